"""Sweeps on a data file (`pipelines.sweep(stage, cfg)` with `data.path`, `rlhf_eqx sweep
STAGE --data FILE`): every member equals the stage's run on the same file with its seed
and grid values (`run_on_data`: the same per-step metrics, exported weights and held-out
numbers), for SFT, DPO, KTO and the reward model, on a JSON-lines file and on a Parquet
file; a resumed data sweep ends bit-identical to the uninterrupted one and refuses a
changed file; a diverged member is frozen and reported."""

import dataclasses
import json
import os
import shutil

import equinox as eqx
import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_sweep_runs import assert_same_run, step_records

from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main

pytestmark = pytest.mark.slow

ANIMALS = ["dog", "cat", "fox", "owl", "bee", "cow", "pig", "hen"]


def pair_rows(n: int = 24) -> list[dict]:
    """Preference pairs with distinct prompts: a short story as chosen, noise rejected."""
    return [
        {
            "prompt": f"Once upon a time {i}, the {ANIMALS[i % 8]}",
            "chosen": f" ran to see the {ANIMALS[(i + 3) % 8]}.",
            "rejected": " zzz qq zzz." if i % 2 else " no no no.",
        }
        for i in range(n)
    ]


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def write_parquet(path, rows) -> str:
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


SMALL = [
    "sampling.prompt_length=16",
    "data.heldout_fraction=0.25",
    "ops.quiet=true",
    "ops.monitor=false",
    "ops.checkpoint_every=1",
    "sft.steps=3",
    "dpo.steps=3",
    "kto.steps=3",
    "reward.steps=4",
    "reward.eval_every=2",
    "reward.heldout_fraction=0.5",  # a validation split of the 16 training pairs, both seeds
    *(f"{s}.{f}" for s in ("sft", "dpo", "kto", "reward") for f in ("batch_size=4",)),
    *(f"{s}.max_length=40" for s in ("sft", "dpo", "kto", "reward")),
]


SAMPLED_EVAL = ["sampling.max_new_tokens=8", "data.eval_prompts=2", "eval_samples=1"]
"""The held-out samples' size, for the stages that sample them (`reward` samples nothing
and refuses these settings)."""


def data_config(path: str, stage: str = "dpo"):
    sampled = SAMPLED_EVAL if stage != "reward" else []
    return pl.apply_overrides(pl.animal_task_config(), [*SMALL, *sampled, f"data.path={path}"])


HELD = {
    "sft": ("heldout_nll", "heldout_nll_before"),
    "dpo": ("heldout_reward_accuracy",),
    "kto": ("heldout_pair_accuracy",),
    "reward": ("heldout_accuracy", "selected_step"),
}
GRIDS = {
    "sft": {"sft.optim.learning_rate": [5e-4, 2e-3]},
    "dpo": {"dpo.beta": [0.05, 0.2]},
    "kto": {"kto.beta": [0.1, 0.5]},
    "reward": {"reward.optim.learning_rate": [1e-3, 3e-3]},
}


def check_members_equal_their_runs(res, stage: str, tmp_path, members):
    key = "reward_model" if stage == "reward" else stage
    for mem in members:
        run_dir = str(tmp_path / mem.name)
        summary = pl.run_on_data(dataclasses.replace(mem.cfg, out=run_dir), stage)
        ours = os.path.join(res.out, "members", mem.name)
        hf = "reward" if stage == "reward" else stage
        assert os.path.isdir(os.path.join(ours, hf, "hf"))
        assert_same_run(ours, run_dir, stage)
        for k in HELD[stage]:
            assert res.summaries[mem.name][k] == pytest.approx(summary[key][k], abs=1e-4), k


