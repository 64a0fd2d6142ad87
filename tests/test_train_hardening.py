"""Steps under bad or unusual input: entropy alignment, weight-decay mask, sampling
temperature, donation safety, build-time validation, scalar reward models, non-finite
updates, token-id checks, traced hyperparameters."""

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import ADAM_EPS, assert_adam_steps_agree
from test_train_common import (
    VOCAB,
    CumMeanLM,
    CumMeanValue,
    leaves_equal,
    preference_batch,
    sequence_batch,
    tiny_config,
)

import rlhf_eqx as rx
from rlhf_eqx.train import (
    GRPOBatch,
    compute_reference_logps,
    decay_mask,
    init_train_state,
    make_dpo_step,
    make_grpo_step,
    make_optimizer,
    make_ppo_step,
    make_reward_step,
    make_sft_step,
    prepare_ppo_batch,
)

# ----------------------------------------------------------------------------- entropy


def test_ppo_and_grpo_entropy_counts_the_first_completion_token(getkey):
    """The entropy of token t is that of the distribution that predicted it, first
    completion token included."""
    policy = CumMeanLM(getkey())
    value = CumMeanValue(getkey())
    B, T, P = 2, 6, 3
    tokens = jax.random.randint(getkey(), (B, T), 0, VOCAB)
    mask = jnp.ones((B, T), bool)
    cm = jnp.arange(T)[None, :] >= P
    cm = jnp.broadcast_to(cm, (B, T))
    ent = jax.vmap(lambda t, m: rx.token_entropy(policy, t, m))(tokens, mask)
    expected = float(jnp.sum(jnp.where(cm, ent, 0.0))) / float(jnp.sum(cm))
    assert float(ent[0, P]) > 0.1  # the first completion token has a real entropy

    batch, _ = prepare_ppo_batch(
        (policy, value), policy, tokens, mask, cm, jnp.zeros(B), kl_coef=0.0
    )
    _, _, m = make_ppo_step(optax.sgd(0.0))(
        (policy, value), optax.sgd(0.0).init((policy, value)), batch
    )
    np.testing.assert_allclose(float(m["policy/entropy"]), expected, rtol=1e-5)

    g = GRPOBatch(tokens=tokens, mask=mask, completion_mask=cm, rewards=jnp.asarray([0.0, 1.0]))
    _, _, m = make_grpo_step(optax.sgd(0.0), group_size=2, mode="token-mean")(
        policy, optax.sgd(0.0).init(policy), g
    )
    np.testing.assert_allclose(float(m["entropy"]), expected, rtol=1e-5)


# ----------------------------------------------------------------------------- weight decay


def test_weight_decay_spares_stacked_norms_and_biases(getkey):
    cfg = rx.TransformerConfig(
        vocab_size=VOCAB,
        d_model=32,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        max_seq_len=16,
        attn_bias=True,
    )
    policy = rx.Policy(cfg, key=getkey())
    layers = policy.transformer.layers
    assert layers.attn_norm.ndim == 2 and layers.bqkv.ndim == 2  # stacked [L, ...]
    mask = decay_mask(policy)
    assert not mask.transformer.layers.attn_norm and not mask.transformer.layers.mlp_norm
    assert not mask.transformer.layers.bqkv and not mask.transformer.final_norm
    assert mask.transformer.layers.wqkv and mask.transformer.layers.w_down
    assert mask.transformer.embed

    # One AdamW step with zero gradients moves only the decayed leaves.
    opt = make_optimizer(
        learning_rate=0.1, total_steps=10, weight_decay=0.5, max_grad_norm=None, schedule="constant"
    )
    params = eqx.filter(policy, eqx.is_inexact_array)
    state = opt.init(params)
    zeros = jax.tree.map(jnp.zeros_like, params)
    with jax.numpy_dtype_promotion("standard"):
        updates, _ = opt.update(zeros, state, params)
    new = eqx.apply_updates(policy, updates)
    np.testing.assert_array_equal(new.transformer.layers.attn_norm, layers.attn_norm)
    np.testing.assert_array_equal(new.transformer.layers.bqkv, layers.bqkv)
    np.testing.assert_array_equal(new.transformer.final_norm, policy.transformer.final_norm)
    assert not np.allclose(new.transformer.layers.wqkv, layers.wqkv)


