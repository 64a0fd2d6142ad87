"""Shared tiny models and batches for the train tests; tests of optimisers, train state and
the micro-batching machinery."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_tree_allclose

import rlhf_eqx as rx
from rlhf_eqx.train import (
    accumulate_gradients,
    init_train_state,
    learning_rate_from_state,
    make_optimizer,
    make_schedule,
    make_sft_step,
    partition_trainable,
    split_micro_batches,
)

VOCAB = 32
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


class CumMeanLM(eqx.Module):
    """A hand-written causal LM: embedding, causal cumulative mean, tanh mixing, linear head.

    Any `(tokens, mask) -> logits [T, V]` Module works with the step builders.
    """

    embed: jax.Array
    mix: jax.Array
    head: jax.Array
    bias: jax.Array

    def __init__(self, key, vocab=VOCAB, dim=16):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = 0.5 * jax.random.normal(k1, (vocab, dim))
        self.mix = jax.random.normal(k2, (dim, dim)) / math.sqrt(dim)
        self.head = 0.3 * jax.random.normal(k3, (dim, vocab))
        self.bias = jnp.zeros((vocab,))

    def hidden(self, tokens, mask):
        m = mask.astype(jnp.float32)[:, None]
        x = self.embed[tokens] * m
        count = jnp.maximum(jnp.cumsum(m, axis=0), 1.0)
        return jnp.tanh((jnp.cumsum(x, axis=0) / count) @ self.mix) + x

    def __call__(self, tokens, mask):
        return self.hidden(tokens, mask) @ self.head + self.bias[None, :]


class CumMeanValue(eqx.Module):
    """Critic counterpart of `CumMeanLM`: `(tokens, mask) -> values [T]`."""

    body: CumMeanLM
    w: jax.Array

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.body = CumMeanLM(k1)
        self.w = 0.1 * jax.random.normal(k2, (16,))

    def __call__(self, tokens, mask):
        return self.body.hidden(tokens, mask) @ self.w


class CumMeanReward(eqx.Module):
    """Reward counterpart: the critic's value at the last real token."""

    value: CumMeanValue

    def __call__(self, tokens, mask):
        last = jnp.max(jnp.where(mask, jnp.arange(mask.shape[0]), 0))
        return self.value(tokens, mask)[last]


class CumMeanActorCritic(eqx.Module):
    """One model returning `(logits, values)` (shared body)."""

    lm: CumMeanLM
    w: jax.Array

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.lm = CumMeanLM(k1)
        self.w = 0.1 * jax.random.normal(k2, (16,))

    def __call__(self, tokens, mask):
        h = self.lm.hidden(tokens, mask)
        return h @ self.lm.head + self.lm.bias[None, :], h @ self.w


def tiny_config():
    return rx.TransformerConfig(
        vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=16
    )


def sequence_batch(key, B=4, T=10, prompt=3, vocab=VOCAB):
    """Right-padded rows of different lengths (one row with an empty completion)."""
    tokens = jax.random.randint(key, (B, T), 0, vocab)
    lengths = jnp.asarray([T, T - 2, T - 4, prompt, T - 1, T - 3, T, T - 5][:B])
    pos = jnp.arange(T)[None, :]
    mask = pos < lengths[:, None]
    completion = mask & (pos >= prompt)
    return rx.SequenceBatch(tokens=tokens, mask=mask, completion_mask=completion)


def preference_batch(key, B=4, T=10, prompt=3, vocab=VOCAB):
    k1, k2 = jax.random.split(key)
    c = sequence_batch(k1, B, T, prompt, vocab)
    r = sequence_batch(k2, B, T, prompt, vocab)
    # Same prompt, different lengths for the rejected rows.
    r_tokens = r.tokens.at[:, :prompt].set(c.tokens[:, :prompt])
    r_len = jnp.asarray([T - 1, T, T - 3, T - 2, T, T - 4, T - 1, T][:B])
    pos = jnp.arange(T)[None, :]
    r_mask = pos < r_len[:, None]
    return rx.PreferenceBatch(
        chosen_tokens=c.tokens,
        chosen_mask=c.mask,
        chosen_completion_mask=c.completion_mask,
        rejected_tokens=r_tokens,
        rejected_mask=r_mask,
        rejected_completion_mask=r_mask & (pos >= prompt),
    )


def uneven_sequences(key, B, T, prompt=3, vocab=VOCAB):
    """`(tokens, mask, completion_mask)` of `B` rows of `T` tokens whose lengths differ
    widely (row 0 has no completion token, row 5 is full), so that a per-device mean
    differs from the global one."""
    k1, k2 = jax.random.split(key)
    tokens = jax.random.randint(k1, (B, T), 1, vocab)
    lengths = jax.random.randint(k2, (B,), prompt + 1, T + 1).at[0].set(prompt).at[5].set(T)
    pos = jnp.arange(T)[None, :]
    mask = pos < lengths[:, None]
    return tokens, mask, mask & (pos >= prompt)


