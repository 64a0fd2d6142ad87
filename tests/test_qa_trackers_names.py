"""Metric names and values the trackers' stores are picky about: names that a path
would resolve to another (`a//b`, `a/../b`, a trailing `/`), names longer than MLflow's
250 characters, characters MLflow refuses, and NaN / infinities. Every tracker logs
them (under a name of its own where it must) and stays open for the rest of the run;
nothing leaves the machine."""

import glob
import importlib.util
import json
import math
import os
import tempfile

import pytest

from rlhf_eqx import pipelines as pl

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# trackio reads its store's place once, when imported: never the user's own store.
os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="trackio-test-")

ODD = {
    "a//b": 1.0,
    "c/../d": 2.0,
    "/lead": 3.0,
    "trail/": 4.0,
    "x/.": 5.0,
    "sp ace:colon": 6.0,
    "per%cent(x)": 7.0,
    "k" * 300: 8.0,
}
RECORDS = [
    {"loss": 1.0},
    {"loss": float("nan"), "grad_norm": float("inf"), "kl": float("-inf")},
    ODD,
    {"loss": 0.5},
]


def _offline(monkeypatch):
    for var in ("WANDB_MODE", "WANDB_BASE_URL", "MLFLOW_TRACKING_URI", "TRACKIO_SPACE_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("TRACKIO_SERVER_URL", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")


def _log_all(run_dir, names):
    open_names = []
    with pl.trackers.open_trackers(names, run_dir, {"sft": {"steps": 4}}, quiet=True) as tr:
        log = pl.tools.MetricsLog(run_dir, "sft", quiet=True)
        for i, rec in enumerate(RECORDS):
            log.write({"iteration": i, "step": i, **rec})
            open_names.append(tr.names)
    return open_names


@pytest.mark.parametrize("name", ["tensorboard", "wandb", "mlflow", "trackio"])
def test_odd_names_and_non_finite_values_keep_each_tracker_open(
    name, tmp_path, monkeypatch, capsys
):
    module = {"tensorboard": "tensorboardX"}.get(name, name)
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")
    _offline(monkeypatch)
    run_dir = str(tmp_path / "run")
    assert _log_all(run_dir, [name]) == [(name,)] * len(RECORDS)
    assert "could not" not in capsys.readouterr().err
    if name == "mlflow":
        _check_mlflow(run_dir)


def _check_mlflow(run_dir):
    from mlflow.tracking import MlflowClient

    (uri,) = [v["tracking_uri"] for v in _recorded(run_dir).values()]
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("rlhf_eqx").experiment_id])
    assert run.info.status == "FINISHED"
    keys = set(run.data.metrics)
    # each odd name under one MLflow accepts, its value at its step
    expected = {
        "sft/a/b": 1.0,
        "sft/c/__/d": 2.0,
        "sft/lead": 3.0,
        "sft/trail": 4.0,
        "sft/x/_": 5.0,
        "sft/sp ace:colon": 6.0,
        "sft/per_cent_x_": 7.0,
        "sft/" + "k" * 246: 8.0,
    }
    assert set(expected) <= keys
    for key, value in expected.items():
        (m,) = client.get_metric_history(run.info.run_id, key)
        assert (m.step, m.value) == (2, value)
    losses = client.get_metric_history(run.info.run_id, "sft/loss")
    assert [m.step for m in losses] == [0, 1, 3]
    assert math.isnan(losses[1].value) and losses[2].value == 0.5
    (inf,) = client.get_metric_history(run.info.run_id, "sft/grad_norm")
    assert inf.step == 1 and inf.value > 1e300


def _recorded(run_dir):
    with open(os.path.join(run_dir, "trackers.json")) as f:
        return json.load(f)


def test_wandb_and_trackio_hold_the_names_and_non_finite_values_as_logged(tmp_path, monkeypatch):
    for module in ("wandb", "trackio"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")
    _offline(monkeypatch)
    run_dir = str(tmp_path / "run")
    _log_all(run_dir, ["wandb", "trackio"])
    from trackio.sqlite_storage import SQLiteStorage

    ids = _recorded(run_dir)
    rows = SQLiteStorage.get_logs(ids["trackio"]["project"], run_id=ids["trackio"]["id"])
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert math.isnan(rows[1]["sft/loss"]) and rows[1]["sft/kl"] == -math.inf
    assert all(rows[2][f"sft/{k}"] == v for k, v in ODD.items())

    (log,) = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    history = []
    for record in pl.trackers.wandb_records(log):
        if record.WhichOneof("record_type") == "history":
            history.append(
                {
                    "/".join(i.nested_key) if i.nested_key else i.key: json.loads(i.value_json)
                    for i in record.history.item
                }
            )
    assert [h["sft/step"] for h in history] == [0, 1, 2, 3]
    assert history[1]["sft/loss"] == "NaN" or math.isnan(history[1]["sft/loss"])
    assert all(history[2][f"sft/{k}"] == v for k, v in ODD.items())
