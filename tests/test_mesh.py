"""Sharded-mesh training: sharding rules, placement helpers, and one jitted DPO / PPO step
and generation on ("data", "model") meshes of 8 simulated CPU devices equal to one device."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ADAM_EPS, assert_adam_steps_agree, assert_trees_close_per_leaf
from jax.sharding import NamedSharding, PartitionSpec as P

import rlhf_eqx as rx
from rlhf_eqx import distributed as dist
from rlhf_eqx.train import (
    init_train_state,
    make_dpo_step,
    make_optimizer,
    make_ppo_step,
    prepare_ppo_batch,
)

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

VOCAB = 64
B, T, PROMPT = 8, 12, 3
# The equivalence tests' AdamW: a mesh adds the same terms as one device in another
# order, so the parameters after a step agree within a bound scaled by the learning rate
# (`assert_adam_steps_agree`, with Adam's `eps = ADAM_EPS`), the loss and the gradient
# (Adam's moments) within a relative tolerance.
LR = 1e-3


def _config():
    return rx.TransformerConfig(
        vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=T
    )


def _rows(key, lengths):
    tokens = jax.random.randint(key, (B, T), 0, VOCAB)
    pos = jnp.arange(T)[None, :]
    mask = pos < jnp.asarray(lengths)[:, None]
    return tokens, mask, mask & (pos >= PROMPT)


def _preference_batch(key):
    """Right-padded pairs whose masks differ from row to row (and so from device to device)."""
    k1, k2 = jax.random.split(key)
    ct, cm, ccm = _rows(k1, [12, 10, 8, 4, 11, 9, 12, 7])
    rt, rm, rcm = _rows(k2, [11, 12, 9, 10, 12, 8, 11, 12])
    rt = rt.at[:, :PROMPT].set(ct[:, :PROMPT])
    return rx.PreferenceBatch(
        chosen_tokens=ct,
        chosen_mask=cm,
        chosen_completion_mask=ccm,
        rejected_tokens=rt,
        rejected_mask=rm,
        rejected_completion_mask=rcm,
    )


def _max_abs_diff(a, b) -> float:
    la = jax.tree.leaves(eqx.filter(a, eqx.is_array))
    lb = jax.tree.leaves(eqx.filter(b, eqx.is_array))
    assert len(la) == len(lb)
    return max(
        float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
        for x, y in zip(la, lb)
    )


# ------------------------------------------------------------------ rules and helpers


def test_partition_specs_follow_the_megatron_layout_and_fsdp(getkey):
    policy = rx.apply_lora(
        rx.Policy(_config(), key=getkey()),
        rx.LoRAConfig(rank=4, targets=("q", "o", "up")),
        key=getkey(),
    )
    tp = dist.partition_specs(policy)
    assert tp.transformer.layers.wqkv == P(None, None, "model")
    assert tp.transformer.layers.w_gate_up == P(None, None, "model")
    assert tp.transformer.layers.wo == P(None, "model", None)
    assert tp.transformer.layers.w_down == P(None, "model", None)
    assert tp.transformer.embed == P("model", None)
    assert tp.lm_head == P(None, "model")
    assert tp.transformer.layers.attn_norm == P(None, None)
    assert tp.transformer.final_norm == P(None)
    lora = tp.transformer.layers.lora
    assert (lora["q"].a, lora["q"].b) == (P(None, None, None), P(None, None, "model"))
    assert (lora["o"].a, lora["o"].b) == (P(None, "model", None), P(None, None, None))
    full = dist.partition_specs(policy, fsdp=True)
    assert full.transformer.layers.wqkv == P(None, "data", "model")
    assert full.transformer.layers.wo == P(None, "model", "data")
    assert full.transformer.embed == P("model", "data")
    assert full.transformer.layers.lora["up"].a == P(None, "data", None)
    dp = dist.partition_specs(policy, tensor_parallel=False)
    assert all(
        all(a is None for a in s) for s in jax.tree.leaves(dp, is_leaf=lambda x: isinstance(x, P))
    )


def test_partition_specs_of_int8_base_and_of_a_partition(getkey):
    policy = rx.quantize_int8(rx.Policy(_config(), key=getkey()))
    specs = dist.partition_specs(policy, fsdp=True)
    w = specs.transformer.layers.wqkv
    assert (w.q, w.scale) == (P(None, "data", "model"), P(None, "model"))
    assert specs.transformer.layers.w_down.scale == P(None, None)
    # A trainable partition (None elsewhere) keeps its structure.
    params, _ = eqx.partition(
        rx.Policy(_config(), key=getkey()), lambda x: eqx.is_array(x) and x.ndim == 3
    )
    pspecs = dist.partition_specs(params)
    assert jax.tree.structure(pspecs) == jax.tree.structure(params)


def test_make_mesh_has_auto_axes_and_checks_the_device_count():
    mesh = dist.make_mesh(4, 2)
    assert dict(mesh.shape) == {"data": 4, "model": 2}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    with pytest.raises(ValueError, match="3 × 2 = 6 devices"):
        dist.make_mesh(3, 2)


def test_fit_spec_replicates_dimensions_that_do_not_divide():
    mesh = dist.make_mesh(4, 2)
    assert dist.fit_spec(P("model", "data"), (6, 8), mesh) == P("model", "data")
    assert dist.fit_spec(P("model", "data"), (5, 6), mesh) == P(None, None)
    assert dist.fit_spec(P("data"), (8, 3), mesh) == P("data", None)


def test_shard_model_and_opt_state_place_leaves_by_the_rules(getkey):
    mesh = dist.make_mesh(2, 4)
    policy = rx.Policy(_config(), key=getkey())
    opt = make_optimizer(learning_rate=1e-3, total_steps=10)
    state = dist.shard_train_state(init_train_state(policy, opt), mesh, fsdp=True)
    wqkv = state.params.transformer.layers.wqkv
    assert wqkv.sharding == NamedSharding(mesh, P(None, "data", "model"))
    assert wqkv.addressable_shards[0].data.shape == (2, 16, 16)
    # Adam's moments mirror the params; the step counts are replicated.
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.shape == wqkv.shape]
    assert len(moments) == 2
    assert all(m.sharding.spec == wqkv.sharding.spec for m in moments)
    scalars = [x for x in jax.tree.leaves(state.opt_state) if x.ndim == 0]
    assert scalars and all(s.sharding.is_fully_replicated for s in scalars)
    # Values are unchanged by placement.
    assert _max_abs_diff(state.params, policy) == 0.0


def test_shard_train_state_keeps_the_run_key_and_the_skipped_count(getkey):
    policy = rx.Policy(_config(), key=getkey())
    opt = make_optimizer(learning_rate=LR, total_steps=10)
    state = init_train_state(policy, opt, key=jax.random.key(5))
    state = eqx.tree_at(lambda s: s.skipped, state, jnp.asarray(3, jnp.int32))
    mesh = dist.make_mesh(4, 2)
    placed = dist.shard_train_state(state, mesh, fsdp=True)
    assert int(placed.skipped) == 3 and int(placed.step) == 0
    assert placed.key is not None
    np.testing.assert_array_equal(
        jax.random.key_data(placed.key), jax.random.key_data(jax.random.key(5))
    )
    for x in (placed.step, placed.skipped, placed.key):
        assert x.sharding == NamedSharding(mesh, P())


def test_shard_batch_splits_rows_and_names_a_field_that_does_not_divide(getkey):
    mesh = dist.make_mesh(4, 2)
    batch = dist.shard_batch(_preference_batch(getkey()), mesh)
    assert batch.chosen_tokens.sharding == NamedSharding(mesh, P("data"))
    assert batch.chosen_tokens.addressable_shards[0].data.shape == (2, T)
    odd = rx.SequenceBatch(
        tokens=jnp.zeros((6, T), jnp.int32),
        mask=jnp.ones((6, T), bool),
        completion_mask=jnp.ones((6, T), bool),
    )
    with pytest.raises(ValueError, match=r"\.tokens has 6 rows.*4 devices"):
        dist.shard_batch(odd, mesh)


def test_global_batch_in_one_process_is_shard_batch_and_names_a_field_that_does_not_divide(
    getkey,
):
    mesh = dist.make_mesh(4, 2)
    local = _preference_batch(getkey())
    placed, expected = dist.global_batch(local, mesh), dist.shard_batch(local, mesh)
    for x, y in zip(jax.tree.leaves(placed), jax.tree.leaves(expected)):
        assert x.sharding == y.sharding
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    odd = rx.SequenceBatch(
        tokens=jnp.zeros((6, T), jnp.int32),
        mask=jnp.ones((6, T), bool),
        completion_mask=jnp.ones((6, T), bool),
    )
    with pytest.raises(
        ValueError, match=r"field \.tokens has 6 rows .*4 slice\(s\) of mesh axis 'data'"
    ):
        dist.global_batch(odd, mesh)


# ------------------------------------------------------------------ equivalence


def _slow_unless(shape, fsdp, fast):
    marks = () if (shape, fsdp) in fast else (pytest.mark.slow,)
    return pytest.param(
        shape, fsdp, marks=marks, id=f"{shape[0]}x{shape[1]}{'-fsdp' if fsdp else ''}"
    )


# Each case compiles the step for its mesh (several seconds): the fast suite runs each
# algorithm once on each of the (8, 1), (4, 2) and (2, 4) meshes, the rest with `-m slow`.
DPO_MESHES = [
    _slow_unless(shape, fsdp, {((8, 1), False), ((2, 4), True)})
    for shape, fsdp in [
        ((8, 1), False),
        ((8, 1), True),
        ((4, 2), True),
        ((2, 4), False),
        ((2, 4), True),
    ]
]
PPO_MESHES = [
    _slow_unless(shape, fsdp, {((8, 1), True), ((4, 2), False)})
    for shape, fsdp in [((8, 1), True), ((4, 2), False), ((2, 4), True)]
]


def _perturbed(model, seed):
    return jax.tree.map(
        lambda x: (
            x + 0.01 * jax.random.normal(jax.random.key(seed), x.shape)
            if eqx.is_inexact_array(x)
            else x
        ),
        model,
    )


@functools.cache
def _dpo_setup():
    policy = rx.Policy(_config(), key=jax.random.key(0))
    # The first step is informative only when the policy differs from the reference.
    moved = _perturbed(policy, 2)
    batch = _preference_batch(jax.random.key(1))
    opt = make_optimizer(learning_rate=LR, eps=ADAM_EPS, total_steps=10)
    step = make_dpo_step(opt, beta=0.1, donate=False)
    single = init_train_state(moved, opt).apply(step, batch, reference=policy)
    return policy, moved, batch, opt, step, single


@pytest.mark.parametrize("shape, fsdp", DPO_MESHES)
def test_dpo_step_on_a_mesh_equals_one_device(shape, fsdp):
    policy, moved, batch, opt, step, (single, m1) = _dpo_setup()
    mesh = dist.make_mesh(*shape)
    state = dist.shard_train_state(init_train_state(moved, opt), mesh, fsdp=fsdp)
    reference = dist.shard_model(policy, mesh, fsdp=fsdp)
    sharded, m2 = state.apply(step, dist.shard_batch(batch, mesh), reference=reference)
    assert_adam_steps_agree(
        single.params,
        sharded.params,
        lr=LR,
        a_opt_state=single.opt_state,
        b_opt_state=sharded.opt_state,
    )
    np.testing.assert_allclose(float(m1["loss"]), float(m2["loss"]), rtol=1e-5)
    np.testing.assert_allclose(float(m1["grad_norm"]), float(m2["grad_norm"]), rtol=1e-5)
    # The result lives on the mesh.
    assert len(sharded.params.transformer.layers.wqkv.sharding.device_set) == 8


def test_the_step_comparison_catches_a_wrong_gradient():
    """The comparison of the mesh tests fails on a step whose gradient is wrong: one
    pair's chosen and rejected swapped (as a per-device instead of a global normaliser
    would reweight rows), both by the parameters alone and by Adam's moments."""
    policy, moved, batch, opt, step, (single, _) = _dpo_setup()
    fields = ("tokens", "mask", "completion_mask")
    chosen = [getattr(batch, f"chosen_{f}") for f in fields]
    rejected = [getattr(batch, f"rejected_{f}") for f in fields]
    swapped = eqx.tree_at(
        lambda b: [getattr(b, f"{side}_{f}") for side in ("chosen", "rejected") for f in fields],
        batch,
        [c.at[7].set(r[7]) for c, r in zip(chosen, rejected)]
        + [r.at[7].set(c[7]) for c, r in zip(chosen, rejected)],
    )
    wrong, _ = init_train_state(moved, opt).apply(step, swapped, reference=policy)
    with pytest.raises(AssertionError, match="parameter"):
        assert_adam_steps_agree(single.params, wrong.params, lr=LR)
    with pytest.raises(AssertionError, match="optimiser state leaf"):
        assert_trees_close_per_leaf(single.opt_state, wrong.opt_state, what="optimiser state leaf")


