"""DoRA adapters (Liu et al. 2024, arXiv:2402.09353) as Hugging Face PEFT computes,
merges, saves and loads them (`LoraConfig(use_dora=True)`)."""

import functools
import json
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import rlhf_eqx as rx

CFG = rx.TransformerConfig(
    vocab_size=32,
    d_model=16,
    n_layers=2,
    n_heads=2,
    n_kv_heads=1,
    d_ff=24,
    max_seq_len=32,
    attn_bias=True,  # Qwen2's q/k/v biases: DoRA leaves them unscaled
)
TARGETS = ("q", "v", "o", "up", "down")
Q, KV = CFG.q_size, CFG.kv_size
# each target's base weight in the layer stack and its output columns there
BASE = {"q": ("wqkv", (0, Q)), "v": ("wqkv", (Q + KV, Q + 2 * KV)),
        "o": ("wo", (0, CFG.d_model)), "up": ("w_gate_up", (CFG.d_ff, 2 * CFG.d_ff)),
        "down": ("w_down", (0, CFG.d_model))}  # fmt: skip


def _weight(model, target, layer=None):
    """`(weight, columns)` the decoder layer passes to `target`'s adapter (one layer's
    weight with `layer`, else the stack)."""
    field, columns = BASE[target]
    weight = getattr(model.transformer.layers, field)
    if layer is not None:
        weight = jax.tree_util.tree_map(lambda t: t[layer], weight)
    return weight, columns


def _tokens():
    tokens = (jnp.arange(20, dtype=jnp.int32) * 7 % 32).reshape(2, 10)
    return tokens, jnp.ones(tokens.shape, bool)


def _policy(seed=0):
    policy = rx.Policy(CFG, key=jax.random.key(seed))
    bias = 0.1 * jax.random.normal(jax.random.key(9), policy.transformer.layers.bqkv.shape)
    return eqx.tree_at(lambda p: p.transformer.layers.bqkv, policy, bias)


def _dora(policy, *, rslora=False, seed=1):
    config = rx.LoRAConfig(rank=4, alpha=8.0, dropout=0.0, targets=TARGETS, use_dora=True,
                           use_rslora=rslora)  # fmt: skip
    return rx.apply_lora(policy, config, key=jax.random.key(seed))


def _trained(model, seed=3):
    """The adapters moved off their initialisation: `b` and the magnitudes random."""
    lora = model.transformer.layers.lora
    keys = iter(jax.random.split(jax.random.key(seed), 2 * len(lora)))
    new = {}
    for name, ad in lora.items():
        b = 0.3 * jax.random.normal(next(keys), ad.b.shape)
        m = ad.magnitude * (1 + 0.2 * jax.random.normal(next(keys), ad.magnitude.shape))
        new[name] = eqx.tree_at(lambda x: (x.b, x.magnitude), ad, (b, m))
    return eqx.tree_at(lambda p: p.transformer.layers.lora, model, new)


def test_a_fresh_dora_adapter_leaves_the_model_unchanged():
    policy = _policy()
    tokens, mask = _tokens()
    model = _dora(policy)
    ad = model.transformer.layers.lora["q"]
    np.testing.assert_allclose(  # magnitude = column norms of the base weight
        ad.magnitude, jnp.linalg.norm(policy.transformer.layers.wqkv[..., : CFG.q_size], axis=1),
        rtol=1e-6,
    )  # fmt: skip
    # g = m / ‖W‖ is exactly 1: each adapter of each layer adds exactly zero
    xs = {n: jax.random.normal(jax.random.key(4), (5, ad.a.shape[1]))
          for n, ad in model.transformer.layers.lora.items()}  # fmt: skip

    def delta(n, ad, w):
        return ad(xs[n], weight=w, columns=BASE[n][1])

    deltas = eqx.filter_jit(
        lambda m: {
            n: jax.vmap(functools.partial(delta, n))(ad, _weight(m, n)[0])
            for n, ad in m.transformer.layers.lora.items()
        }  # fmt: skip
    )(model)
    for name, delta in deltas.items():
        assert delta.shape[0] == CFG.n_layers and not np.any(np.asarray(delta)), name
    # the model's outputs (XLA may order the base products' sums differently: rounding)
    np.testing.assert_allclose(model(tokens, mask), policy(tokens, mask), rtol=1e-6, atol=1e-6)
    int8 = rx.quantize_int8(policy)
    np.testing.assert_allclose(_dora(int8)(tokens, mask), int8(tokens, mask), rtol=1e-6, atol=1e-6)


