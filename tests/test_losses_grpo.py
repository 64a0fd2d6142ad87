"""GRPO family: group / RLOO / REINFORCE++ advantages, GRPO and GSPO policy losses."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_allclose
from hypothesis import given, strategies as st
from jaxtyping import TypeCheckError

import rlhf_eqx.testing as rt
from rlhf_eqx.losses import (
    ADVANTAGE_SCALES,
    AGGREGATION_MODES,
    KL_KINDS,
    aggregate,
    check_choice,
    group_advantages,
    grpo_policy_loss,
    kl_penalty,
    mask_truncated,
    ppo_policy_loss,
    reinforce_pp_advantages,
    rloo_advantages,
)


def test_group_advantages_closed_forms():
    r = jnp.array([[1.0, 2.0, 3.0], [10.0, 10.0, 10.0]])
    g = np.asarray(group_advantages(r, scale="group"))
    np.testing.assert_allclose(g[0], np.array([-1.0, 0.0, 1.0]) / (1.0 + 1e-4), rtol=1e-6)
    np.testing.assert_array_equal(g[1], [0.0, 0.0, 0.0])
    b = np.asarray(group_advantages(r, scale="batch"))
    std = np.std(np.asarray(r), ddof=1)
    np.testing.assert_allclose(b[0], np.array([-1.0, 0.0, 1.0]) / (std + 1e-4), rtol=1e-6)
    n = np.asarray(group_advantages(r, scale="none"))
    np.testing.assert_allclose(n, [[-1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    # One group, no batch axis; a single completion has zero advantage.
    assert_tree_allclose(group_advantages(r[0]), jnp.asarray(g[0]))
    assert np.all(np.asarray(group_advantages(jnp.array([5.0]))) == 0.0)
    with pytest.raises((ValueError, TypeError)):
        group_advantages(r, scale="max")  # pyright: ignore


def test_rloo_closed_form():
    r = jnp.array([1.0, 2.0, 3.0, 6.0])
    expected = [1 - 11 / 3, 2 - 10 / 3, 3 - 9 / 3, 6 - 6 / 3]
    np.testing.assert_allclose(np.asarray(rloo_advantages(r)), expected, rtol=1e-6)
    with pytest.raises(ValueError):
        rloo_advantages(jnp.array([1.0]))


def _advantages(r):
    return {
        "group": group_advantages(r, scale="group"),
        "batch": group_advantages(r, scale="batch"),
        "none": group_advantages(r, scale="none"),
        "rloo": rloo_advantages(r),
    }


@given(rt.reward_groups(n_groups=3, group_size=4))
def test_advantage_properties(rewards):
    out = rt.check_finite(_advantages, rewards)
    rt.check_permutation_invariance(_advantages, (rewards,))
    r = np.asarray(rewards, np.float64)
    scale = max(1.0, float(np.abs(r).max()))
    for name, adv in out.items():
        sums = np.asarray(adv, np.float64).sum(-1)
        tol = 1e-5 * scale if name in ("none", "rloo") else 1e-4 * 4
        assert np.all(np.abs(sums) <= tol), name
        constant = np.all(r == r[:, :1], axis=1)
        assert np.all(np.asarray(adv)[constant] == 0.0), name
    # RLOO is the centred reward scaled by G / (G - 1).
    np.testing.assert_allclose(
        np.asarray(out["rloo"]), np.asarray(out["none"]) * 4 / 3, rtol=1e-4, atol=1e-3 * scale
    )


def test_reinforce_pp():
    rewards = jnp.array([[0.0, 0.5, 1.0, 7.0], [1.0, 0.0, 0.0, 2.0]])
    mask = jnp.array([[True, True, True, False], [True, False, True, True]])
    adv, ret = reinforce_pp_advantages(rewards, mask, gamma=0.5)
    np.testing.assert_allclose(
        np.asarray(ret),
        [[0.0 + 0.5 * (0.5 + 0.5), 0.5 + 0.5, 1.0, 0.0], [1.5, 0.0, 1.0, 2.0]],
        rtol=1e-6,
    )
    real = np.asarray(ret)[np.asarray(mask)]
    expected = (real - real.mean()) / np.sqrt(real.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(np.asarray(adv)[np.asarray(mask)], expected, rtol=1e-5)
    assert np.all(np.asarray(adv)[~np.asarray(mask)] == 0.0)


# --- policy losses -----------------------------------------------------------------------


def _grpo_token(logp, old_logp, adv, mask):
    return grpo_policy_loss(logp, old_logp, adv, mask, clip_eps=0.2, clip_eps_high=0.28)


def _grpo_seq(logp, old_logp, adv, mask):
    return grpo_policy_loss(
        logp, old_logp, adv, mask, importance="sequence", clip_eps=3e-4, clip_eps_high=4e-4
    )


def _grpo_kl(logp, old_logp, ref_logp, mask):
    return grpo_policy_loss(
        logp, old_logp, jnp.asarray(-0.7), mask, ref_logp=ref_logp, beta=0.04, delta=2.0
    )


@given(rt.logprob_arrays(n=2, length=6, min_value=-1.0), st.floats(-3.0, 3.0, width=32))
def test_grpo_token_matches_ppo_and_clip_gradient(data, adv):
    logp, old, mask = data
    a = jnp.asarray(adv, jnp.float32)
    loss, stats = _grpo_token(logp, old, a, mask)
    ppo, ppo_stats = ppo_policy_loss(
        logp, old, jnp.full((6,), a), mask, clip_eps=0.2, clip_eps_high=0.28
    )
    assert_tree_allclose(loss, ppo)
    assert_tree_allclose(stats["ratio"], ppo_stats["ratio"])
    rt.check_ppo_clip_gradient_zero(
        _grpo_token, logp, old, a, mask, clip_eps=0.2, clip_eps_high=0.28
    )


def _both(logp, old_logp, mask):
    adv = jnp.asarray(1.5)
    return _grpo_token(logp, old_logp, adv, mask), _grpo_seq(logp, old_logp, -adv, mask)


@given(rt.logprob_arrays(n=3, length=6))
def test_grpo_finite_and_padding_invariant(data):
    logp, old, ref, mask = data
    rt.check_finite(_both, logp, old, mask)
    rt.check_padding_invariance(_both, (logp, old), mask)
    rt.check_finite(_grpo_kl, logp, old, ref, mask)
    rt.check_padding_invariance(_grpo_kl, (logp, old, ref), mask)


def _trl_gspo(logp, old, adv, mask, eps_low, eps_high):
    """TRL GRPOTrainer, importance_sampling_level="sequence", one completion."""
    m = mask.astype(logp.dtype)
    log_w = jnp.sum((logp - old) * m) / jnp.maximum(jnp.sum(m), 1.0)
    coef_1 = jnp.exp(log_w)
    coef_2 = jnp.clip(coef_1, 1 - eps_low, 1 + eps_high)
    per_token = -jnp.minimum(coef_1 * adv, coef_2 * adv) * jnp.ones_like(logp)
    return jnp.sum(per_token * m) / jnp.maximum(jnp.sum(m), 1.0)


@functools.partial(jax.jit, static_argnames=("eps",))
def _gspo_vs_trl(logp, old, a, mask, *, eps):
    def ours(lp):
        per_token, _ = grpo_policy_loss(
            lp, old, a, mask, importance="sequence", clip_eps=eps[0], clip_eps_high=eps[1]
        )
        return aggregate(per_token[None], mask[None], mode="seq-mean-token-mean")

    def trl(lp):
        return _trl_gspo(lp, old, a, mask, *eps)

    return jax.value_and_grad(ours)(logp), jax.value_and_grad(trl)(logp)


def test_gspo_value_and_gradient_match_sequence_form():
    T = 6
    rng = np.random.default_rng(0)
    mask = jnp.array([True, True, False, True, True, False])
    old = jnp.asarray(-np.abs(rng.normal(size=T)), jnp.float32)
    advs = jnp.array([1.3, -0.8])
    for scale, eps in ((1e-4, (3e-4, 4e-4)), (0.3, (0.2, 0.2)), (0.05, (0.2, 0.28))):
        logp = old + jnp.asarray(scale * rng.normal(size=T), jnp.float32)
        for a in advs:
            (v1, g1), (v2, g2) = _gspo_vs_trl(logp, old, a, mask, eps=eps)
            np.testing.assert_allclose(float(v1), float(v2), rtol=1e-6)
            np.testing.assert_allclose(np.asarray(g1), np.asarray(g2), rtol=1e-5, atol=1e-8)
    # Every real token carries the sequence ratio.
    _, stats = grpo_policy_loss(logp, old, jnp.asarray(1.0), mask, importance="sequence")
    s = np.exp(np.mean((np.asarray(logp) - np.asarray(old))[np.asarray(mask)]))
    np.testing.assert_allclose(np.asarray(stats["ratio"])[np.asarray(mask)], s, rtol=1e-5)


def test_grpo_kl_term_and_delta():
    logp = jnp.array([-1.0, -2.0, -0.5])
    old = jnp.array([-1.0, -2.5, -0.5])
    ref = jnp.array([-1.2, -1.0, -0.5])
    mask = jnp.array([True, True, False])
    a = jnp.asarray(2.0)
    base, _ = grpo_policy_loss(logp, old, a, mask, clip_eps_high=10.0)
    with_kl, stats = grpo_policy_loss(
        logp, old, a, mask, clip_eps_high=10.0, ref_logp=ref, beta=0.04
    )
    k3 = np.where(np.asarray(mask), np.asarray(kl_penalty(logp, ref, kind="k3")), 0.0)
    np.testing.assert_allclose(np.asarray(with_kl - base), 0.04 * k3, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(stats["kl"]), k3, rtol=1e-6)
    # Two-sided clipping: the unclipped ratio e^0.5 is capped at delta = 1.5.
    capped, _ = grpo_policy_loss(logp, old, a, mask, clip_eps_high=10.0, delta=1.5)
    np.testing.assert_allclose(np.asarray(capped), [-2.0, -3.0, 0.0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(base)[1], -2.0 * np.exp(0.5), rtol=1e-6)
    with pytest.raises(ValueError):
        grpo_policy_loss(logp, old, a, mask, beta=0.1)


def test_clip_stats():
    logp = jnp.log(jnp.array([1.5, 0.5, 1.0]))
    old = jnp.zeros(3)
    mask = jnp.ones(3, bool)
    _, pos = grpo_policy_loss(logp, old, jnp.asarray(1.0), mask)
    _, neg = grpo_policy_loss(logp, old, jnp.asarray(-1.0), mask)
    np.testing.assert_array_equal(np.asarray(pos["clipped_high"]), [1, 0, 0])
    np.testing.assert_array_equal(np.asarray(neg["clipped_low"]), [0, 1, 0])
    np.testing.assert_array_equal(np.asarray(pos["clipped_low"]), [0, 0, 0])


def test_mask_truncated_and_dr_grpo_aggregation():
    mask = jnp.array([[True, True, False], [True, True, True], [True, False, False]])
    truncated = jnp.array([False, True, False])
    new = jax.vmap(mask_truncated)(mask, truncated)
    np.testing.assert_array_equal(np.asarray(new), [[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    per_token = jnp.array([[1.0, 2.0, 9.0], [5.0, 5.0, 5.0], [4.0, 9.0, 9.0]])
    # Dr.GRPO (TRL): sum / (rows · max_completion_length); the truncated row is left out.
    out = aggregate(per_token, new, mode="seq-mean-token-sum-norm", constant=8.0)
    assert float(out) == pytest.approx((3.0 + 4.0) / (2 * 8.0))
    # Grpo: mean of per-sequence means.
    assert float(aggregate(per_token, new, mode="seq-mean-token-mean")) == pytest.approx(
        (1.5 + 4.0) / 2
    )


def test_jit_and_vmap(getkey):
    B, T = 3, 5
    logp = -jnp.abs(jax.random.normal(getkey(), (B, T)))
    old = -jnp.abs(jax.random.normal(getkey(), (B, T)))
    adv = jax.random.normal(getkey(), (B,))
    mask = jax.random.bernoulli(getkey(), 0.7, (B, T))
    batched = jax.vmap(_grpo_seq)(logp, old, adv, mask)
    looped = [_grpo_seq(logp[i], old[i], adv[i], mask[i]) for i in range(B)]
    assert_tree_allclose(batched, jax.tree.map(lambda *x: jnp.stack(x), *looped))
    assert_tree_allclose(jax.jit(jax.vmap(_grpo_seq))(logp, old, adv, mask), batched)


def test_grpo_traced_hyperparameters_under_jit_and_vmap(getkey):
    T = 6
    logp = -jnp.abs(jax.random.normal(getkey(), (T,)))
    old = logp + 0.5 * jax.random.normal(getkey(), (T,))
    ref = logp + 0.3 * jax.random.normal(getkey(), (T,))
    mask = jnp.arange(T) < 5
    a = jnp.asarray(-0.7)

    def f(eps, eps_high, beta, delta):
        return grpo_policy_loss(
            logp,
            old,
            a,
            mask,
            clip_eps=eps,
            clip_eps_high=eps_high,
            ref_logp=ref,
            beta=beta,
            delta=delta,
        )[0]

    jitted = jax.jit(f)
    for args in ((0.2, 0.28, 0.04, 1.5), (0.1, 0.1, 0.0, 3.0)):
        assert_tree_allclose(jitted(*(jnp.asarray(x) for x in args)), f(*args))
    betas = jnp.array([0.0, 0.1])
    swept = jax.vmap(lambda b: f(0.2, 0.28, b, 1.5))(betas)
    assert_tree_allclose(swept, jnp.stack([f(0.2, 0.28, 0.0, 1.5), f(0.2, 0.28, 0.1, 1.5)]))


def test_grpo_uses_ppo_clipping():
    """Token-level GRPO with a per-token copy of its advantage is PPO's clipped surrogate."""
    logp = jnp.log(jnp.array([0.5, 0.9, 0.2, 0.6]))
    old = jnp.log(jnp.array([0.6, 0.5, 0.4, 0.6]))
    mask = jnp.ones(4, bool)
    for a in (1.0, -1.0):
        g, _ = grpo_policy_loss(logp, old, jnp.asarray(a), mask, clip_eps=0.2, clip_eps_high=0.3)
        p, _ = ppo_policy_loss(logp, old, jnp.full((4,), a), mask, clip_eps=0.2, clip_eps_high=0.3)
        np.testing.assert_array_equal(g, p)


