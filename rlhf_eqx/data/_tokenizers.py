"""Tokenizers: one small protocol and four implementations.

Every tokenizer maps text to a list of ids *without* special tokens; the batching code
(`tokenize_preferences`, `tokenize_sft`, `tokenize_prompts`) adds BOS/EOS itself, so
the same text encodes to the same ids whichever way it is later assembled.

| class | file | dependency |
| --- | --- | --- |
| `Llama2cTokenizer` | llama2.c `tokenizer.bin` | none |
| `SentencePieceTokenizer` | sentencepiece `.model` | `sentencepiece` |
| `HFTokenizer` | Hugging Face `tokenizer.json` | `tokenizers` |
| `ByteTokenizer` | — (UTF-8 bytes) | none |

`load_tokenizer(path)` picks the class from the file name (or the files in a
directory).
"""

import heapq
import json
import os
import re
import struct
from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np
from jaxtyping import Array, Int

from ._errors import DataError

__all__ = [
    "Tokenizer",
    "Llama2cTokenizer",
    "SentencePieceTokenizer",
    "HFTokenizer",
    "ByteTokenizer",
    "load_tokenizer",
    "check_vocab",
]


# Ids to decode: a list/tuple of ints or a 1-D numpy/jax integer array.
TokenIds = Iterable[int] | Int[np.ndarray, " _n"] | Int[Array, " _n"]


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer.

    - `encode(text) -> list[int]`: ids of `text`, with no BOS/EOS added.
    - `decode(ids) -> str`: text of `ids` (any iterable of ints, numpy or jax arrays
      included); BOS, EOS and padding ids are skipped.
    - `bos_id`, `eos_id`, `pad_id`: special ids (`pad_id` only needs to be a valid id:
      padded positions are always masked).
    - `vocab_size`: number of ids; every id produced is in `[0, vocab_size)`.
    """

    @property
    def bos_id(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: TokenIds) -> str: ...


def check_vocab(tokenizer: Tokenizer, vocab_size: int) -> None:
    """Refuse a tokenizer whose ids do not all fit a model's vocabulary.

    A model's embedding has `vocab_size` rows; an id at or past it gives NaN logits
    (or, negative, silently wraps around). A tokenizer may have *fewer* ids than the
    model (vocabularies are often padded to a multiple of 64), never more.

    **Arguments:**

    - `tokenizer`: any `Tokenizer`.
    - `vocab_size`: the model's vocabulary size (`TransformerConfig.vocab_size`).

    **Raises:** `DataError` naming both sizes (or the special id that does not fit).
    """
    if vocab_size < 1:
        raise DataError(f"vocab_size must be positive, got {vocab_size}")
    if tokenizer.vocab_size > vocab_size:
        raise DataError(
            f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary has "
            f"only {vocab_size}: ids {vocab_size}..{tokenizer.vocab_size - 1} would be "
            "outside the model's embedding"
        )
    for name in ("bos_id", "eos_id", "pad_id"):
        value = getattr(tokenizer, name)
        if not 0 <= value < vocab_size:
            raise DataError(
                f"the tokenizer's {name}={value} is outside the model's vocabulary "
                f"[0, {vocab_size})"
            )


def _int_ids(ids: TokenIds) -> list[int]:
    """Plain Python ints from a list, tuple, numpy or jax array of ids."""
    return [int(i) for i in ids]


# ----------------------------------------------------------------------------------------
# llama2.c
# ----------------------------------------------------------------------------------------

_BYTE_PIECE = re.compile(rb"<0x([0-9A-Fa-f]{2})>")
# A piece with a non-space byte followed by a space could be formed across the
# boundary before a space; when the vocabulary has none, text can be encoded one
# space-delimited chunk at a time (and chunks cached) with exactly the same result.
_CROSSES_SPACE = re.compile(rb"[^ ] ")
_CHUNK = re.compile(rb" *[^ ]*")
_MIN_SCORE = -1e10  # llama2.c's initial best score: pieces scoring below never merge
_CACHE_SIZE = 1 << 16


class Llama2cTokenizer:
    """The tokenizer of Karpathy's llama2.c (`tokenizer.bin`), encoding exactly as its
    `encode` does.

    **File format:** int32 `max_token_length`, then for each of the `vocab_size`
    pieces: float32 score, int32 byte length, the piece's bytes. Id 0 is `<unk>` (used
    as padding), 1 is BOS, 2 is EOS, ids 3–258 are the byte-fallback pieces `<0xNN>`.

    **Encoding** (llama2.c `encode`, which reproduces sentencepiece BPE):

    1. prepend the dummy-prefix space `" "` (non-empty text only), as sentencepiece
       does;
    2. look up each UTF-8 character (a lead byte and up to three continuation bytes)
       as a piece; a character that is not a piece becomes its bytes' fallback ids
       (`<0xNN>`, id = byte + 3);
    3. repeatedly merge the adjacent pair whose concatenated piece exists and has the
       highest score (the leftmost pair on ties), until no pair merges.

    Step 3 is the same greedy rule as llama2.c's quadratic loop, run with a heap and a
    linked list (O(n log n)); when no vocabulary piece contains a non-space byte
    followed by a space, merges never cross the start of a space-delimited chunk and
    each chunk is encoded (and cached) separately, which gives identical ids.

    **Decoding:** byte pieces back to bytes, the leading space of the first piece of
    the text (and of the first piece after a BOS) removed — the dummy prefix — and
    invalid UTF-8 replaced (`errors="replace"`). BOS, EOS and padding are skipped, so
    `decode(encode(s)) == s`.

    Reference: A. Karpathy, llama2.c, `run.c` (`encode`, `decode`); T. Kudo and
    J. Richardson, "SentencePiece", EMNLP 2018.
    """

    def __init__(
        self,
        pieces: Sequence[bytes],
        scores: Sequence[float],
        *,
        bos_id: int = 1,
        eos_id: int = 2,
        pad_id: int = 0,
    ):
        if len(pieces) != len(scores):
            raise DataError(f"{len(pieces)} pieces but {len(scores)} scores")
        self.pieces: tuple[bytes, ...] = tuple(bytes(p) for p in pieces)
        self.scores: tuple[float, ...] = tuple(float(s) for s in scores)
        self.vocab_size: int = len(self.pieces)
        for name, value in (("bos_id", bos_id), ("eos_id", eos_id), ("pad_id", pad_id)):
            if not 0 <= value < self.vocab_size:
                raise DataError(f"{name}={value} is outside the vocabulary of {self.vocab_size}")
        self.bos_id: int = bos_id
        self.eos_id: int = eos_id
        self.pad_id: int = pad_id
        # llama2.c sorts the vocabulary and binary-searches it; pieces are unique in
        # the files it ships, and for duplicates the first id is used here.
        self._piece_to_id: dict[bytes, int] = {}
        for i, p in enumerate(self.pieces):
            self._piece_to_id.setdefault(p, i)
        self._byte_ids: tuple[int, ...] = tuple(
            self._piece_to_id.get(b"<0x%02X>" % b, b + 3) for b in range(256)
        )
        decoded = []
        for p in self.pieces:
            m = _BYTE_PIECE.fullmatch(p)
            decoded.append(bytes([int(m.group(1), 16)]) if m else p)
        self._decoded: tuple[bytes, ...] = tuple(decoded)
        self._chunked: bool = not any(_CROSSES_SPACE.search(p) for p in self.pieces)
        self._cache: dict[bytes, list[int]] = {}
        self._special: frozenset[int] = frozenset((bos_id, eos_id, pad_id))

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "Llama2cTokenizer":
        """Read a llama2.c `tokenizer.bin` (vocabulary size = number of pieces stored)."""
        with open(path, "rb") as f:
            data = f.read()
        if len(data) < 4:
            raise DataError(f"{os.fspath(path)}: too short for a llama2.c tokenizer")
        offset = 4  # int32 max_token_length, not needed here
        pieces, scores = [], []
        while offset < len(data):
            if offset + 8 > len(data):
                raise DataError(f"{os.fspath(path)}: truncated at byte {offset}")
            score, length = struct.unpack_from("<fi", data, offset)
            offset += 8
            if length < 0 or offset + length > len(data):
                raise DataError(f"{os.fspath(path)}: bad piece length {length} at byte {offset}")
            pieces.append(data[offset : offset + length])
            scores.append(score)
            offset += length
        return cls(pieces, scores)

    def encode(self, text: str) -> list[int]:
        data = text.encode("utf-8", errors="surrogatepass")
        if not data:
            return []
        data = b" " + data  # sentencepiece's dummy prefix
        if not self._chunked:
            return self._merge(self._symbols(data))
        out: list[int] = []
        cache = self._cache
        for match in _CHUNK.finditer(data):
            chunk = match.group()
            if not chunk:
                continue
            ids = cache.get(chunk)
            if ids is None:
                ids = self._merge(self._symbols(chunk))
                if len(cache) >= _CACHE_SIZE:
                    cache.clear()
                cache[chunk] = ids
            out.extend(ids)
        return out

    def _symbols(self, data: bytes) -> list[int]:
        """Initial ids: one per UTF-8 character, or its bytes' fallback ids."""
        out: list[int] = []
        n = len(data)
        i = 0
        while i < n:
            j = i + 1
            while j < n and (data[j] & 0xC0) == 0x80 and j - i < 4:
                j += 1
            char = data[i:j]
            piece_id = self._piece_to_id.get(char)
            if piece_id is None:
                out.extend(self._byte_ids[b] for b in char)
            else:
                out.append(piece_id)
            i = j
        return out

    def _merge(self, ids: list[int]) -> list[int]:
        """Best-score-first pair merging (ties: leftmost), as llama2.c's loop."""
        n = len(ids)
        if n < 2:
            return list(ids)
        pieces, scores, lookup = self.pieces, self.scores, self._piece_to_id
        cur = list(ids)
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        alive = [True] * n
        heap: list[tuple[float, int, int, int, int, int]] = []
        # Heap entries (−score, left position, right position, left id, right id, merged
        # id): positions keep their left-to-right order, so the heap pops the best score
        # and, on ties, the leftmost pair. (The pair-pushing code is written out twice
        # rather than in a helper: this loop is the tokenizer's hot path.)
        for i in range(n - 1):
            merged = lookup.get(pieces[cur[i]] + pieces[cur[i + 1]])
            if merged is not None and scores[merged] > _MIN_SCORE:
                heap.append((-scores[merged], i, i + 1, cur[i], cur[i + 1], merged))
        heapq.heapify(heap)
        while heap:
            _, i, j, left, right, merged = heapq.heappop(heap)
            if not alive[i] or nxt[i] != j or cur[i] != left or cur[j] != right:
                continue  # stale: one side has merged since this pair was pushed
            cur[i] = merged
            alive[j] = False
            nxt[i] = nxt[j]
            if nxt[j] >= 0:
                prv[nxt[j]] = i
            for a in (prv[i], i):
                b = nxt[a] if a >= 0 else -1
                if b < 0:
                    continue
                m = lookup.get(pieces[cur[a]] + pieces[cur[b]])
                if m is not None and scores[m] > _MIN_SCORE:
                    heapq.heappush(heap, (-scores[m], a, b, cur[a], cur[b], m))
        out = []
        i = 0
        while i >= 0:
            out.append(cur[i])
            i = nxt[i]
        return out

    def decode(self, ids: TokenIds) -> str:
        out = bytearray()
        at_start = True
        for t in _int_ids(ids):
            if t == self.bos_id:
                at_start = True
                continue
            if t in self._special:
                continue
            if not 0 <= t < self.vocab_size:
                raise DataError(f"id {t} is outside the vocabulary of {self.vocab_size}")
            piece = self._decoded[t]
            if at_start and self.pieces[t].startswith(b" "):
                piece = piece[1:]
            at_start = False
            out += piece
        return out.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"Llama2cTokenizer(vocab_size={self.vocab_size})"