def _peft_reference(x, w, a, b, m, s, c):
    """PEFT's DoRA on one projection in float64 (layout `[in, out]`): the output
    `y = m / ‖W + s·A B‖ ⊙ (x W + s·x A B)` with the norm a constant (detached), and the
    gradients of `Σ y ⊙ c` with respect to `m`, `A`, `B`."""
    x, w, a, b, m, c = (np.asarray(t, np.float64) for t in (x, w, a, b, m, c))
    norm = np.linalg.norm(w + s * a @ b, axis=0)
    g = m / norm
    y = (x @ w + s * x @ a @ b) * g
    dm = np.sum(c * (x @ w + s * x @ a @ b), axis=0) / norm
    cg = c * g
    db = s * (x @ a).T @ cg
    da = s * x.T @ (cg @ b.T)
    return y, dm, da, db


@pytest.mark.parametrize("rslora", [False, True])
def test_gradients_match_peft_with_the_norm_detached(rslora):
    model = _trained(_dora(_policy(), rslora=rslora))
    ad = model.transformer.layers.lora["v"]
    layer = jax.tree_util.tree_map(lambda t: t[1], ad)  # layer 1, as the scan slices it
    weight, (lo, hi) = _weight(model, "v", 1)
    x = jax.random.normal(jax.random.key(5), (6, CFG.d_model))
    c = jax.random.normal(jax.random.key(6), (6, hi - lo))
    base = weight[..., lo:hi]

    def loss(trainable):  # as the decoder layer calls it: its own product is `base`
        ad = eqx.combine(trainable, frozen)
        return jnp.sum((x @ base + ad(x, weight=weight, columns=(lo, hi), base=x @ base)) * c)

    trainable, frozen = eqx.partition(layer, lambda t: False)
    parts = (layer.a, layer.b, layer.magnitude)
    trainable = eqx.tree_at(lambda t: (t.a, t.b, t.magnitude), trainable,
                            parts, is_leaf=lambda t: t is None)  # fmt: skip
    grads = jax.grad(loss)(trainable)
    s = float(layer.scale)
    assert s == pytest.approx(8.0 / (2.0 if rslora else 4.0))
    y, dm, da, db = _peft_reference(x, base, layer.a, layer.b, layer.magnitude, s, c)
    for given in (x @ base, None):  # the layer's product, or taken again
        out = layer(x, weight=weight, columns=(lo, hi), base=given)
        np.testing.assert_allclose(x @ base + out, y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grads.magnitude, dm, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(grads.a, da, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(grads.b, db, rtol=1e-4, atol=1e-5)


def test_lora_filter_trains_magnitudes_and_low_rank_factors_only():
    model = _dora(_policy())
    trainable, _ = eqx.partition(model, rx.lora_filter(model))
    names = {
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree_util.tree_leaves_with_path(trainable)
        if leaf is not None
    }
    assert all(n.split(".")[-1] in ("a", "b", "magnitude") for n in names), names
    assert len(names) == 3 * len(TARGETS)
    D, Q, KV, F = CFG.d_model, CFG.q_size, CFG.kv_size, CFG.d_ff
    shapes = {"q": (D, Q), "v": (D, KV), "o": (Q, D), "up": (D, F), "down": (F, D)}
    # rank 4: A and B, plus one magnitude per output feature, in each layer
    expected = sum(CFG.n_layers * (4 * (i + o) + o) for i, o in shapes.values())
    assert rx.models.count_params(model, rx.lora_filter(model)) == expected


def test_merge_equals_the_adapted_forward_and_jit_equals_eager():
    model = _trained(_dora(_policy()))
    tokens, mask = _tokens()
    eager = model(tokens, mask)
    np.testing.assert_allclose(eqx.filter_jit(lambda m: m(tokens, mask))(model), eager,
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    np.testing.assert_allclose(rx.merge_lora(model)(tokens, mask), eager, rtol=1e-4, atol=1e-5)
    assert not np.allclose(rx.without_lora(model)(tokens, mask), eager, atol=1e-3)

    def loss(trainable, frozen):
        return jnp.mean(eqx.combine(trainable, frozen)(tokens, mask) ** 2)

    trainable, frozen = eqx.partition(model, rx.lora_filter(model))
    g_eager = jax.grad(loss)(trainable, frozen)
    g_jit = eqx.filter_jit(jax.grad(loss))(trainable, frozen)
    for x, y in zip(jax.tree_util.tree_leaves(g_eager), jax.tree_util.tree_leaves(g_jit)):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)


def test_dropout_follows_peft_on_the_dropped_input():
    """With dropout PEFT takes the base product again on the dropped input: `y = x W +
    (g - 1) x̃ W + g s x̃ A B`."""
    config = rx.LoRAConfig(rank=4, alpha=8.0, dropout=0.5, targets=("o",), use_dora=True)
    model = _trained(rx.apply_lora(_policy(), config, key=jax.random.key(1)))
    layer = jax.tree_util.tree_map(lambda t: t[0], model.transformer.layers.lora["o"])
    x = jax.random.normal(jax.random.key(5), (4, CFG.q_size))
    key = jax.random.key(8)
    keep = jax.random.bernoulli(key, 0.5, x.shape)
    dropped = np.where(keep, np.asarray(x) * 2.0, 0.0)
    weight, columns = _weight(model, "o", 0)
    w = np.asarray(weight, np.float64)
    a, b, m = (np.asarray(t, np.float64) for t in (layer.a, layer.b, layer.magnitude))
    s = float(layer.scale)
    g = m / np.linalg.norm(w + s * a @ b, axis=0)
    expected = (g - 1) * (dropped @ w) + g * s * (dropped @ a @ b)
    # the layer's product of the undropped input is not what the dropped one needs
    got = layer(x, key, weight=weight, columns=columns, base=x @ weight)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_peft_adapter_round_trip_with_peft_names(tmp_path):
    policy = _policy()
    model = _trained(_dora(policy))
    rx.save_lora_adapter(model, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["use_dora"] is True and config["peft_type"] == "LORA"
    tensors = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    name = "base_model.model.model.layers.1.self_attn.q_proj.lora_magnitude_vector"
    assert tensors[name].shape == (CFG.q_size,)
    np.testing.assert_array_equal(tensors[name], model.transformer.layers.lora["q"].magnitude[1])
    assert sum(k.endswith(".lora_magnitude_vector") for k in tensors) == 2 * len(TARGETS)
    loaded = rx.load_lora_adapter(policy, tmp_path / "adapter")
    tokens, mask = _tokens()
    np.testing.assert_allclose(loaded(tokens, mask), model(tokens, mask), rtol=1e-6, atol=1e-6)
    # an int8 base reads the same adapter
    int8 = rx.load_lora_adapter(rx.quantize_int8(policy), tmp_path / "adapter")
    np.testing.assert_allclose(int8(tokens, mask), model(tokens, mask), rtol=0.05, atol=0.05)


def test_a_peft_written_dora_adapter_loads(tmp_path):
    """An adapter in PEFT's own layout (only `q_proj` of layer 0, bfloat16 magnitudes)."""
    import ml_dtypes

    policy = _policy()
    rng = np.random.default_rng(0)
    a = rng.normal(size=(2, CFG.d_model)).astype(np.float32)
    b = rng.normal(size=(CFG.q_size, 2)).astype(np.float32)
    m = rng.uniform(0.5, 1.5, size=(CFG.q_size,)).astype(ml_dtypes.bfloat16)
    stem = "base_model.model.model.layers.0.self_attn.q_proj"
    path = tmp_path / "peft"
    path.mkdir()
    save_file({f"{stem}.lora_A.weight": a, f"{stem}.lora_B.weight": b,
               f"{stem}.lora_magnitude_vector": m}, path / "adapter_model.safetensors")  # fmt: skip
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"],
              "layers_to_transform": [0], "use_dora": True}  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(config))
    model = rx.load_lora_adapter(policy, path)
    ad = jax.tree_util.tree_map(lambda t: t[0], model.transformer.layers.lora["q"])
    x = rng.normal(size=(3, CFG.d_model)).astype(np.float32)
    w = np.asarray(policy.transformer.layers.wqkv[0][:, : CFG.q_size], np.float64)
    y, *_ = _peft_reference(x, w, a.T, b.T, m.astype(np.float32), 2.0, np.zeros((3, 1)))
    got = ad(jnp.asarray(x), weight=_weight(policy, "q", 0)[0], columns=BASE["q"][1])
    np.testing.assert_allclose(x @ w + got, y, rtol=1e-5, atol=1e-5)
    # layer 1 is not adapted: its output is the base's
    other = jax.tree_util.tree_map(lambda t: t[1], model.transformer.layers.lora["q"])
    got = other(jnp.asarray(x), weight=_weight(policy, "q", 1)[0], columns=BASE["q"][1])
    assert not np.any(np.asarray(got))


def test_refusals_are_one_line_naming_the_field(tmp_path):
    policy = _policy()
    model = _dora(policy)
    path = tmp_path / "a"
    rx.save_lora_adapter(model, path)
    tensors = load_file(path / "adapter_model.safetensors")
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"
    save_file({k: v for k, v in tensors.items() if k != name}, path / "adapter_model.safetensors")
    with pytest.raises(ValueError, match=f"{name}.*is missing"):
        rx.load_lora_adapter(policy, path)
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, "use_dora": False}))
    with pytest.raises(ValueError, match="DoRA magnitude but `use_dora` is False"):
        rx.load_lora_adapter(policy, path)


