"""The built-in experiment trackers: TensorBoard, Weights & Biases, MLflow and trackio,
each a `Tracker` (`_trackers.py`) registered under its name for `ops.trackers`.

Each keeps to local files unless the user configured a server:

| tracker | where it writes by default | what sends elsewhere |
| --- | --- | --- |
| `tensorboard` | `<run dir>/tensorboard/<stage>/` (`tensorboardX`) | nothing |
| `wandb` | offline run in `<run dir>/wandb/` | `WANDB_MODE=online` |
| `mlflow` | `sqlite:///<run dir>/mlflow.db` | `MLFLOW_TRACKING_URI` |
| `trackio` | its local store, `$TRACKIO_DIR` | `TRACKIO_SPACE_ID`, `TRACKIO_SERVER_URL` |

How stages show: TensorBoard keeps one event directory per stage (tags `<stage>/<metric>`,
its step axis the stage's step); the others keep one run per pipeline run with the
metrics prefixed by their stage (`sft/loss`, `dpo/loss`): W&B plots each stage against
its own step (`<stage>/step`, `define_metric`), MLflow and trackio record each metric at
the stage's step. The final summary is `summary/<stage>/<key>`.
"""

import json
import math
import os
import re
import time
from typing import Any

from ._trackers import Tracker, flatten, register_tracker


def _numbers(values: dict) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in values.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }


class TensorBoardTracker(Tracker):
    """TensorBoard scalars with `tensorboardX` (or `torch.utils.tensorboard`): one event
    directory per stage, `<run dir>/tensorboard/<stage>/`, tags `<stage>/<metric>` at the
    stage's step. The configuration and summary are not written (TensorBoard shows
    scalars); they are in `config.json` and `summary.json`."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.writers: dict[str, Any] = {}
        self._writer_class: Any = None

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

    def writer(self, stage: str) -> Any:
        """The `SummaryWriter` of `stage` (made on its first record)."""
        if stage not in self.writers:
            self.writers[stage] = self._writer_class(
                os.path.join(self.run_dir, "tensorboard", stage)
            )
        return self.writers[stage]

    def log(self, step: int, metrics: dict[str, float], stage: str) -> None:
        w = self.writer(stage)
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


class WandbTracker(Tracker):
    """A Weights & Biases run, offline by default: `WANDB_MODE` when set (`online`,
    `offline`, `disabled`), else `offline`; the run directory is `<run dir>/wandb/`
    (sync it later with `wandb sync <run dir>/wandb/offline-run-*`). Project
    `WANDB_PROJECT` or `rlhf_eqx`; the run's name, group and configuration as given.
    Each stage's metrics are `<stage>/<metric>` plotted against `<stage>/step`; the
    summary is `summary/...` in the run's summary."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.run: Any = None
        self.stages: set[str] = set()

    def start(self, run_name: str, config: dict, group: str | None) -> None:
        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "rlhf_eqx",
            name=run_name,
            group=group,
            config=config,
            dir=self.run_dir,
            mode=os.environ.get("WANDB_MODE") or "offline",
            reinit="create_new",
        )

    def log(self, step: int, metrics: dict[str, float], stage: str) -> None:
        if stage not in self.stages:
            self.run.define_metric(f"{stage}/step")
            self.run.define_metric(f"{stage}/*", step_metric=f"{stage}/step")
            self.stages.add(stage)
        row = {f"{stage}/{k}": v for k, v in metrics.items()}
        row[f"{stage}/step"] = step
        self.run.log(row)

    def summary(self, values: dict) -> None:
        flat = flatten(values, "summary")
        self.run.summary.update({k: v for k, v in flat.items() if v is not None})

    def finish(self) -> None:
        self.run.finish()


_MLFLOW_NAME = re.compile(r"[^\w\-. :/]")


