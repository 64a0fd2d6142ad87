"""DPO step: ln 2 at the start, cached == on-the-fly reference, exact micro-batching,
frozen reference, RPO, batch-level loss types, custom models."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_tree_allclose
from test_train_common import (
    CumMeanLM,
    counted,
    leaves_equal,
    preference_batch,
    sgd_delta,
    tiny_config,
    traces,
)

import rlhf_eqx as rx
from rlhf_eqx.losses import dpo_loss
from rlhf_eqx.train import (
    compute_reference_logps,
    init_train_state,
    make_dpo_step,
    make_optimizer,
    sequence_logps,
)


def test_dpo_transformer_starts_at_ln2_and_learns_with_frozen_reference(getkey):
    policy = counted(rx.Policy(tiny_config(), key=getkey()))
    reference = policy  # the same weights: the state copies its trainable buffers
    batch = preference_batch(getkey(), B=4, T=12)
    opt = make_optimizer(learning_rate=1e-2, total_steps=20)
    state = init_train_state(policy, opt)
    ref_before = jax.tree.map(np.asarray, eqx.filter(reference, eqx.is_array))
    step = make_dpo_step(opt, beta=0.5)
    state, first = state.apply(step, batch, reference=reference)
    traced = traces(policy)
    np.testing.assert_allclose(float(first["loss"]), math.log(2.0), rtol=1e-6)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        np.testing.assert_allclose(float(first[name]), 0.0, atol=1e-6)
    for _ in range(15):
        state, metrics = state.apply(step, batch, reference=reference)
    assert traces(policy) == traced, "the step was traced more than once"
    assert float(metrics["loss"]) < 0.3
    assert float(metrics["rewards/accuracies"]) == 1.0
    assert float(metrics["rewards/margins"]) > 0.0
    # The reference was never updated (nor donated).
    assert leaves_equal(eqx.filter(reference, eqx.is_array), ref_before)
    expected = {
        "loss",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "rewards/accuracies",
        "logps/chosen",
        "logps/rejected",
        "logits/chosen",
        "logits/rejected",
        "grad_norm",
        "learning_rate",
    }
    assert expected <= set(metrics)


def _direct_loss(model, ref, batch, beta):
    c = sequence_logps(model, batch.chosen_tokens, batch.chosen_mask, batch.chosen_completion_mask)
    r = sequence_logps(
        model, batch.rejected_tokens, batch.rejected_mask, batch.rejected_completion_mask
    )
    rc = sequence_logps(ref, batch.chosen_tokens, batch.chosen_mask, batch.chosen_completion_mask)
    rr = sequence_logps(
        ref, batch.rejected_tokens, batch.rejected_mask, batch.rejected_completion_mask
    )
    return jnp.mean(jax.vmap(lambda *a: dpo_loss(*a, beta=beta))(c, r, rc, rr))


def test_dpo_cached_reference_equals_on_the_fly_and_direct_gradient(getkey):
    policy, reference = CumMeanLM(getkey()), CumMeanLM(getkey())
    batch = preference_batch(getkey())
    live, m_live = sgd_delta(
        make_dpo_step(optax.sgd(1.0), beta=0.3, donate=False), policy, batch, reference=reference
    )
    cached_batch = compute_reference_logps(reference, batch)
    assert cached_batch.ref_chosen_logp.shape == (4,)
    step = make_dpo_step(optax.sgd(1.0), beta=0.3, reference="cached", donate=False)
    cached, m_cached = sgd_delta(step, policy, cached_batch)
    assert_tree_allclose(cached, live, atol=1e-6)
    for name in m_live:
        np.testing.assert_allclose(float(m_cached[name]), float(m_live[name]), rtol=1e-6, atol=1e-7)
    loss, grads = eqx.filter_jit(eqx.filter_value_and_grad(_direct_loss))(
        policy, reference, batch, 0.3
    )
    np.testing.assert_allclose(float(m_live["loss"]), float(loss), rtol=1e-6)
    assert_tree_allclose(live, jax.tree.map(lambda g: -g, grads), atol=1e-6)
    assert float(m_live["rewards/accuracies"]) in (0.0, 0.25, 0.5, 0.75, 1.0)
    with pytest.raises(ValueError, match="cached"):
        sgd_delta(step, policy, batch)


@pytest.mark.parametrize(
    "loss_type,rpo_alpha",
    [
        ("sigmoid", 0.5),
        pytest.param("ipo", None, marks=pytest.mark.slow),
        pytest.param("simpo", 1.0, marks=pytest.mark.slow),
    ],
)
def test_dpo_micro_batches_match_full_batch(getkey, loss_type, rpo_alpha):
    policy, reference = CumMeanLM(getkey()), CumMeanLM(getkey())
    batch = compute_reference_logps(reference, preference_batch(getkey()))
    kw = dict(beta=0.2, loss_type=loss_type, rpo_alpha=rpo_alpha, reference="cached", donate=False)
    full, m_full = sgd_delta(make_dpo_step(optax.sgd(1.0), **kw), policy, batch)
    micro, m_micro = sgd_delta(make_dpo_step(optax.sgd(1.0), micro_batches=2, **kw), policy, batch)
    assert_tree_allclose(micro, full, atol=1e-5)
    assert set(m_micro) == set(m_full)
    for name in m_full:
        np.testing.assert_allclose(float(m_micro[name]), float(m_full[name]), rtol=1e-5, atol=1e-6)
    if rpo_alpha is not None:
        assert "nll_loss" in m_full
        assert float(m_full["nll_loss"]) > 0.0


def test_dpo_rpo_adds_weighted_chosen_nll(getkey):
    policy = CumMeanLM(getkey())
    batch = compute_reference_logps(policy, preference_batch(getkey()))
    base = make_dpo_step(optax.sgd(0.0), reference="cached", donate=False)
    rpo = make_dpo_step(optax.sgd(0.0), reference="cached", rpo_alpha=0.7, donate=False)
    _, m0 = sgd_delta(base, policy, batch)
    _, m1 = sgd_delta(rpo, policy, batch)
    cm = batch.chosen_completion_mask & batch.chosen_mask
    logp = jax.vmap(lambda t, m: rx.token_logprobs(policy, t, m))(
        batch.chosen_tokens, batch.chosen_mask
    )
    nll = -float(jnp.sum(jnp.where(cm, logp, 0.0))) / float(jnp.sum(cm))
    np.testing.assert_allclose(float(m1["nll_loss"]), nll, rtol=1e-5)
    np.testing.assert_allclose(float(m1["loss"]), float(m0["loss"]) + 0.7 * nll, rtol=1e-5)


def test_dpo_batch_level_aot_and_its_micro_batch_guard(getkey):
    policy, reference = CumMeanLM(getkey()), CumMeanLM(getkey())
    batch = compute_reference_logps(reference, preference_batch(getkey()))
    _, m = sgd_delta(
        make_dpo_step(optax.sgd(1.0), loss_type="aot", reference="cached", donate=False),
        policy,
        batch,
    )
    assert np.isfinite(float(m["loss"]))
    with pytest.raises(ValueError, match="micro_batches"):
        make_dpo_step(optax.sgd(1.0), loss_type="aot", micro_batches=2)


def test_dpo_lora_style_filter_spec_trains_only_selected_leaves(getkey):
    model = CumMeanLM(getkey())
    spec = eqx.tree_at(lambda m: m.head, jax.tree.map(lambda _: False, model), True)
    opt = make_optimizer(learning_rate=5e-2, total_steps=20, schedule="constant")
    state = init_train_state(model, opt, filter_spec=spec)
    batch = preference_batch(getkey())
    step = make_dpo_step(opt, beta=1.0)
    losses = []
    for _ in range(20):
        state, metrics = state.apply(step, batch, reference=model)
        losses.append(float(metrics["loss"]))
    assert losses[0] == pytest.approx(math.log(2.0), rel=1e-6)
    assert losses[-1] < losses[0] - 0.1
    trained = state.model
    assert leaves_equal(
        (trained.embed, trained.mix, trained.bias), (model.embed, model.mix, model.bias)
    )
    assert not np.allclose(np.asarray(trained.head), np.asarray(model.head))
