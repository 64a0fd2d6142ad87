"""A sweep of the built-in GRPO or reward stage with a setting its sweep does not run is
refused naming the field before anything runs: no seed's SFT is trained first, and no
sweep directory is left behind (one would hold the refused configuration, so that the
corrected command is told the directory already holds a sweep, and its `--resume` that
the configuration differs)."""

import os

import pytest

from rlhf_eqx import pipelines as pl

TINY = ["sft.steps=2", "eval_samples=2", "ops.quiet=true", "ops.monitor=false"]


@pytest.mark.parametrize(
    ("stage", "sets", "grid", "needle"),
    [
        ("grpo", ["grpo.staleness=1"], {"grpo.beta": [0.02, 0.1]}, "grpo.staleness=1"),
        ("grpo", ["grpo.dynamic_sampling=2"], {}, "grpo.dynamic_sampling=2"),
        ("reward", ["reward.ensemble=2"], {}, "reward.ensemble=2"),
    ],
)
def test_built_in_sweep_refuses_what_it_does_not_run_before_anything_runs(
    stage, sets, grid, needle, tmp_path
):
    cfg = pl.apply_overrides(pl.animal_task_config(), [*TINY, *sets])
    out = str(tmp_path / "s")
    with pytest.raises(pl.ConfigError, match=needle):
        pl.sweep(stage, cfg, seeds=2, grid=grid, out=out)
    assert not os.path.exists(out)


def test_cli_sweep_refusal_leaves_the_directory_free_for_the_corrected_command(tmp_path, capsys):
    from rlhf_eqx.pipelines.tools import sweep_command

    out = str(tmp_path / "s")
    argv = ["grpo", "--seeds", "1", "--out", out, "--quiet", "--set", "sft.steps=2"]
    assert sweep_command([*argv, "--set", "grpo.overlong_buffer=4"]) == 2
    assert "grpo.overlong_buffer=4" in capsys.readouterr().err
    assert not os.path.exists(out)
