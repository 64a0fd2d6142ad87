"""The metrics log (`metrics.jsonl`, and the run's experiment trackers) and progress bars;
how a run writes its JSON files for other tools and reads them back.

**Non-finite numbers in JSON.** A NaN or infinite number (a diverged loss, the KL of a
policy far from its reference) is written as the string `"NaN"`, `"Infinity"` or
`"-Infinity"` in every JSON file a run writes for other tools (`metrics.jsonl`,
`summary.json`, `seeds_summary.json`, a sweep's `sweep_summary.json` and its members'
files): the bare tokens Python writes by default are not JSON (`jq`, JavaScript's
`JSON.parse` and most readers refuse the file). The strings are the tokens' own
spelling, so `float(s)` in Python and `Number(s)` in JavaScript read them back; the
library's readers (`read_json`, `from_json`) read both these files and older ones with
the bare tokens."""

import errno
import json
import math
import numbers
import os
import sys
from collections.abc import Callable
from typing import Any

from ._trackers import Trackers, active_trackers, start_trackers


class DiskFullError(OSError):
    """No space left on the device of a run's directory; the message names it."""

    def __init__(self, directory: str, detail: str = ""):
        super().__init__(errno.ENOSPC, f"no space left on the device of {directory}{detail}")

    def __str__(self) -> str:
        return str(self.strerror)


NONFINITE_JSON: dict[str, float] = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
"""How a non-finite number is written in the run's JSON files, and read back."""


