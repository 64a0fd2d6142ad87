"""YaRN rotary scaling (Peng et al. 2023, arXiv:2309.00071) as transformers computes it
(`_compute_yarn_parameters`), read from `config.json` and GGUF metadata."""

import dataclasses
import json
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlhf_eqx as rx


def reference_yarn(theta, dim, rope_scaling, max_position_embeddings):
    """transformers' `_compute_yarn_parameters`, in float64 NumPy."""
    factor = rope_scaling["factor"]
    attention_factor = rope_scaling.get("attention_factor")
    mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
    original = rope_scaling.get("original_max_position_embeddings") or max_position_embeddings

    def get_mscale(scale, m=1):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = rope_scaling.get("beta_fast") or 32
    beta_slow = rope_scaling.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope_scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos = theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    inv = 1 / (factor * pos) * (1 - keep) + 1 / pos * keep
    return inv, attention_factor, (low, high)


def _cfg(rs, head_dim=64, theta=10000.0):
    return rx.TransformerConfig(
        vocab_size=32,
        d_model=2 * head_dim,
        n_layers=1,
        n_heads=2,
        d_ff=32,
        head_dim=head_dim,
        rope_theta=theta,
        max_seq_len=64,
        rope_scaling=rs,
    )


@pytest.mark.parametrize(
    "fields",
    [
        {"factor": 4.0, "original_max_position_embeddings": 32768},
        {"factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 16, "beta_slow": 2},
        {"factor": 4.0, "original_max_position_embeddings": 2048, "truncate": False},
        {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
         "mscale_all_dim": 0.5},
        {"factor": 2.0, "original_max_position_embeddings": 8192, "attention_factor": 0.9},
    ],
)  # fmt: skip
def test_inverse_frequencies_and_attention_factor_match_transformers(fields):
    config = {"rope_scaling": {"rope_type": "yarn", **fields}, "max_position_embeddings": 64}
    rs = rx.models.config_from_hf(_qwen2_config(config)).rope_scaling
    cfg = _cfg(rs, head_dim=64, theta=1e6)
    inv, attention, _ = reference_yarn(1e6, 64, config["rope_scaling"], 64)
    np.testing.assert_allclose(cfg.inv_freq(), inv, rtol=2e-6)
    assert cfg.rope_attention_factor() == pytest.approx(attention, rel=1e-12)


def test_factor_one_leaves_the_frequencies_and_the_attention_unscaled():
    plain = _cfg(None).inv_freq()
    cfg = _cfg(rx.RopeScaling("yarn", 1.0, original_max_position=2048))
    np.testing.assert_allclose(cfg.inv_freq(), plain, rtol=1e-7)
    assert cfg.rope_attention_factor() == 1.0


def test_ramp_endpoints_keep_high_and_interpolate_low_frequencies():
    rs = rx.RopeScaling("yarn", 8.0, original_max_position=4096)
    cfg = _cfg(rs, head_dim=128)
    low, high = rs.yarn_range(128, 10000.0)
    assert 0 < low < high < 63  # both ends of the ramp fall inside the spectrum here
    plain, scaled = _cfg(None, head_dim=128).inv_freq(), cfg.inv_freq()
    np.testing.assert_allclose(scaled[: low + 1], plain[: low + 1], rtol=1e-7)  # extrapolated
    np.testing.assert_allclose(scaled[high:], plain[high:] / 8.0, rtol=1e-6)  # interpolated
    middle = scaled[low + 1 : high] / plain[low + 1 : high]
    assert np.all((middle < 1) & (middle > 1 / 8.0))
    # d(r) is the index turning r times over the pretraining context
    dim_fast = 128 * math.log(4096 / (32 * 2 * math.pi)) / (2 * math.log(10000.0))
    assert low == math.floor(dim_fast)


def _qwen2_config(extra):
    base = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 64,
    }
    return {**base, **extra}


def test_missing_fields_take_transformers_defaults():
    scaling = {"type": "yarn", "factor": 4.0, "beta_fast": 0, "truncate": None}
    cfg = rx.models.config_from_hf(_qwen2_config({"rope_scaling": scaling}))
    rs = cfg.rope_scaling
    assert (rs.kind, rs.original_max_position, rs.beta_fast, rs.beta_slow) == ("yarn", 64, 32, 1)
    assert rs.truncate is False  # a null `truncate` is falsy in transformers
    assert rs.attention_scale == pytest.approx(0.1 * math.log(4.0) + 1.0)
    assert rx.models.config_from_hf(rx.models.config_to_hf(cfg)) == cfg
    # transformers 5's `rope_parameters` hold the same fields beside `rope_theta`
    params = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "beta_fast": 0}
    new = rx.models.config_from_hf(_qwen2_config({"rope_parameters": params}))
    assert new.rope_theta == 1e6
    assert new.rope_scaling == dataclasses.replace(rs, truncate=True)


