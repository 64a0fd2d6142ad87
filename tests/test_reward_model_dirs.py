"""`<stage>.reward_model=DIR` as users give it: the exported model's directory, or the
directory of the run that trained it (`rlhf_eqx reward --out RUN`), which stands for
the one model it exported; a run with none or several is refused naming them."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlhf_eqx as rx
from rlhf_eqx import pipelines as pl


@pytest.fixture(scope="module")
def builtin():
    return pl.tools.load_model("builtin")


def _run_dir(path) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "summary.json"), "w") as f:
        f.write('{"stopped": "done"}')
    with open(os.path.join(path, "config.json"), "w") as f:  # the run's configuration
        f.write('{"stages": ["reward"]}')
    return str(path)


def test_a_run_directory_stands_for_its_exported_reward_model(builtin, tmp_path):
    policy, tok = builtin
    rm = rx.RewardModel.from_policy(policy, key=jax.random.key(0))
    run = _run_dir(tmp_path / "run")
    pl.runs.export_reward_model(rm, run)
    tokens = jnp.asarray([[tok.bos_id, *tok.encode("Once upon a time a dog")]])
    mask = jnp.ones(tokens.shape, bool)
    by_run = pl.runs.load_reward_source(run, tok)
    by_dir = pl.runs.load_reward_source(os.path.join(run, "reward", "hf"), tok)
    assert isinstance(by_run, pl.runs.ModelReward)
    np.testing.assert_array_equal(by_run.scores(tokens, mask)[0], by_dir.scores(tokens, mask)[0])
    # a PRM run: the PRM, which a stage with reward_source=reward_model refuses by kind
    prm_run = _run_dir(tmp_path / "prm_run")
    prm = rx.ValueModel.from_policy(policy, key=jax.random.key(1))
    pl.runs.export_prm(prm, prm_run, separator="\n", aggregation="min")
    assert isinstance(pl.runs.load_reward_source(prm_run, tok), pl.runs.ProcessReward)
    with pytest.raises(ValueError, match="holds a process reward model"):
        pl.runs.stage_reward_source(
            pl.GRPOConfig(reward_source="reward_model", reward_model=prm_run),
            task=[],
            tokenizer=tok,
            judge=pl.JudgeConfig(),
            judges={},
        )


def test_a_run_directory_without_one_reward_model_is_refused_naming_them(builtin, tmp_path):
    policy, tok = builtin
    empty = _run_dir(tmp_path / "grpo_run")
    with pytest.raises(ValueError, match="a run directory without an exported reward model"):
        pl.runs.load_reward_source(empty, tok)
    stopped = tmp_path / "stopped"  # a run that stopped before its summary: its metrics
    stopped.mkdir()
    (stopped / "config.json").write_text('{"stages": ["reward"]}')
    (stopped / "metrics.jsonl").write_text('{"stage": "reward", "step": 0, "loss": 1.0}\n')
    with pytest.raises(ValueError, match="a run directory without an exported reward model"):
        pl.runs.load_reward_source(str(stopped), tok)
    both = _run_dir(tmp_path / "both")
    pl.runs.export_reward_model(rx.RewardModel.from_policy(policy, key=jax.random.key(0)), both)
    prm = rx.ValueModel.from_policy(policy, key=jax.random.key(1))
    pl.runs.export_prm(prm, both, separator="\n", aggregation="min")
    hf, prm_hf = os.path.join(both, "reward", "hf"), os.path.join(both, "prm", "hf")
    with pytest.raises(
        ValueError, match=re.escape(f"several exported models; choose one: {hf}, {prm_hf}")
    ):
        pl.runs.load_reward_source(both, tok)
