"""The attention kernel against a plain softmax reference: values and gradients, with
grouped queries, soft-capping, blocks, fully masked rows and shared-prefix layouts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from rlhf_eqx.models import (
    attention,
    attention_layout,
    cached_attention,
    previous_allowed,
    region_attention,
)


def naive(q, k, v, allowed, cap=None):
    """softmax(cap·tanh(q kᵀ/√d/cap)) v per query head, keys/values head-major; rows with
    no allowed key give 0."""
    H, K = q.shape[-2], k.shape[-3]
    kk = jnp.repeat(k, H // K, axis=-3)  # [..., H, S, hd]
    vv = jnp.repeat(v, H // K, axis=-3)
    s = jnp.einsum("...thd,...hsd->...hts", q, kk) / np.sqrt(q.shape[-1])
    if cap is not None:
        s = cap * jnp.tanh(s / cap)
    ok = allowed[..., None, :, :]
    p = jnp.where(
        jnp.any(ok, axis=-1, keepdims=True), jax.nn.softmax(jnp.where(ok, s, -1e30), axis=-1), 0.0
    )
    return jnp.einsum("...hts,...hsd->...thd", p, vv)


def inputs(seed, B=2, T=24, H=4, K=2, hd=8):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (B, T, H, hd)) * 2.0
    k = jax.random.normal(ks[1], (B, K, T, hd)) * 2.0
    v = jax.random.normal(ks[2], (B, K, T, hd))
    mask = jax.random.bernoulli(ks[3], 0.75, (B, T)).at[:, 0].set(False)  # row 0: no key
    return q, k, v, mask


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 1000),
    cap=st.sampled_from([None, 5.0]),
    block=st.sampled_from([None, 5, 8]),
    branches=st.booleans(),
)
def test_attention_values_and_gradients_match_softmax(seed, cap, block, branches):
    q, k, v, mask = inputs(seed)
    branch = jnp.asarray(np.repeat([0, 1, 2], 8))[None].repeat(2, 0) if branches else None
    allowed, _ = attention_layout(mask, None, branch)
    w = jax.random.normal(jax.random.key(seed + 1), q.shape)
    f = lambda fn: lambda q, k, v: jnp.sum(fn(q, k, v) * w)
    fast = lambda q, k, v: attention(q, k, v, allowed, cap=cap, causal_block=block)
    slow = lambda q, k, v: naive(q, k, v, allowed, cap=cap)
    np.testing.assert_allclose(jax.jit(fast)(q, k, v), slow(q, k, v), rtol=1e-5, atol=1e-5)
    g_fast = jax.jit(jax.grad(f(fast), argnums=(0, 1, 2)))(q, k, v)
    g_slow = jax.grad(f(slow), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g_fast, g_slow):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_rows_without_keys_are_zero_with_zero_gradient():
    q, k, v, _ = inputs(0)
    allowed = jnp.zeros((2, 24, 24), bool)
    out, grads = jax.value_and_grad(lambda q: jnp.sum(attention(q, k, v, allowed)))(q)
    assert out == 0.0 and not jnp.any(grads)


def test_bfloat16_inputs_follow_float32():
    q, k, v, mask = inputs(1)
    allowed, _ = attention_layout(mask, None)
    bf = lambda x: x.astype(jnp.bfloat16)
    got = attention(bf(q), bf(k), bf(v), allowed)
    assert got.dtype == jnp.bfloat16
    want = naive(
        bf(q).astype(jnp.float32), bf(k).astype(jnp.float32), bf(v).astype(jnp.float32), allowed
    )
    np.testing.assert_allclose(got.astype(jnp.float32), want, rtol=3e-2, atol=3e-2)


def test_shared_prefix_layout_positions_and_predictors():
    mask = jnp.asarray([True] * 7 + [False])
    branch = jnp.asarray([0, 0, 0, 1, 1, 2, 2, 0])
    allowed, positions = attention_layout(mask, None, branch)
    # each completion continues the prompt's positions
    assert positions[:7].tolist() == [0, 1, 2, 3, 4, 3, 4]
    # the rejected completion never sees the chosen one
    assert not allowed[5, 3] and not allowed[6, 4] and allowed[6, 2] and allowed[6, 5]
    prev, has_prev = previous_allowed(allowed)
    assert prev[:7].tolist() == [0, 0, 1, 2, 3, 2, 5]
    assert has_prev[:7].tolist() == [False] + [True] * 6


@pytest.mark.parametrize("T", [130, 300])
def test_blocks_keep_memory_linear(T):
    """The backward pass keeps no [T, T] probabilities: the saved residuals of a blocked
    attention are far smaller than one layer's score matrix."""
    q, k, v, _ = inputs(2, B=1, T=T, H=4, K=2, hd=8)
    allowed, _ = attention_layout(jnp.ones((1, T), bool), None)
    fn = lambda q, k, v: jnp.sum(attention(q, k, v, allowed, causal_block=64))
    _, vjp = jax.vjp(fn, q, k, v)
    saved = sum(x.size for x in jax.tree.leaves(vjp) if hasattr(x, "size") and x.dtype != jnp.bool_)
    assert saved < 4 * T * T  # the float scores alone would be 4·T·T (4 heads)