def uneven_preferences(key, B, T, prompt=3):
    """A `PreferenceBatch` of `uneven_sequences` rows, the rejected rows sharing the
    chosen rows' prompt tokens."""
    k1, k2 = jax.random.split(key)
    ct, cm, ccm = uneven_sequences(k1, B, T, prompt)
    rt, rm, rcm = uneven_sequences(k2, B, T, prompt)
    return rx.PreferenceBatch(
        chosen_tokens=ct,
        chosen_mask=cm,
        chosen_completion_mask=ccm,
        rejected_tokens=rt.at[:, :prompt].set(ct[:, :prompt]),
        rejected_mask=rm,
        rejected_completion_mask=rcm,
    )


def sgd_delta(step, model, batch, **kwargs):
    """Run one `optax.sgd(1.0)` step on `model`: returns (-gradient, metrics)."""
    opt = optax.sgd(1.0)
    opt_state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    new, _, metrics = step(model, opt_state, batch, **kwargs)
    delta = jax.tree.map(
        lambda a, b: a - b,
        eqx.filter(new, eqx.is_inexact_array),
        eqx.filter(model, eqx.is_inexact_array),
    )
    return delta, metrics


def leaves_equal(a, b):
    return all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


# ----------------------------------------------------------------------------- schedules


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_schedule_closed_forms(schedule):
    lr, N, W = 1e-3, 100, 10
    f = make_schedule(learning_rate=lr, total_steps=N, warmup_ratio=0.1, schedule=schedule)
    np.testing.assert_allclose(float(f(0)), 0.0)
    np.testing.assert_allclose(float(f(5)), lr * 5 / W, rtol=1e-6)
    np.testing.assert_allclose(float(f(W)), lr, rtol=1e-6)
    s = 55
    expected = {
        "cosine": 0.5 * lr * (1 + math.cos(math.pi * (s - W) / (N - W))),
        "linear": lr * (N - s) / (N - W),
        "constant": lr,
    }[schedule]
    np.testing.assert_allclose(float(f(s)), expected, rtol=1e-5)
    end = {"cosine": 0.0, "linear": 0.0, "constant": lr}[schedule]
    np.testing.assert_allclose(float(f(N)), end, atol=1e-10)
    np.testing.assert_allclose(float(f(N + 50)), end, atol=1e-10)
    # Jittable, float32.
    assert jax.jit(f)(jnp.asarray(3)).dtype == jnp.float32


def test_schedule_rejects_bad_arguments():
    # The shape/type checker of the test run rejects the unknown name before the ValueError.
    with pytest.raises((ValueError, TypeError)):
        make_schedule(learning_rate=1.0, total_steps=10, schedule="exponential")  # type: ignore
    with pytest.raises(ValueError):
        make_schedule(learning_rate=1.0, total_steps=0)
    with pytest.raises(ValueError):
        make_schedule(learning_rate=1.0, total_steps=10, warmup_ratio=1.0)


def test_optimizer_matches_optax_adamw_and_logs_learning_rate(getkey):
    params = {"w": jax.random.normal(getkey(), (3, 4)), "b": jax.random.normal(getkey(), (4,))}
    grads = {"w": jax.random.normal(getkey(), (3, 4)), "b": jax.random.normal(getkey(), (4,))}
    kw = dict(learning_rate=0.1, total_steps=20, warmup_ratio=0.2, schedule="linear")
    opt = make_optimizer(**kw, weight_decay=0.01, max_grad_norm=None, b1=0.8, b2=0.9, eps=1e-6)
    sched = make_schedule(**kw)
    ref = optax.adamw(
        sched, b1=0.8, b2=0.9, eps=1e-6, weight_decay=0.01, mask=lambda p: {"w": True, "b": False}
    )
    with jax.numpy_dtype_promotion("standard"):
        s1, s2 = opt.init(params), ref.init(params)
        p1 = p2 = params
        for i in range(6):
            u1, s1 = opt.update(grads, s1, p1)
            u2, s2 = ref.update(grads, s2, p2)
            p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
            np.testing.assert_allclose(
                float(learning_rate_from_state(s1)), float(sched(i)), rtol=1e-6
            )
    assert_tree_allclose(p1, p2, rtol=1e-5, atol=1e-7)
    assert learning_rate_from_state(s2) is None


def test_optimizer_clips_global_norm():
    opt = make_optimizer(learning_rate=1.0, total_steps=10, max_grad_norm=1.0, schedule="constant")
    params = {"w": jnp.zeros((2, 2))}
    huge = {"w": jnp.full((2, 2), 1e6)}
    clip = optax.clip_by_global_norm(1.0)
    clipped, _ = clip.update(huge, clip.init(params))
    np.testing.assert_allclose(float(optax.tree.norm(clipped)), 1.0, rtol=1e-6)
    with jax.numpy_dtype_promotion("standard"):
        state = opt.init(params)
        u, _ = opt.update(huge, state, params)
    # First Adam step moves each coordinate by ~lr, whatever the gradient's scale.
    np.testing.assert_allclose(np.asarray(u["w"]), -1.0, rtol=1e-4)