# ----------------------------------------------------------------------------- temperature


@pytest.mark.parametrize("step_temperature, exact", [(0.7, True), (1.0, False)])
def test_on_policy_ratio_is_one_at_the_sampling_temperature(getkey, step_temperature, exact):
    policy = rx.Policy(tiny_config(), key=getkey())
    value = rx.ValueModel.from_policy(policy, key=getkey())
    prompt = jax.random.randint(getkey(), (4, 3), 3, VOCAB)
    out = rx.generate_batch(
        policy, prompt, jnp.ones_like(prompt, bool), getkey(), max_new_tokens=6, temperature=0.7
    )
    cm = out.completion_mask & out.mask
    batch, _ = prepare_ppo_batch(
        (policy, value),
        policy,
        out.tokens,
        out.mask,
        cm,
        jnp.ones(4),
        kl_coef=0.05,
        temperature=0.7,
    )
    # The sampler and the rollout agree on the log-probabilities.
    np.testing.assert_allclose(
        np.asarray(batch.old_logp), np.asarray(jnp.where(cm, out.logprobs, 0)), atol=2e-5
    )
    step = make_ppo_step(optax.sgd(0.0), temperature=step_temperature)
    _, _, m = step((policy, value), optax.sgd(0.0).init((policy, value)), batch)
    if exact:
        np.testing.assert_allclose(float(m["policy/ratio"]), 1.0, atol=1e-6)
        np.testing.assert_allclose(float(m["policy/approxkl"]), 0.0, atol=1e-7)
    else:
        assert abs(float(m["policy/approxkl"])) > 1e-4

    g = GRPOBatch(
        tokens=out.tokens,
        mask=out.mask,
        completion_mask=cm,
        rewards=jnp.asarray([0.0, 1.0, 1.0, 0.0]),
        old_logp=out.logprobs,
    )
    _, _, mg = make_grpo_step(optax.sgd(0.0), group_size=2, temperature=step_temperature)(
        policy, optax.sgd(0.0).init(policy), g
    )
    assert (float(mg["clip_ratio"]) == 0.0) or not exact


# ----------------------------------------------------------------------------- donation


def test_direct_calls_never_delete_the_callers_arrays(getkey):
    policy = rx.Policy(tiny_config(), key=getkey())
    batch = preference_batch(getkey(), B=2, T=8)
    opt = make_optimizer(learning_rate=1e-2, total_steps=5)
    params = policy
    # The same arrays as params and reference, even when donation is asked for.
    step = make_dpo_step(opt, donate=True)
    new, _, _ = step(
        params, opt.init(eqx.filter(params, eqx.is_inexact_array)), batch, reference=params
    )
    assert np.isfinite(np.asarray(policy.transformer.embed)).all()
    # A reward model sharing its base with the policy, called directly.
    rm = rx.RewardModel.from_policy(policy, key=getkey())
    rstep = make_reward_step(opt)
    rstep(rm, opt.init(eqx.filter(rm, eqx.is_inexact_array)), batch)
    assert np.isfinite(np.asarray(policy.transformer.layers.wqkv)).all()
    # A policy and a value model sharing arrays, through a donating TrainState.
    value = rx.ValueModel.from_policy(policy, key=getkey())
    state = init_train_state((policy, value), opt)
    seq = sequence_batch(getkey(), B=2, T=8)
    ppo_batch, _ = prepare_ppo_batch(
        (policy, value), policy, seq.tokens, seq.mask, seq.completion_mask, jnp.ones(2), kl_coef=0.1
    )
    pstep = make_ppo_step(opt)
    for _ in range(2):
        state, m = state.apply(pstep, ppo_batch)
    assert np.isfinite(float(m["loss"]))
    assert np.isfinite(np.asarray(policy.transformer.embed)).all()


