"""Tokenizers from the metadata of a llama.cpp GGUF file (`tokenizer.ggml.*`).

A GGUF file carries no `tokenizer.json`: it stores the vocabulary (`tokens`, and
`token_type`, `scores` or `merges`), the special ids, the name of the pre-tokenizer
(`tokenizer.ggml.pre`) and the chat template as metadata. `tokenizer_from_gguf` rebuilds
the tokenizer they describe as a Hugging Face `tokenizers.Tokenizer`:

- `tokenizer.ggml.model = "gpt2"`: byte-level BPE with the file's merges, text split
  first by the regular expressions llama.cpp's `llama-vocab.cpp` uses for the named
  pre-tokenizer (`_PRE_SPLITS`; a file without one gets llama.cpp's `default`), then
  mapped to the byte alphabet of GPT-2. For `smollm` (digits split one by one, then
  GPT-2's expression, as SmolLM2's own `tokenizer.json`) this differs from
  `transformers`' GGUF loader, which skips the digit split: where whitespace precedes a
  numeric character (`"\\n\\n1."` is `ĊĊ 1 .` here and in llama.cpp, `Ċ Ċ 1 .` there;
  4 of 216 test texts).
  For Llama 3's pre-tokenizers (`LLAMA3_RULES`) a piece that is itself a token is
  that token, whatever the merges (llama.cpp's `ignore_merges`, `tokenizers`'
  `BPE(ignore_merges=True)`, as Llama 3's own `tokenizer.json`).
- `tokenizer.ggml.model = "llama"`: sentencepiece-style BPE (spaces as `▁`, one put
  before each run of text when `add_space_prefix`, as llama.cpp does; unknown
  characters as their `<0xNN>` byte tokens), the merges recovered from the scores as
  `transformers`' GGUF converter does (every split of a token into two tokens, ranked by
  the token's score: the sentencepiece rule of merging the best-scoring pair first).

Tokens of type 3 (control) are added as special tokens and of type 4 (user-defined) as
plain added tokens, so both encode as one id wherever they appear in the text (llama.cpp's
`parse_special=true`).

References: G. Gerganov et al., llama.cpp, `src/llama-vocab.cpp` (pre-tokenizer regexes,
`llm_tokenizer_bpe`, `llm_tokenizer_spm`); `transformers`,
`integrations/gguf/gguf_tokenizer_mapping.py`.
"""

import os

