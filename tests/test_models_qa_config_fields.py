"""Configuration values that would change the numbers silently or fail far from their
source: a rotary base or scaling factor that is not positive, a llama3 band the wrong way
round, a Gemma attention scalar of zero, a flag written as a string. Each is one line
naming the file and the field, in `config.json` and in GGUF metadata alike."""

import json
import math

import jax
import numpy as np
import pytest

import rlhf_eqx as rx
from rlhf_eqx.models import load_gguf_policy, write_gguf


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = rx.TransformerConfig(
        vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=32
    )
    d = tmp_path_factory.mktemp("hf")
    rx.save_hf(rx.Policy(cfg, key=jax.random.key(0)), d)
    return d, json.loads((d / "config.json").read_text())


def _with(checkpoint, tmp_path, **fields):
    d, config = checkpoint
    (tmp_path / "model.safetensors").symlink_to(d / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({**config, **fields}))
    return tmp_path


def _refused(path, *parts):
    with pytest.raises(ValueError) as e:
        rx.load_hf(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(path / "config.json")), msg
    for part in parts:
        assert part in msg, (part, msg)


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"rope_theta": -1.0}, "`rope_theta` must be a positive number, got -1.0"),
        ({"rope_theta": 0}, "`rope_theta` must be a positive number, got 0"),
        ({"rope_theta": "10000"}, "`rope_theta` must be a number, got '10000'"),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": -5.0}},
            "rope_parameters: `rope_theta` must be a positive number",
        ),
        (
            {"rope_scaling": {"rope_type": "linear", "factor": 0}},
            "rope_scaling: `factor` must be a positive number, got 0",
        ),
        (
            {"rope_scaling": {"rope_type": "linear", "factor": -2.0}},
            "rope_scaling: `factor` must be a positive number, got -2.0",
        ),
        (
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 4.0,
                    "high_freq_factor": 1.0,
                }
            },
            "`rope_scaling.high_freq_factor` = 1.0 is not supported: it must exceed "
            "`low_freq_factor` = 4.0",
        ),
        (
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "original_max_position_embeddings": 0,
                }
            },
            "`rope_scaling.original_max_position_embeddings` = 0",
        ),
        ({"tie_word_embeddings": "false"}, "`tie_word_embeddings` must be true or false"),
    ],
)
def test_llama_config_values_are_named(checkpoint, tmp_path, fields, named):
    _refused(_with(checkpoint, tmp_path, **fields), named)


def test_a_gemma_attention_scalar_of_zero_is_named(checkpoint, tmp_path):
    d = _with(
        checkpoint,
        tmp_path,
        architectures=["Gemma2ForCausalLM"],
        model_type="gemma2",
        head_dim=16,
        hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=0,
    )
    _refused(d, "`query_pre_attn_scalar` must be a positive number, got 0")


def test_a_qwen_window_flag_written_as_a_string_is_named(checkpoint, tmp_path):
    d = _with(
        checkpoint,
        tmp_path,
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        use_sliding_window="no",
    )
    _refused(d, "`use_sliding_window` must be true or false, got 'no'")


def test_a_rotary_base_of_zero_is_refused_by_the_config():
    with pytest.raises(ValueError, match="rope_theta must be a positive number, got 0.0"):
        rx.TransformerConfig(vocab_size=8, d_model=8, n_layers=1, n_heads=2, d_ff=8, rope_theta=0.0)
    with pytest.raises(ValueError, match="rope_theta must be a positive number, got inf"):
        rx.TransformerConfig(
            vocab_size=8, d_model=8, n_layers=1, n_heads=2, d_ff=8, rope_theta=math.inf
        )


@pytest.mark.parametrize("factor", [0.0, -2.0, math.nan])
def test_a_gguf_rope_scaling_factor_that_is_not_positive_names_the_key(tmp_path, factor):
    pytest.importorskip("gguf", reason="GGUF files need the gguf package")
    cfg = rx.TransformerConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, d_ff=32)
    path = tmp_path / "m.gguf"

    def scaling(writer):
        writer.add_string("llama.rope.scaling.type", "linear")
        writer.add_float32("llama.rope.scaling.factor", factor)

    write_gguf(rx.Policy(cfg, key=jax.random.key(0)), path, dtype="f32", metadata=scaling)
    with pytest.raises(ValueError) as e:
        load_gguf_policy(path)
    msg = str(e.value)
    assert msg == (
        f"{path}: `llama.rope.scaling.factor` = {factor!r} is not supported: a positive "
        "number is expected"
    )