# ----------------------------------------------------------------------------------------
# sentencepiece
# ----------------------------------------------------------------------------------------


class SentencePieceTokenizer:
    """A sentencepiece model (`.model`, e.g. Llama 1/2, Mistral, Gemma).

    BOS/EOS/padding are the model's own ids; a model without a padding piece pads with
    the unknown-piece id (padding is always masked). `decode` skips BOS, EOS and the
    padding piece (when the model has one).
    """

    def __init__(self, processor):
        self.processor = processor
        self.vocab_size: int = int(processor.get_piece_size())
        bos, eos, pad, unk = (
            int(processor.bos_id()),
            int(processor.eos_id()),
            int(processor.pad_id()),
            int(processor.unk_id()),
        )
        if eos < 0:
            raise DataError("the sentencepiece model has no EOS piece")
        self.eos_id: int = eos
        self.bos_id: int = bos if bos >= 0 else eos
        self.pad_id: int = pad if pad >= 0 else max(unk, 0)
        self._skip: frozenset[int] = frozenset(
            {self.bos_id, self.eos_id} | ({pad} if pad >= 0 else set())
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "SentencePieceTokenizer":
        import sentencepiece as spm

        return cls(spm.SentencePieceProcessor(model_file=os.fspath(path)))

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.processor.encode(text, out_type=int)]

    def decode(self, ids: TokenIds) -> str:
        return self.processor.decode([i for i in _int_ids(ids) if i not in self._skip])

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer(vocab_size={self.vocab_size})"


