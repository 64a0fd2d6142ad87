"""The metrics log (`metrics.jsonl`, optional TensorBoard scalars) and progress bars."""

import json
import os
import sys
from typing import Any

from ._monitor import tensorboard_writer


def _float(v: Any) -> Any:
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    try:
        return float(v)
    except (TypeError, ValueError):
        return str(v)


class MetricsLog:
    """Append-only JSON lines (`metrics.jsonl` in the run directory): one line per step
    (`{"stage", "iteration", "step", ...metrics}`), per evaluation (`"eval": true`) and
    per event (`"event": ...`, e.g. a rollback)."""

    def __init__(self, run_dir: str, stage: str, *, quiet: bool = False, tensorboard: bool = False):
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.stage = stage
        self.quiet = quiet
        self.writer = (
            tensorboard_writer(os.path.join(run_dir, "tensorboard", stage)) if tensorboard else None
        )

    def write(self, record: dict) -> None:
        line = {"stage": self.stage, **{k: _float(v) for k, v in record.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")
        if self.writer is not None and "step" in line and "event" not in line:
            for k, v in line.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                    self.writer.add_scalar(f"{self.stage}/{k}", v, global_step=line["step"])
            self.writer.flush()

    def event(self, kind: str, message: str, **fields: Any) -> None:
        self.write({"event": kind, "message": message, **fields})
        print(f"[{self.stage}] {kind}: {message}", file=sys.stderr)

    def info(self, message: str) -> None:
        if not self.quiet:
            print(f"[{self.stage}] {message}")


def progress(total: int, initial: int, desc: str, quiet: bool):
    if quiet:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=initial, desc=desc, leave=False, file=sys.stderr)
