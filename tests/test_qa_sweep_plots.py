"""A sweep's plots name its diverged members: a grid point whose every seed diverged has
no line (its members are left out of the means) but is in each plot's legend, marked
diverged, rather than missing from the plot as if it had not been swept."""

import os

import pytest

from rlhf_eqx import pipelines as pl

TINY = ["sft.steps=2", "kto.steps=3", "eval_samples=2", "ops.quiet=true", "ops.monitor=false"]


@pytest.mark.slow  # about 40 s on an idle 2-core machine, more when it is shared
def test_a_point_whose_members_diverged_is_named_in_each_plots_legend(tmp_path, monkeypatch):
    import matplotlib.axes

    labels: list[str] = []
    plot = matplotlib.axes.Axes.plot

    def recording(self, *args, **kwargs):
        labels.append(kwargs.get("label"))
        return plot(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", recording)
    cfg = pl.apply_overrides(pl.animal_task_config(), TINY)
    grid = {"kto.optim.learning_rate": [5e-4, 1e6]}
    res = pl.sweep("kto", cfg, seeds=1, grid=grid, out=str(tmp_path / "s"))
    assert res.diverged == ("learning_rate=1e+06,seed=0",)
    plots = os.listdir(os.path.join(res.out, "plots"))
    assert "loss.png" in plots
    assert labels.count("learning_rate=0.0005") == len(plots)
    assert labels.count("learning_rate=1e+06 (1 of 1 diverged, left out)") == len(plots)
