"""GRPO sweeps on a data file of prompts with reference answers (`rlhf_eqx sweep grpo
--data FILE`): every member of a 2 β × 2 seeds sweep equals its separate run
(`run_on_data` with that seed and β: the same per-step metrics, exported weights and
held-out exact-match numbers), scored by a reward model the test writes (the stories
model writes no digits, so the exact match alone would give equal rewards and zero
updates); a sweep resumed after a stop ends bit-identical to the uninterrupted one; the
settings a GRPO sweep does not run are refused, naming the field, before anything runs."""

import dataclasses
import json
import os
import shutil

import equinox as eqx
import jax
import numpy as np
import pytest
from test_sweep_data import ANIMALS, SMALL, write_jsonl
from test_sweep_runs import assert_same_run, step_records, weights

import rlhf_eqx as rx
from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main

SETS = [
    *SMALL,  # the data sweeps' small settings (prompt and completion lengths, ops)
    "sampling.max_new_tokens=8",
    "eval_samples=1",  # GRPO completes every held-out prompt (it reads no data.eval_prompts)
    "grpo.rollouts=3",
    "grpo.prompts_per_rollout=2",
    "grpo.group_size=4",
    "grpo.reward_source=reward_model",
]
GRID = {"grpo.beta": [0.02, 0.2]}
HELD = (
    "heldout_exact_match",
    "heldout_exact_match_se",
    "heldout_exact_match_before",
    "heldout_exact_match_before_se",
)


