"""Reading per-pair values out of shared-prefix packed rows (`PackedPreferenceBatch`).

A packed row holds up to `K` segments (pairs), each a shared prefix (branch 0) followed
by branches `1 ... n` (a pair's chosen and rejected completions); see
`attention_layout`. These helpers reduce per-token values to `[..., K, n]`.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def _one_hot(segment_ids, branch_ids, *, num_segments: int, num_branches: int):
    seg = jax.nn.one_hot(segment_ids, num_segments, dtype=jnp.bool_)  # [..., T, K]
    br = jax.nn.one_hot(
        branch_ids - 1, num_branches, dtype=jnp.bool_
    )  # [..., T, n]; prefix -> none
    return seg[..., :, None] & br[..., None, :]  # [..., T, K, n]


def branch_sums(
    values: Float[Array, "*B T"],
    select: Bool[Array, "*B T"],
    segment_ids: Int[Array, "*B T"],
    branch_ids: Int[Array, "*B T"],
    *,
    num_segments: int,
    num_branches: int = 2,
) -> Float[Array, "*B K n"]:
    """`out[..., k, b-1]`: the sum of `values` over the selected tokens of segment `k`,
    branch `b` (prefix tokens, branch 0, are never counted)."""
    where = _one_hot(segment_ids, branch_ids, num_segments=num_segments, num_branches=num_branches)
    where = where & select[..., :, None, None]
    return jnp.sum(
        jnp.where(where, values[..., :, None, None], jnp.zeros((), values.dtype)), axis=-3
    )


def branch_last_index(
    mask: Bool[Array, "*B T"],
    segment_ids: Int[Array, "*B T"],
    branch_ids: Int[Array, "*B T"],
    *,
    num_segments: int,
    num_branches: int = 2,
) -> Int[Array, "*B K n"]:
    """The position of the last real token of each (segment, branch) (0 when it has none)."""
    T = mask.shape[-1]
    where = _one_hot(segment_ids, branch_ids, num_segments=num_segments, num_branches=num_branches)
    where = where & mask[..., :, None, None]
    t = jnp.arange(T, dtype=jnp.int32).reshape((1,) * (mask.ndim - 1) + (T, 1, 1))
    return jnp.max(jnp.where(where, t, 0), axis=-3)
