"""Pretrained checkpoints paired with their tokenizers (above the models and data layers)."""

import os
from collections.abc import Mapping
from typing import Any

from .data import (
    DataError,
    HFTokenizer,
    JinjaChatTemplate,
    Llama2cTokenizer,
    Tokenizer,
    add_tokenizer_metadata,
    tokenizer_from_gguf,
)
from .models import Policy, load_gguf_policy, load_llama2c_policy, open_gguf, write_gguf


def load_llama2c(
    model_path: str | os.PathLike,
    tokenizer_path: str | os.PathLike | None = None,
    *,
    dtype: str = "float32",
    norm_eps: float = 1e-5,
    rope_theta: float = 10000.0,
) -> tuple[Policy, Llama2cTokenizer | None]:
    """Load a llama2.c `.bin` checkpoint as a `Policy`, and its tokenizer.

    **Arguments:**

    - `model_path`: a float32 llama2.c checkpoint (see `rlhf_eqx.models.load_llama2c_policy`).
    - `tokenizer_path`: optional llama2.c tokenizer file (`tokenizer.bin`, `tok512.bin`),
      read with `rlhf_eqx.data.Llama2cTokenizer.from_file`.
    - `dtype`, `norm_eps`, `rope_theta`: as in `load_llama2c_policy`.

    **Returns:** `(policy, tokenizer)`, the tokenizer being `None` without
    `tokenizer_path`. Raises `ValueError` naming both files when the tokenizer's
    vocabulary differs from the model's.
    """
    policy = load_llama2c_policy(model_path, dtype=dtype, norm_eps=norm_eps, rope_theta=rope_theta)
    if tokenizer_path is None:
        return policy, None
    tokenizer = Llama2cTokenizer.from_file(tokenizer_path)
    if tokenizer.vocab_size != policy.cfg.vocab_size:
        raise ValueError(
            f"{os.fspath(tokenizer_path)}: tokenizer has {tokenizer.vocab_size} pieces but "
            f"{os.fspath(model_path)} has a vocabulary of {policy.cfg.vocab_size}"
        )
    return policy, tokenizer


def load_gguf(
    path: str | os.PathLike, *, quantized: bool = False, dtype: str | None = None
) -> tuple[Policy, HFTokenizer]:
    """Load a llama.cpp GGUF file: the model and its tokenizer.

    **Arguments:**

    - `path`: a `.gguf` file (architectures and tensor types as in
      `rlhf_eqx.models.load_gguf_policy`).
    - `quantized`: keep the projections and the embedding in the file's packed blocks
      (`GGUFWeight`, decoded inside the products) instead of dequantising them.
    - `dtype`: the parameter dtype of the dense weights (`"float32"` default,
      `"bfloat16"`, `"float16"`).

    **Returns:** `(policy, tokenizer)`: the `Policy` of `load_gguf_policy` and the
    `HFTokenizer` of `rlhf_eqx.data.tokenizer_from_gguf` (byte-level BPE or
    SentencePiece-style vocabulary from the `tokenizer.ggml.*` metadata, with the file's
    `chat_template`), both read from one parse of the file.

    Raises `ValueError` (or `rlhf_eqx.data.DataError` for the tokenizer) naming the file
    and the metadata key or tensor at fault; nothing in the file is executed.
    """
    path = os.fspath(path)
    reader = open_gguf(path)
    policy = load_gguf_policy(path, quantized=quantized, dtype=dtype, reader=reader)
    return policy, tokenizer_from_gguf(reader, path)


def _piece(tokenizer: Tokenizer, i: int | None) -> str:
    """The text of special token `i` as a chat template sees it: the vocabulary's spelling
    (`tokenizer.token(i)`) where the tokenizer has one, else `""`."""
    token = getattr(tokenizer, "token", None)
    if i is None or token is None:
        return ""
    return str(token(i))


