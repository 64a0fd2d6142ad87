"""PEFT adapter directories beyond one rank and alpha: `use_rslora`, `rank_pattern` /
`alpha_pattern`, and adapters whose config names no base model. Directories are written
by hand as PEFT writes them, and the maths is checked against `B·A·x · scale` computed
in numpy."""

import dataclasses
import json
import math
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import rlhf_eqx as rx

CFG = rx.TransformerConfig(
    vocab_size=32, d_model=16, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=24, max_seq_len=32
)
MODULES = {"q": "self_attn.q_proj", "v": "self_attn.v_proj", "up": "mlp.up_proj"}
SHAPES = {"q": (16, 16), "v": (16, 8), "up": (16, 24)}  # (in, out)
TOKENS = jnp.asarray([1, 5, 9, 2, 30, 7, 7, 11], jnp.int32)
MASK = TOKENS > 0


@pytest.fixture(scope="module")
def base():
    return rx.Policy(CFG, key=jax.random.key(0))


def _write_adapter(directory, ranks, config, seed=0):
    """A PEFT adapter directory: `ranks[target][i]` is layer `i`'s rank (0: no tensors);
    returns the tensors `{(target, i): (A [r, in], B [out, r])}`."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    tensors, parts = {}, {}
    for target, per_layer in ranks.items():
        fan_in, fan_out = SHAPES[target]
        for i, r in enumerate(per_layer):
            if r == 0:
                continue
            a = rng.standard_normal((r, fan_in)).astype(np.float32) * 0.3
            b = rng.standard_normal((fan_out, r)).astype(np.float32) * 0.3
            stem = f"base_model.model.model.layers.{i}.{MODULES[target]}"
            tensors[f"{stem}.lora_A.weight"], tensors[f"{stem}.lora_B.weight"] = a, b
            parts[(target, i)] = (a, b)
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    full = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None,
        "lora_dropout": 0.0,
        "target_modules": sorted(MODULES[t].split(".")[1] for t in ranks),
        "bias": "none",
        "use_rslora": False,
        "rank_pattern": {},
        "alpha_pattern": {},
        **config,
    }
    (directory / "adapter_config.json").write_text(json.dumps(full, indent=2, sort_keys=True))
    return parts


def _layer(adapter, i):
    return jax.tree_util.tree_map(lambda t: t[i], adapter)


def _hand_merged(base, parts, scales):
    """`base` with `W += (B·A)ᵀ · scale` per adapted layer, in numpy float64."""
    layers = base.transformer.layers
    wqkv, wgu = np.array(layers.wqkv, np.float64), np.array(layers.w_gate_up, np.float64)
    cols = {"q": (wqkv, 0, 16), "v": (wqkv, 24, 32), "up": (wgu, 24, 48)}
    for (target, i), (a, b) in parts.items():
        w, lo, hi = cols[target]
        w[i, :, lo:hi] += (b.astype(np.float64) @ a).T * scales[(target, i)]
    return eqx.tree_at(
        lambda m: [m.transformer.layers.wqkv, m.transformer.layers.w_gate_up],
        base,
        [jnp.asarray(wqkv, jnp.float32), jnp.asarray(wgu, jnp.float32)],
    )


def _logits(model):
    return np.asarray(eqx.filter_jit(lambda m: m(TOKENS, MASK))(model))


def test_rslora_scales_by_alpha_over_root_rank(base, tmp_path):
    parts = _write_adapter(
        tmp_path / "ad", {"q": [4, 4, 4]}, {"r": 4, "lora_alpha": 3, "use_rslora": True}
    )
    model = rx.load_lora_adapter(base, tmp_path / "ad")
    ad = model.transformer.layers.lora["q"]
    np.testing.assert_allclose(np.asarray(ad.scale), [3 / 2] * 3, rtol=1e-7)
    x = np.random.default_rng(1).standard_normal((5, 16)).astype(np.float32)
    for i in range(3):
        a, b = parts[("q", i)]
        want = x.astype(np.float64) @ a.T @ b.T * (3 / math.sqrt(4))
        got = np.asarray(_layer(ad, i)(jnp.asarray(x)))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    scales = {k: 3 / 2 for k in parts}
    np.testing.assert_allclose(
        _logits(model), _logits(_hand_merged(base, parts, scales)), atol=2e-5
    )


def test_rank_and_alpha_patterns_match_as_peft_does(base, tmp_path):
    """PEFT's `get_pattern_key`: the first key of each pattern that matches the end of the
    module name after a dot; `up_proj` matches every layer's `mlp.up_proj`, a regex key
    only its layers."""
    config = {
        "r": 2,
        "lora_alpha": 4,
        "rank_pattern": {r"model\.layers\.[12]\.self_attn\.q_proj": 3, "up_proj": 5},
        "alpha_pattern": {"layers.2.self_attn.q_proj": 9, "q_proj": 1.5},
    }
    ranks = {"q": [2, 3, 3], "v": [2, 2, 2], "up": [5, 5, 5]}
    parts = _write_adapter(tmp_path / "ad", ranks, config)
    model = rx.load_lora_adapter(base, tmp_path / "ad")
    lora = model.transformer.layers.lora
    q_alphas = [1.5, 1.5, 9]
    scales = {("q", i): q_alphas[i] / ranks["q"][i] for i in range(3)}
    scales |= {("v", i): 4 / 2 for i in range(3)} | {("up", i): 4 / 5 for i in range(3)}
    assert lora["q"].ranks == (2, 3, 3) and lora["q"].a.shape == (3, 16, 3)
    np.testing.assert_allclose(np.asarray(lora["q"].scale), [0.75, 0.5, 3.0], rtol=1e-7)
    assert lora["v"].scale == 2.0 and lora["up"].scale == 0.8  # one rank and scale each
    np.testing.assert_array_equal(np.asarray(lora["q"].a[0, :, 2:]), 0.0)  # rank 2 of 3
    np.testing.assert_array_equal(np.asarray(lora["q"].b[0, 2:]), 0.0)
    x = np.random.default_rng(2).standard_normal((4, 16)).astype(np.float32)
    for i in range(3):
        a, b = parts[("q", i)]
        want = x.astype(np.float64) @ a.T @ b.T * scales[("q", i)]
        np.testing.assert_allclose(
            np.asarray(_layer(lora["q"], i)(jnp.asarray(x))), want, rtol=1e-5, atol=1e-5
        )
    np.testing.assert_allclose(
        _logits(model), _logits(_hand_merged(base, parts, scales)), atol=2e-5
    )
    merged = rx.merge_lora(model)
    np.testing.assert_allclose(_logits(merged), _logits(model), atol=2e-5)


def test_patterned_adapters_save_and_load_again(base, tmp_path):
    config = {
        "r": 2,
        "lora_alpha": 7,
        "use_rslora": True,
        "rank_pattern": {"layers.1.self_attn.q_proj": 3, "v_proj": 1},
        "alpha_pattern": {"v_proj": 5},
    }
    _write_adapter(tmp_path / "ad", {"q": [2, 3, 2], "v": [1, 1, 1], "up": [2, 2, 2]}, config)
    model = rx.load_lora_adapter(base, tmp_path / "ad")
    rx.save_lora_adapter(model, tmp_path / "again")
    written = json.loads((tmp_path / "again" / "adapter_config.json").read_text())
    assert (written["r"], written["lora_alpha"], written["use_rslora"]) == (2, 7.0, True)
    assert written["rank_pattern"] == {"layers.1.self_attn.q_proj": 3, "v_proj": 1}
    assert written["alpha_pattern"] == {"layers.1.self_attn.q_proj": 7.0, "v_proj": 5.0}
    back = rx.load_lora_adapter(base, tmp_path / "again")
    for name, ad in model.transformer.layers.lora.items():
        other = back.transformer.layers.lora[name]
        assert type(other) is type(ad)
        for x, y in zip(jax.tree_util.tree_leaves(ad), jax.tree_util.tree_leaves(other)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    np.testing.assert_array_equal(_logits(back), _logits(model))


def test_per_projection_ranks_save_as_patterns(base, tmp_path):
    """Adapters of different ranks by projection (one `LoRAAdapter` each) were refused
    on saving; they are written as `rank_pattern` / `alpha_pattern` by projection."""
    config = {"r": 4, "lora_alpha": 8, "rank_pattern": {"up_proj": 2}}
    _write_adapter(tmp_path / "ad", {"q": [4, 4, 4], "up": [2, 2, 2]}, config)
    model = rx.load_lora_adapter(base, tmp_path / "ad")
    assert type(model.transformer.layers.lora["up"]) is rx.models.LoRAAdapter
    rx.save_lora_adapter(model, tmp_path / "again")
    written = json.loads((tmp_path / "again" / "adapter_config.json").read_text())
    assert (written["r"], written["lora_alpha"], written["use_rslora"]) == (4, 8.0, False)
    assert written["rank_pattern"] == {"up_proj": 2}
    assert written["alpha_pattern"] == {"up_proj": 8.0}
    np.testing.assert_array_equal(
        _logits(rx.load_lora_adapter(base, tmp_path / "again")), _logits(model)
    )


def test_layerwise_adapters_train_only_their_own_ranks(base, tmp_path):
    """The per-layer scale is frozen, and the zero padding beyond a layer's rank gets
    zero gradients."""
    config = {"r": 2, "lora_alpha": 2, "rank_pattern": {"layers.0.self_attn.q_proj": 1}}
    _write_adapter(tmp_path / "ad", {"q": [1, 2, 2]}, config)
    model = rx.load_lora_adapter(base, tmp_path / "ad")
    spec = rx.lora_filter(model)
    assert spec.transformer.layers.lora["q"].scale is False
    assert spec.transformer.layers.lora["q"].a is True
    trainable, frozen = eqx.partition(model, spec)

    def loss(t):
        m = eqx.combine(t, frozen)
        return jnp.sum(m(TOKENS, MASK) ** 2)

    grads = jax.grad(loss)(trainable).transformer.layers.lora["q"]
    assert float(jnp.abs(grads.a[0, :, 1:]).max()) == 0.0
    assert float(jnp.abs(grads.b[0, 1:]).max()) == 0.0
    assert float(jnp.abs(grads.a[1]).max()) > 0.0
    # each layer's own rank, as PEFT counts it: no zero padding
    assert rx.count_params(model, spec) == (16 * 1 + 1 * 16) + 2 * (16 * 2 + 2 * 16)
    padded = sum(x.size for x in jax.tree_util.tree_leaves(eqx.filter(model, spec)))
    assert padded == 3 * (16 * 2 + 2 * 16)


@pytest.mark.parametrize("value", ["missing", None])
def test_adapter_without_a_base_model_name_loads_on_the_base_given(base, tmp_path, value):
    parts = _write_adapter(tmp_path / "ad", {"v": [2, 2, 2]}, {"r": 2, "lora_alpha": 2})
    path = tmp_path / "ad" / "adapter_config.json"
    config = json.loads(path.read_text())
    if value == "missing":
        del config["base_model_name_or_path"]
    path.write_text(json.dumps(config))
    model = rx.load_lora_adapter(base, tmp_path / "ad")
    scales = {k: 1.0 for k in parts}
    np.testing.assert_allclose(
        _logits(model), _logits(_hand_merged(base, parts, scales)), atol=2e-5
    )
    # saved again, the config records no base as PEFT does: the key with null
    rx.save_lora_adapter(model, tmp_path / "again")
    written = json.loads((tmp_path / "again" / "adapter_config.json").read_text())
    assert "base_model_name_or_path" in written and written["base_model_name_or_path"] is None
    rx.save_lora_adapter(model, tmp_path / "named", base_model_name_or_path="org/base")
    named = json.loads((tmp_path / "named" / "adapter_config.json").read_text())
    assert named["base_model_name_or_path"] == "org/base"


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"rank_pattern": {"q_proj": 0}}, r"`rank_pattern\['q_proj'\]` must be a positive"),
        ({"rank_pattern": {"q_proj": 2.5}}, r"`rank_pattern\['q_proj'\]` must be an integer"),
        ({"alpha_pattern": {"(q_proj": 2}}, r"`alpha_pattern` key '\(q_proj' is not a regex"),
        ({"rank_pattern": ["q_proj"]}, "`rank_pattern` must be an object"),
        ({"use_rslora": "yes"}, "`use_rslora` must be true or false"),
        (
            {"rank_pattern": {"q_proj": 3}},
            r"has shape \(2, 16\), expected \(3, 16\) \(rank 3, from `r` / `rank_pattern`\)",
        ),
    ],
)
def test_bad_patterns_are_named(base, tmp_path, changes, message):
    _write_adapter(tmp_path / "ad", {"q": [2, 2, 2]}, {"r": 2, "lora_alpha": 2, **changes})
    with pytest.raises(ValueError, match=message):
        rx.load_lora_adapter(base, tmp_path / "ad")


def test_layerwise_adapter_to_llama_cpp_adapter_file(base, tmp_path):
    """llama.cpp scales each tensor pair by `alpha / r` at the pair's own rank: the file
    holds each layer's rank, and `alpha / r_l · B A` is the model's `scale_l · B A`."""
    gguf = pytest.importorskip("gguf")
    config = {"r": 2, "lora_alpha": 3, "rank_pattern": {"layers.1.mlp.up_proj": 4}}
    config["target_modules"] = r"model\.layers\.[12]\.mlp\.up_proj"  # none in layer 0
    parts = _write_adapter(tmp_path / "ad", {"up": [0, 4, 2]}, config)
    model = rx.load_lora_adapter(base, tmp_path / "ad")
    rx.models.save_gguf_adapter(model, tmp_path / "ad.gguf", alpha=5.0)
    reader = gguf.GGUFReader(tmp_path / "ad.gguf")
    tensors = {t.name: np.asarray(t.data, np.float64) for t in reader.tensors}
    assert "blk.0.ffn_up.weight.lora_a" not in tensors
    for i, r in [(1, 4), (2, 2)]:
        a, b = tensors[f"blk.{i}.ffn_up.weight.lora_a"], tensors[f"blk.{i}.ffn_up.weight.lora_b"]
        assert a.shape == (r, 16) and b.shape == (24, r)
        want_a, want_b = parts[("up", i)]
        np.testing.assert_allclose(5.0 / r * b @ a, 3 / r * want_b @ want_a, rtol=1e-5, atol=1e-6)


def test_adapter_of_another_base_and_a_file_in_the_way_are_named(base, tmp_path, getkey):
    _write_adapter(tmp_path / "ad", {"up": [2, 2, 2]}, {"r": 2, "lora_alpha": 2})
    narrow = rx.Policy(dataclasses.replace(CFG, d_ff=32), key=getkey())
    with pytest.raises(
        ValueError, match=r"has shape \(24, 2\), expected \(32, 2\).*up projection is 16 → 32"
    ):
        rx.load_lora_adapter(narrow, tmp_path / "ad")
    shallow = rx.Policy(dataclasses.replace(CFG, n_layers=2), key=getkey())
    with pytest.raises(ValueError, match="adapts layer 2, but the base model has 2 layers"):
        rx.load_lora_adapter(shallow, tmp_path / "ad")
    deep = rx.Policy(dataclasses.replace(CFG, n_layers=4), key=getkey())
    with pytest.raises(ValueError, match="covers 3 layers, the base model has 4"):
        rx.load_lora_adapter(deep, tmp_path / "ad")
    model = rx.load_lora_adapter(base, tmp_path / "ad")
    (tmp_path / "file").write_text("x")
    tensors = load_file(str(tmp_path / "ad" / "adapter_model.safetensors"))
    name = "base_model.model.model.layers.1.mlp.up_proj.lora_A.weight"
    save_file(
        {**tensors, name: tensors[name].astype(np.int32)},
        str(tmp_path / "ad" / "adapter_model.safetensors"),
    )
    with pytest.raises(ValueError, match="lora_A.weight' has non-float dtype int32"):
        rx.load_lora_adapter(base, tmp_path / "ad")
    with pytest.raises(ValueError, match="file exists and is not a directory"):
        rx.save_lora_adapter(model, tmp_path / "file")
    assert (tmp_path / "file").read_text() == "x"


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"init_lora_weights": "pissa_niter_4"}, "PEFT changed the base weights"),
        ({"init_lora_weights": "olora"}, "path_initial_model_for_weight_conversion"),
        ({"lora_bias": True}, "`lora_bias` = True is not supported"),
        ({"use_qalora": True}, "`use_qalora` = True is not supported"),
        ({"target_parameters": ["mlp.experts.down_proj"]}, "`target_parameters` = "),
        ({"kasa_config": {}}, "`kasa_config` = {} is not supported"),
        ({"arrow_config": {"top_k": 3}}, "`arrow_config` = "),
        ({"use_bdlora": {"nblocks": 2}}, "`use_bdlora` = "),
        ({"monteclora_config": {"n_experts": 4}}, "`monteclora_config` = "),
        ({"bias": "some"}, "`bias` = 'some' is not one of none, all, lora_only"),
    ],
)
def test_adapters_that_need_another_base_or_layer_are_refused(base, tmp_path, changes, message):
    """A PiSSA / OLoRA / CorDA / LoRA-GA / LoftQ adapter saved without PEFT's conversion
    holds the update of a base PEFT changed: on the original base it would load and
    compute something else without a word."""
    _write_adapter(tmp_path / "ad", {"q": [2, 2, 2]}, {"r": 2, "lora_alpha": 2, **changes})
    with pytest.raises(ValueError, match=message):
        rx.load_lora_adapter(base, tmp_path / "ad")
    for init in (True, False, "gaussian", "eva", "orthogonal"):  # the base as it was
        _write_adapter(tmp_path / str(init), {"q": [2, 2, 2]}, {"r": 2, "lora_alpha": 2,
                       "init_lora_weights": init})  # fmt: skip
        rx.load_lora_adapter(base, tmp_path / str(init))


@pytest.mark.parametrize(
    "config, ranks, written",
    [
        (  # a regex over whole module names: q in layers 0 and 2
            {"target_modules": r"model\.layers\.[02]\.self_attn\.q_proj"},
            {"q": [2, 0, 2]},
            {"target_modules": ["q_proj"], "layers_to_transform": [0, 2]},
        ),
        (  # PEFT's layers_to_transform over a list of names
            {"target_modules": ["q_proj", "up_proj"], "layers_to_transform": 1},
            {"q": [0, 2, 0], "up": [0, 2, 0]},
            {"target_modules": ["q_proj", "up_proj"], "layers_to_transform": [1]},
        ),
        (  # different layers by projection: one regex, which PEFT matches the same way
            {"target_modules": ["q_proj", "up_proj"], "exclude_modules": ["layers.0.mlp.up_proj"]},
            {"q": [2, 2, 2], "up": [0, 2, 2]},
            {
                "target_modules": r"model\.layers\.(0|1|2)\.self_attn\.q_proj|"
                r"model\.layers\.(1|2)\.mlp\.up_proj",
                "layers_to_transform": None,
            },
        ),
    ],
)
def test_adapters_of_some_layers(base, tmp_path, config, ranks, written):
    """PEFT adapts the modules `target_modules` (a regex, or names restricted by
    `layers_to_transform`) selects, less `exclude_modules`; the other layers get none.
    Saved again, the selection is written back, and PEFT's matching selects the same."""
    parts = _write_adapter(tmp_path / "ad", ranks, {"r": 2, "lora_alpha": 3, **config})
    model = rx.load_lora_adapter(base, tmp_path / "ad")
    for target, per_layer in ranks.items():
        ad = model.transformer.layers.lora[target]  # a LoRAAdapter where all layers agree
        assert getattr(ad, "ranks", (ad.a.shape[-1],) * 3) == tuple(per_layer)
    scales = {k: 1.5 for k in parts}
    np.testing.assert_allclose(
        _logits(model), _logits(_hand_merged(base, parts, scales)), atol=2e-5
    )
    rx.save_lora_adapter(model, tmp_path / "again")
    saved = json.loads((tmp_path / "again" / "adapter_config.json").read_text())
    assert {k: saved[k] for k in written} == written
    for target, per_layer in ranks.items():
        for i, r in enumerate(per_layer):
            name = f"model.layers.{i}.{MODULES[target]}"
            targeted = (
                re.fullmatch(saved["target_modules"], name) is not None
                if isinstance(saved["target_modules"], str)
                else name.endswith("." + MODULES[target].split(".")[1])
                and (saved["layers_to_transform"] is None or i in saved["layers_to_transform"])
            )
            assert targeted == (r > 0), name
    np.testing.assert_array_equal(
        _logits(rx.load_lora_adapter(base, tmp_path / "again")), _logits(model)
    )
    merged = rx.merge_lora(model)
    np.testing.assert_allclose(_logits(merged), _logits(model), atol=2e-5)


