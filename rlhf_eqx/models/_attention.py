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


_f32 = jnp.float32


def _heads_major(x, K: int):
    """`[..., T, K·G, hd]` -> `[..., K, G·T, hd]` (query head h = kv head · G + g): both
    attention products become plain batched matrix products over the kv heads."""
    return rearrange(x, "... t (k g) d -> ... k (g t) d", k=K)


def _heads_minor(x, T: int):
    return rearrange(x, "... k (g t) d -> ... t (k g) d", t=T)


def _scores(qg, k, T: int, scale: float, cap: float | None):
    """Scaled (and soft-capped) float32 scores `[..., K, G, T, S]`."""
    s = jnp.einsum("...qd,...sd->...qs", qg, k, preferred_element_type=_f32)
    return softcap(rearrange(s, "... k (g t) s -> ... k g t s", t=T) * scale, cap)


def _attention_forward(q, k, v, allowed, scale, cap):
    T, K = q.shape[-3], k.shape[-3]
    qg = _heads_major(q, K)
    s = _scores(qg, k, T, scale, cap)
    ok = allowed[..., None, None, :, :]
    m = jnp.max(jnp.where(ok, s, -jnp.inf), axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # a row with no allowed key
    p = jnp.where(ok, jnp.exp(s - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    # normalise the [T, hd] output, not the [T, S] probabilities (one pass less over them)
    o = jnp.einsum(
        "...qs,...sd->...qd",
        rearrange(p.astype(v.dtype), "... k g t s -> ... k (g t) s"),
        v,
        preferred_element_type=_f32,
    )
    inv = jnp.where(denom > 0, 1.0 / jnp.maximum(denom, jnp.finfo(_f32).tiny), 0.0)
    o = o * rearrange(inv, "... k g t one -> ... k (g t) one")
    lse = jnp.where(denom > 0, m + jnp.log(jnp.maximum(denom, jnp.finfo(_f32).tiny)), jnp.inf)
    return _heads_minor(o.astype(v.dtype), T), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fused_attention(q, k, v, allowed, scale: float, cap: float | None):
    """Softmax attention whose backward pass recomputes the probabilities from the saved
    log-normaliser (as FlashAttention does, Dao et al. 2022) instead of storing them, and
    differentiates the softmax in closed form: `dS = P ∘ (dP - rowsum(dO ∘ O))`."""
    return _attention_forward(q, k, v, allowed, scale, cap)[0]


def _fused_fwd(q, k, v, allowed, scale, cap):
    out, lse = _attention_forward(q, k, v, allowed, scale, cap)
    return out, (q, k, v, allowed, out, lse)


def _fused_bwd(scale, cap, res, d_out):
    q, k, v, allowed, out, lse = res
    T, K = q.shape[-3], k.shape[-3]
    qg = _heads_major(q, K)
    do = _heads_major(d_out, K).astype(_f32)
    o = _heads_major(out, K).astype(_f32)
    D = rearrange(jnp.sum(do * o, axis=-1), "... k (g t) -> ... k g t", t=T)[..., None]
    s = _scores(qg, k, T, scale, cap)
    p = jnp.where(allowed[..., None, None, :, :], jnp.exp(s - lse), 0.0)
    flat = lambda x: rearrange(x, "... k g t s -> ... k (g t) s")
    dv = jnp.einsum("...qs,...qd->...sd", flat(p).astype(v.dtype), do.astype(v.dtype),
                    preferred_element_type=_f32)
    dp = jnp.einsum("...qd,...sd->...qs", do.astype(v.dtype), v, preferred_element_type=_f32)
    ds = p * (rearrange(dp, "... k (g t) s -> ... k g t s", t=T) - D)
    if cap is not None:
        ds = ds * (1.0 - jnp.square(s / cap))
    ds = flat(ds * scale)
    dq = jnp.einsum("...qs,...sd->...qd", ds.astype(k.dtype), k, preferred_element_type=_f32)
    dk = jnp.einsum("...qs,...qd->...sd", ds.astype(q.dtype), qg, preferred_element_type=_f32)
    return (
        _heads_minor(dq, T).astype(q.dtype),
        dk.astype(k.dtype),
        dv.astype(v.dtype),
        None,
    )


_fused_attention.defvjp(_fused_fwd, _fused_bwd)


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
    with no allowed key (padding) get zeros.

    With `causal_block=n` — only valid when the queries are the last `T` of the `S`
    key positions and `allowed` is causal among them (query `t` never sees key
    `S - T + s` for `s > t`; the first `S - T` keys, a prefix, may be seen by all) — the
    queries are taken in blocks of `n`: block `[i, i + n)` is scored only against the
    keys `[0, S - T + i + n)` (the keys after it are masked anyway), which skips about
    half of the score and softmax work at long `T`. Outputs at allowed rows are those
    of the dense computation up to float32 rounding.

    The backward pass never stores the probabilities: it keeps the output and each
    row's log-normaliser and recomputes them (FlashAttention's scheme, Dao et al.
    2022), so the saved activations grow linearly in `T`. The softmax output is
    normalised after the value product (on `[T, hd]`, not `[T, S]`).
    """
    T, S = q.shape[-3], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if causal_block is None or S < T or T <= causal_block:
        return _fused_attention(q, k, v, allowed, scale, cap)
    if causal_block < 1:
        raise ValueError(f"causal_block must be a positive int, got {causal_block!r}")
    prefix = S - T
    outs = []
    for start in range(0, T, causal_block):
        end = prefix + min(start + causal_block, T)
        q_blk, allowed_blk = q[..., start : start + causal_block, :, :], allowed[..., start : start + causal_block, :end]
        outs.append(_fused_attention(q_blk, k[..., :end, :], v[..., :end, :], allowed_blk, scale, cap))
    return jnp.concatenate(outs, axis=-3)


def region_attention(
    q: Float[Array, "*B T H hd"],
    k: Float[Array, "*B K T hd"],
    v: Float[Array, "*B K T hd"],
    allowed: Bool[Array, "*B T T"],
    regions: tuple[int, ...],
    *,
    scale: float | None = None,
    cap: float | None = None,
    causal_block: int | None = None,
) -> Float[Array, "*B T H hd"]:
    """`attention` over rows laid out in fixed regions: a shared prefix `[0, regions[0])`
    followed by branches of `regions[1:]` positions, each attending to the prefix and to
    itself only (`attention_layout` with `branch_ids`, the same boundaries in every row).

    Each region is scored only against the keys it may see — the prefix against itself,
    a branch against the prefix and its own keys — so no work goes to one branch's
    queries against another branch's keys; the outputs equal `attention(q, k, v,
    allowed)` wherever `allowed` follows the layout.
    """
    if sum(regions) != q.shape[-3] or any(r < 0 for r in regions) or not regions:
        raise ValueError(f"regions={regions} must be non-negative and add up to T={q.shape[-3]}")
    kw = dict(scale=scale, cap=cap, causal_block=causal_block)
    P = regions[0]
    outs = [attention(q[..., :P, :, :], k[..., :P, :], v[..., :P, :], allowed[..., :P, :P], **kw)] if P else []
    start = P
    for n in regions[1:]:
        if n == 0:
            continue
        end = start + n
        cat = lambda x: jnp.concatenate([x[..., :P, :], x[..., start:end, :]], axis=-2)
        keys_allowed = jnp.concatenate([allowed[..., start:end, :P], allowed[..., start:end, start:end]], axis=-1)
        outs.append(attention(q[..., start:end, :, :], cat(k), cat(v), keys_allowed, **kw))
        start = end
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
