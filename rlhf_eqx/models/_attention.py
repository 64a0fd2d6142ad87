"""Rotary embeddings, the attention mask (causal, padding, segments, sliding window) and attention."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from einops import rearrange
from jaxtyping import Array, Bool, Float, Int

from ._layers import softcap


def rope_tables(
    positions: Int[Array, "*B T"], inv_freq: Float[Array, " half"]
) -> tuple[Float[Array, "*B T hd"], Float[Array, "*B T hd"]]:
    """cos/sin tables `[..., T, head_dim]` in float32 (rotate-half layout, as in Hugging Face Llama)."""
    freqs = inv_freq.reshape((1,) * positions.ndim + inv_freq.shape)
    angles = positions.astype(jnp.float32)[..., None] * freqs
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(
    x: Float[Array, "*B T N hd"], cos: Float[Array, "*B T hd"], sin: Float[Array, "*B T hd"]
) -> Float[Array, "*B T N hd"]:
    """Rotary position embedding (Su et al. 2021), rotate-half convention, float32 inside."""
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[..., None, :] + rotated * sin[..., None, :]
    return out.astype(x.dtype)


def _dense_attention(q, k, v, allowed, *, scale: float, cap: float | None):
    """The scores of every query against every key, materialised (see `attention`)."""
    T, K = q.shape[-3], k.shape[-3]
    # query head h = kv head · G + g; [..., T, K·G, hd] -> [..., K, G·T, hd]: both
    # products become plain batched matrix products over the kv heads (no transposes
    # inside them, forward or backward).
    qg = rearrange(q, "... t (k g) d -> ... k (g t) d", k=K)
    scores = jnp.einsum("...qd,...sd->...qs", qg, k, preferred_element_type=jnp.float32)
    scores = softcap(rearrange(scores, "... k (g t) s -> ... k g t s", t=T) * scale, cap)
    scores = jnp.where(allowed[..., None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = rearrange(jax.nn.softmax(scores, axis=-1).astype(v.dtype), "... k g t s -> ... k (g t) s")
    out = jnp.einsum("...qs,...sd->...qd", probs, v)
    return rearrange(out, "... k (g t) d -> ... t (k g) d", t=T)


def attention(
    q: Float[Array, "*B T H hd"],
    k: Float[Array, "*B K S hd"],
    v: Float[Array, "*B K S hd"],
    allowed: Bool[Array, "*B T S"],
    *,
    scale: float | None = None,
    cap: float | None = None,
    causal_block: int | None = None,
) -> Float[Array, "*B T H hd"]:
    """Grouped-query softmax attention; keys/values are head-major (`[..., K, S, hd]`).

    `softmax(cap·tanh(scale · q kᵀ / cap))` over allowed keys (`scale` defaults to
    `hd ** -0.5`; no capping when `cap` is None). Scores and softmax are float32. Rows
    with no allowed key (padding) get finite values.

    With `causal_block=n` — only valid when `allowed` is causal (no query at `t` may
    see a key at `s > t`) and queries and keys are the same positions (`T == S`) — the
    queries are taken in blocks of `n`: block `[i, i + n)` is scored only against the
    keys `[0, i + n)` (the keys after it are masked anyway), which skips about half of
    the score and softmax work at long `T`, and each block is rematerialised in the
    backward pass (`jax.checkpoint`), so that the saved activations grow linearly in
    `T` instead of holding `T × T` probabilities per layer. Outputs at allowed rows
    are those of the dense computation up to float32 rounding.
    """
    T, S = q.shape[-3], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if causal_block is None or T != S or T <= causal_block:
        return _dense_attention(q, k, v, allowed, scale=scale, cap=cap)
    if causal_block < 1:
        raise ValueError(f"causal_block must be a positive int, got {causal_block!r}")
    block = jax.checkpoint(functools.partial(_dense_attention, scale=scale, cap=cap))
    outs = []
    for start in range(0, T, causal_block):
        end = min(start + causal_block, T)
        outs.append(
            block(q[..., start:end, :, :], k[..., :end, :], v[..., :end, :], allowed[..., start:end, :end])
        )
    return jnp.concatenate(outs, axis=-3)


def within_window(
    query_pos: Int[Array, "*B T"], key_pos: Int[Array, "*B S"], window: Int[Array, ""]
) -> Bool[Array, "*B T S"]:
    """`query_pos - key_pos < window` (keys at most `window - 1` positions back); all
    keys when `window` is 0 (a global layer)."""
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
    causal = jnp.asarray(np.tril(np.ones((T, T), dtype=bool)))
    allowed = causal.reshape((1,) * (mask.ndim - 1) + (T, T)) & mask[..., None, :]
    if segment_ids is not None:
        allowed = allowed & (segment_ids[..., :, None] == segment_ids[..., None, :])
    if branch_ids is not None:
        key_branch = branch_ids[..., None, :]
        allowed = allowed & ((key_branch == 0) | (key_branch == branch_ids[..., :, None]))
    positions = jnp.maximum(jnp.sum(allowed, axis=-1, dtype=jnp.int32) - 1, 0)
    return allowed, positions


def previous_allowed(allowed: Bool[Array, "*B T T"]) -> tuple[Int[Array, "*B T"], Bool[Array, "*B T"]]:
    """For each query `t`, the last key `s < t` it may attend to (0 where there is none)
    and whether there is one: the position whose next-token prediction scores token `t`.

    With plain padding this is the previous real token; with segments it stays inside
    the segment; with shared-prefix branches the first token of every branch is
    predicted from the prefix's last token.
    """
    T = allowed.shape[-1]
    lead = (1,) * (allowed.ndim - 2)
    strictly_before = jnp.asarray(np.tril(np.ones((T, T), dtype=bool), k=-1)).reshape(lead + (T, T))
    keys = jnp.arange(T, dtype=jnp.int32).reshape(lead + (1, T))
    prev = jnp.max(jnp.where(allowed & strictly_before, keys, -1), axis=-1)
    return jnp.maximum(prev, 0), prev >= 0
