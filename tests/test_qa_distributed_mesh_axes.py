"""Meshes whose axes are named otherwise than `make_mesh`'s `("data", "model")`.

The sharding rules name `"data"` (FSDP) and `"model"` (tensor parallel); a spec naming an
axis the mesh lacks is replicated. A mesh with neither axis, or `fsdp=True` without a
`"data"` axis, would replicate every parameter with no error: refused, naming the
mesh's axes. A batch split over an axis the mesh lacks is refused naming `axis` and the
mesh's axes (it was a bare `KeyError: 'data'`). A mesh with other names that still has
the rules' axes works and equals one device.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import assert_updates_agree
from jax.sharding import AxisType
from test_train_common import tiny_config, uneven_sequences

import rlhf_eqx as rx
from rlhf_eqx import distributed as dist
from rlhf_eqx.train import init_train_state, make_sft_step

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


def _batch(key):
    tokens, mask, cm = uneven_sequences(key, 8, 10, 3)
    return rx.SequenceBatch(tokens=tokens, mask=mask, completion_mask=cm)


def test_meshes_the_rules_cannot_use_are_refused_naming_their_axes(getkey):
    policy = rx.Policy(tiny_config(), key=getkey())
    state = init_train_state(policy, optax.sgd(0.1))
    other = _mesh((4, 2), ("batch", "tp"))
    for place in (
        lambda: dist.shard_train_state(state, other),
        lambda: dist.shard_model(policy, other),
        lambda: dist.shard_opt_state(state.opt_state, state.params, other),
    ):
        with pytest.raises(ValueError, match=r"axes \('batch', 'tp'\) include neither 'data'"):
            place()
    with pytest.raises(ValueError, match=r"fsdp=True .* mesh's axes are \('model', 'tp'\)"):
        dist.shard_train_state(state, _mesh((4, 2), ("model", "tp")), fsdp=True)
    batch = _batch(getkey())
    for split, where in ((dist.shard_batch, "shard_batch"), (dist.global_batch, "global_batch")):
        with pytest.raises(
            ValueError,
            match=rf"{where}: axis='data' is not an axis of the mesh, whose axes "
            r"are \('batch', 'tp'\)",
        ):
            split(batch, other)
    # naming the mesh's own axis splits the rows over it
    placed = dist.shard_batch(batch, other, axis="batch")
    assert placed.tokens.sharding.spec == jax.sharding.PartitionSpec("batch")


def test_mesh_with_an_extra_axis_name_equals_one_device(getkey):
    """`("data", "model", "pipe")` of sizes (2, 2, 2): FSDP over `data`, tensor parallel
    over `model`, `pipe` unused (replicated); the SFT step equals the one-device step."""
    policy = rx.Policy(tiny_config(), key=getkey())
    opt = optax.sgd(0.5)
    batch = _batch(getkey())
    step = make_sft_step(opt, mode="seq-mean-token-mean")
    params = eqx.filter(policy, eqx.is_inexact_array)
    one_params, _, one_m = step(policy, opt.init(params), batch)
    mesh = _mesh((2, 2, 2), ("data", "model", "pipe"))
    state = dist.shard_train_state(init_train_state(policy, opt), mesh, fsdp=True)
    state, m = state.apply(step, dist.shard_batch(batch, mesh))
    assert_updates_agree(state.model, one_params, policy)
    assert jnp.allclose(m["loss"], one_m["loss"], rtol=1e-5)


def test_make_mesh_of_fewer_devices_says_how_to_pick_them():
    with pytest.raises(ValueError, match=r"3 × 1 = 3 devices, but 8 are given \(for a mesh of "):
        dist.make_mesh(3, devices=jax.devices()[:8])
    with pytest.raises(ValueError, match=r"2 × 1 = 2 devices, but 1 are given$"):
        dist.make_mesh(2, devices=jax.devices()[:1])
    assert dist.make_mesh(3, devices=jax.devices()[:3]).shape == {"data": 3, "model": 1}


def test_plain_data_parallel_takes_a_mesh_of_any_axis_names(getkey):
    """`fsdp=False, tensor_parallel=False`: every parameter replicated, which a mesh named
    `("batch",)` holds as well as any; the step over rows split on `batch` equals one
    device."""
    policy = rx.Policy(tiny_config(), key=getkey())
    opt = optax.sgd(0.5)
    batch = _batch(getkey())
    step = make_sft_step(opt, mode="seq-mean-token-mean")
    one_params, _, _ = step(policy, opt.init(eqx.filter(policy, eqx.is_inexact_array)), batch)
    mesh = _mesh((8,), ("batch",))
    state = dist.shard_train_state(init_train_state(policy, opt), mesh, tensor_parallel=False)
    state, _ = state.apply(step, dist.shard_batch(batch, mesh, axis="batch"))
    assert_updates_agree(state.model, one_params, policy)
    with pytest.raises(ValueError, match="pass tensor_parallel=False for plain data parallelism"):
        dist.shard_model(policy, mesh)