# ----------------------------------------------------------------------------------------
# Hugging Face tokenizers
# ----------------------------------------------------------------------------------------

_BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>", "<|endoftext|>", "[CLS]")
_EOS_CANDIDATES = ("</s>", "<|end_of_text|>", "<eos>", "<|endoftext|>", "<|im_end|>", "[SEP]")
_PAD_CANDIDATES = ("<pad>", "[PAD]", "<|pad|>", "<|finetune_right_pad_id|>")


def _token_content(value: object) -> str | None:
    """`"<s>"` or `{"content": "<s>", ...}` (tokenizer_config.json) -> `"<s>"`."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer (`tokenizer.json`).

    `encode` never adds the post-processor's special tokens. Special tokens are named
    by the `bos_token` / `eos_token` / `pad_token` arguments of `from_file`, else by a
    `tokenizer_config.json` beside the file, else by the usual names (`<s>`, `</s>`,
    `<|endoftext|>`, `<pad>`, ...); padding falls back to EOS.
    """

    def __init__(self, tokenizer, *, bos_token: str, eos_token: str, pad_token: str | None = None):
        self.tokenizer = tokenizer
        self.vocab_size: int = int(tokenizer.get_vocab_size(with_added_tokens=True))

        def token_id(token: str) -> int:
            i = tokenizer.token_to_id(token)
            if i is None:
                raise DataError(f"special token {token!r} is not in the vocabulary")
            return int(i)

        self.bos_id: int = token_id(bos_token)
        self.eos_id: int = token_id(eos_token)
        self.pad_id: int = token_id(pad_token) if pad_token is not None else self.eos_id
        self._skip: frozenset[int] = frozenset((self.bos_id, self.eos_id, self.pad_id))

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
    ) -> "HFTokenizer":
        from tokenizers import Tokenizer as _HFTok

        path = os.fspath(path)
        tok = _HFTok.from_file(path)
        config_path = os.path.join(os.path.dirname(path), "tokenizer_config.json")
        config: dict = {}
        if os.path.isfile(config_path):
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        vocab = tok.get_vocab(with_added_tokens=True)

        def resolve(given: str | None, key: str, candidates: tuple[str, ...]) -> str | None:
            if given is not None:
                return given
            named = _token_content(config.get(key))
            if named is not None:
                return named
            return next((c for c in candidates if c in vocab), None)

        bos = resolve(bos_token, "bos_token", _BOS_CANDIDATES)
        eos = resolve(eos_token, "eos_token", _EOS_CANDIDATES)
        pad = resolve(pad_token, "pad_token", _PAD_CANDIDATES)
        if eos is None:
            raise DataError(f"{path}: cannot tell the EOS token; pass eos_token=...")
        return cls(tok, bos_token=bos if bos is not None else eos, eos_token=eos, pad_token=pad)

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False).ids]

    def decode(self, ids: TokenIds) -> str:
        kept = [i for i in _int_ids(ids) if i not in self._skip]
        return self.tokenizer.decode(kept, skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size})"


