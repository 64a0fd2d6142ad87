"""`replicate` / `unreplicate` for `jax.pmap`: every copy on its own device, of every
kind of array a train state holds (float32, bfloat16, typed PRNG keys, NumPy arrays,
scalars), and the pmap step of a replicated bfloat16 policy against one device."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_train_common import tiny_config, uneven_sequences

import rlhf_eqx as rx
from rlhf_eqx import distributed as dist
from rlhf_eqx.train import make_sft_step

N_DEV = 4

pytestmark = pytest.mark.skipif(
    jax.local_device_count() < N_DEV, reason=f"needs {N_DEV} (simulated) devices"
)


def test_replicate_puts_one_copy_on_each_device_and_unreplicate_inverts_it():
    devices = jax.local_devices()[:N_DEV]
    tree = dict(
        w=jnp.arange(6.0).reshape(2, 3),
        half=jnp.ones((3,), jnp.bfloat16),
        key=jax.random.key(1),
        scalar=jnp.float32(2.0),
        host=np.arange(3, dtype=np.int32),
        count=3,
    )
    copies = dist.replicate(tree, devices)
    assert copies["count"] == 3
    for name in ("w", "half", "key", "scalar", "host"):
        x, y = tree[name], copies[name]
        assert y.shape == (N_DEV, *np.shape(x)) and y.dtype == jnp.asarray(x).dtype, name
        shards = sorted(y.addressable_shards, key=lambda s: s.index[0].start)
        assert [s.device for s in shards] == devices, name
        assert all(s.data.shape == (1, *np.shape(x)) for s in shards), name
    back = dist.unreplicate(copies)
    for name in ("w", "half", "scalar", "host"):
        np.testing.assert_array_equal(np.asarray(back[name]), np.asarray(tree[name]))
    np.testing.assert_array_equal(
        jax.random.key_data(back["key"]), jax.random.key_data(tree["key"])
    )


def test_pmap_step_of_a_bfloat16_policy_equals_one_device(getkey):
    cfg = tiny_config()
    policy = rx.Policy(dataclasses.replace(cfg, dtype="bfloat16"), key=getkey())
    tokens, mask, cm = uneven_sequences(getkey(), 8, 10, 3)
    batch = rx.SequenceBatch(tokens=tokens, mask=mask, completion_mask=cm.at[2:4].set(False))
    opt = optax.sgd(0.5)
    opt_state = opt.init(eqx.filter(policy, eqx.is_inexact_array))
    one, _, one_m = make_sft_step(opt)(policy, opt_state, batch)
    devices = jax.local_devices()[:N_DEV]
    step = make_sft_step(opt, axis_name="data")
    dp, _, dp_m = jax.pmap(step, axis_name="data", devices=devices)(
        dist.replicate(policy, devices),
        dist.replicate(opt_state, devices),
        dist.shard_batch_for_pmap(batch, N_DEV),
    )
    got = jax.tree.leaves(eqx.filter(dist.unreplicate(dp), eqx.is_inexact_array))
    want = jax.tree.leaves(eqx.filter(one, eqx.is_inexact_array))
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype == jnp.bfloat16
        # one bfloat16 rounding of the updated weights apart, at most
        np.testing.assert_allclose(
            np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2**-7, atol=1e-3
        )
    np.testing.assert_allclose(float(dp_m["loss"][0]), float(one_m["loss"]), rtol=1e-3)
