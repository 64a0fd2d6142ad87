"""Data parallel with `jax.pmap`: one step on 8 devices equals one step on the whole batch.

Every algorithm's step is built with `axis_name="data"`; the global batch has uneven
masks across devices (rows of very different lengths, an empty completion), so a
per-device mean would differ from the global one.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_updates_agree
from test_train_common import tiny_config, uneven_preferences, uneven_sequences

import rlhf_eqx as rx
from rlhf_eqx.distributed import replicate, shard_batch_for_pmap, unreplicate
from rlhf_eqx.train import (
    GRPOBatch,
    KTOBatch,
    compute_reference_logps,
    make_dpo_step,
    make_grpo_step,
    make_kto_step,
    make_ppo_step,
    make_reward_step,
    make_sft_step,
    prepare_ppo_batch,
)

N_DEV = 8
B = 16
T = 12


def _devices():
    if jax.local_device_count() < N_DEV:
        pytest.skip(f"needs {N_DEV} devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    return jax.local_devices()[:N_DEV]


def _uneven_sequences(key, prompt=3):
    return uneven_sequences(key, B, T, prompt)


def _preferences(key):
    return uneven_preferences(key, B, T)


def _compare(step_dp, step_one, params, opt, batch, **kwargs):
    """Run `step_dp` under pmap on 8 devices and `step_one` on one device; compare the
    updates (with `optax.sgd`, the learning rate times minus the gradient, which the
    maths fixes up to rounding) leaf by leaf, relative to each leaf's largest entry."""
    devices = _devices()
    opt_state = opt.init(eqx.filter(params, eqx.is_inexact_array))
    one_params, _, one_m = step_one(params, opt_state, batch, **kwargs)

    dp = jax.pmap(lambda p, s, b, kw: step_dp(p, s, b, **kw), axis_name="data", devices=devices)
    rep_kwargs = replicate(kwargs, devices)
    dp_params, _, dp_m = dp(
        replicate(params, devices),
        replicate(opt_state, devices),
        shard_batch_for_pmap(batch, N_DEV),
        rep_kwargs,
    )
    # Every replica holds the same parameters ...
    for leaf in jax.tree.leaves(eqx.filter(dp_params, eqx.is_inexact_array)):
        np.testing.assert_allclose(
            np.asarray(leaf[1:]), np.broadcast_to(leaf[:1], leaf[1:].shape), atol=1e-7
        )
    # ... whose update equals the one-device update on the whole batch.
    assert_updates_agree(unreplicate(dp_params), one_params, params)
    moved = jax.tree.map(
        jnp.subtract, *(eqx.filter(p, eqx.is_inexact_array) for p in (one_params, params))
    )
    assert max(float(jnp.max(jnp.abs(u))) for u in jax.tree.leaves(moved)) > 1e-4  # it moved
    for name, value in one_m.items():
        np.testing.assert_allclose(
            np.asarray(dp_m[name][0]), np.asarray(value), rtol=2e-4, atol=2e-5, err_msg=name
        )
    return one_m


def test_pmap_sft_equals_one_device(getkey):
    policy = rx.Policy(tiny_config(), key=getkey())
    tokens, mask, cm = _uneven_sequences(getkey())
    batch = rx.SequenceBatch(tokens=tokens, mask=mask, completion_mask=cm)
    opt = optax.sgd(0.5)
    for mode in ("token-mean", "seq-mean-token-mean"):
        m = _compare(
            make_sft_step(opt, mode=mode, axis_name="data"),
            make_sft_step(opt, mode=mode),
            policy,
            opt,
            batch,
        )
        assert float(m["num_tokens"]) == float(jnp.sum(cm))


def test_pmap_reward_equals_one_device(getkey):
    model = rx.RewardModel(tiny_config(), key=getkey())
    batch = _preferences(getkey())
    opt = optax.sgd(0.5)
    _compare(
        make_reward_step(opt, center_coef=0.01, axis_name="data"),
        make_reward_step(opt, center_coef=0.01),
        model,
        opt,
        batch,
    )


@pytest.mark.parametrize("reference", ["model", pytest.param("cached", marks=pytest.mark.slow)])
def test_pmap_dpo_equals_one_device(getkey, reference):
    policy = rx.Policy(tiny_config(), key=getkey())
    ref = rx.Policy(tiny_config(), key=getkey())
    batch = _preferences(getkey())
    opt = optax.sgd(2.0)
    kw = dict(beta=0.5, rpo_alpha=0.3, reference=reference)
    extra = {"reference": ref}
    if reference == "cached":
        batch = compute_reference_logps(ref, batch)
        extra = {}
    _compare(
        make_dpo_step(opt, axis_name="data", **kw),
        make_dpo_step(opt, **kw),
        policy,
        opt,
        batch,
        **extra,
    )