@pytest.mark.parametrize("shape, fsdp", PPO_MESHES)
def test_ppo_step_on_a_mesh_equals_one_device(shape, fsdp):
    cfg = _config()
    policy = rx.Policy(cfg, key=jax.random.key(0))
    value = rx.ValueModel.from_policy(policy, key=jax.random.key(3))
    reference = _perturbed(policy, 4)
    tokens, mask, cm = _rows(jax.random.key(5), [12, 10, 8, 4, 11, 9, 12, 7])
    scores = jnp.linspace(-1.0, 1.0, B)
    batch, _ = prepare_ppo_batch((policy, value), reference, tokens, mask, cm, scores, kl_coef=0.05)
    noise = 0.3 * jax.random.normal(jax.random.key(6), batch.old_logp.shape)
    batch = eqx.tree_at(
        lambda b: b.old_logp, batch, jnp.where(batch.completion_mask, batch.old_logp + noise, 0.0)
    )
    opt = make_optimizer(learning_rate=LR, eps=ADAM_EPS, total_steps=10)
    step = make_ppo_step(opt, donate=False)

    def run(mesh):
        state = init_train_state((policy, value), opt)
        b = batch
        if mesh is not None:
            state = dist.shard_train_state(state, mesh, fsdp=fsdp)
            b = dist.shard_batch(batch, mesh)
        return state.apply(step, b)

    single, m1 = run(None)
    sharded, m2 = run(dist.make_mesh(*shape))
    assert_adam_steps_agree(
        single.params,
        sharded.params,
        lr=LR,
        a_opt_state=single.opt_state,
        b_opt_state=sharded.opt_state,
    )
    for name in ("loss", "policy/clipfrac", "val/clipfrac"):
        np.testing.assert_allclose(float(m1[name]), float(m2[name]), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("shape", [(2, 4), pytest.param((8, 1), marks=pytest.mark.slow)])
def test_generation_on_a_mesh_gives_the_same_tokens(shape):
    policy = rx.Policy(_config(), key=jax.random.key(0))
    prompts = jax.random.randint(jax.random.key(1), (B, 4), 3, VOCAB)
    pmask = jnp.arange(4)[None, :] >= jnp.asarray([0, 1, 2, 3, 0, 2, 1, 0])[:, None]  # left-padded
    kw = dict(max_new_tokens=6, temperature=1.0, top_k=8)
    ref = rx.generate_batch(policy, prompts, pmask, jax.random.key(2), **kw)
    mesh = dist.make_mesh(*shape)
    sp = dist.shard_model(policy, mesh, fsdp=True)
    prompts_s, pmask_s = dist.shard_batch((prompts, pmask), mesh)
    out = rx.generate_batch(sp, prompts_s, pmask_s, jax.random.key(2), **kw)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(out.completion_mask), np.asarray(ref.completion_mask))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(ref.logprobs), atol=1e-5)


