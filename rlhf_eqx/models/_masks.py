"""Which keys each query may attend to: causal, padding, segments, shared-prefix branches
and sliding windows; and each token's rotary position."""

import jax.numpy as jnp
from jaxtyping import Array, Bool, Int


def within_window(
    query_pos: Int[Array, "*#B T"], key_pos: Int[Array, "*#B S"], window: Int[Array, ""]
) -> Bool[Array, "*#B T S"]:
    """`query_pos - key_pos < window` (keys at most `window - 1` positions back); all
    keys when `window` is 0 (a global layer). The leading axes broadcast."""
    dist = query_pos[..., :, None] - key_pos[..., None, :]
    return (window == 0) | (dist < window)


def attention_layout(
    mask: Bool[Array, "*B T"],
    segment_ids: Int[Array, "*B T"] | None,
    branch_ids: Int[Array, "*B T"] | None = None,
) -> tuple[Bool[Array, "*B T T"], Int[Array, "*B T"]]:
    """Which keys each query may attend to, and each token's rotary position.

    Causal, real keys only, same segment only. With `branch_ids` (shared-prefix
    packing), a token of branch `b > 0` attends to the keys of branch 0 (the shared
    prefix, e.g. a prompt) and of its own branch `b` only, so two completions packed
    after one prompt both see the prompt but never each other. A token's position is
    the number of real keys it may attend to before itself, so padding never shifts
    positions and each branch continues the prefix's positions.
    """
    T = mask.shape[-1]
    causal = jnp.tri(T, dtype=jnp.bool_)  # iotas in the program; a np.tril would embed T² bytes
    allowed = causal.reshape((1,) * (mask.ndim - 1) + (T, T)) & mask[..., None, :]
    if segment_ids is not None:
        allowed = allowed & (segment_ids[..., :, None] == segment_ids[..., None, :])
    if branch_ids is not None:
        key_branch = branch_ids[..., None, :]
        allowed = allowed & ((key_branch == 0) | (key_branch == branch_ids[..., :, None]))
    positions = jnp.maximum(jnp.sum(allowed, axis=-1, dtype=jnp.int32) - 1, 0)
    return allowed, positions


def previous_allowed(
    allowed: Bool[Array, "*B T T"],
) -> tuple[Int[Array, "*B T"], Bool[Array, "*B T"]]:
    """For each query `t`, the last key `s < t` it may attend to (0 where there is none)
    and whether there is one: the position whose next-token prediction scores token `t`.

    With plain padding this is the previous real token; with segments it stays inside
    the segment; with shared-prefix branches the first token of every branch is
    predicted from the prefix's last token.
    """
    T = allowed.shape[-1]
    lead = (1,) * (allowed.ndim - 2)
    strictly_before = jnp.tri(T, k=-1, dtype=jnp.bool_).reshape(lead + (T, T))
    keys = jnp.arange(T, dtype=jnp.int32).reshape(lead + (1, T))
    prev = jnp.max(jnp.where(allowed & strictly_before, keys, -1), axis=-1)
    return jnp.maximum(prev, 0), prev >= 0