def _with_rope_freqs(tmp_path, factors):
    """A Llama GGUF file (head_dim 16) holding `factors` as its `rope_freqs.weight`."""
    pytest.importorskip("gguf", reason="GGUF files need the gguf package")
    cfg = rx.TransformerConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, d_ff=32)
    policy = rx.Policy(cfg, key=jax.random.key(0))
    path = tmp_path / "m.gguf"
    add = lambda writer: writer.add_tensor("rope_freqs.weight", factors)
    write_gguf(policy, path, dtype="f32", metadata=add)
    return policy, path


def test_rope_freqs_of_ones_read_as_no_scaling(tmp_path):
    policy, path = _with_rope_freqs(tmp_path, np.ones(8, np.float32))
    back = load_gguf_policy(path)
    assert back.cfg == policy.cfg and back.cfg.rope_scaling is None


@pytest.mark.parametrize("shape", [(3,), (2, 8)])
def test_rope_freqs_of_another_shape_names_the_expected_one(tmp_path, shape):
    _, path = _with_rope_freqs(tmp_path, np.full(shape, 2.0, np.float32))
    with pytest.raises(ValueError) as e:
        load_gguf_policy(path)
    assert str(e.value) == (
        f"{path}: tensor 'rope_freqs.weight' has shape {shape}, expected (8,): one divisor "
        "per rotary frequency (head_dim 16 / 2)"
    )


def test_a_gemma_config_without_head_dim_names_transformers_default(tmp_path):
    """Gemma's config class defaults `head_dim` to 256 (not hidden_size / heads): a
    `config.json` that leaves it out reads as transformers reads it, and the shape
    refusal says where the 256 comes from."""
    cfg = rx.TransformerConfig(
        vocab_size=64, d_model=32, n_layers=1, n_heads=2, d_ff=32,
        norm_plus_one=True, embed_scale=True, mlp_activation="gelu_tanh", tie_embeddings=True,
    )  # fmt: skip
    rx.save_hf(rx.Policy(cfg, key=jax.random.key(0)), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["GemmaForCausalLM"]
    del config["head_dim"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as e:
        rx.load_hf(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "expected (512, 32)" in msg
    assert f"({tmp_path / 'config.json'} has no `head_dim`: transformers takes its config " in msg
    assert "default 256, not hidden_size / num_attention_heads = 16" in msg


@pytest.mark.parametrize("pattern", [0, -6])
def test_a_gemma3_window_pattern_that_is_not_positive_is_named(checkpoint, tmp_path, pattern):
    d = _with(
        checkpoint,
        tmp_path,
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        head_dim=16,
        hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=16,
        sliding_window=4,
        sliding_window_pattern=pattern,
    )
    _refused(d, f"`sliding_window_pattern` = {pattern} is not supported: a positive integer")


@pytest.mark.parametrize("arch, count", [("llama", 2**32 - 1), ("gemma2", 200_000)])
def test_a_gguf_block_count_past_the_tensors_is_named_at_once(tmp_path, arch, count):
    """A corrupt layer count is compared with the layers the file holds before anything
    is built per layer (it took seconds per hundred thousand layers, and memory)."""
    pytest.importorskip("gguf", reason="GGUF files need the gguf package")
    gemma = arch == "gemma2"
    cfg = rx.TransformerConfig(
        vocab_size=64, d_model=32, n_layers=1, n_heads=2, d_ff=32, head_dim=16,
        **(dict(norm_plus_one=True, embed_scale=True, post_norms=True, tie_embeddings=True,
                mlp_activation="gelu_tanh", query_scale=16**-0.5, attn_softcap=50.0,
                final_softcap=30.0, sliding_window=4096, window_layers=(True,))
           if gemma else {}),
    )  # fmt: skip
    path = tmp_path / "m.gguf"
    corrupt = lambda writer: writer.add_uint32(f"{arch}.block_count", count)
    write_gguf(rx.Policy(cfg, key=jax.random.key(0)), path, dtype="f32", metadata=corrupt)
    with pytest.raises(ValueError) as e:
        load_gguf_policy(path)
    assert str(e.value) == (
        f"{path}: `{arch}.block_count` = {count} but the file holds the tensors of 1 layer "
        "(tensor 'blk.1.attn_norm.weight' is missing)"
    )


def test_flags_absent_take_the_family_default_and_null_is_false(checkpoint):
    _, config = checkpoint
    base = {k: v for k, v in config.items() if k != "tie_word_embeddings"}
    gemma = {**base, "architectures": ["GemmaForCausalLM"], "hidden_act": "gelu_pytorch_tanh"}
    assert rx.models.config_from_hf(base).tie_embeddings is False
    assert rx.models.config_from_hf(gemma).tie_embeddings is True
    assert rx.models.config_from_hf({**gemma, "tie_word_embeddings": None}).tie_embeddings is False
    assert rx.models.config_from_hf({**base, "tie_word_embeddings": True}).tie_embeddings is True
