"""Experiment trackers behind the metrics log: a tiny SFT stage and a tiny DPO stage run
with TensorBoard, Weights & Biases (offline), MLflow (a SQLite store in the run
directory) and trackio (its local store, here a temporary directory), and what each
recorded is read back with that library's own reader: the configuration, every step's
metrics (equal to `metrics.jsonl`'s), the final summary and the group. A tracker that
cannot start or fails while logging prints one line and the run completes; unknown
names are refused; the offline defaults reach no network endpoint."""

import glob
import importlib.util
import json
import math
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

import jax
import pytest

import rlhf_eqx as rx
from rlhf_eqx import pipelines as pl
from rlhf_eqx.assets import asset_path

# The trackers' libraries and theirs (SQLAlchemy under MLflow's store) announce
# deprecations of each other's APIs; those are not this project's.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# trackio reads its store's place once, when imported: a directory of this module's own.
_TRACKIO_DIR = tempfile.mkdtemp(prefix="trackio-test-")
os.environ["TRACKIO_DIR"] = _TRACKIO_DIR  # never the user's own store

GROUP = "sweep-a"
STAGES = ("sft", "dpo")
NETWORK_SETTINGS = (
    "WANDB_MODE",
    "WANDB_BASE_URL",
    "WANDB_PROJECT",
    "MLFLOW_TRACKING_URI",
    "MLFLOW_EXPERIMENT_NAME",
    "TRACKIO_SPACE_ID",
    "TRACKIO_SERVER_URL",
    "TRACKIO_PROJECT",
)


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _need(module: str, extra: str):
    if not _installed(module):
        pytest.skip(f"{module} is not installed (pip install 'rlhf_eqx[{extra}]')")


_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}  # as runs write them


def _records(path):
    """The records of a `metrics.jsonl`, its non-finite numbers read back from their strings."""
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return [
        {k: _NONFINITE.get(v, v) if isinstance(v, str) else v for k, v in r.items()} for r in lines
    ]


def _steps(run_dir: str) -> dict[str, list[dict]]:
    """The step and evaluation records of `metrics.jsonl` by stage."""
    out: dict[str, list[dict]] = {}
    for r in _records(os.path.join(run_dir, "metrics.jsonl")):
        if "step" in r and "event" not in r:
            out.setdefault(r["stage"], []).append(r)
    return out


def _numbers(rec: dict) -> dict[str, float]:
    return {
        k: v
        for k, v in rec.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"
    }


class _Guard:
    """Refuses and records every connection or name lookup beyond this machine."""

    def __init__(self):
        self.attempts: list[object] = []

    @staticmethod
    def _local(address) -> bool:
        if not isinstance(address, tuple):
            return True  # a Unix socket
        host = str(address[0])
        return host in ("localhost", "::1", "0.0.0.0") or host.startswith("127.")

    def install(self, monkeypatch):
        connect, connect_ex, getaddrinfo = (
            socket.socket.connect,
            socket.socket.connect_ex,
            socket.getaddrinfo,
        )

        def guarded(original):
            def call(sock, address):
                if not self._local(address):
                    self.attempts.append(address)
                    raise OSError(f"network use refused in this test: {address}")
                return original(sock, address)

            return call

        def lookup(host, *a, **k):
            if host not in (None, "localhost") and not self._local((host,)):
                self.attempts.append(host)
                raise OSError(f"name lookup refused in this test: {host}")
            return getaddrinfo(host, *a, **k)

        monkeypatch.setattr(socket.socket, "connect", guarded(connect))
        monkeypatch.setattr(socket.socket, "connect_ex", guarded(connect_ex))
        monkeypatch.setattr(socket, "getaddrinfo", lookup)


def _offline(mp: pytest.MonkeyPatch) -> "_Guard":
    """The trackers' offline defaults (no setting that sends elsewhere, W&B quiet) and the
    network refused beyond this machine; returns the guard (its `attempts`)."""
    for var in NETWORK_SETTINGS:
        mp.delenv(var, raising=False)
    mp.setenv("WANDB_SILENT", "true")
    mp.setenv("WANDB_CONSOLE", "off")
    guard = _Guard()
    guard.install(mp)
    return guard


def _tiny_stages(run_dir: str, *, ops: pl.OpsConfig | None = None) -> dict:
    """A 3-step SFT stage and a 2-step DPO stage from it on a one-layer model with the
    shipped 512-token tokenizer, logging to `run_dir`; returns a summary."""
    ops = ops or pl.OpsConfig(quiet=True, monitor=False)
    cfg = rx.TransformerConfig(
        vocab_size=512, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=64
    )
    policy = rx.Policy(cfg, key=jax.random.key(0))
    tok = rx.data.load_tokenizer(asset_path("tok512.bin"))
    summary: dict = {"stopped": "done"}

    def ctx(stage, seed):
        return pl.RunContext(
            ops=ops,
            log=pl.tools.MetricsLog(run_dir, stage, quiet=True),
            key=jax.random.key(seed),
            prompt_length=8,
        )

    lora = pl.LoRASettings(rank=0)
    sft = pl.SFTConfig(steps=3, batch_size=2, max_length=24, lora=lora)
    texts = [("Once", " upon a time"), ("The", " dog ran"), ("A cat", " sat down")]
    res = pl.runs.run_sft(policy, tok, texts, cfg=sft, ctx=ctx("sft", 0))
    summary["sft"] = {"final_loss": res.history[-1]["loss"], "stopped": res.loop.stopped}
    pairs = [
        rx.data.PreferenceRecord(prompt="Once", chosen=" a cat", rejected=" rain"),
        rx.data.PreferenceRecord(prompt="The dog", chosen=" ran home", rejected=" sat"),
    ]
    dpo = pl.DPOConfig(steps=2, batch_size=2, max_length=24, lora=lora)
    res = pl.runs.run_dpo(res.state.model, tok, pairs, cfg=dpo, ctx=ctx("dpo", 1))
    summary["dpo"] = {
        "final_loss": res.history[-1]["loss"],
        "accuracy": res.history[-1]["rewards/accuracies"],
    }
    return summary


CONFIG = {"sft": {"steps": 3, "batch_size": 2}, "dpo": {"beta": 0.1}, "ops": {"seed": 0}}


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """One run of the tiny stages with every installed tracker, in its offline default,
    with the network refused; `(run_dir, summary, started tracker names, attempts)`."""
    names = tuple(
        n
        for n, m in (
            ("tensorboard", "tensorboardX"),
            ("wandb", "wandb"),
            ("mlflow", "mlflow"),
            ("trackio", "trackio"),
        )
        if _installed(m)
    )
    run_dir = str(tmp_path_factory.mktemp("tracked") / "run-1")
    mp = pytest.MonkeyPatch()
    try:
        guard = _offline(mp)
        with pl.trackers.open_trackers(names, run_dir, CONFIG, group=GROUP) as trackers:
            started = trackers.names
            where = {n: t for n, t in trackers.trackers.items()}
            summary = _tiny_stages(run_dir)
            trackers.summary(summary)
    finally:
        mp.undo()
    return run_dir, summary, started, guard.attempts, where