def _check_chat_template(template: str, tokenizer: Tokenizer, path: str) -> None:
    """Compile `template` and render one user turn with the generation prompt, as
    `load_gguf` does when it reads the file: a template it would refuse is a `DataError`
    naming the file, before anything is written."""
    try:
        chat = JinjaChatTemplate(
            template,
            bos_token=_piece(tokenizer, getattr(tokenizer, "bos_id", None)),
            eos_token=_piece(tokenizer, getattr(tokenizer, "eos_id", None)),
        )
        chat.render([{"role": "user", "content": "Hello"}], add_generation_prompt=True)
    except ImportError:
        return  # jinja2 is optional: the template is checked where it is first used
    except DataError as e:
        raise DataError(
            f"save_gguf: {path}: chat_template: {e} (load_gguf would refuse the file; "
            "nothing written)"
        ) from None


def save_gguf(
    model: Policy,
    path: str | os.PathLike,
    *,
    tokenizer: Tokenizer,
    dtype: str = "f16",
    chat_template: str | None = None,
    general: Mapping[str, Any] | str | os.PathLike | None = None,
) -> None:
    """Write a `Policy` as a llama.cpp GGUF file with its tokenizer and chat template.

    **Arguments:**

    - `model`: a `Policy`; LoRA adapters are folded in and quantised weights
      dequantised first (`rlhf_eqx.models.write_gguf`).
    - `path`: the file, written atomically (the old file or the whole new one).
    - `tokenizer`: the model's tokenizer, written as `tokenizer.ggml.*` metadata
      (`rlhf_eqx.data.add_tokenizer_metadata`: byte-level BPE as `gpt2`, llama2.c and
      SentencePiece vocabularies as `llama`). llama.cpp reads one token per embedding
      row: a tokenizer with fewer ids than `cfg.vocab_size` (an embedding padded to a
      multiple of 64 or 128) is padded with unused `[PAD{i}]` tokens, as llama.cpp's
      converter pads it.
    - `dtype`: `"f16"` (default), `"bf16"` (a bfloat16 model bit for bit), `"q8_0"` or
      `"f32"` for the matrices.
    - `chat_template`: a Jinja chat template for `tokenizer.chat_template` (default:
      the tokenizer's own, when it has one).
    - `general`: the model card (`general.*` metadata: name, license, author, base
      models, ...): the path of a GGUF file whose card is carried (the file the model
      was loaded from), or a mapping (`{**rlhf_eqx.models.read_gguf_card(src),
      "general.finetune": "dpo"}`); none by default. The keys of the file's encoding
      (file type, quantization version, ...) are always the written file's
      (`rlhf_eqx.models.write_gguf`).

    The tokenizer's end-of-turn ids (`stop_ids` besides EOS) are written as
    `tokenizer.ggml.eot_token_id` (and a second as `eom_token_id`), which `load_gguf`
    reads back as stop ids.

    Raises `ValueError` naming the tensor when a weight holds NaN or ±inf, the file and
    the tokenizer type when it cannot be written, the file and the error when the chat
    template does not compile or render a user turn (a `rlhf_eqx.data.DataError`), or both
    sizes when the tokenizer has more ids than the model's embedding has rows; nothing
    is written then.
    """
    if isinstance(model, Policy) and tokenizer.vocab_size > model.cfg.vocab_size:
        raise ValueError(
            f"save_gguf: {os.fspath(path)}: the tokenizer has {tokenizer.vocab_size} ids but "
            f"the model's vocabulary (token_embd.weight) has {model.cfg.vocab_size}: llama.cpp "
            "and load_gguf refuse such a file"
        )
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if template:
        _check_chat_template(template, tokenizer, os.fspath(path))

    def metadata(writer) -> None:
        try:
            add_tokenizer_metadata(writer, tokenizer, template, vocab_size=model.cfg.vocab_size)
        except DataError as e:  # the tokenizer's own fault, named with the file not written
            why = str(e).removeprefix("add_tokenizer_metadata: ")
            raise DataError(f"save_gguf: {os.fspath(path)}: {why}") from None

    write_gguf(model, path, dtype=dtype, metadata=metadata, general=general)
