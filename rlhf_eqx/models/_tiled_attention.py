"""Tiled causal attention (FlashAttention's scheme, Dao et al. 2022): queries in blocks,
each going over its causal key blocks with an online softmax; the backward pass recomputes
each tile's probabilities from the saved log-normalisers."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from einops import rearrange

from ._dense_attention import _f32
from ._layers import softcap, vary_like


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
    init = jnp.full(stats, -jnp.inf, _f32), jnp.zeros(stats, _f32), jnp.zeros(qb.shape, _f32)
    return vary_like(qb, init)  # of the loop body's type under jax.shard_map


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

        dq0 = vary_like(qb, jnp.zeros(qb.shape, _f32))
        dq_b, (dk_b, dv_b) = jax.lax.scan(body, dq0, (kb, vb, ab))
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

        dq0 = vary_like(qb, jnp.zeros(qb.shape, _f32))
        dq, dk, dv = jax.lax.fori_loop(0, n_keys, step, (dq0, *grads))
        return (dk, dv), dq

    zeros = vary_like(qb_all, jnp.zeros(kp.shape, _f32))
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
