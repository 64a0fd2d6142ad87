"""The stages of the newer objectives from the CLI: `kto` (an unpaired file, preference
pairs), `distill` (a teacher checkpoint, vocabularies checked) and GRPO's policy losses
(`grpo.policy_loss`), and their settings checked."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlhf_eqx as rx
from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main
from rlhf_eqx.assets import asset_path

_SMALL = [
    "--quiet",
    "--set",
    "kto.steps=3",
    "--set",
    "kto.batch_size=4",
    "--set",
    "kto.max_length=40",
    "--set",
    "sampling.prompt_length=16",
    "--set",
    "data.heldout_fraction=0.25",
    "--set",
    "ops.monitor=false",
]


def _unpaired(path, n=16):
    with open(path, "w") as f:
        for i in range(n):
            good = i % 2 == 0
            rec = {
                "prompt": f"Once upon a time {i}",
                "completion": " a dog ran home." if good else " zzz zzz.",
                "label": good,
            }
            f.write(json.dumps(rec) + "\n")


@pytest.mark.slow
def test_kto_runs_on_an_unpaired_file(tmp_path, capsys):
    data = tmp_path / "unpaired.jsonl"
    _unpaired(data)
    with open(data, "a") as f:  # prompts longer than sampling.prompt_length=16
        for i in range(4):
            long = {"prompt": f"{i} Once upon a time " * 12, "completion": " a cat.", "label": True}
            f.write(json.dumps(long) + "\n")
    out = tmp_path / "run"
    argv = ["kto", "--data", str(data), "--out", str(out), *_SMALL]
    assert main([*argv, "--set", "data.filter=long_prompt,empty"]) == 0
    events = [r for r in pl.tools.read_records(str(out)) if r.get("event") == "data_filter"]
    assert len(events) == 1 and events[0]["dropped_long_prompt"] >= 1
    assert events[0]["dropped_empty"] == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"] == "done"
    kto = summary["kto"]
    assert 0.0 <= kto["heldout_ordering_accuracy"] <= 1.0
    assert {"heldout_reward_desirable", "heldout_reward_undesirable"} <= set(kto)
    assert (out / "kto" / "hf" / "tokenizer.bin").exists()
    steps = [r for r in pl.tools.read_metrics(str(out))["kto"]]
    assert [r["step"] for r in steps] == [0, 1, 2]
    assert all("kl" in r and "rewards/chosen" in r for r in steps)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("rlhf_eqx kto: done:") and "summary.json" in last
    # the export samples alone: its tokenizer is beside it
    hf = str(out / "kto" / "hf")
    assert main(["sample", "--model", hf, "--prompt", "Once upon", "-n", "1", "--quiet"]) == 0
    assert capsys.readouterr().out.startswith("Once upon")


@pytest.mark.slow
def test_kto_splits_preference_pairs(tmp_path):
    data = tmp_path / "pairs.jsonl"
    with open(data, "w") as f:
        for i in range(12):
            rec = {"prompt": f"The cat {i}", "chosen": " sat on a mat.", "rejected": " zz."}
            f.write(json.dumps(rec) + "\n")
    out = tmp_path / "run"
    assert main(["kto", "--data", str(data), "--out", str(out), *_SMALL]) == 0
    kto = json.loads((out / "summary.json").read_text())["kto"]
    assert 0.0 <= kto["heldout_pair_accuracy"] <= 1.0


def test_kto_settings_are_checked():
    with pytest.raises(pl.ConfigError, match="kto.loss_type='x': must be one of kto"):
        pl.config.validate_stage("kto", pl.KTOConfig(loss_type="x"))
    with pytest.raises(pl.ConfigError, match="kto.desirable_weight=-1"):
        pl.config.validate_stage("kto", pl.KTOConfig(desirable_weight=-1.0))


@pytest.mark.slow
def test_distill_from_a_checkpoint_directory_on_a_data_file(tmp_path):
    data = tmp_path / "pairs.jsonl"
    with open(data, "w") as f:
        for i in range(12):
            rec = {"prompt": f"The cat {i}", "chosen": " sat on a mat.", "rejected": " zz."}
            f.write(json.dumps(rec) + "\n")
    # a teacher checkpoint directory: the shipped model, its final norm scaled (sharper
    # token distributions), exported with its tokenizer
    policy, _ = pl.tools.load_model("builtin")
    policy = eqx.tree_at(lambda p: p.transformer.final_norm, policy, replace_fn=lambda w: 1.5 * w)
    teacher = tmp_path / "teacher"
    rx.save_hf(policy, teacher)
    pl.runs.copy_tokenizer(asset_path("tok512.bin"), str(teacher))
    out = tmp_path / "run"
    small = [a.replace("kto.", "distill.") for a in _SMALL]
    argv = ["distill", "--data", str(data), "--out", str(out), *small]
    assert main([*argv, "--set", f"distill.teacher={teacher}"]) == 0
    d = json.loads((out / "summary.json").read_text())["distill"]
    assert d["heldout_jsd"] >= 0 and d["heldout_jsd_before"] > 0
    steps = pl.tools.read_metrics(str(out))["distill"]
    assert {r["on_policy"] for r in steps} <= {0.0, 1.0} and len(steps) == 3


def test_distill_refuses_a_teacher_of_another_vocabulary():
    cfg = rx.TransformerConfig(
        vocab_size=16, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=16, max_seq_len=8
    )
    a = rx.Policy(cfg, key=jax.random.key(0))
    b = rx.Policy(
        rx.TransformerConfig(
            vocab_size=32, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=16, max_seq_len=8
        ),
        key=jax.random.key(1),
    )
    with pytest.raises(ValueError, match="teacher's vocab_size=32 differs from the student's"):
        pl.runs.check_same_vocabulary(a, b)


@pytest.mark.parametrize("loss", [pytest.param("cispo", marks=pytest.mark.slow), "clip_cov"])
def test_grpo_policy_loss_is_selected_from_the_cli(tmp_path, loss):
    data = tmp_path / "prompts.jsonl"
    with open(data, "w") as f:
        for i in range(8):
            f.write(json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}) + "\n")
    out = tmp_path / "run"
    argv = ["grpo", "--data", str(data), "--out", str(out), "--quiet"]
    for s in (
        "grpo.rollouts=1",
        "grpo.prompts_per_rollout=2",
        "grpo.group_size=2",
        f"grpo.policy_loss={loss}",
        "sampling.prompt_length=16",
        "sampling.max_new_tokens=4",
        "data.heldout_fraction=0.25",
        "ops.monitor=false",
    ):
        argv += ["--set", s]
    assert main(argv) == 0
    assert json.loads((out / "config.json").read_text())["grpo"]["policy_loss"] == loss
    steps = pl.tools.read_metrics(str(out))["grpo"]
    assert steps and all(np.isfinite(r["loss"]) for r in steps)
    # the batch policy losses log the fraction of tokens they select; the default does not
    assert all(("selected_frac" in r) == (loss == "clip_cov") for r in steps)


def test_grpo_policy_loss_is_checked():
    # the GRPO record refuses it when the config is built, naming the choices
    with pytest.raises(pl.ConfigError, match="^policy_loss='ppo': must be one of grpo, cispo"):
        pl.GRPOConfig(policy_loss="ppo")
    with pytest.raises(pl.ConfigError, match="^grpo.policy_loss='ppo': must be one of grpo"):
        pl.apply_overrides(pl.PipelineConfig(), ["grpo.policy_loss=ppo"])


def test_the_distillation_example_grows_a_teacher_with_the_same_function():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "examples", "distill_larger_teacher.py")
    spec = importlib.util.spec_from_file_location("distill_larger_teacher", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    cfg = rx.TransformerConfig(
        vocab_size=32, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=24, max_seq_len=16
    )
    small = rx.Policy(cfg, key=jax.random.key(0))
    grown = example.grow(small, 4)
    assert grown.cfg.n_layers == 4 and grown.transformer.layers.wo.shape[0] == 4
    tokens = jax.random.randint(jax.random.key(1), (9,), 0, 32)
    mask = jnp.ones(9, bool)
    np.testing.assert_allclose(grown(tokens, mask), small(tokens, mask), atol=1e-6)
    with pytest.raises(ValueError, match="--layers=2"):
        example.grow(small, 2)
