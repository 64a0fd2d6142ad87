"""Configuration values that would change the numbers silently or fail far from their
source: a rotary base or scaling factor that is not positive, a llama3 band the wrong way
round, a Gemma attention scalar of zero, a flag written as a string. Each is one line
naming the file and the field, in `config.json` and in GGUF metadata alike."""

import json
import math

import jax
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