# ------------------------------------------------------------------ pmap helpers


def test_replicate_and_unreplicate_round_trip(getkey):
    devices = jax.local_devices()[:8]
    policy = rx.Policy(_config(), key=getkey())
    rep = dist.replicate(policy, devices)
    wqkv = rep.transformer.layers.wqkv
    assert wqkv.shape == (8,) + policy.transformer.layers.wqkv.shape
    assert {s.device for s in wqkv.addressable_shards} == set(devices)
    assert all(s.data.shape[0] == 1 for s in wqkv.addressable_shards)
    assert rep.cfg == policy.cfg  # static fields are kept
    assert _max_abs_diff(dist.unreplicate(rep), policy) == 0.0
    # Replicated params and a device-split batch run under pmap like one device.
    batch = dist.shard_batch_for_pmap(_preference_batch(getkey()), 8)
    logits = jax.pmap(lambda p, t, m: p(t, m), devices=devices)(
        rep, batch.chosen_tokens, batch.chosen_mask
    )
    flat = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), batch)
    np.testing.assert_allclose(
        np.asarray(logits).reshape(B, T, VOCAB),
        np.asarray(policy(flat.chosen_tokens, flat.chosen_mask)),
        atol=1e-5,
    )


def test_shard_batch_for_pmap_round_trip_and_a_global_reduction(getkey):
    batch = _preference_batch(getkey())
    per_device = dist.shard_batch_for_pmap(batch, 4)
    assert per_device.chosen_tokens.shape == (4, 2, T)
    back = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), per_device)
    assert _max_abs_diff(back, batch) == 0.0
    # Under pmap, a psum of per-device sums is the global token count.
    count = jax.pmap(
        lambda m: jax.lax.psum(jnp.sum(m), "data"),
        axis_name="data",
        devices=jax.local_devices()[:4],
    )(per_device.chosen_mask)
    assert int(count[0]) == int(jnp.sum(batch.chosen_mask))