def test_the_network_guard_refuses_what_would_leave_the_machine(monkeypatch):
    guard = _Guard()
    guard.install(monkeypatch)
    with pytest.raises(OSError, match="refused in this test"):
        socket.create_connection(("192.0.2.1", 80), timeout=0.5)
    with socket.socket() as s, pytest.raises(OSError, match="refused in this test"):
        s.connect(("192.0.2.1", 80))
    assert guard.attempts == ["192.0.2.1", ("192.0.2.1", 80)]


def test_every_installed_tracker_starts_offline_and_reaches_no_network(tracked_run):
    run_dir, _, started, attempts, where = tracked_run
    assert attempts == []
    assert pl.trackers.active_trackers(run_dir) is None  # finished: the run directory is released
    if "wandb" in where:
        assert where["wandb"].run.settings.mode == "offline"
        assert os.path.commonpath([where["wandb"].run.dir, run_dir]) == run_dir
        # W&B's analytics exporter, which posts from a thread whatever the run's mode, is off
        from wandb.analytics.opentelemetry import opentelemetry_proxy

        assert opentelemetry_proxy.get_open_telemetry_proxy() is None
    if "mlflow" in where:
        assert where["mlflow"].tracking_uri == "sqlite:///" + os.path.join(run_dir, "mlflow.db")
    if "trackio" in where:
        run = where["trackio"].run
        assert run._space_id is None and run._server_base_url is None
    assert set(started) == set(where)
    for name, module in (("wandb", "wandb"), ("mlflow", "mlflow"), ("trackio", "trackio")):
        assert (name in started) == _installed(module)


# --- TensorBoard ------------------------------------------------------------------------


def _tfrecords(path: str):
    """The records of a TFRecord file (a TensorBoard event file): length, its CRC, the
    bytes, their CRC."""
    with open(path, "rb") as f:
        while header := f.read(12):
            (n,) = struct.unpack("<Q", header[:8])
            yield f.read(n)
            f.read(4)


def _tensorboard_events(directory: str, purge: bool = True) -> dict[str, list[tuple]]:
    """`{tag: [(step, value), ...]}` of the event files in `directory` in the order
    written, read with tensorboardX's protocol buffers; `purge`: as TensorBoard reads
    them, a session start with a step (`purge_step`) dropping the earlier events at and
    after that step."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list[tuple]] = {}
    files = []
    for path in glob.glob(os.path.join(directory, "events.out.tfevents.*")):
        events = [Event.FromString(data) for data in _tfrecords(path)]
        files.append((events[0].wall_time, events))
    for _, events in sorted(files, key=lambda f: f[0]):
        for ev in events:
            if purge and ev.HasField("session_log") and ev.session_log.status == 1:  # START
                out = {t: [(s, v) for s, v in sv if s < ev.step] for t, sv in out.items()}
            for v in ev.summary.value:
                out.setdefault(v.tag, []).append((ev.step, v.simple_value))
    return out


def _tensorboard_scalars(directory: str) -> dict[str, dict[int, float]]:
    """`{tag: {step: value}}` of the event files in `directory`, read with TensorBoard's
    event accumulator when installed, else with tensorboardX's protocol buffers."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        return {t: dict(sv) for t, sv in _tensorboard_events(directory).items()}
    acc = EventAccumulator(directory)
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_tensorboard_has_each_stage_in_its_directory_with_the_logged_values(tracked_run):
    _need("tensorboardX", "tensorboard")
    run_dir, *_ = tracked_run
    for stage, recs in _steps(run_dir).items():
        scalars = _tensorboard_scalars(os.path.join(run_dir, "tensorboard", stage))
        for rec in recs:
            for k, v in _numbers(rec).items():
                assert scalars[f"{stage}/{k}"][rec["step"]] == pytest.approx(v, rel=1e-6)
        assert {t.split("/")[0] for t in scalars} == {stage}


# --- Weights & Biases -------------------------------------------------------------------


def _item(item) -> tuple[str, object]:
    key = "/".join(item.nested_key) if item.nested_key else item.key
    return key, json.loads(item.value_json)


def test_tensorboard_logs_a_non_finite_step_without_a_warning_per_value(tmp_path, caplog):
    # a diverged sweep member's last step is logged as it is: NaN, quietly
    _need("tensorboardX", "tensorboard")
    run_dir = str(tmp_path)
    with pl.trackers.open_trackers(["tensorboard"], run_dir, {}):
        log = pl.tools.MetricsLog(run_dir, "dpo", quiet=True)
        log.write({"iteration": 0, "step": 0, "loss": float("nan"), "grad_norm": float("inf")})
    assert "NaN or Inf" not in caplog.text
    events = _tensorboard_events(os.path.join(run_dir, "tensorboard", "dpo"))
    assert math.isnan(events["dpo/loss"][0][1]) and events["dpo/grad_norm"][0][1] == math.inf


