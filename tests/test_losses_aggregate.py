"""Aggregation modes: closed forms, exact micro-batching, masking invariants."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_allclose
from hypothesis import given, strategies as st

import rlhf_eqx.testing as rt
from rlhf_eqx.losses import aggregate, aggregate_parts, safe_divide, sft_nll

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]

X = jnp.array([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, -7.0, -7.0], [9.0, 9.0, 9.0, 9.0]])
M = jnp.array([[True, True, True, False], [True, True, False, False], [False] * 4])


def test_closed_forms():
    # Row 0: sum 6 over 3 tokens; row 1: sum 9 over 2 tokens; row 2 fully masked.
    assert float(aggregate(X, M, mode="token-mean")) == pytest.approx(15.0 / 5.0)
    assert float(aggregate(X, M, mode="seq-mean-token-mean")) == pytest.approx((2.0 + 4.5) / 2)
    assert float(aggregate(X, M, mode="seq-mean-token-sum")) == pytest.approx((6.0 + 9.0) / 2)
    assert float(aggregate(X, M, mode="seq-mean-token-sum-norm")) == pytest.approx(15.0 / (2 * 4))
    assert float(aggregate(X, M, mode="seq-mean-token-sum-norm", constant=10.0)) == pytest.approx(
        15.0 / 20.0
    )
    num, den = aggregate_parts(X, M, mode="seq-mean-token-mean")
    assert float(num) == pytest.approx(6.5) and float(den) == 2.0


def test_all_masked_batch_is_zero_not_nan():
    mask = jnp.zeros((2, 3), bool)
    x = jnp.full((2, 3), jnp.nan)
    for mode in MODES:
        out = aggregate(x, mask, mode=mode)
        assert float(out) == 0.0
        g = jax.grad(lambda v, mode=mode: aggregate(v, mask, mode=mode))(jnp.ones((2, 3)))
        assert np.all(np.asarray(g) == 0.0)


def test_masked_nan_is_ignored():
    x = X.at[0, 3].set(jnp.nan).at[2].set(jnp.inf)
    for mode in MODES:
        assert float(aggregate(x, M, mode=mode)) == float(aggregate(X, M, mode=mode))


def test_invalid_arguments():
    with pytest.raises((ValueError, TypeError)):  # TypeError: the shape/type checker
        aggregate(X, M, mode="mean")  # pyright: ignore
    with pytest.raises(ValueError):
        aggregate(X, M, mode="token-mean", constant=3.0)
    with pytest.raises(ValueError):
        aggregate(X, M, mode="seq-mean-token-sum-norm", constant=0.0)


def test_safe_divide():
    assert float(safe_divide(jnp.asarray(3.0), jnp.asarray(0.0))) == 0.0
    assert float(safe_divide(jnp.asarray(3.0), jnp.asarray(2.0))) == 1.5


def test_sft_nll():
    logp = jnp.array([-1.0, -2.0, -3.0])
    mask = jnp.array([True, False, True])
    np.testing.assert_array_equal(np.asarray(sft_nll(logp, mask)), [1.0, 0.0, 3.0])


def _agg(x, m, mode):
    return aggregate(x, m, mode=mode, constant=7.0 if mode.endswith("norm") else None)


def _parts(x, m, mode):
    return aggregate_parts(x, m, mode=mode, constant=7.0 if mode.endswith("norm") else None)


@jax.jit
def _micro_vs_full(x, mask):
    """For every mode and every split of the 6 rows into k equal micro-batches (as a
    scanned gradient-accumulation step does): Σ_i num_i / denom_full, and the full loss."""
    out = {}
    for mode in MODES:
        _, den = _parts(x, mask, mode)
        for k in (1, 2, 3, 6):
            xs = x.reshape(k, 6 // k, x.shape[-1])
            ms = mask.reshape(k, 6 // k, mask.shape[-1])
            nums, _ = jax.vmap(lambda a, b, mode=mode: _parts(a, b, mode))(xs, ms)
            out[f"{mode}/{k}"] = safe_divide(jnp.sum(nums), den)
        out[f"{mode}/full"] = _agg(x, mask, mode)
    return out


@given(rt.logprob_arrays(batch=6, length=5, min_value=-1e3), st.permutations(range(6)))
def test_micro_batching_is_exact(data, perm):
    x, mask = data
    perm = np.asarray(perm)
    out = _micro_vs_full(x[perm], mask[perm])
    for mode in MODES:
        full = float(out[f"{mode}/full"])
        np.testing.assert_allclose(float(_agg(x, mask, mode)), full, rtol=1e-6, atol=1e-6)
        for k in (1, 2, 3, 6):
            np.testing.assert_allclose(float(out[f"{mode}/{k}"]), full, rtol=1e-6, atol=1e-6)


def _all_modes(x, mask):
    return {mode: _agg(x, mask, mode) for mode in MODES}


@given(rt.logprob_arrays(batch=3, length=4))
def test_aggregate_invariants(data):
    x, mask = data
    rt.check_finite(_all_modes, x, mask)
    rt.check_padding_invariance(_all_modes, (x,), mask)
    rt.check_all_masked_contributes_nothing(_all_modes, (x,), mask)
    rt.check_permutation_invariance(_all_modes, (x, mask))


def test_seq_mean_token_mean_equals_python_loop():
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(4, 6)).astype(np.float32)
    ms = rng.random((4, 6)) < 0.6
    ms[0] = False
    ms[1, 0] = True
    x, mask = jnp.asarray(xs), jnp.asarray(ms)
    seq_means = [xs[b][ms[b]].mean() for b in range(4) if ms[b].any()]
    assert float(aggregate(x, mask, mode="seq-mean-token-mean")) == pytest.approx(
        float(np.mean(seq_means)), rel=1e-5
    )
    assert_tree_allclose(
        aggregate(x, mask, mode="token-mean"), jnp.asarray(xs[ms].mean(), jnp.float32)
    )


def test_traced_dr_grpo_constant():
    f = jax.jit(lambda c: aggregate(X, M, mode="seq-mean-token-sum-norm", constant=c))
    np.testing.assert_allclose(
        f(jnp.asarray(7.0)), aggregate(X, M, mode="seq-mean-token-sum-norm", constant=7), rtol=1e-6
    )
