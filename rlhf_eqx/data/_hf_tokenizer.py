"""Hugging Face `tokenizers` files (`tokenizer.json`) as tokenizers."""

import json
import os
from collections.abc import Sequence

from ._errors import DataError
from ._tokenizer import TokenIds, int_ids

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


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 ({e})") from None


def _parse_json(text: str, path: str) -> object:
    """`json.loads(text)`; a `DataError` names the file and the line
    (`path:LINE: not valid JSON (...)`)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(
            f"{path}:{e.lineno}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})"
        ) from None


def _chat_template(config: dict, directory: str) -> str | None:
    """The chat template that comes with a tokenizer, as transformers reads it: a
    `chat_template.jinja` beside it (what transformers writes since 4.50), else the
    config's `chat_template`, a string or a list of named templates (`"default"`)."""
    jinja_path = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        template = _read_text(jinja_path)
    else:
        template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def tokenizer_config(directory: str) -> dict:
    """The `tokenizer_config.json` in `directory` (`{}` when there is none); a
    `DataError` naming the file when it is not a JSON object."""
    config_path = os.path.join(directory, "tokenizer_config.json")
    if not os.path.isfile(config_path):
        return {}
    config = _parse_json(_read_text(config_path), config_path)
    if not isinstance(config, dict):
        raise DataError(f"{config_path}: expected a JSON object, got {type(config).__name__}")
    return config


def generation_stop_ids(directory: str, vocab_size: int) -> tuple[int, ...]:
    """The ids transformers' `generate` stops at for the checkpoint in `directory`:
    `generation_config.json`'s `eos_token_id` (an id or a list of them: Llama 3's
    `<|end_of_text|>`, `<|eom_id|>`, `<|eot_id|>`), else `config.json`'s (what
    `GenerationConfig.from_model_config` takes without the file); `()` when neither
    names one. A value that is not ids of the vocabulary is a `DataError` naming the
    file."""
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        config = _parse_json(_read_text(path), path)
        value = config.get("eos_token_id") if isinstance(config, dict) else None
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids) or not all(
            0 <= i < vocab_size for i in ids
        ):
            raise DataError(
                f"{path}: eos_token_id = {value!r} is not ids of the tokenizer's "
                f"{vocab_size} tokens"
            )
        return tuple(ids)
    return ()


_BOS_BY_DEFAULT = ("LlamaTokenizer", "CodeLlamaTokenizer", "GemmaTokenizer")


