"""The tokenizer protocol, and what every tokenizer shares.

Four tokenizers implement the protocol, one module each:

| class | module | file | dependency |
| --- | --- | --- | --- |
| `Llama2cTokenizer` | `_llama2c_tokenizer` | llama2.c `tokenizer.bin` | none |
| `SentencePieceTokenizer` | `_sentencepiece_tokenizer` | sentencepiece `.model` | `sentencepiece` |
| `HFTokenizer` | `_hf_tokenizer` | Hugging Face `tokenizer.json` | `tokenizers` |
| `ByteTokenizer` | `_byte_tokenizer` | — (UTF-8 bytes) | none |

`load_tokenizer(path)` (`_load_tokenizer`) picks the class from the file name (or the
files in a directory). Any object with the protocol's members works everywhere a
tokenizer is taken; it need not inherit from anything.
"""

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import numpy as np
from jaxtyping import Array, Int

from ._errors import DataError

# Ids to decode: a list/tuple of ints or a 1-D numpy/jax integer array.
TokenIds = Iterable[int] | Int[np.ndarray, " _n"] | Int[Array, " _n"]


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer.

    Every tokenizer maps text to a list of ids *without* special tokens; the batching
    code (`tokenize_preferences`, `tokenize_sft`, `tokenize_prompts`) adds BOS/EOS
    itself, so the same text encodes to the same ids whichever way it is later
    assembled.

    - `encode(text) -> list[int]`: ids of `text`, with no BOS/EOS added.
    - `decode(ids) -> str`: text of `ids` (any iterable of ints, numpy or jax arrays
      included); BOS, EOS and padding ids are skipped.
    - `bos_id`, `eos_id`, `pad_id`: special ids (`pad_id` only needs to be a valid id:
      padded positions are always masked).
    - `vocab_size`: number of ids; every id produced is in `[0, vocab_size)`.

    Optional: `stop_ids`, the ids that end a completion: EOS, then the model's
    end-of-turn ids when they differ from it (a GGUF file's
    `tokenizer.ggml.eot_token_id` / `eom_token_id`, Gemma's `<end_of_turn>`, Llama 3's
    `<|eot_id|>`; an HF directory's `generation_config.json` `eos_token_id` list). The
    samplers' default stop set is these and BOS; a tokenizer without the member stops
    at EOS (and BOS) only, as the llama2.c and byte tokenizers' `(eos_id,)` does.
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


def int_ids(ids: TokenIds, vocab_size: int) -> list[int]:
    """Plain Python ints from a list, tuple, numpy or jax array of ids, each checked to be
    an integer in `[0, vocab_size)` (a `DataError` names the first that is not)."""
    if hasattr(ids, "dtype") and hasattr(ids, "shape"):
        arr = np.asarray(ids)
        if arr.ndim != 1:
            raise DataError(f"token ids must be a 1-D sequence, got shape {arr.shape}")
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise DataError(
                f"token ids must be integers, got dtype {arr.dtype} (first id {arr[0]!r})"
            )
        values = arr.tolist()
    else:
        values = []
        for k, i in enumerate(ids):
            if isinstance(i, bool | np.bool_) or not isinstance(i, int | np.integer):
                raise DataError(f"token ids must be integers, got {i!r} at position {k}")
            values.append(int(i))
    for k, i in enumerate(values):
        if not 0 <= i < vocab_size:
            raise DataError(
                f"token id {i} at position {k} is outside the vocabulary [0, {vocab_size})"
            )
    return values


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


def decode_continuation(
    tokenizer: Tokenizer, prompt_ids: TokenIds, completion_ids: TokenIds
) -> str:
    """The text that `completion_ids` add after `prompt_ids`.

    Decoding a completion on its own drops the leading space of its first piece
    (SentencePiece-style tokenizers strip the dummy prefix at the start of a text), so
    `prompt + decode(completion)` can glue two words together. This decodes prompt and
    completion together and cuts the prompt's text off, so that
    `decode(prompt_ids) + decode_continuation(...)` is the decoded sequence. Falls back to
    decoding the completion alone when the joint text does not start with the prompt's
    text (byte-fallback pieces split across the boundary).
    """
    prompt = int_ids(prompt_ids, tokenizer.vocab_size)
    completion = int_ids(completion_ids, tokenizer.vocab_size)
    head = tokenizer.decode(prompt)
    full = tokenizer.decode(prompt + completion)
    if full.startswith(head):
        return full[len(head) :]
    return tokenizer.decode(completion)
