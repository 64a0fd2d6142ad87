"""Sweeps of the `multiturn` stage with the user's own environment (`multiturn.environment=
MODULE:NAME`): every member, its episodes rolled out for all members in one compiled
program, equals its separate run (`run_pipeline` of `sft,multiturn` with that seed, β and
environment: the same per-step metrics, exported weights and held-out numbers)."""

import dataclasses
import json
import os
import textwrap

import pytest
from test_sweep_runs import assert_same_run

from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main

pytestmark = pytest.mark.slow

ENV_MODULE = textwrap.dedent(
    '''
    """Asks "And then?" after each turn; a turn's reward is its number of even token ids."""

    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import rlhf_eqx as rx


    class EvenIds(rx.envs.Environment):
        question: jax.Array
        max_observation_tokens: int = eqx.field(static=True)

        def reset(self, key, prompt, prompt_mask):
            return jnp.zeros((), jnp.int32), 0 * self.question, self.question < 0

        def step(self, turns, completion, completion_mask):
            even = jnp.sum(completion_mask & (completion % 2 == 0)).astype(jnp.float32)
            return turns + 1, self.question, self.question >= 0, even, turns + 1 >= 2


    def make(tok):
        question = jnp.asarray(tok.encode("And then?"), jnp.int32)
        return EvenIds(question, max_observation_tokens=int(question.shape[0]))
    '''
)

SETS = [
    "sft.steps=2",
    "eval_samples=1",
    "ops.quiet=true",
    "ops.monitor=false",
    "multiturn.rollouts=2",
    "multiturn.prompts_per_rollout=2",
    "multiturn.group_size=2",
    "multiturn.turn_tokens=6",
    "multiturn.environment=sweep_env_module:make",
    "sampling.temperature=0.7",  # the reference at the episodes' temperature, as in a run
]
COMPARED = (
    "multiturn_success",
    "multiturn_success_sft",
    "multiturn_base_nll",
    "multiturn_win_rate_vs_sft",
)


def test_multiturn_sweep_with_a_user_environment_equals_its_separate_runs(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "sweep_env_module.py").write_text(ENV_MODULE)
    out = str(tmp_path / "s")
    argv = ["sweep", "multiturn", "--seeds", "2", "--grid", "multiturn.beta=0.02,0.1"]
    argv += ["--out", out, "--export", *(a for s in SETS for a in ("--set", s))]
    assert main(argv) == 0
    assert "4 members done" in capsys.readouterr().out
    cfg = pl.apply_overrides(pl.animal_task_config(), SETS)
    res = pl.sweep(
        "multiturn", cfg, seeds=2, grid={"multiturn.beta": [0.02, 0.1]}, out=out, resume=True
    )
    assert len(res.members) == 4 and res.diverged == ()
    for mem in res.members[1:3]:  # one of each grid point, both seeds
        run_dir = str(tmp_path / mem.name)
        summary = pl.run_pipeline(dataclasses.replace(mem.cfg, out=run_dir))
        ours = os.path.join(out, "members", mem.name)
        assert_same_run(ours, run_dir, "multiturn")
        with open(os.path.join(ours, "metrics.jsonl")) as f:
            recs = [json.loads(line) for line in f]
        assert any("rollout/turns" in r for r in recs)
        for k in COMPARED:
            assert res.summaries[mem.name][k] == pytest.approx(summary["multiturn"][k], abs=1e-4), k


def test_an_observation_outside_the_vocabulary_stops_the_sweep_naming_it(tmp_path, monkeypatch):
    """The members' rollout runs inside `vmap`, where the rollout cannot check its values:
    the sweep checks each member's episodes (`rlhf_eqx.envs.check_trajectory`)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    foreign = "def make_foreign(tok):\n    return EvenIds(jnp.asarray([600, 601]), 2)\n\n\n"
    source = ENV_MODULE.replace("def make(tok):", foreign + "def make(tok):")
    (tmp_path / "foreign_env_module.py").write_text(source)
    sets = [s.replace("sweep_env_module:make", "foreign_env_module:make_foreign") for s in SETS]
    cfg = pl.apply_overrides(pl.animal_task_config(), sets)
    with pytest.raises(ValueError, match=r"EvenIds returned the observation id 600 \(episode"):
        pl.sweep("multiturn", cfg, seeds=1, out=str(tmp_path / "s"))