def test_wandb_offline_run_holds_config_group_steps_and_summary(tracked_run):
    _need("wandb", "wandb")
    run_dir, summary, *_ = tracked_run
    (path,) = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    records = list(pl.trackers.wandb_records(path))
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.run_group == GROUP and run.display_name == "run-1" and run.project == "rlhf_eqx"
    config = dict(_item(u) for u in run.config.update)
    assert {k: config[k] for k in CONFIG} == CONFIG
    history = [
        dict(_item(i) for i in r.history.item)
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    for stage, recs in _steps(run_dir).items():
        rows = [h for h in history if f"{stage}/step" in h]
        assert [h[f"{stage}/step"] for h in rows] == [r["step"] for r in recs]
        for h, rec in zip(rows, recs):
            for k, v in _numbers(rec).items():
                assert h[f"{stage}/{k}"] == pytest.approx(v, rel=1e-12)
    metric_axes = {
        r.metric.glob_name: r.metric.step_metric
        for r in records
        if r.WhichOneof("record_type") == "metric" and r.metric.glob_name
    }
    assert metric_axes == {f"{s}/*": f"{s}/step" for s in STAGES}
    final: dict = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            final.update(_item(u) for u in r.summary.update)
    assert final["summary/sft/final_loss"] == pytest.approx(summary["sft"]["final_loss"])
    assert final["summary/dpo/accuracy"] == summary["dpo"]["accuracy"]
    assert final["summary/stopped"] == "done"


# --- MLflow -----------------------------------------------------------------------------


def test_mlflow_store_holds_params_group_metric_histories_and_summary(tracked_run):
    _need("mlflow", "mlflow")
    from mlflow.tracking import MlflowClient

    run_dir, summary, *_ = tracked_run
    client = MlflowClient(tracking_uri="sqlite:///" + os.path.join(run_dir, "mlflow.db"))
    exp = client.get_experiment_by_name("rlhf_eqx")
    (found,) = client.search_runs([exp.experiment_id])
    run = client.get_run(found.info.run_id)
    assert run.info.run_name == "run-1" and run.info.status == "FINISHED"
    assert run.data.tags["group"] == GROUP
    assert run.data.params["sft.steps"] == "3" and run.data.params["dpo.beta"] == "0.1"
    for stage, recs in _steps(run_dir).items():
        for k in _numbers(recs[0]):
            hist = client.get_metric_history(run.info.run_id, f"{stage}/{k}")
            got = sorted((m.step, m.value) for m in hist)
            want = sorted((r["step"], r[k]) for r in recs if k in r)
            assert [s for s, _ in got] == [s for s, _ in want]
            assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-12)
    assert run.data.metrics["summary/sft/final_loss"] == pytest.approx(summary["sft"]["final_loss"])
    assert run.data.tags["summary/stopped"] == "done"


_TELEMETRY_PROBE = """
import os, sys, tempfile
from rlhf_eqx import pipelines as pl
d = tempfile.mkdtemp()
with pl.trackers.open_trackers(["mlflow"], d, {"ops": {"seed": 0}}, quiet=True) as t:
    assert t.names == ("mlflow",)
    import mlflow.telemetry
    from mlflow.telemetry.utils import is_telemetry_disabled
    # without the setting, a client whose configuration fetch failed (no network) is
    # dropped too: MLflow's own view of the setting is what counts
    print("telemetry off:", is_telemetry_disabled(), mlflow.telemetry.get_telemetry_client())
"""


