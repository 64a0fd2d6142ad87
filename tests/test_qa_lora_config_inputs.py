"""`LoRAConfig` given what a user's own code or a sweep hands it (numpy scalars,
sets), and a PEFT adapter directory that holds no adapter of this model's modules."""

import json

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

import rlhf_eqx as rx

CFG = rx.TransformerConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=24)


def test_numpy_scalars_are_numbers():
    config = rx.LoRAConfig(rank=np.int64(4), alpha=np.float32(8.0), dropout=np.float64(0.1))
    assert config.rank == 4 and type(config.rank) is int
    assert config.scale == 2.0 and type(config.alpha) is float
    model = rx.apply_lora(rx.Policy(CFG, key=jax.random.key(0)), config, key=jax.random.key(1))
    assert model.transformer.layers.lora["q"].a.shape == (2, 16, 4)


@pytest.mark.parametrize("dropout", [float("nan"), True, 1, np.float32(-0.5)])
def test_dropout_that_is_not_a_probability_is_a_value_error(dropout):
    with pytest.raises(ValueError, match="dropout"):
        rx.LoRAConfig(dropout=dropout)


def test_a_set_of_targets_is_in_the_projections_order():
    """A set's order follows the string hash, which changes from one interpreter to the
    next; the adapters' initial values must not."""
    assert rx.LoRAConfig(targets={"v", "down", "q"}).targets == ("q", "v", "down")
    assert rx.LoRAConfig(targets=["v", "q"]).targets == ("v", "q")  # a sequence keeps its order


@pytest.mark.parametrize(
    "targets, hint",
    [(["q_proj", "v_proj"], "here 'q', 'v'"), ("all-linear", "all-linear is targets=")],
)
def test_peft_module_names_are_refused_with_their_names_here(targets, hint):
    with pytest.raises(ValueError, match=hint):
        rx.LoRAConfig(targets=targets)


def _adapter_dir(path, config, tensors):
    path.mkdir()
    base = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 2, "lora_alpha": 4}
    (path / "adapter_config.json").write_text(json.dumps(base | config))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


@pytest.mark.parametrize("targets", [["c_attn"], ["q_proj"], "q_proj"])
def test_an_adapter_without_lora_tensors_is_refused(targets, tmp_path):
    """PEFT refuses target_modules that name no module of the model; an adapter
    directory without a LoRA tensor would otherwise load as a model with no adapter."""
    directory = _adapter_dir(tmp_path / "a", {"target_modules": targets}, {})
    with pytest.raises(ValueError, match="no LoRA tensor.*target_modules"):
        rx.load_lora_adapter(rx.Policy(CFG, key=jax.random.key(0)), directory)


def test_a_string_target_names_the_whole_module_name(tmp_path):
    """PEFT reads a string `target_modules` as a regex the whole module name matches, so
    `"q_proj"` adapts nothing; the refusal says so."""
    rng = np.random.default_rng(0)
    tensors = {
        f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_{p}.weight": rng.normal(
            size=shape
        ).astype(np.float32)
        for i in range(2)
        for p, shape in (("A", (2, 16)), ("B", (16, 2)))
    }
    directory = _adapter_dir(tmp_path / "a", {"target_modules": "q_proj"}, tensors)
    with pytest.raises(ValueError, match=r"regex.*whole module name"):
        rx.load_lora_adapter(rx.Policy(CFG, key=jax.random.key(0)), directory)