def question_rows(n: int = 16) -> list[dict]:
    """GSM8K-style rows: a question and its `#### <int>` answer."""
    return [
        {"question": f"Once upon a time {i}, the {ANIMALS[i % 8]}", "answer": f"{i}\n#### {i}"}
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The questions file and a reward model on the stories model's backbone with a
    fresh head (its scores differ between completions)."""
    root = tmp_path_factory.mktemp("files")
    policy, _ = pl.tools.load_model("builtin")
    reward_dir = str(root / "reward")
    rx.save_hf(rx.RewardModel.from_policy(policy, key=jax.random.key(7)), reward_dir)
    return write_jsonl(root / "questions.jsonl", question_rows()), reward_dir


def grpo_config(files):
    path, reward_dir = files
    sets = [*SETS, f"grpo.reward_model={reward_dir}", f"data.path={path}"]
    return pl.apply_overrides(pl.animal_task_config(), sets)


@pytest.fixture(scope="module")
def swept(files, tmp_path_factory):
    """The sweep of 2 seeds × 2 β, its policies exported."""
    out = str(tmp_path_factory.mktemp("sweep") / "s")
    return pl.sweep("grpo", grpo_config(files), seeds=2, grid=GRID, out=out, export=True)


@pytest.mark.slow
def test_grpo_data_sweep_members_equal_their_runs_on_the_file(swept, tmp_path):
    assert len(swept.members) == 4 and swept.diverged == ()
    assert not os.path.isdir(os.path.join(swept.out, "seeds"))  # no built-in task stages
    for mem in swept.members:
        ours = os.path.join(swept.out, "members", mem.name)
        recs = step_records(ours, "grpo")
        assert [r["iteration"] for r in recs] == [0, 1, 2]
        # the reward model's scores differ within the groups: the updates are not zero
        assert all(r["rollout/frac_reward_zero_std"] < 1.0 for r in recs)
        run_dir = str(tmp_path / mem.name)
        summary = pl.run_on_data(dataclasses.replace(mem.cfg, out=run_dir), "grpo")
        mine, theirs = swept.summaries[mem.name], summary["grpo"]
        assert mine["stopped"] == summary["stopped"] == "done"
        # per-step metrics and exported weights to 1e-5: the vmapped update sums in
        # another order than the separate run's (the weights differ by ~3e-7), while the
        # rollouts are the same tokens (equal scores)
        assert_same_run(ours, run_dir, "grpo")
        assert [r["rollout/score"] for r in recs] == [
            r["rollout/score"] for r in step_records(run_dir, "grpo")
        ]
        # the held-out exact match (the stories model writes no digits: 0 before and
        # after) and the trained policy's held-out samples
        for k in HELD:
            assert mine[k] == theirs[k], k
        assert mine["sampled"]["prompts"] == theirs["sampled"]["prompts"] > 0
        for k in ("base_nll_before", "base_nll_after", "kl_after"):
            assert mine["sampled"][k] == pytest.approx(theirs["sampled"][k], abs=1e-4), k
        assert mine["sampled"]["examples"] == theirs["sampled"]["examples"]


@pytest.mark.slow
def test_resumed_grpo_data_sweep_is_bit_identical_to_the_uninterrupted_one(
    swept, files, tmp_path, capsys
):
    # the sweep as if stopped after its first checkpoint (rollout 1 of 3), resumed from
    # the command line
    out = str(tmp_path / "s")
    shutil.copytree(swept.out, out)
    for name in os.listdir(os.path.join(out, "checkpoints")):
        if name != "iter_00000001":
            shutil.rmtree(os.path.join(out, "checkpoints", name))
    for name in os.listdir(os.path.join(out, "members")):
        shutil.rmtree(os.path.join(out, "members", name, "grpo"))
        os.remove(os.path.join(out, "members", name, "summary.json"))
    small = tmp_path / "small.json"  # a file sets every section, as the swept run did
    small.write_text(json.dumps(pl.config.config_to_dict(grpo_config(files))))
    argv = ["sweep", "grpo", "--config", str(small), "--seeds", "2"]
    argv += ["--grid", "grpo.beta=0.02,0.2", "--out", out, "--resume", "--export"]
    assert main(argv) == 0
    assert "4 members done" in capsys.readouterr().out
    last = pl.tools.latest_checkpoint(os.path.join(out, "checkpoints"))
    assert last.endswith("iter_00000003")
    tree, _ = pl.tools.restore_checkpoint(last, {"states": swept.states})
    a = jax.tree.leaves(eqx.filter(swept.states, eqx.is_array))
    b = jax.tree.leaves(eqx.filter(tree["states"], eqx.is_array))
    assert len(a) == len(b) > 0
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))
    for mem in swept.members:
        ours = os.path.join(out, "members", mem.name)
        theirs = os.path.join(swept.out, "members", mem.name)
        assert step_records(ours, "grpo") == step_records(theirs, "grpo")  # every number
        wa, wb = (
            weights(os.path.join(ours, "grpo", "hf")),
            weights(os.path.join(theirs, "grpo", "hf")),
        )
        assert wa.keys() == wb.keys() and all(np.array_equal(wa[k], wb[k]) for k in wa)
        with open(os.path.join(ours, "summary.json")) as f:
            resumed = json.load(f)
        for k in HELD:
            assert resumed[k] == swept.summaries[mem.name][k], k
        assert resumed["sampled"] == swept.summaries[mem.name]["sampled"]


@pytest.mark.parametrize(
    ("sets", "needle"),
    [
        (["grpo.staleness=1"], "grpo.staleness=1: a GRPO sweep runs synchronous rollouts"),
        (["grpo.placement=split"], "grpo.placement='split': a GRPO sweep"),
        (["grpo.sampler_device=0"], "grpo.sampler_device=0: a GRPO sweep"),
        (["grpo.dynamic_sampling=2"], "grpo.dynamic_sampling=2: a GRPO sweep"),
        (["grpo.rollout_correction.mode=truncate"], "grpo.rollout_correction=.*: a GRPO sweep"),
        ([], "grpo.reward_model='': grpo.reward_source=reward_model on a data file"),
    ],
)
def test_grpo_data_sweep_refuses_what_it_does_not_run_naming_the_field(sets, needle, tmp_path):
    path = write_jsonl(tmp_path / "questions.jsonl", question_rows(4))
    cfg = pl.apply_overrides(pl.animal_task_config(), [*SETS, f"data.path={path}", *sets])
    with pytest.raises(pl.ConfigError, match=needle):
        pl.sweep("grpo", cfg, seeds=1, grid=GRID, out=str(tmp_path / "s"))
    assert not (tmp_path / "s").exists()
