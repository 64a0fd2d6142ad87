"""A sweep's summary per grid point is the mean over every seed that did not diverge, of
every number of their summaries: one that is NaN (the held-out KL to the base of an SFT
policy after a learning rate of 1e6, whose update is finite) makes the point's mean
NaN rather than being dropped from it (a mean of the other seeds alone, or no entry)."""

import math
import os

import numpy as np
import pytest

from rlhf_eqx import pipelines as pl

TINY = ["sft.steps=2", "eval_samples=2", "ops.quiet=true", "ops.monitor=false"]


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-12, abs=1e-12)


@pytest.mark.slow  # a whole run of a stage (8-15 s): in the slow suite
def test_a_non_finite_member_number_is_in_its_points_mean(tmp_path):
    cfg = pl.apply_overrides(pl.animal_task_config(), TINY)
    grid = {"sft.optim.learning_rate": [5e-4, 1e6]}
    res = pl.sweep("sft", cfg, seeds=1, grid=grid, out=str(tmp_path / "s"))
    assert res.diverged == ()  # the second step's update is finite: no divergence
    bad = res.summaries["learning_rate=1e+06,seed=0"]
    assert math.isnan(bad["kl"])  # the case this test is about
    for name, point in res.summary["points"].items():
        done = [res.summaries[n] for n in point["members"] if n not in point["diverged"]]
        keys = {k for s in done for k, v in s.items() if isinstance(v, float)}
        for k in keys - {"seed"}:
            if k.endswith("_se"):
                continue
            values = [s[k] for s in done if k in s]
            got = point["metrics"].get(k)
            assert got is not None, (name, k)
            assert got["n"] == len(values), (name, k)
            assert _same(got["mean"], float(np.mean(values))), (name, k, got)
    assert math.isnan(res.summary["points"]["learning_rate=1e+06"]["metrics"]["kl"]["mean"])
    # a sweep of SFT runs nothing before its members: no shared stages' seed directory
    assert not os.path.exists(os.path.join(res.out, "seeds"))
