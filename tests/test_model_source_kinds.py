"""A GGUF file is told apart by its first bytes (the magic `GGUF`), not only by a
`.gguf` name: under another name (`model.bin`, `my-model`, as such files are often
downloaded) it loads as a policy, a quantised policy, a distillation teacher, a judge or
a tokenizer file exactly as with its `.gguf` name, and its context is read from its
header; missing files are refused as before."""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlhf_eqx as rx
from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main
from rlhf_eqx.assets import asset_path
from rlhf_eqx.data import load_tokenizer

NAMES = ("model.bin", "my-model")


def _tiny_policy() -> rx.Policy:
    cfg = rx.TransformerConfig(
        vocab_size=512,
        d_model=32,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        d_ff=64,
        max_seq_len=128,
    )
    return rx.Policy(cfg, key=jax.random.key(0))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """`{name: path}`: one GGUF file (Q8_0) as `m.gguf` and copied under `NAMES`, and a
    Hugging Face directory of the same weights without a tokenizer (`hf`)."""
    root = tmp_path_factory.mktemp("models")
    tok = load_tokenizer(asset_path("tok512.bin"))
    policy = _tiny_policy()
    paths = {"m.gguf": os.fspath(root / "m.gguf")}
    rx.save_gguf(policy, paths["m.gguf"], tokenizer=tok, dtype="q8_0")
    for name in NAMES:
        paths[name] = os.fspath(root / name)
        shutil.copyfile(paths["m.gguf"], paths[name])
    paths["hf"] = os.fspath(root / "hf")
    rx.save_hf(policy, paths["hf"])
    return paths


def _logits(policy: rx.Policy) -> np.ndarray:
    ids = jnp.arange(1, 9, dtype=jnp.int32)
    return np.asarray(policy(ids, jnp.ones_like(ids, bool)))


@pytest.mark.parametrize("name", NAMES)
def test_a_renamed_gguf_loads_as_its_gguf_name(models, name):
    want, want_tok = pl.tools.load_model(models["m.gguf"])
    policy, tok = pl.tools.load_model(models[name])
    np.testing.assert_array_equal(_logits(policy), _logits(want))
    assert tok.encode("Once upon a time") == want_tok.encode("Once upon a time")
    assert pl.tools.tokenizer_file(models[name]) == models[name]
    packed, _ = pl.tools.load_model(models[name], quantized=True)
    reference, _ = pl.tools.load_model(models["m.gguf"], quantized=True)
    assert type(packed.transformer.embed) is type(reference.transformer.embed)
    assert type(packed.transformer.embed).__name__ == "GGUFWeight"


@pytest.mark.parametrize("name", NAMES)
def test_sample_command_reads_a_renamed_gguf(models, name, capsys):
    assert main(["sample", "--model", models[name], "-n", "1", "--quiet"]) == 0
    assert "llama2.c" not in capsys.readouterr().err


@pytest.mark.parametrize("name", NAMES)
def test_validation_reads_a_renamed_gguf(models, name):
    cfg = pl.apply_overrides(pl.animal_task_config(), [f"model.source={models[name]}"])
    pl.config.validate_config(cfg)  # no "a llama2.c checkpoint needs a tokenizer file"
    long = pl.apply_overrides(cfg, ["sampling.max_new_tokens=200"])
    with pytest.raises(pl.ConfigError, match=r"max_seq_len=128 tokens"):
        pl.config.validate_config(long)  # the context from the file's header
    quantized = pl.apply_overrides(cfg, ["model.quantized=true"])
    with pytest.raises(pl.ConfigError, match="LoRA"):  # the source is taken; SFT has no LoRA
        pl.config.validate_config(quantized)
    policy, _ = pl.tools.load_configured_model(quantized)
    assert type(policy.transformer.embed).__name__ == "GGUFWeight"


@pytest.mark.parametrize("name", NAMES)
def test_a_renamed_gguf_is_a_teacher_a_judge_and_a_tokenizer_file(models, name, tmp_path):
    path = models[name]
    pl.config.validate_judge(pl.JudgeConfig(model=path))
    pl.config.validate_stage("distill", pl.DistillConfig(teacher=path))
    student, _ = pl.tools.load_model(models["hf"], models["m.gguf"])
    teacher = pl.runs.load_teacher(path, student)
    np.testing.assert_array_equal(_logits(teacher), _logits(pl.tools.load_model(path)[0]))
    _, tok = pl.tools.load_model(models["hf"], path)  # --tokenizer: the GGUF file's
    assert type(tok).__name__ == "HFTokenizer"
    out = tmp_path / "export"
    out.mkdir()
    pl.runs.copy_tokenizer(path, os.fspath(out))
    assert sorted(os.listdir(out)) == ["tokenizer.json", "tokenizer_config.json"]


def test_missing_files_are_refused_as_before(tmp_path):
    for name in ("model.bin", "my-model", "m.gguf"):
        missing = os.fspath(tmp_path / name)
        with pytest.raises(pl.ConfigError, match=r"^model\.source=.*\(--model\)"):
            pl.tools.load_model(missing)
    missing = os.fspath(tmp_path / "model.bin")
    with pytest.raises(pl.ConfigError, match=r"^judge.model=.*a directory or a \.gguf file$"):
        pl.config.validate_judge(pl.JudgeConfig(model=missing))
    with pytest.raises(pl.ConfigError, match=r"^distill.teacher=.*checkpoint directory or a"):
        pl.config.validate_stage("distill", pl.DistillConfig(teacher=missing))