@pytest.mark.slow
def test_mlflow_telemetry_is_off_outside_a_test_runner(tmp_path):
    # MLflow turns its telemetry (posts to its own service from a thread) off by itself
    # under pytest and CI only: a process outside them must find it off once the tracker
    # started
    _need("mlflow", "mlflow")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTEST_CURRENT_TEST", "CI", "MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK")
    }
    out = subprocess.run(
        [sys.executable, "-c", _TELEMETRY_PROBE],
        env=env,
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "telemetry off: True None" in out.stdout


# --- trackio ----------------------------------------------------------------------------


def test_trackio_store_holds_config_group_logs_and_summary(tracked_run):
    _need("trackio", "trackio")
    import trackio
    from trackio.sqlite_storage import SQLiteStorage

    assert str(trackio.utils.TRACKIO_DIR) == os.environ["TRACKIO_DIR"]
    run_dir, summary, *_ = tracked_run
    (run,) = [r for r in trackio.Api().runs("rlhf_eqx") if r.name == "run-1"]
    assert run.config["_Group"] == GROUP
    assert {k: run.config[k] for k in CONFIG} == CONFIG
    logs = SQLiteStorage.get_logs("rlhf_eqx", "run-1")
    for stage, recs in _steps(run_dir).items():
        rows = [r for r in logs if any(k.startswith(f"{stage}/") for k in r)]
        assert [r["step"] for r in rows] == [r["step"] for r in recs]
        for row, rec in zip(rows, recs):
            for k, v in _numbers(rec).items():
                assert row[f"{stage}/{k}"] == pytest.approx(v, rel=1e-12)
    (last,) = [r for r in logs if "summary/sft/final_loss" in r]
    assert last["summary/sft/final_loss"] == pytest.approx(summary["sft"]["final_loss"])


def test_quiet_trackers_print_nothing_on_stdout(tmp_path, capsys):
    """trackio prints its store, dashboard and run lines when it starts and a line when it
    finishes; with `quiet` (a run's `ops.quiet`) standard output stays empty."""
    _need("trackio", "trackio")
    for quiet in (False, True):
        t = pl.trackers.open_trackers(["trackio"], str(tmp_path / f"q{quiet}"), {}, quiet=quiet)
        assert t.names == ("trackio",)
        t.finish()
        out = capsys.readouterr().out
        assert ("Created new run" in out and "Run finished" in out) != quiet, out


_WANDB_QUIET_PROBE = """
import sys
from rlhf_eqx import pipelines as pl
run_dir, quiet = sys.argv[1], sys.argv[2] == "quiet"
with pl.trackers.open_trackers(["wandb"], run_dir, {}, quiet=quiet) as t:
    assert t.names == ("wandb",)
    pl.tools.MetricsLog(run_dir, "dpo", quiet=True).write({"step": 0, "loss": 0.5})
"""


@pytest.mark.slow
def test_a_quiet_wandb_run_leaves_out_its_banner_and_run_summary(tmp_path):
    """W&B prints its notes on standard error (some 20 lines a run: a sweep's members
    each); a quiet run starts it in its quiet mode. In a process of its own: W&B's
    terminal output goes to the standard error of the process's first run."""
    _need("wandb", "wandb")
    for quiet in ("loud", "quiet"):
        out = subprocess.run(
            [sys.executable, "-c", _WANDB_QUIET_PROBE, str(tmp_path / quiet), quiet],
            cwd=str(tmp_path),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        loud = "Tracking run with wandb" in out.stderr and "Run history" in out.stderr
        assert loud == (quiet == "loud"), out.stderr[-2000:]
        if quiet == "quiet":  # offline: not even where the run is stored
            assert "wandb:" not in out.stderr, out.stderr[-2000:]


# --- failures and choices ---------------------------------------------------------------


class _Refuses(pl.trackers.Tracker):
    def __init__(self, run_dir):
        del run_dir

    def start(self, run_name, config, group):
        raise RuntimeError("no licence server")

    def log(self, step, metrics, stage):
        raise AssertionError("never started, never called")

    def summary(self, values):
        raise AssertionError("never started, never called")

    def finish(self):
        raise AssertionError("never started, never called")


class _Breaks(pl.trackers.Tracker):
    """Starts, then fails on its second record."""

    calls: list = []

    def __init__(self, run_dir):
        del run_dir

    def start(self, run_name, config, group):
        type(self).calls.append(("start", run_name, group))

    def log(self, step, metrics, stage):
        type(self).calls.append(("log", stage, step))
        if len(type(self).calls) > 2:
            raise OSError("disk quota exceeded")

    def summary(self, values):
        type(self).calls.append(("summary",))

    def finish(self):
        type(self).calls.append(("finish",))


def test_a_tracker_that_fails_prints_one_line_and_the_run_completes(tmp_path, capsys):
    pl.trackers.register_tracker("test-refuses", _Refuses)
    pl.trackers.register_tracker("test-breaks", _Breaks)
    _Breaks.calls = []
    run_dir = str(tmp_path / "run")
    with pl.trackers.open_trackers(["test-refuses", "test-breaks"], run_dir, {}) as trackers:
        assert trackers.names == ("test-breaks",)
        summary = _tiny_stages(run_dir)
        assert trackers.names == ()
    err = capsys.readouterr().err
    assert (
        "tracker test-refuses: could not start (no licence server); the run goes on without it"
        in err
    )
    assert (
        "tracker test-breaks: could not log (disk quota exceeded); the run goes on without it"
        in err
    )
    assert _Breaks.calls == [("start", "run", None), ("log", "sft", 0), ("log", "sft", 1)]
    steps = _steps(run_dir)
    assert [len(steps[s]) for s in STAGES] == [3, 2] and summary["dpo"]["final_loss"] > 0


@pytest.mark.parametrize(
    ("error", "status"),
    [(ValueError("the probe failed"), "FAILED"), (KeyboardInterrupt(), "KILLED")],
)
def test_a_run_that_ends_with_an_exception_is_no_finished_tracker_run(
    error, status, tmp_path, monkeypatch
):
    # a crashed or interrupted run is marked so in the trackers, not FINISHED
    _need("mlflow", "mlflow")
    for var in NETWORK_SETTINGS:
        monkeypatch.delenv(var, raising=False)
    from mlflow.tracking import MlflowClient

    run_dir = str(tmp_path / "run")
    with pytest.raises(type(error)):
        with pl.trackers.open_trackers(["mlflow"], run_dir, {}) as trackers:
            assert trackers.names == ("mlflow",)
            raise error
    with open(os.path.join(run_dir, "trackers.json")) as f:
        run_id = json.load(f)["mlflow"]["run_id"]
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    assert client.get_run(run_id).info.status == status


def test_a_missing_library_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pl.trackers.open_trackers(["wandb"], str(tmp_path), {}) as trackers:
        assert trackers.names == ()
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("tracker wandb: could not start (")
    assert line.endswith("); the run goes on without it")


def test_an_unreachable_mlflow_server_is_one_line_within_seconds(tmp_path, monkeypatch, capsys):
    # MLflow's own retries (7, backoff factor 2) held each run for minutes before the
    # tracker gave up; the first request now tries twice and the run goes on
    _need("mlflow", "mlflow")
    with socket.socket() as s:  # a local port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    t0 = time.monotonic()
    with pl.trackers.open_trackers(["mlflow"], str(tmp_path), {}) as trackers:
        assert trackers.names == ()
    assert time.monotonic() - t0 < 60
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("tracker mlflow: could not start (") and f":{port}" in line
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ  # later requests: MLflow's


def test_unknown_tracker_names_are_refused_listing_the_known_ones():
    cfg = pl.apply_overrides(pl.PipelineConfig(), ["ops.trackers=tensorboard,wandb"])
    assert cfg.ops.trackers == ("tensorboard", "wandb")
    pl.config.validate_config(cfg)
    bad = pl.apply_overrides(pl.PipelineConfig(), ["ops.trackers=wandb,neptune"])
    with pytest.raises(pl.ConfigError) as e:
        pl.config.validate_config(bad)
    assert str(e.value).startswith("ops.trackers=neptune: must be one of tensorboard, wandb,")
    assert "mlflow" in str(e.value) and "trackio" in str(e.value)
    with pytest.raises(pl.ConfigError, match="ops.trackers=neptune"):
        pl.trackers.open_trackers(["neptune"], "unused", {})


def test_the_pipeline_config_selects_the_trackers_and_the_group(tmp_path):
    pl.trackers.register_tracker("test-breaks", _Breaks)
    _Breaks.calls = []
    cfg = pl.apply_overrides(
        pl.PipelineConfig(),
        ["ops.trackers=test-breaks", "ops.tracker_group=lr-sweep", "ops.tensorboard=true"],
    )
    with pl.trackers.run_trackers(cfg, str(tmp_path / "m3")) as trackers:
        assert pl.trackers.active_trackers(str(tmp_path / "m3")) is trackers
        assert set(trackers.names) <= {"test-breaks", "tensorboard"}
        assert "test-breaks" in trackers.names
    assert _Breaks.calls[0] == ("start", "m3", "lr-sweep")
    assert _Breaks.calls[-1] == ("finish",)


class _Records(pl.trackers.Tracker):
    """Keeps what it is given (a plain backend of the protocol)."""

    seen: list = []

    def __init__(self, run_dir):
        self.run_dir = run_dir

    def start(self, run_name, config, group):
        type(self).seen.append(("start", run_name, config, group))

    def log(self, step, metrics, stage):
        type(self).seen.append(("log", stage, step, metrics))

    def summary(self, values):
        type(self).seen.append(("summary", values))

    def finish(self):
        type(self).seen.append(("finish",))


def test_the_run_summary_file_is_logged_when_the_trackers_finish(tmp_path):
    pl.trackers.register_tracker("test-records", _Records)
    _Records.seen = []
    run_dir = str(tmp_path / "r")
    with pl.trackers.open_trackers(["test-records"], run_dir, {"a": 1}, group="g", run_name="name"):
        log = pl.tools.MetricsLog(run_dir, "reward", quiet=True)
        log.write({"iteration": 0, "step": 0, "loss": 0.5, "ok": True, "note": "x"})
        log.write({"eval": True, "iteration": 1, "step": 1, "accuracy": 0.75})
        log.event("rollback", "restored", step=1)
        pl.tools.MetricsLog(run_dir, "other", quiet=True).write({"data_quality": 1.0})  # no step
        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            json.dump({"reward": {"accuracy": 0.75}, "stopped": "done"}, f)
    assert _Records.seen == [
        ("start", "name", {"a": 1}, "g"),
        ("log", "reward", 0, {"iteration": 0.0, "loss": 0.5}),
        ("log", "reward", 1, {"iteration": 1.0, "accuracy": 0.75}),
        ("summary", {"reward": {"accuracy": 0.75}, "stopped": "done"}),
        ("finish",),
    ]
    pl.tools.MetricsLog(run_dir, "reward", quiet=True).write({"step": 2, "loss": 0.1})
    assert len(_Records.seen) == 5  # finished: nothing more reaches the trackers


@pytest.mark.slow
def test_a_run_on_a_data_file_logs_its_config_steps_and_summary_to_mlflow(tmp_path, monkeypatch):
    _need("mlflow", "mlflow")
    from mlflow.tracking import MlflowClient

    for var in NETWORK_SETTINGS:
        monkeypatch.delenv(var, raising=False)
    data = tmp_path / "pairs.jsonl"
    with open(data, "w") as f:
        for i in range(40):
            rec = {"prompt": f"Once upon a time {i}", "chosen": " a cat", "rejected": " rain"}
            f.write(json.dumps(rec) + "\n")
    out = tmp_path / "run"
    cfg = pl.apply_overrides(
        pl.animal_task_config(),
        [
            f"data.path={data}",
            f"out={out}",
            "sft.steps=3",
            "sft.batch_size=4",
            "sft.max_length=32",
            "sampling.prompt_length=16",
            "ops.monitor=false",
            "ops.quiet=true",
            "ops.trackers=mlflow",
            f"ops.tracker_group={GROUP}",
        ],
    )
    summary = pl.run_on_data(cfg, "sft")
    client = MlflowClient(tracking_uri="sqlite:///" + str(out / "mlflow.db"))
    (run,) = client.search_runs([client.get_experiment_by_name("rlhf_eqx").experiment_id])
    assert run.data.tags["group"] == GROUP and run.info.status == "FINISHED"
    assert run.data.params["sft.steps"] == "3" and run.data.params["ops.trackers"] == '["mlflow"]'
    recs = _steps(str(out))["sft"]
    hist = client.get_metric_history(run.info.run_id, "sft/loss")
    assert [(m.step, m.value) for m in hist] == [(r["step"], r["loss"]) for r in recs]
    want = summary["sft"]["heldout_nll"]
    assert run.data.metrics["summary/sft/heldout_nll"] == pytest.approx(want)


# --- resume: the same tracker runs continue ---------------------------------------------

_BACKENDS = (
    ("tensorboard", "tensorboardX"),
    ("wandb", "wandb"),
    ("mlflow", "mlflow"),
    ("trackio", "trackio"),
)
# (stage, steps) of the uninterrupted run; the stopped one logs every SFT step and DPO's
# steps 0-2, its last checkpoint after DPO step 0: the resumed run logs DPO's steps 1-3.
_PLAN = (("sft", 6), ("dpo", 4))
_STOP, _CHECKPOINT = 3, 1


def _record(stage: str, step: int, took: float) -> dict:
    """A step record whose numbers depend on the stage and step only (a bit-identical
    resume), but for its measured time `took`."""
    k = 1.0 if stage == "sft" else 2.0
    loss, margin = k / (step + 1), k * step
    return {"iteration": step, "step": step, "loss": loss, "margin": margin, "time_s": took}


def _log(run_dir: str, stage: str, steps, took: float) -> None:
    log = pl.tools.MetricsLog(run_dir, stage, quiet=True)
    for step in steps:
        log.write(_record(stage, step, took + step))


def _want(stage: str) -> dict[str, list[tuple[int, float]]]:
    """What an uninterrupted run logs of `stage`, with each step's first time (the
    stopped run's, then the resumed run's): `{metric: [(step, value)]}`."""
    out: dict[str, list] = {}
    for step in range(dict(_PLAN)[stage]):
        took = 50.0 if stage == "dpo" and step >= _STOP else 10.0
        for k, v in _numbers(_record(stage, step, took + step)).items():
            out.setdefault(k, []).append((step, v))
    return out


def _same_rows(got, want, rel: float = 1e-12) -> bool:
    """`[(step, value)]` lists equal in their steps, in any order, and their values to
    `rel`."""
    got, want = sorted(got), sorted(want)
    steps = [s for s, _ in got] == [s for s, _ in want]
    return steps and [v for _, v in got] == pytest.approx([v for _, v in want], rel=rel)


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """The plan logged by a run stopped after DPO step 2 (as a kill leaves it: no
    summary), then resumed from its checkpoint after DPO step 0 (DPO steps 1-3 again,
    later times), with every installed tracker and the network refused; `(run_dir,
    started names, attempts, stderr of the resume)`."""
    names = tuple(n for n, m in _BACKENDS if _installed(m))
    cut = str(tmp_path_factory.mktemp("resume") / "cut-run")
    summary = {"sft": {"final_loss": 1 / 6}, "dpo": {"final_loss": 0.5}, "stopped": "done"}
    mp = pytest.MonkeyPatch()
    err = tempfile.TemporaryFile("w+")
    try:
        guard = _offline(mp)
        with pl.trackers.open_trackers(names, cut, CONFIG, group=GROUP) as trackers:
            started = trackers.names
            _log(cut, "sft", range(6), 10.0)
            _log(cut, "dpo", range(_STOP), 10.0)
        mp.setattr(sys, "stderr", err)
        with pl.trackers.open_trackers(names, cut, CONFIG, group=GROUP, resume=True) as trackers:
            assert trackers.names == started
            _log(cut, "dpo", range(_CHECKPOINT, 4), 50.0)
            trackers.summary(summary)
    finally:
        mp.undo()
        err.seek(0)
        said = err.read()
        err.close()
    return cut, started, guard.attempts, said


@pytest.mark.slow
def test_a_resumed_run_records_its_tracker_runs_and_warns_of_nothing(resumed_run):
    cut, started, attempts, err = resumed_run
    assert attempts == [] and err == ""
    runs = pl.trackers.recorded_runs(cut)
    assert set(runs) == set(started)
    if "mlflow" in runs:
        assert set(runs["mlflow"]) == {"run_id", "tracking_uri"}


@pytest.mark.slow
def test_tensorboard_resumed_purges_the_stopped_runs_later_steps(resumed_run):
    _need("tensorboardX", "tensorboard")
    cut, *_ = resumed_run
    for stage, _ in _PLAN:
        got = _tensorboard_events(os.path.join(cut, "tensorboard", stage))
        for k, rows in _want(stage).items():
            if k != "time_s":  # TensorBoard keeps the resumed run's times
                assert _same_rows(got[f"{stage}/{k}"], rows, rel=1e-6)  # float32
    raw = _tensorboard_events(os.path.join(cut, "tensorboard", "dpo"), purge=False)
    assert sorted(s for s, _ in raw["dpo/loss"]) == [0, 1, 1, 2, 2, 3]  # unpurged: twice
    times = dict(_tensorboard_events(os.path.join(cut, "tensorboard", "dpo"))["dpo/time_s"])
    assert times == {0: 10.0, 1: 51.0, 2: 52.0, 3: 53.0}


@pytest.mark.slow
def test_wandb_resumed_continues_the_run_id_with_each_step_once(resumed_run):
    _need("wandb", "wandb")
    cut, *_ = resumed_run
    (first, second) = sorted(glob.glob(os.path.join(cut, "wandb", "offline-run-*")))
    assert first.rsplit("-", 1)[1] == second.rsplit("-", 1)[1]  # one run id, two parts
    history, configs, final = [], [], {}
    for path in (first, second):
        (log,) = glob.glob(os.path.join(path, "run-*.wandb"))
        for r in pl.trackers.wandb_records(log):
            kind = r.WhichOneof("record_type")
            if kind == "history":
                history.append(dict(_item(i) for i in r.history.item))
            elif kind == "run":
                configs.append(dict(_item(u) for u in r.run.config.update))
                assert r.run.run_group == GROUP and r.run.display_name == "cut-run"
            elif kind == "summary":
                final.update(_item(u) for u in r.summary.update)
    steps = [h["_step"] for h in history]
    assert steps == list(range(len(steps)))  # the internal step continues
    for stage, _ in _PLAN:
        rows = [h for h in history if f"{stage}/step" in h]
        for k, want in _want(stage).items():
            got = [(h[f"{stage}/step"], h[f"{stage}/{k}"]) for h in rows if f"{stage}/{k}" in h]
            assert [s for s, _ in got] == [s for s, _ in want] and _same_rows(got, want)
    assert [{k: c[k] for k in CONFIG} for c in configs] == [CONFIG, CONFIG]
    assert final["summary/dpo/final_loss"] == 0.5 and final["summary/stopped"] == "done"


@pytest.mark.slow
def test_mlflow_resumed_reopens_its_run_with_each_step_once(resumed_run):
    _need("mlflow", "mlflow")
    from mlflow.tracking import MlflowClient

    cut, *_ = resumed_run
    client = MlflowClient(tracking_uri="sqlite:///" + os.path.join(cut, "mlflow.db"))
    (found,) = client.search_runs([client.get_experiment_by_name("rlhf_eqx").experiment_id])
    run = client.get_run(found.info.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["group"] == GROUP
    assert run.data.params["sft.steps"] == "3" and run.data.params["dpo.beta"] == "0.1"
    for stage, _ in _PLAN:
        for k, want in _want(stage).items():
            hist = client.get_metric_history(run.info.run_id, f"{stage}/{k}")
            assert _same_rows([(m.step, m.value) for m in hist], want)
    (summary,) = client.get_metric_history(run.info.run_id, "summary/dpo/final_loss")
    assert summary.value == 0.5 and run.data.tags["summary/stopped"] == "done"


@pytest.mark.slow
def test_trackio_resumed_reopens_its_run_with_each_step_once(resumed_run):
    _need("trackio", "trackio")
    import trackio
    from trackio.sqlite_storage import SQLiteStorage

    cut, *_ = resumed_run
    (run,) = [r for r in trackio.Api().runs("rlhf_eqx") if r.name == "cut-run"]
    assert run.config["_Group"] == GROUP and {k: run.config[k] for k in CONFIG} == CONFIG
    logs = SQLiteStorage.get_logs("rlhf_eqx", "cut-run")
    for stage, _ in _PLAN:
        for k, want in _want(stage).items():
            got = [(r["step"], r[f"{stage}/{k}"]) for r in logs if f"{stage}/{k}" in r]
            assert _same_rows(got, want)
    (last,) = [r for r in logs if "summary/dpo/final_loss" in r]
    assert last["summary/dpo/final_loss"] == 0.5


class _Resumable(_Records):
    """Records its calls and reopens its run from its identity; `lost` ids raise."""

    lost: set = set()

    def start(self, run_name, config, group):
        self.id = f"run-{len(type(self).seen)}"
        type(self).seen.append(("start", self.id))

    def identity(self):
        return {"id": self.id}

    def resume(self, run_name, config, group, identity):
        if identity["id"] in type(self).lost:
            raise KeyError(f"no run {identity['id']} in the store")
        self.id = identity["id"]
        type(self).seen.append(("resume", self.id))


def _resumable(tmp_path) -> str:
    pl.trackers.register_tracker("test-resumable", _Resumable)
    _Resumable.seen, _Resumable.lost = [], set()
    run_dir = str(tmp_path / "r")
    with pl.trackers.open_trackers(["test-resumable"], run_dir, {}):
        _log(run_dir, "sft", range(2), 0.0)
    return run_dir


def test_a_resumed_run_reopens_each_trackers_run_from_the_run_directory(tmp_path, capsys):
    run_dir = _resumable(tmp_path)
    assert pl.trackers.recorded_runs(run_dir) == {"test-resumable": {"id": "run-0"}}
    with pl.trackers.open_trackers(["test-resumable"], run_dir, {}, resume=True):
        _log(run_dir, "sft", range(1, 3), 0.0)
    assert [c for c in _Resumable.seen if c[0] in ("start", "resume")] == [
        ("start", "run-0"),
        ("resume", "run-0"),
    ]
    assert capsys.readouterr().err == ""
    with pl.trackers.open_trackers(["test-resumable"], run_dir, {}):  # not resumed: new
        pass
    assert _Resumable.seen[-2][0] == "start"


@pytest.mark.parametrize("damage", ["missing", "corrupt", "not a mapping"])
def test_a_missing_or_corrupt_trackers_file_starts_new_runs_with_one_line(damage, tmp_path, capsys):
    run_dir = _resumable(tmp_path)
    path = os.path.join(run_dir, "trackers.json")
    if damage == "missing":
        os.remove(path)
    else:
        with open(path, "w") as f:
            f.write('{"test-resumable": {"id": ' if damage == "corrupt" else "[1, 2]")
    capsys.readouterr()
    with pl.trackers.open_trackers(["test-resumable"], run_dir, {}, resume=True) as trackers:
        assert trackers.names == ("test-resumable",)
    (line,) = capsys.readouterr().err.strip().splitlines()
    reason = "is missing" if damage == "missing" else "is unreadable ("
    assert line.startswith(f"trackers: {path} {reason}")
    assert line.endswith("; each tracker starts a new run")
    assert [c[0] for c in _Resumable.seen if c[0] in ("start", "resume")] == ["start", "start"]
    new_id = [c for c in _Resumable.seen if c[0] == "start"][-1][1]
    assert pl.trackers.recorded_runs(run_dir) == {"test-resumable": {"id": new_id}}


def test_a_run_the_store_lost_or_never_had_starts_a_new_one_with_one_line(tmp_path, capsys):
    run_dir = _resumable(tmp_path)
    _Resumable.lost = {"run-0"}
    pl.trackers.register_tracker("test-records", _Records)
    with pl.trackers.open_trackers(
        ["test-resumable", "test-records"], run_dir, {}, resume=True
    ) as trackers:
        assert trackers.names == ("test-resumable", "test-records")
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "tracker test-resumable: could not resume its run ('no run run-0 in the store'); "
        "it starts a new run",
        "tracker test-records: trackers.json records no run of it; it starts a new run",
    ]
    assert [c[0] for c in _Resumable.seen if c[0] in ("start", "resume")] == ["start", "start"]
    runs = pl.trackers.recorded_runs(run_dir)
    assert runs["test-records"] is None and runs["test-resumable"]["id"] != "run-0"


def test_a_new_tracker_run_of_a_resumed_run_holds_the_earlier_steps_once(
    tmp_path, monkeypatch, capsys
):
    # a tracker added on resume (or whose record is lost) gets the whole run, not only
    # the steps after the checkpoint; the steps the resumed run repeats are there once
    _need("mlflow", "mlflow")
    for var in NETWORK_SETTINGS:
        monkeypatch.delenv(var, raising=False)
    from mlflow.tracking import MlflowClient

    run_dir = str(tmp_path / "run")
    log = pl.tools.MetricsLog(run_dir, "sft", quiet=True)
    for step in range(3):  # the stopped run's records, none sent to a tracker
        log.write({"iteration": step, "step": step, "loss": 1.0 - step / 10})
    with pl.trackers.open_trackers(["mlflow"], run_dir, {}, resume=True) as trackers:
        assert trackers.names == ("mlflow",)
        log.write({"iteration": 2, "step": 2, "loss": 0.8})  # the resumed run repeats step 2
        log.write({"iteration": 3, "step": 3, "loss": 0.7})
    assert capsys.readouterr().err.strip().endswith("is missing; each tracker starts a new run")
    with open(os.path.join(run_dir, "trackers.json")) as f:
        run_id = json.load(f)["mlflow"]["run_id"]
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    history = client.get_metric_history(run_id, "sft/loss")
    assert sorted((m.step, round(m.value, 6)) for m in history) == [
        (0, 1.0),
        (1, 0.9),
        (2, 0.8),
        (3, 0.7),
    ]


def test_tensorboard_added_on_resume_holds_the_earlier_steps_once(tmp_path):
    _need("tensorboardX", "tensorboard")
    run_dir = str(tmp_path / "run")
    log = pl.tools.MetricsLog(run_dir, "sft", quiet=True)
    for step in range(3):  # the stopped run's records, none sent to a tracker
        log.write({"iteration": step, "step": step, "loss": 1.0 - step / 10})
    with pl.trackers.open_trackers(["tensorboard"], run_dir, {}, resume=True):
        log.write({"iteration": 2, "step": 2, "loss": 0.75})  # the resumed run repeats step 2
        log.write({"iteration": 3, "step": 3, "loss": 0.7})
    events = _tensorboard_events(os.path.join(run_dir, "tensorboard", "sft"))
    got = [(s, round(v, 6)) for s, v in events["sft/loss"]]
    assert got == [(0, 1.0), (1, 0.9), (2, 0.75), (3, 0.7)]


def test_tensorboard_added_on_resume_gets_the_non_finite_steps_as_numbers(tmp_path):
    # metrics.jsonl holds NaN and infinities as the strings "NaN", "-Infinity" (JSON)
    _need("tensorboardX", "tensorboard")
    run_dir = str(tmp_path / "run")
    log = pl.tools.MetricsLog(run_dir, "sft", quiet=True)
    log.write({"iteration": 0, "step": 0, "loss": 1.0, "kl": 0.5})
    log.write({"iteration": 1, "step": 1, "loss": math.nan, "kl": -math.inf})
    with pl.trackers.open_trackers(["tensorboard"], run_dir, {}, resume=True):
        pass
    events = _tensorboard_events(os.path.join(run_dir, "tensorboard", "sft"))
    assert events["sft/loss"][0] == (0, 1.0) and events["sft/loss"][1][0] == 1
    assert math.isnan(events["sft/loss"][1][1])
    assert events["sft/kl"] == [(0, 0.5), (1, -math.inf)]


def test_the_summary_files_non_finite_strings_reach_the_trackers_as_numbers(tmp_path):
    pl.trackers.register_tracker("test-records", _Records)
    _Records.seen = []
    run_dir = str(tmp_path / "r")
    with pl.trackers.open_trackers(["test-records"], run_dir, {}):
        with open(os.path.join(run_dir, "summary.json"), "w") as f:  # as a run writes it
            json.dump({"dpo": {"loss": "NaN", "kl": "Infinity", "note": "x"}}, f)
    [values] = [s[1] for s in _Records.seen if s[0] == "summary"]
    assert math.isnan(values["dpo"].pop("loss"))
    assert values == {"dpo": {"kl": math.inf, "note": "x"}}


# --- resume of a real run: a clean stop, and kill -9 ------------------------------------

_PAUSE_MODULE = """
import os, time
from rlhf_eqx import pipelines as pl

class Pause(pl.Callback):
    def on_step(self, run, step, metrics):
        time.sleep(float(os.environ.get("STEP_PAUSE", "0")))

class StopAtFour(pl.Callback):
    def on_step(self, run, step, metrics):
        if step == 4:
            run.request_stop("four steps")
"""


def _data_run_argv(tmp_path, out: str) -> list[str]:
    """`python -m rlhf_eqx` arguments of a 6-step SFT run on a small data file into
    `out`, checkpointed every 2 steps, with every installed tracker."""
    data = tmp_path / "pairs.jsonl"
    if not data.exists():
        with open(data, "w") as f:
            for i in range(40):
                rec = {"prompt": f"Once upon a time {i}", "chosen": " a cat", "rejected": " rain"}
                f.write(json.dumps(rec) + "\n")
        (tmp_path / "pause_steps.py").write_text(_PAUSE_MODULE)
    names = ",".join(n for n, m in _BACKENDS if _installed(m))
    sets = [
        "sft.steps=6",
        "sft.batch_size=4",
        "sft.max_length=32",
        "sampling.prompt_length=16",
        "ops.monitor=false",
        "ops.checkpoint_every=2",
        f"ops.trackers={names}",
        f"ops.tracker_group={GROUP}",
    ]
    return ["sft", "--data", str(data), "--out", out, "--quiet"] + [
        a for s in sets for a in ("--set", s)
    ]


def _held_steps(run_dir: str) -> dict[str, list[tuple[int, float]]]:
    """What each installed tracker holds of `run_dir`'s SFT stage, by backend and metric:
    `{backend: {metric: [(step, value)]}}` (W&B: every offline part of its run id)."""
    out: dict[str, dict[str, list]] = {}
    if _installed("mlflow"):
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri="sqlite:///" + os.path.join(run_dir, "mlflow.db"))
        (run,) = client.search_runs([client.get_experiment_by_name("rlhf_eqx").experiment_id])
        out["mlflow"] = {
            k: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)]
            for k in run.data.metrics
            if k.startswith("sft/")
        }
    if _installed("trackio"):
        from trackio.sqlite_storage import SQLiteStorage

        rows = SQLiteStorage.get_logs("rlhf_eqx", os.path.basename(run_dir))
        out["trackio"] = {}
        for r in rows:
            for k, v in _numbers(r).items():
                if k.startswith("sft/"):
                    out["trackio"].setdefault(k, []).append((r["step"], v))
    if _installed("wandb"):
        out["wandb"] = {}
        parts = sorted(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb")))
        assert len({os.path.basename(p) for p in parts}) == 1  # one run id
        for path in parts:
            for r in pl.trackers.wandb_records(path):
                if r.WhichOneof("record_type") == "history":
                    h = dict(_item(i) for i in r.history.item)
                    for k, v in h.items():
                        if k.startswith("sft/") and k != "sft/step":
                            out["wandb"].setdefault(k, []).append((h["sft/step"], v))
    if _installed("tensorboardX"):
        out["tensorboard"] = _tensorboard_events(os.path.join(run_dir, "tensorboard", "sft"))
    return out


_WALL_CLOCK = ("time", "per_s", "mfu", "seconds")


def _assert_same_histories(got: dict, want: dict) -> None:
    """Each backend's metrics at the same steps, each step once; the values equal but
    for measured times (float32 in TensorBoard)."""
    assert set(got) == set(want)
    for backend in want:
        assert set(got[backend]) == set(want[backend]), backend
        for k, rows in want[backend].items():
            steps = sorted(s for s, _ in got[backend][k])
            assert steps == sorted(s for s, _ in rows), (backend, k)
            if not any(w in k for w in _WALL_CLOCK):
                rel = 1e-6 if backend == "tensorboard" else 1e-12
                assert _same_rows(got[backend][k], rows, rel=rel), (backend, k)


@pytest.fixture(scope="module")
def uninterrupted_data_run(tmp_path_factory):
    """The 6-step SFT data run without a stop: `(tmp dir, its run dir)`."""
    from rlhf_eqx.__main__ import main

    tmp = tmp_path_factory.mktemp("data-runs")
    full = str(tmp / "full")
    mp = pytest.MonkeyPatch()
    try:
        guard = _offline(mp)
        assert main(_data_run_argv(tmp, full)) == 0
    finally:
        mp.undo()
    assert guard.attempts == []
    return tmp, full


@pytest.mark.slow
def test_a_data_run_stopped_by_a_callback_then_resumed_continues_its_tracker_runs(
    uninterrupted_data_run, monkeypatch
):
    from rlhf_eqx.__main__ import main

    tmp, full = uninterrupted_data_run
    guard = _offline(monkeypatch)
    monkeypatch.syspath_prepend(str(tmp))
    cut = str(tmp / "stopped")
    argv = _data_run_argv(tmp, cut)
    assert main([*argv, "--callback", "pause_steps:StopAtFour"]) == 0
    ckpts = os.path.join(cut, "sft", "checkpoints")
    last = pl.tools.latest_checkpoint(ckpts)
    assert last.endswith("iter_00000004")
    shutil.rmtree(last)  # resume from step 2: the stopped run logged steps 2 and 3 after it
    assert pl.tools.latest_checkpoint(ckpts).endswith("iter_00000002")
    assert main([*argv, "--resume"]) == 0 and guard.attempts == []
    _assert_same_histories(_held_steps(cut), _held_steps(full))


_KILLED_RUN = """
import sys
from rlhf_eqx.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def _kill_when(proc: subprocess.Popen, ready, seconds: float = 240.0) -> None:
    """SIGKILL `proc` as soon as `ready()` holds (polled every 50 ms); the process must
    still be running then."""
    deadline = time.monotonic() + seconds
    while not ready():
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, f"not ready to kill after {seconds:.0f} s"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL


@pytest.mark.slow
def test_kill_9_then_resume_continues_each_tracker_run(uninterrupted_data_run, monkeypatch):
    from rlhf_eqx.__main__ import main

    tmp, full = uninterrupted_data_run
    guard = _offline(monkeypatch)
    killed = str(tmp / "killed")
    argv = _data_run_argv(tmp, killed)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}  # its own W&B service
    env.update(STEP_PAUSE="0.5", PYTHONPATH=os.pathsep.join([root, str(tmp)]))
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_RUN, *argv, "--callback", "pause_steps:Pause"], env=env
    )
    ckpts = os.path.join(killed, "sft", "checkpoints")

    def past_a_checkpoint() -> bool:  # a step logged after the checkpoint of step 2
        latest = pl.tools.latest_checkpoint(ckpts) if os.path.isdir(ckpts) else None
        try:
            steps = [r["step"] for r in _steps(killed).get("sft", [])]
        except (OSError, ValueError):  # not written yet, or a line being written
            return False
        return latest is not None and bool(steps) and steps[-1] >= int(latest[-8:])

    _kill_when(proc, past_a_checkpoint)
    assert int(pl.tools.latest_checkpoint(ckpts)[-8:]) < 6
    assert main([*argv, "--resume"]) == 0 and guard.attempts == []
    _assert_same_histories(_held_steps(killed), _held_steps(full))


def test_trackio_with_an_unwritable_store_says_so(tmp_path, monkeypatch, capsys):
    """A trackio store that cannot be written (here under a file; permissions do not stop
    root) is one line naming it and `TRACKIO_DIR`, as another tracker that cannot start
    is, rather than a tracker whose background writes fail unseen."""
    _need("trackio", "trackio")
    import trackio

    (tmp_path / "file").write_text("")
    store = tmp_path / "file" / "trackio"
    monkeypatch.setattr(trackio.utils, "TRACKIO_DIR", store)
    t = pl.trackers.open_trackers(["trackio"], str(tmp_path / "run"), {}, quiet=True)
    assert t.names == ()
    t.finish()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"tracker trackio: could not start (its store {store} is not writable")
    assert "TRACKIO_DIR" in err[0] and err[0].endswith("; the run goes on without it")
