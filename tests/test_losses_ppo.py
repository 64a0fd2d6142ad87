"""PPO: GAE closed forms and padding, clipped losses and their gradients, KL estimators,
KL-shaped rewards, KL controllers."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_allclose
from hypothesis import given, strategies as st
from jaxtyping import TypeCheckError

import rlhf_eqx.testing as rt
from rlhf_eqx.losses import (
    KLControllerState,
    adaptive_kl_update,
    aggregate,
    fixed_kl_update,
    gae,
    kl_penalty,
    kl_shaped_rewards,
    ppo_policy_loss,
    ppo_value_loss,
    whiten_advantages,
)

GAMMA, LAM = 0.9, 0.8


def gae_loop(rewards, values, mask, gamma, lam):
    """Straightforward reference: walk the real positions backwards."""
    r, v, m = (np.asarray(a, np.float64) for a in (rewards, values, mask))
    idx = [t for t in range(len(m)) if m[t]]
    adv = np.zeros(len(m))
    next_v, next_a = 0.0, 0.0
    for t in reversed(idx):
        delta = r[t] + gamma * next_v - v[t]
        next_a = delta + gamma * lam * next_a
        next_v = v[t]
        adv[t] = next_a
    ret = np.where(m.astype(bool), adv + v, 0.0)
    return adv, ret


def _gae(rewards, values, mask):
    return gae(rewards, values, mask, gamma=GAMMA, lam=LAM)


@given(rt.logprob_arrays(n=2, length=6, min_value=-10.0, max_value=10.0))
def test_gae_equals_python_loop(data):
    rewards, values, mask = data
    adv, ret = jax.jit(_gae)(rewards, values, mask)
    ref_adv, ref_ret = gae_loop(rewards, values, mask, GAMMA, LAM)
    np.testing.assert_allclose(np.asarray(adv), ref_adv, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(ret), ref_ret, rtol=1e-5, atol=1e-4)


@given(rt.logprob_arrays(n=2, length=6, min_value=-1e3, max_value=1e3))
def test_gae_padding_does_not_leak(data):
    rewards, values, mask = data
    rt.check_padding_invariance(_gae, (rewards, values), mask)
    rt.check_finite(_gae, rewards, values, mask)
    adv, ret = _gae(rewards, values, mask)
    assert np.all(np.asarray(adv)[~np.asarray(mask)] == 0.0)
    assert np.all(np.asarray(ret)[~np.asarray(mask)] == 0.0)


def test_gae_special_cases(getkey):
    T = 7
    r = jax.random.normal(getkey(), (T,))
    v = jax.random.normal(getkey(), (T,))
    mask = jnp.ones((T,), bool)
    g = 0.95
    # λ = 1: discounted return minus the value.
    adv1, ret1 = gae(r, v, mask, gamma=g, lam=1.0)
    disc = np.array([sum(g**k * float(r[t + k]) for k in range(T - t)) for t in range(T)])
    np.testing.assert_allclose(np.asarray(adv1), disc - np.asarray(v), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ret1), disc, rtol=1e-5, atol=1e-5)
    # λ = 0: the TD error.
    adv0, _ = gae(r, v, mask, gamma=g, lam=0.0)
    v_next = np.append(np.asarray(v)[1:], 0.0)
    np.testing.assert_allclose(
        np.asarray(adv0), np.asarray(r) + g * v_next - np.asarray(v), rtol=1e-5, atol=1e-5
    )


def test_gae_skips_interior_padding():
    r = jnp.array([1.0, 99.0, 2.0, 0.0])
    v = jnp.array([0.5, -99.0, 0.25, 7.0])
    mask = jnp.array([True, False, True, False])
    adv, ret = gae(r, v, mask, gamma=0.5, lam=1.0)
    # position 2: δ = 2 - 0.25; position 0: 1 + 0.5·2 - 0.5
    np.testing.assert_allclose(np.asarray(adv), [1.5, 0.0, 1.75, 0.0])
    np.testing.assert_allclose(np.asarray(ret), [2.0, 0.0, 2.0, 0.0])


def test_gae_vmap_equals_loop(getkey):
    B, T = 3, 5
    r = jax.random.normal(getkey(), (B, T))
    v = jax.random.normal(getkey(), (B, T))
    m = jax.random.bernoulli(getkey(), 0.7, (B, T))
    batched = jax.vmap(_gae)(r, v, m)
    looped = [_gae(r[i], v[i], m[i]) for i in range(B)]
    assert_tree_allclose(batched, tuple(jnp.stack(x) for x in zip(*looped)))


# --- policy loss -------------------------------------------------------------------------


def _ppo(logp, old_logp, adv, mask):
    return ppo_policy_loss(logp, old_logp, adv, mask, clip_eps=0.2, clip_eps_high=0.28)


def _ppo_dual(logp, old_logp, adv, mask):
    return ppo_policy_loss(logp, old_logp, adv, mask, clip_eps=0.2, dual_clip=3.0)


@given(
    rt.logprob_arrays(n=2, length=8, min_value=-1.0),
    st.lists(st.floats(-5.0, 5.0, width=32), min_size=8, max_size=8),
)
def test_ppo_gradient_is_zero_where_clipped(data, adv):
    logp, old_logp, mask = data
    adv = jnp.asarray(adv, jnp.float32)
    rt.check_ppo_clip_gradient_zero(
        _ppo, logp, old_logp, adv, mask, clip_eps=0.2, clip_eps_high=0.28
    )
    rt.check_ppo_clip_gradient_zero(
        _ppo_dual, logp, old_logp, adv, mask, clip_eps=0.2, check_inside=False
    )


@given(rt.logprob_arrays(n=3, length=6))
def test_ppo_losses_finite_and_padding_invariant(data):
    logp, old_logp, adv, mask = data
    rt.check_finite(_ppo_dual, logp, old_logp, adv, mask)
    rt.check_padding_invariance(_ppo_dual, (logp, old_logp, adv), mask)
    rt.check_finite(_value, logp, old_logp, adv, mask)
    rt.check_padding_invariance(_value, (logp, old_logp, adv), mask)


def _value(values, old_values, returns, mask):
    return ppo_value_loss(values, old_values, returns, mask, clip_eps=0.2)


def test_ppo_policy_loss_closed_form():
    logp = jnp.log(jnp.array([1.0, 1.5, 0.5, 1.1, 5.0, 0.5]))
    old = jnp.zeros(6)
    adv = jnp.array([2.0, 2.0, -1.0, -1.0, -1.0, 3.0])
    mask = jnp.array([True, True, True, True, True, False])
    loss, stats = ppo_policy_loss(logp, old, adv, mask, clip_eps=0.2)
    # max(-A ρ, -A clip(ρ)): [-2, -2.4 (clipped), 0.8 (clipped), 1.1, 5.0, masked]
    np.testing.assert_allclose(np.asarray(loss), [-2.0, -2.4, 0.8, 1.1, 5.0, 0.0], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(stats["clipped"]), [0, 1, 1, 0, 0, 0])
    np.testing.assert_allclose(
        np.asarray(stats["approx_kl"]),
        0.5 * np.where(np.asarray(mask), np.asarray(logp) ** 2, 0),
        rtol=1e-6,
    )
    ratio = np.array([1.0, 1.5, 0.5, 1.1, 5.0])
    np.testing.assert_allclose(
        np.asarray(stats["approx_kl_k3"])[:5], ratio - 1 - np.log(ratio), rtol=1e-5, atol=1e-7
    )
    # Dual clip with c = 3 bounds the negative-advantage token with ρ = 5 at 3.
    loss_d, stats_d = ppo_policy_loss(logp, old, adv, mask, clip_eps=0.2, dual_clip=3.0)
    np.testing.assert_allclose(np.asarray(loss_d), [-2.0, -2.4, 0.8, 1.1, 3.0, 0.0], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(stats_d["clipped_dual"]), [0, 0, 0, 0, 1, 0])
    # Clip-higher: ε_high = 0.6 leaves ρ = 1.5 unclipped for A > 0.
    loss_h, _ = ppo_policy_loss(logp, old, adv, mask, clip_eps=0.2, clip_eps_high=0.6)
    assert float(loss_h[1]) == pytest.approx(-3.0)
    # Inside the clip region the gradient is -A ρ (d ρ / d logp = ρ).
    g = jax.grad(lambda lp: jnp.sum(ppo_policy_loss(lp, old, adv, mask)[0]))(logp)
    np.testing.assert_allclose(np.asarray(g), [-2.0, 0.0, 0.0, 1.1, 5.0, 0.0], rtol=1e-6)
    with pytest.raises(ValueError):
        ppo_policy_loss(logp, old, adv, mask, dual_clip=0.5)


def test_ppo_value_loss_closed_form():
    v = jnp.array([1.0, 2.0, 0.0, 3.0])
    v_old = jnp.array([1.0, 1.0, 0.0, 0.0])
    ret = jnp.array([0.0, 0.0, 1.0, 2.0])
    mask = jnp.array([True, True, True, False])
    loss, clipped = ppo_value_loss(v, v_old, ret, mask, clip_eps=0.2)
    # pos 1: unclipped (2-0)^2 = 4, clipped (1.2-0)^2 = 1.44 -> 0.5·4 = 2 (not clipped)
    # pos 0: (1-0)^2 both = 1 -> 0.5
    # pos 2: v = v_old: 1 -> 0.5
    np.testing.assert_allclose(np.asarray(loss), [0.5, 2.0, 0.5, 0.0], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(clipped), [0, 0, 0, 0])
    # A prediction that moved past the clip towards the return: the clipped branch is
    # larger (0.2 - 1.1)^2 > (1 - 1.1)^2 and wins the max.
    loss2, clipped2 = ppo_value_loss(
        jnp.array([1.0, 0.0]),
        jnp.array([0.0, 1.0]),
        jnp.array([1.1, 0.5]),
        jnp.array([True, True]),
        clip_eps=0.2,
    )
    np.testing.assert_allclose(np.asarray(loss2), [0.5 * 0.9**2, 0.5 * 0.5**2], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(clipped2), [1.0, 0.0])
    loss3, _ = ppo_value_loss(v, v_old, ret, mask, clip_eps=None)
    np.testing.assert_allclose(np.asarray(loss3), [0.5, 2.0, 0.5, 0.0], rtol=1e-6)


def test_jit_equals_eager(getkey):
    logp = -jnp.abs(jax.random.normal(getkey(), (6,)))
    old = -jnp.abs(jax.random.normal(getkey(), (6,)))
    adv = jax.random.normal(getkey(), (6,))
    mask = jnp.array([True] * 5 + [False])
    assert_tree_allclose(jax.jit(_ppo_dual)(logp, old, adv, mask), _ppo_dual(logp, old, adv, mask))
    assert_tree_allclose(jax.jit(_value)(logp, old, adv, mask), _value(logp, old, adv, mask))


def test_whiten_advantages():
    adv = jnp.array([[1.0, 2.0, 3.0], [4.0, 100.0, 5.0]])
    mask = jnp.array([[True, True, True], [True, False, True]])
    w = np.asarray(whiten_advantages(adv, mask))
    real = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    expected = (real - real.mean()) / math.sqrt(real.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(w[np.asarray(mask)], expected, rtol=1e-5)
    assert w[1, 1] == 0.0


# --- KL ----------------------------------------------------------------------------------


@given(rt.logprob_arrays(n=2, length=5))
def test_kl_estimators_nonnegative_and_finite(data):
    logp, ref, mask = data
    del mask
    for kind in ("k2", "k3", "abs"):
        kl = np.asarray(kl_penalty(logp, ref, kind=kind))
        assert np.all(np.isfinite(kl)) and np.all(kl >= 0.0), kind
    rt.check_finite(_k3, logp, ref)


def _k3(logp, ref):
    return kl_penalty(logp, ref, kind="k3")


def test_kl_estimators_closed_forms():
    p = np.array([0.5, 0.3, 0.2])
    q = np.array([0.2, 0.2, 0.6])
    exact = float(np.sum(p * np.log(p / q)))
    logp = jnp.log(jnp.asarray(p, jnp.float32))
    ref = jnp.log(jnp.asarray(q, jnp.float32))
    # k1 and k3 are unbiased: their expectation under the policy is KL(p || q).
    for kind in ("k1", "k3"):
        est = float(np.sum(p * np.asarray(kl_penalty(logp, ref, kind=kind))))
        assert est == pytest.approx(exact, rel=1e-5), kind
    lr = np.log(q / p)
    np.testing.assert_allclose(np.asarray(kl_penalty(logp, ref, kind="k2")), 0.5 * lr**2, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(kl_penalty(logp, ref, kind="abs")), np.abs(lr), rtol=1e-5)
    np.testing.assert_allclose(
        np.asarray(kl_penalty(logp, ref, kind="k3")), np.exp(lr) - lr - 1, rtol=1e-5
    )
    # veRL's low_var_kl clamp.
    big = kl_penalty(jnp.array([-30.0]), jnp.array([0.0]), kind="k3", clamp=10.0)
    assert float(big[0]) == 10.0
    with pytest.raises((ValueError, TypeError)):
        kl_penalty(logp, ref, kind="k4")  # pyright: ignore


def test_kl_shaped_rewards():
    logp = jnp.array([-1.0, -2.0, -0.5, -3.0, 0.0])
    ref = jnp.array([-1.5, -1.0, -0.5, -3.0, -9.0])
    mask = jnp.array([False, True, True, True, False])
    r = np.asarray(kl_shaped_rewards(2.0, logp, ref, mask, kl_coef=0.1))
    # k1 = logp - ref: [0.5, -1, 0, 0, 9]; last real position is 3.
    np.testing.assert_allclose(r, [0.0, 0.1, 0.0, 2.0, 0.0], rtol=1e-6, atol=1e-7)
    r3 = np.asarray(kl_shaped_rewards(2.0, logp, ref, mask, kl_coef=0.1, kind="k3"))
    k3 = math.exp(1.0) - 1.0 - 1.0  # log r = ref - logp = 1 at position 1
    np.testing.assert_allclose(r3, [0.0, -0.1 * k3, 0.0, 2.0, 0.0], rtol=1e-5, atol=1e-7)
    empty = kl_shaped_rewards(2.0, logp, ref, jnp.zeros(5, bool), kl_coef=0.1)
    assert np.all(np.asarray(empty) == 0.0)


def test_kl_controllers():
    state = KLControllerState(0.2)
    up = adaptive_kl_update(state, 12.0, 256, target=6.0, horizon=10000)
    assert float(up.coef) == pytest.approx(0.2 * (1 + 0.2 * 256 / 10000), rel=1e-6)
    down = adaptive_kl_update(state, 5.7, 256, target=6.0, horizon=10000)
    assert float(down.coef) == pytest.approx(0.2 * (1 + (5.7 / 6 - 1) * 256 / 10000), rel=1e-6)
    assert float(fixed_kl_update(state, 100.0, 256).coef) == pytest.approx(0.2)
    assert float(state.coef) == pytest.approx(0.2)  # pure: the input is unchanged
    jitted = jax.jit(lambda s, kl: adaptive_kl_update(s, kl, 256, target=6.0, horizon=10000))
    assert_tree_allclose(jitted(state, jnp.asarray(12.0)), up)


def test_ppo_step_aggregation_matches_trl_masked_mean(getkey):
    # TRL: pg_loss = masked_mean(max(pg_losses, pg_losses2), mask) over the minibatch.
    B, T = 3, 5
    logp = -jnp.abs(jax.random.normal(getkey(), (B, T)))
    old = -jnp.abs(jax.random.normal(getkey(), (B, T)))
    adv = jax.random.normal(getkey(), (B, T))
    mask = jax.random.bernoulli(getkey(), 0.7, (B, T)).at[0, 0].set(True)
    per_token, _ = jax.vmap(_ppo_dual)(logp, old, adv, mask)
    ratio = np.exp(np.asarray(logp) - np.asarray(old))
    a = np.asarray(adv)
    pg = np.maximum(-a * ratio, -a * np.clip(ratio, 0.8, 1.2))
    pg = np.where(a < 0, np.minimum(pg, -a * 3.0), pg)
    m = np.asarray(mask)
    assert float(aggregate(per_token, mask, mode="token-mean")) == pytest.approx(
        float(pg[m].mean()), rel=1e-5
    )


def test_traced_clip_eps_and_kl_coef_under_jit(getkey):
    T = 7
    logp = -jnp.abs(jax.random.normal(getkey(), (T,)))
    old = logp + 0.4 * jax.random.normal(getkey(), (T,))
    adv = jax.random.normal(getkey(), (T,))
    v, v_old, ret = (jax.random.normal(getkey(), (T,)) for _ in range(3))
    mask = jnp.arange(T) < 5

    @jax.jit
    def f(eps, eps_high, dual, kl_coef):
        pol, _ = ppo_policy_loss(
            logp, old, adv, mask, clip_eps=eps, clip_eps_high=eps_high, dual_clip=dual
        )
        val, _ = ppo_value_loss(v, v_old, ret, mask, clip_eps=eps)
        shaped = kl_shaped_rewards(1.0, logp, old, mask, kl_coef=kl_coef, kind="k3")
        return pol, val, shaped

    for eps, eps_high, dual, kl_coef in ((0.1, 0.3, 2.0, 0.05), (0.25, 0.25, 3.0, 0.5)):
        got = f(*(jnp.asarray(x) for x in (eps, eps_high, dual, kl_coef)))
        want = (
            ppo_policy_loss(
                logp, old, adv, mask, clip_eps=eps, clip_eps_high=eps_high, dual_clip=dual
            )[0],
            ppo_value_loss(v, v_old, ret, mask, clip_eps=eps)[0],
            kl_shaped_rewards(1.0, logp, old, mask, kl_coef=kl_coef, kind="k3"),
        )
        assert_tree_allclose(got, want)
    # vmap over a traced clip_eps equals one call per value.
    swept = jax.vmap(lambda e: ppo_policy_loss(logp, old, adv, mask, clip_eps=e)[0])(
        jnp.array([0.1, 0.2])
    )
    for i, e in enumerate((0.1, 0.2)):
        assert_tree_allclose(swept[i], ppo_policy_loss(logp, old, adv, mask, clip_eps=e)[0])


def test_python_clip_values_are_validated():
    x = jnp.zeros(3)
    m = jnp.ones(3, bool)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        ppo_policy_loss(x, x, x, m, dual_clip=1.0)
    with pytest.raises(ValueError, match="clip_eps must be non-negative"):
        ppo_value_loss(x, x, x, m, clip_eps=-0.1)
    with pytest.raises((ValueError, TypeCheckError), match="k4"):
        kl_penalty(x, x, kind="k4")  # pyright: ignore


@pytest.mark.parametrize("bad", [dict(target=0.0), dict(horizon=0), dict(target=-1.0)])
def test_adaptive_kl_update_refuses_non_positive_target_and_horizon(bad):
    """`target=0` gave a NaN coefficient (0 / 0) with a KL of 0."""
    kw = dict(target=6.0, horizon=10000) | bad
    with pytest.raises(ValueError, match="must be positive"):
        adaptive_kl_update(KLControllerState(0.1), 0.0, 256, **kw)
