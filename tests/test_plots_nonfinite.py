"""A plot never drops a NaN or infinite step silently: a sweep's plots (drawn again by
`plot_run`, the `plot` command) mark the steps where a member's metric is not finite,
name the member and those steps in the legend and in a printed line, and leave those
steps out of the point's mean visibly; a single run's plot marks them too."""

import json
import math
import os

import pytest

from rlhf_eqx import pipelines as pl

pytest.importorskip("matplotlib")


@pytest.fixture
def labels(monkeypatch):
    """The labels of every line drawn (the legend's entries)."""
    import matplotlib.axes

    seen: list[str] = []
    plot = matplotlib.axes.Axes.plot

    def recording(self, *args, **kwargs):
        seen.append(kwargs.get("label"))
        return plot(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", recording)
    return seen


def _member(out, name, losses, *, bare=False):
    """A member's directory: step records of `losses` (`bare`: written with Python's
    bare NaN token, as an older version did) and its summary."""
    d = os.path.join(out, "members", name)
    os.makedirs(d)
    records = [
        {"stage": "dpo", "iteration": s, "step": s, "loss": v, "rewards/margins": 0.1 * s}
        for s, v in enumerate(losses)
    ]
    if bare:
        with open(os.path.join(d, "metrics.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    else:
        log = pl.tools.MetricsLog(d, "dpo", quiet=True)
        for r in records:
            log.write({k: v for k, v in r.items() if k != "stage"})
    with open(os.path.join(d, "summary.json"), "w") as f:
        json.dump({"name": name, "stopped": "done"}, f)


def _sweep(tmp_path, *, bare=False) -> str:
    out = str(tmp_path / "sweep")
    os.makedirs(out)
    with open(os.path.join(out, "sweep.json"), "w") as f:
        json.dump({"stage": "dpo", "grid": {"dpo.beta": [0.1, 0.5]}, "seeds": 2}, f)
    _member(out, "beta=0.1,seed=0", [1.0, 0.9, 0.8, 0.7])
    _member(out, "beta=0.1,seed=1", [1.0, math.nan, math.inf, 0.6], bare=bare)
    _member(out, "beta=0.5,seed=0", [1.0, 0.8, 0.6, 0.4])
    _member(out, "beta=0.5,seed=1", [1.0, 0.7, 0.5, 0.3])
    points = {
        "beta=0.1": {"members": ["beta=0.1,seed=0", "beta=0.1,seed=1"], "diverged": []},
        "beta=0.5": {"members": ["beta=0.5,seed=0", "beta=0.5,seed=1"], "diverged": []},
    }
    with open(os.path.join(out, "sweep_summary.json"), "w") as f:
        json.dump({"points": points, "stage": "dpo", "diverged": []}, f)
    return out


@pytest.mark.parametrize("bare", [False, True])
def test_a_sweeps_plot_marks_and_names_a_member_whose_metric_is_not_finite(
    tmp_path, labels, capsys, bare
):
    out = _sweep(tmp_path, bare=bare)
    files = pl.tools.plot_run(out)
    assert sorted(map(os.path.basename, files)) == ["loss.png", "rewards_margins.png"]
    assert "beta=0.1,seed=1: not finite at steps 1-2, left out" in labels
    # only the loss plot marks it: the member's other metric is finite throughout
    assert labels.count("beta=0.1,seed=1: not finite at steps 1-2, left out") == 1
    assert labels.count("beta=0.1") == 2 and labels.count("beta=0.5") == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "not finite" in x]
    assert "beta=0.1,seed=1" in line and "loss (steps 1-2)" in line


def test_an_unfinished_sweep_is_refused_in_one_line(tmp_path):
    out = _sweep(tmp_path)
    os.remove(os.path.join(out, "sweep_summary.json"))
    with pytest.raises(ValueError, match="a sweep without its sweep_summary.json") as e:
        pl.tools.plot_run(out)
    assert "\n" not in str(e.value)


def test_a_runs_plot_marks_the_steps_whose_metric_is_not_finite(tmp_path, labels, capsys):
    run = str(tmp_path / "run")
    log = pl.tools.MetricsLog(run, "sft", quiet=True)
    for step, loss in enumerate([1.0, math.nan, 0.5, -math.inf, 0.25]):
        log.write({"iteration": step, "step": step, "loss": loss})
    (path,) = pl.tools.plot_run(run)
    assert "not finite: steps 1, 3" in labels
    err = capsys.readouterr().err
    assert f"note: {path}: not finite (NaN or infinite): loss (steps 1, 3)" in err
