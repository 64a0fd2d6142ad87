"""Uncertainty of the held-out evaluations (standard errors over prompts, binomial for
pairs) and runs over several seeds (`run_seeds`, `--seeds N`): the aggregation maths on
hand-made values, and a multi-seed run of two tiny seeded runs whose summary is made of
the per-seed summaries."""

import dataclasses
import json
import math
import os

import jaxtyping
import numpy as np
import pytest

from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main

# --- standard errors --------------------------------------------------------------------


def test_prompt_se_is_the_std_of_per_prompt_rates_over_root_prompts():
    # 4 prompts x 3 samples: per-prompt rates 1, 1/3, 2/3, 0
    outcomes = np.array([1, 1, 1, 0, 1, 0, 1, 1, 0, 0, 0, 0], np.float32)
    rates = np.array([1.0, 1 / 3, 2 / 3, 0.0])
    mean = rates.mean()
    expected = math.sqrt(((rates - mean) ** 2).sum() / 3) / math.sqrt(4)
    assert pl.runs.prompt_se(outcomes, 3) == pytest.approx(expected, rel=1e-12)
    assert pl.runs.prompt_se(outcomes, 3) == pytest.approx(0.2151657414559676, rel=1e-12)
    # one sample per prompt: the usual s / sqrt(N)
    x = [0.2, 0.9, 0.4, 0.4, 1.0]
    assert pl.runs.prompt_se(x, 1) == pytest.approx(np.std(x, ddof=1) / math.sqrt(5), rel=1e-12)


def test_prompt_se_is_zero_when_every_prompt_has_the_same_rate():
    # samples disagree within each prompt, but every prompt's rate is 1/2
    assert pl.runs.prompt_se([1, 0, 0, 1, 1, 0], 2) == 0.0
    assert pl.runs.prompt_se(np.ones(24 * 8), 8) == 0.0


def test_prompt_se_refuses_outcomes_that_do_not_split_into_groups():
    with pytest.raises(ValueError, match=r"prompt_se: outcomes of shape \(7,\)"):
        pl.runs.prompt_se(np.zeros(7), 2)
    assert math.isnan(pl.runs.prompt_se([1.0, 0.0], 2))  # one prompt: no spread to measure


def test_binomial_se():
    assert pl.runs.binomial_se(0.9, 100) == pytest.approx(0.03, rel=1e-12)
    assert pl.runs.binomial_se(169 / 180, 180) == pytest.approx(
        math.sqrt(169 / 180 * 11 / 180 / 180), rel=1e-12
    )
    assert pl.runs.binomial_se(1.0, 50) == 0.0
    assert math.isnan(pl.runs.binomial_se(0.5, 0))


