"""Sweeps (`pipelines.sweep`, `rlhf_eqx sweep`): what is refused before anything is
loaded or compiled — grid fields that change shapes or control flow, stages that do not
sweep, malformed `--grid` specs — each with one line naming the field."""

import os

import pytest

from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main


@pytest.mark.parametrize(
    "field", ["dpo.batch_size", "dpo.steps", "dpo.lora.rank", "dpo.loss_type", "sft.steps"]
)
def test_sweep_refuses_a_field_that_is_not_traceable_naming_it_and_the_allowed(field, tmp_path):
    with pytest.raises(pl.ConfigError) as e:
        pl.sweep("dpo", seeds=1, grid={field: [1.0, 2.0]}, out=str(tmp_path / "s"))
    msg = str(e.value)
    assert field in msg and "dpo.beta" in msg and "dpo.optim.learning_rate" in msg
    assert not (tmp_path / "s").exists()  # refused before the sweep directory is taken


def test_sweep_refuses_a_stage_that_does_not_sweep(tmp_path):
    with pytest.raises(pl.ConfigError, match="sweep distill: not supported .*dpo"):
        pl.sweep("distill", seeds=1, out=str(tmp_path / "s"))


@pytest.mark.parametrize("field", ["ppo.gamma", "ppo.lam", "ppo.minibatches", "ppo.dual_clip"])
def test_ppo_sweep_refuses_what_the_step_does_not_trace(field, tmp_path):
    with pytest.raises(pl.ConfigError) as e:
        pl.sweep("ppo", seeds=1, grid={field: [1.5, 2.0]}, out=str(tmp_path / "s"))
    msg = str(e.value)
    assert f"--grid {field}: not traceable" in msg
    assert all(f"ppo.{f}" in msg for f in ("kl_coef", "clip_eps", "vf_coef", "ent_coef"))
    assert not (tmp_path / "s").exists()


def test_ppo_sweep_refuses_a_process_reward_model(tmp_path):
    cfg = pl.apply_overrides(
        pl.animal_task_config(), ["ppo.reward_source=prm", f"ppo.reward_model={tmp_path}"]
    )
    with pytest.raises(pl.ConfigError, match="ppo.reward_source='prm'"):
        pl.sweep("ppo", cfg, seeds=1, out=str(tmp_path / "s"))


def test_sweep_refuses_a_non_finite_grid_value_and_bad_seeds(tmp_path):
    with pytest.raises(pl.ConfigError, match="dpo.beta: value inf"):
        pl.sweep("dpo", seeds=1, grid={"dpo.beta": [0.1, float("inf")]}, out=str(tmp_path))
    with pytest.raises(pl.ConfigError, match="seeds=0"):
        pl.sweep("dpo", seeds=0, out=str(tmp_path))


def test_sweep_validates_each_grid_value_as_a_set_value(tmp_path):
    # beta must be > 0: the member's configuration is built by --set, which refuses it
    with pytest.raises(pl.ConfigError, match="beta"):
        pl.sweep("dpo", seeds=1, grid={"dpo.beta": [0.1, -1.0]}, out=str(tmp_path / "s"))


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--grid", "dpo.max_length=40,80"], "--grid dpo.max_length: not traceable"),
        (["--grid", "dpo.beta"], "expected FIELD=V1,V2"),
        (["--grid", "dpo.beta=a,b"], "values must be numbers"),
        (["--grid", "dpo.beta=0.1,,0.2"], "an empty value between commas"),
        (["--grid", "dpo.beta=0.1,0.2,"], "an empty value between commas"),
        (["--grid", "dpo.beta="], "no values"),
        (["--grid", "dpo.beta=0.1", "--grid", "dpo.beta=0.2"], "given twice"),
    ],
)
def test_cli_sweep_refuses_bad_grids_with_exit_status_2(argv, needle, tmp_path, capsys):
    code = main(["sweep", "dpo", "--seeds", "1", "--out", str(tmp_path / "s"), *argv])
    assert code == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def _pairs_file(tmp_path) -> str:
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "Once", "chosen": " a dog.", "rejected": " zzz."}\n')
    return str(path)


@pytest.mark.parametrize(
    ("stage", "sets", "needle"),
    [
        ("ppo", [], "sweep ppo --data: not supported .*sft, dpo, kto, reward, grpo"),
        ("dpo", ["dpo.packing=true"], "dpo.packing=True: a DPO sweep"),
        ("sft", ["sft.packing=true"], "sft.packing=True: an SFT sweep"),
        ("reward", ["reward.ensemble=2"], "reward.ensemble=2: a sweep trains one"),
    ],
)
def test_data_sweep_refuses_what_it_does_not_run_before_taking_the_directory(
    stage, sets, needle, tmp_path
):
    cfg = pl.apply_overrides(pl.animal_task_config(), [f"data.path={_pairs_file(tmp_path)}", *sets])
    with pytest.raises(pl.ConfigError, match=needle):
        pl.sweep(stage, cfg, seeds=1, out=str(tmp_path / "s"))
    assert not (tmp_path / "s").exists()


