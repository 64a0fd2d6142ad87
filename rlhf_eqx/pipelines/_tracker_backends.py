"""The built-in experiment trackers: TensorBoard, Weights & Biases, MLflow and trackio,
each a `Tracker` (`_trackers.py`) registered under its name for `ops.trackers`.

Each keeps to local files unless the user configured a server:

| tracker | where it writes by default | what sends elsewhere |
| --- | --- | --- |
| `tensorboard` | `<run dir>/tensorboard/<stage>/` (`tensorboardX`) | nothing |
| `wandb` | offline run in `<run dir>/wandb/` (W&B's analytics off) | `WANDB_MODE=online` |
| `mlflow` | `sqlite:///<run dir>/mlflow.db` (MLflow's telemetry off) | `MLFLOW_TRACKING_URI` |
| `trackio` | its local store, `$TRACKIO_DIR` | `TRACKIO_SPACE_ID`, `TRACKIO_SERVER_URL` |

How stages show: TensorBoard keeps one event directory per stage (tags `<stage>/<metric>`,
its step axis the stage's step); the others keep one run per pipeline run with the
metrics prefixed by their stage (`sft/loss`, `dpo/loss`): W&B plots each stage against
its own step (`<stage>/step`, `define_metric`), MLflow and trackio record each metric at
the stage's step. The final summary is `summary/<stage>/<key>`.

How a resumed run continues each (`Tracker.resume`, from `trackers.json`): TensorBoard
writes to the same stage directories, its first record of a stage purging the steps at
and after it (`purge_step`: the stopped run's steps after its last checkpoint); MLflow
reopens the recorded run id; trackio reopens the run by name (`resume="must"`); W&B
opens the recorded run id (`resume="allow"`: offline, a second `offline-run-*-<id>`
directory), its internal `_step` continuing after the stopped run's. MLflow, trackio
and W&B offline cannot delete what a run holds: a resumed run reads which metrics the run
already holds at which steps and does not log those again (`_Held`), so the steps the
stopped run logged after its last checkpoint, repeated by the resumed run, are there
once, with their first values (the same values when the resume is bit-identical; the
stopped run's measured times). What the stopped run's tracker lost (a killed process:
W&B and trackio write from buffers) is logged again from `metrics.jsonl` when the run
reopens (`_replay`). The summary is logged when a run finishes: a run that stopped
cleanly (a callback) and is resumed logs a second one, the run's latest. A new tracker
run of a resumed run (none recorded: a tracker added on resume, a lost record) catches
up (`catch_up`): it logs the run's earlier records from `metrics.jsonl`, then each step
once, as a reopened one; TensorBoard writes them into a stage directory without events
and purges the steps after the checkpoint.
"""

import contextlib
import contextvars
import glob
import json
import math
import os
import re
import tempfile
import time
from collections.abc import Iterator, Mapping
from typing import Any

from ._trackers import Tracker, flatten, register_tracker, starting_quietly


def _numbers(values: dict) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in values.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }


class _Held:
    """The metrics a reopened run holds, by key and step. A resumed run repeats the steps
    the stopped run logged after its last checkpoint; `new` keeps only the metrics the
    run does not hold yet at a step, and holds them from then on (a step's first value
    stays: the same value when the resume is bit-identical, a measured time of the
    stopped run). A run that was not reopened (`resumed` false) logs everything."""

    def __init__(self):
        self.keys: set[tuple[str, int]] = set()
        self.last_step = -1
        self.resumed = False

    def add(self, key: str, step: int) -> None:
        self.keys.add((key, int(step)))
        self.last_step = max(self.last_step, int(step))

    def new(self, step: int, row: dict[str, float]) -> dict[str, float]:
        if not self.resumed:
            return row
        out = {k: v for k, v in row.items() if (k, int(step)) not in self.keys}
        for k in out:
            self.add(k, step)
        return out


def _replay(tracker: Tracker, run_dir: str) -> None:
    """Send `tracker` again the records of `run_dir/metrics.jsonl` that went to the
    trackers (steps and evaluations, not events): its `_Held` filter keeps only those its
    store lost, e.g. what a killed run's tracker had not yet written (W&B's and trackio's
    buffered records)."""
    for step, numbers, stage in _logged(run_dir):
        tracker.log(step, numbers, stage)