def _adds_bos(tok, bos: str | None, config: dict) -> bool:
    """Whether the model expects BOS before a text, as transformers decides: the
    config's `add_bos_token` when given; else true for the tokenizer classes whose
    default is true (Llama, Gemma); else whether the `tokenizer.json` post-processor
    puts BOS first (Llama 3 and Gemma files do, GPT-2-style files such as Qwen's and
    SmolLM2's do not)."""
    if config.get("add_bos_token") is not None:
        return bool(config["add_bos_token"])
    tokenizer_class = str(config.get("tokenizer_class") or "").removesuffix("Fast")
    if tokenizer_class in _BOS_BY_DEFAULT:
        return True
    bos_id = tok.token_to_id(bos) if bos is not None else None
    if bos_id is None:
        return False
    first = tok.encode("a", add_special_tokens=True).ids[:1]
    return first == [bos_id] and tok.encode("a", add_special_tokens=False).ids[:1] != first


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer (`tokenizer.json`).

    `encode` never adds the post-processor's special tokens. Special tokens are named
    by the `bos_token` / `eos_token` / `pad_token` arguments of `from_file`, else by a
    `tokenizer_config.json` beside the file, else by the usual names (`<s>`, `</s>`,
    `<|endoftext|>`, `<pad>`, ...); padding falls back to EOS. A file that is not valid
    JSON (or not a tokenizer) is a `DataError` naming it (and the line).

    `chat_template` is the model's Hugging Face chat template (a jinja2 string) when it
    came with the tokenizer (a `chat_template.jinja` beside the file, else
    `tokenizer_config.json`'s `chat_template`, its `"default"` one when it lists named
    templates; or a GGUF file's `tokenizer.chat_template`: see `tokenizer_from_gguf`),
    else `None`;
    `jinja_chat_template()` renders it. `add_bos_token` says whether the model expects
    BOS before a text (`tokenizer_config.json`'s `add_bos_token`; without it, true for
    a Llama or Gemma `tokenizer_class`, else whether the file's post-processor puts BOS
    first, as transformers does); `encode` never adds it: the tokenize functions'
    `add_bos` does. `stop_ids` are the ids a completion ends at: EOS, then the
    end-of-turn ids the model names (`from_file`: the `eos_token_id` list of a
    `generation_config.json` or `config.json` beside the file, `generation_stop_ids`; a
    GGUF file's `eot_token_id` / `eom_token_id`: `tokenizer_from_gguf`), which the
    samplers stop at by default.
    """

    def __init__(
        self,
        tokenizer,
        *,
        bos_token: str,
        eos_token: str,
        pad_token: str | None = None,
        chat_template: str | None = None,
        add_bos_token: bool = True,
        stop_ids: Sequence[int] = (),
    ):
        self.tokenizer = tokenizer
        self.chat_template: str | None = chat_template
        self.add_bos_token: bool = bool(add_bos_token)
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
        self.stop_ids: tuple[int, ...] = end_ids(self.eos_id, stop_ids, self.vocab_size)

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
        text = _read_text(path)
        try:
            tok = _HFTok.from_str(text)
        except Exception as e:  # the Rust library raises a bare Exception
            _parse_json(text, path)  # names the line when the JSON itself is broken
            raise DataError(f"{path}: not a Hugging Face tokenizer file ({e})") from None
        config = tokenizer_config(os.path.dirname(path))
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
        return cls(
            tok,
            bos_token=bos if bos is not None else eos,
            eos_token=eos,
            pad_token=pad,
            chat_template=_chat_template(config, os.path.dirname(path)),
            add_bos_token=_adds_bos(tok, bos, config),
            stop_ids=generation_stop_ids(os.path.dirname(path), len(vocab)),
        )

    def save(self, directory: str | os.PathLike) -> None:
        """Write `tokenizer.json` and a `tokenizer_config.json` (the BOS, EOS and padding
        tokens, `add_bos_token`, and `chat_template` when there is one) in `directory`,
        which `from_file` (and `load_chat_template`) read back."""
        directory = os.fspath(directory)
        os.makedirs(directory, exist_ok=True)
        self.tokenizer.save(os.path.join(directory, "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.token(self.bos_id),
            "eos_token": self.token(self.eos_id),
            "pad_token": self.token(self.pad_id),
            "add_bos_token": self.add_bos_token,
        }
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, ensure_ascii=False, indent=2)

    def token(self, i: int) -> str:
        """The text of token `i` as the vocabulary spells it (e.g. `"<|im_end|>"`)."""
        return self.tokenizer.id_to_token(int(i))

    def jinja_chat_template(self):
        """The `chat_template` as a `JinjaChatTemplate` with this tokenizer's BOS and EOS
        text (for `render` and `render_with_assistant_mask`); a `DataError` when there is
        none."""
        return carried_chat_template(self)

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False).ids]

    def decode(self, ids: TokenIds) -> str:
        kept = [i for i in int_ids(ids, self.vocab_size) if i not in self._skip]
        return self.tokenizer.decode(kept, skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size})"


def end_ids(eos_id: int, stop_ids: Sequence[int], vocab_size: int) -> tuple[int, ...]:
    """`(eos_id, *stop_ids)` without repeats: a tokenizer's `stop_ids`; an id outside
    `[0, vocab_size)` is a `DataError`."""
    ids = tuple(dict.fromkeys((int(eos_id), *(int(i) for i in stop_ids))))
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise DataError(f"stop id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return ids


def carried_chat_template(tok):
    """`tok.chat_template` (a tokenizer with `token(i)` and its special ids) as a
    `JinjaChatTemplate` with the tokenizer's BOS, EOS and padding text; a `DataError`
    when it carries none."""
    from ._jinja_chat import JinjaChatTemplate

    if tok.chat_template is None:
        raise DataError("this tokenizer carries no chat template")
    return JinjaChatTemplate(
        tok.chat_template,
        bos_token=tok.token(tok.bos_id),
        eos_token=tok.token(tok.eos_id),
        pad_token=tok.token(tok.pad_id),
    )
