"""The iteration loop's state and its checkpointed form: where a run stands after its last
completed iteration (`Position`), what the loop returns (`LoopResult`), how that position
is written to and read back from a checkpoint (`LoopCheckpoints`), and which records of
`metrics.jsonl` a resumed run writes again (`stale_record`).

A checkpoint after iteration `i` holds the state and the run's PRNG key (`state.eqx`)
and, in `meta.json`, the iteration, the step count, the rollbacks, the last ten losses,
the configuration, how the run stopped (when it stopped early) and the callbacks' own
state. Iteration `i` depends only on the state, the key and `i`, so a run restored from
it continues exactly as the uninterrupted run.
"""

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PyTree

from ._checkpoints import latest_checkpoint, restore_checkpoint, save_checkpoint
from ._metrics import MetricsLog, drop_records, logged_steps, step_ranges
from ._resume_rules import RunDirError, check_resumable


@dataclasses.dataclass(frozen=True)
class Position:
    """Where a run stands: the next `iteration` to run, the `state` after the ones
    before it, the optimiser `steps` taken and the last ten accepted `losses`. The loop
    replaces it in one assignment after an iteration's records are written, so that
    Ctrl-C anywhere checkpoints a consistent position."""

    iteration: int
    state: Any
    steps: int
    losses: list[float]


@dataclasses.dataclass
class LoopResult:
    """What `run_iterations` returns: the final state, the metrics of every step run in
    this call, the iterations completed, why it stopped (`"done"`, `"kl_guard"`,
    `"diverged"` or `"callback"`), the rollbacks, and, when a callback stopped it, the
    reason it gave (`stop_reason`). `run` is the `RunHandle` the callbacks saw."""

    state: Any
    history: list[dict]
    iterations: int
    stopped: str
    rollbacks: int
    stop_reason: str | None = None
    run: Any = dataclasses.field(default=None, repr=False, compare=False)


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during a run: the last completed iteration was checkpointed (when the run
    has a checkpoint directory) and the run can be resumed from it."""

    def __init__(self, stage: str, iteration: int, total: int, checkpoint: str | None):
        super().__init__(f"{stage} interrupted at iteration {iteration}/{total}")
        self.stage, self.iteration, self.total, self.checkpoint = (
            stage,
            iteration,
            total,
            checkpoint,
        )


def copy_state(tree: PyTree) -> PyTree:
    """A copy of every array of `tree` (a state the loop may return to must not share
    buffers that a donating step overwrites)."""
    return jax.tree.map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, tree)


def stale_record(stage: str, steps: int, start: int) -> Callable[[dict], bool]:
    """Records of `stage` written after the checkpoint a run resumes from (they are
    written again), except an evaluation at or before the resumed iteration that the loop
    wrote before that checkpoint (a callback's record written after the loop ended,
    `"after_loop"`, follows the last checkpoint and is written again)."""

    def stale(r: dict) -> bool:
        if r.get("stage") != stage or r.get("event") == "resume":
            return False
        if r.get("after_loop"):
            return True
        if r.get("eval") and r.get("iteration", start + 1) <= start:
            return False
        if "step" in r:
            return r["step"] >= steps
        return "event" in r and r.get("iteration", -1) >= start

    return stale


def check_iteration_count(checkpoint: str, saved: dict, num_iterations: int, stage: str) -> None:
    """Refuse (`RunDirError`, naming both numbers) to resume `stage` with
    `num_iterations` iterations from `checkpoint` (its `meta.json`: `saved`) when the
    checkpoint is past them, unless the run had stopped early there."""
    at = int(saved["iteration"])
    if at > num_iterations and (saved.get("stopped") or "done") == "done":
        raise RunDirError(
            f"{checkpoint}: the checkpoint is at iteration {at}, past the "
            f"{num_iterations} iterations of {stage} requested"
        )


def check_logged_steps(
    log_path: str, stage: str, steps: int, checkpoint: str, *, repeats: bool = True
) -> None:
    """Refuse (`RunDirError`, naming the file and the steps) to resume `stage` from
    `checkpoint`, taken after `steps` steps, when the metrics log `log_path` lacks step
    records before it, or (with `repeats`: a log of this run alone, as a run directory's
    is) holds one twice (`logged_steps`: lines removed, lost or copied by hand): the
    resumed run's metrics would have holes or repeats."""
    missing, repeated = logged_steps(log_path, stage, steps)
    wrong = [f"lack step(s) {step_ranges(missing)}"] if missing else []
    if repeats and repeated:
        wrong.append(f"hold step(s) {step_ranges(repeated)} more than once")
    if wrong:
        raise RunDirError(
            f"{log_path}: the step records of {stage} before the checkpoint {checkpoint} "
            f"(step {steps}) {' and '.join(wrong)}; restore those lines as the run wrote "
            "them (each step once), or start a new run (--overwrite or another --out)"
        )


