"""Cutting sampled completions at stop strings (host-side, after `generate_batch`)."""

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from ._options import GenerationOutput


def truncate_at_stop_strings(
    out: GenerationOutput,
    tokenizer: Any,
    stop_strings: Sequence[str],
    *,
    pad_id: int = 0,
) -> GenerationOutput:
    """Cut each row's completion where a stop string first appears in its decoded text.

    Host-side (call it on the output of `generate_batch`, outside `jit`). For every row,
    the completion is decoded with `tokenizer.decode`; if a stop string occurs, the
    completion keeps its longest token prefix whose text ends at or before the first
    occurrence (the stop string itself is dropped), and the remaining completion
    positions get `pad_id`, mask `False` and log-probability 0. A chat model that starts
    a new turn, e.g. `"\\n\\nHuman:"`, is cut there. Rows without a stop string are
    unchanged.

    **Arguments:**

    - `out`: a batched `GenerationOutput` (`[B, T]` fields).
    - `tokenizer`: anything with `decode(ids: list[int]) -> str`.
    - `stop_strings`: the strings to stop at (non-empty).
    - `pad_id`: the id written over cut tokens.

    **Returns:** a `GenerationOutput` of the same shapes.
    """
    if isinstance(stop_strings, str):
        raise TypeError("stop_strings must be a sequence of strings, not one string")
    if not all(isinstance(s, str) and s for s in stop_strings):
        raise ValueError(f"stop_strings must be non-empty strings, got {stop_strings!r}")
    tokens = np.array(out.tokens)
    mask = np.array(out.mask)
    cmask = np.array(out.completion_mask)
    logprobs = np.array(out.logprobs)
    if tokens.ndim != 2:
        raise ValueError(
            f"expected a batched output with [B, T] fields, got tokens of shape {tokens.shape}"
        )
    for row in range(tokens.shape[0]):
        cols = np.flatnonzero(cmask[row])
        ids = tokens[row, cols].tolist()
        text = tokenizer.decode(ids)
        hits = [i for i in (text.find(s) for s in stop_strings) if i >= 0]
        if not hits:
            continue
        start = min(hits)
        # Longest prefix of tokens whose text ends at or before the stop string.
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(tokenizer.decode(ids[:mid])) <= start:
                lo = mid
            else:
                hi = mid - 1
        cut = cols[lo:]
        tokens[row, cut] = pad_id
        mask[row, cut] = False
        cmask[row, cut] = False
        logprobs[row, cut] = 0.0
    return GenerationOutput(
        tokens=jnp.asarray(tokens, jnp.int32),
        mask=jnp.asarray(mask),
        completion_mask=jnp.asarray(cmask),
        logprobs=jnp.asarray(logprobs, jnp.float32),
    )
