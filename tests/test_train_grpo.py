"""GRPO step: advantages, exact micro-batching for every aggregation mode, reference KL,
truncated-completion masking, training sanity."""

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
    leaves_equal,
    sequence_batch,
    sgd_delta,
    traces,
)

import rlhf_eqx as rx
from rlhf_eqx.losses import group_advantages
from rlhf_eqx.train import (
    GRPOBatch,
    grpo_advantages,
    init_train_state,
    make_grpo_step,
    make_optimizer,
)


def _batch(key, policy, *, B=4, ref=None, truncated=None):
    k1, k2 = jax.random.split(key)
    s = sequence_batch(k1, B=B, T=10)
    old = jax.vmap(lambda t, m: rx.token_logprobs(policy, t, m))(s.tokens, s.mask)
    # Perturb the sampling log-probs so that some ratios leave the clip range.
    old = old + 0.3 * jax.random.normal(k2, old.shape)
    rewards = jnp.asarray([1.0, 0.0, 0.5, 2.0, 0.0, 1.0, 1.0, 0.0][:B])
    ref_logp = None
    if ref is not None:
        ref_logp = jax.vmap(lambda t, m: rx.token_logprobs(ref, t, m))(s.tokens, s.mask)
    return GRPOBatch(
        tokens=s.tokens,
        mask=s.mask,
        completion_mask=s.completion_mask,
        rewards=rewards,
        old_logp=old,
        ref_logp=ref_logp,
        truncated=truncated,
    )


def test_grpo_advantages_are_grouped():
    r = jnp.asarray([1.0, 0.0, 3.0, 3.0, 2.0, 0.0])
    a = grpo_advantages(r, group_size=2, scale="group")
    np.testing.assert_allclose(
        np.asarray(a), np.asarray(group_advantages(r.reshape(3, 2)).reshape(6))
    )
    np.testing.assert_allclose(np.asarray(a[2:4]), 0.0)
    np.testing.assert_allclose(
        np.asarray(grpo_advantages(r, group_size=3, scale="none")),
        np.asarray(r - jnp.repeat(jnp.asarray([4.0 / 3.0, 5.0 / 3.0]), 3)),
        rtol=1e-6,
    )


@pytest.mark.parametrize(
    "mode",
    [
        m if m in ("token-mean", "seq-mean-token-mean") else pytest.param(m, marks=pytest.mark.slow)
        for m in MODES
    ],
)
def test_grpo_micro_batches_match_full_batch(getkey, mode):
    policy, ref = CumMeanLM(getkey()), CumMeanLM(getkey())
    batch = _batch(getkey(), policy, ref=ref)
    importance = "sequence" if mode == "seq-mean-token-mean" else "token"
    kw = dict(
        group_size=2, mode=mode, beta=0.05, clip_eps_high=0.28, importance=importance, donate=False
    )
    full, m_full = sgd_delta(make_grpo_step(optax.sgd(1.0), **kw), policy, batch)
    micro, m_micro = sgd_delta(make_grpo_step(optax.sgd(1.0), micro_batches=2, **kw), policy, batch)
    assert_tree_allclose(micro, full, atol=1e-5)
    for name in m_full:
        np.testing.assert_allclose(float(m_micro[name]), float(m_full[name]), rtol=1e-5, atol=1e-6)
    if importance == "token":
        assert float(m_full["clip_ratio"]) > 0.0
    assert float(m_full["kl"]) > 0.0
    assert {"loss", "clip_ratio", "kl", "entropy", "grad_norm", "reward", "reward_std"} <= set(
        m_full
    )


def test_grpo_reference_model_equals_precomputed_ref_logp(getkey):
    policy, ref = CumMeanLM(getkey()), CumMeanLM(getkey())
    with_ref = _batch(getkey(), policy, ref=ref)
    without = eqx.tree_at(lambda b: b.ref_logp, with_ref, None)
    step = make_grpo_step(optax.sgd(1.0), group_size=2, beta=0.1, donate=False)
    a, ma = sgd_delta(step, policy, with_ref)
    b, mb = sgd_delta(step, policy, without, reference=ref)
    assert_tree_allclose(a, b, atol=1e-6)
    np.testing.assert_allclose(float(ma["kl"]), float(mb["kl"]), rtol=1e-6)
    with pytest.raises(ValueError, match="reference"):
        sgd_delta(step, policy, without)


def test_grpo_truncated_completions_are_masked(getkey):
    policy = CumMeanLM(getkey())
    truncated = jnp.asarray([False, True, False, False])
    batch = _batch(getkey(), policy, truncated=truncated)
    step = make_grpo_step(
        optax.sgd(1.0),
        group_size=2,
        mask_truncated_completions=True,
        mode="token-mean",
        donate=False,
    )
    a, ma = sgd_delta(step, policy, batch)
    # Same advantages, but row 1 without completion tokens and no truncation flag.
    adv = grpo_advantages(batch.rewards, group_size=2)
    manual = eqx.tree_at(
        lambda b: (b.completion_mask, b.truncated, b.rewards, b.advantages),
        batch,
        (batch.completion_mask.at[1].set(False), None, None, adv),
        is_leaf=lambda x: x is None,
    )
    b, mb = sgd_delta(
        make_grpo_step(optax.sgd(1.0), group_size=2, mode="token-mean", donate=False),
        policy,
        manual,
    )
    assert_tree_allclose(a, b, atol=1e-6)
    np.testing.assert_allclose(float(ma["loss"]), float(mb["loss"]), rtol=1e-6)


