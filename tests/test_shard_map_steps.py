"""Data parallel with `jax.shard_map` and its default `check_vma=True`.

The model's custom derivatives (RMSNorm's weight, the gated activation, attention, the
selective LM head's skipped chunks) type-check there: the gradient of a loss summed over
a shard of the rows, with respect to replicated parameters, is the gradient of the loss
summed over all rows (autodiff sums a replicated input's cotangent over the axis).

A step built with `axis_name="data"` equals the one-device step on the global
batch. The rows have uneven masks across devices (very different lengths, an empty
completion), so a per-device mean would differ from the global one.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_updates_agree
from jax.sharding import PartitionSpec as P
from test_train_common import tiny_config, uneven_preferences, uneven_sequences

import rlhf_eqx as rx
from rlhf_eqx.distributed import make_mesh
from rlhf_eqx.train import GRPOBatch, make_dpo_step, make_grpo_step, make_sft_step

N_DEV = 4
B = 8
T = 10

pytestmark = pytest.mark.skipif(
    jax.device_count() < N_DEV, reason=f"needs {N_DEV} (simulated) devices"
)


def _uneven_sequences(key, prompt=3):
    return uneven_sequences(key, B, T, prompt)


# The step differentiates per-device (varying) copies of the replicated parameters and
# sums the gradients once itself: differentiating the replicated parameters, whose
# gradient shard_map's autodiff already sums over the axis, gave N_DEV times the update.


def test_shard_map_gradient_of_replicated_policy_is_the_global_gradient(getkey):
    policy = rx.Policy(tiny_config(), key=getkey())
    tokens, mask, cm = _uneven_sequences(getkey())
    mesh = make_mesh(N_DEV, devices=jax.devices()[:N_DEV])
    params, static = eqx.partition(policy, eqx.is_inexact_array)

    def grad_of_sum(p, t, m, c):
        def loss(p):
            logp = eqx.combine(p, static).selected_logprobs(t, m, c, chunk=8)[0]
            return jnp.sum(logp)

        return jax.grad(loss)(p)

    one = jax.jit(grad_of_sum)(params, tokens, mask, cm)
    sharded = jax.shard_map(
        grad_of_sum, mesh=mesh, in_specs=(P(), P("data"), P("data"), P("data")), out_specs=P()
    )
    dp = jax.jit(sharded)(params, tokens, mask, cm)
    for a, b in zip(jax.tree.leaves(dp), jax.tree.leaves(one), strict=True):
        scale = float(jnp.max(jnp.abs(b)))
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5 * scale + 1e-7)
    assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(one)) > 1e-3


def _compare(step_dp, step_one, params, opt, batch, **kwargs):
    """Run `step_dp` under `jax.shard_map` over a 4-device data axis (parameters and
    optimiser state replicated, the batch split by rows, `check_vma` at its default) and
    `step_one` under `jax.jit` on the global batch; the updates and metrics agree."""
    mesh = make_mesh(N_DEV, devices=jax.devices()[:N_DEV])
    opt_state = opt.init(eqx.filter(params, eqx.is_inexact_array))
    one_params, _, one_m = jax.jit(lambda p, s, b, kw: step_one(p, s, b, **kw))(
        params, opt_state, batch, kwargs
    )
    sharded = jax.shard_map(
        lambda p, s, b, kw: step_dp(p, s, b, **kw),
        mesh=mesh,
        in_specs=(P(), P(), P("data"), P()),
        out_specs=P(),
    )
    dp_params, _, dp_m = jax.jit(sharded)(params, opt_state, batch, kwargs)
    assert_updates_agree(dp_params, one_params, params)
    moved = jax.tree.map(
        jnp.subtract, *(eqx.filter(p, eqx.is_inexact_array) for p in (one_params, params))
    )
    assert max(float(jnp.max(jnp.abs(u))) for u in jax.tree.leaves(moved)) > 1e-4  # it moved
    for name, value in one_m.items():
        np.testing.assert_allclose(
            np.asarray(dp_m[name]), np.asarray(value), rtol=2e-4, atol=2e-5, err_msg=name
        )


def test_shard_map_sft_equals_one_device(getkey):
    policy = rx.Policy(tiny_config(), key=getkey())
    tokens, mask, cm = _uneven_sequences(getkey())
    batch = rx.SequenceBatch(tokens=tokens, mask=mask, completion_mask=cm)
    opt = optax.sgd(0.5)
    _compare(make_sft_step(opt, axis_name="data"), make_sft_step(opt), policy, opt, batch)


def test_shard_map_dpo_equals_one_device(getkey):
    policy = rx.Policy(tiny_config(), key=getkey())
    ref = rx.Policy(tiny_config(), key=getkey())
    batch = uneven_preferences(getkey(), B, T)
    opt = optax.sgd(2.0)
    kw = dict(beta=0.5, rpo_alpha=0.3)
    _compare(
        make_dpo_step(opt, axis_name="data", **kw),
        make_dpo_step(opt, **kw),
        policy,
        opt,
        batch,
        reference=ref,
    )


def test_shard_map_grpo_equals_one_device(getkey):
    policy = rx.Policy(tiny_config(), key=getkey())
    ref = rx.Policy(tiny_config(), key=getkey())
    tokens, mask, cm = _uneven_sequences(getkey())
    rewards = jax.random.bernoulli(getkey(), 0.5, (B,)).astype(jnp.float32).at[:2].set(1.0)
    batch = GRPOBatch(tokens=tokens, mask=mask, completion_mask=cm, rewards=rewards)
    opt = optax.sgd(2.0)
    kw = dict(group_size=2, scale="batch", beta=0.04, mode="token-mean")
    _compare(
        make_grpo_step(opt, axis_name="data", **kw),
        make_grpo_step(opt, **kw),
        policy,
        opt,
        batch,
        reference=ref,
    )


@pytest.mark.parametrize("causal_block", [None, 16, 4])
def test_shard_map_attention_gradient_equals_one_device(getkey, causal_block):
    """Dense, unrolled-tile and looped-tile attention (rows split over the axis, one
    causal mask replicated) differentiate under check_vma as on one device."""
    from rlhf_eqx.models import attention

    Bq, Tq, H, K, hd = 8, 40, 4, 2, 8
    q = jax.random.normal(getkey(), (Bq, Tq, H, hd))
    k, v = (jax.random.normal(getkey(), (Bq, K, Tq, hd)) for _ in range(2))
    causal = jnp.tril(jnp.ones((Tq, Tq), bool))

    def grads(q, k, v, causal):
        allowed = jnp.broadcast_to(causal, (q.shape[0], Tq, Tq))
        loss = lambda q, k, v: jnp.sum(
            jnp.sin(attention(q, k, v, allowed, causal_block=causal_block))
        )
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    one = jax.jit(grads)(q, k, v, causal)
    mesh = make_mesh(N_DEV, devices=jax.devices()[:N_DEV])
    sharded = jax.shard_map(
        grads, mesh=mesh, in_specs=(P("data"),) * 3 + (P(),), out_specs=P("data")
    )
    for a, b in zip(jax.jit(sharded)(q, k, v, causal), one, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