def test_an_adapter_made_by_peft_computes_peft_s_merged_weights(tmp_path):
    """`tests/fixtures/peft/dora`, written by PEFT (`use_dora=True`, every trainable
    tensor, magnitudes included, moved off its initialisation). PEFT's merge in float64
    NumPy, `W' = m / ‖W + s·B A‖ · (W + s·B A)` with `W [out, in]` and the norm over
    `in`, gives the logits of the loaded adapter; saving writes the same tensors again."""
    fixtures = os.path.join(os.path.dirname(__file__), "fixtures")
    base = rx.load_hf(os.path.join(fixtures, "hf", "llama3"), dtype="float32")
    model = rx.load_lora_adapter(base, os.path.join(fixtures, "peft", "dora"))
    assert set(model.transformer.layers.lora) == {"q", "v"}
    tensors = load_file(os.path.join(fixtures, "peft", "dora", "adapter_model.safetensors"))
    cfg = base.cfg
    wqkv = np.array(base.transformer.layers.wqkv, np.float64)  # [L, in, q + 2 kv]
    cols = {"q": slice(0, cfg.q_size), "v": slice(cfg.q_size + cfg.kv_size, None)}
    for i in range(cfg.n_layers):
        for target, proj in (("q", "q_proj"), ("v", "v_proj")):
            stem = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            names = ("lora_A.weight", "lora_B.weight", "lora_magnitude_vector")
            a, b, m = (np.asarray(tensors[f"{stem}.{n}"], np.float64) for n in names)
            w = wqkv[i][:, cols[target]].T + (4 / 2) * b @ a  # [out, in], lora_alpha / r
            merged = m[:, None] / np.linalg.norm(w, axis=1, keepdims=True) * w
            wqkv[i][:, cols[target]] = merged.T
    reference = eqx.tree_at(
        lambda p: p.transformer.layers.wqkv, base, jnp.asarray(wqkv, jnp.float32)
    )
    tokens = jnp.asarray([[1, 5, 9, 3, 7, 2]], jnp.int32)
    mask = jnp.ones(tokens.shape, bool)
    want = reference(tokens, mask)
    assert np.abs(np.asarray(want - base(tokens, mask))).max() > 1e-2  # the adapter shows
    np.testing.assert_allclose(model(tokens, mask), want, rtol=1e-4, atol=1e-5)
    rx.save_lora_adapter(model, tmp_path / "again")
    again = load_file(tmp_path / "again" / "adapter_model.safetensors")
    assert sorted(again) == sorted(tensors)
    for name, value in tensors.items():
        np.testing.assert_array_equal(again[name], value)