@pytest.mark.parametrize("regions, block", [((5, 9, 10), None), ((6, 10, 8), 4), ((0, 12, 12), 5)])
def test_region_attention_equals_masked_attention(regions, block):
    """Scoring each branch against the prefix and itself only equals full attention
    under the shared-prefix mask, values and gradients, with and without query blocks
    (the blocks then see the prefix keys too)."""
    T = sum(regions)
    q, k, v, mask = inputs(3, T=T)
    branch = jnp.asarray(np.repeat([0, 1, 2], regions))[None].repeat(2, 0)
    allowed, _ = attention_layout(mask, None, branch)
    w = jax.random.normal(jax.random.key(4), q.shape)
    fast = lambda q, k, v: jnp.sum(
        region_attention(q, k, v, allowed, regions, cap=7.0, causal_block=block) * w
    )
    slow = lambda q, k, v: jnp.sum(naive(q, k, v, allowed, cap=7.0) * w)
    np.testing.assert_allclose(jax.jit(fast)(q, k, v), slow(q, k, v), rtol=1e-5, atol=1e-4)
    for a, b in zip(
        jax.jit(jax.grad(fast, argnums=(0, 1, 2)))(q, k, v),
        jax.grad(slow, argnums=(0, 1, 2))(q, k, v),
    ):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="add up to"):
        region_attention(q, k, v, allowed, (1, 2, 3))


def _float_shapes(jaxpr):
    """Shapes of every float value produced anywhere in a jaxpr (sub-jaxprs included)."""
    out = []
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            aval = var.aval
            if hasattr(aval, "dtype") and jnp.issubdtype(aval.dtype, jnp.floating):
                out.append(aval.shape)
        for param in eqn.params.values():
            subs = param if isinstance(param, (tuple, list)) else (param,)
            for sub in subs:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out.extend(_float_shapes(inner))
    return out


def test_causal_blocks_form_tiles_not_score_rows():
    """With `causal_block`, the forward and backward passes score tiles of block × block
    only: no float value spans all S keys (a `[block, S]` score row would). (A last,
    partial block of queries is scored densely; here T is a whole number of blocks.)"""
    T, block = 320, 64
    q, k, v, _ = inputs(5, B=1, T=T, H=4, K=2, hd=8)
    allowed, _ = attention_layout(jnp.ones((1, T), bool), None)
    loss = lambda q, k, v: jnp.sum(attention(q, k, v, allowed, causal_block=block) ** 2)
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr
    shapes = _float_shapes(jaxpr)
    assert any(s[-2:] == (block, block) for s in shapes if len(s) >= 2)
    rows = [s for s in shapes if len(s) >= 2 and s[-1] == T and s[-2] >= block]
    assert not rows, f"scores of a query block against all keys: {rows}"


