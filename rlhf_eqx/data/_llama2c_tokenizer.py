"""The tokenizer of Karpathy's llama2.c (`tokenizer.bin`)."""

import heapq
import os
import re
import struct
from collections.abc import Sequence

from ._errors import DataError
from ._tokenizer import TokenIds, int_ids

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
    `decode(encode(s)) == s`. `stop_ids` is `(eos_id,)`: no end-of-turn token.

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
        self.stop_ids: tuple[int, ...] = (eos_id,)  # no end-of-turn token

    @classmethod
    def from_file(
        cls, path: str | os.PathLike, *, vocab_size: int | None = None
    ) -> "Llama2cTokenizer":
        """Read a llama2.c `tokenizer.bin`.

        The file does not store its number of pieces (llama2.c takes it from the model
        checkpoint), so a file cut short on a piece boundary still parses. Two checks
        catch it: the header's `max_token_length` is the length of the longest piece
        (llama2.c's exporter writes exactly that), so a file whose longest piece is
        shorter has lost pieces; and, when `vocab_size` is given (the model's), the
        number of pieces must equal it.

        **Raises:** `DataError` naming the file, for a truncated or corrupt file.
        """
        name = os.fspath(path)
        if os.path.isdir(name):
            raise DataError(f"{name}: is a directory, not a llama2.c tokenizer file")
        with open(name, "rb") as f:
            data = f.read()
        if len(data) < 4:
            raise DataError(f"{name}: too short for a llama2.c tokenizer")
        (max_token_length,) = struct.unpack_from("<i", data, 0)
        if max_token_length < 1:
            raise DataError(f"{name}: bad header, max_token_length={max_token_length}")
        offset = 4
        pieces, scores = [], []
        while offset < len(data):
            if offset + 8 > len(data):
                raise DataError(f"{name}: truncated at byte {offset}")
            score, length = struct.unpack_from("<fi", data, offset)
            offset += 8
            if length < 0 or offset + length > len(data):
                raise DataError(f"{name}: bad piece length {length} at byte {offset}")
            if length > max_token_length:
                raise DataError(
                    f"{name}: piece {len(pieces)} has {length} bytes, more than the header's "
                    f"max_token_length={max_token_length}"
                )
            pieces.append(data[offset : offset + length])
            scores.append(score)
            offset += length
        longest = max((len(p) for p in pieces), default=0)
        if longest != max_token_length:
            raise DataError(
                f"{name}: the header promises pieces of up to {max_token_length} bytes but the "
                f"longest of the {len(pieces)} pieces read has {longest}: the file is truncated"
            )
        if vocab_size is not None and len(pieces) != vocab_size:
            raise DataError(
                f"{name}: {len(pieces)} pieces read but the vocabulary has {vocab_size}: "
                "the file is truncated or belongs to another model"
            )
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
        for t in int_ids(ids, self.vocab_size):
            if t == self.bos_id:
                at_start = True
                continue
            if t in self._special:
                continue
            piece = self._decoded[t]
            if at_start and self.pieces[t].startswith(b" "):
                piece = piece[1:]
            at_start = False
            out += piece
        return out.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"Llama2cTokenizer(vocab_size={self.vocab_size})"