def stages_after(log_path: str, stage: str) -> list[str]:
    """The stages with step records in the metrics log `log_path` after the last record
    of `stage`, in order: the stages of a pipeline that trained on its result."""
    try:
        with open(log_path, "rb") as f:
            records = [_record(line) for line in f.read().splitlines()]
    except OSError:  # no log yet
        return []
    later: dict[str, None] = {}
    for rec in records:
        name = rec.get("stage")
        if name == stage:
            later = {}
        elif isinstance(name, str) and "step" in rec and "event" not in rec:
            later[name] = None
    return list(later)


def _record(line: bytes) -> dict:
    """The JSON object of a metrics log line (`{}` for a torn or foreign one)."""
    try:
        rec = json.loads(line)
    except ValueError:
        return {}
    return rec if isinstance(rec, dict) else {}


@dataclasses.dataclass(frozen=True)
class Resumed:
    """What a checkpoint gives back: the position, the rollbacks, how the run had
    stopped (`"done"` while it had not), the reason a callback gave, the callbacks' own
    state and the checkpoint's path."""

    position: Position
    rollbacks: int
    stopped: str
    stop_reason: str | None
    callbacks: dict
    path: str


@dataclasses.dataclass(frozen=True)
class LoopCheckpoints:
    """The checkpoints of one run of the loop: `directory` (`None`: none are written),
    the run's `key`, the `meta` every checkpoint carries (its `"config"` is checked on
    resume), how many to keep, the loop's `num_iterations` (recorded in each checkpoint:
    a resume tells the stage's iteration count by it) and the metrics `log` flushed
    (`MetricsLog.sync`) before each checkpoint's commit."""

    directory: str | None
    key: jax.Array
    meta: dict
    keep: int
    num_iterations: int | None = None
    log: MetricsLog | None = None

    def save(
        self, pos: Position, rollbacks: int, callbacks: dict | None = None, **extra
    ) -> str | None:
        """Write the checkpoint of `pos` (`iter_<pos.iteration>`); returns its path, or
        `None` without a directory. `extra` goes into `meta.json` (e.g. `stopped`)."""
        if self.directory is None:
            return None
        m = dict(self.meta, steps=pos.steps, rollbacks=rollbacks, losses=pos.losses[-10:], **extra)
        if self.num_iterations is not None:
            m["num_iterations"] = self.num_iterations
        if callbacks:
            m["callbacks"] = callbacks
        if self.log is not None:
            self.log.sync()  # the lines of its steps reach the device before it does
        tree = {"state": pos.state, "key": jax.random.key_data(self.key)}
        return save_checkpoint(self.directory, pos.iteration, tree, m, keep=self.keep)

    def resume(self, state: Any, num_iterations: int, log: MetricsLog) -> Resumed | None:
        """Read the latest checkpoint into the structure of `state` and drop the records
        of `log.stage` written after it (`stale_record`); `None` when there is none
        (the records of an earlier start are dropped too). A checkpoint that a callback
        stopped before `num_iterations` continues (`stopped` is `"done"`), unless a
        later stage has step records in `log` after this stage's (`stages_after`): it
        trained on this stage's result, which then stays as it stopped; the `resume`
        event says which. A checkpoint whose
        configuration differs outside the resumable fields, one past `num_iterations`
        (unless the run had stopped early), or one whose earlier steps lack their
        records in `log` (`check_logged_steps`) raises `RunDirError`."""
        directory = self.directory
        path = latest_checkpoint(directory, set_aside=True) if directory is not None else None
        resumed, note = None, ""
        if path is not None:
            like = {"state": state, "key": jax.random.key_data(self.key)}
            tree, saved = restore_checkpoint(path, like)
            if "config" in saved and "config" in self.meta:
                check_resumable(saved["config"], self.meta["config"], where=path)
            pos = Position(
                int(saved["iteration"]),
                tree["state"],
                int(saved.get("steps", 0)),
                [float(x) for x in saved.get("losses", [])],
            )
            stopped, reason = saved.get("stopped") or "done", saved.get("stop_reason")
            check_iteration_count(path, saved, num_iterations, log.stage)
            # a log given to several runs of the loop may repeat steps; the run
            # directory's own check (`open_run_dir`) refuses repeats too
            check_logged_steps(log.path, log.stage, pos.steps, path, repeats=False)
            if stopped == "callback" and pos.iteration < num_iterations:
                later = stages_after(log.path, log.stage)
                why = f" ({reason})" if reason else ""
                if later:
                    note = (
                        f"; a callback stopped it there{why} and it stays stopped: "
                        f"{', '.join(later)} trained on its result (a new run trains it "
                        "further: --overwrite or another --out)"
                    )
                else:  # as `resume_from_checkpoint` does: the run goes on
                    stopped, reason = "done", None
                    note = f"; a callback had stopped it there{why}, training goes on"
            resumed = Resumed(
                pos,
                int(saved.get("rollbacks", 0)),
                stopped,
                reason,
                dict(saved.get("callbacks") or {}),
                path,
            )
        start, steps = (resumed.position.iteration, resumed.position.steps) if resumed else (0, 0)
        drop_records(log.path, stale_record(log.stage, steps, start))
        if resumed is not None:
            log.event(
                "resume",
                f"continuing from {path} (iteration {start}, step {steps}){note}",
                iteration=start,
                step=steps,
            )
        return resumed
