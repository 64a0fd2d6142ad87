"""The final summary of a run that a callback stopped and that was resumed to its end:
the trackers' runs hold the resumed run's summary, without the stopped run's
`stop_reason` (MLflow's tags, W&B's run summary)."""

import glob
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from rlhf_eqx import pipelines as pl

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

STOPPED = {"stopped": "callback", "stop_reason": "held-out NLL not below 1.2", "dpo": {"x": 1.0}}
DONE = {"stopped": "done", "dpo": {"x": 2.0}}


def _need(module):
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")


def _offline(monkeypatch):
    for var in ("WANDB_MODE", "WANDB_BASE_URL", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")


_PART = """
import json, sys
from rlhf_eqx import pipelines as pl
run_dir, names, summary, resume = sys.argv[1], sys.argv[2].split(","), sys.argv[3], sys.argv[4]
with pl.trackers.open_trackers(names, run_dir, {}, resume=resume == "1", quiet=True) as t:
    pl.tools.MetricsLog(run_dir, "dpo", quiet=True).write({"iteration": 0, "step": 0, "loss": 1.0})
    t.summary(json.loads(summary))
    assert t.names == tuple(names), t.names
"""


def _part(run_dir, names, summary, *, resume):
    """One part of the run in a process of its own (W&B writes a finished run's
    transaction log out when its process ends)."""
    args = [run_dir, ",".join(names), json.dumps(summary), "1" if resume else "0"]
    out = subprocess.run(
        [sys.executable, "-c", _PART, *args], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "tracker " not in out.stderr, out.stderr[-2000:]


@pytest.mark.slow  # a whole run of a stage (8-15 s): in the slow suite
def test_mlflow_holds_the_resumed_runs_summary_without_the_stop_reason(tmp_path, monkeypatch):
    _need("mlflow")
    _offline(monkeypatch)
    run_dir = str(tmp_path / "run")
    _part(run_dir, ["mlflow"], STOPPED, resume=False)
    _part(run_dir, ["mlflow"], DONE, resume=True)
    from mlflow.tracking import MlflowClient

    with open(os.path.join(run_dir, "trackers.json")) as f:
        ids = json.load(f)["mlflow"]
    run = MlflowClient(tracking_uri=ids["tracking_uri"]).get_run(ids["run_id"])
    tags = {k: v for k, v in run.data.tags.items() if k.startswith("summary/")}
    assert tags == {"summary/stopped": "done"}
    assert run.data.metrics["summary/dpo/x"] == 2.0
    assert run.info.status == "FINISHED"


@pytest.mark.slow  # a whole run of a stage (8-15 s): in the slow suite
def test_wandb_holds_the_resumed_runs_summary_without_the_stop_reason(tmp_path, monkeypatch):
    _need("wandb")
    _offline(monkeypatch)
    run_dir = str(tmp_path / "run")
    _part(run_dir, ["wandb"], STOPPED, resume=False)
    _part(run_dir, ["wandb"], DONE, resume=True)
    # The parts' summary records, oldest first, applied as `wandb sync --append` does.
    held: dict = {}
    parts = sorted(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb")))
    assert len(parts) == 2
    for path in parts:
        for record in pl.trackers.wandb_records(path):
            if record.WhichOneof("record_type") == "summary":
                for item in record.summary.update:
                    held[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
                for item in record.summary.remove:
                    held.pop(item.key or "/".join(item.nested_key), None)
    summary = {k: v for k, v in held.items() if k.startswith("summary/")}
    assert summary == {"summary/stopped": "done", "summary/dpo/x": 2.0}
