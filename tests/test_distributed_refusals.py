"""Steps and placement helpers refuse, by name, what they cannot run: a mesh with Explicit
(sharding-in-types) axes, a step built for a device axis run where none is bound, a step
built without one run under `jax.pmap` / `shard_map`, and micro-batches that do not
divide the rows one device of `jax.pmap` holds (8 simulated CPU devices, set by the
suite's conftest)."""

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import rlhf_eqx as rx
from rlhf_eqx import distributed as dist
from rlhf_eqx.train import init_train_state, make_sft_step

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

B, T, VOCAB = 8, 6, 32


def _policy():
    cfg = rx.TransformerConfig(
        vocab_size=VOCAB, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32, max_seq_len=T
    )
    return rx.Policy(cfg, key=jax.random.key(0))


def _batch():
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, VOCAB)
    mask = jnp.ones((B, T), bool)
    return rx.SequenceBatch(tokens=tokens, mask=mask, completion_mask=mask.at[:, :2].set(False))


def _run_on_four_devices(step, opt, batch):
    """`step` under `jax.pmap` over 4 devices: the policy and its optimiser state
    replicated, `batch` split into 4 shards of its rows."""
    policy, devices = _policy(), jax.local_devices()[:4]
    run = jax.pmap(lambda p, s, b: step(p, s, b), axis_name="data", devices=devices)
    return run(
        dist.replicate(policy, devices),
        dist.replicate(opt.init(policy), devices),
        dist.shard_batch_for_pmap(batch, 4),
    )


def _explicit_mesh():
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)


def test_placement_helpers_refuse_a_mesh_with_explicit_axes():
    mesh, policy = _explicit_mesh(), _policy()
    opt = optax.sgd(0.1)
    state = init_train_state(policy, opt)
    calls = {
        "shard_model": lambda: dist.shard_model(policy, mesh),
        "shard_opt_state": lambda: dist.shard_opt_state(state.opt_state, state.params, mesh),
        "shard_train_state": lambda: dist.shard_train_state(state, mesh),
        "shard_batch": lambda: dist.shard_batch(_batch(), mesh),
        "global_batch": lambda: dist.global_batch(_batch(), mesh),
    }
    for name, call in calls.items():
        with pytest.raises(
            ValueError, match=rf"^{name}: mesh axes 'data': Explicit.*AxisType.Auto"
        ):
            call()


def test_a_step_given_arrays_on_explicit_axes_names_them():
    """Arrays placed by the caller on an Explicit mesh fail inside the model's gathers
    (`ShardingTypeError`); the step names the arguments, their shapes and the axes."""
    policy, opt = _policy(), optax.sgd(0.1)
    batch = jax.device_put(_batch(), NamedSharding(_explicit_mesh(), P("data")))
    step = make_sft_step(opt)
    with pytest.raises(
        ValueError, match=r"batch\.tokens \(shape \(8, 6\)\) over the Explicit mesh axis 'data'"
    ) as e:
        step(policy, opt.init(policy), batch)
    assert "AxisType.Auto" in str(e.value)


def test_a_step_built_for_a_device_axis_refuses_to_run_without_it():
    policy, opt = _policy(), optax.sgd(0.1)
    step = make_sft_step(opt, axis_name="data")
    with pytest.raises(ValueError, match=r"built with axis_name='data'.*no device axis 'data'"):
        step(policy, opt.init(policy), _batch())
    mesh = dist.make_mesh(4, 2)  # jit on a mesh binds no axis name either
    state = dist.shard_train_state(init_train_state(policy, opt), mesh)
    with pytest.raises(ValueError, match="without axis_name to run it under jax.jit"):
        state.apply(step, dist.shard_batch(_batch(), mesh))