def test_grpo_training_sanity_and_single_trace(getkey):
    policy = counted(CumMeanLM(getkey()))
    batch = _batch(getkey(), policy)
    batch = eqx.tree_at(
        lambda b: b.old_logp,
        batch,
        jax.vmap(lambda t, m: rx.token_logprobs(policy, t, m))(batch.tokens, batch.mask),
    )
    opt = make_optimizer(learning_rate=2e-2, total_steps=30, schedule="constant")
    state = init_train_state(policy, opt)
    step = make_grpo_step(opt, group_size=2, clip_eps_high=0.28)
    state, first = state.apply(step, batch)
    traced = traces(policy)
    for _ in range(20):
        state, metrics = state.apply(step, batch)
    assert traces(policy) == traced
    # Ratio 1 on every token: the loss is minus the mean advantage of the non-empty rows.
    adv = grpo_advantages(batch.rewards, group_size=2)
    rows = jnp.any(batch.completion_mask, axis=-1)
    expected = -float(jnp.sum(jnp.where(rows, adv, 0.0))) / float(jnp.sum(rows))
    np.testing.assert_allclose(float(first["loss"]), expected, rtol=1e-5, atol=1e-6)
    assert float(metrics["loss"]) < float(first["loss"]) - 0.05
    assert float(metrics["clip_ratio"]) > 0.0
    assert not leaves_equal(eqx.filter(state.model, eqx.is_array), eqx.filter(policy, eqx.is_array))


# --- each group's prompt computed once (prompt_length / samples_per_prompt) ------------


def _sampled_groups(key, policy, *, n=3, G=2, P=6, new=7):
    """Left-padded prompts of different lengths, G completions each (EOS stops some)."""
    kp, ks, kr = jax.random.split(key, 3)
    prompts = jax.random.randint(kp, (n, P), 1, policy.cfg.vocab_size)
    lengths = jnp.asarray([P, P - 2, 1][:n])
    pmask = jnp.arange(P)[None, :] >= (P - lengths)[:, None]
    out = rx.generate_batch(
        policy, prompts, pmask, ks, max_new_tokens=new, temperature=1.0, num_samples=G, eos_id=3
    )
    rewards = jax.random.normal(kr, (n * G,))
    return out, rewards


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(beta=0.2, temperature=0.7, micro_batches=3),
        dict(importance="sequence", mode="token-mean"),
    ],
)
def test_grpo_shared_prompt_equals_one_row_per_completion(getkey, kw):
    cfg = rx.TransformerConfig(
        vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=64
    )
    policy, ref = rx.Policy(cfg, key=getkey()), rx.Policy(cfg, key=getkey())
    G, P = 2, 6
    out, rewards = _sampled_groups(getkey(), policy, G=G, P=P)
    fields = dict(
        tokens=out.tokens, mask=out.mask, completion_mask=out.completion_mask, rewards=rewards
    )
    plain = GRPOBatch(**fields)
    shared = GRPOBatch(**fields, prompt_length=P, samples_per_prompt=G)
    opt = optax.sgd(1.0)
    step = make_grpo_step(opt, group_size=G, **kw)
    state = opt.init(eqx.filter(policy, eqx.is_inexact_array))
    p1, _, m1 = step(policy, state, plain, reference=ref)
    p2, _, m2 = step(policy, state, shared, reference=ref)
    assert float(m1["entropy"]) > 0.0
    assert_tree_allclose(m2, m1, rtol=1e-4, atol=1e-5)
    assert_tree_allclose(p2, p1, rtol=1e-4, atol=1e-6)


def test_grpo_shared_prompt_is_validated(getkey):
    cfg = rx.TransformerConfig(
        vocab_size=40, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=24, max_seq_len=32
    )
    policy = rx.Policy(cfg, key=getkey())
    out, rewards = _sampled_groups(getkey(), policy, G=2, P=6)
    fields = dict(
        tokens=out.tokens, mask=out.mask, completion_mask=out.completion_mask, rewards=rewards
    )
    with pytest.raises(rx.data.DataError, match="both"):
        GRPOBatch(**fields, prompt_length=6)
    with pytest.raises(rx.data.DataError, match=r"group 1"):
        GRPOBatch(
            **dict(fields, tokens=out.tokens.at[3, 5].add(1)), prompt_length=6, samples_per_prompt=2
        )
    with pytest.raises(rx.data.DataError, match="not a multiple"):
        GRPOBatch(**fields, prompt_length=6, samples_per_prompt=4)
    with pytest.raises(rx.data.DataError, match="completion tokens inside"):
        GRPOBatch(**fields, prompt_length=7, samples_per_prompt=2)
    with pytest.raises(rx.data.DataError, match="no completion"):
        GRPOBatch(**fields, prompt_length=out.tokens.shape[1], samples_per_prompt=2)
    shared = GRPOBatch(**fields, prompt_length=6, samples_per_prompt=2)
    opt = optax.sgd(1.0)
    state = opt.init(eqx.filter(policy, eqx.is_inexact_array))
    with pytest.raises(ValueError, match="group_size=3"):
        make_grpo_step(opt, group_size=3)(policy, state, shared)
    with pytest.raises(ValueError, match="whole groups"):
        make_grpo_step(opt, group_size=2, micro_batches=6)(policy, state, shared)
