"""A tracker of one's own whose run identity cannot be recorded (`identity()` raises,
returns what JSON cannot hold, or returns something other than a mapping): one line on
stderr, the run goes on, and the other trackers' runs are recorded and resumed."""

import json

import pytest

from rlhf_eqx import pipelines as pl

CALLS: list = []


class Good(pl.trackers.Tracker):
    def __init__(self, run_dir):
        del run_dir

    def start(self, run_name, config, group):
        CALLS.append(("start", type(self).__name__))

    def log(self, step, metrics, stage):
        CALLS.append(("log", type(self).__name__, stage, step))

    def summary(self, values):
        pass

    def finish(self):
        CALLS.append(("finish", type(self).__name__))

    def identity(self):
        return {"id": "good-1"}

    def resume(self, run_name, config, group, identity):
        CALLS.append(("resume", type(self).__name__, identity))


class Raises(Good):
    def identity(self):
        raise RuntimeError("no run id yet")


class NotJson(Good):
    def identity(self):
        return {"opened": object()}


class NotAMapping(Good):
    def identity(self):
        return "run-7"


BAD = {"qa_raises": Raises, "qa_notjson": NotJson, "qa_notmapping": NotAMapping}


@pytest.fixture(autouse=True)
def _registered():
    pl.trackers.register_tracker("qa_good", Good)
    for name, factory in BAD.items():
        pl.trackers.register_tracker(name, factory)
    CALLS.clear()


def _run(run_dir, *, resume):
    names = ["qa_good", *BAD]
    with pl.trackers.open_trackers(names, str(run_dir), {}, resume=resume) as trackers:
        assert trackers.names == tuple(names)
        pl.tools.MetricsLog(str(run_dir), "sft", quiet=True).write(
            {"iteration": 0, "step": 0, "loss": 1.0}
        )


def test_an_identity_that_cannot_be_recorded_is_one_line_and_the_run_goes_on(tmp_path, capsys):
    _run(tmp_path, resume=False)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3, err
    for name, line in zip(BAD, err):
        assert line.startswith(f"tracker {name}: could not record its run (")
    assert "identity() returned str, not a dict" in err[2]
    recorded = json.loads((tmp_path / "trackers.json").read_text())
    assert recorded == {"qa_good": {"id": "good-1"}} | {name: None for name in BAD}
    assert CALLS.count(("log", "Good", "sft", 0)) == 1 and len(CALLS) == 3 * 4

    # Resumed: the tracker with a recorded run reopens it; the others start new runs.
    CALLS.clear()
    _run(tmp_path, resume=True)
    assert ("resume", "Good", {"id": "good-1"}) in CALLS
    assert [c for c in CALLS if c[0] == "start"] == [
        ("start", "Raises"),
        ("start", "NotJson"),
        ("start", "NotAMapping"),
    ]
