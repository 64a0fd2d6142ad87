"""rlhf_eqx.testing: the strategies produce what they promise, the checks catch broken losses."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import find, given, strategies as st

import rlhf_eqx.testing as rt
from rlhf_eqx.losses import aggregate, ppo_policy_loss
from rlhf_eqx.ops import masked_mean

# --- strategies --------------------------------------------------------------------------


@given(rt.logprob_arrays(n=2, batch=st.integers(1, 3), max_length=5))
def test_logprob_arrays_shapes_and_ranges(data):
    a, b, mask = data
    assert a.shape == b.shape == mask.shape and a.ndim == 2 and 1 <= a.shape[1] <= 5
    assert a.dtype == jnp.float32 and mask.dtype == jnp.bool_
    for x in (a, b):
        x = np.asarray(x)
        assert np.all(np.isfinite(x)) and np.all(x <= 0.0) and np.all(x >= -1e4)


def test_logprob_arrays_reach_the_edge_cases():
    all_masked = find(rt.logprob_arrays(length=4), lambda d: not bool(np.asarray(d[1]).any()))
    assert all_masked[1].shape == (4,)
    find(rt.logprob_arrays(length=4), lambda d: float(np.min(np.asarray(d[0]))) == -1e4)
    left = find(rt.logprob_arrays(length=4), lambda d: list(np.asarray(d[1])) == [0, 0, 1, 1])
    assert left[0].shape == (4,)


@given(rt.logprob_arrays(batch=2, length=3, allow_all_masked=False))
def test_logprob_arrays_without_empty_rows(data):
    assert bool(np.asarray(data[1]).any(axis=-1).all())


@given(rt.preference_pairs(batch=3, max_length=10))
def test_preference_pairs(pairs):
    for x in pairs[:4]:
        assert x.shape == (3,) and x.dtype == jnp.float32
        assert np.all(np.asarray(x) <= 0.0) and np.all(np.asarray(x) >= -1e4)
    for n in pairs[4:]:
        assert n.shape == (3,) and n.dtype == jnp.int32
        assert np.all((np.asarray(n) >= 1) & (np.asarray(n) <= 10))


def test_preference_pairs_ties_and_scalars():
    tie = find(
        rt.preference_pairs(),
        lambda p: (
            bool(p.chosen_logp == p.ref_chosen_logp)
            and bool(p.rejected_logp == p.ref_rejected_logp)
            and float(p.chosen_logp) != 0.0
        ),
    )
    assert tie.chosen_logp.shape == ()


@given(rt.reward_groups(n_groups=st.integers(1, 3), max_group_size=5))
def test_reward_groups(rewards):
    assert rewards.ndim == 2 and 2 <= rewards.shape[1] <= 5 and rewards.dtype == jnp.float32
    assert np.all(np.abs(np.asarray(rewards)) <= 1e6)


def test_reward_groups_reach_extremes_and_constant_groups():
    find(rt.reward_groups(group_size=3), lambda r: float(np.max(np.abs(np.asarray(r)))) == 1e6)
    const = find(rt.reward_groups(group_size=3), lambda r: len(set(np.asarray(r).tolist())) == 1)
    assert const.shape == (3,)


@given(rt.scales(min_value=1e-3, max_value=1e3))
def test_scales_stay_in_range(x):
    assert isinstance(x, float) and 1e-3 <= x <= 1e3


def test_scales_reach_both_ends_and_orders_between():
    assert find(rt.scales(), lambda x: x == 1e-8) == 1e-8
    assert find(rt.scales(), lambda x: x == 1e8) == 1e8
    find(rt.scales(), lambda x: 1e-5 < x < 1e-3)
    find(rt.scales(), lambda x: 1e3 < x < 1e5)
    with pytest.raises(ValueError, match="min_value"):
        rt.scales(min_value=0.0)


# --- checks pass on good losses and fail on broken ones ----------------------------------

X = jnp.array([[-1.0, -2.0, -3.0], [-0.5, -4.0, -1.0], [-2.0, -2.0, -2.0]])
MASK = jnp.array([[True, True, False], [False, True, True], [True, True, True]])


def good_loss(x, mask):
    return aggregate(-x, mask, mode="seq-mean-token-mean")


def leaky_loss(x, mask):  # reads the padding
    return jnp.mean(jnp.where(mask, -x, 0.0)) + 1e-3 * jnp.sum(x)


def counts_empty_rows(x, mask):  # divides by all rows, empty ones included
    return jnp.mean(masked_mean(-x, mask, axis=-1))


def first_row_only(x, mask):
    return jnp.sum(jnp.where(mask, x, 0.0)[0])


def sqrt_loss(x, mask):  # finite value, NaN gradient at masked negative entries
    return jnp.sum(jnp.where(mask, jnp.sqrt(jnp.where(mask, -x, x)), 0.0))


def grad_leak_loss(x, mask):  # same values as good_loss, but padding gets gradient
    return good_loss(x, mask) + jnp.sum(x - jax.lax.stop_gradient(x))


def test_checks_pass_on_a_correct_loss():
    rt.check_finite(good_loss, X, MASK)
    rt.check_padding_invariance(good_loss, (X,), MASK)
    rt.check_masked_gradients_zero(good_loss, (X,), MASK)
    rt.check_all_masked_contributes_nothing(good_loss, (X,), MASK)
    rt.check_permutation_invariance(good_loss, (X, MASK))


def test_check_padding_invariance_catches_leaks():
    with pytest.raises(AssertionError, match="changed"):
        rt.check_padding_invariance(leaky_loss, (X,), MASK)


def test_check_masked_gradients_catches_gradient_through_padding():
    rt.check_padding_invariance(grad_leak_loss, (X,), MASK)  # the values do not show it
    with pytest.raises(AssertionError, match="non-zero at masked positions"):
        rt.check_masked_gradients_zero(grad_leak_loss, (X,), MASK)
    with pytest.raises(AssertionError, match="non-zero at masked positions"):
        rt.check_masked_gradients_zero(grad_leak_loss, (X,), MASK, jit=False)


def test_check_finite_of_a_function_with_boolean_outputs_only():
    """The gradient of a function returning only a mask is zero (it raised: `jax.grad` of
    an integer 0)."""
    for jit in (True, False):
        out = rt.check_finite(lambda x, m: m & (x > -2.0), X, MASK, jit=jit)
        assert out.dtype == jnp.bool_


def test_check_all_masked_catches_counted_rows():
    rt.check_padding_invariance(counts_empty_rows, (X,), MASK)  # fine within rows ...
    with pytest.raises(AssertionError):  # ... but an empty row changes the mean
        rt.check_all_masked_contributes_nothing(counts_empty_rows, (X,), MASK)


def test_check_permutation_catches_order_dependence():
    with pytest.raises(AssertionError, match="permutation"):
        rt.check_permutation_invariance(first_row_only, (X, MASK))


def test_check_finite_catches_nan_gradients_and_values():
    assert np.isfinite(float(sqrt_loss(X, MASK)))
    with pytest.raises(AssertionError, match="gradient"):
        rt.check_finite(sqrt_loss, X, MASK)
    with pytest.raises(AssertionError, match="not finite"):
        rt.check_finite(lambda x, m: jnp.exp(-x * 1e3), X, MASK, jit=False)


def _good_ppo(logp, old, adv, mask):
    return ppo_policy_loss(logp, old, adv, mask, clip_eps=0.2)


def _unclipped(logp, old, adv, mask):
    return jnp.where(mask, -adv * jnp.exp(logp - old), 0.0)


def _no_gradient(logp, old, adv, mask):
    return jax.lax.stop_gradient(_good_ppo(logp, old, adv, mask)[0])


def test_check_ppo_clip_gradient_zero():
    logp = jnp.log(jnp.array([1.5, 0.5, 1.0, 0.9, 3.0]))
    old = jnp.zeros(5)
    adv = jnp.array([1.0, -1.0, 2.0, -0.5, 1.0])
    mask = jnp.array([True, True, True, True, False])
    rt.check_ppo_clip_gradient_zero(_good_ppo, logp, old, adv, mask, clip_eps=0.2)
    with pytest.raises(AssertionError, match="clipped"):
        rt.check_ppo_clip_gradient_zero(_unclipped, logp, old, adv, mask, clip_eps=0.2)
    with pytest.raises(AssertionError, match="inside"):
        rt.check_ppo_clip_gradient_zero(_no_gradient, logp, old, adv, mask, clip_eps=0.2)


def test_docstring_example_runs():
    code = re.search(r"```python\n(.*?)```", rt.__doc__, re.S).group(1)
    namespace = {}
    exec(compile(code, "rlhf_eqx.testing docstring", "exec"), namespace)
    namespace["test_my_kl_loss"]()


@given(rt.masks((2, 5)))
def test_masks_strategy(mask):
    assert mask.shape == (2, 5) and mask.dtype == jnp.bool_


def test_masks_reach_every_pattern():
    def pattern(m):
        return tuple(int(v) for v in np.asarray(m))

    for target in [(1, 1, 0, 0, 0), (0, 0, 0, 1, 1), (0, 0, 0, 0, 0), (1, 1, 1, 1, 1)]:
        assert pattern(find(rt.masks((5,)), lambda m, t=target: pattern(m) == t)) == target