def test_kv_cache_decode_equals_the_forward_pass():
    model = _trained(_dora(_policy()))
    seq = jnp.asarray([3, 1, 4, 1, 5, 9, 2, 6], jnp.int32)
    full = model(seq, jnp.ones(seq.shape, bool))
    prefill = eqx.filter_jit(lambda p, t, m: p.prefill(t, m, cache_size=seq.shape[0]))
    step = eqx.filter_jit(lambda p, tok, c, i: p.decode_step(tok, c, index=i, position=i))
    logits, cache = prefill(model, seq[:3], jnp.ones((3,), bool))
    np.testing.assert_allclose(logits, full[2], rtol=1e-5, atol=1e-5)
    for t in range(3, seq.shape[0]):
        logits, cache = step(model, seq[t], cache, jnp.int32(t))
        np.testing.assert_allclose(logits, full[t], rtol=1e-5, atol=1e-5)


def test_a_packed_gguf_base_takes_dora_adapters():
    """The norm reads the dequantised weight (as PEFT's DoRA on a quantised base does):
    a GGUF-block base (llama.cpp's Q8_0 / Q4_0) works like a dense one."""
    cfg = rx.TransformerConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=2, d_ff=64,
                               max_seq_len=16)  # fmt: skip
    dense = rx.Policy(cfg, key=jax.random.key(0))
    layers = dense.transformer.layers
    packed = eqx.tree_at(
        lambda p: (p.transformer.layers.wqkv, p.transformer.layers.w_down),
        dense,
        (
            rx.models.quantize_gguf(layers.wqkv, "Q8_0"),
            rx.models.quantize_gguf(layers.w_down, "Q4_0"),
        ),
    )
    config = rx.LoRAConfig(rank=2, targets=("q", "down"), dropout=0.0, use_dora=True)
    tokens = jnp.arange(8, dtype=jnp.int32)[None]
    mask = jnp.ones(tokens.shape, bool)
    fresh = rx.apply_lora(packed, config, key=jax.random.key(1))
    np.testing.assert_allclose(fresh(tokens, mask), packed(tokens, mask), rtol=1e-6, atol=1e-6)
    model = _trained(fresh)
    # folded into the dequantised base (merge_lora refuses a packed one), the same outputs
    merged = rx.merge_lora(rx.models.dequantize(model, dtype="float32"))
    np.testing.assert_allclose(model(tokens, mask), merged(tokens, mask), rtol=1e-4, atol=1e-5)
    assert not np.allclose(model(tokens, mask), packed(tokens, mask), atol=1e-3)