def test_train_state_apply_donates_its_own_buffers(getkey):
    model = CumMeanLM(getkey())
    opt = make_optimizer(learning_rate=1e-2, total_steps=5)
    state = init_train_state(model, opt)
    old = state.params.head
    state, _ = state.apply(make_sft_step(opt), sequence_batch(getkey()))
    assert old.is_deleted()  # updated in place
    state, _ = state.apply(make_sft_step(opt), sequence_batch(getkey()), donate=False)
    assert not state.params.head.is_deleted()


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda o: make_dpo_step(o, loss_type="sigmod"), "loss_type"),
        (lambda o: make_dpo_step(o, beta=-0.1), "beta"),
        (lambda o: make_dpo_step(o, beta=math.inf), "beta"),
        (lambda o: make_dpo_step(o, label_smoothing=0.7), "label_smoothing"),
        (lambda o: make_dpo_step(o, reference="ref"), "reference"),
        (lambda o: make_sft_step(o, mode="mean"), "mode"),
        (lambda o: make_sft_step(o, micro_batches=2.0), "micro_batches"),
        (lambda o: make_sft_step(o, micro_batches=0), "micro_batches"),
        (lambda o: make_grpo_step(o, group_size=0), "group_size"),
        (lambda o: make_grpo_step(o, group_size=2.5), "group_size"),
        (lambda o: make_grpo_step(o, group_size=2, beta=-1.0), "beta"),
        (lambda o: make_grpo_step(o, group_size=2, clip_eps=-0.2), "clip_eps"),
        (lambda o: make_grpo_step(o, group_size=2, scale="groups"), "scale"),
        (lambda o: make_ppo_step(o, clip_eps=-0.2), "clip_eps"),
        (lambda o: make_ppo_step(o, vf_coef=-1.0), "vf_coef"),
        (lambda o: make_ppo_step(o, temperature=0.0), "temperature"),
        (lambda o: make_ppo_step(o, mode="token-mean", constant=3.0), "constant"),
        (lambda o: make_reward_step(o, center_coef=-1.0), "center_coef"),
        (lambda o: make_sft_step(o, nonfinite="ignore"), "nonfinite"),
        (lambda o: make_optimizer(learning_rate=-1.0, total_steps=10), "learning_rate"),
        (lambda o: make_optimizer(learning_rate=math.inf, total_steps=10), "learning_rate"),
        (lambda o: make_optimizer(learning_rate=1e-3, total_steps=0), "total_steps"),
    ],
)
def test_invalid_hyperparameters_fail_at_build_time(build, match):
    # A ValueError from the builder's checks, or the shape/type checker's TypeCheckError
    # (a TypeError) when the annotation already excludes the value; both name it.
    with pytest.raises((ValueError, TypeError), match=match):
        build(optax.sgd(1.0))


def test_reward_step_refuses_a_model_without_a_scalar_head(getkey):
    policy = rx.Policy(tiny_config(), key=getkey())
    batch = preference_batch(getkey(), B=2, T=8)
    step = make_reward_step(optax.sgd(1e-3))
    with pytest.raises(ValueError, match="one scalar per sequence.*Policy"):
        step(policy, optax.sgd(1e-3).init(policy), batch)


# ----------------------------------------------------------------------------- non-finite


def _cached_batch(getkey, policy, B=4):
    batch = compute_reference_logps(policy, preference_batch(getkey(), B=B, T=10))
    return batch