def test_multiturn_sweep_refuses_an_untraceable_field_and_a_bad_environment(tmp_path):
    with pytest.raises(pl.ConfigError, match="--grid multiturn.turn_tokens: not traceable"):
        pl.sweep(
            "multiturn", seeds=1, grid={"multiturn.turn_tokens": [4.0, 8.0]}, out=str(tmp_path)
        )
    for spec, needle in [("nocolon", "expected MODULE:NAME"), ("no_such_mod:x", "cannot import")]:
        cfg = pl.apply_overrides(pl.animal_task_config(), [f"multiturn.environment={spec}"])
        with pytest.raises(pl.ConfigError, match=f"multiturn.environment='{spec}': {needle}"):
            pl.sweep("multiturn", cfg, seeds=1, out=str(tmp_path / "s"))
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(
    ("grid", "needle"),
    [
        ({"dpo.beta": [0.1, 0.2, 0.1]}, "--grid dpo.beta: value 0.1 given twice"),
        ({"dpo.beta": [0.1, 0.1000]}, "--grid dpo.beta: value 0.1 given twice"),
        ({"dpo.beta": []}, "--grid dpo.beta: no values"),
        ({"dpo.bta": [0.1]}, "--grid dpo.bta: unknown field; did you mean dpo.beta? (traceable: "),
        (
            {"dpo.optim.learnin_rate": [0.1]},
            "--grid dpo.optim.learnin_rate: unknown field; did you mean dpo.optim.learning_rate?",
        ),
        ({"dop.beta": [0.1]}, "--grid dop.beta: unknown field; did you mean dpo.beta?"),
        ({"dpo.lr": [0.1]}, "--grid dpo.lr: unknown field; TRL's lr is dpo.optim.learning_rate"),
        ({"dpo.xyz": [0.1]}, "--grid dpo.xyz: unknown field (traceable: dpo.beta, "),
    ],
)
def test_sweep_refuses_a_bad_grid_value_or_a_misspelt_field_naming_it(grid, needle, tmp_path):
    # a repeated value would make two members of one name writing one directory
    with pytest.raises(pl.ConfigError) as e:
        pl.sweep("dpo", seeds=1, grid=grid, out=str(tmp_path / "s"))
    assert needle in str(e.value)
    assert not (tmp_path / "s").exists()


def test_sweep_takes_a_grid_of_any_sequence_of_numbers(tmp_path):
    import numpy as np

    grid = {"dpo.beta": np.array([0.05, 0.2]), "dpo.optim.learning_rate": (1e-3, 2)}
    # the grid passes (NumPy floats, a tuple, an int); the seeds, checked after it, do not
    with pytest.raises(pl.ConfigError, match="seeds=0"):
        pl.sweep("dpo", seeds=0, grid=grid, out=str(tmp_path / "s"))


def test_cli_sweep_refuses_a_repeated_grid_value_with_exit_status_2(tmp_path, capsys):
    out = str(tmp_path / "s")
    code = main(["sweep", "dpo", "--seeds", "1", "--out", out, "--grid", "dpo.beta=0.1,0.2,0.10"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--grid dpo.beta: value 0.1 given twice" in err and err.count("\n") == 1


def test_cli_sweep_suggests_the_traceable_field_of_a_misspelt_grid_field(tmp_path, capsys):
    out = str(tmp_path / "s")
    assert main(["sweep", "dpo", "--seeds", "1", "--out", out, "--grid", "dpo.bta=0.1,0.2"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: --grid dpo.bta: unknown field; did you mean dpo.beta? ("), line
    assert not os.path.exists(out)


def test_cli_sweep_refuses_callbacks_in_one_line(tmp_path, capsys):
    out = str(tmp_path / "s")
    code = main(["sweep", "dpo", "--seeds", "1", "--out", out, "--callback", "m:C"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --callback: not in a sweep") and err.count("\n") == 1
    assert not os.path.exists(out)


@pytest.mark.parametrize(
    "setting", ["ops.eval_every=2", "ops.loss_spike=3", "ops.kl_spike=4", "ops.max_rollbacks=1"]
)
def test_sweep_refuses_the_ops_settings_it_does_not_read(setting, tmp_path):
    """A sweep has no periodic evaluation and no rollback: setting them is refused by
    name, not silently ignored."""
    cfg = pl.apply_overrides(pl.animal_task_config(), [setting])
    with pytest.raises(pl.ConfigError, match=f"{setting.split('=')[0]}="):
        pl.sweep("dpo", cfg, seeds=1, out=str(tmp_path / "s"))
    assert not (tmp_path / "s").exists()