def test_shard_batch_for_pmap_refuses_a_batch_that_does_not_divide(getkey):
    with pytest.raises(ValueError, match=r"\.chosen_tokens has 8 rows .*n_devices=3"):
        dist.shard_batch_for_pmap(_preference_batch(getkey()), 3)
    with pytest.raises(ValueError, match="scalar"):
        dist.shard_batch_for_pmap({"x": jnp.zeros(())}, 2)


def _objective_case(name):
    """A model, a micro-batched step (two micro-batches of four rows), a batch with uneven
    masks, and the step's extra arguments, for SFT, reward modelling, GRPO and KTO."""
    from rlhf_eqx import train

    opt = make_optimizer(learning_rate=LR, eps=ADAM_EPS, total_steps=10)
    policy = rx.Policy(_config(), key=jax.random.key(0))
    tokens, mask, completion = _rows(jax.random.key(1), [12, 10, 8, 4, 11, 9, 12, 7])
    if name == "sft":
        batch = rx.SequenceBatch(tokens=tokens, mask=mask, completion_mask=completion)
        return policy, opt, train.make_sft_step(opt, micro_batches=2), batch, {}
    if name == "reward":
        model = rx.RewardModel(_config(), key=jax.random.key(3))
        step = train.make_reward_step(opt, center_coef=0.01, micro_batches=2)
        return model, opt, step, _preference_batch(jax.random.key(4)), {}
    reference = _perturbed(policy, 2)
    if name == "grpo":
        rewards = jnp.asarray([1.0, 0.0, 0.5, 0.5, 0.0, 1.0, 1.0, 0.0])
        batch = train.GRPOBatch(
            tokens=tokens, mask=mask, completion_mask=completion, rewards=rewards
        )
        step = train.make_grpo_step(opt, group_size=2, beta=0.04, micro_batches=2)
        return policy, opt, step, batch, {"reference": reference}
    kl_tokens, kl_mask, kl_completion = _rows(jax.random.key(5), [11, 12, 9, 10, 12, 8, 11, 12])
    batch = train.KTOBatch(
        tokens=tokens,
        mask=mask,
        completion_mask=completion,
        label=jnp.asarray([True, False, True, True, False, False, True, False]),
        kl_tokens=kl_tokens,
        kl_mask=kl_mask,
        kl_completion_mask=kl_completion,
    )
    return policy, opt, train.make_kto_step(opt, micro_batches=2), batch, {"reference": reference}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sft", "reward", "grpo", "kto"])
