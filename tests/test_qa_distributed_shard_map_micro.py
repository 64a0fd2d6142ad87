"""Micro-batches under `jax.shard_map` with `check_vma=True`: each micro-batch's loss,
gradients and metric sums vary over the data axis, and so must the accumulation's
initial carry (the scan refused the carry's types). SFT, DPO with a reference model and
GKD with a device whose rows hold no completion token, two micro-batches per device,
equal the one-device step on the global batch, as under `jax.pmap`."""

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from helpers import assert_updates_agree
from jax.sharding import PartitionSpec as P
from test_train_common import tiny_config, uneven_preferences, uneven_sequences

import rlhf_eqx as rx
from rlhf_eqx.data import DistillBatch
from rlhf_eqx.distributed import make_mesh
from rlhf_eqx.train import make_distill_step, make_dpo_step, make_sft_step

N_DEV = 4
B = 8
T = 10

pytestmark = pytest.mark.skipif(
    jax.device_count() < N_DEV, reason=f"needs {N_DEV} (simulated) devices"
)


def _compare(build, params, batch, **extra):
    """`build(opt, axis_name="data", micro_batches=2)` under `jax.shard_map` against
    `build(opt)` under `jax.jit` on the global batch."""
    opt = optax.sgd(0.5)
    opt_state = opt.init(eqx.filter(params, eqx.is_inexact_array))
    one, dp = build(opt), build(opt, axis_name="data", micro_batches=2)
    one_params, _, one_m = jax.jit(lambda p, s, b, e: one(p, s, b, **e))(
        params, opt_state, batch, extra
    )
    sharded = jax.shard_map(
        lambda p, s, b, e: dp(p, s, b, **e),
        mesh=make_mesh(N_DEV, devices=jax.devices()[:N_DEV]),
        in_specs=(P(), P(), P("data"), P()),
        out_specs=P(),
    )
    dp_params, _, dp_m = jax.jit(sharded)(params, opt_state, batch, extra)
    assert_updates_agree(dp_params, one_params, params)
    for name, value in one_m.items():
        np.testing.assert_allclose(
            np.asarray(dp_m[name]), np.asarray(value), rtol=2e-4, atol=2e-5, err_msg=name
        )


@pytest.mark.parametrize("algorithm", ["sft", pytest.param("dpo", marks=pytest.mark.slow), "gkd"])
def test_shard_map_micro_batched_step_equals_one_device(getkey, algorithm):
    cfg = tiny_config()
    policy, other = rx.Policy(cfg, key=getkey()), rx.Policy(cfg, key=getkey())
    tokens, mask, cm = uneven_sequences(getkey(), B, T, 3)
    cm = cm.at[2:4].set(False)  # the second device's rows: no completion token
    if algorithm == "sft":
        batch = rx.SequenceBatch(tokens=tokens, mask=mask, completion_mask=cm)
        _compare(
            lambda opt, **kw: make_sft_step(opt, mode="seq-mean-token-mean", **kw), policy, batch
        )
    elif algorithm == "dpo":
        batch = uneven_preferences(getkey(), B, T)
        _compare(
            lambda opt, **kw: make_dpo_step(opt, beta=0.5, **kw), policy, batch, reference=other
        )
    else:
        batch = DistillBatch(tokens=tokens, mask=mask, completion_mask=cm)
        gkd = lambda opt, **kw: make_distill_step(opt, chunk=4, **kw)  # noqa: E731
        _compare(gkd, policy, batch, teacher=other)
