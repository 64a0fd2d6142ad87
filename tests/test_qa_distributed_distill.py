"""The distillation steps under `jax.shard_map` with its default `check_vma=True`.

GKD's chunked LM head skips chunks without a completion position (`jax.lax.cond`); its
branches must have one type there (varying over the data axis), and the heads' weights
must vary like the rows before the conditional. A step built with `axis_name="data"`
equals the one-device step on the global batch, with the rows of one device holding no
completion token at all (every chunk of that device is skipped).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_updates_agree
from jax.sharding import PartitionSpec as P
from test_train_common import CumMeanLM, tiny_config

import rlhf_eqx as rx
from rlhf_eqx.data import DistillBatch
from rlhf_eqx.distributed import make_mesh
from rlhf_eqx.train import make_distill_step, make_onpolicy_distill_step

N_DEV = 4
B = 8
T = 10

pytestmark = pytest.mark.skipif(
    jax.device_count() < N_DEV, reason=f"needs {N_DEV} (simulated) devices"
)


def _batch(key, vocab, **fields):
    k1, k2 = jax.random.split(key)
    tokens = jax.random.randint(k1, (B, T), 1, vocab)
    lengths = jax.random.randint(k2, (B,), 4, T + 1).at[0].set(3).at[5].set(T)
    pos = jnp.arange(T)[None, :]
    mask = pos < lengths[:, None]
    # rows 2 and 3 (the second device's) have no completion token
    completion = (mask & (pos >= 3)).at[2:4].set(False)
    return DistillBatch(tokens=tokens, mask=mask, completion_mask=completion, **fields)


def _compare(build, student, batch, teacher, **kw):
    """`build(..., axis_name="data")` under `jax.shard_map` over 4 devices (student,
    optimiser state and teacher replicated, rows split) against `build(...)` under
    `jax.jit` on the global batch: the same update and metrics."""
    opt = optax.sgd(1.0)
    opt_state = opt.init(eqx.filter(student, eqx.is_inexact_array))
    one, dp = build(opt, **kw), build(opt, axis_name="data", **kw)
    one_params, _, one_m = jax.jit(lambda p, s, b, t: one(p, s, b, teacher=t))(
        student, opt_state, batch, teacher
    )
    mesh = make_mesh(N_DEV, devices=jax.devices()[:N_DEV])
    sharded = jax.shard_map(
        lambda p, s, b, t: dp(p, s, b, teacher=t),
        mesh=mesh,
        in_specs=(P(), P(), P("data"), P()),
        out_specs=P(),
    )
    dp_params, _, dp_m = jax.jit(sharded)(student, opt_state, batch, teacher)
    assert_updates_agree(dp_params, one_params, student)
    moved = jax.tree.map(
        jnp.subtract, *(eqx.filter(p, eqx.is_inexact_array) for p in (one_params, student))
    )
    assert max(float(jnp.max(jnp.abs(u))) for u in jax.tree.leaves(moved)) > 1e-4
    for name, value in one_m.items():
        np.testing.assert_allclose(
            np.asarray(dp_m[name]), np.asarray(value), rtol=2e-4, atol=2e-5, err_msg=name
        )


@pytest.mark.parametrize(
    "chunk", [pytest.param(4, marks=pytest.mark.slow), 1]
)  # unrolled chunks; a scan over 20 chunks
def test_shard_map_distill_step_equals_one_device(getkey, chunk):
    cfg = tiny_config()
    student, teacher = rx.Policy(cfg, key=getkey()), rx.Policy(cfg, key=getkey())
    batch = _batch(getkey(), cfg.vocab_size)
    _compare(make_distill_step, student, batch, teacher, beta=0.4, chunk=chunk)


@pytest.mark.slow
def test_shard_map_distill_step_other_students_and_cached_teacher(getkey):
    cfg = tiny_config()
    teacher = rx.Policy(cfg, key=getkey())
    batch = _batch(getkey(), cfg.vocab_size)
    # a student returning full logits (identity head) against a Policy teacher
    _compare(make_distill_step, CumMeanLM(getkey(), vocab=cfg.vocab_size), batch, teacher, chunk=4)
    # the teacher's logits cached in the batch (no teacher model)
    cached = _batch(getkey(), cfg.vocab_size)
    cached = eqx.tree_at(
        lambda b: b.teacher_logits,
        cached,
        jax.vmap(teacher)(cached.tokens, cached.mask),
        is_leaf=lambda x: x is None,
    )
    _compare(make_distill_step, rx.Policy(cfg, key=getkey()), cached, None, chunk=4)


def test_shard_map_onpolicy_distill_step_equals_one_device(getkey):
    cfg = tiny_config()
    student, teacher = rx.Policy(cfg, key=getkey()), rx.Policy(cfg, key=getkey())
    batch = _batch(getkey(), cfg.vocab_size)
    _compare(make_onpolicy_distill_step, student, batch, teacher, kl_coef=0.5, clip_eps=0.2)
