"""`add_tokenizer_metadata`: a tokenizer written as a GGUF file's `tokenizer.ggml.*`
metadata, the inverse of `tokenizer_from_gguf`."""

import json
import re

from ._errors import DataError
from ._gguf_tokenizer import CONTROL, END_OF_TURN_KEYS, USER_DEFINED, split_pre_tokenizer
from ._hf_tokenizer import HFTokenizer
from ._llama2c_tokenizer import Llama2cTokenizer
from ._sentencepiece_tokenizer import SentencePieceTokenizer

NORMAL, UNKNOWN, UNUSED, BYTE = 1, 2, 5, 6
# the name llama.cpp knows each family of split expressions by
_PRE_NAMES = {"smollm": "smollm", "llama3": "llama-bpe", "qwen2": "qwen2", "gpt2": "gpt-2"}
_PRE_NAMES["default"] = "default"
# text on which the pre-tokenizers of `_SPLITS` all split differently
_PROBE = "Hello, world! It's 12345 ½ don't DON'T  x\n\n1. a  \t b\r\n中文 🙂 $+<=>^~| end  "
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _pre_name(pre_tokenizer) -> str | None:
    """The llama.cpp pre-tokenizer name whose splitting `pre_tokenizer` reproduces on
    `_PROBE` (as byte-level pieces), or `None`."""
    if pre_tokenizer is None:
        return None
    pieces = [p for p, _ in pre_tokenizer.pre_tokenize_str(_PROBE)]
    for key in ("smollm", "llama3", "qwen2", "gpt2", "default"):
        if pieces == [p for p, _ in split_pre_tokenizer(key).pre_tokenize_str(_PROBE)]:
            return _PRE_NAMES[key]
    return None


def _hf_tokens(tok: HFTokenizer):
    """`(tokenizer json, tokens by id, token types)` of an `HFTokenizer`."""
    spec = json.loads(tok.tokenizer.to_str())
    model = spec.get("model") or {}
    n = tok.vocab_size
    tokens: list[str | None] = [None] * n
    types = [NORMAL] * n
    for t, i in (model.get("vocab") or {}).items():
        if 0 <= i < n:
            tokens[i] = t
    for added in spec.get("added_tokens") or ():
        i = added["id"]
        tokens[i] = added["content"]
        types[i] = CONTROL if added.get("special") else USER_DEFINED
    missing = [i for i, t in enumerate(tokens) if t is None]
    if missing:
        raise DataError(f"add_tokenizer_metadata: the tokenizer has no token with id {missing[0]}")
    return spec, tokens, types


def _merges(model) -> list[str]:
    return [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or ()]


def _padded(tokens: list, types: list, scores: list | None, n: int | None):
    """The vocabulary padded to `n` ids with `[PAD{i}]` tokens of type unused (score
    -1000), as llama.cpp's converter pads a vocabulary smaller than the embedding."""
    extra = range(len(tokens), n or 0)
    tokens = [*tokens, *(f"[PAD{i}]" for i in extra)]
    types = [*types, *(UNUSED for _ in extra)]
    return tokens, types, None if scores is None else [*scores, *(-1000.0 for _ in extra)]


def _written_vocab_size(writer) -> int | None:
    """`{arch}.vocab_size` if it was already added to `writer` (the model's metadata is
    written before the tokenizer's), else `None`."""
    key = f"{getattr(writer, 'arch', None)}.vocab_size"
    kv = getattr(writer, "kv_data", None)
    for part in kv if isinstance(kv, list) else [kv] if isinstance(kv, dict) else []:
        value = getattr(part.get(key), "value", None)
        if isinstance(value, int):
            return value
    return None


def _write_hf(writer, tok: HFTokenizer, n: int | None) -> None:
    spec, tokens, types = _hf_tokens(tok)
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise DataError(
            f"add_tokenizer_metadata: a {model.get('type')} tokenizers model cannot be written "
            "as GGUF (byte-level or sentencepiece-style BPE)"
        )
    pre_tokenizer = tok.tokenizer.pre_tokenizer
    if model.get("byte_fallback"):  # sentencepiece-style: scores from the merge ranks
        rank: dict[str, int] = {}
        for r, m in enumerate(_merges(model)):
            rank.setdefault(m.replace(" ", ""), r)
        last = len(rank) + len(tokens)
        scores = [-float(rank.get(t, last + i)) for i, t in enumerate(tokens)]
        for i, t in enumerate(tokens):
            if types[i] == NORMAL and _BYTE_PIECE.fullmatch(t):
                types[i] = BYTE
        unk = model.get("unk_token")
        if unk is not None:
            types[tokens.index(unk)] = UNKNOWN
        prefix = (
            '"Prepend"' in json.dumps(spec.get("normalizer"))
            or '"first"' in json.dumps(spec.get("pre_tokenizer"))
            or '"always"' in json.dumps(spec.get("pre_tokenizer"))
        )
        unk_id = tokens.index(unk) if unk else None
        _write_llama(writer, tokens, scores, types, tok, unk_id, n)
        writer.add_add_space_prefix(prefix)
        return
    name = _pre_name(pre_tokenizer)
    if name is None:
        raise DataError(
            "add_tokenizer_metadata: the tokenizer's pre-tokenizer splits text as none of "
            f"llama.cpp's {sorted(_PRE_NAMES.values())} do; it cannot be written as GGUF"
        )
    if name == _PRE_NAMES["llama3"] and not model.get("ignore_merges"):
        name = "smaug-bpe"  # Llama 3's splits without its whole-piece rule (`LLAMA3_RULES`)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(name)
    padded, padded_types, _ = _padded(tokens, types, None, n)
    writer.add_token_list(padded)
    writer.add_token_types(padded_types)
    writer.add_token_merges(_merges(model))
    unk = model.get("unk_token")
    _write_ids(writer, tok, tokens.index(unk) if unk is not None else None)
    writer.add_add_space_prefix(False)


