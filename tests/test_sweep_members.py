"""Sweeps (`pipelines.sweep`): each member's name and directory, and the grid's field
order a resume must keep — checked without training (a data file whose one record is
refused stops the sweep after it took its directory and opened its members' trackers)."""

import pytest

from rlhf_eqx import pipelines as pl


class _Names(pl.trackers.Tracker):
    started: list[str] = []

    def __init__(self, run_dir):
        self.run_dir = run_dir

    def start(self, run_name, config, group):
        _Names.started.append(run_name)

    def log(self, step, metrics, stage):
        pass

    def summary(self, values):
        pass

    def finish(self):
        pass


def _stopped_sweep(tmp_path, grid, *, resume=False, trackers=()):
    """`sweep("dpo", ...)` on a file whose one record is refused, into an existing
    directory (kept, with its `sweep.json`, when the record stops the sweep)."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "Once"}\n')
    (tmp_path / "s").mkdir(exist_ok=True)
    sets = [f"data.path={bad}", "ops.quiet=true"]
    sets += [f"ops.trackers={','.join(trackers)}"] if trackers else []
    cfg = pl.apply_overrides(pl.animal_task_config(), sets)
    pl.sweep("dpo", cfg, seeds=1, grid=grid, out=str(tmp_path / "s"), resume=resume)


def test_whole_number_grid_values_name_distinct_members(tmp_path):
    # `%g` names 1234567 and 1234568 alike: two members would share one directory
    pl.trackers.register_tracker("member_names", _Names)
    _Names.started.clear()
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        grid = {"dpo.beta": [1234567.0, 1234568.0, 1e6, 2.0]}
        _stopped_sweep(tmp_path, grid, trackers=["member_names"])
    assert [n.split("/", 1)[1] for n in _Names.started] == [
        "beta=1234567.0,seed=0",
        "beta=1234568.0,seed=0",
        "beta=1e+06,seed=0",
        "beta=2,seed=0",
    ]


def test_a_resume_with_the_grids_fields_in_another_order_is_refused_naming_them(tmp_path):
    # the members' names and their places on the stacked axis follow the fields' order
    grid = {"dpo.beta": [0.1, 0.2], "dpo.optim.learning_rate": [1e-3, 2e-3]}
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        _stopped_sweep(tmp_path, grid)
    assert (tmp_path / "s" / "sweep.json").is_file()
    swapped = dict(reversed(list(grid.items())))
    with pytest.raises(pl.loop.RunDirError) as e:
        _stopped_sweep(tmp_path, swapped, resume=True)
    assert "the grid's fields in another order (dpo.beta, dpo.optim.learning_rate -> " in str(
        e.value
    )
    with pytest.raises(ValueError, match="bad.jsonl:1"):  # the stored order resumes
        _stopped_sweep(tmp_path, grid, resume=True)
