"""Attention of a decode step against a KV cache whose keys are stored transposed."""

import math

from jaxtyping import Array, Bool, Float

from ._dense_attention import _heads_major, _softmax_values, _transposed_scores


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
    copy first), a sizeable share of a decode step. Same values as `attention(q,
    swapaxes(keys_t), v, allowed)`."""
    T, K = q.shape[-3], keys_t.shape[-3]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = _transposed_scores(_heads_major(q, K), keys_t, T, scale, cap)
    return _softmax_values(s, v, allowed, T)[0]
