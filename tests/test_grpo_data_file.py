"""GRPO on a prompt file (`rlhf_eqx grpo --data FILE`) with the user's reward functions
(`grpo.reward_functions`, `grpo.reward_weights`: PPO's semantics, checks and one-line
errors): prompts without answers are trained on when the reward needs none, the
held-out reward before and after is reported when there is no exact match to report,
the exact match still when every prompt has an answer; repeated prompts are counted;
a data-file sweep scores with the same functions."""

import json
import re
import textwrap

import numpy as np
import pytest

from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main

_REWARDS = """
import json


def length(completions, **kwargs):
    return [len(c) / 10 for c in completions]


def topic(prompts, completions, topic, **kwargs):
    with open("seen.jsonl", "a") as f:
        f.write(json.dumps({"prompts": prompts, "topic": topic}) + "\\n")
    return [float(t == "cats") for t in topic]


X = 3
"""

_SMALL = [
    *("--set", "grpo.rollouts=1", "--set", "grpo.prompts_per_rollout=2"),
    *("--set", "grpo.group_size=2", "--set", "sampling.max_new_tokens=8"),
    *("--set", "eval_samples=1", "--set", "data.heldout_fraction=0.25"),
    *("--quiet", "--set", "ops.monitor=false"),
]


@pytest.fixture
def rewards(tmp_path, monkeypatch):
    """A module of reward functions in the working directory, its name."""
    name = f"grpo_rewards_{abs(hash(str(tmp_path))) % 10**8}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(_REWARDS))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def _prompts(path, *, answers: bool, n: int = 16) -> str:
    rows = [
        {"prompt": f"Once upon a time {i}", "topic": "cats" if i % 2 else "dogs"} for i in range(n)
    ]
    if answers:
        rows = [{**r, "answer": i} for i, r in enumerate(rows)]
    rows.append(dict(rows[0]))  # a repeated prompt
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("stage", ["ppo", "grpo"])
def test_reward_function_settings_are_refused_alike_for_ppo_and_grpo(stage, rewards):
    cases = {
        "reward_functions=bogus": "reward_functions=bogus: expected MODULE:NAME",
        f"reward_functions={rewards}:nope": f"reward_functions={rewards}:nope: {rewards} has no",
        f"reward_functions={rewards}:X": f"reward_functions={rewards}:X: expected a function",
        "reward_weights=1": "reward_weights=(1.0,): only with",
    }
    for override, message in cases.items():
        cfg = pl.apply_overrides(pl.animal_task_config(), [f"{stage}.{override}"])
        with pytest.raises(pl.ConfigError, match="^" + re.escape(f"{stage}.{message}")):
            pl.config.validate_config(cfg)
    other = [f"{stage}.reward_source=judge", f"{stage}.reward_functions={rewards}:length"]
    cfg = pl.apply_overrides(pl.animal_task_config(), other)
    with pytest.raises(pl.ConfigError, match=f"score only with {stage}.reward_source=task"):
        pl.config.validate_config(cfg)
    task = [f"{stage}.reward_source=task", f"{stage}.reward_functions={rewards}:length"]
    for weights, message in (("1,2", "expected one weight per function"), ("nan", "finite")):
        cfg = pl.apply_overrides(
            pl.animal_task_config(), [*task, f"{stage}.reward_weights={weights}"]
        )
        with pytest.raises(pl.ConfigError, match=message):
            pl.config.validate_config(cfg)
    pl.config.validate_config(pl.apply_overrides(pl.animal_task_config(), task))


def test_the_shared_rollout_config_declares_the_reward_functions_once():
    for stage in ("ppo", "grpo"):
        c = getattr(pl.PipelineConfig(), stage)
        assert (c.reward_functions, c.reward_weights) == ((), ())
    fields = pl.config.RolloutStageConfig.__dataclass_fields__
    assert {"reward_functions", "reward_weights"} <= set(fields)


def test_multiturn_refuses_reward_functions_it_would_not_use(rewards):
    cfg = pl.apply_overrides(
        pl.animal_task_config(),
        ["stages=sft,multiturn", f"multiturn.reward_functions={rewards}:length"],
    )
    with pytest.raises(pl.ConfigError, match="multiturn.reward_functions=.*does not use"):
        pl.config.validate_config(cfg)


