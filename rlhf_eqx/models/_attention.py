"""Rotary embeddings, the attention mask (causal, padding, segments, sliding window) and
attention."""

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
    """cos/sin tables `[..., T, head_dim]` in float32 (rotate-half layout, as in Hugging Face
    Llama)."""
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


# At most this many query rows per kv head (G·T) count as "a few queries" (decoding, a
# reward model's read-out), whose scores are taken against keys laid out `[hd, S]`.
_FEW_QUERY_ROWS = 16


def _scores(qg, k, T: int, scale: float, cap: float | None):
    """Scaled (and soft-capped) float32 scores `[..., K, G, T, S]`.

    For a few query rows against many keys (a decode step: `G` rows per kv head against
    the whole cache) the keys are first copied to `[..., K, hd, S]`: the batched `[G, hd]
    × [hd, S]` products then need no transposition inside the matrix-product kernel. On
    XLA's CPU backend (32 rows, 192 cached keys) the score product took 1.5 ms per layer
    and token, 0.4 ms after the copy, which itself costs 0.1 ms more than the slice of
    the cache it replaces. The barrier keeps XLA from folding the copy back into the
    product."""
    rows, S = qg.shape[-2], k.shape[-2]
    if rows <= _FEW_QUERY_ROWS and S >= 4 * rows:
        keys_t = jax.lax.optimization_barrier(jnp.swapaxes(k, -1, -2))
        return _transposed_scores(qg, keys_t, T, scale, cap)
    s = jnp.einsum("...qd,...sd->...qs", qg, k, preferred_element_type=_f32)
    return softcap(rearrange(s, "... k (g t) s -> ... k g t s", t=T) * scale, cap)


def _transposed_scores(qg, keys_t, T: int, scale: float, cap: float | None):
    """`_scores` against keys laid out `[..., K, hd, S]`."""
    s = jnp.einsum("...qd,...ds->...qs", qg, keys_t, preferred_element_type=_f32)
    return softcap(rearrange(s, "... k (g t) s -> ... k g t s", t=T) * scale, cap)


def _attention_forward(q, k, v, allowed, scale, cap):
    T, K = q.shape[-3], k.shape[-3]
    return _softmax_values(_scores(_heads_major(q, K), k, T, scale, cap), v, allowed, T)


def _softmax_values(s, v, allowed, T: int):
    """Output `[..., T, H, hd]` and log-normaliser of the scores `s` `[..., K, G, T, S]`."""
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


def cached_attention(
    q: Float[Array, "*B T H hd"],
    keys_t: Float[Array, "*B K hd S"],
    v: Float[Array, "*B K S hd"],
    allowed: Bool[Array, "*B T S"],
    *,
    scale: float | None = None,
    cap: float | None = None,
) -> Float[Array, "*B T H hd"]:
    """`attention` of a few queries (a decode step) against a KV cache whose keys are
    stored transposed, `[..., K, hd, S]`: the score product `[G·T, hd] × [hd, S]` reads
    them as they lie. On XLA's CPU backend a product against keys laid out `[S, hd]`
    transposes them inside the kernel (or, as `attention` does for few queries, in a
    copy first): for 32 rows and 192 cached keys that copy was 0.31 ms per layer and
    token, a fifth of a decode step. Same values as `attention(q, swapaxes(keys_t),
    v, allowed)`."""
    T, K = q.shape[-3], keys_t.shape[-3]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = _transposed_scores(_heads_major(q, K), keys_t, T, scale, cap)
    return _softmax_values(s, v, allowed, T)[0]


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
    dv = jnp.einsum(
        "...qs,...qd->...sd",
        flat(p).astype(v.dtype),
        do.astype(v.dtype),
        preferred_element_type=_f32,
    )
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


def _tile_scores(qb, kt, G: int, scale: float, cap: float | None):
    """`[..., K, G, n, b]` scaled (soft-capped) float32 scores of one tile."""
    s = jnp.einsum("...qd,...sd->...qs", qb, kt, preferred_element_type=_f32)
    return softcap(rearrange(s, "... k (g t) s -> ... k g t s", g=G) * scale, cap)


def _softmax_step(carry, qb, kt, vt, ok, G: int, scale: float, cap: float | None):
    """One key tile of the online softmax: update the running max, normaliser and
    unnormalised output `(m, den, acc)` of a query block (`ok`: `[..., n, b]` mask)."""
    m, den, acc = carry
    ok = ok[..., None, None, :, :]
    s = _tile_scores(qb, kt, G, scale, cap)
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
    return m_new, den * corr + jnp.sum(p, axis=-1), acc