def _logged(run_dir: str) -> Iterator[tuple[int, dict[str, float], str]]:
    """`(step, numbers, stage)` of each record of `run_dir/metrics.jsonl` that goes to
    the trackers (steps and evaluations, not events; a torn last line skipped)."""
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            lines = f.readlines()
    except FileNotFoundError:
        return
    from ._metrics import from_json  # (the metrics log imports the trackers)

    for line in lines:
        try:
            record = from_json(json.loads(line))  # non-finite numbers are strings there
        except ValueError:  # a torn last line
            continue
        if "step" in record and "event" not in record:
            numbers = {k: v for k, v in _numbers(record).items() if k != "step"}
            if numbers:
                yield int(record["step"]), numbers, str(record.get("stage", "run"))


def _catch_up(tracker: Tracker, held: "_Held", run_dir: str) -> None:
    """A new run of a resumed run (`trackers.json` had none to reopen) logs the run's
    earlier records of `metrics.jsonl` and then, as a reopened one, each step once."""
    held.resumed = True
    _replay(tracker, run_dir)


def _prefixed(stage: str, metrics: dict[str, float]) -> dict[str, float]:
    """`metrics` named `<stage>/<metric>`."""
    return {f"{stage}/{k}": v for k, v in metrics.items()}


def _run_options(project_variable: str, run_name: str, group: str | None, config: dict):
    """The project (`$<project_variable>` or `rlhf_eqx`), name, group and configuration
    of a W&B or trackio run."""
    project = os.environ.get(project_variable) or "rlhf_eqx"
    return dict(project=project, name=run_name, group=group, config=config)


