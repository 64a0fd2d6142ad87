"""PPO on a prompt file (`rlhf_eqx ppo --data FILE`): TRL's prompt-only layout, rewards
from an exported reward model (or the exact match of reference answers), the held-out
reward before and after (`sampled_comparison(..., reward=...)`), the refusals."""

import dataclasses
import json

import jax
import numpy as np
import pytest

import rlhf_eqx as rx
from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main

_QUIET = ["--quiet", "--set", "ops.monitor=false"]
_SMALL = [
    *("--set", "ppo.rollouts=2", "--set", "ppo.prompts_per_rollout=4"),
    *("--set", "ppo.minibatches=2", "--set", "sampling.max_new_tokens=8"),
    *("--set", "eval_samples=2", "--set", "data.heldout_fraction=0.25"),
]


@pytest.fixture(scope="module")
def builtin():
    return pl.tools.load_model("builtin")


def _prompts(path, *, answers: bool, n: int = 16):
    openings = ["Once upon a time", "Tom had a", "Lily saw a", "The little dog"]
    with open(path, "w") as f:
        for i in range(n):
            rec = {"prompt": f"{openings[i % 4]} {i}", "source": "mine"}
            if answers:
                rec["answer"] = i
            f.write(json.dumps(rec) + "\n")
        f.write(json.dumps({"prompt": "Once upon a time 0"}) + "\n")  # a repeated prompt
        f.write(json.dumps({"prompt": "Once upon a time " * 40}) + "\n")  # too long
    return str(path)


def test_sampled_comparison_scores_a_reward_source_as_the_same_function(builtin):
    policy, tok = builtin
    cfg = pl.PipelineConfig()
    cfg = dataclasses.replace(cfg, eval_samples=2)
    cfg = dataclasses.replace(
        cfg, sampling=dataclasses.replace(cfg.sampling, prompt_length=16, max_new_tokens=8)
    )
    prompts = ["Once upon a time", "The cat", "Tom had a ball"]

    def has_a(p, t):
        return float("a" in t)

    source = pl.runs.FunctionReward((pl.runs.RewardFunction("a", has_a),))
    key = jax.random.key(3)
    by_fn = pl.sampled_comparison(policy, policy, tok, prompts, key, cfg, score=has_a)
    by_source = pl.sampled_comparison(policy, policy, tok, prompts, key, cfg, reward=source)
    for side in ("before", "after"):
        assert by_source[f"reward_{side}"] == pytest.approx(by_fn[f"score_{side}"])
        assert by_source[f"reward_{side}_se"] == pytest.approx(by_fn[f"score_{side}_se"])


def test_ppo_on_a_file_is_refused_without_a_reward_it_can_compute(tmp_path, capsys):
    plain = _prompts(tmp_path / "p.jsonl", answers=False)
    # a reward model on a data file is a directory: refused before anything loads
    assert main(["ppo", "--data", plain, "--out", str(tmp_path / "a"), *_QUIET]) == 2
    assert "ppo.reward_model='': ppo.reward_source=reward_model" in capsys.readouterr().err
    argv = ["ppo", "--data", plain, "--out", str(tmp_path / "b"), *_QUIET]
    assert main([*argv, "--set", "ppo.reward_source=task"]) == 1
    err = capsys.readouterr().err
    assert "ppo.reward_source=task: the exact match of reference answers, but 17" in err
    assert not (tmp_path / "b").exists()  # nothing ran: the run directory is removed


@pytest.mark.slow
def test_ppo_trains_on_a_prompt_file_with_an_exported_reward_model(builtin, tmp_path):
    policy, _ = builtin
    rm_run = tmp_path / "rm"
    rm = rx.RewardModel.from_policy(policy, key=jax.random.key(0))
    pl.runs.export_reward_model(rm, str(rm_run))
    (rm_run / "summary.json").write_text("{}")  # a finished run: it stands for reward/hf
    data_file = _prompts(tmp_path / "p.jsonl", answers=False)
    out = tmp_path / "ppo"
    argv = ["ppo", "--data", data_file, "--out", str(out), *_QUIET, *_SMALL]
    assert main([*argv, "--set", f"ppo.reward_model={rm_run}"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data_quality"] == {
        "skipped_by_reader": {},
        "duplicate_prompts": 1,
        "longer_than_prompt_length": 1,
    }
    held = summary["ppo"]
    for name in ("heldout_reward_before", "heldout_reward"):
        assert np.isfinite(held[name]) and np.isfinite(held[f"{name}_se"])
    assert held["sampled"]["prompts"] > 0 and np.isfinite(held["sampled"]["kl_after"])
    assert (out / "ppo" / "hf" / "config.json").exists()
    assert (out / "ppo" / "adapter").is_dir()
    iterations = [r for r in pl.tools.read_records(str(out)) if "rollout/score" in r]
    assert len(iterations) == 2  # each rollout's mean reward

    # with reference answers, reward_source=task is their exact match (the repeated
    # prompt without one shares the text, and so the answer, of one that has it)
    answered = _prompts(tmp_path / "a.jsonl", answers=True)
    out2 = tmp_path / "ppo_task"
    argv = ["ppo", "--data", answered, "--out", str(out2), *_QUIET, *_SMALL]
    assert main([*argv, "--set", "ppo.reward_source=task"]) == 0
    # data.filter=duplicate_prompt: the repeated prompt is trained on once
    out3 = tmp_path / "ppo_once"
    argv[4] = str(out3)
    filtered = ["--set", "data.filter=duplicate_prompt", "--set", "ppo.rollouts=1"]
    assert main([*argv, "--set", "ppo.reward_source=task", *filtered]) == 0
    quality = json.loads((out3 / "summary.json").read_text())["data_quality"]
    assert quality["duplicate_prompts"] == 1
    dc = dataclasses.replace(pl.DataConfig(), heldout_fraction=0.25)
    train, _ = pl.runs.split_records(rx.data.load_prompts(answered), dc)
    repeated_in_training = [r.prompt for r in train].count("Once upon a time 0") == 2
    assert quality["dropped_duplicate_prompts"] == int(repeated_in_training)
    held = json.loads((out2 / "summary.json").read_text())["ppo"]
    assert 0.0 <= held["heldout_reward_before"] <= 1.0 and 0.0 <= held["heldout_reward"] <= 1.0