class MLflowTracker(Tracker):
    """An MLflow run: tracking URI `MLFLOW_TRACKING_URI` when set, else a SQLite store in
    the run directory, `sqlite:///<run dir>/mlflow.db` (open it with
    `mlflow ui --backend-store-uri sqlite:///<run dir>/mlflow.db`). Experiment
    `MLFLOW_EXPERIMENT_NAME` or `rlhf_eqx`; the group is the run's `group` tag. The
    configuration is the run's parameters (dotted names, `sft.steps`), each stage's
    metrics `<stage>/<metric>` at the stage's step, and the summary `summary/...`
    metrics (numbers) and tags (words)."""

    def __init__(self, run_dir: str):
        self.run_dir = os.path.abspath(run_dir)
        self.client: Any = None
        self.run_id: str | None = None
        self.tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or (
            "sqlite:///" + os.path.join(self.run_dir, "mlflow.db")
        )

    def start(self, run_name: str, config: dict, group: str | None) -> None:
        import logging

        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        quiet = [logging.getLogger(n) for n in ("mlflow", "alembic")]
        levels = [q.level for q in quiet]
        for q in quiet:
            q.setLevel(logging.WARNING)  # the store's table-creation notes
        try:
            self.client = MlflowClient(tracking_uri=self.tracking_uri)
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "rlhf_eqx"
            exp = self.client.get_experiment_by_name(name)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
        finally:
            for q, level in zip(quiet, levels):
                q.setLevel(level)
        tags = {"group": group} if group else {}
        self.run_id = self.client.create_run(exp_id, run_name=run_name, tags=tags).info.run_id
        params = [
            Param(k[:250], json.dumps(v) if not isinstance(v, str) else v[:6000])
            for k, v in flatten(config, sep=".").items()
        ]
        for i in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def _metrics(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(_MLFLOW_NAME.sub("_", k), v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def log(self, step: int, metrics: dict[str, float], stage: str) -> None:
        self._metrics({f"{stage}/{k}": v for k, v in metrics.items()}, step)

    def summary(self, values: dict) -> None:
        flat = flatten(values, "summary")
        self._metrics({k: v for k, v in _numbers(flat).items() if math.isfinite(v)}, 0)
        for k, v in flat.items():
            if isinstance(v, str):
                self.client.set_tag(self.run_id, _MLFLOW_NAME.sub("_", k), v[:5000])

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)


class TrackioTracker(Tracker):
    """A trackio run in its local store (`$TRACKIO_DIR`, default
    `~/.cache/huggingface/trackio`; `trackio show` opens the dashboard). It syncs to a
    Hugging Face Space or a server only when `TRACKIO_SPACE_ID` or `TRACKIO_SERVER_URL`
    is set, and never launches a dashboard itself. Project `TRACKIO_PROJECT` or
    `rlhf_eqx`; the run's name, group and configuration as given. Each stage's metrics
    are `<stage>/<metric>` at the stage's step; the summary is `summary/...` logged at
    the run's last step. One trackio run at a time in a process (`trackio.init` ends
    the previous one)."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.run: Any = None
        self.last_step = 0

    def start(self, run_name: str, config: dict, group: str | None) -> None:
        import trackio

        self.run = trackio.init(
            project=os.environ.get("TRACKIO_PROJECT") or "rlhf_eqx",
            name=run_name,
            group=group,
            config=config,
            embed=False,
            auto_log_gpu=False,
            auto_log_cpu=False,
        )

    def log(self, step: int, metrics: dict[str, float], stage: str) -> None:
        self.last_step = max(self.last_step, step)
        self.run.log({f"{stage}/{k}": v for k, v in metrics.items()}, step=step)

    def summary(self, values: dict) -> None:
        numbers = _numbers(flatten(values, "summary"))
        if numbers:
            self.run.log(numbers, step=self.last_step)

    def finish(self) -> None:
        self.run.finish()


register_tracker("tensorboard", TensorBoardTracker)
register_tracker("wandb", WandbTracker)
register_tracker("mlflow", MLflowTracker)
register_tracker("trackio", TrackioTracker)