def test_micro_batches_that_do_not_divide_a_devices_rows_are_refused_by_field():
    policy, opt = _policy(), optax.sgd(0.1)
    step = make_sft_step(opt, axis_name="data", micro_batches=4)
    with pytest.raises(
        ValueError,
        match=r"SequenceBatch\.tokens has shape \(2, 6\): 2 rows on each device of axis 'data'"
        r".*not divisible by micro_batches=4",
    ):
        _run_on_four_devices(step, opt, _batch())
    with pytest.raises(ValueError, match=r"has shape \(8, 6\): 8 rows, not divisible by micro"):
        make_sft_step(opt, micro_batches=3)(policy, opt.init(policy), _batch())


def test_a_step_whose_arguments_live_on_different_devices_names_them():
    policy, opt = _policy(), optax.sgd(0.1)
    half = dist.make_mesh(4, 1, devices=jax.devices()[:4])
    state = dist.shard_train_state(init_train_state(policy, opt), half)
    batch = dist.shard_batch(_batch(), dist.make_mesh(4, 2))
    with pytest.raises(
        ValueError,
        match=r"different sets of devices: params\.transformer\.embed \(shape \(32, 16\)\) "
        r"on devices \[0, 1, 2, 3\]; "
        r"batch\.tokens \(shape \(8, 6\)\) on devices \[0, 1, 2, 3, 4, 5, 6, 7\]",
    ):
        state.apply(make_sft_step(opt), batch)


def test_groups_that_straddle_devices_are_refused_naming_the_axis():
    """GRPO's groups of one prompt's samples lie on one device: 2 rows a device with
    group_size 4 is refused naming each device's rows and the axis."""
    opt = optax.sgd(0.1)
    step = rx.train.make_grpo_step(opt, group_size=4, axis_name="data")
    seq = _batch()
    batch = rx.train.GRPOBatch(
        tokens=seq.tokens,
        mask=seq.mask,
        completion_mask=seq.completion_mask,
        rewards=jnp.arange(B, dtype=jnp.float32),
    )
    with pytest.raises(
        ValueError,
        match=r"batch size 2 is not a multiple of group_size=4 \(the rows on each device of "
        r"axis 'data'",
    ):
        _run_on_four_devices(step, opt, batch)


def test_a_step_built_without_a_device_axis_refuses_to_run_under_pmap():
    """Without `axis_name` each replica would take its own shard's step and the copies
    would drift apart silently: under a named or unnamed `jax.pmap` and under
    `jax.shard_map` the step refuses, naming `axis_name` and the bound axis."""
    policy, opt = _policy(), optax.sgd(0.1)
    step = make_sft_step(opt)
    with pytest.raises(ValueError, match=r"built without axis_name.*device axis\(es\) 'data'"):
        _run_on_four_devices(step, opt, _batch())
    devices = jax.local_devices()[:4]
    args = (
        dist.replicate(policy, devices),
        dist.replicate(opt.init(policy), devices),
        dist.shard_batch_for_pmap(_batch(), 4),
    )
    with pytest.raises(ValueError, match=r"under jax.pmap without an axis name.*axis_name='data'"):
        jax.pmap(step, devices=devices)(*args)
    mesh = dist.make_mesh(4, 2)
    run = jax.shard_map(
        lambda p, s, b: step(p, s, b)[2]["loss"][None],
        mesh=mesh,
        in_specs=(P(), P(), P("data")),
        out_specs=P("data"),
        axis_names={"data"},
    )
    with pytest.raises(ValueError, match=r"built without axis_name.*axis\(es\) 'data'"):
        run(policy, opt.init(policy), _batch())


def test_a_step_under_another_device_axis_names_the_bound_axes():
    policy, opt = _policy(), optax.sgd(0.1)
    devices = jax.local_devices()[:4]
    step = jax.pmap(make_sft_step(opt, axis_name="data"), axis_name="batch", devices=devices)
    with pytest.raises(
        ValueError,
        match=r"no device axis 'data' is bound \(the device axes "
        r"bound here: 'batch'\)",
    ):
        step(
            dist.replicate(policy, devices),
            dist.replicate(opt.init(policy), devices),
            dist.shard_batch_for_pmap(_batch(), 4),
        )
