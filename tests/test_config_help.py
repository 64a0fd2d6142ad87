"""`rlhf_eqx STAGE --help` lists the fields a run of the stage reads, each one a
setting `--set` accepts: not the fields set from another section (the PPO and GRPO
`temperature`, which is `sampling.temperature`)."""

import pytest

from rlhf_eqx import pipelines as pl


def _listed(text: str) -> list[tuple[str, str]]:
    """The `(path, value)` of each `  section.field = value` line of a help text."""
    lines = [line.strip() for line in text.splitlines() if line.startswith("  ")]
    return [tuple(line.split(" = ", 1)) for line in lines if " = " in line]


@pytest.mark.parametrize("command", ["grpo", "ppo", "multiturn", "pipeline"])
def test_help_lists_only_settings(command):
    cfg = pl.animal_task_config()
    listed = _listed(pl.config.config_help(command, cfg))
    paths = [path for path, _ in listed]
    assert "sampling.temperature" in paths
    assert not [
        p
        for p in paths
        if p.endswith(".temperature") and p.split(".")[0] in ("grpo", "ppo", "multiturn")
    ]
    # each field listed of the stage's own section is a setting: --set takes it as shown
    own = [f"{p}={v}" for p, v in listed if p.startswith(f"{command}.") and v not in ("None", "")]
    pl.apply_overrides(cfg, own)


@pytest.mark.parametrize("command", ["online-dpo", "multiturn"])
def test_help_of_a_stage_without_a_data_file_form_says_so(command):
    """A stage without a data-file form (`--data FILE` is refused) is described on the
    built-in task alone, with or without `data.path`."""
    cfg = pl.animal_task_config()
    for c in (cfg, pl.apply_overrides(cfg, ["data.path=x.jsonl"])):
        text = pl.config.config_help(command, c)
        assert f"; {command} does not run on a data file)" in text
        assert "with --data FILE" not in text and "on a data file (--data FILE)" not in text


def test_help_of_a_data_file_stage_names_its_data_file_form():
    text = pl.config.config_help("dpo", pl.animal_task_config())
    assert "(stages sft, dpo; with --data FILE, dpo alone)" in text