def test_tensors_of_a_module_peft_would_not_adapt_are_refused(base, tmp_path):
    config = {"r": 2, "lora_alpha": 2, "layers_to_transform": [0, 1]}
    _write_adapter(tmp_path / "ad", {"q": [2, 2, 2]}, config)
    with pytest.raises(ValueError, match="layers.2.self_attn.q_proj.lora_A.weight belongs to a"):
        rx.load_lora_adapter(base, tmp_path / "ad")
    all_linear = {"r": 2, "lora_alpha": 2, "target_modules": "all-linear"}
    _write_adapter(tmp_path / "all", {"q": [2, 2, 2]}, all_linear)
    assert rx.load_lora_adapter(base, tmp_path / "all").transformer.layers.lora["q"].scale == 1.0


def test_new_rslora_adapters_train_and_save_as_peft_reads_them(base, tmp_path, getkey):
    """`LoRAConfig(use_rslora=True)`: scale `alpha / √r`; saved with `use_rslora` and the
    alpha given, and read back with the same scale."""
    config = rx.LoRAConfig(rank=4, alpha=6, targets=("q", "up"), use_rslora=True)
    assert config.scale == 3.0
    model = rx.apply_lora(base, config, key=getkey())
    ad = model.transformer.layers.lora["q"]
    np.testing.assert_array_equal(np.asarray(ad.scale), [3.0] * 3)
    np.testing.assert_array_equal(_logits(model), _logits(base))  # b starts at zero
    spec = rx.lora_filter(model)
    assert rx.count_params(model, spec) == 3 * (16 * 4 + 4 * 16) + 3 * (16 * 4 + 4 * 24)
    model = eqx.tree_at(
        lambda m: m.transformer.layers.lora["q"].b, model, jnp.full((3, 4, 16), 0.1)
    )
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 16)), jnp.float32)
    a = np.asarray(ad.a[1], np.float64)
    want = np.asarray(x, np.float64) @ a @ np.full((4, 16), 0.1) * 6 / math.sqrt(4)
    got = _layer(model.transformer.layers.lora["q"], 1)(x)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    rx.save_lora_adapter(model, tmp_path / "ad")
    saved = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert (saved["r"], saved["lora_alpha"], saved["use_rslora"]) == (4, 6.0, True)
    assert saved["rank_pattern"] == {} and saved["alpha_pattern"] == {}
    back = rx.load_lora_adapter(base, tmp_path / "ad")
    np.testing.assert_array_equal(_logits(back), _logits(model))
