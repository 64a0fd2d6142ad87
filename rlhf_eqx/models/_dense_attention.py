"""Dense softmax attention: the grouped-query score and value products, and a fused kernel
whose backward pass recomputes the probabilities from the saved log-normaliser."""

import functools

import jax
import jax.numpy as jnp
from einops import rearrange

from ._layers import softcap

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
    × [hd, S]` products then need no transposition inside the matrix-product kernel,
    which on XLA's CPU backend saves far more than the copy costs. The barrier keeps XLA
    from folding the copy back into the product."""
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