@pytest.mark.parametrize("T, S, block", [(40, 52, 8), (43, 43, 8), (24, 30, 8), (16, 16, 4)])
def test_looped_and_unrolled_tiles_match_softmax(T, S, block):
    """Both tilings — a scan over 4 or more whole query blocks (plus a partial last
    block), and unrolled blocks for shorter rows — equal the dense softmax, values and
    gradients, with prefix keys (queries are the last T of S keys), padding and segments."""
    ks = jax.random.split(jax.random.key(T * S), 5)
    q = jax.random.normal(ks[0], (2, T, 4, 8)) * 2.0
    k = jax.random.normal(ks[1], (2, 2, S, 8)) * 2.0
    v = jax.random.normal(ks[2], (2, 2, S, 8))
    mask = jax.random.bernoulli(ks[3], 0.8, (2, S)).at[:, 0].set(False)
    seg = (jnp.arange(S) >= S // 3).astype(jnp.int32)[None].repeat(2, 0)
    allowed = attention_layout(mask, seg)[0][..., S - T :, :]
    w = jax.random.normal(ks[4], q.shape)
    fast = lambda q, k, v: jnp.sum(attention(q, k, v, allowed, cap=6.0, causal_block=block) * w)
    slow = lambda q, k, v: jnp.sum(naive(q, k, v, allowed, cap=6.0) * w)
    np.testing.assert_allclose(jax.jit(fast)(q, k, v), slow(q, k, v), rtol=1e-5, atol=1e-4)
    got = jax.jit(jax.grad(fast, argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(got, jax.grad(slow, argnums=(0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    one = jax.vmap(lambda *a: attention(*a, cap=6.0, causal_block=block))(q, k, v, allowed)
    np.testing.assert_allclose(
        one, attention(q, k, v, allowed, cap=6.0, causal_block=block), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("T", [1, 3, 8])
@pytest.mark.parametrize("cap", [None, 5.0])
def test_few_queries_against_many_keys_match_softmax(T, cap):
    """A few queries per kv head against a long key range (a decode step, a reward
    model's read-out) take the scores against keys laid out `[hd, S]`; values and
    gradients are the softmax's."""
    S, H, K, hd = 96, 4, 2, 8
    ks = jax.random.split(jax.random.key(T), 4)
    q = jax.random.normal(ks[0], (2, T, H, hd))
    k = jax.random.normal(ks[1], (2, K, S, hd))
    v = jax.random.normal(ks[2], (2, K, S, hd))
    allowed = jax.random.bernoulli(ks[3], 0.7, (2, T, S)).at[0, 0].set(False)
    jaxpr = str(jax.make_jaxpr(lambda q, k, v: attention(q, k, v, allowed, cap=cap))(q, k, v))
    assert "optimization_barrier" in jaxpr  # the keys copied to [hd, S]
    got = attention(q, k, v, allowed, cap=cap)
    np.testing.assert_allclose(got, naive(q, k, v, allowed, cap), rtol=1e-5, atol=1e-5)
    loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))
    grads = jax.grad(loss(lambda q, k, v: attention(q, k, v, allowed, cap=cap)), argnums=(0, 1, 2))(
        q, k, v
    )
    want = jax.grad(loss(lambda q, k, v: naive(q, k, v, allowed, cap)), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(grads, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cap", [None, 5.0])
def test_cached_attention_reads_transposed_keys(cap):
    """Keys stored `[K, hd, S]` (the KV cache's layout): the softmax's values and
    gradients, rows without an allowed key give zeros, and no transposition of the keys
    is left in the program."""
    S, H, K, hd = 40, 4, 2, 8
    ks = jax.random.split(jax.random.key(7), 4)
    q = jax.random.normal(ks[0], (3, 1, H, hd))
    kt = jax.random.normal(ks[1], (3, K, hd, S))
    v = jax.random.normal(ks[2], (3, K, S, hd))
    allowed = jax.random.bernoulli(ks[3], 0.6, (3, 1, S)).at[1].set(False)
    k = jnp.swapaxes(kt, -1, -2)
    got = cached_attention(q, kt, v, allowed, cap=cap)
    np.testing.assert_allclose(got, naive(q, k, v, allowed, cap), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(got[1]) == 0.0)
    cached = lambda q, kt, v: cached_attention(q, kt, v, allowed, cap=cap)
    jaxpr = str(jax.make_jaxpr(cached)(q, kt, v))
    assert f"f32[3,{K},{S},{hd}] = transpose" not in jaxpr  # the keys are read as stored
    loss = lambda f: lambda q, kt, v: jnp.sum(jnp.sin(f(q, kt, v)))
    reference = lambda q, kt, v: naive(q, jnp.swapaxes(kt, -1, -2), v, allowed, cap)
    grads = jax.grad(loss(cached), argnums=(0, 1, 2))(q, kt, v)
    want = jax.grad(loss(reference), argnums=(0, 1, 2))(q, kt, v)
    for g, w in zip(grads, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