@pytest.mark.slow  # PPO replicated: tests/test_mesh.py (fast)
def test_pmap_ppo_equals_one_device(getkey):
    policy = rx.Policy(tiny_config(), key=getkey())
    value = rx.ValueModel.from_policy(policy, key=getkey())
    tokens, mask, cm = _uneven_sequences(getkey())
    scores = jax.random.normal(getkey(), (B,))
    ref = rx.Policy(tiny_config(), key=getkey())
    batch, _ = prepare_ppo_batch(
        (policy, value), ref, tokens, mask, cm, scores, kl_coef=0.1, temperature=0.9
    )
    # Perturb the sampling log-probs so that some ratios are clipped.
    noise = 0.3 * jax.random.normal(getkey(), batch.old_logp.shape)
    batch = eqx.tree_at(
        lambda b: b.old_logp, batch, jnp.where(batch.completion_mask, batch.old_logp + noise, 0.0)
    )
    opt = optax.sgd(0.5)
    kw = dict(
        vf_coef=0.5, ent_coef=0.01, clip_eps_high=0.28, mode="seq-mean-token-mean", temperature=0.9
    )
    m = _compare(
        make_ppo_step(opt, axis_name="data", **kw),
        make_ppo_step(opt, **kw),
        (policy, value),
        opt,
        batch,
    )
    assert 0.0 < float(m["policy/clipfrac"]) < 1.0


@pytest.mark.parametrize("scale", ["group", pytest.param("batch", marks=pytest.mark.slow)])
def test_pmap_grpo_equals_one_device(getkey, scale):
    policy = rx.Policy(tiny_config(), key=getkey())
    ref = rx.Policy(tiny_config(), key=getkey())
    tokens, mask, cm = _uneven_sequences(getkey())
    rewards = jax.random.bernoulli(getkey(), 0.5, (B,)).astype(jnp.float32).at[:2].set(1.0)
    batch = GRPOBatch(tokens=tokens, mask=mask, completion_mask=cm, rewards=rewards)
    opt = optax.sgd(2.0)
    kw = dict(group_size=2, scale=scale, beta=0.04, mode="token-mean")
    m = _compare(
        make_grpo_step(opt, axis_name="data", **kw),
        make_grpo_step(opt, **kw),
        policy,
        opt,
        batch,
        reference=ref,
    )
    assert float(m["frac_reward_zero_std"]) > 0.0


def test_pmap_grpo_shared_prompt_equals_one_device_unshared(getkey):
    """Each device runs its groups' prompts once; the step equals one device's step on
    the unshared rows (groups of 2 never straddle devices: 2 rows per device)."""
    policy = rx.Policy(tiny_config(), key=getkey())
    ref = rx.Policy(tiny_config(), key=getkey())
    tokens, mask, cm = _uneven_sequences(getkey())
    tokens = tokens.at[1::2, :3].set(tokens[0::2, :3])
    rewards = jax.random.normal(getkey(), (B,))
    fields = dict(tokens=tokens, mask=mask, completion_mask=cm, rewards=rewards)
    shared = GRPOBatch(**fields, prompt_length=3, samples_per_prompt=2)
    opt = optax.sgd(2.0)
    kw = dict(group_size=2, beta=0.04, mode="token-mean")
    devices = _devices()
    opt_state = opt.init(eqx.filter(policy, eqx.is_inexact_array))
    one_params, _, one_m = make_grpo_step(opt, **kw)(
        policy, opt_state, GRPOBatch(**fields), reference=ref
    )
    dp = jax.pmap(
        lambda p, s, b, r: make_grpo_step(opt, axis_name="data", **kw)(p, s, b, reference=r),
        axis_name="data",
        devices=devices,
    )
    dp_params, _, dp_m = dp(
        replicate(policy, devices),
        replicate(opt_state, devices),
        shard_batch_for_pmap(shared, N_DEV),
        replicate(ref, devices),
    )
    assert_updates_agree(unreplicate(dp_params), one_params, policy)
    for k in ("loss", "kl", "entropy"):
        np.testing.assert_allclose(unreplicate(dp_m)[k], one_m[k], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_pmap_kto_equals_one_device(getkey):
    """KTO's KL baseline (a batch mean over mismatched pairs) and its desirable and
    undesirable sums are reduced over the devices: labels are uneven across them."""
    policy = rx.Policy(tiny_config(), key=getkey())
    ref = rx.Policy(tiny_config(), key=getkey())
    tokens, mask, cm = _uneven_sequences(getkey())
    kl_tokens, kl_mask, kl_cm = _uneven_sequences(getkey())
    label = jnp.arange(B) % 3 == 0
    batch = KTOBatch(
        tokens=tokens,
        mask=mask,
        completion_mask=cm,
        label=label,
        kl_tokens=kl_tokens,
        kl_mask=kl_mask,
        kl_completion_mask=kl_cm,
    )
    opt = optax.sgd(0.5)
    for micro_batches in (1, 2):
        _compare(
            make_kto_step(opt, axis_name="data", micro_batches=micro_batches),
            make_kto_step(opt, micro_batches=micro_batches),
            policy,
            opt,
            batch,
            reference=ref,
        )
