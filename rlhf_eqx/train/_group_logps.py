"""Token log-probabilities of GRPO groups with their prompt computed once.

`generate_batch(..., num_samples=G)` returns each prompt's `G` completions in `G`
consecutive rows that hold the same (left-padded) prompt in positions `[0, P)`. The
update's forward passes need not run that prompt `G` times: packed as one row
`[prompt | completion 1 | … | completion G]` whose completions each attend to the prompt
and to themselves only (`attention_layout` with `branch_ids`, fixed `regions`), every
completion token gets the log-probability it has in its own row, while the prompt's
projections, MLPs and keys/values are computed once per group. With 64-token prompts,
groups of 4 and 128-token completions that is a quarter of the positions.
"""

import jax
import jax.numpy as jnp
import numpy as np

from ..data._errors import DataError


def check_shared_prompts(batch) -> None:
    """Validate a `GRPOBatch`'s `prompt_length` / `samples_per_prompt` (static shapes
    always; the token values when they are concrete, i.e. outside `jax.jit`)."""
    P, G = batch.prompt_length, batch.samples_per_prompt
    if P is None and G is None:
        return
    if P is None or G is None:
        raise DataError("GRPOBatch: set both prompt_length and samples_per_prompt, or neither")
    for name, value in (("prompt_length", P), ("samples_per_prompt", G)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DataError(f"GRPOBatch.{name} must be a positive int, got {value!r}")
    tokens = batch.tokens
    if getattr(tokens, "ndim", 0) != 2:
        return  # a per-sample view (vmap) or a pytree spec: nothing to check here
    B, T = tokens.shape
    if P >= T:
        raise DataError(f"GRPOBatch.prompt_length={P} leaves no completion in rows of {T} tokens")
    if B % G:
        raise DataError(f"GRPOBatch has {B} rows, not a multiple of samples_per_prompt={G}")
    if isinstance(tokens, jax.core.Tracer) or isinstance(batch.mask, jax.core.Tracer):
        return
    in_prompt = np.asarray(batch.completion_mask)[:, :P] & np.asarray(batch.mask)[:, :P]
    if in_prompt.any():
        row = int(np.argmax(in_prompt.any(axis=1)))
        raise DataError(
            f"GRPOBatch: row {row} marks completion tokens inside its prompt positions [0, {P})"
        )
    tok = np.asarray(tokens)[:, :P].reshape(B // G, G, P)
    msk = np.asarray(batch.mask)[:, :P].reshape(B // G, G, P)
    real = np.where(msk, tok, -1)
    differs = np.any(real != real[:, :1], axis=(1, 2)) | np.any(msk != msk[:, :1], axis=(1, 2))
    if differs.any():
        g = int(np.argmax(differs))
        raise DataError(
            f"GRPOBatch: rows {g * G}..{g * G + G - 1} (group {g}) do not hold the same prompt in "
            f"positions [0, {P}) (prompt_length={P}, samples_per_prompt={G})"
        )


def group_layout(P: int, G: int, N: int):
    """Branch ids `[P + G·N]` and regions of one packed group row."""
    branch = np.concatenate(
        [np.zeros(P, np.int32), np.repeat(np.arange(1, G + 1, dtype=np.int32), N)]
    )
    return jnp.asarray(branch), (P,) + (N,) * G


def pack_groups(x, P: int, G: int):
    """`[B, T]` rows of groups of `G` sharing `[0, P)` -> `[B / G, P + G·(T - P)]`."""
    B, T = x.shape
    g = x.reshape(B // G, G, T)
    return jnp.concatenate([g[:, 0, :P], g[:, :, P:].reshape(B // G, G * (T - P))], axis=1)


def unpack_groups(y, P: int, G: int):
    """Inverse of `pack_groups` on the completion positions; the prompt positions get 0."""
    n, L = y.shape
    N = (L - P) // G
    comp = y[:, P:].reshape(n * G, N)
    return jnp.concatenate([jnp.zeros((n * G, P), y.dtype), comp], axis=1)


def shared_prompt_logprobs(model, batch, select, *, key, temperature: float, with_entropy: bool):
    """`model.selected_logprobs` on the packed groups, returned in the `[B, T]` layout."""
    P, G = batch.prompt_length, batch.samples_per_prompt
    B, T = batch.tokens.shape
    if B % G:
        raise ValueError(
            f"a (micro-)batch of {B} rows does not split into groups of samples_per_prompt={G}: "
            "use a micro_batches count that keeps whole groups together"
        )
    branch, regions = group_layout(P, G, T - P)
    n = B // G
    out = model.selected_logprobs(
        pack_groups(batch.tokens, P, G),
        pack_groups(batch.mask, P, G),
        pack_groups(select, P, G),
        branch_ids=jnp.broadcast_to(branch, (n, branch.shape[0])),
        regions=regions,
        key=key,
        temperature=temperature,
        with_entropy=with_entropy,
    )
    return tuple(unpack_groups(x, P, G) for x in out)
