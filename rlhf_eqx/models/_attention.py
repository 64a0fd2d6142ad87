"""Grouped-query softmax attention: one entry point that runs the dense kernel or the
tiled causal one, and attention over fixed shared-prefix regions."""

import math

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from ._dense_attention import _fused_attention
from ._layers import vary_together
from ._tiled_attention import _LOOPED_BLOCKS, _looped_attention, _unrolled_attention


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
    # under jax.shard_map, one type for all (each cotangent has its input's type, and
    # the tiled loops' carries start with the type their bodies return)
    q, k, v, allowed = vary_together(q, k, v, allowed)
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