def test_nonfinite_reference_skips_the_update_and_is_counted(getkey):
    policy = CumMeanLM(getkey())
    batch = _cached_batch(getkey, policy)
    bad = eqx.tree_at(lambda b: b.ref_chosen_logp, batch, batch.ref_chosen_logp.at[1].set(jnp.nan))
    opt = make_optimizer(learning_rate=1e-2, total_steps=10)
    state = init_train_state(policy, opt)
    step = make_dpo_step(opt, reference="cached")
    before = jax.tree.map(np.asarray, (state.params, state.opt_state))
    state, m = state.apply(step, bad)
    assert float(m["nonfinite"]) == 1.0 and int(state.skipped) == 1
    assert leaves_equal((state.params, state.opt_state), before)
    state, m = state.apply(step, batch)
    assert float(m["nonfinite"]) == 0.0 and int(state.skipped) == 1
    assert not leaves_equal(state.params, before[0])


@pytest.mark.parametrize("what", ["lr", "beta"])
def test_infinite_hyperparameters_never_reach_the_parameters(getkey, what):
    policy = CumMeanLM(getkey())
    batch = _cached_batch(getkey, policy)
    # Arrays skip build-time validation (they may be traced): the guard catches them.
    lr = jnp.asarray(jnp.inf if what == "lr" else 1e-2)
    beta = jnp.asarray(jnp.inf if what == "beta" else 0.1)
    opt = make_optimizer(learning_rate=lr, total_steps=10, warmup_ratio=0.0)
    step = make_dpo_step(opt, beta=beta, reference="cached")
    params = eqx.filter(policy, eqx.is_inexact_array)
    new, _, m = step(policy, opt.init(params), batch)
    assert float(m["nonfinite"]) == 1.0
    assert leaves_equal(new, policy)


def test_nonfinite_raise_mode_stops(getkey):
    policy = CumMeanLM(getkey())
    batch = _cached_batch(getkey, policy)
    bad = eqx.tree_at(lambda b: b.ref_rejected_logp, batch, batch.ref_rejected_logp * jnp.nan)
    step = make_dpo_step(optax.sgd(1e-2), reference="cached", nonfinite="raise")
    with pytest.raises(Exception, match="non-finite"):
        out = step(policy, optax.sgd(1e-2).init(policy), bad)
        jax.block_until_ready(out)


def test_opt_in_token_id_check_inside_the_step(getkey):
    policy = CumMeanLM(getkey())
    batch = sequence_batch(getkey())
    bad = eqx.tree_at(lambda b: b.tokens, batch, batch.tokens.at[1, 2].set(VOCAB))
    step = make_sft_step(optax.sgd(1e-2), check_token_ids=VOCAB)
    step(policy, optax.sgd(1e-2).init(policy), batch)  # fine
    with pytest.raises(Exception, match=rf"token id outside \[0, {VOCAB}\)"):
        jax.block_until_ready(step(policy, optax.sgd(1e-2).init(policy), bad))


# --------------------------------------------------------------------------- traced hyperparameters


def _dpo_run(policy, batches, beta, lr):
    # Adam's eps = ADAM_EPS: the vmapped run's reductions may add in another order, and
    # the parameters then agree within a bound scaled by the learning rate
    opt = make_optimizer(learning_rate=lr, total_steps=5, warmup_ratio=0.2, eps=ADAM_EPS)
    step = make_dpo_step(opt, beta=beta, reference="cached")
    state = init_train_state(policy, opt)

    def body(state, batch):
        state, m = state.apply(step, batch)
        return state, m["loss"]

    state, losses = jax.lax.scan(body, state, batches)
    return state.params, losses


