"""Adapters made by PEFT itself (`get_peft_model` + `save_pretrained`, see
`tests/fixtures/make_peft_fixtures.py`) loaded with `load_lora_adapter`: the outputs PEFT
computed for them (`tests/fixtures/peft/reference.npz`), or a refusal naming what a LoRA
of the plain base cannot express."""

import json
import os
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import rlhf_eqx as rx

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
PEFT = os.path.join(FIXTURES, "peft")
REFERENCE = np.load(os.path.join(PEFT, "reference.npz"))
TOKENS = np.asarray(REFERENCE["tokens"], np.int32)  # numpy: nothing runs at collection
MASK = np.ones(TOKENS.shape, bool)


def _base(family):
    return rx.load_hf(os.path.join(FIXTURES, "hf", family), dtype="float32")


def _logits(model):
    return np.asarray(eqx.filter_jit(lambda m: m(jnp.asarray(TOKENS), jnp.asarray(MASK)))(model))


@pytest.mark.parametrize(
    "case, family",
    [
        ("patterns", "llama3"),
        ("rslora_regex", "llama3"),
        ("layers_pattern", "llama3"),
        ("exclude", "qwen2"),
    ],
)
def test_peft_adapters_compute_what_peft_computes(case, family, tmp_path):
    base = _base(family)
    model = rx.load_lora_adapter(base, os.path.join(PEFT, case))
    want = REFERENCE[case]
    assert np.abs(want - _logits(base)).max() > 1.0  # the adapter shows
    np.testing.assert_allclose(_logits(model), want, atol=2e-5, rtol=0)
    np.testing.assert_allclose(_logits(rx.merge_lora(model)), want, atol=2e-5, rtol=0)
    rx.save_lora_adapter(model, tmp_path / "again")
    again = rx.load_lora_adapter(base, tmp_path / "again")
    np.testing.assert_allclose(_logits(again), want, atol=2e-5, rtol=0)


def test_bias_setting_without_saved_biases_is_a_plain_lora():
    """`bias="lora_only"` on modules without biases: PEFT saves no bias, the adapter is a
    plain LoRA; where the base has biases PEFT saves them trained, which is refused."""
    base = _base("llama3")
    model = rx.load_lora_adapter(base, os.path.join(PEFT, "bias_no_biases"))
    np.testing.assert_allclose(_logits(model), REFERENCE["bias_no_biases"], atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match=r"self_attn\.q_proj\.base_layer\.bias' is a bias of the"):
        rx.load_lora_adapter(_base("qwen2"), os.path.join(PEFT, "bias_trained"))


@pytest.mark.parametrize(
    "case, message",
    [
        ("lm_head_saved", r"`modules_to_save` = \['lm_head'\] is not supported"),
    ],
)
def test_peft_options_beyond_lora_are_refused(case, message):
    with pytest.raises(ValueError, match=rf"{case}/adapter_config\.json: {message}"):
        rx.load_lora_adapter(_base("llama3"), os.path.join(PEFT, case))


def test_a_missing_adapter_file_is_named_with_what_is_there_instead(tmp_path):
    """An adapter saved as `adapter_model.bin` (a PyTorch pickle) or a model checkpoint
    given as an adapter: one line naming the missing file and what to do."""
    base = _base("llama3")
    (tmp_path / "ad").mkdir()
    shutil.copy(os.path.join(PEFT, "patterns", "adapter_config.json"), tmp_path / "ad")
    with pytest.raises(FileNotFoundError, match=r"ad/adapter_model\.safetensors: file not found$"):
        rx.load_lora_adapter(base, tmp_path / "ad")
    (tmp_path / "ad" / "adapter_model.bin").write_bytes(b"\x80\x02")
    with pytest.raises(
        FileNotFoundError, match=r"safetensors: file not found; .* adapter_model\.bin"
    ):
        rx.load_lora_adapter(base, tmp_path / "ad")
    with pytest.raises(FileNotFoundError, match="adapter_config.json: file not found; .* load_hf"):
        rx.load_lora_adapter(base, os.path.join(FIXTURES, "hf", "llama3"))


def _rewards(model):
    return np.asarray(eqx.filter_jit(lambda m: m(jnp.asarray(TOKENS), jnp.asarray(MASK)))(model))


