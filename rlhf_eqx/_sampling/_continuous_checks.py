"""Argument checks of `generate_continuous` (concrete prompt ids, stop sequences, one key
per prompt) and the stop-sequence table its loop matches against."""

import numbers
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Key


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_concrete_prompts(prompts: Any, prompt_masks: Any, vocab_size: int) -> None:
    """Raise naming the argument, row and position of a bad id or an empty prompt."""
    if not isinstance(prompts, jax.core.Tracer):
        ids = np.asarray(prompts)
        bad = (ids < 0) | (ids >= vocab_size)
        if bad.any():
            row, col = (int(x) for x in np.argwhere(bad)[0])
            raise ValueError(
                f"prompts: row {row} has id {int(ids[row, col])} at position {col}, "
                f"outside the vocabulary [0, {vocab_size})"
            )
    if not isinstance(prompt_masks, jax.core.Tracer):
        empty = ~np.asarray(prompt_masks).any(axis=-1)
        if empty.any():
            raise ValueError(
                f"prompt_masks: row {int(np.argmax(empty))} has no real token; every "
                "prompt needs at least one"
            )


def _check_stop_sequences(stop_sequences: Any, vocab_size: int) -> tuple[tuple[int, ...], ...]:
    if stop_sequences is None:
        return ()
    if isinstance(stop_sequences, str) or not isinstance(stop_sequences, Sequence):
        raise TypeError(
            "stop_sequences must be a sequence of token-id sequences (tokenize stop strings "
            f"first), got {stop_sequences!r}"
        )
    out = []
    for seq in stop_sequences:
        if isinstance(seq, str) or not isinstance(seq, Sequence) or len(seq) == 0:
            raise ValueError(
                f"stop_sequences: each entry must be a non-empty sequence of ids, got {seq!r}"
            )
        if not all(_is_int(i) and 0 <= i < vocab_size for i in seq):
            raise ValueError(
                f"stop_sequences: {list(seq)!r} has ids outside the vocabulary [0, {vocab_size})"
            )
        out.append(tuple(int(i) for i in seq))
    return tuple(out)


def _key_array(keys: Any, num_prompts: int) -> Key[Array, " R"]:
    """`keys` as typed keys `[R]` (raw `uint32[R, 2]` keys are wrapped)."""
    if not isinstance(keys, jax.Array):
        raise TypeError(f"keys must be a JAX array of PRNG keys, got {type(keys).__name__}")
    typed = jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key)
    if not typed:
        if keys.ndim != 2 or keys.shape[-1] != 2 or keys.dtype != jnp.uint32:
            raise ValueError(
                f"keys must be {num_prompts} PRNG keys (jax.random.split(key, {num_prompts}) "
                f"or raw uint32[{num_prompts}, 2]), got {keys.dtype}{list(keys.shape)}"
            )
        keys = jax.random.wrap_key_data(keys)
    if keys.shape != (num_prompts,):
        raise ValueError(
            f"keys must hold one PRNG key per prompt: expected shape ({num_prompts},), "
            f"got {keys.shape}"
        )
    return keys


def _stop_table(
    stop_sequences: tuple[tuple[int, ...], ...],
) -> tuple[np.ndarray, np.ndarray]:
    """Stop sequences right-aligned in a `[Q, L]` table, with the `[Q, L]` positions
    each one constrains (the others are wildcards)."""
    L = max(len(s) for s in stop_sequences)
    table = np.zeros((len(stop_sequences), L), np.int32)
    care = np.zeros((len(stop_sequences), L), np.bool_)
    for q, seq in enumerate(stop_sequences):
        table[q, L - len(seq) :] = seq
        care[q, L - len(seq) :] = True
    return table, care
