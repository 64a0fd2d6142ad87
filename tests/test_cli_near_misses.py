"""A misspelt command, stage, section or field is refused in one line that names the
nearest known ones, and a setting given by its TRL (or PEFT) name names the setting that
holds it here. Every case stops at argument checking."""

import json

import pytest

from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a command that were not refused would write runs/ here


def _error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def _refused(argv, capsys) -> str:
    assert main([*argv, "--show-config"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_a_misspelt_command_names_the_nearest(capsys):
    line = _error(["gpro"], capsys)
    assert line.startswith("rlhf_eqx: error: unknown command 'gpro'; did you mean grpo? (commands:")
    assert "did you mean online-dpo?" in _error(["onlinedpo"], capsys)
    assert "did you mean" not in _error(["xyz"], capsys)


def test_a_misspelt_stage_section_or_field_names_the_nearest(capsys):
    line = _refused(["--set", "stages=sft,dop"], capsys)
    assert "unknown stage 'dop'; did you mean dpo? (known: " in line
    line = _refused(["dpo", "--set", "dpo.bta=0.1"], capsys)
    assert "dpo.bta: unknown field; did you mean dpo.beta? (known: " in line
    line = _refused(["dpo", "--set", "dpo.optim.learning_rat=0.1"], capsys)
    assert "did you mean dpo.optim.learning_rate?" in line
    line = _refused(["dpo", "--set", "dop.beta=0.1"], capsys)
    assert "dop: unknown config section; did you mean " in line and "dpo" in line
    assert "(known: model, data, sampling, ops, sft" in line
    line = _refused(["dpo", "--set", "dpo.beta.x=1"], capsys)
    assert line.endswith("dpo.beta: a setting, not a config section")
    with pytest.raises(pl.ConfigError, match="unknown stage 'dpp'; did you mean"):
        pl.config.get_stage("dpp")


@pytest.mark.parametrize(
    "given, meant",
    [
        ("grpo.num_generations=8", "grpo.group_size"),
        ("grpo.max_completion_length=8", "sampling.max_new_tokens"),
        ("dpo.learning_rate=1e-3", "dpo.optim.learning_rate"),
        ("dpo.optim.lr=1e-3", "dpo.optim.learning_rate"),
        ("dpo.max_steps=3", "dpo.steps"),
        ("dpo.lora.r=4", "dpo.lora.rank"),
        ("seed=3", "ops.seed"),
    ],
)
def test_a_trl_name_names_the_setting_that_holds_it(given, meant, capsys):
    command = given.split(".")[0] if "." in given else "pipeline"
    line = _refused([command, "--set", given], capsys)
    name = given.partition("=")[0]
    assert f"{name}: unknown field; TRL's {name.split('.')[-1]} is {meant} here" in line


def test_a_config_file_with_a_trl_name_is_refused_the_same_way(tmp_path, capsys):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"grpo": {"num_generations": 8}}))
    line = _refused(["grpo", "--config", str(path)], capsys)
    assert "grpo.num_generations: unknown field; TRL's num_generations is grpo.group_size" in line


def test_a_stage_whose_settings_are_another_section_names_it(capsys):
    line = _refused(["online-dpo", "--set", "online-dpo.beta=0.2"], capsys)
    assert "online-dpo: unknown config section; the online-dpo stage's settings" in line
    assert "are the dpo section (dpo.beta)" in line