def test_sequence_classifier_adapter_scores_as_peft_does():
    """A PEFT `SEQ_CLS` adapter holds the score head (`modules_to_save`): onto a
    `RewardModel` it sets the head; onto a policy it is refused."""
    base = _base("llama3")
    reward = rx.RewardModel.from_policy(base, key=jax.random.key(0))
    loaded = rx.load_lora_adapter(reward, os.path.join(PEFT, "seq_cls"))
    np.testing.assert_allclose(_rewards(loaded), REFERENCE["seq_cls"], atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match=r"'base_model\.model\.score\.weight' is the score head"):
        rx.load_lora_adapter(base, os.path.join(PEFT, "seq_cls"))


@pytest.mark.parametrize(
    "score, message",
    [
        (np.zeros((1, 7), np.float32), r"has shape \(1, 7\), expected \(1, 32\)"),
        (np.zeros((1, 32), np.int32), "has non-float dtype int32"),
    ],
)
def test_a_score_head_that_does_not_fit_is_named(score, message, tmp_path):
    shutil.copytree(os.path.join(PEFT, "seq_cls"), tmp_path / "ad")
    path = str(tmp_path / "ad" / "adapter_model.safetensors")
    save_file({**load_file(path), "base_model.model.score.weight": score}, path)
    reward = rx.RewardModel.from_policy(_base("llama3"), key=jax.random.key(0))
    with pytest.raises(
        ValueError, match=rf"safetensors: tensor 'base_model\.model\.score\.weight' {message}"
    ):
        rx.load_lora_adapter(reward, tmp_path / "ad")


def test_reward_model_adapters_are_saved_with_their_head(tmp_path):
    """`save_lora_adapter` of a `RewardModel` writes PEFT's sequence-classifier layout,
    and reads back onto a reward model with another head as the same rewards."""
    base = _base("llama3")
    reward = rx.RewardModel.from_policy(base, key=jax.random.key(0))
    adapted = rx.load_lora_adapter(reward, os.path.join(PEFT, "seq_cls"))
    rx.save_lora_adapter(adapted, tmp_path / "ad")
    config = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert (config["task_type"], config["modules_to_save"]) == ("SEQ_CLS", ["classifier", "score"])
    score = load_file(str(tmp_path / "ad" / "adapter_model.safetensors"))[
        "base_model.model.score.weight"
    ]
    np.testing.assert_array_equal(score, np.asarray(adapted.head)[None])
    # the layout PEFT wrote for the same adapter: tensor names, shapes, config fields
    peft_dir = os.path.join(PEFT, "seq_cls")
    theirs = load_file(os.path.join(peft_dir, "adapter_model.safetensors"))
    ours = load_file(str(tmp_path / "ad" / "adapter_model.safetensors"))
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    with open(os.path.join(peft_dir, "adapter_config.json")) as f:
        peft_config = json.load(f)
    for field in ("peft_type", "task_type", "r", "lora_alpha", "modules_to_save", "bias"):
        assert config[field] == peft_config[field], field
    assert sorted(config["target_modules"]) == sorted(peft_config["target_modules"])
    other = rx.RewardModel.from_policy(base, key=jax.random.key(1))
    again = rx.load_lora_adapter(other, tmp_path / "ad")
    np.testing.assert_allclose(_rewards(again), REFERENCE["seq_cls"], atol=2e-5, rtol=0)
    biased = eqx.tree_at(lambda m: m.bias, adapted, jnp.ones(()))
    with pytest.raises(ValueError, match="RewardModel's `bias` is 1.0, but PEFT's score head"):
        rx.save_lora_adapter(biased, tmp_path / "biased")


def test_tensors_outside_the_adapted_projections_are_named(tmp_path):
    """PEFT adapters of the embedding, or of a module this model does not have: one line
    naming the file, the tensor and why."""
    shutil.copytree(os.path.join(PEFT, "patterns"), tmp_path / "ad")
    path = tmp_path / "ad" / "adapter_model.safetensors"
    tensors = load_file(str(path))
    for name, why in [
        ("base_model.model.model.embed_tokens.lora_embedding_A", "outside the decoder layers"),
        ("base_model.model.model.layers.0.self_attn.rotary.lora_A.weight", "q_proj, k_proj"),
    ]:
        save_file({**tensors, name: np.zeros((2, 32), np.float32)}, str(path))
        with pytest.raises(
            ValueError, match=rf"adapter_model\.safetensors: unexpected tensor '{name}' .*{why}"
        ):
            rx.load_lora_adapter(_base("llama3"), tmp_path / "ad")