@pytest.mark.parametrize("stage", ["sft", "dpo", "kto", "reward"])
def test_data_sweep_members_equal_their_runs_on_the_file(stage, tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", pair_rows())
    cfg = data_config(path, stage)
    res = pl.sweep(stage, cfg, seeds=2, grid=GRIDS[stage], out=str(tmp_path / "s"), export=True)
    assert len(res.members) == 4 and res.diverged == ()
    assert not os.path.isdir(os.path.join(res.out, "seeds"))  # no built-in task stages
    check_members_equal_their_runs(res, stage, tmp_path, res.members[1:3])


def test_cli_dpo_sweep_on_a_parquet_file_equals_its_runs_and_resumes(tmp_path, capsys):
    path = write_parquet(tmp_path / "pairs.parquet", pair_rows())
    out = str(tmp_path / "s")
    small = tmp_path / "small.json"  # a file sets every section, as data_config does
    small.write_text(json.dumps(pl.config.config_to_dict(data_config(path))))
    argv = ["sweep", "dpo", "--config", str(small), "--data", path, "--seeds", "2"]
    argv += ["--grid", "dpo.beta=0.05,0.2"]
    assert main([*argv, "--out", out, "--export", "--set", "ops.quiet=false"]) == 0
    printed = capsys.readouterr().out
    assert "4 members done" in printed
    # the table has the held-out numbers of the stage's run on the file
    assert "| grid point | seeds | loss | rewards/accuracies | rewards/margins | " in printed
    assert "| heldout_reward_accuracy |" in printed
    with open(os.path.join(out, "sweep.json")) as f:
        assert json.load(f)["data"]["path"] == path
    cfg = data_config(path)
    res = pl.sweep("dpo", cfg, seeds=2, grid=GRIDS["dpo"], out=out, resume=True)
    check_members_equal_their_runs(res, "dpo", tmp_path, res.members[:1])
    # killed after its first checkpoint: the resumed sweep is bit-identical
    again = str(tmp_path / "again")
    shutil.copytree(out, again)
    for name in os.listdir(os.path.join(again, "checkpoints")):
        if name != "iter_00000001":
            shutil.rmtree(os.path.join(again, "checkpoints", name))
    resumed = pl.sweep("dpo", cfg, seeds=2, grid=GRIDS["dpo"], out=again, resume=True)
    a = jax.tree.leaves(eqx.filter(res.states, eqx.is_array))
    b = jax.tree.leaves(eqx.filter(resumed.states, eqx.is_array))
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))
    for mem in res.members:
        ours = step_records(os.path.join(again, "members", mem.name))
        theirs = step_records(os.path.join(out, "members", mem.name))
        assert [r["loss"] for r in ours] == [r["loss"] for r in theirs]
    # a changed file is refused on resume
    write_parquet(path, pair_rows(20))
    with pytest.raises(pl.loop.RunDirError, match="data file .* changed"):
        pl.sweep("dpo", cfg, seeds=2, grid=GRIDS["dpo"], out=again, resume=True)


def test_a_diverged_member_of_a_data_sweep_is_frozen_and_reported(tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", pair_rows())
    grid = {"sft.optim.learning_rate": [5e-4, 1e6]}
    res = pl.sweep("sft", data_config(path), seeds=1, grid=grid, out=str(tmp_path / "s"))
    assert res.diverged == ("learning_rate=1e+06,seed=0",)
    bad = res.summaries["learning_rate=1e+06,seed=0"]
    assert bad["stopped"] == "diverged" and "heldout_nll" not in bad
    good = res.summaries["learning_rate=0.0005,seed=0"]
    assert good["stopped"] == "done" and np.isfinite(good["heldout_nll"])


class _Interrupts(pl.trackers.Tracker):
    """Ctrl-C while the sweep logs a member's step `at` (once)."""

    at = 2

    def __init__(self, run_dir):
        del run_dir

    def start(self, run_name, config, group):
        pass

    def log(self, step, metrics, stage):
        if stage == "dpo" and step == type(self).at:
            type(self).at = None
            raise KeyboardInterrupt

    def summary(self, values):
        pass

    def finish(self):
        pass


def test_an_interrupted_sweep_checkpoints_its_last_completed_iteration(tmp_path, capsys):
    # interrupted while logging iteration 2, with a checkpoint every 3: the 2 iterations
    # completed are checkpointed, and the resumed sweep ends as the uninterrupted one
    pl.trackers.register_tracker("test-interrupts", _Interrupts)
    path = write_jsonl(tmp_path / "pairs.jsonl", pair_rows())
    cfg = pl.apply_overrides(data_config(path), ["dpo.steps=4", "ops.checkpoint_every=3"])
    out = str(tmp_path / "s")
    with pytest.raises(KeyboardInterrupt):
        pl.sweep(
            "dpo",
            dataclasses.replace(
                cfg, ops=dataclasses.replace(cfg.ops, trackers=("test-interrupts",))
            ),
            seeds=2,
            out=out,
        )
    assert "sweep dpo: checkpointed iteration 2" in capsys.readouterr().err
    assert os.listdir(os.path.join(out, "checkpoints")) == ["iter_00000002"]
    resumed = pl.sweep("dpo", cfg, seeds=2, out=out, resume=True)
    whole = pl.sweep("dpo", cfg, seeds=2, out=str(tmp_path / "whole"))
    a = jax.tree.leaves(eqx.filter(whole.states, eqx.is_array))
    b = jax.tree.leaves(eqx.filter(resumed.states, eqx.is_array))
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))
    for mem in whole.members:
        ours = step_records(os.path.join(out, "members", mem.name))
        theirs = step_records(os.path.join(whole.out, "members", mem.name))
        assert [(r["step"], r["loss"]) for r in ours] == [(r["step"], r["loss"]) for r in theirs]