class TensorBoardTracker(Tracker):
    """TensorBoard scalars with `tensorboardX` (or `torch.utils.tensorboard`): one event
    directory per stage, `<run dir>/tensorboard/<stage>/`, tags `<stage>/<metric>` at the
    stage's step. The configuration and summary are not written (TensorBoard shows
    scalars); they are in `config.json` and `summary.json`."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.writers: dict[str, Any] = {}
        self._writer_class: Any = None
        self.resumed = False

    def start(self, run_name: str, config: dict, group: str | None) -> None:
        del run_name, config, group
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ImportError(
                    "needs tensorboardX: pip install 'rlhf_eqx[tensorboard]'"
                ) from None
        self._writer_class = SummaryWriter

    def identity(self) -> dict:
        return {"log_dir": "tensorboard"}  # in the run directory

    def resume(self, run_name: str, config: dict, group: str | None, identity: dict) -> None:
        del identity  # the run directory's own
        self.start(run_name, config, group)
        self.resumed = True

    def catch_up(self) -> None:
        """A new tracker run of a resumed run: a stage directory without events (the
        tracker added on resume) gets the stage's earlier records of `metrics.jsonl`;
        then, as a reopened run, the first record of each stage purges the events at
        and after it (those of steps after the checkpoint, which the run repeats)."""
        root = os.path.join(self.run_dir, "tensorboard")
        have = {
            stage
            for stage in (os.listdir(root) if os.path.isdir(root) else ())
            if glob.glob(os.path.join(root, glob.escape(stage), "events.out.tfevents.*"))
        }
        for step, numbers, stage in _logged(self.run_dir):
            if stage not in have:
                self.log(step, numbers, stage)
        self.finish()  # the next record of each stage opens a purging event file
        self.writers = {}
        self.resumed = True

    def writer(self, stage: str, purge_step: int | None = None) -> Any:
        """The `SummaryWriter` of `stage` (made on its first record; in a resumed run,
        `purge_step` makes TensorBoard drop the earlier events at and after it, and the
        new event file's name sorts after the stopped run's, which it never replaces)."""
        if stage not in self.writers:
            resumed = (
                {"purge_step": purge_step, "filename_suffix": f".{time.time_ns()}"}
                if purge_step is not None
                else {}
            )
            self.writers[stage] = self._writer_class(
                os.path.join(self.run_dir, "tensorboard", stage), **resumed
            )
        return self.writers[stage]

    def log(self, step: int, metrics: dict[str, float], stage: str) -> None:
        w = self.writer(stage, step if self.resumed else None)
        with _quiet_logger("tensorboardX.x2num"):  # its "NaN or Inf found" per value
            for k, v in metrics.items():
                w.add_scalar(f"{stage}/{k}", v, global_step=step)
        w.flush()

    def summary(self, values: dict) -> None:
        del values

    def finish(self) -> None:
        for w in self.writers.values():
            close = getattr(w, "close", None)
            if close is not None:
                close()


@contextlib.contextmanager
def _quiet_logger(name: str) -> Iterator[None]:
    """The logger `name`'s warnings dropped: tensorboardX warns `NaN or Inf found in input
    tensor.` for each non-finite value, which a diverged step logs on purpose (its
    `metrics.jsonl` record and the console's `diverged` line say what happened)."""
    import logging

    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


class WandbTracker(Tracker):
    """A Weights & Biases run, offline by default: `WANDB_MODE` when set (`online`,
    `offline`, `disabled`), else `offline`; the run directory is `<run dir>/wandb/`
    (sync it later with `wandb sync <run dir>/wandb/offline-run-*`). Project
    `WANDB_PROJECT` or `rlhf_eqx`; the run's name, group and configuration as given.
    Each stage's metrics are `<stage>/<metric>` plotted against `<stage>/step`; the
    summary is `summary/...` in the run's summary.

    Resumed, it opens the recorded run id with `resume="allow"`. Offline, W&B cannot
    reopen a run: it writes a second `offline-run-*-<id>` directory for the same id,
    whose internal `_step` would restart at 0; this tracker reads the earlier
    directories' transaction logs (`wandb_records`) and continues `_step` after their
    last one, and leaves out the metrics they already hold at a step. A killed run's W&B
    service loses the records it had not written (it writes its log in 32 KiB blocks:
    a small run's whole history); the resumed run logs them again from `metrics.jsonl`.
    Upload the parts in order into the one run (`wandb sync --append`, oldest first)."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.run: Any = None
        self.stages: set[str] = set()
        self.held = _Held()
        self.next_step: int | None = None  # the `_step` of the next row (resumed)
        self.exit_code: int | None = None  # 1 after `fail`
        self.summarised: set[str] = set()  # summary keys the run holds (resumed)

    def start(self, run_name: str, config: dict, group: str | None, **resume) -> None:
        import wandb

        mode = os.environ.get("WANDB_MODE") or "offline"
        if mode != "online":
            _no_wandb_analytics()
        # a quiet run: W&B's banner and run summary (some 20 lines on stderr a run) left
        # out, its warnings kept; offline, W&B prints its three lines of where the run
        # is stored even in its quiet mode, so only its silent mode leaves them out (the
        # run's own line names a tracker that fails to start)
        quiet = {}
        if starting_quietly():
            quiet = {"settings": wandb.Settings(quiet=True, silent=mode != "online")}
        self.run = wandb.init(
            **_run_options("WANDB_PROJECT", run_name, group, config),
            dir=self.run_dir,
            mode=mode,
            reinit="create_new",
            **quiet,
            **resume,
        )

    def identity(self) -> dict:
        return {"id": self.run.id, "project": self.run.project}

    def resume(self, run_name: str, config: dict, group: str | None, identity: dict) -> None:
        last = -1
        pattern = os.path.join(self.run_dir, "wandb", f"*-{identity['id']}", "run-*.wandb")
        for path in sorted(glob.glob(pattern)):
            for record in wandb_records(path):
                if record.WhichOneof("record_type") == "summary":
                    self.summarised |= {_wandb_key(i) for i in record.summary.update}
                    self.summarised -= {_wandb_key(i) for i in record.summary.remove}
                if record.WhichOneof("record_type") != "history":
                    continue
                row = {_wandb_key(i): json.loads(i.value_json) for i in record.history.item}
                last = max(last, int(row.get("_step", -1)))
                for key in row:
                    stage = key.split("/")[0]
                    if f"{stage}/step" in row and key != f"{stage}/step":
                        self.held.add(key, row[f"{stage}/step"])
        self.start(run_name, config, group, id=identity["id"], resume="allow")
        self.next_step, self.held.resumed = last + 1, True
        _replay(self, self.run_dir)

    def catch_up(self) -> None:
        _catch_up(self, self.held, self.run_dir)

    def log(self, step: int, metrics: dict[str, float], stage: str) -> None:
        if stage not in self.stages:
            self.run.define_metric(f"{stage}/step")
            self.run.define_metric(f"{stage}/*", step_metric=f"{stage}/step")
            self.stages.add(stage)
        row = self.held.new(step, _prefixed(stage, metrics))
        if not row:
            return
        row[f"{stage}/step"] = step
        if self.next_step is None:
            self.run.log(row)
        else:
            self.run.log(row, step=self.next_step)
            self.next_step += 1

    def summary(self, values: dict) -> None:
        """The run's summary `summary/...`; a resumed run's earlier summary keys that this
        one lacks (a callback's `stop_reason` of the stopped run) are removed."""
        flat = {k: v for k, v in flatten(values, "summary").items() if v is not None}
        self.run.summary.update(flat)
        for key in sorted(k for k in self.summarised - set(flat) if k.startswith("summary/")):
            del self.run.summary[key]

    def fail(self, error: BaseException) -> None:
        del error
        self.exit_code = 1

    def finish(self) -> None:
        self.run.finish(exit_code=self.exit_code)


def _wandb_key(item: Any) -> str:
    """The key of an item of a W&B history or summary record (its parts joined by `/`)."""
    return "/".join(item.nested_key) if item.nested_key else item.key


def _no_wandb_analytics() -> None:
    """Turn W&B's own analytics off in this process. Its exporter (OpenTelemetry, in W&B
    0.31) follows the process's settings, not the run's, and posts to W&B's server from a
    background thread even while the run is offline."""
    try:
        from wandb.analytics.opentelemetry import opentelemetry_proxy
    except ImportError:  # a W&B without it
        return
    disable = getattr(opentelemetry_proxy, "disable", None)
    if disable is not None:
        disable()


def wandb_records(path: str) -> Iterator[Any]:
    """The records of a W&B transaction log (`<run dir>/wandb/offline-run-*/run-<id>.wandb`),
    each a `wandb.proto.wandb_internal_pb2.Record`, in the order written. The file is a
    7-byte header (`:W&B`, version) and then LevelDB-log chunks in 32 KiB blocks (a
    7-byte chunk header: CRC, length, type 1 whole / 2 first / 3 middle / 4 last; the
    block's tail under 7 bytes, and type 0, are padding). A torn last chunk (a killed
    writer) ends the records.

    **Arguments:**

    - `path`: the `.wandb` file.

    **Returns:** an iterator over its records (`record.WhichOneof("record_type")`:
    `"run"`, `"history"`, `"summary"`, `"config"`, `"metric"`, ...).
    """
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B transaction log (no :W&B header)")
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        n, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if left < 7 or kind == 0:  # the block's padding
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + n], pos + 7 + n
        if len(chunk) < n:
            return
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


_MLFLOW_NAME = re.compile(r"[^\w\-. :/]")
_MLFLOW_KEY_LENGTH = 250


def _mlflow_key(name: str) -> str:
    """`name` as an MLflow metric or tag key: the characters MLflow refuses replaced by
    `_`, empty parts of the path dropped and `.` / `..` parts spelt `_` / `__` (MLflow
    refuses a key that a path would resolve to another: `a//b`, `a/../b`, `a/`), and cut
    to MLflow's 250 characters. A metric named so is logged, where MLflow's refusal
    dropped the tracker for the rest of the run."""

    def tidy(key: str) -> str:
        parts = [p.replace(".", "_") if p in (".", "..") else p for p in key.split("/")]
        return "/".join(p for p in parts if p) or "_"

    return tidy(tidy(_MLFLOW_NAME.sub("_", name))[:_MLFLOW_KEY_LENGTH])


class MLflowTracker(Tracker):
    """An MLflow run: tracking URI `MLFLOW_TRACKING_URI` when set, else a SQLite store in
    the run directory, `sqlite:///<run dir>/mlflow.db` (open it with
    `mlflow ui --backend-store-uri sqlite:///<run dir>/mlflow.db`). Experiment
    `MLFLOW_EXPERIMENT_NAME` or `rlhf_eqx`; the group is the run's `group` tag. The
    configuration is the run's parameters (dotted names, `sft.steps`), each stage's
    metrics `<stage>/<metric>` at the stage's step, and the summary `summary/...`
    metrics (numbers) and tags (words).

    Resumed, it reopens the recorded run id (status `RUNNING` again) and reads its metric
    histories: a metric history cannot be cut, so the steps the stopped run logged after
    its last checkpoint stay, and the resumed run logs a metric at a step only when the
    history does not hold it there (each step once, its first value). Parameters
    are immutable in MLflow: those the run has keep their first value. A run that
    ends with an exception is `FAILED` (`KILLED` when interrupted); a resume makes it
    `RUNNING` again."""

    def __init__(self, run_dir: str):
        self.run_dir = os.path.abspath(run_dir)
        self.client: Any = None
        self.run_id: str | None = None
        self.held = _Held()
        self.status = "FINISHED"
        self.summary_tags: set[str] = set()  # the summary's words the run holds (resumed)
        self.tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or (
            "sqlite:///" + os.path.join(self.run_dir, "mlflow.db")
        )

    def _experiment(self) -> str:
        """Connect to the store; the experiment's id (made when new)."""
        import logging

        _no_mlflow_telemetry()
        from mlflow.tracking import MlflowClient

        quiet = [logging.getLogger(n) for n in ("mlflow", "alembic")]
        levels = [q.level for q in quiet]
        for q in quiet:
            q.setLevel(logging.WARNING)  # the store's table-creation notes
        try:
            self.client = MlflowClient(tracking_uri=self.tracking_uri)
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "rlhf_eqx"
            with _first_contact():
                exp = self.client.get_experiment_by_name(name)
            return exp.experiment_id if exp is not None else self.client.create_experiment(name)
        finally:
            for q, level in zip(quiet, levels):
                q.setLevel(level)

    def _params(self, config: dict, held: Mapping[str, str]) -> None:
        from mlflow.entities import Param

        params = [
            Param(k[:250], json.dumps(v) if not isinstance(v, str) else v[:6000])
            for k, v in flatten(config, sep=".").items()
            if k[:250] not in held
        ]
        for i in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def start(self, run_name: str, config: dict, group: str | None) -> None:
        exp_id = self._experiment()
        tags = {"group": group} if group else {}
        self.run_id = self.client.create_run(exp_id, run_name=run_name, tags=tags).info.run_id
        self._params(config, {})

    def identity(self) -> dict:
        return {"run_id": self.run_id, "tracking_uri": self.tracking_uri}

    def resume(self, run_name: str, config: dict, group: str | None, identity: dict) -> None:
        del run_name
        self._experiment()
        run = self.client.get_run(identity["run_id"])  # raises for a run the store lacks
        self.run_id = run.info.run_id
        self.client.update_run(self.run_id, status="RUNNING")
        self.summary_tags = {k for k in run.data.tags if k.startswith("summary/")}
        for key in run.data.metrics:
            for m in self.client.get_metric_history(self.run_id, key):
                self.held.add(key, m.step)
        if group:
            self.client.set_tag(self.run_id, "group", group)
        self._params(config, run.data.params)
        self.held.resumed = True
        _replay(self, self.run_dir)

    def catch_up(self) -> None:
        _catch_up(self, self.held, self.run_dir)

    def _metrics(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        named = {_mlflow_key(k): v for k, v in values.items()}  # one value a key
        metrics = [Metric(k, v, now, step) for k, v in named.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def log(self, step: int, metrics: dict[str, float], stage: str) -> None:
        named = {_mlflow_key(k): v for k, v in _prefixed(stage, metrics).items()}
        self._metrics(self.held.new(step, named), step)

    def summary(self, values: dict) -> None:
        """The summary's numbers as `summary/...` metrics at step 0 and its words as
        tags; a resumed run's earlier summary tags that this summary lacks (a callback's
        `stop_reason` of the stopped run) are deleted."""
        flat = flatten(values, "summary")
        self._metrics({k: v for k, v in _numbers(flat).items() if math.isfinite(v)}, 0)
        words = {_mlflow_key(k): v for k, v in flat.items() if isinstance(v, str)}
        for k, v in words.items():
            self.client.set_tag(self.run_id, k, v[:5000])
        for k in sorted(self.summary_tags - set(words)):
            self.client.delete_tag(self.run_id, k)

    def fail(self, error: BaseException) -> None:
        self.status = "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED"

    def finish(self) -> None:
        self.client.set_terminated(self.run_id, status=self.status)


_FIRST_CONTACT = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "15"}
"""MLflow's HTTP settings for the tracker's first request to a tracking server, where the
user has not set them."""


@contextlib.contextmanager
def _first_contact() -> Iterator[None]:
    """One retry and a 15 s timeout (`_FIRST_CONTACT`) for the first request to an MLflow
    tracking server, unless the environment sets them: with MLflow's defaults (7 retries,
    backoff factor 2, 120 s timeouts) a wrong or unreachable `MLFLOW_TRACKING_URI` held
    each run (each member of a sweep) for minutes before the tracker gave up on it.
    Later requests keep MLflow's settings."""
    added = {k: v for k, v in _FIRST_CONTACT.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def _no_mlflow_telemetry() -> None:
    """Turn MLflow's usage telemetry off in this process (unless `MLFLOW_DISABLE_TELEMETRY`
    says otherwise). MLflow 3 starts it on `import mlflow` and, from a background thread,
    fetches its configuration from and posts usage records to its telemetry service
    (`mlflow-telemetry.io`), whatever the tracking URI."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    try:
        from mlflow.telemetry import set_telemetry_client
    except ImportError:  # an MLflow without it
        return
    set_telemetry_client()  # re-reads the setting: drops the client an earlier import made


class TrackioTracker(Tracker):
    """A trackio run in its local store (`$TRACKIO_DIR`, default
    `~/.cache/huggingface/trackio`; `trackio show` opens the dashboard). It syncs to a
    Hugging Face Space or a server only when `TRACKIO_SPACE_ID` or `TRACKIO_SERVER_URL`
    is set, and never launches a dashboard itself. A store that cannot be written is
    refused when the run starts (one line naming it, as for a tracker that cannot
    start), not left to fail in trackio's background writer. Project `TRACKIO_PROJECT` or
    `rlhf_eqx`; the run's name, group and configuration as given. Each stage's metrics
    are `<stage>/<metric>` at the stage's step; the summary is `summary/...` logged at
    the run's last step. Each run is started in a context of its own, so that several
    (a sweep's members) stay open together in one process (`trackio.init` ends the
    current run of its context).

    Resumed, it reopens the recorded run by name (`trackio.init(resume="must")`, checked
    against the recorded run id) and reads what it holds: the resumed run logs a metric
    at a step only when the run does not hold it there (each step once, its first
    value). trackio writes from a background thread, so a killed run may lose its last
    records: the resumed run logs them again from `metrics.jsonl`."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.run: Any = None
        self.held = _Held()

    def start(self, run_name: str, config: dict, group: str | None, **resume) -> None:
        import trackio

        _writable_store(str(trackio.utils.TRACKIO_DIR))
        # in a context of its own: `trackio.init` ends the context's current run, and a
        # sweep's members keep their runs open together
        self.run = contextvars.Context().run(
            trackio.init,
            **_run_options("TRACKIO_PROJECT", run_name, group, config),
            embed=False,
            auto_log_gpu=False,
            auto_log_cpu=False,
            **resume,
        )

    def identity(self) -> dict:
        return {"project": self.run.project, "name": self.run.name, "id": self.run.id}

    def resume(self, run_name: str, config: dict, group: str | None, identity: dict) -> None:
        from trackio.sqlite_storage import SQLiteStorage

        del run_name
        self.start(identity["name"], config, group, resume="must")
        if self.run.id != identity["id"]:
            raise ValueError(f"run {identity['name']!r} is another run than {identity['id']}")
        for row in SQLiteStorage.get_logs(self.run.project, run_id=self.run.id):
            for key in _numbers(row):
                if key not in ("step", "timestamp"):
                    self.held.add(key, row["step"])
        self.held.resumed = True
        _replay(self, self.run_dir)

    def catch_up(self) -> None:
        _catch_up(self, self.held, self.run_dir)

    def log(self, step: int, metrics: dict[str, float], stage: str) -> None:
        row = self.held.new(step, _prefixed(stage, metrics))
        self.held.last_step = max(self.held.last_step, step)
        if row:
            self.run.log(row, step=step)

    def summary(self, values: dict) -> None:
        numbers = _numbers(flatten(values, "summary"))
        if numbers:
            self.run.log(numbers, step=max(self.held.last_step, 0))

    def finish(self) -> None:
        self.run.finish()


def _writable_store(where: str) -> None:
    """Refuse (`OSError`, naming the directory and `TRACKIO_DIR`) a trackio store that
    cannot be written: trackio writes from a background thread, whose failures would
    only warn while the run believes it is tracked."""
    try:
        os.makedirs(where, exist_ok=True)
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as e:
        raise OSError(
            f"its store {where} is not writable ({e.strerror or e}); set TRACKIO_DIR to a "
            "writable directory"
        ) from None


register_tracker("tensorboard", TensorBoardTracker)
register_tracker("wandb", WandbTracker)
register_tracker("mlflow", MLflowTracker)
register_tracker("trackio", TrackioTracker)