def test_win_rate_se_counts_ties_as_half_per_prompt():
    a = np.array([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    b = np.array([0.0, 0.0, 1.0, 0.0, 1.0, 1.0])
    # outcomes 1, 1/2 | 1/2, 1 | 0, 0: per-prompt wins 3/4, 3/4, 0
    wins = np.array([0.75, 0.75, 0.0])
    assert pl.runs.win_rate(a, b) == pytest.approx(wins.mean())
    assert pl.runs.win_rate_se(a, b, 2) == pytest.approx(np.std(wins, ddof=1) / math.sqrt(3))
    # the shape check names `baseline` (or, with the checks off, the function's own error)
    with pytest.raises((ValueError, jaxtyping.TypeCheckError), match="baseline|paired"):
        pl.runs.win_rate_se(a, b[:4], 2)


def test_format_table_prints_each_rate_with_its_standard_error():
    summary = {
        "base": {"score": 0.172, "score_se": 0.031, "base_nll": 1.49},
        "ppo": {
            "score": 0.906,
            "score_se": 0.021,
            "win_rate_vs_sft": 0.839,
            "win_rate_vs_sft_se": 0.0349,
            "kl": 0.329,
            "base_nll": 1.72,
        },
        "reward_model": {"heldout_accuracy": 0.939, "heldout_accuracy_se": 0.0178},
    }
    table = pl.tools.format_table(summary)
    assert "90.6% ± 2.1" in table and "83.9% ± 3.5" in table and "17.2% ± 3.1" in table
    assert "reward model held-out accuracy: 93.9% ± 1.8" in table
    # a stage name longer than the column widens it: every row's columns still align
    summary["online-dpo"] = dict(summary.pop("ppo"))
    rows = pl.tools.format_table(summary).splitlines()[:3]
    assert rows[0].startswith("stage" + " " * 6 + " " * 8 + "score")
    assert len({len(r) for r in rows}) == 1 and rows[2].startswith("online-dpo ")
    # a multi-turn stage's own held-out episodes are shown beside the task's score
    summary["multiturn"] = {
        **summary["online-dpo"],
        "multiturn_success": 1.6875,
        "multiturn_success_se": 0.125,
        "multiturn_success_sft": 1.25,
        "multiturn_success_sft_se": float("nan"),
    }
    line = pl.tools.format_table(summary).splitlines()[-2]
    assert line == (
        "multiturn held-out episodes (success or mean episode reward): 1.25 (SFT) -> "
        "1.688 ± 0.125; the score above is the task's own"
    )


# --- aggregation over seeds ---------------------------------------------------------------


def test_summarize_seeds_on_hand_made_summaries():
    summaries = {
        0: {"stopped": "done", "ppo": {"score": 0.9, "kl": 0.3, "stopped": "done"}, "seconds": 10},
        1: {"stopped": "done", "ppo": {"score": 0.8, "kl": 0.5, "stopped": "done"}, "seconds": 12},
        2: {"stopped": "diverged", "ppo": {"score": 0.4, "flag": True}, "seconds": 11},
    }
    out = pl.tools.summarize_seeds(summaries)
    assert out["seeds"] == [0, 1, 2]
    assert out["stopped"] == {"0": "done", "1": "done", "2": "diverged"}
    score = out["metrics"]["ppo.score"]
    assert score["values"] == [0.9, 0.8, 0.4] and score["seeds"] == [0, 1, 2]
    assert score["mean"] == pytest.approx(0.7)
    # sample std: sqrt(((0.2)^2 + (0.1)^2 + (0.3)^2) / 2)
    assert score["std"] == pytest.approx(math.sqrt(0.14 / 2))
    assert (score["min"], score["max"]) == (0.4, 0.9)
    kl = out["metrics"]["ppo.kl"]  # seed 2 does not report it
    assert kl["seeds"] == [0, 1] and kl["mean"] == pytest.approx(0.4)
    assert kl["std"] == pytest.approx(math.sqrt(0.02))
    assert out["metrics"]["seconds"]["values"] == [10.0, 12.0, 11.0]
    assert "ppo.flag" not in out["metrics"] and "ppo.stopped" not in out["metrics"]
    one = pl.tools.summarize_seeds({5: summaries[0]})["metrics"]["ppo.score"]
    assert one == {"seeds": [5], "values": [0.9], "mean": 0.9, "std": None, "min": 0.9, "max": 0.9}


def test_seeds_table_shows_mean_std_and_range():
    summaries = {
        s: {"sft": {"score": v, "score_se": 0.02, "base_nll": 1.5}, "reward_model": r}
        for s, v, r in (
            (0, 0.25, {"heldout_accuracy": 0.9, "heldout_accuracy_se": 0.02}),
            (1, 0.20, {"heldout_accuracy": 0.8, "heldout_accuracy_se": 0.03}),
        )
    }
    table = pl.tools.format_seeds_table(pl.tools.summarize_seeds(summaries))
    assert "| sft | 22.5% ± 3.5 (20.0–25.0) |" in table
    assert "reward_model.heldout_accuracy: 85.0% ± 7.1 (80.0–90.0)" in table


def test_seeds_table_of_a_data_file_stage_lists_its_held_out_numbers():
    # a stage on a data file has no score: its own numbers, not an empty table
    summaries = {
        s: {
            "data": "pairs.jsonl",
            "truncation": {"records": 42},
            "dpo": {"heldout_reward_accuracy": a, "heldout_reward_accuracy_se": 0.1, "n": 6},
            "sft": {"heldout_nll": nll, "sampled": {"kl_after": 0.01}, "stopped": "done"},
        }
        for s, a, nll in ((0, 0.5, 2.5), (1, 1.0, 2.7))
    }
    table = pl.tools.format_seeds_table(pl.tools.summarize_seeds(summaries))
    assert table.splitlines()[2:] == [
        "dpo.heldout_reward_accuracy: 75.0% ± 35.4 (50.0–100.0)",
        "dpo.n: 6.000 ± 0.000 (6.000–6.000)",
        "sft.heldout_nll: 2.600 ± 0.141 (2.500–2.700)",
    ]
    assert "| stage |" not in table


@pytest.mark.parametrize("bad", [0, -2, True, 1.5, "3"])
def test_seeds_must_be_a_positive_int(bad):
    with pytest.raises(pl.ConfigError, match=f"seeds={bad!r}: must be an int >= 1"):
        pl.tools.check_seeds(bad)


def test_cli_refuses_zero_seeds(tmp_path, capsys):
    assert main(["--seeds", "0", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "seeds=0: must be an int >= 1" in err[0]
    assert not (tmp_path / "run").exists()


# --- a multi-seed run -----------------------------------------------------------------------


def _tiny(out):
    """The smallest pipeline: SFT alone, 2 steps, 1 held-out sample per prompt."""
    cfg = pl.animal_task_config()
    return dataclasses.replace(
        cfg,
        out=str(out),
        stages=("sft",),
        eval_samples=1,
        sft=dataclasses.replace(cfg.sft, steps=2),
        sampling=dataclasses.replace(cfg.sampling, max_new_tokens=8),
        ops=dataclasses.replace(cfg.ops, quiet=True, monitor=False),
    )


def _read(path):
    with open(path) as f:
        return json.load(f)


@pytest.mark.slow
def test_run_seeds_summary_is_made_of_the_per_seed_summaries_and_resume_skips_finished(
    tmp_path, capsys
):
    out = tmp_path / "seeds"
    cfg = _tiny(out)
    # an interrupted two-seed run: only seed 0 finished
    pl.tools.run_seeds(cfg, 1)
    seed0 = out / "seed-0"
    first = _read(seed0 / "summary.json")
    metrics_mtime = os.path.getmtime(seed0 / "metrics.jsonl")
    with pytest.raises(pl.loop.RunDirError, match="already holds a run"):
        pl.tools.run_seeds(cfg, 2)  # a new run into the old one is refused
    capsys.readouterr()
    result = pl.tools.run_seeds(cfg, 2, resume=True)
    assert "seed 0: finished" in capsys.readouterr().err
    assert os.path.getmtime(seed0 / "metrics.jsonl") == metrics_mtime  # not rerun
    per_seed = {s: _read(out / f"seed-{s}" / "summary.json") for s in (0, 1)}
    assert per_seed[0] == first
    assert _read(out / "seed-1" / "config.json")["ops"]["seed"] == 1
    assert _read(out / "seeds_summary.json") == json.loads(
        json.dumps(pl.tools.summarize_seeds(per_seed))
    )
    assert result == pl.tools.summarize_seeds(per_seed)
    for path in ("base.score", "sft.score", "sft.score_se", "sft.kl", "sft.base_nll"):
        m = result["metrics"][path]
        stage, key = path.split(".")
        assert m["values"] == [per_seed[0][stage][key], per_seed[1][stage][key]]
        assert m["mean"] == pytest.approx(np.mean(m["values"]))
        assert m["std"] == pytest.approx(np.std(m["values"], ddof=1))
    # the two seeds sampled different held-out stories
    assert per_seed[0]["sft"] != per_seed[1]["sft"]
    assert 0 < per_seed[0]["sft"]["score_se"] < 0.2