def test_bad_yarn_fields_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="factor"):
        rx.models.config_from_hf(_qwen2_config({"rope_scaling": {"rope_type": "yarn"}}))
    with pytest.raises(ValueError, match="beta_slow"):
        scaling = {"rope_type": "yarn", "factor": 2.0, "beta_slow": "x"}
        rx.models.config_from_hf(_qwen2_config({"rope_scaling": scaling}))
    with pytest.raises(ValueError, match="apply"):
        rx.RopeScaling("yarn", 2.0).apply(np.ones(4, np.float32))


def test_load_hf_of_a_yarn_qwen2_checkpoint_gives_the_logits_of_the_model(tmp_path):
    rs = rx.RopeScaling("yarn", 4.0, original_max_position=16, beta_fast=8.0)
    base = rx.models.config_from_hf(_qwen2_config({}))
    cfg = base.__class__(**{**base.__dict__, "rope_scaling": rs})
    policy = rx.Policy(cfg, key=jax.random.key(0))
    rx.save_hf(policy, tmp_path / "ckpt")
    written = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert written["rope_scaling"]["rope_type"] == "yarn"
    loaded = rx.load_hf(tmp_path / "ckpt", dtype="float32")
    assert loaded.cfg.rope_scaling == rs
    tokens = jnp.arange(40, dtype=jnp.int32).reshape(1, 40) % 32
    mask = jnp.ones(tokens.shape, bool)
    np.testing.assert_allclose(loaded(tokens, mask), policy(tokens, mask), rtol=1e-5, atol=1e-5)
    plain = rx.Policy(
        cfg.__class__(**{**cfg.__dict__, "rope_scaling": None}), key=jax.random.key(0)
    )
    assert not np.allclose(
        plain(tokens, mask), policy(tokens, mask), atol=1e-4
    )  # the scaling shows


def test_attention_factor_scales_the_attention_logits():
    """cos and sin both scaled by `a` multiply q·k by `a²`: the same as a query scale `a²`
    times larger."""
    base = rx.models.config_from_hf(_qwen2_config({}))
    a = 1.3
    rs = rx.RopeScaling("yarn", 4.0, original_max_position=16, attention_factor=a)
    scaled = base.__class__(**{**base.__dict__, "rope_scaling": rs})
    unit = rx.RopeScaling("yarn", 4.0, original_max_position=16, attention_factor=1.0)
    by_scale = base.__class__(
        **{**base.__dict__, "rope_scaling": unit, "query_scale": a**2 * base.head_dim**-0.5}
    )
    tokens = jnp.arange(12, dtype=jnp.int32).reshape(1, 12)
    mask = jnp.ones(tokens.shape, bool)
    one = rx.Policy(scaled, key=jax.random.key(1))(tokens, mask)
    two = rx.Policy(by_scale, key=jax.random.key(1))(tokens, mask)
    np.testing.assert_allclose(one, two, rtol=1e-5, atol=1e-5)


def test_kv_cache_decode_equals_the_forward_pass_with_an_attention_factor():
    """Prefill, decode steps and a decode chunk scale their rotary tables as the full
    forward pass does."""
    base = rx.models.config_from_hf(_qwen2_config({}))
    rs = rx.RopeScaling("yarn", 4.0, original_max_position=16, attention_factor=1.4)
    cfg = base.__class__(**{**base.__dict__, "rope_scaling": rs})
    assert cfg.rope_attention_factor() == pytest.approx(1.4)
    unit = base.__class__(
        **{**base.__dict__, "rope_scaling": dataclasses.replace(rs, attention_factor=1.0)}
    )

    def sharp(c):  # larger query / key weights: attention far from uniform
        p = rx.Policy(c, key=jax.random.key(3))
        return eqx.tree_at(lambda p: p.transformer.layers.wqkv, p, p.transformer.layers.wqkv * 8)

    policy, plain = sharp(cfg), sharp(unit)
    seq = jnp.asarray([3, 1, 4, 1, 5, 9, 2, 6, 5, 3], jnp.int32)
    full = policy(seq, jnp.ones(seq.shape, bool))
    assert np.abs(np.asarray(plain(seq, jnp.ones(seq.shape, bool)) - full)).max() > 1e-3

    @eqx.filter_jit
    def cached(model):
        logits, cache = model.prefill(seq[:4], jnp.ones((4,), bool), cache_size=seq.shape[0])
        outs = [logits]
        for t in range(4, 7):
            logits, cache = model.decode_step(seq[t], cache, index=t, position=jnp.int32(t))
            outs.append(logits)
        chunk, _ = model.decode_chunk(seq[7:], cache, index=7, position=7)
        return jnp.concatenate([jnp.stack(outs), chunk])

    np.testing.assert_allclose(cached(policy), full[3:], rtol=1e-5, atol=1e-5)


