"""Int8 weight-only quantisation: closed form, accuracy, a frozen base under LoRA, jit/generate."""

import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, strategies as st
from hypothesis.extra import numpy as hnp

import rlhf_eqx as rx
from rlhf_eqx.models import (
    Int8Weight,
    LoRAConfig,
    apply_lora,
    count_params,
    dequantize,
    lora_filter,
    merge_lora,
    quantize_int8,
    quantize_weight_int8,
    without_lora,
)

CFG = rx.TransformerConfig(
    vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=64
)
FIELDS = ("wqkv", "wo", "w_gate_up", "w_down")
TOKENS = jnp.arange(3, 13, dtype=jnp.int32)
MASK = jnp.ones((10,), jnp.bool_)


@eqx.filter_jit
def _out(model):
    return model(TOKENS, MASK)


def _random_policy(key, scale=0.1):
    model = rx.Policy(CFG, key=key)
    leaves, treedef = jax.tree_util.tree_flatten(model)
    keys = jax.random.split(jax.random.fold_in(key, 1), len(leaves))
    leaves = [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def test_quantize_weight_int8_closed_form():
    w = jnp.asarray([[1.0, -2.0, 0.0], [0.5, 4.0, 0.0]], jnp.float32)
    qw = quantize_weight_int8(w)
    assert qw.q.dtype == jnp.int8 and qw.scale.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(qw.scale), [1 / 127, 4 / 127, 0.0], rtol=1e-7)
    # 0.5 * 127 = 63.5 and -2 * 127 / 4 = -63.5 round half to even
    np.testing.assert_array_equal(np.asarray(qw.q), [[127, -64, 0], [64, 127, 0]])
    np.testing.assert_array_equal(np.asarray(qw.dequantize(jnp.float32))[:, 2], [0.0, 0.0])


@given(
    hnp.arrays(
        np.float32,
        (6, 5),  # one shape: one compilation
        elements=st.floats(0.0009765625, 100, width=32)
        | st.floats(-100, -0.0009765625, width=32)
        | st.just(0.0),
    ),
    st.integers(0, 4),
)
def test_quantize_weight_int8_error_bound(w, zero_col):
    w = w.copy()
    w[:, zero_col] = 0.0
    qw = quantize_weight_int8(jnp.asarray(w))
    q, scale = np.asarray(qw.q), np.asarray(qw.scale)
    amax = np.max(np.abs(w), axis=0)
    np.testing.assert_allclose(scale, amax / 127, rtol=1e-6)
    assert np.all(np.abs(q.astype(np.int32)) <= 127)
    assert np.all(np.max(np.abs(q.astype(np.int32)), axis=0)[amax > 0] == 127)
    err = np.abs(np.asarray(qw.dequantize(jnp.float32)) - w)
    assert np.all(err <= scale[None, :] * (0.5 + 1e-4) + 1e-30)


@pytest.mark.parametrize("kind", [rx.Policy, rx.ValueModel, rx.RewardModel, rx.Transformer])
def test_quantize_structure_and_dequantize(kind, getkey):
    model = kind(CFG, key=getkey())
    q = quantize_int8(model)
    layers = q.layers if kind is rx.Transformer else q.transformer.layers
    dense_layers = model.layers if kind is rx.Transformer else model.transformer.layers
    for f in FIELDS:
        w, d = getattr(layers, f), getattr(dense_layers, f)
        assert isinstance(w, Int8Weight)
        assert w.q.dtype == jnp.int8 and w.q.shape == d.shape
        assert w.scale.shape == (CFG.n_layers, d.shape[-1]) and w.scale.dtype == jnp.float32
        deq = np.asarray(jax.vmap(lambda x: x.dequantize(jnp.float32))(w))
        assert np.all(np.abs(deq - np.asarray(d)) <= np.asarray(w.scale)[:, None, :] * 0.5001)
    # Everything else is the same array object.
    for name in ("attn_norm", "mlp_norm"):
        assert getattr(layers, name) is getattr(dense_layers, name)
    # Idempotent; dequantize restores dense float arrays of the parameter dtype.
    assert quantize_int8(q) is q
    back = dequantize(q)
    back_layers = back.layers if kind is rx.Transformer else back.transformer.layers
    for f in FIELDS:
        assert getattr(back_layers, f).dtype == jnp.float32
    assert dequantize(model) is model
    # int8 projections hold about a quarter of the bytes.
    nbytes = lambda t: sum(
        x.nbytes for x in jax.tree_util.tree_leaves([getattr(t, f) for f in FIELDS])
    )
    assert nbytes(layers) < 0.3 * nbytes(dense_layers)
    assert count_params(q) > count_params(model)  # scales are extra entries