def _write_ids(writer, tok, unk_id: int | None) -> None:
    writer.add_bos_token_id(tok.bos_id)
    writer.add_eos_token_id(tok.eos_id)
    writer.add_pad_token_id(tok.pad_id)
    if unk_id is not None:
        writer.add_unk_token_id(unk_id)
    ends = [i for i in getattr(tok, "stop_ids", ()) if i != tok.eos_id]
    for key, i in zip(END_OF_TURN_KEYS, ends):  # a third end-of-turn id has no key
        writer.add_uint32(f"tokenizer.ggml.{key}", int(i))
    writer.add_add_bos_token(bool(getattr(tok, "add_bos_token", True)))


def _write_llama(writer, tokens, scores, types, tok, unk_id, n) -> None:
    tokens, types, scores = _padded(tokens, types, scores, n)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    _write_ids(writer, tok, unk_id)


def _write_llama2c(writer, tok: Llama2cTokenizer, n: int | None) -> None:
    tokens, types = [], []
    for i, piece in enumerate(tok.pieces):
        try:
            text = piece.decode("utf-8")
        except UnicodeDecodeError:
            raise DataError(
                f"add_tokenizer_metadata: llama2.c piece {i} ({piece!r}) is not valid UTF-8"
            ) from None
        tokens.append(text.replace(" ", "▁"))
        if i in (tok.bos_id, tok.eos_id):
            types.append(CONTROL)
        elif _BYTE_PIECE.fullmatch(text):
            types.append(BYTE)
        elif i == 0:
            types.append(UNKNOWN)
        else:
            types.append(NORMAL)
    _write_llama(writer, tokens, list(tok.scores), types, tok, 0, n)
    writer.add_add_space_prefix(True)


def _write_sentencepiece(writer, tok: SentencePieceTokenizer, n: int | None) -> None:
    sp = tok.processor
    tokens, scores, types = [], [], []
    for i in range(tok.vocab_size):
        tokens.append(sp.id_to_piece(i))
        scores.append(float(sp.get_score(i)))
        types.append(
            UNKNOWN
            if sp.is_unknown(i)
            else CONTROL
            if sp.is_control(i)
            else BYTE
            if sp.is_byte(i)
            else UNUSED
            if sp.is_unused(i)
            else NORMAL
        )
    unk = int(sp.unk_id())
    _write_llama(writer, tokens, scores, types, tok, unk if unk >= 0 else None, n)
    writer.add_add_space_prefix(True)


def add_tokenizer_metadata(
    writer, tokenizer, chat_template: str | None = None, *, vocab_size: int | None = None
) -> None:
    """Write a tokenizer as GGUF metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`),
    as llama.cpp reads it; `tokenizer_from_gguf` on the written file encodes as
    `tokenizer` does.

    **Arguments:**

    - `writer`: a `gguf.GGUFWriter`, before its key-value data is written.
    - `tokenizer`: an `HFTokenizer` over a byte-level BPE model (written as `gpt2`: its
      tokens, token types — added special tokens as control, other added tokens as
      user-defined — merges, and the name of the llama.cpp pre-tokenizer that splits
      text as its pre-tokenizer does, found by comparing their splits of a probe text;
      Llama 3's splits are `llama-bpe` when the model takes whole pieces first, as Llama
      3's does (`ignore_merges`), else `smaug-bpe`)
      or over a sentencepiece-style BPE model (`byte_fallback`; written as `llama`, with
      each token's score minus the rank of the first merge that makes it); a
      `Llama2cTokenizer` or `SentencePieceTokenizer` (written as `llama`: tokens with
      `▁` for spaces, scores and types).
    - `chat_template`: the jinja2 chat template; default: the tokenizer's own
      `chat_template` attribute when it has one.
    - `vocab_size`: the model's vocabulary (rows of `token_embd.weight`); default: the
      `{arch}.vocab_size` already added to `writer`, if any. llama.cpp reads one token
      per embedding row, so a smaller vocabulary is padded with `[PAD{i}]` tokens of
      type unused, as llama.cpp's `convert_hf_to_gguf.py` pads it.

    BOS, EOS and padding ids are written from the tokenizer, with `add_bos_token` (the
    tokenizer's attribute, default true) and `add_space_prefix`; the end-of-turn ids
    of its `stop_ids` (those besides EOS) as `tokenizer.ggml.eot_token_id` and a second
    as `eom_token_id` (llama.cpp has no key for more).

    **Raises:** `DataError` naming the tokenizer type (or pre-tokenizer) that cannot be
    written, or both sizes when the tokenizer has more ids than `vocab_size`.
    """
    n = vocab_size if vocab_size is not None else _written_vocab_size(writer)
    if n is not None and tokenizer.vocab_size > n:
        raise DataError(
            f"add_tokenizer_metadata: the tokenizer has {tokenizer.vocab_size} ids but the "
            f"model's vocabulary has {n}"
        )
    if isinstance(tokenizer, HFTokenizer):
        _write_hf(writer, tokenizer, n)
    elif isinstance(tokenizer, Llama2cTokenizer):
        _write_llama2c(writer, tokenizer, n)
    elif isinstance(tokenizer, SentencePieceTokenizer):
        _write_sentencepiece(writer, tokenizer, n)
    else:
        raise DataError(
            f"add_tokenizer_metadata: a {type(tokenizer).__name__} cannot be written as GGUF "
            "tokenizer metadata (HFTokenizer, Llama2cTokenizer or SentencePieceTokenizer)"
        )
    template = (
        chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    )
    if template:
        writer.add_chat_template(template)