def test_choice_tuples_and_errors():
    assert ADVANTAGE_SCALES == ("group", "batch", "none")
    for scale in ADVANTAGE_SCALES:
        group_advantages(jnp.array([[1.0, 2.0, 4.0]]), scale=scale)
    with pytest.raises(
        ValueError, match="^unknown scale 'std'; expected one of 'group', 'batch', 'none'$"
    ):
        check_choice("scale", "std", ADVANTAGE_SCALES)
    with pytest.raises((ValueError, TypeCheckError), match="std"):
        group_advantages(jnp.array([1.0, 2.0]), scale="std")  # pyright: ignore
    with pytest.raises(ValueError, match="^unknown mode 'mean'; expected one of 'token-mean'"):
        check_choice("mode", "mean", AGGREGATION_MODES)
    check_choice("kind", "k3", KL_KINDS)


@pytest.mark.parametrize("scale", ["group", "batch"])
def test_group_advantages_eps_zero_constant_group_is_zero_not_nan(scale):
    """A group of identical rewards (or a group of one) with `eps=0` divided 0 by 0."""
    for rewards in (jnp.full((2, 3), 5.0), jnp.array([[3.0]])):
        adv, grad = jax.value_and_grad(
            lambda r: jnp.sum(group_advantages(r, scale=scale, eps=0.0))
        )(rewards)
        assert float(adv) == 0.0 and np.all(np.asarray(grad) == 0.0)
        assert np.all(np.asarray(group_advantages(rewards, scale=scale, eps=0.0)) == 0.0)
    spread = jnp.array([[1.0, 3.0]])
    np.testing.assert_allclose(
        np.asarray(group_advantages(spread, scale=scale, eps=0.0)),
        [[-1.0 / np.sqrt(2.0), 1.0 / np.sqrt(2.0)]],
        rtol=1e-6,
    )
    with pytest.raises(ValueError, match="eps must be non-negative"):
        group_advantages(spread, eps=-1e-4)
