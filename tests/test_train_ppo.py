"""PPO: advantages (closed forms), value alignment, exact micro-batching, one vs two
optimisers, combined actor-critic models, training sanity."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_tree_allclose
from test_train_common import (
    MODES,
    CumMeanActorCritic,
    CumMeanLM,
    CumMeanValue,
    counted,
    sequence_batch,
    traces,
)

from rlhf_eqx.train import (
    compute_advantages,
    init_train_state,
    make_optimizer,
    make_ppo_step,
    prepare_ppo_batch,
    token_values,
)


def test_token_values_reads_the_previous_real_position():
    values = jnp.asarray([1.0, 2.0, 3.0, 4.0, 5.0])
    mask = jnp.asarray([False, True, True, False, True])
    np.testing.assert_allclose(np.asarray(token_values(values, mask)), [0.0, 0.0, 2.0, 0.0, 3.0])


def test_compute_advantages_closed_forms(getkey):
    B, T = 3, 6
    cm = jnp.arange(T)[None, :] >= jnp.asarray([2, 3, 6])[:, None]  # last row: empty completion
    scores = jnp.asarray([1.0, -2.0, 5.0])
    logp = jax.random.normal(getkey(), (B, T))
    ref = jax.random.normal(getkey(), (B, T))
    zeros = jnp.zeros((B, T))
    # No KL, γ = λ = 1, V = 0: every completion token's advantage is the score.
    adv, ret, stats = compute_advantages(
        scores, logp, ref, zeros, cm, kl_coef=0.0, gamma=1.0, lam=1.0, whiten=False
    )
    np.testing.assert_allclose(np.asarray(adv), np.asarray(jnp.where(cm, scores[:, None], 0.0)))
    np.testing.assert_allclose(np.asarray(ret), np.asarray(adv))
    kl = jnp.where(cm, logp - ref, 0.0)
    np.testing.assert_allclose(
        float(stats["objective/kl"]), float(jnp.mean(jnp.sum(kl, -1))), rtol=1e-5
    )
    np.testing.assert_allclose(float(stats["objective/scores"]), 4.0 / 3.0, rtol=1e-6)
    # Whitened: zero mean, unit variance over the completion tokens.
    adv_w, _, stats = compute_advantages(scores, logp, ref, zeros, cm, kl_coef=0.1)
    sel = np.asarray(adv_w)[np.asarray(cm)]
    np.testing.assert_allclose(sel.mean(), 0.0, atol=1e-5)
    np.testing.assert_allclose(sel.std(ddof=1), 1.0, rtol=1e-4)
    np.testing.assert_allclose(
        float(stats["objective/non_score_reward"]),
        -0.1 * float(jnp.mean(jnp.sum(kl, -1))),
        rtol=1e-5,
    )


def _rollout(key, model, reference, B=4):
    s = sequence_batch(key, B=B, T=10)
    scores = jnp.asarray([1.0, -1.0, 0.5, 2.0, 0.0, 1.0, -0.5, 0.3][:B])
    batch, stats = prepare_ppo_batch(
        model,
        reference,
        s.tokens,
        s.mask,
        s.completion_mask,
        scores,
        kl_coef=0.05,
        gamma=1.0,
        lam=0.95,
    )
    assert set(stats) >= {"objective/kl", "objective/scores"}
    # Perturb the sampling log-probs so the clipped branches are exercised.
    noise = 0.3 * jax.random.normal(jax.random.fold_in(key, 1), batch.old_logp.shape)
    return eqx.tree_at(
        lambda b: b.old_logp, batch, jnp.where(batch.completion_mask, batch.old_logp + noise, 0.0)
    )


def _delta(step, params, opt, batch):
    opt_state = opt.init(eqx.filter(params, eqx.is_inexact_array))
    new, _, metrics = step(params, opt_state, batch)
    return jax.tree.map(
        lambda a, b: a - b,
        eqx.filter(new, eqx.is_inexact_array),
        eqx.filter(params, eqx.is_inexact_array),
    ), metrics


@pytest.mark.parametrize(
    "mode", [m if m == "token-mean" else pytest.param(m, marks=pytest.mark.slow) for m in MODES]
)
def test_ppo_micro_batches_match_full_batch(getkey, mode):
    params = (CumMeanLM(getkey()), CumMeanValue(getkey()))
    batch = _rollout(getkey(), params, CumMeanLM(getkey()))
    kw = dict(mode=mode, vf_coef=0.5, ent_coef=0.01, clip_eps_high=0.28, donate=False)
    full, m_full = _delta(make_ppo_step(optax.sgd(1.0), **kw), params, optax.sgd(1.0), batch)
    micro, m_micro = _delta(
        make_ppo_step(optax.sgd(1.0), micro_batches=2, **kw), params, optax.sgd(1.0), batch
    )
    assert_tree_allclose(micro, full, atol=1e-5)
    for name in m_full:
        np.testing.assert_allclose(float(m_micro[name]), float(m_full[name]), rtol=1e-5, atol=1e-6)
    assert {
        "loss/policy",
        "loss/value",
        "policy/clipfrac",
        "policy/approxkl",
        "policy/entropy",
        "val/clipfrac",
        "val/vpred",
        "grad_norm",
    } <= set(m_full)
    assert float(m_full["policy/clipfrac"]) > 0.0


def test_ppo_two_optimisers_equal_one_optimiser_without_clipping(getkey):
    params = (CumMeanLM(getkey()), CumMeanValue(getkey()))
    batch = _rollout(getkey(), params, CumMeanLM(getkey()))
    one, m1 = _delta(make_ppo_step(optax.sgd(0.5), donate=False), params, optax.sgd(0.5), batch)
    step2 = make_ppo_step(optax.sgd(0.5), value_optimizer=optax.sgd(0.5), donate=False)
    states = tuple(optax.sgd(0.5).init(eqx.filter(p, eqx.is_inexact_array)) for p in params)
    new, _, m2 = step2(params, states, batch)
    two = jax.tree.map(
        lambda a, b: a - b,
        eqx.filter(new, eqx.is_inexact_array),
        eqx.filter(params, eqx.is_inexact_array),
    )
    assert_tree_allclose(one, two, atol=1e-7)
    np.testing.assert_allclose(float(m1["grad_norm"]), float(m2["grad_norm"]), rtol=1e-6)
    np.testing.assert_allclose(
        float(m2["grad_norm"]) ** 2,
        float(m2["grad_norm/policy"]) ** 2 + float(m2["grad_norm/value"]) ** 2,
        rtol=1e-5,
    )


def test_ppo_combined_actor_critic_learns_and_compiles_once(getkey):
    model = counted(CumMeanActorCritic(getkey()))
    batch = _rollout(getkey(), model, CumMeanLM(getkey()))
    opt = make_optimizer(learning_rate=1e-2, total_steps=30, schedule="constant")
    state = init_train_state(model, opt)
    step = make_ppo_step(opt, vf_coef=0.5)
    state, first = state.apply(step, batch)
    traced = traces(model)
    for _ in range(20):
        state, metrics = state.apply(step, batch)
    assert traces(model) == traced
    assert float(metrics["loss"]) < float(first["loss"]) - 0.05
    assert float(metrics["loss/value"]) < float(first["loss/value"])
    assert float(metrics["policy/clipfrac"]) > 0.0