def test_a_small_magnitude_change_shows_in_bfloat16():
    """`g - 1` is taken in float32: a magnitude 0.3% above the norm rescales a bfloat16
    projection by 0.3% (in bfloat16 `g` itself would round to 1)."""
    import dataclasses

    policy = rx.Policy(dataclasses.replace(CFG, dtype="bfloat16"), key=jax.random.key(0))
    config = rx.LoRAConfig(rank=4, alpha=8.0, dropout=0.0, targets=("o",), use_dora=True)
    model = rx.apply_lora(policy, config, key=jax.random.key(1))
    stack = model.transformer.layers.lora["o"]
    layer = jax.tree_util.tree_map(lambda t: t[0], stack)
    layer = eqx.tree_at(lambda ad: ad.magnitude, layer, layer.magnitude * 1.003)
    x = jax.random.normal(jax.random.key(2), (4, CFG.q_size)).astype(jnp.bfloat16)
    weight = model.transformer.layers.wo[0]
    base = np.asarray(x, np.float32) @ np.asarray(weight, np.float32)
    delta = np.asarray(layer(x, weight=weight, columns=(0, CFG.d_model)), np.float32)
    np.testing.assert_allclose(delta, 0.003 * base, rtol=0.05, atol=2e-3 * np.abs(base).max())
    assert np.abs(delta).max() > 1e-3 * np.abs(base).max()


