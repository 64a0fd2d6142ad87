"""SFT step: training sanity, single compilation, exact micro-batching, custom models."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_tree_allclose
from test_train_common import (
    MODES,
    CumMeanLM,
    counted,
    sequence_batch,
    sgd_delta,
    tiny_config,
    traces,
)

import rlhf_eqx as rx
from rlhf_eqx.losses import aggregate, sft_nll
from rlhf_eqx.train import init_train_state, make_optimizer, make_sft_step


@pytest.mark.slow
def test_sft_transformer_loss_decreases_and_compiles_once(getkey):
    model = counted(rx.Policy(tiny_config(), key=getkey()))
    batch = sequence_batch(getkey(), B=4, T=12)
    opt = make_optimizer(learning_rate=1e-2, total_steps=25, warmup_ratio=0.1)
    state = init_train_state(model, opt)
    step = make_sft_step(opt)
    losses = []
    for i in range(25):
        state, metrics = state.apply(step, batch)
        losses.append(float(metrics["loss"]))
        if i == 0:
            traced = traces(model)
    assert traces(model) == traced, "the step was traced more than once"
    assert losses[-1] < 0.5 * losses[0], losses
    assert float(metrics["mean_token_accuracy"]) > 0.5
    np.testing.assert_allclose(float(metrics["num_tokens"]), float(jnp.sum(batch.completion_mask)))
    np.testing.assert_allclose(float(metrics["nll"]), float(metrics["loss"]), rtol=1e-6)


def _reference_loss(model, batch, mode):
    logp = jax.vmap(lambda t, m: rx.token_logprobs(model, t, m))(batch.tokens, batch.mask)
    m = batch.completion_mask & batch.mask
    return aggregate(jax.vmap(sft_nll)(logp, m), m, mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_sft_micro_batches_match_full_batch_and_direct_gradient(getkey, mode):
    model = CumMeanLM(getkey())
    batch = sequence_batch(getkey(), B=4, T=10)  # row 3 has an empty completion
    full, m_full = sgd_delta(make_sft_step(optax.sgd(1.0), mode=mode, donate=False), model, batch)
    for k in (2, 4) if mode == "token-mean" else (2,):
        step = make_sft_step(optax.sgd(1.0), mode=mode, micro_batches=k, donate=False)
        micro, m_micro = sgd_delta(step, model, batch)
        assert_tree_allclose(micro, full, atol=1e-5)
        for name in ("loss", "nll", "mean_token_accuracy", "grad_norm"):
            np.testing.assert_allclose(
                float(m_micro[name]), float(m_full[name]), rtol=1e-5, atol=1e-6
            )
    loss, grads = eqx.filter_jit(eqx.filter_value_and_grad(_reference_loss))(model, batch, mode)
    np.testing.assert_allclose(float(m_full["loss"]), float(loss), rtol=1e-6)
    assert_tree_allclose(full, jax.tree.map(lambda g: -g, grads), atol=1e-6)


def test_sft_custom_model_learns_and_compiles_once(getkey):
    model = counted(CumMeanLM(getkey()))
    opt = make_optimizer(learning_rate=3e-2, total_steps=40, schedule="constant")
    state = init_train_state(model, opt)
    step = make_sft_step(opt, micro_batches=2)
    batch = sequence_batch(getkey(), B=4)
    state, first = state.apply(step, batch)
    traced = traces(model)
    for _ in range(30):
        # Fresh arrays of the same shapes: no recompilation.
        state, metrics = state.apply(step, jax.tree.map(jnp.copy, batch))
    assert traces(model) == traced
    assert float(metrics["loss"]) < 0.5 * float(first["loss"])


def test_sft_micro_batches_must_divide_batch(getkey):
    model = CumMeanLM(getkey())
    step = make_sft_step(optax.sgd(1.0), micro_batches=3, donate=False)
    with pytest.raises(ValueError, match="divisible"):
        sgd_delta(step, model, sequence_batch(getkey(), B=4))
