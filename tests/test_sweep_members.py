"""Sweeps (`pipelines.sweep`): each member's name and directory, and the grid's field
order a resume must keep — checked without training (a data file whose one record is
refused stops the sweep after it took its directory and opened its members' trackers)."""

import json
import os

import pytest

from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main


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


def _cli_stopped_sweep(tmp_path, capsys, settings: dict, *more: str) -> tuple[int, str]:
    """`rlhf_eqx sweep dpo --config FILE` of `settings` on the file whose one record is
    refused, resumed into `tmp_path / "s"`: the exit status and the error line."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "Once"}\n')
    conf = tmp_path / "conf.json"
    conf.write_text(json.dumps(settings))
    (tmp_path / "s").mkdir(exist_ok=True)
    argv = ["sweep", "dpo", "--data", str(bad), "--config", str(conf), "--seeds", "1"]
    argv += ["--grid", "dpo.beta=0.1,0.2", "--out", str(tmp_path / "s"), "--quiet", *more]
    code = main(argv)
    (line,) = capsys.readouterr().err.strip().splitlines()
    return code, line


def test_a_resume_compares_only_the_sections_the_swept_stage_reads(tmp_path, capsys):
    code, line = _cli_stopped_sweep(tmp_path, capsys, {"kto": {"batch_size": 4}})
    assert code == 1 and "bad.jsonl:1" in line  # stopped after it took the directory
    # another stage's section (and, on a data file, `stages`) is not read: it resumes
    other = {"kto": {"batch_size": 8}, "sft": {"steps": 7}, "stages": ["sft", "kto"]}
    code, line = _cli_stopped_sweep(tmp_path, capsys, other, "--resume")
    assert code == 1 and "bad.jsonl:1" in line, line
    # what the sweep reads is still compared, naming the field (not the unread ones)
    code, line = _cli_stopped_sweep(tmp_path, capsys, {**other, "dpo": {"steps": 3}}, "--resume")
    assert code == 2 and "the resumed sweep differs from the stored one (dpo.steps: " in line
    assert "kto" not in line and "sft.steps" not in line, line


def test_a_resume_of_the_built_in_task_compares_the_prerequisites_sections(tmp_path):
    # a sweep of dpo on the built-in task runs SFT first: its settings are read, KTO's
    # are not (a stored spec as the sweep writes it, with both changed)
    out = str(tmp_path / "s")
    os.makedirs(out)
    cfg = pl.animal_task_config()
    spec = {"stage": "dpo", "grid": {}, "seeds": 1, **pl.config.config_to_dict(cfg)}
    del spec["out"]
    spec["stages"] = ["sft", "dpo"]
    spec["sft"]["steps"] += 1
    spec["kto"]["batch_size"] += 1
    with open(os.path.join(out, "sweep.json"), "w") as f:
        json.dump(spec, f)
    with pytest.raises(pl.loop.RunDirError) as e:
        pl.sweep("dpo", cfg, seeds=1, out=out, resume=True)
    assert "differs from the stored one (sft.steps: " in str(e.value)
    assert "kto" not in str(e.value)


def test_a_resume_takes_the_data_file_moved_with_the_same_bytes_and_refuses_other_bytes(
    tmp_path, capsys
):
    code, line = _cli_stopped_sweep(tmp_path, capsys, {})
    assert code == 1 and "bad.jsonl:1" in line
    moved = tmp_path / "moved.jsonl"
    os.replace(tmp_path / "bad.jsonl", moved)
    argv = ["sweep", "dpo", "--data", str(moved), "--seeds", "1", "--grid", "dpo.beta=0.1,0.2"]
    argv += ["--out", str(tmp_path / "s"), "--quiet", "--resume"]
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and "moved.jsonl:1" in err[-1], err  # resumed: the reader's refusal
    assert any("data.path: the data file moved" in e and "contents are the same" in e for e in err)
    moved.write_text('{"prompt": "Twice"}\n')  # other bytes at the new path
    code = main(argv)
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "the data file at the new path differs" in line, line


def test_a_resume_of_a_sweep_whose_spec_holds_a_setting_since_removed_names_it_once(
    tmp_path, capsys
):
    code, line = _cli_stopped_sweep(tmp_path, capsys, {})
    assert code == 1
    path = tmp_path / "s" / "sweep.json"
    spec = json.loads(path.read_text())
    spec["dpo"]["retired_setting"] = 3  # as a spec written by an older version
    path.write_text(json.dumps(spec))
    argv = ["sweep", "dpo", "--data", str(tmp_path / "bad.jsonl"), "--seeds", "1", "--quiet"]
    argv += ["--grid", "dpo.beta=0.1,0.2", "--out", str(tmp_path / "s"), "--resume"]
    code = main(argv)
    note, line = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and "bad.jsonl:1" in line, line  # resumed
    assert "sweep.json: dpo.retired_setting: no longer used" in note, note