def test_int8_logits_close_on_random_model(getkey):
    model = _random_policy(getkey())
    q = quantize_int8(model)
    ref, got = np.asarray(_out(model)), np.asarray(_out(q))
    err = np.max(np.abs(got - ref))
    assert 0 < err <= 0.05 * np.max(np.abs(ref)), (err, np.max(np.abs(ref)))
    assert np.mean(np.argmax(got, -1) == np.argmax(ref, -1)) >= 0.9
    # The int8 forward computes exactly with the dequantised weights.
    np.testing.assert_allclose(np.asarray(_out(dequantize(q))), got, atol=1e-5, rtol=1e-5)


def test_lora_on_int8_base_trains_only_adapters(getkey):
    base = quantize_int8(_random_policy(getkey()))
    model = apply_lora(base, LoRAConfig(rank=4, targets=("q", "v", "gate", "down")), key=getkey())
    trainable, frozen = eqx.partition(model, lora_filter(model))
    assert count_params(trainable) == count_params(model, lora_filter(model)) > 0
    opt = optax.adamw(1e-2)
    state = opt.init(eqx.filter(trainable, eqx.is_array))

    @eqx.filter_jit
    def step(trainable, state, key):
        def loss(trainable):
            m = eqx.combine(trainable, frozen)
            return -jnp.sum(rx.logprobs_from_logits(m(TOKENS, MASK, key=key), TOKENS, MASK))

        grads = eqx.filter_grad(loss)(trainable)
        with jax.numpy_dtype_promotion("standard"):  # optax's bias correction: float ** int32
            updates, state = opt.update(grads, state, trainable)
        return eqx.apply_updates(trainable, updates), state

    new_trainable, state = step(trainable, state, getkey())
    new = eqx.combine(new_trainable, frozen)
    old_base = jax.tree_util.tree_leaves(without_lora(model))
    new_base = jax.tree_util.tree_leaves(without_lora(new))
    assert all(a is b for a, b in zip(old_base, new_base))
    assert isinstance(new.transformer.layers.wqkv, Int8Weight)
    changed = [
        not np.array_equal(
            np.asarray(new.transformer.layers.lora[n].b),
            np.asarray(model.transformer.layers.lora[n].b),
        )
        for n in ("q", "v", "gate", "down")
    ]
    assert all(changed)
    with pytest.raises(TypeError, match="dequantize"):
        merge_lora(new)
    # dequantize, then merge: same logits as the int8 base with adapters.
    merged = merge_lora(dequantize(new))
    np.testing.assert_allclose(
        np.asarray(_out(merged)), np.asarray(_out(new)), atol=1e-4, rtol=1e-4
    )


def test_stories260k_int8(shared_dir):
    base = os.path.join(shared_dir, "models", "stories260K")
    policy, tok = rx.load_llama2c(
        os.path.join(base, "stories260K.bin"), os.path.join(base, "tok512.bin")
    )
    q = quantize_int8(policy)
    tokens = jnp.asarray([1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421], jnp.int32)
    mask = jnp.ones(tokens.shape, jnp.bool_)
    ref, got = np.asarray(policy(tokens, mask)), np.asarray(eqx.filter_jit(q)(tokens, mask))
    assert np.max(np.abs(got - ref)) <= 0.03 * np.max(np.abs(ref))
    np.testing.assert_array_equal(np.argmax(got, -1), np.argmax(ref, -1))
    out = rx.generate(
        q,
        jnp.asarray([1], jnp.int32),
        jnp.ones((1,), jnp.bool_),
        jax.random.key(0),
        max_new_tokens=24,
        temperature=0.0,
    )
    text = tok.decode([int(t) for t in out.tokens])
    assert text.startswith("Once upon a time, there was a little girl named Lily."), text