from ._errors import DataError
from ._hf_tokenizer import HFTokenizer

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp applies each expression in turn to the pieces the previous ones left, keeping
# both the matches and the text between them (`tokenizers`' `Split(..., "isolated")`).
_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt2": (_GPT2,),
    "llama3": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "smollm": (r"\p{N}", _GPT2),
}
_PRE_SPLITS: dict[str, str] = {
    "default": "default",
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"), "llama3"),
    **dict.fromkeys(("dbrx", "smaug-bpe", "midm-2.0", "lfm2", "falcon-h1"), "llama3"),
    **dict.fromkeys(("qwen2", "qwen2.5", "deepseek-r1-qwen", "megrez"), "qwen2"),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell"), "smollm"),
    **dict.fromkeys(("exaone", "minerva-7b"), "smollm"),
    **dict.fromkeys(("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "trillion"), "gpt2"),
}
# the pre-tokenizers for which llama.cpp takes a piece that is a token as that one token,
# before any merge (`ignore_merges`), and adds BOS when the file does not say
# (`tokenizer.ggml.add_bos_token`): Llama 3's and the vocabularies built like it
LLAMA3_RULES = frozenset(
    ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2")
)
CONTROL, USER_DEFINED = 3, 4
_SPECIAL_KEYS = ("bos_token_id", "eos_token_id", "padding_token_id", "unknown_token_id")
# the end-of-turn ids llama.cpp stops generation at besides EOS (`llama_vocab::is_eog`):
# Gemma's `<end_of_turn>`, Llama 3's `<|eot_id|>` and `<|eom_id|>`
END_OF_TURN_KEYS = ("eot_token_id", "eom_token_id")


def byte_alphabet() -> dict[int, str]:
    """GPT-2's map from each byte to the printable character that spells it."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def split_pre_tokenizer(name: str):
    """The `tokenizers` pre-tokenizer of a byte-level vocabulary whose text llama.cpp
    splits with the expressions named `name` (a key of `_SPLITS`)."""
    from tokenizers import Regex, pre_tokenizers

    steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _SPLITS[name]]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)


def _open(reader, path):
    if isinstance(reader, str | os.PathLike):
        from ..models import open_gguf

        path = os.fspath(reader)
        if not os.path.isfile(path):
            raise DataError(f"{path}: no such GGUF file")
        try:  # a truncated or unreadable file: one line naming the file and the part
            reader = open_gguf(path)
        except (OSError, ValueError) as e:
            raise DataError(str(e)) from None
    if path is None:  # a reader's memory map knows its file
        path = getattr(getattr(reader, "data", None), "filename", None) or "<gguf>"
    return reader, os.fspath(path)


_NUMBER = (int, float)
# what llama.cpp reads under each key: a string, an integer, a bool, or a list of one kind
_KINDS: dict[str, tuple[type | tuple[type, ...], bool]] = {
    "tokenizer.ggml.model": (str, False),
    "tokenizer.ggml.pre": (str, False),
    "tokenizer.chat_template": (str, False),
    "tokenizer.ggml.tokens": (str, True),
    "tokenizer.ggml.merges": (str, True),
    "tokenizer.ggml.token_type": (int, True),
    "tokenizer.ggml.scores": (_NUMBER, True),
    "tokenizer.ggml.add_bos_token": (bool, False),
    "tokenizer.ggml.add_space_prefix": (bool, False),
    **{f"tokenizer.ggml.{k}": (int, False) for k in _SPECIAL_KEYS + END_OF_TURN_KEYS},
}
_KIND_NAMES = {str: ("a string", "strings"), int: ("an integer", "integers"),
               bool: ("a bool", "bools"), _NUMBER: ("a number", "numbers")}  # fmt: skip


def _field(reader, key: str, path: str):
    """The value of `key` (`None` when absent), checked against the type llama.cpp reads
    there (`_KINDS`); another type, or a string that is not UTF-8, is a `DataError`
    naming the file and the key (and the list entry)."""
    field = reader.fields.get(key)
    if field is None:
        return None
    try:
        value = field.contents()
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: {key}{_undecodable_entry(field)} is not UTF-8: {e}") from None
    kind, is_list = _KINDS[key]
    items = value if is_list and isinstance(value, list) else [value]
    bad = (is_list and not isinstance(value, list)) or any(
        not isinstance(v, kind) or (kind is not bool and isinstance(v, bool)) for v in items
    )
    if bad:
        one, many = _KIND_NAMES[kind]
        want = f"a list of {many}" if is_list else one
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise DataError(f"{path}: {key} = {shown} is not {want}")
    return value


def _undecodable_entry(field) -> str:
    """`[i]`: the first entry of a list of strings that is not UTF-8 (`""` for a string)."""
    from gguf import GGUFValueType

    if field.types[0] != GGUFValueType.ARRAY:
        return ""
    for n, i in enumerate(field.data):
        try:
            bytes(field.parts[i]).decode("utf-8")
        except UnicodeDecodeError:
            return f"[{n}]"
    return ""


def _byte_level_model(tokens, types, merges, unk_id, ignore_merges, path):
    """The byte-level BPE model: ordinary tokens under their byte-alphabet spelling
    (a token outside that alphabet spelled from its UTF-8 bytes), control and
    user-defined tokens under their own text, as llama.cpp's converter writes them
    (DeepSeek's `<｜User｜>`, a user-defined run of spaces): the added tokens of the same
    text then take their ids."""
    from tokenizers import decoders, models

    if merges is None:
        raise DataError(f"{path}: tokenizer.ggml.merges is missing (a gpt2 vocabulary needs it)")
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        added = types is not None and types[i] in (CONTROL, USER_DEFINED)
        as_is = added or set(t) <= alphabet
        vocab.setdefault(t if as_is else "".join(spelling[b] for b in t.encode("utf-8")), i)
    pairs = []
    for i, m in enumerate(merges):
        left, sep, right = m.partition(" ")
        if not sep or left not in vocab or right not in vocab or left + right not in vocab:
            raise DataError(
                f"{path}: tokenizer.ggml.merges[{i}] = {m!r} names a token not in "
                "tokenizer.ggml.tokens"
            )
        pairs.append((left, right))
    unk = tokens[unk_id] if unk_id is not None else None
    model = models.BPE(
        vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=False, ignore_merges=ignore_merges
    )
    return model, decoders.ByteLevel()


def _sentencepiece_model(tokens, scores, types, unk_id, add_space_prefix, path):
    from tokenizers import decoders

    if scores is None:
        raise DataError(f"{path}: tokenizer.ggml.scores is missing (a llama vocabulary needs it)")
    if len(scores) != len(tokens):
        raise DataError(
            f"{path}: tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens"
        )
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    ranked = []
    for t, i in vocab.items():
        if types is not None and types[i] in (CONTROL, USER_DEFINED):
            continue
        for k in range(1, len(t)):
            left, right = t[:k], t[k:]
            if left in vocab and right in vocab:
                ranked.append((-float(scores[i]), i, vocab[left], vocab[right], left, right))
    ranked.sort()
    from tokenizers import models

    unk = tokens[unk_id] if unk_id is not None else None
    model = models.BPE(
        vocab=vocab,
        merges=[(r[4], r[5]) for r in ranked],
        unk_token=unk,
        byte_fallback=True,
        fuse_unk=True,
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    return model, decoders.Sequence(steps)


def tokenizer_from_gguf(reader, path: str | os.PathLike | None = None) -> HFTokenizer:
    """The tokenizer described by a GGUF file's metadata, with its chat template.

    **Arguments:**

    - `reader`: a `gguf.GGUFReader`, or the path of a `.gguf` file (then `path` may be
      left out).
    - `path`: the file's name, for error messages.

    **Returns:** an `HFTokenizer` over the rebuilt `tokenizers.Tokenizer`, with BOS, EOS
    and padding from `tokenizer.ggml.bos_token_id` / `eos_token_id` /
    `padding_token_id` (padding falls back to EOS), `stop_ids` EOS and the end-of-turn
    ids `tokenizer.ggml.eot_token_id` / `eom_token_id` (where llama.cpp stops
    generating: Gemma's `<end_of_turn>`, Llama 3's `<|eot_id|>`), `chat_template` from
    `tokenizer.chat_template` (or `None`) and `add_bos_token` from
    `tokenizer.ggml.add_bos_token` (default: as llama.cpp, true for `llama` and for a
    `gpt2` vocabulary with one of Llama 3's pre-tokenizers, `LLAMA3_RULES`, false for
    other `gpt2` ones). Like every tokenizer here, `encode` never adds BOS itself: the
    tokenize functions follow `add_bos_token` by default (`add_bos=None`, `wants_bos`).
    `tokenizer.ggml.add_space_prefix` (default: true for `llama`) decides whether a `▁`
    is put before the text of a sentencepiece-style vocabulary.

    **Raises:** `DataError` naming the file and the field: an unknown
    `tokenizer.ggml.model` or `tokenizer.ggml.pre`, missing tokens, merges or scores, a
    merge that names an unknown token, a special id outside the vocabulary, a chat
    template that does not compile (with its line) or cannot render a user turn.
    """
    from tokenizers import AddedToken, Tokenizer, normalizers

    reader, path = _open(reader, path)
    kind = _field(reader, "tokenizer.ggml.model", path)
    if kind is None:
        raise DataError(f"{path}: tokenizer.ggml.model is missing (the file has no tokenizer)")
    if kind not in ("gpt2", "llama"):
        raise DataError(f"{path}: tokenizer.ggml.model = {kind!r} is not supported (gpt2 or llama)")
    tokens = _field(reader, "tokenizer.ggml.tokens", path)
    if not tokens:
        raise DataError(f"{path}: tokenizer.ggml.tokens is missing or empty")
    n = len(tokens)
    types = _field(reader, "tokenizer.ggml.token_type", path)
    if types is not None and len(types) != n:
        raise DataError(
            f"{path}: tokenizer.ggml.token_type has {len(types)} entries for {n} tokens"
        )
    ids = {}
    for key in _SPECIAL_KEYS + END_OF_TURN_KEYS:
        value = _field(reader, f"tokenizer.ggml.{key}", path)
        if value is not None and not 0 <= int(value) < n:
            raise DataError(
                f"{path}: tokenizer.ggml.{key} = {value} is outside the vocabulary of {n} tokens"
            )
        ids[key] = None if value is None else int(value)
    add_bos = _field(reader, "tokenizer.ggml.add_bos_token", path)
    add_space_prefix = _field(reader, "tokenizer.ggml.add_space_prefix", path)
    if kind == "gpt2":
        pre = _field(reader, "tokenizer.ggml.pre", path) or "default"
        if pre not in _PRE_SPLITS:
            raise DataError(
                f"{path}: tokenizer.ggml.pre = {pre!r} is not a supported pre-tokenizer "
                f"({', '.join(sorted(_PRE_SPLITS))})"
            )
        llama3 = pre in LLAMA3_RULES
        merges = _field(reader, "tokenizer.ggml.merges", path)
        model, decoder = _byte_level_model(
            tokens, types, merges, ids["unknown_token_id"], llama3, path
        )
        normalizer, pre_tokenizer = None, split_pre_tokenizer(_PRE_SPLITS[pre])
        add_bos = bool(add_bos) if add_bos is not None else llama3
    else:
        add_space_prefix = True if add_space_prefix is None else bool(add_space_prefix)
        model, decoder = _sentencepiece_model(
            tokens, _field(reader, "tokenizer.ggml.scores", path), types, ids["unknown_token_id"],
            add_space_prefix, path,
        )  # fmt: skip
        # llama.cpp: a space before every run of text (after each special token too) when
        # add_space_prefix, every space spelled `▁`, no pre-tokenizer split
        steps = [normalizers.Replace(" ", "▁")]
        if add_space_prefix:
            steps.insert(0, normalizers.Prepend("▁"))
        normalizer, pre_tokenizer = normalizers.Sequence(steps), None
        add_bos = bool(add_bos) if add_bos is not None else True
    tok = Tokenizer(model)
    if normalizer is not None:
        tok.normalizer = normalizer
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoder
    if types is not None:
        special = [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types)
            if ty == CONTROL
        ]
        tok.add_special_tokens(special)
        user = [
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types)
            if ty == USER_DEFINED
        ]
        tok.add_tokens(user)
    if tok.get_vocab_size(with_added_tokens=True) != n:
        raise DataError(
            f"{path}: tokenizer.ggml.tokens has {n} tokens but "
            f"{tok.get_vocab_size(with_added_tokens=True)} distinct ids were built (duplicates)"
        )
    template = _field(reader, "tokenizer.chat_template", path) or None  # "": no template
    eos = ids["eos_token_id"]
    if eos is None:
        raise DataError(f"{path}: tokenizer.ggml.eos_token_id is missing")
    bos = ids["bos_token_id"] if ids["bos_token_id"] is not None else eos
    pad = ids["padding_token_id"]
    if template is not None:
        _check_template(template, tokens[bos], tokens[eos], path)
    return HFTokenizer(
        tok,
        bos_token=tokens[bos],
        eos_token=tokens[eos],
        pad_token=tokens[pad] if pad is not None else None,
        chat_template=template,
        add_bos_token=add_bos,
        stop_ids=[ids[k] for k in END_OF_TURN_KEYS if ids[k] is not None],
    )


_PROBE_CHAT = ({"role": "user", "content": "Hello"},)


def _check_template(template: str, bos: str, eos: str, path: str) -> None:
    """Compile the chat template and render one user turn with the generation prompt
    (what every chat template renders); a syntax or rendering error is a `DataError`
    naming the file and the field."""
    try:
        from ._jinja_chat import JinjaChatTemplate

        chat = JinjaChatTemplate(template, bos_token=bos, eos_token=eos)
        chat.render(list(_PROBE_CHAT), add_generation_prompt=True)
    except ImportError:
        return  # jinja2 is optional: the template is checked when it is first used
    except DataError as e:
        raise DataError(f"{path}: tokenizer.chat_template: {e}") from None
