"""An interrupt (Ctrl-C, SIGTERM: a `KeyboardInterrupt`) before anything ran undoes
the start as a failure does: `--overwrite` puts the previous run back, untouched, and a
new run leaves no directory; once a step record is written the run is kept."""

import json

import pytest

from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main

TRACKER = "test-interrupt-at-start"


class _InterruptAtStart(pl.trackers.Tracker):
    """Ctrl-C as the run's trackers start: after the run directory is taken, before any
    step."""

    def __init__(self, run_dir):
        del run_dir

    def start(self, run_name, config, group):
        raise KeyboardInterrupt

    def log(self, step, metrics, stage):
        pass

    def summary(self, values):
        pass

    def finish(self):
        pass


@pytest.fixture(autouse=True)
def _tracker():
    pl.trackers.register_tracker(TRACKER, _InterruptAtStart)


def _snapshot(root) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _finished_run(run) -> None:
    cfg = pl.apply_overrides(pl.PipelineConfig(), [f"out={run}"])
    with pl.tools.open_run_dir(cfg, str(run)):
        steps = [{"stage": "dpo", "iteration": i, "step": i, "loss": 0.69} for i in range(3)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
        (run / "summary.json").write_text('{"stopped": "done"}')


def _argv(tmp_path, run, *extra) -> list[str]:
    pairs = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"Say {i}.", "chosen": f" A cat {i}.", "rejected": " No."} for i in range(8)]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sets = ["--set", "ops.monitor=false", "--set", f"ops.trackers={TRACKER}"]
    return ["dpo", "--data", str(pairs), "--out", str(run), "--quiet", *sets, *extra]


def test_an_interrupted_overwrite_puts_the_previous_run_back(tmp_path, capsys):
    run = tmp_path / "run"
    _finished_run(run)
    before = _snapshot(run)
    assert main(_argv(tmp_path, run, "--overwrite")) == 130
    err = capsys.readouterr().err
    assert f"interrupted before anything ran: the previous run is back in {run}" in err
    assert "--overwrite again" in err
    argv = _argv(tmp_path, run, "--overwrite")
    again = "to start it again: rlhf_eqx " + " ".join(argv)
    assert "interrupted before anything ran (nothing to resume); " + again in err
    assert "--resume" not in err.replace("--resume would", "")
    assert _snapshot(run) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pairs.jsonl", "run"]


def test_an_interrupted_new_run_leaves_no_directory(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(_argv(tmp_path, run)) == 130
    err = capsys.readouterr().err
    assert "interrupted before anything ran (nothing to resume); to start it again:" in err
    assert "resume with" not in err
    assert not run.exists()


def test_an_interrupt_after_a_step_record_keeps_the_new_run(tmp_path, capsys):
    run = tmp_path / "run"
    _finished_run(run)
    cfg = pl.apply_overrides(pl.PipelineConfig(), [f"out={run}"])
    with pytest.raises(KeyboardInterrupt):
        with pl.tools.open_run_dir(cfg, str(run), overwrite=True):
            (run / "metrics.jsonl").write_text('{"stage": "sft", "iteration": 0, "step": 0}\n')
            raise KeyboardInterrupt
    assert (run / "metrics.jsonl").read_text().count("\n") == 1  # the new run's
    assert not (run / "summary.json").exists()
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert len(aside) == 1 and (aside[0] / "summary.json").exists()
    assert "previous run is back" not in capsys.readouterr().err