def test_micro_batched_steps_of_other_objectives_on_an_fsdp_tp_mesh_equal_one_device(name):
    """SFT, reward modelling, GRPO (groups of two, a KL term) and KTO (its KL baseline from
    mismatched pairs), each with two micro-batches, on a (4, 2) mesh with FSDP and tensor
    parallel: the step of one device on the same global batch."""
    model, opt, step, batch, extras = _objective_case(name)
    state = init_train_state(model, opt)
    single, m1 = state.apply(step, batch, donate=False, **extras)
    mesh = dist.make_mesh(4, 2)
    placed = dist.shard_train_state(state, mesh, fsdp=True)
    extras = {k: dist.shard_model(v, mesh, fsdp=True) for k, v in extras.items()}
    sharded, m2 = placed.apply(step, dist.shard_batch(batch, mesh), **extras)
    assert_adam_steps_agree(
        single.params,
        sharded.params,
        lr=LR,
        a_opt_state=single.opt_state,
        b_opt_state=sharded.opt_state,
    )
    for key, value in m1.items():
        np.testing.assert_allclose(float(m2[key]), float(value), rtol=1e-4, atol=1e-6, err_msg=key)


@pytest.mark.slow
def test_lora_dpo_step_with_int8_base_on_a_mesh_equals_one_device():
    policy = rx.quantize_int8(rx.Policy(_config(), key=jax.random.key(0)))
    policy = rx.apply_lora(
        policy, rx.LoRAConfig(rank=4, targets=("q", "o", "up", "down")), key=jax.random.key(1)
    )
    # Non-zero `b` so that the adapters change the output from the first step on.
    policy = eqx.tree_at(
        lambda m: [a.b for a in m.transformer.layers.lora.values()],
        policy,
        [
            0.05 * jax.random.normal(jax.random.key(i), a.b.shape)
            for i, a in enumerate(policy.transformer.layers.lora.values())
        ],
    )
    batch = _preference_batch(jax.random.key(2))
    opt = make_optimizer(learning_rate=LR, eps=ADAM_EPS, total_steps=10)
    step = make_dpo_step(opt, beta=0.1, donate=False)
    state = init_train_state(policy, opt, filter_spec=rx.lora_filter(policy))
    single, _ = state.apply(step, batch, reference=rx.without_lora(policy))
    mesh = dist.make_mesh(4, 2)
    sharded_state = dist.shard_train_state(state, mesh, fsdp=True)
    reference = rx.without_lora(sharded_state.model)  # shares the sharded base
    sharded, _ = sharded_state.apply(step, dist.shard_batch(batch, mesh), reference=reference)
    assert_adam_steps_agree(
        single.params,
        sharded.params,
        lr=LR,
        a_opt_state=single.opt_state,
        b_opt_state=sharded.opt_state,
    )
    a = sharded.params.transformer.layers.lora["up"].a
    assert a.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "data", None)), a.ndim)
