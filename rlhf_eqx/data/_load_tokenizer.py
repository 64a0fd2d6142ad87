"""`load_tokenizer`: the tokenizer class from a file's type."""

import os

from ._errors import DataError
from ._hf_tokenizer import HFTokenizer
from ._llama2c_tokenizer import Llama2cTokenizer
from ._sentencepiece_tokenizer import SentencePieceTokenizer
from ._tokenizer import Tokenizer


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load a tokenizer, choosing the class from the file type.

    `*.json` → `HFTokenizer`, `*.model` → `SentencePieceTokenizer`, `*.bin` →
    `Llama2cTokenizer`, a GGUF file → `HFTokenizer` from the file's metadata
    (`tokenizer_from_gguf`); a directory is searched for `tokenizer.json`,
    `tokenizer.model`, `tokenizer.bin` (in that order).

    A GGUF file is told by its `.gguf` name or by its first four bytes, the magic
    `GGUF`, whatever its name (`tok.bin`, `model`, as such files are often downloaded;
    `is_gguf_file`), so that it never reaches the reader of its suffix.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        for name in ("tokenizer.json", "tokenizer.model", "tokenizer.bin"):
            candidate = os.path.join(path, name)
            if os.path.isfile(candidate):
                return load_tokenizer(candidate)
        hint = ""
        if any(os.path.isfile(os.path.join(path, n)) for n in ("vocab.json", "merges.txt")):
            hint = (
                " (vocab.json / merges.txt, a slow tokenizer's files, are not read: write a "
                "tokenizer.json with transformers' AutoTokenizer.from_pretrained(DIR)"
                ".save_pretrained(DIR))"
            )
        raise DataError(f"{path}: no tokenizer.json, tokenizer.model or tokenizer.bin{hint}")
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such tokenizer file")
    if is_gguf_file(path):
        from ._gguf_tokenizer import tokenizer_from_gguf

        return tokenizer_from_gguf(path)
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".json":
        return HFTokenizer.from_file(path)
    if suffix == ".model":
        return SentencePieceTokenizer.from_file(path)
    if suffix == ".bin":
        return Llama2cTokenizer.from_file(path)
    raise DataError(f"{path}: unknown tokenizer file type (expected .json, .model, .bin or .gguf)")


GGUF_MAGIC = b"GGUF"
"""The first four bytes of every llama.cpp GGUF file."""


def is_gguf_file(path: str | os.PathLike) -> bool:
    """Whether `path` is a llama.cpp GGUF file: a `.gguf` name (whether or not the file
    exists), or a readable file whose first four bytes are `GGUF_MAGIC`, whatever its
    name."""
    path = os.fspath(path)
    if path.lower().endswith(".gguf"):
        return True
    if not os.path.isfile(path):
        return False
    try:
        with open(path, "rb") as f:
            return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:
        return False