def to_json(value: Any) -> Any:
    """`value` (dicts, lists and tuples of JSON values) with every NaN or infinite number
    replaced by its string in `NONFINITE_JSON`: what `json.dumps(..., allow_nan=False)`
    accepts."""
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        x = float(value)
        if math.isfinite(x):
            return value
        return "NaN" if x != x else ("Infinity" if x > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    return value


def from_json(value: Any) -> Any:
    """`value` read from a run's JSON file with the strings of `NONFINITE_JSON` read
    back as the numbers they stand for (what `to_json` wrote); the bare tokens of older
    files are numbers already (`json.loads` reads them)."""
    if isinstance(value, str):
        return NONFINITE_JSON.get(value, value)
    if isinstance(value, dict):
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value


def json_text(value: Any, **kwargs: Any) -> str:
    """`value` as JSON text (`json.dumps` with `kwargs`), non-finite numbers as strings
    (`to_json`): a file any JSON reader reads."""
    return json.dumps(to_json(value), allow_nan=False, **kwargs)


def read_json(path: str) -> Any:
    """The JSON value of the file `path`, non-finite numbers read back (`from_json`)."""
    with open(path) as f:
        return from_json(json.load(f))


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
    per event (`"event": ...`, e.g. a rollback).

    Step and evaluation lines also go to the experiment trackers open for the run
    directory (`open_trackers`; `ops.trackers`), with this log's stage: their numbers
    (not `step`, booleans or words) exactly as written here. `tensorboard=True` without
    open trackers starts a TensorBoard tracker for this log alone."""

    def __init__(self, run_dir: str, stage: str, *, quiet: bool = False, tensorboard: bool = False):
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, "metrics.jsonl")
        repair_metrics(self.path)
        self.stage = stage
        self.quiet = quiet
        self._dir_synced = False
        self._own: Trackers | None = None
        if tensorboard and active_trackers(run_dir) is None:
            self._own = start_trackers(("tensorboard",), run_dir, {})

    @property
    def trackers(self) -> Trackers | None:
        """The experiment trackers this log's records go to (`None`: none)."""
        if self._own is not None:
            return self._own
        return active_trackers(self.run_dir)

    @property
    def writer(self) -> Any:
        """This stage's TensorBoard `SummaryWriter`, `None` without a TensorBoard tracker."""
        trackers = self.trackers
        tb = None if trackers is None else trackers.trackers.get("tensorboard")
        return None if tb is None else tb.writer(self.stage)

    def write(self, record: dict) -> None:
        line = {"stage": self.stage, **{k: _float(v) for k, v in record.items()}}
        text = json_text(line) + "\n"  # trackers get the numbers themselves (below)
        try:
            with open(self.path, "a") as f:
                f.write(text)
        except OSError as e:
            repair_metrics(self.path)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFullError(self.run_dir) from None
            raise
        trackers = self.trackers
        if trackers is not None and "step" in line and "event" not in line:
            numbers = {
                k: float(v)
                for k, v in line.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"
            }
            trackers.log(int(line["step"]), numbers, self.stage)

    def sync(self) -> None:
        """Flush the lines written so far to the device (`fsync`), and, the first time,
        the run directory's entry of the file: what a checkpoint's commit waits for, so
        that a power cut cannot keep a checkpoint whose metrics lines it lost. Once per
        checkpoint, not per line."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if not self._dir_synced:
            fsync_dir(self.run_dir)
            self._dir_synced = True

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


def fsync_dir(path: str) -> None:
    """Flush the entries of the directory `path` (files created, renamed or removed in it)
    to the device; a file system that cannot (`EINVAL`, `EBADF`, `EACCES`, ...) is let be."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO):
            raise
    finally:
        os.close(fd)


def repair_metrics(path: str) -> bool:
    """Cut a torn last line (one a crash left without its newline) off the JSON-lines
    file `path`; returns whether anything was cut."""
    try:
        with open(path, "rb+") as f:
            size = f.seek(0, os.SEEK_END)
            if size == 0:
                return False
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return False
            start = max(size - (1 << 20), 0)
            f.seek(start)
            tail = f.read()
            cut = tail.rfind(b"\n")
            f.truncate(start + cut + 1 if cut >= 0 else start)
            return True
    except FileNotFoundError:
        return False


def bad_line(path: str) -> tuple[int, str] | None:
    """The first line of the JSON-lines file `path` that is not a JSON object, as
    `(line number, why)`; `None` when every line is one (or there is no file). A torn
    last line (no newline: what `repair_metrics` cuts) is not counted."""
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip() or not line.endswith(b"\n"):
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                return n, f"not JSON: {getattr(e, 'msg', e)}"
            if not isinstance(rec, dict):
                return n, f"not a JSON object: {type(rec).__name__}"
    return None


def drop_records(path: str, drop: Callable[[dict], bool]) -> int:
    """Rewrite the JSON-lines file `path` without the records for which `drop(record)`
    is true (atomically: a temporary file and a rename); returns how many went."""
    if not os.path.isfile(path):
        return 0
    kept, n = [], 0
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                kept.append(line)
                continue
            if drop(rec):
                n += 1
            else:
                kept.append(line)
    if n:
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(path) or ".")
    return n


def logged_steps(path: str, stage: str, steps: int) -> tuple[list[int], list[int]]:
    """`(missing, repeated)`: the steps `0 .. steps - 1` of `stage` with no step record
    (`"step"`, no `"event"`, no `"eval"`) in the JSON-lines file `path`, and those with
    more than one: lines removed, lost or copied by hand. A run that reached step
    `steps` wrote each of them once (a rollback's steps go on)."""
    seen: dict[int, int] = {}
    if steps > 0 and os.path.isfile(path):
        with open(path, "rb") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if (
                    isinstance(rec, dict)
                    and rec.get("stage") == stage
                    and isinstance(rec.get("step"), int)
                    and 0 <= rec["step"] < steps
                    and "event" not in rec
                    and not rec.get("eval")
                ):
                    seen[rec["step"]] = seen.get(rec["step"], 0) + 1
    missing = [s for s in range(steps) if s not in seen]
    return missing, sorted(s for s, n in seen.items() if n > 1)


def step_ranges(steps: list[int]) -> str:
    """Sorted step numbers as runs: `[0, 1, 2, 5, 7, 8]` as `0-2, 5, 7-8`."""
    runs: list[list[int]] = []
    for s in steps:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
