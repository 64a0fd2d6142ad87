"""Reward sources of PPO and GRPO from the CLI: a reward-model ensemble (trained, exported,
loaded), a generative judge, a process reward model trained on a stepwise file; their
export and loading give the scores of the models in memory."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import text_rollout

import rlhf_eqx as rx
from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main


@pytest.fixture(scope="module")
def builtin():
    return pl.tools.load_model("builtin")


_PROMPTS = ("Once upon a time", "Tom had a")
_TEXTS = (" a dog ran home.\nIt was happy.", " big red ball.\nHe played.\n")


def test_ensemble_export_and_load_give_the_same_scores(builtin, tmp_path):
    policy, tok = builtin
    keys = jax.random.split(jax.random.key(0), 3)
    ens = rx.train.make_ensemble(lambda k: rx.RewardModel.from_policy(policy, key=k), keys)
    # distinct biases: the exported HF head has none, so they travel in ensemble.json
    ens = eqx.tree_at(lambda e: e.members.bias, ens, jnp.asarray([0.5, -1.0, 2.0]))
    source = pl.runs.EnsembleReward(ens, penalty=0.7, mode="std")
    out = pl.runs.export_reward_ensemble(ens, str(tmp_path), penalty=0.7, mode="std")
    loaded = pl.runs.load_reward_source(out, tok)
    assert isinstance(loaded, pl.runs.EnsembleReward)
    assert (loaded.penalty, loaded.mode, loaded.ensemble.num_members) == (0.7, "std", 3)
    roll = text_rollout(tok, _PROMPTS, _TEXTS)
    want, want_members = source.scores(roll.tokens, roll.mask)
    got, got_members = loaded.scores(roll.tokens, roll.mask)
    np.testing.assert_allclose(got_members, want_members, atol=1e-5)
    np.testing.assert_allclose(got, want, atol=1e-5)
    scored = loaded.score(roll)
    np.testing.assert_allclose(scored.scores, want, atol=1e-5)
    np.testing.assert_allclose(
        scored.metrics["reward/ensemble_std"], np.std(want_members, axis=0).mean(), rtol=1e-5
    )
    # the conservative score is below the mean by penalty * std
    np.testing.assert_allclose(
        want, want_members.mean(0) - 0.7 * want_members.std(0), rtol=1e-5, atol=1e-6
    )


def test_prm_export_and_load_give_the_same_step_rewards(builtin, tmp_path):
    policy, tok = builtin
    prm = rx.ValueModel.from_policy(policy, key=jax.random.key(1))
    prm = eqx.tree_at(lambda m: m.bias, prm, jnp.asarray(0.3, jnp.float32))
    out = pl.runs.export_prm(prm, str(tmp_path), separator="\n", aggregation="mean", score="prob")
    loaded = pl.runs.load_reward_source(out, tok, eos_ids=(tok.eos_id,))
    assert isinstance(loaded, pl.runs.ProcessReward)
    assert loaded.separator_id == rx.data.separator_id(tok, "\n")
    assert (loaded.aggregation, loaded.score_kind) == ("mean", "prob")
    roll = text_rollout(tok, _PROMPTS, _TEXTS)
    direct = pl.runs.ProcessReward(prm, loaded.separator_id, aggregation="mean")
    want, got = direct.score(roll), loaded.score(roll)
    np.testing.assert_allclose(got.scores, want.scores, atol=1e-5)
    np.testing.assert_allclose(got.token_rewards, want.token_rewards, atol=1e-5)
    # step rewards sit at the step ends only: two steps in each completion
    steps = np.asarray(want.token_rewards != 0).sum(axis=1)
    np.testing.assert_array_equal(steps, [2, 2])
    assert got.metrics["reward/prm_steps"] == 2.0
    # a PRM directory is not a reward model, and the reverse
    with pytest.raises(ValueError, match="holds a process reward model"):
        pl.runs.stage_reward_source(
            pl.GRPOConfig(reward_source="reward_model", reward_model=out),
            task=[],
            tokenizer=tok,
            judge=pl.JudgeConfig(),
            judges={},
        )


def test_judge_source_scores_every_completion_in_one_pass(builtin):
    policy, tok = builtin
    judge = pl.JudgeConfig(template="{prompt}{completion} The story was", yes="happy", no="big")
    source = pl.runs.stage_reward_source(
        pl.GRPOConfig(reward_source="judge"),
        task=[],
        tokenizer=tok,
        judge=judge,
        judges={"base": policy},
    )
    roll = text_rollout(tok, _PROMPTS, _TEXTS)
    want = rx.train.judge_reward(
        policy, tok, template=judge.template, yes_token="happy", no_token="big"
    ).score(list(_PROMPTS), list(_TEXTS))
    np.testing.assert_allclose(source.score(roll).scores, want, atol=1e-6)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["grpo.reward_source=oracle"], "grpo.reward_source='oracle': must be one of task,"),
        (["reward.ensemble=0"], "reward.ensemble=0: must be >= 1"),
        (["reward.ensemble_mode=max"], "reward.ensemble_mode='max': must be one of std,"),
        (["prm.aggregation=max"], "prm.aggregation='max': must be one of min, last, mean"),
        (["ppo.reward_model=/no/such/dir"], "ppo.reward_model='/no/such/dir': no such directory"),
        (
            ["grpo.reward_source=judge", "judge.template={answer}"],
            "judge.template='{answer}': a format string",
        ),
        (["grpo.reward_source=prm"], "grpo.reward_model='': reward_source=prm needs"),
    ],
)
def test_reward_source_settings_are_checked(overrides, message):
    with pytest.raises(pl.ConfigError) as info:
        pl.config.validate_config(pl.apply_overrides(pl.animal_task_config(), overrides))
    assert message in str(info.value) and "\n" not in str(info.value)


_QUIET = ["--quiet", "--set", "ops.monitor=false", "--set", "sampling.prompt_length=16"]


def _stepwise(path, n=24):
    with open(path, "w") as f:
        for i in range(n):
            a, b = i % 7 + 1, i % 5 + 2
            wrong = i % 3 == 0
            steps = [f"{a} times {b} is {a * b + wrong}", f"so the answer is {a * b + wrong}"]
            rec = {"prompt": f"What is {a} times {b}?", "completions": steps}
            rec["labels"] = [not wrong, not wrong]
            f.write(json.dumps(rec) + "\n")


def _questions(path, n=12):
    with open(path, "w") as f:
        for i in range(n):
            a, b = i % 7 + 1, i % 5 + 2
            rec = {"question": f"What is {a} times {b}?", "answer": f"{a * b}\n#### {a * b}"}
            f.write(json.dumps(rec) + "\n")


@pytest.mark.slow
def test_prm_stage_trains_on_a_stepwise_file_and_scores_grpo(tmp_path):
    steps, questions = tmp_path / "steps.jsonl", tmp_path / "q.jsonl"
    _stepwise(steps)
    _questions(questions)
    prm_run = tmp_path / "prm"
    small = ["--set", "prm.steps=3", "--set", "prm.batch_size=4", "--set", "prm.max_length=48"]
    assert main(["prm", "--data", str(steps), "--out", str(prm_run), *_QUIET, *small]) == 0
    summary = json.loads((prm_run / "summary.json").read_text())
    assert 0.0 <= summary["prm"]["heldout_step_accuracy"] <= 1.0
    assert summary["prm"]["heldout_steps"] > 0
    hf = prm_run / "prm" / "hf"
    meta = json.loads((hf / "prm.json").read_text())
    assert meta["separator"] == "\n" and meta["aggregation"] == "min"
    steps_logged = pl.tools.read_metrics(str(prm_run))["prm"]
    assert [r["step"] for r in steps_logged] == [0, 1, 2]
    assert all("accuracy" in r for r in steps_logged)

    grpo_run = tmp_path / "grpo"
    argv = ["grpo", "--data", str(questions), "--out", str(grpo_run), *_QUIET]
    argv += ["--set", "grpo.reward_source=prm", "--set", f"grpo.reward_model={hf}"]
    argv += ["--set", "grpo.rollouts=1", "--set", "grpo.prompts_per_rollout=2"]
    argv += ["--set", "grpo.group_size=2", "--set", "sampling.max_new_tokens=8"]
    argv += ["--set", "data.heldout_fraction=0.25"]
    assert main(argv) == 0
    it = [r for r in pl.tools.read_records(str(grpo_run)) if r.get("stage") == "grpo"]
    assert any("rollout/reward/prm_steps" in r for r in it)
    # a reward model source without a directory is refused before anything runs
    bad = [*argv[:5], "--set", "grpo.reward_source=reward_model", "--overwrite", *_QUIET]
    assert main(bad) == 2
    assert (grpo_run / "summary.json").exists()  # the refused run moved nothing aside


@pytest.mark.slow
def test_ensemble_reward_stage_scores_ppo_and_grpo_scores_with_a_judge(tmp_path):
    quiet = ["--quiet", "--set", "ops.monitor=false"]
    out = tmp_path / "ppo"
    argv = ["ppo", "--out", str(out), *quiet, "--set", "reward.ensemble=2"]
    argv += ["--set", "sft.steps=2", "--set", "reward.steps=3", "--set", "reward.eval_every=0"]
    argv += ["--set", "reward.pairs_per_prompt=2", "--set", "ppo.rollouts=1"]
    argv += ["--set", "ppo.prompts_per_rollout=4", "--set", "sampling.max_new_tokens=8"]
    argv += ["--set", "eval_samples=1"]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["reward_model"]["ensemble"] == 2
    meta = json.loads((out / "reward" / "ensemble" / "ensemble.json").read_text())
    assert meta["members"] == 2 and len(meta["biases"]) == 2
    assert (out / "reward" / "ensemble" / "member_1" / "config.json").exists()
    it = [r for r in pl.tools.read_records(str(out)) if r.get("stage") == "ppo"]
    assert any("rollout/reward/ensemble_std" in r for r in it)

    # GRPO on the built-in task scored by the exported ensemble, then by a judge
    for extra in (
        ["grpo.reward_source=reward_model", f"grpo.reward_model={out}/reward/ensemble"],
        ["grpo.reward_source=judge", "judge.yes=happy", "judge.no=big", "judge.model=sft"],
    ):
        run = tmp_path / extra[0].split("=")[1]
        argv = ["grpo", "--out", str(run), *quiet, "--set", "sft.steps=2"]
        argv += ["--set", "grpo.rollouts=1", "--set", "grpo.prompts_per_rollout=2"]
        argv += ["--set", "grpo.group_size=2", "--set", "sampling.max_new_tokens=8"]
        argv += ["--set", "eval_samples=1"]
        for e in extra:
            argv += ["--set", e]
        assert main(argv) == 0
        assert "reward" not in json.loads((run / "summary.json").read_text())