def _softmax_init(qb, G: int):
    stats = qb.shape[:-2] + (G, qb.shape[-2] // G)
    return jnp.full(stats, -jnp.inf, _f32), jnp.zeros(stats, _f32), jnp.zeros(qb.shape, _f32)


def _softmax_finish(m, den, acc, G: int):
    """The normalised output `[..., K, G, n, hd]` and log-normaliser `[..., K, G, n]`
    (`inf` for a query with no allowed key, whose output is 0)."""
    tiny = jnp.finfo(_f32).tiny
    inv = jnp.where(den > 0, 1.0 / jnp.maximum(den, tiny), 0.0)
    out = acc * rearrange(inv, "... k g t -> ... k (g t)")[..., None]
    lse = jnp.where(den > 0, m + jnp.log(jnp.maximum(den, tiny)), jnp.inf)
    return rearrange(out, "... k (g t) d -> ... k g t d", g=G), lse


def _grad_step(qb, dob, lse_b, delta_b, kt, vt, ok, G: int, scale: float, cap: float | None):
    """One tile of the backward pass: the probabilities recomputed from the saved
    log-normaliser, then this tile's `(dq, dk, dv)` contributions (FlashAttention-2)."""
    flat = lambda x: rearrange(x, "... k g t s -> ... k (g t) s")
    prod = lambda spec, a, b: jnp.einsum(spec, a, b, preferred_element_type=_f32)
    s = _tile_scores(qb, kt, G, scale, cap)
    p = jnp.where(ok[..., None, None, :, :], jnp.exp(s - lse_b[..., None]), 0.0)
    dv_t = prod("...qs,...qd->...sd", flat(p).astype(vt.dtype), dob)
    dp = prod("...qd,...sd->...qs", dob, vt)
    ds = p * (rearrange(dp, "... k (g t) s -> ... k g t s", g=G) - delta_b[..., None])
    if cap is not None:
        ds = ds * (1.0 - jnp.square(s / cap))
    ds = flat(ds * scale)
    dq_t = prod("...qs,...sd->...qd", ds.astype(kt.dtype), kt)
    dk_t = prod("...qs,...qd->...sd", ds.astype(qb.dtype), qb)
    return dq_t, dk_t, dv_t


def _grad_inputs(out, d_out, K: int):
    """`dO` and `rowsum(dO ∘ O)` per query, `[..., K, G, T(, hd)]` float32."""
    do = rearrange(d_out.astype(_f32), "... t (k g) d -> ... k g t d", k=K)
    o = rearrange(out.astype(_f32), "... t (k g) d -> ... k g t d", k=K)
    return do, jnp.sum(do * o, axis=-1)


# -- unrolled tiles: a Python loop over query blocks, a scan over each one's key blocks


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
    G = q.shape[-2] // K
    qg = rearrange(q, "... t (k g) d -> ... k g t d", k=K)
    out = []
    for start in range(0, T, block):
        stop = min(start + block, T)
        end = S - T + stop
        nk = -(-end // block)
        qb = rearrange(qg[..., start:stop, :], "... k g t d -> ... k (g t) d")
        kb = _key_blocks(k, end, nk, block, k.ndim - 2)
        vb = _key_blocks(v, end, nk, block, v.ndim - 2)
        ab = _key_blocks(allowed[..., start:stop, :], end, nk, block, allowed.ndim - 1)
        out.append((start, stop, end, qb, kb, vb, ab))
    return G, out


def _unrolled_forward(q, k, v, allowed, scale, cap, block):
    G, tiles = _tiles(q, k, v, allowed, block)
    outs, lses = [], []
    for _, _, _, qb, kb, vb, ab in tiles:

        def body(carry, xs, qb=qb):
            kt, vt, at = xs
            return _softmax_step(carry, qb, kt, vt, at, G, scale, cap), None

        (m, den, acc), _ = jax.lax.scan(body, _softmax_init(qb, G), (kb, vb, ab))
        out, lse = _softmax_finish(m, den, acc, G)
        outs.append(out)
        lses.append(lse)
    out = rearrange(jnp.concatenate(outs, axis=-2), "... k g t d -> ... t (k g) d")
    return out.astype(v.dtype), jnp.concatenate(lses, axis=-1)


def _unrolled_backward(q, k, v, allowed, out, lse, d_out, scale, cap, block):
    S, hd = k.shape[-2], q.shape[-1]
    G, tiles = _tiles(q, k, v, allowed, block)
    do, delta = _grad_inputs(out, d_out, k.shape[-3])
    dqs, dk, dv = [], jnp.zeros(k.shape, _f32), jnp.zeros(v.shape, _f32)
    for start, stop, end, qb, kb, vb, ab in tiles:
        dob = rearrange(do[..., start:stop, :], "... k g t d -> ... k (g t) d").astype(v.dtype)
        lse_b, delta_b = lse[..., start:stop], delta[..., start:stop]

        def body(dq, xs, qb=qb, dob=dob, lse_b=lse_b, delta_b=delta_b):
            kt, vt, at = xs
            dq_t, dk_t, dv_t = _grad_step(qb, dob, lse_b, delta_b, kt, vt, at, G, scale, cap)
            return dq + dq_t, (dk_t, dv_t)

        dq_b, (dk_b, dv_b) = jax.lax.scan(body, jnp.zeros(qb.shape, _f32), (kb, vb, ab))
        dqs.append(rearrange(dq_b, "... k (g t) d -> ... k g t d", g=G))
        back = lambda x: jnp.moveaxis(x, 0, -3).reshape(x.shape[1:-2] + (-1, hd))[..., :end, :]
        pad = [(0, 0)] * (k.ndim - 2) + [(0, S - end), (0, 0)]
        dk = dk + jnp.pad(back(dk_b), pad)
        dv = dv + jnp.pad(back(dv_b), pad)
    dq = rearrange(jnp.concatenate(dqs, axis=-2), "... k g t d -> ... t (k g) d")
    return dq, dk, dv


# -- looped tiles: a scan over query blocks, a loop over each one's causal key blocks
# (the compiled program does not grow with T; used from _LOOPED_BLOCKS query blocks on)

_LOOPED_BLOCKS = 4


def _looped_inputs(q, k, v, allowed, block: int):
    """Query blocks `[n, ..., K, G·block, hd]` and their mask rows `[n, ..., block, S']`
    (scanned over), keys and values zero-padded to `S'` (whole key blocks), and how many
    key blocks each query block sees (`T` is a multiple of `block`)."""
    T, K, S = q.shape[-3], k.shape[-3], k.shape[-2]
    n_k = -(-S // block)
    pad = [(0, 0)] * (k.ndim - 2) + [(0, n_k * block - S), (0, 0)]
    qb = rearrange(q, "... (n b) (k g) d -> n ... k (g b) d", b=block, k=K)
    mask_pad = [(0, 0)] * (allowed.ndim - 1) + [(0, n_k * block - S)]
    rows = rearrange(jnp.pad(allowed, mask_pad), "... (n b) s -> n ... b s", b=block)
    seen = (S - T + block * np.arange(1, T // block + 1) + block - 1) // block
    return qb, jnp.pad(k, pad), jnp.pad(v, pad), rows, jnp.asarray(seen, jnp.int32)


def _key_tile(x, j, block: int, axis: int):
    return jax.lax.dynamic_slice_in_dim(x, j * block, block, axis=axis)


def _looped_forward(q, k, v, allowed, scale, cap, block):
    G = q.shape[-2] // k.shape[-3]
    qb_all, kp, vp, rows_all, seen = _looped_inputs(q, k, v, allowed, block)
    key_axis = kp.ndim - 2

    def per_query_block(_, xs):
        qb, rows, n_keys = xs

        def step(j, carry):
            kt, vt = _key_tile(kp, j, block, key_axis), _key_tile(vp, j, block, key_axis)
            ok = _key_tile(rows, j, block, rows.ndim - 1)
            return _softmax_step(carry, qb, kt, vt, ok, G, scale, cap)

        return None, _softmax_finish(*jax.lax.fori_loop(0, n_keys, step, _softmax_init(qb, G)), G)

    _, (out, lse) = jax.lax.scan(per_query_block, None, (qb_all, rows_all, seen))
    out = rearrange(out, "n ... k g b d -> ... (n b) (k g) d")
    return out.astype(v.dtype), rearrange(lse, "n ... k g b -> ... k g (n b)")


def _looped_backward(q, k, v, allowed, out, lse, d_out, scale, cap, block):
    S = k.shape[-2]
    G = q.shape[-2] // k.shape[-3]
    qb_all, kp, vp, rows_all, seen = _looped_inputs(q, k, v, allowed, block)
    key_axis = kp.ndim - 2
    do, delta = _grad_inputs(out, d_out, k.shape[-3])
    per_block = lambda x: rearrange(x, "... k g (n b) -> n ... k g b", b=block)
    do_all = rearrange(do, "... k g (n b) d -> n ... k (g b) d", b=block).astype(v.dtype)

    def per_query_block(grads, xs):
        qb, rows, dob, lse_b, delta_b, n_keys = xs

        def step(j, carry):
            dq, dk, dv = carry
            kt, vt = _key_tile(kp, j, block, key_axis), _key_tile(vp, j, block, key_axis)
            ok = _key_tile(rows, j, block, rows.ndim - 1)
            dq_t, dk_t, dv_t = _grad_step(qb, dob, lse_b, delta_b, kt, vt, ok, G, scale, cap)
            add = lambda acc, t: jax.lax.dynamic_update_slice_in_dim(
                acc, _key_tile(acc, j, block, key_axis) + t, j * block, axis=key_axis
            )
            return dq + dq_t, add(dk, dk_t), add(dv, dv_t)

        dq, dk, dv = jax.lax.fori_loop(0, n_keys, step, (jnp.zeros(qb.shape, _f32), *grads))
        return (dk, dv), dq

    zeros = jnp.zeros(kp.shape, _f32)
    xs = (qb_all, rows_all, do_all, per_block(lse), per_block(delta), seen)
    (dk, dv), dq = jax.lax.scan(per_query_block, (zeros, zeros), xs)
    dq = rearrange(dq, "n ... k (g b) d -> ... (n b) (k g) d", g=G)
    return dq, dk[..., :S, :], dv[..., :S, :]


def _flash(forward, backward):
    """A custom-VJP tiled attention `(q, k, v, allowed, scale, cap, block) -> out` whose
    backward pass keeps only the output and the log-normalisers (memory linear in T)."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
    def fn(q, k, v, allowed, scale: float, cap: float | None, block: int):
        return forward(q, k, v, allowed, scale, cap, block)[0]

    def fwd(q, k, v, allowed, scale, cap, block):
        out, lse = forward(q, k, v, allowed, scale, cap, block)
        return out, (q, k, v, allowed, out, lse)

    def bwd(scale, cap, block, res, d_out):
        q, k, v, allowed, out, lse = res
        dq, dk, dv = backward(q, k, v, allowed, out, lse, d_out, scale, cap, block)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None

    fn.defvjp(fwd, bwd)
    return fn


_unrolled_attention = _flash(_unrolled_forward, _unrolled_backward)
_looped_attention = _flash(_looped_forward, _looped_backward)


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
    `n`, each going over the key blocks of `n` up to its own end with an online softmax
    (running max and normaliser), so about half the score work is skipped at long `T`
    and no `[T, S]` score tensor is ever formed, only `[n, n]` tiles that stay in cache.
    From 4 whole query blocks on, the blocks are a scan and their key blocks a loop, so
    the compiled program does not grow with `T` (shorter rows unroll them). Outputs at
    allowed rows are those of the dense computation up to float32 rounding.

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
    whole = T // causal_block * causal_block
    if whole < _LOOPED_BLOCKS * causal_block:
        return _unrolled_attention(q, k, v, allowed, scale, cap, causal_block)
    end = S - T + whole  # the keys the whole query blocks may see
    out = _looped_attention(
        q[..., :whole, :, :],
        k[..., :end, :],
        v[..., :end, :],
        allowed[..., :whole, :end],
        scale,
        cap,
        causal_block,
    )
    if whole == T:
        return out
    # the last, partial block of queries
    rest = _unrolled_attention(
        q[..., whole:, :, :], k, v, allowed[..., whole:, :], scale, cap, causal_block
    )
    return jnp.concatenate([out, rest], axis=-3)


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
    outs = (
        [attention(q[..., :P, :, :], k[..., :P, :], v[..., :P, :], allowed[..., :P, :P], **kw)]
        if P
        else []
    )
    start = P
    for n in regions[1:]:
        if n == 0:
            continue
        end = start + n
        cat = lambda x: jnp.concatenate([x[..., :P, :], x[..., start:end, :]], axis=-2)
        keys_allowed = jnp.concatenate(
            [allowed[..., start:end, :P], allowed[..., start:end, start:end]], axis=-1
        )
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