# ----------------------------------------------------------------------------------------
# bytes
# ----------------------------------------------------------------------------------------


class ByteTokenizer:
    """UTF-8 bytes as tokens; no files, no dependencies.

    Ids: padding 0, BOS 1, EOS 2, byte `b` → `b + 3` (the same layout as llama2.c's
    byte-fallback pieces); `vocab_size` = 259. Decoding replaces invalid UTF-8.
    """

    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    vocab_size: int = 259

    def encode(self, text: str) -> list[int]:
        return [b + 3 for b in text.encode("utf-8", errors="surrogatepass")]

    def decode(self, ids: TokenIds) -> str:
        kept = [i for i in _int_ids(ids) if i >= 3]
        if any(i >= self.vocab_size for i in kept):
            raise DataError(f"ids outside the vocabulary of {self.vocab_size}")
        return bytes(i - 3 for i in kept).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load a tokenizer, choosing the class from the file type.

    `*.json` → `HFTokenizer`, `*.model` → `SentencePieceTokenizer`, `*.bin` →
    `Llama2cTokenizer`; a directory is searched for `tokenizer.json`,
    `tokenizer.model`, `tokenizer.bin` (in that order).
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        for name in ("tokenizer.json", "tokenizer.model", "tokenizer.bin"):
            candidate = os.path.join(path, name)
            if os.path.isfile(candidate):
                return load_tokenizer(candidate)
        raise DataError(f"{path}: no tokenizer.json, tokenizer.model or tokenizer.bin")
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such tokenizer file")
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".json":
        return HFTokenizer.from_file(path)
    if suffix == ".model":
        return SentencePieceTokenizer.from_file(path)
    if suffix == ".bin":
        return Llama2cTokenizer.from_file(path)
    raise DataError(f"{path}: unknown tokenizer file type (expected .json, .model or .bin)")


def decode_continuation(tokenizer: Tokenizer, prompt_ids: TokenIds, completion_ids: TokenIds) -> str:
    """The text that `completion_ids` add after `prompt_ids`.

    Decoding a completion on its own drops the leading space of its first piece
    (SentencePiece-style tokenizers strip the dummy prefix at the start of a text), so
    `prompt + decode(completion)` can glue two words together. This decodes prompt and
    completion together and cuts the prompt's text off, so that
    `decode(prompt_ids) + decode_continuation(...)` is the decoded sequence. Falls back to
    decoding the completion alone when the joint text does not start with the prompt's
    text (byte-fallback pieces split across the boundary).
    """
    prompt = _int_ids(prompt_ids)
    completion = _int_ids(completion_ids)
    head = tokenizer.decode(prompt)
    full = tokenizer.decode(prompt + completion)
    if full.startswith(head):
        return full[len(head) :]
    return tokenizer.decode(completion)