def test_a_whole_dpo_run_vmaps_over_beta_and_learning_rate(getkey):
    policy = CumMeanLM(getkey())
    one = [_cached_batch(getkey, policy) for _ in range(5)]
    batches = jax.tree.map(lambda *xs: jnp.stack(xs), *one)
    betas = jnp.asarray([0.05, 0.1, 0.5, 1.0])
    lrs = jnp.asarray([1e-3, 3e-3, 1e-2, 3e-2])
    run = jax.jit(jax.vmap(lambda b, lr: _dpo_run(policy, batches, b, lr)))
    params, losses = run(betas, lrs)
    for i in range(4):
        p_i, l_i = _dpo_run(policy, batches, float(betas[i]), float(lrs[i]))
        p_vmapped = jax.tree.map(lambda x: x[i], params)
        assert_adam_steps_agree(p_vmapped, p_i, lr=float(lrs[i]), steps=5)
        np.testing.assert_allclose(np.asarray(losses[i]), np.asarray(l_i), rtol=2e-5, atol=1e-6)
    assert not np.allclose(np.asarray(losses[0]), np.asarray(losses[3]))


def test_updates_keep_the_parameter_dtype(getkey):
    """A float32 optimiser update of bfloat16 weights leaves them bfloat16 (as
    `optax.apply_updates` does; under strict dtype promotion the sum was an error, under
    the standard rules it made them float32), so the next call reuses the compiled step
    instead of retracing it with weights of twice the memory. A reward model mixes a
    bfloat16 backbone with a float32 head: its gradient norm is taken in float32."""
    cfg = dataclasses.replace(tiny_config(), dtype="bfloat16")
    policy = rx.Policy(cfg, key=getkey())
    opt = rx.train.make_optimizer(learning_rate=1e-2, total_steps=10, max_grad_norm=1.0)
    dtypes = lambda m: [x.dtype for x in jax.tree.leaves(eqx.filter(m, eqx.is_inexact_array))]
    traces = []

    def loss_fn(params, frozen, batch, key):
        traces.append(1)  # runs once per trace
        lp = jax.vmap(rx.logprobs_from_logits)(
            params(batch.tokens, batch.mask), batch.tokens, batch.mask
        )
        return {"nll": -jnp.sum(lp)}, {"nll": jnp.sum(batch.mask)}, {}

    pairs = preference_batch(getkey())
    cases = [
        (rx.train.make_step(loss_fn, opt), policy, sequence_batch(getkey()), {}),
        (make_dpo_step(opt), policy, pairs, {"reference": policy}),
        (rx.train.make_reward_step(opt), rx.RewardModel(cfg, key=getkey()), pairs, {}),
    ]
    for step, model, batch, extra in cases:
        state = init_train_state(model, opt)
        for _ in range(3):
            state, metrics = state.apply(step, batch, **extra)
            assert float(metrics["nonfinite"]) == 0.0
            assert np.isfinite(float(metrics["grad_norm"]))
            assert dtypes(state.model) == dtypes(model)
        assert not leaves_equal(state.model, model)  # the weights did move
    assert len(traces) == 1


def test_float16_trainable_weights_are_refused_and_lora_on_a_float16_base_trains(getkey):
    """Adam on float16 weights underflows (epsilon and small second moments), so every
    update was skipped as non-finite: the step refuses them by name, while float32 LoRA
    adapters on a float16 base train."""
    cfg = dataclasses.replace(tiny_config(), dtype="float16")
    policy = rx.Policy(cfg, key=getkey())
    opt = rx.train.make_optimizer(learning_rate=1e-2, total_steps=10)
    batch = sequence_batch(getkey())
    with pytest.raises(ValueError, match="float16 trainable weights"):
        init_train_state(policy, opt).apply(make_sft_step(opt), batch)
    lora = rx.apply_lora(
        policy, rx.LoRAConfig(rank=2, alpha=4.0, targets=("q", "down")), key=getkey()
    )
    state = init_train_state(lora, opt, filter_spec=rx.lora_filter(lora))
    start = state.params
    for _ in range(2):
        state, metrics = state.apply(make_sft_step(opt), batch, donate=False)
        assert float(metrics["nonfinite"]) == 0.0
    assert not leaves_equal(state.params, start)
