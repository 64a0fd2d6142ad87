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


def _key_blocks(x, end: int, nk: int, b: int, axis: int):
    """Keys `[0, end)` of `x` along `axis`, zero-padded to `nk · b` and split into `nk`
    blocks of `b`, the block index moved to the front (scanned over)."""
    x = jax.lax.slice_in_dim(x, 0, end, axis=axis)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, nk * b - end)
    x = jnp.pad(x, pad)
    x = x.reshape(x.shape[:axis] + (nk, b) + x.shape[axis + 1 :])
    return jnp.moveaxis(x, axis, 0)


def _tiles(q, k, v, allowed, block: int):
    """Per query block `[start, stop)`: its queries `[..., K, G·n, hd]` and its keys,
    values and mask split into key blocks of `block`, keys `[0, S - T + stop)` only (the
    later keys are masked for causal queries that are the last `T` of `S` keys)."""
    T, K, S = q.shape[-3], k.shape[-3], k.shape[-2]
    qg = _heads_major(q, K)  # [..., K, G·T, hd], g-major
    G = q.shape[-2] // K
    out = []
    for start in range(0, T, block):
        stop = min(start + block, T)
        n, end = stop - start, S - T + stop
        nk = -(-end // block)
        qb = rearrange(qg, "... k (g t) d -> ... k g t d", g=G)[..., start:stop, :]
        qb = rearrange(qb, "... k g t d -> ... k (g t) d")
        kb = _key_blocks(k, end, nk, block, k.ndim - 2)
        vb = _key_blocks(v, end, nk, block, v.ndim - 2)
        ab = _key_blocks(allowed[..., start:stop, :], end, nk, block, allowed.ndim - 1)
        out.append((start, stop, n, end, qb, kb, vb, ab))
    return out


def _tile_scores(qb, kb, G: int, scale: float, cap: float | None):
    """`[..., K, G, n, b]` scaled (soft-capped) float32 scores of one tile."""
    s = jnp.einsum("...qd,...sd->...qs", qb, kb, preferred_element_type=_f32)
    return softcap(rearrange(s, "... k (g t) s -> ... k g t s", g=G) * scale, cap)


def _flash_forward(q, k, v, allowed, scale, cap, block):
    """Tiled attention with an online softmax (FlashAttention, Dao et al. 2022): each
    query block scans the key blocks it may see, keeping a running max, normaliser and
    output; no score tile outlives its step. Returns the output and the log-normalisers."""
    K = k.shape[-3]
    G = q.shape[-2] // K
    outs, lses = [], []
    for _, _, n, _, qb, kb, vb, ab in _tiles(q, k, v, allowed, block):
        lead = qb.shape[:-3]

        def body(carry, xs, qb=qb):
            m, den, acc = carry
            kt, vt, at = xs
            s = _tile_scores(qb, kt, G, scale, cap)
            ok = at[..., None, None, :, :]
            m_new = jnp.maximum(m, jnp.max(jnp.where(ok, s, -jnp.inf), axis=-1))
            base = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.where(ok, jnp.exp(s - base[..., None]), 0.0)
            corr = jnp.where(jnp.isfinite(m), jnp.exp(m - base), 0.0)
            pv = jnp.einsum(
                "...qs,...sd->...qd",
                rearrange(p.astype(vt.dtype), "... k g t s -> ... k (g t) s"),
                vt,
                preferred_element_type=_f32,
            )
            acc = acc * rearrange(corr, "... k g t -> ... k (g t)")[..., None] + pv
            return (m_new, den * corr + jnp.sum(p, axis=-1), acc), None

        init = (
            jnp.full(lead + (K, G, n), -jnp.inf, _f32),
            jnp.zeros(lead + (K, G, n), _f32),
            jnp.zeros(lead + (K, G * n, q.shape[-1]), _f32),
        )
        (m, den, acc), _ = jax.lax.scan(body, init, (kb, vb, ab))
        tiny = jnp.finfo(_f32).tiny
        inv = jnp.where(den > 0, 1.0 / jnp.maximum(den, tiny), 0.0)
        o = acc * rearrange(inv, "... k g t -> ... k (g t)")[..., None]
        outs.append(rearrange(o, "... k (g t) d -> ... k g t d", g=G))
        lses.append(jnp.where(den > 0, m + jnp.log(jnp.maximum(den, tiny)), jnp.inf))
    o = rearrange(jnp.concatenate(outs, axis=-2), "... k g t d -> ... t (k g) d")
    return o.astype(v.dtype), jnp.concatenate(lses, axis=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _flash_attention(q, k, v, allowed, scale: float, cap: float | None, block: int):
    return _flash_forward(q, k, v, allowed, scale, cap, block)[0]


def _flash_fwd(q, k, v, allowed, scale, cap, block):
    out, lse = _flash_forward(q, k, v, allowed, scale, cap, block)
    return out, (q, k, v, allowed, out, lse)


def _flash_bwd(scale, cap, block, res, d_out):
    """The tiled backward pass (FlashAttention-2's): per query block, scan its key blocks,
    recompute the probabilities from the saved log-normaliser and accumulate `dq` in the
    carry and each key block's `dk`, `dv` as the scan's outputs."""
    q, k, v, allowed, out, lse = res
    K, S, hd = k.shape[-3], k.shape[-2], q.shape[-1]
    G = q.shape[-2] // K
    do = rearrange(d_out.astype(_f32), "... t (k g) d -> ... k g t d", k=K)
    o = rearrange(out.astype(_f32), "... t (k g) d -> ... k g t d", k=K)
    D_all = jnp.sum(do * o, axis=-1)  # [..., K, G, T]
    dqs = []
    dk = jnp.zeros(k.shape, _f32)
    dv = jnp.zeros(v.shape, _f32)
    for start, stop, n, end, qb, kb, vb, ab in _tiles(q, k, v, allowed, block):
        dob = rearrange(do[..., start:stop, :], "... k g t d -> ... k (g t) d").astype(v.dtype)
        lse_b, D_b = lse[..., start:stop], D_all[..., start:stop]

        def body(dq, xs, qb=qb, dob=dob, lse_b=lse_b, D_b=D_b):
            kt, vt, at = xs
            s = _tile_scores(qb, kt, G, scale, cap)
            p = jnp.where(at[..., None, None, :, :], jnp.exp(s - lse_b[..., None]), 0.0)
            flat = lambda x: rearrange(x, "... k g t s -> ... k (g t) s")
            dv_t = jnp.einsum(
                "...qs,...qd->...sd", flat(p).astype(vt.dtype), dob, preferred_element_type=_f32
            )
            dp = jnp.einsum("...qd,...sd->...qs", dob, vt, preferred_element_type=_f32)
            ds = p * (rearrange(dp, "... k (g t) s -> ... k g t s", g=G) - D_b[..., None])
            if cap is not None:
                ds = ds * (1.0 - jnp.square(s / cap))
            ds = flat(ds * scale)
            prod = lambda spec, a, b: jnp.einsum(spec, a, b, preferred_element_type=_f32)
            dq = dq + prod("...qs,...sd->...qd", ds.astype(kt.dtype), kt)
            dk_t = prod("...qs,...qd->...sd", ds.astype(qb.dtype), qb)
            return dq, (dk_t, dv_t)

        dq_b, (dk_b, dv_b) = jax.lax.scan(body, jnp.zeros(qb.shape, _f32), (kb, vb, ab))
        dqs.append(rearrange(dq_b, "... k (g t) d -> ... k g t d", g=G))
        back = lambda x: jnp.moveaxis(x, 0, -3).reshape(x.shape[1:-2] + (-1, hd))[..., :end, :]
        pad = [(0, 0)] * (k.ndim - 2) + [(0, S - end), (0, 0)]
        dk = dk + jnp.pad(back(dk_b), pad)
        dv = dv + jnp.pad(back(dv_b), pad)
    dq = rearrange(jnp.concatenate(dqs, axis=-2), "... k g t d -> ... t (k g) d")
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_flash_attention.defvjp(_flash_fwd, _flash_bwd)


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
    attention is tiled (FlashAttention's scheme, Dao et al. 2022): queries in blocks of
    `n`, each scanning the key blocks of `n` up to its own end with an online softmax
    (running max and normaliser), so about half the score work is skipped at long `T`
    and no `[T, S]` score tensor is ever formed, only `[n, n]` tiles that stay in cache.
    Outputs at allowed rows are those of the dense computation up to float32 rounding.

    The backward pass never stores the probabilities: it keeps the output and each
    row's log-normaliser and recomputes them (FlashAttention's scheme), tile by tile
    with `causal_block`, so the saved activations grow linearly in `T`. Without it (a
    few queries, as in decoding) the scores are dense and the softmax output is
    normalised after the value product (on `[T, hd]`, not `[T, S]`).
    """
    T, S = q.shape[-3], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if causal_block is not None and causal_block < 1:
        raise ValueError(f"causal_block must be a positive int, got {causal_block!r}")
    if causal_block is None or S < T or (T <= causal_block and S <= causal_block):
        return _fused_attention(q, k, v, allowed, scale, cap)
    return _flash_attention(q, k, v, allowed, scale, cap, causal_block)


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