def test_gguf_metadata_round_trip(tmp_path):
    base = rx.models.config_from_hf(_qwen2_config({}))
    rs = rx.RopeScaling("yarn", 4.0, original_max_position=16, beta_fast=8.0)
    cfg = base.__class__(**{**base.__dict__, "rope_scaling": rs})
    rx.models.write_gguf(rx.Policy(cfg, key=jax.random.key(2)), tmp_path / "m.gguf", dtype="f32")
    again = rx.models.load_gguf_policy(tmp_path / "m.gguf")
    assert again.cfg.rope_scaling == rs
    unexpressed = rx.RopeScaling("yarn", 4.0, original_max_position=16, attention_factor=1.2)
    policy = rx.Policy(
        base.__class__(**{**base.__dict__, "rope_scaling": unexpressed}), key=jax.random.key(2)
    )
    with pytest.raises(ValueError, match="rope_scaling"):
        rx.models.write_gguf(policy, tmp_path / "n.gguf", dtype="f32")


def _llama_gguf_with(tmp_path, add):
    """A Llama GGUF file whose metadata `add(writer)` completes with yarn keys, written
    with llama.cpp's own key names (`gguf.Keys.Rope`)."""
    gguf = pytest.importorskip("gguf", reason="GGUF files need the gguf package")
    cfg = rx.TransformerConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, d_ff=32)
    path = tmp_path / "m.gguf"
    keys = gguf.Keys.Rope

    def metadata(writer):
        writer.add_string(keys.SCALING_TYPE.format(arch="llama"), "yarn")
        writer.add_float32(keys.SCALING_FACTOR.format(arch="llama"), 4.0)
        writer.add_uint32(keys.SCALING_ORIG_CTX_LEN.format(arch="llama"), 512)
        add(writer, keys)

    rx.models.write_gguf(rx.Policy(cfg, key=jax.random.key(0)), path, dtype="f32",
                         metadata=metadata)  # fmt: skip
    return path


def test_llama_cpp_yarn_keys_read_as_transformers_fields(tmp_path):
    def betas(writer, keys):
        writer.add_float32(keys.SCALING_YARN_BETA_FAST.format(arch="llama"), 16.0)

    cfg = rx.models.load_gguf_policy(_llama_gguf_with(tmp_path, betas)).cfg
    assert cfg.rope_scaling == rx.RopeScaling(
        "yarn", 4.0, original_max_position=512, beta_fast=16.0, beta_slow=1.0
    )


def test_llama_cpp_yarn_attention_keys_are_refused_naming_the_key(tmp_path):
    def log_multiplier(writer, keys):
        writer.add_float32(keys.SCALING_YARN_LOG_MUL.format(arch="llama"), 0.1)

    path = _llama_gguf_with(tmp_path, log_multiplier)
    with pytest.raises(ValueError, match=r"`llama\.rope\.scaling\.yarn_log_multiplier` = 0\.1"):
        rx.models.load_gguf_policy(path)


@pytest.mark.parametrize("kind", ["linear", "llama3", "yarn"])
def test_numpy_scalar_fields_are_kept_as_python_numbers_and_export(kind, tmp_path):
    """Fields read with NumPy (`np.float32`, `np.int64`) are taken as the numbers they are
    and stored as Python ones: `save_hf` writes them to `config.json` and reads them back."""
    fields = {
        "linear": {},
        "llama3": {"low_freq_factor": np.float32(1.0), "high_freq_factor": np.float64(4.0)},
        "yarn": {"beta_fast": np.float32(8.0), "attention_factor": np.float32(1.25)},
    }[kind]
    if kind != "linear":
        fields["original_max_position"] = np.int64(16)
    rs = rx.RopeScaling(kind, np.float32(4.0), **fields)
    for field in dataclasses.fields(rs):
        value = getattr(rs, field.name)
        assert value is None or type(value) in (str, bool, int, float), field.name
    assert rs == rx.RopeScaling(kind, 4.0, **{k: v.item() for k, v in fields.items()})
    policy = rx.Policy(_cfg(rs, head_dim=16), key=jax.random.key(0))
    rx.save_hf(policy, tmp_path / "ckpt")
    loaded = rx.load_hf(tmp_path / "ckpt", dtype="float32")
    assert loaded.cfg.rope_scaling == rs


def test_a_field_that_is_not_finite_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"^RopeScaling\.factor must be a finite number, got inf"):
        rx.RopeScaling("yarn", math.inf, original_max_position=16)
    with pytest.raises(ValueError, match=r"^RopeScaling\.mscale must be a finite number"):
        rx.RopeScaling("yarn", 4.0, original_max_position=16, mscale=math.nan)


def test_fields_a_scaling_does_not_read_hold_their_defaults_and_export(tmp_path):
    """A `linear` scaling given `original_max_position` (some `config.json` files write
    it) equals the one without: `save_hf` writes what it reads and reads back the same."""
    rs = rx.RopeScaling("linear", 2.0, original_max_position=4096, beta_fast=8.0)
    assert rs == rx.RopeScaling("linear", 2.0)
    llama3 = rx.RopeScaling("llama3", 8.0, original_max_position=64, beta_slow=2.0)
    assert llama3 == rx.RopeScaling("llama3", 8.0, original_max_position=64)
    policy = rx.Policy(_cfg(rs, head_dim=16), key=jax.random.key(0))
    rx.save_hf(policy, tmp_path / "ckpt")
    assert rx.load_hf(tmp_path / "ckpt", dtype="float32").cfg.rope_scaling == rs
