"""Reward-model step: training sanity, metrics, exact micro-batching."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_tree_allclose
from test_train_common import (
    CumMeanReward,
    CumMeanValue,
    counted,
    preference_batch,
    sgd_delta,
    tiny_config,
    traces,
)

import rlhf_eqx as rx
from rlhf_eqx.train import init_train_state, make_optimizer, make_reward_step


@pytest.mark.slow
def test_reward_model_learns_preferences_and_compiles_once(getkey):
    model = counted(rx.RewardModel(tiny_config(), key=getkey()))
    batch = preference_batch(getkey(), B=4, T=12)
    opt = make_optimizer(learning_rate=1e-2, total_steps=20, weight_decay=0.01)
    state = init_train_state(model, opt)
    step = make_reward_step(opt)
    state, first = state.apply(step, batch)
    traced = traces(model)
    for _ in range(15):
        state, metrics = state.apply(step, batch)
    assert traces(model) == traced
    assert float(metrics["loss"]) < 0.5 * float(first["loss"])
    assert float(metrics["accuracy"]) == 1.0
    assert float(metrics["margin"]) > 0.0
    np.testing.assert_allclose(
        float(metrics["margin"]),
        float(metrics["rewards/chosen"] - metrics["rewards/rejected"]),
        rtol=1e-5,
    )
    assert {"rewards/mean", "rewards/std", "grad_norm", "learning_rate"} <= set(metrics)


def test_reward_micro_batches_match_full_batch_and_closed_form(getkey):
    model = CumMeanReward(CumMeanValue(getkey()))
    batch = preference_batch(getkey())
    full, m_full = sgd_delta(
        make_reward_step(optax.sgd(1.0), center_coef=0.01, donate=False), model, batch
    )
    micro, m_micro = sgd_delta(
        make_reward_step(optax.sgd(1.0), center_coef=0.01, micro_batches=2, donate=False),
        model,
        batch,
    )
    assert_tree_allclose(micro, full, atol=1e-6)
    for name in m_full:
        np.testing.assert_allclose(float(m_micro[name]), float(m_full[name]), rtol=1e-5, atol=1e-6)
    rc = jax.vmap(model)(batch.chosen_tokens, batch.chosen_mask)
    rr = jax.vmap(model)(batch.rejected_tokens, batch.rejected_mask)
    expected = jnp.mean(-jax.nn.log_sigmoid(rc - rr) + 0.01 * (rc + rr) ** 2)
    np.testing.assert_allclose(float(m_full["loss"]), float(expected), rtol=1e-5)
    np.testing.assert_allclose(
        float(m_full["accuracy"]), float(jnp.mean((rc > rr).astype(jnp.float32)))
    )
    np.testing.assert_allclose(
        float(m_full["rewards/std"]), float(jnp.std(jnp.concatenate([rc, rr]))), rtol=1e-5
    )


def test_reward_custom_model_learns(getkey):
    model = counted(CumMeanReward(CumMeanValue(getkey())))
    batch = preference_batch(getkey())
    opt = make_optimizer(learning_rate=5e-2, total_steps=30, schedule="constant")
    state = init_train_state(model, opt)
    step = make_reward_step(opt, micro_batches=2)
    state, first = state.apply(step, batch)
    traced = traces(model)
    for _ in range(25):
        state, metrics = state.apply(step, batch)
    assert traces(model) == traced
    assert float(metrics["loss"]) < 0.5 * float(first["loss"])
    assert float(metrics["accuracy"]) == 1.0
