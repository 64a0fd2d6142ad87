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
import os
import socket
import struct
import sys
import tempfile

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


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


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
    guard = _Guard()
    try:
        for var in NETWORK_SETTINGS:
            mp.delenv(var, raising=False)
        mp.setenv("WANDB_SILENT", "true")
        mp.setenv("WANDB_CONSOLE", "off")
        guard.install(mp)
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


def _tensorboard_scalars(directory: str) -> dict[str, dict[int, float]]:
    """`{tag: {step: value}}` of the event files in `directory`, read with TensorBoard's
    event accumulator when installed, else with tensorboardX's protocol buffers."""
    out: dict[str, dict[int, float]] = {}
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        from tensorboardX.proto.event_pb2 import Event

        for path in sorted(glob.glob(os.path.join(directory, "events.out.tfevents.*"))):
            for data in _tfrecords(path):
                ev = Event.FromString(data)
                for v in ev.summary.value:
                    out.setdefault(v.tag, {})[ev.step] = v.simple_value
        return out
    acc = EventAccumulator(directory)
    acc.Reload()
    for tag in acc.Tags()["scalars"]:
        out[tag] = {e.step: e.value for e in acc.Scalars(tag)}
    return out


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


def _wandb_records(path: str):
    """The records of a W&B transaction log (`run-<id>.wandb`): a 7-byte header, then
    LevelDB-log chunks in 32 KiB blocks (CRC, length, type), each record a
    `wandb_internal_pb2.Record`."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        n, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if kind == 0:  # the block's zero padding
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind == 2:
            pending = chunk
            continue
        if kind == 3:
            pending += chunk
            continue
        record = pb.Record()
        record.ParseFromString(pending + chunk if kind == 4 else chunk)
        pending = b""
        yield record


def _item(item) -> tuple[str, object]:
    key = "/".join(item.nested_key) if item.nested_key else item.key
    return key, json.loads(item.value_json)


def test_wandb_offline_run_holds_config_group_steps_and_summary(tracked_run):
    _need("wandb", "wandb")
    run_dir, summary, *_ = tracked_run
    (path,) = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    records = list(_wandb_records(path))
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


def test_a_missing_library_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pl.trackers.open_trackers(["wandb"], str(tmp_path), {}) as trackers:
        assert trackers.names == ()
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("tracker wandb: could not start (")
    assert line.endswith("); the run goes on without it")


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
