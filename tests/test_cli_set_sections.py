"""A `--set` (or a sweep's `--grid`) aimed at a stage section that the command does not run
is refused in one line (exit 2) naming the key, the stages the command runs and the
command that reads it; the sections the command runs, the shared ones and a config file
that sets every section are accepted. Every case stops at argument checking."""

import json

import pytest

from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a command that were not refused would write runs/ here


@pytest.fixture
def prefs(tmp_path):
    path = tmp_path / "prefs.jsonl"
    rows = [{"prompt": f"Q{i}", "chosen": " yes", "rejected": " no"} for i in range(4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _refused(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def _accepted(argv, capsys) -> dict:
    assert main([*argv, "--show-config"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_another_stages_setting_is_refused_naming_what_runs_and_what_reads_it(prefs, capsys):
    line = _refused(["dpo", "--data", prefs, "--set", "ppo.kl_coef=0.1"], capsys)
    assert line == (
        "error: invalid configuration: --set ppo.kl_coef=0.1: rlhf_eqx dpo runs dpo, which "
        "does not read ppo.*; rlhf_eqx ppo reads it"
    )
    line = _refused(["kto", "--set", "grpo.beta=0.1"], capsys)
    assert "--set grpo.beta=0.1: rlhf_eqx kto runs sft, kto, which do not read grpo.*" in line
    assert line.endswith("rlhf_eqx grpo reads it; for this command set kto.beta")
    # SFT runs before DPO on the built-in task, not on a data file
    assert _accepted(["dpo", "--set", "sft.steps=3"], capsys)["sft"]["steps"] == 3
    line = _refused(["dpo", "--data", prefs, "--set", "sft.steps=3"], capsys)
    assert "rlhf_eqx dpo runs dpo, which does not read sft.*; rlhf_eqx sft reads it" in line
    line = _refused(["dpo", "--data", prefs, "--set", "sft.lora.rank=4"], capsys)
    assert line.endswith("rlhf_eqx sft reads it; for this command set dpo.lora.rank")
    # the reward model runs before PPO, and before GRPO only when GRPO scores with it
    assert _accepted(["ppo", "--set", "reward.steps=3"], capsys)["reward"]["steps"] == 3
    assert "rlhf_eqx reward reads it" in _refused(["grpo", "--set", "reward.steps=3"], capsys)
    scored = ["grpo", "--set", "grpo.reward_source=reward_model", "--set", "reward.steps=3"]
    assert _accepted(scored, capsys)["reward"]["steps"] == 3
    # online DPO's settings are the dpo section
    assert _accepted(["online-dpo", "--set", "dpo.beta=0.3"], capsys)["dpo"]["beta"] == 0.3
    line = _refused(["eval", "--set", "dpo.beta=0.2"], capsys)
    assert "rlhf_eqx eval runs no stage and reads no stage's settings (dpo.*)" in line


def test_the_pipeline_refuses_the_sections_of_stages_outside_its_stages(capsys):
    line = _refused(["--set", "kto.beta=0.2"], capsys)
    assert "rlhf_eqx pipeline runs sft, reward, ppo, dpo, grpo, which do not read kto.*" in line
    assert line.endswith("rlhf_eqx kto reads it, or this pipeline with stages=" + (
        "sft,reward,ppo,dpo,grpo,kto"
    ))  # fmt: skip
    cfg = _accepted(["pipeline", "--set", "stages=sft,kto", "--set", "kto.beta=0.2"], capsys)
    assert cfg["kto"]["beta"] == 0.2
    line = _refused(["pipeline", "--set", "stages=sft,dpo", "--set", "ppo.kl_coef=0.2"], capsys)
    assert "rlhf_eqx pipeline runs sft, dpo, which do not read ppo.*" in line


def test_stages_on_a_stage_command_is_refused(capsys):
    line = _refused(["dpo", "--set", "stages=sft,kto"], capsys)
    assert line == (
        "error: invalid configuration: --set stages=sft,kto: rlhf_eqx dpo runs sft, dpo (its "
        "own stages); choose them with rlhf_eqx pipeline --set stages=sft,kto"
    )


def test_shared_settings_and_a_config_file_of_every_section_are_accepted(prefs, tmp_path, capsys):
    sets = ["--set", "ops.seed=3", "--set", "sampling.prompt_length=24", "--set", "dpo.beta=0.2"]
    cfg = _accepted(["dpo", "--data", prefs, *sets], capsys)
    assert (cfg["ops"]["seed"], cfg["dpo"]["beta"]) == (3, 0.2)
    whole = pl.config.config_to_dict(pl.animal_task_config())
    whole["ppo"]["kl_coef"] = 0.3  # a file (a run's config.json) sets every section
    path = tmp_path / "config.json"
    path.write_text(json.dumps(whole))
    cfg = _accepted(["dpo", "--data", prefs, "--config", str(path)], capsys)
    assert cfg["ppo"]["kl_coef"] == 0.3


def test_a_sweep_refuses_another_stages_set_and_grid_keys(prefs, tmp_path, capsys):
    out = str(tmp_path / "sweep")
    argv = ["sweep", "dpo", "--seeds", "1", "--out", out]
    line = _refused([*argv, "--set", "ppo.kl_coef=0.1"], capsys)
    assert line == (
        "error: --set ppo.kl_coef=0.1: rlhf_eqx sweep dpo runs sft, dpo, which do not read "
        "ppo.*; rlhf_eqx ppo reads it"
    )
    line = _refused([*argv, "--grid", "ppo.kl_coef=0.1,0.2"], capsys)
    assert line.startswith("error: --grid ppo.kl_coef=0.1,0.2: rlhf_eqx sweep dpo runs sft, dpo")
    line = _refused([*argv, "--data", prefs, "--grid", "sft.optim.learning_rate=0.1,0.2"], capsys)
    assert "rlhf_eqx sweep dpo runs dpo, which does not read sft.*" in line
    assert not (tmp_path / "sweep").exists()


def test_help_refuses_another_stages_setting_as_a_run_does(prefs, capsys):
    assert main(["dpo", "--data", prefs, "--set", "ppo.kl_coef=0.1", "--help"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: invalid configuration: --set ppo.kl_coef=0.1: ")
    assert "dpo.beta" in captured.out  # the help still follows
    assert main(["dpo", "--data", prefs, "--set", "dpo.beta=0.3", "--help"]) == 0
    assert "dpo.beta = 0.3" in capsys.readouterr().out