def test_grpo_on_a_file_without_answers_is_refused_naming_the_rewards_that_need_none(
    tmp_path, capsys
):
    path = _prompts(tmp_path / "p.jsonl", answers=False)
    argv = ["grpo", "--data", path, "--out", str(tmp_path / "run"), *_SMALL]
    assert main([*argv, "--set", "grpo.reward_source=task"]) == 1
    err = capsys.readouterr().err
    assert "none of its 17 prompts has a reference answer" in err
    assert "grpo.reward_functions=MODULE:NAME" in err and "grpo.reward_model=DIR" in err


@pytest.mark.slow
def test_grpo_on_prompts_without_answers_scores_with_the_users_functions(tmp_path, rewards):
    path = _prompts(tmp_path / "p.jsonl", answers=False)
    argv = ["grpo", "--data", path, "--out", str(tmp_path / "run"), *_SMALL]
    argv += ["--set", "grpo.reward_source=task"]
    argv += ["--set", f"grpo.reward_functions={rewards}:length,{rewards}:topic"]
    argv += ["--set", "grpo.reward_weights=1,2"]
    assert main(argv) == 0
    (it,) = [r for r in pl.tools.read_records(str(tmp_path / "run")) if "rollout/score" in r]
    assert {"rollout/reward/length", "rollout/reward/topic"} <= set(it)
    seen = [json.loads(line) for line in (tmp_path / "seen.jsonl").read_text().splitlines()]
    for call in seen:  # each completion's own record's column
        for prompt, topic in zip(call["prompts"], call["topic"]):
            assert topic == ("cats" if int(prompt.split()[-1]) % 2 else "dogs")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    grpo = summary["grpo"]
    assert "heldout_exact_match" not in grpo
    for k in ("heldout_reward_before", "heldout_reward", "heldout_reward_se"):
        assert np.isfinite(grpo[k]), k
    assert grpo["sampled"]["prompts"] > 0
    quality = summary["data_quality"]
    assert quality["duplicate_prompts"] == 1 and "without_answer" not in quality


@pytest.mark.slow  # a whole run of a stage (8-15 s): in the slow suite
def test_grpo_with_functions_on_answered_prompts_still_reports_the_exact_match(tmp_path, rewards):
    path = _prompts(tmp_path / "p.jsonl", answers=True)
    argv = ["grpo", "--data", path, "--out", str(tmp_path / "run"), *_SMALL]
    argv += ["--set", "grpo.reward_source=task", "--set", f"grpo.reward_functions={rewards}:length"]
    assert main(argv) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["grpo"]["heldout_exact_match"] == 0.0  # the stories model writes no digits
    assert "heldout_reward" not in summary["grpo"]
    assert summary["data_quality"]["duplicate_prompts"] == 1
    assert "without_answer" not in summary["data_quality"]  # none dropped: functions score


@pytest.mark.slow
def test_grpo_data_sweep_scores_with_the_users_functions(tmp_path, rewards):
    path = _prompts(tmp_path / "p.jsonl", answers=False)
    sets = [
        f"data.path={path}",
        "grpo.rollouts=1",
        "grpo.prompts_per_rollout=2",
        "grpo.group_size=2",
        "sampling.max_new_tokens=8",
        "sampling.prompt_length=16",
        "eval_samples=1",
        "data.heldout_fraction=0.25",
        "ops.quiet=true",
        "ops.monitor=false",
        "grpo.reward_source=task",
        f"grpo.reward_functions={rewards}:length,{rewards}:topic",
    ]
    cfg = pl.apply_overrides(pl.animal_task_config(), sets)
    swept = pl.sweep("grpo", cfg, seeds=1, grid={"grpo.beta": [0.02, 0.2]}, out=str(tmp_path / "s"))
    assert len(swept.members) == 2
    for mem in swept.members:
        assert np.isfinite(swept.summaries[mem.name]["heldout_reward"])
    assert (tmp_path / "seen.jsonl").exists()  # the functions scored the rollouts