# ----------------------------------------------------------------------------- train state


def test_partition_with_filter_spec_and_combine(getkey):
    model = CumMeanLM(getkey())
    spec = jax.tree.map(lambda _: False, model)
    spec = eqx.tree_at(lambda m: m.head, spec, True)
    params, frozen = partition_trainable(model, spec)
    assert params.embed is None and params.head is not None
    assert frozen.head is None and frozen.embed is not None
    assert leaves_equal(eqx.combine(params, frozen), model)


def test_train_state_only_updates_trainable_part_and_keeps_model_valid(getkey):
    model = CumMeanLM(getkey())
    spec = eqx.tree_at(
        lambda m: (m.head, m.bias), jax.tree.map(lambda _: False, model), (True, True)
    )
    opt = make_optimizer(learning_rate=1e-2, total_steps=10)
    state = init_train_state(model, opt, filter_spec=spec)
    step = make_sft_step(opt)  # donates the state's buffers
    batch = sequence_batch(getkey())
    frozen_before = jax.tree.map(np.asarray, state.frozen)
    for _ in range(3):
        state, metrics = state.apply(step, batch)
    assert int(state.step) == 3
    assert leaves_equal(state.frozen, frozen_before)
    assert not np.allclose(np.asarray(state.params.head), np.asarray(model.head))
    # The original model still holds its own (undonated) arrays.
    assert np.isfinite(np.asarray(model.head)).all()
    assert set(metrics) >= {"loss", "grad_norm", "learning_rate", "nll"}
    assert all(v.shape == () and v.dtype == jnp.float32 for v in metrics.values())


# ----------------------------------------------------------------------------- accumulation


def test_split_micro_batches_layout_and_errors():
    x = jnp.arange(12).reshape(6, 2)
    y = split_micro_batches({"x": x, "none": None}, 3)
    assert y["x"].shape == (3, 2, 2) and y["none"] is None
    np.testing.assert_array_equal(np.asarray(y["x"][1]), np.asarray(x[2:4]))
    with pytest.raises(ValueError):
        split_micro_batches(x, 4)
    with pytest.raises(ValueError):
        split_micro_batches(x, 0)


@pytest.mark.parametrize("k", [2, 4])
def test_accumulate_gradients_equals_full_batch(getkey, k):
    w = jax.random.normal(getkey(), (3,))
    xs = jax.random.normal(getkey(), (8, 3))
    denom = 8.0

    def fn(p, mb, key):
        del key
        vals = jnp.tanh(mb @ p)
        return jnp.sum(vals**2) / denom, {"v": (jnp.sum(vals), jnp.asarray(float(mb.shape[0])))}

    l1, g1, s1 = accumulate_gradients(fn, w, xs, micro_batches=1)
    lk, gk, sk = accumulate_gradients(fn, w, xs, micro_batches=k)
    np.testing.assert_allclose(float(l1), float(lk), rtol=1e-6)
    assert_tree_allclose(g1, gk, atol=1e-6)
    assert_tree_allclose(s1, sk, atol=1e-6)
    np.testing.assert_allclose(float(sk["v"][1]), 8.0)


def counted(model):
    """`model` behind `eqx.debug.assert_max_traces` (still a pytree of the same arrays, so
    any step trains it): `traces(model)` then counts its calls from Python, i.e. the
    times a jitted step traced it."""
    return eqx.debug.assert_max_traces(model, max_traces=None)


def traces(model) -> int:
    """How often a `counted` model (or the trained copy of one) has been called from
    Python so far."""
    return eqx.debug.get_num_traces(model)


def test_step_retraces_only_for_a_new_shape(getkey):
    model = counted(CumMeanLM(getkey()))
    opt = make_optimizer(learning_rate=1e-2, total_steps=10, schedule="constant")
    state = init_train_state(model, opt)
    step = make_sft_step(opt)
    state, _ = state.apply(step, sequence_batch(getkey(), B=4, T=10))
    per_trace = traces(model)
    assert per_trace > 0
    for _ in range(2):  # new values, same shapes: the compiled step runs
        state, _ = state.apply(step, sequence_batch(getkey(), B=4, T=10))
    assert traces(model) == per_trace
    state, _ = state.apply(step, sequence_batch(getkey(), B=4, T=12))  # a new shape: once
    assert traces(model) == 2 * per_trace
    for T in (12, 10):  # both shapes are compiled now
        state, _ = state.apply(step, sequence_batch(getkey(), B=4, T=T))
    assert traces(model) == 2 * per_trace