def test_the_base_weight_is_one_leaf_of_the_model_through_quantize_and_checkpoints(tmp_path):
    """The adapters hold no reference to the base weight: the model's pytree has each
    array once, `quantize_int8` leaves no float copy of a projection, and a checkpoint
    (`eqx.tree_serialise_leaves`, as the pipelines write one) stores the base once and
    restores one array per leaf."""
    policy = _policy()
    model = _trained(_dora(policy))
    leaves = jax.tree_util.tree_leaves(model)
    assert len({id(x) for x in leaves}) == len(leaves)
    assert len(leaves) == len(jax.tree_util.tree_leaves(policy)) + 4 * len(TARGETS)
    dense = {getattr(policy.transformer.layers, f).shape for f, _ in BASE.values()}
    int8 = rx.quantize_int8(model)
    float_leaves = [
        x for x in jax.tree_util.tree_leaves(int8) if jnp.issubdtype(x.dtype, jnp.floating)
    ]
    assert not [x.shape for x in float_leaves if x.shape in dense]
    tokens, mask = _tokens()
    want = int8(tokens, mask)
    np.testing.assert_allclose(want, model(tokens, mask), rtol=0.05, atol=0.05)
    for name, tree in (("base", policy), ("dora", model), ("int8", int8)):
        eqx.tree_serialise_leaves(tmp_path / f"{name}.eqx", tree)
    size = lambda name: (tmp_path / f"{name}.eqx").stat().st_size
    adapters = sum(x.nbytes for x in jax.tree_util.tree_leaves(model.transformer.layers.lora))
    assert size("dora") - size("base") < adapters + 4096  # the adapters, not a base copy
    restored = eqx.tree_deserialise_leaves(tmp_path / "int8.eqx", int8)
    leaves = jax.tree_util.tree_leaves(restored)
    assert len({id(x) for x in leaves}) == len(leaves)
    np.testing.assert_array_equal(restored(tokens, mask), want)


def test_memory_estimate_counts_the_base_once_and_trains_the_adapters_only():
    config = rx.LoRAConfig(rank=4, alpha=8.0, dropout=0.0, targets=TARGETS, use_dora=True)
    model = rx.apply_lora(rx.Policy(CFG, key=jax.random.key(0)), config, key=jax.random.key(1))
    est = rx.estimate_memory(CFG, (1, 1), (2, 8), lora=config, reference="none")
    assert est.trainable_params == rx.models.count_params(model, rx.lora_filter(model))
    unique = {id(x): x for x in jax.tree_util.tree_leaves(model)}  # each array once
    assert est.params == sum(x.nbytes for x in unique.values())


def test_partition_specs_split_magnitudes_like_the_columns_they_scale():
    model = _dora(_policy())
    specs = rx.models.partition_specs(model, fsdp=True).transformer.layers.lora
    assert specs["q"].magnitude == jax.sharding.PartitionSpec(None, "model")
    assert specs["q"].b == jax.sharding.PartitionSpec(None, None, "model")
    assert specs["o"].magnitude == jax.sharding.PartitionSpec(None, "data")
    assert specs["o"].scale == jax.sharding.PartitionSpec(None)


def test_save_gguf_adapter_refuses_dora_saying_what_to_write_instead(tmp_path):
    pytest.importorskip("gguf", reason="GGUF files need the gguf package")
    model = _trained(_dora(_policy()))
    with pytest.raises(ValueError, match=r"DoRA.*merge_lora.*save_gguf$") as info:
        rx.models.save_gguf_adapter(model, tmp_path / "a.gguf")
    assert "\n" not in str(info.value) and not (tmp_path / "a.gguf").exists()
    rx.models.write_gguf(rx.merge_lora(model), tmp_path / "m.gguf", dtype="f32")
    again = rx.models.load_gguf_policy(tmp_path / "m.gguf")
    tokens, mask = _tokens()
    np.testing.assert_allclose(again(tokens, mask), model(tokens, mask), rtol=1e-4, atol=1e-5)
