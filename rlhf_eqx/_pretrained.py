"""Pretrained checkpoints paired with their tokenizers (above the models and data layers)."""

import os

from .data import Llama2cTokenizer
from .models import Policy, load_llama2c_policy


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
