"""Micro-batches under `jax.shard_map` with `check_vma=True`: the accumulation's scan
starts from zeros that do not vary over the data axis while each micro-batch's loss,
gradients and metric sums do, and the scan refuses the carry's types. Expected to
equal the one-device step on the global batch, as under `jax.pmap`."""

import equinox as eqx
import jax
import optax
import pytest
from helpers import assert_updates_agree
from jax.sharding import PartitionSpec as P
from test_train_common import tiny_config, uneven_sequences

import rlhf_eqx as rx
from rlhf_eqx.distributed import make_mesh
from rlhf_eqx.train import make_sft_step

N_DEV = 4

pytestmark = pytest.mark.skipif(
    jax.device_count() < N_DEV, reason=f"needs {N_DEV} (simulated) devices"
)


@pytest.mark.xfail(
    raises=TypeError,
    reason="train.accumulate_gradients' scan carry starts from zeros that do not vary "
    "over the device axis under shard_map(check_vma=True)",
    strict=False,
)
def test_shard_map_micro_batched_sft_equals_one_device(getkey):
    policy = rx.Policy(tiny_config(), key=getkey())
    tokens, mask, cm = uneven_sequences(getkey(), 8, 10, 3)
    batch = rx.SequenceBatch(tokens=tokens, mask=mask, completion_mask=cm)
    opt = optax.sgd(0.5)
    opt_state = opt.init(eqx.filter(policy, eqx.is_inexact_array))
    one_params, _, _ = make_sft_step(opt)(policy, opt_state, batch)
    step = make_sft_step(opt, axis_name="data", micro_batches=2)
    sharded = jax.shard_map(
        step,
        mesh=make_mesh(N_DEV, devices=jax.devices()[:N_DEV]),
        in_specs=(P(), P(), P("data")),
        out_specs=P(),
    )
    dp_params, _, _ = jax.jit(sharded)(policy, opt_state, batch)
    assert_updates_agree(dp_params, one_params, policy)
