"""The iteration loop shared by every run (`run_iterations`) and what it checks after
each iteration: divergence (non-finite values, loss and KL spikes), records a resumed run
writes again, and monitoring numbers. The learning-rate factor a rollback lowers is in
`_lr_scale.py`, checkpoints in `_checkpoints.py`, the metrics log in `_metrics.py`.

A run is a sequence of *iterations* (one optimiser step for SFT / reward / offline DPO;
one rollout and its updates for PPO / GRPO / online DPO). Iteration `i` draws its
randomness from `fold_in(key, i)` and its data from `i`, so a run restored from a
checkpoint taken after iteration `i` continues exactly as the uninterrupted run.
"""

import dataclasses
import math
import os
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

from ._checkpoints import (
    discard_checkpoints_after,
    latest_checkpoint,
    restore_checkpoint,
    save_checkpoint,
)
from ._config import (
    OpsConfig,
)
from ._lr_scale import get_lr_scale, set_lr_scale
from ._metrics import MetricsLog, drop_records, progress
from ._monitor import Profiler, device_memory
from ._resume_rules import RunDirError, check_resumable

# --- the checks after each iteration --------------------------------------------------

SPIKE_FLOOR = 0.1
"""The smallest reference of the loss-spike rule: a loss is a spike when `|loss|` exceeds
`ops.loss_spike` × max(median of the last 10 accepted `|loss|`, `SPIKE_FLOOR`)."""


def find_problem(
    metrics: list[dict], info: dict, losses: list[float], ops: OpsConfig
) -> tuple[str | None, bool]:
    """`(what went wrong or None, whether the state before the iteration is still good)`.

    A step's loss is computed before its update: a bad first step (or a KL spike of the
    rollout, sampled before any update) implicates the state the iteration started from;
    a bad later step only the iteration's own updates."""
    kl = info.get("kl")
    if kl is not None and not math.isfinite(kl):
        return f"non-finite KL {kl}", False
    if kl is not None and kl > ops.kl_spike:
        return f"KL spike {kl:.4g} > {ops.kl_spike}", False
    recent = list(losses[-10:])
    for j, m in enumerate(metrics):
        loss = m.get("loss", 0.0)
        bad = None
        if not math.isfinite(loss):
            bad = f"non-finite loss {loss}"
        elif m.get("nonfinite", 0.0) > 0:
            bad = "non-finite gradient (the step was skipped)"
        elif recent:
            ref = max(float(np.median(np.abs(recent[-10:]))), SPIKE_FLOOR)
            if abs(loss) > ops.loss_spike * ref:
                bad = f"loss spike {loss:.4g} (median of recent |loss| {ref:.4g})"
        if bad is not None:
            return (f"step {j}: {bad}" if len(metrics) > 1 else bad), j > 0
        recent.append(loss)
    return None, True


def stale_record(stage: str, steps: int, start: int) -> Callable[[dict], bool]:
    """Records of `stage` written after the checkpoint a run resumes from (they are
    written again), except an evaluation at or before the resumed iteration."""

    def stale(r: dict) -> bool:
        if r.get("stage") != stage or r.get("event") == "resume":
            return False
        if r.get("eval") and r.get("iteration", start + 1) <= start:
            return False
        if "step" in r:
            return r["step"] >= steps
        return "event" in r and r.get("iteration", -1) >= start

    return stale


def monitoring(
    i: int,
    elapsed: float,
    info: dict,
    scores: dict[int, float],
    ops: OpsConfig,
    flops: float | None,
    peak: float | None,
) -> dict:
    out: dict[str, float] = {}
    if flops:
        out["model_flops"] = flops
        if peak:
            out["mfu"] = flops / max(elapsed, 1e-9) / peak
    if ops.monitor:
        out.update(device_memory())
    if "score" in info:
        scores[i] = float(info["score"])
        if i - ops.log_every in scores:
            out["reward_improvement"] = scores[i] - scores[i - ops.log_every]
    return out


# --- the loop --------------------------------------------------------------------------


@dataclasses.dataclass
class LoopResult:
    """What `run_iterations` returns: the final state, the metrics of every step run in
    this call, the iterations completed, why it stopped (`"done"`, `"kl_guard"` or
    `"diverged"`), the rollbacks."""

    state: Any
    history: list[dict]
    iterations: int
    stopped: str
    rollbacks: int


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


def _copy(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, tree)


def run_iterations(
    state: Any,
    iteration: Callable[[Any, jax.Array, int], tuple[Any, list[dict], dict]],
    *,
    num_iterations: int,
    key: jax.Array,
    ops: OpsConfig,
    log: MetricsLog,
    checkpoint_dir: str | None = None,
    resume: bool = False,
    meta: dict | None = None,
    kl_target: float | None = None,
    evaluate: Callable[[Any, int], dict] | None = None,
    tokens_per_iteration: int | None = None,
    flops_per_iteration: float | None = None,
    peak_flops: float | None = None,
) -> LoopResult:
    """Run `iteration(state, fold_in(key, i), i) -> (state, step_metrics, info)` for
    `i = 0 .. num_iterations - 1` with checkpoints, rollback, the KL guard and evaluation.

    - **Checkpoints** (`checkpoint_dir`): after every `ops.checkpoint_every` iterations and
      at the end: the state, the key, the iteration, the step count, the rollbacks and
      the recent losses. `resume=True` continues from the latest one, bit-identical to
      an uninterrupted run (iteration `i` depends only on the state, `key` and `i`):
      `step` and `iteration` continue, and the records the interrupted run wrote after
      that checkpoint are removed from `metrics.jsonl` (they are written again). The
      configuration in the checkpoint (`meta["config"]`) must match the requested one
      outside the fields that may change on resume (`RunDirError` otherwise), and a
      checkpoint past `num_iterations` is refused.
    - **Rollback** (`ops.rollback`): when a step's loss is non-finite, its gradient was
      skipped as non-finite, its loss spikes (`SPIKE_FLOOR`), or `info["kl"]` spikes, the
      state goes back to the last *verified* state — one whose own loss was measured
      finite and below the spike threshold (the state before this iteration when only a
      later step of it failed, else the state before the last accepted iteration,
      else the starting state) — the learning-rate factor is divided by
      `ops.lr_backoff`, checkpoints past it are discarded, an event is logged and the
      iterations are run again. Each step record carries the factor (`lr_scale`) and
      its `learning_rate` is the rate applied: the schedule's times the factor.
    - **Divergence**: when the rollbacks are exhausted (`ops.max_rollbacks`), or a loss is
      non-finite with `ops.rollback` off, the run stops with `stopped="diverged"` and the
      last verified state (finite weights); a `diverged` event says why.
    - **KL guard** (`kl_target`): when `info["kl"]` (the per-token KL of the rollout's
      policy to the reference) exceeds it, the run stops early with `stopped="kl_guard"`
      and the last policy whose rollout KL was within the target (the state before the
      last accepted iteration), and writes a checkpoint of it; resuming such a run
      returns at once.
    - **Ctrl-C**: the state after the last completed iteration is checkpointed and
      `RunInterrupted` (a `KeyboardInterrupt`) is raised with the iteration reached.
    - **Evaluation** (`evaluate(state, i) -> metrics`): every `ops.eval_every` iterations.
    - **Monitoring**: on the last step line of each iteration, `iteration_time_s`,
      `tokens_per_s`, `model_flops` (`flops_per_iteration`) and `mfu` (against
      `peak_flops`), device memory where the backend reports it, and
      `reward_improvement` (the rollout score minus that of `ops.log_every` iterations
      before); `ops.profile_steps` writes a profiler trace.
    """
    meta = dict(meta or {})
    start, steps, rollbacks = 0, 0, 0
    losses: list[float] = []
    stopped = "done"
    if resume and checkpoint_dir is not None:
        path = latest_checkpoint(checkpoint_dir)
        if path is not None:
            like = {"state": state, "key": jax.random.key_data(key)}
            tree, saved = restore_checkpoint(path, like)
            if "config" in saved and "config" in meta:
                check_resumable(saved["config"], meta["config"], where=path)
            state = tree["state"]
            start = int(saved["iteration"])
            steps = int(saved.get("steps", 0))
            rollbacks = int(saved.get("rollbacks", 0))
            losses = [float(x) for x in saved.get("losses", [])]
            stopped = saved.get("stopped") or "done"
            if start > num_iterations and stopped == "done":
                raise RunDirError(
                    f"{path}: the checkpoint is at iteration {start}, past the "
                    f"{num_iterations} iterations of {log.stage} requested"
                )
        drop_records(log.path, stale_record(log.stage, steps, start))
        if path is not None:
            log.event(
                "resume",
                f"continuing from {path} (iteration {start}, step {steps})",
                iteration=start,
                step=steps,
            )
            if stopped != "done":
                return LoopResult(state, [], start, stopped, rollbacks)

    def save(at: int, st: Any, n_steps: int, recent: list[float], **extra) -> str | None:
        if checkpoint_dir is None:
            return None
        m = dict(meta, steps=n_steps, rollbacks=rollbacks, losses=recent[-10:], **extra)
        tree = {"state": st, "key": jax.random.key_data(key)}
        return save_checkpoint(checkpoint_dir, at, tree, m, keep=ops.keep)

    history: list[dict] = []
    bar = progress(num_iterations, start, log.stage, ops.quiet)
    profiler = Profiler(ops.profile_steps, os.path.join(log.run_dir, "profile", log.stage))
    scores: dict[int, float] = {}
    if peak_flops is not None:
        log.write(
            {
                "event": "monitor",
                "iteration": start,
                "step": steps,
                "peak_flops": peak_flops,
                "device": str(jax.devices()[0].device_kind),
                "devices": jax.device_count(),
                "collective_share": "not measured: pipeline runs execute on one device",
            }
        )
    # `committed` is replaced in one assignment after an iteration's records are written,
    # so that Ctrl-C anywhere checkpoints a consistent (iteration, state, steps).
    committed = (start, state, steps, list(losses))
    verified = (start, _copy(state))  # the state before that iteration; presumed good
    within: tuple[int, Any] | None = None  # the last state whose rollout KL was in target
    try:
        while committed[0] < num_iterations:
            i, state, steps, losses = committed
            good = _copy(state)
            profiler.before(i)
            t0 = time.perf_counter()
            new_state, metrics, info = iteration(state, jax.random.fold_in(key, i), i)
            metrics = [{k: float(v) for k, v in m.items()} for m in metrics]
            elapsed = time.perf_counter() - t0
            profiler.after(i)
            problem, before_ok = find_problem(metrics, info, losses, ops)
            if problem is not None:
                back_to, restored = (i, good) if before_ok else verified
                if ops.rollback and rollbacks < ops.max_rollbacks:
                    rollbacks += 1
                    scale = get_lr_scale(state) / ops.lr_backoff
                    if checkpoint_dir is not None:
                        discard_checkpoints_after(checkpoint_dir, back_to)
                    log.event(
                        "rollback",
                        f"iteration {i}: {problem}; restored the state before "
                        f"iteration {back_to}, learning-rate factor now {scale:.3g}",
                        iteration=i,
                        restored=back_to,
                        lr_scale=scale,
                        step=steps,
                    )
                    kept = [x for x in history if x["iteration"] < back_to]
                    dropped = len(history) - len(kept)
                    history = kept
                    losses = [x.get("loss", 0.0) for x in history][-10:] if dropped else losses
                    verified = (back_to, restored)
                    committed = (back_to, set_lr_scale(restored, scale), steps, losses)
                    continue
                if ops.rollback or "spike" not in problem:
                    why = (
                        f"{ops.max_rollbacks} rollbacks used" if ops.rollback else "rollback is off"
                    )
                    log.event(
                        "diverged",
                        f"iteration {i}: {problem}; {why}: stopping with the state before "
                        f"iteration {back_to} (finite weights)",
                        iteration=i,
                        restored=back_to,
                        step=steps,
                    )
                    committed = (back_to, restored, steps, losses)
                    stopped = "diverged"
                    break
                log.event(
                    "spike", f"iteration {i}: {problem} (rollback is off)", iteration=i, step=steps
                )
            if kl_target is not None and info.get("kl", 0.0) > kl_target:
                back_to, restored = within if within is not None else (i, good)
                stopped = "kl_guard"
                log.event(
                    "kl_guard",
                    f"iteration {i}: KL to the reference {info['kl']:.4f} > target "
                    f"{kl_target}; stopping with the policy before iteration {back_to}, the "
                    "last one within the target",
                    iteration=i,
                    kl=info["kl"],
                    restored=back_to,
                    step=steps,
                )
                committed = (i, restored, steps, losses)
                save(i, restored, steps, losses, stopped="kl_guard")
                break
            empty = sum(m.get("empty_batch", 0.0) > 0 for m in metrics)
            if empty:
                log.event(
                    "empty_batch",
                    f"iteration {i}: {empty} of {len(metrics)} steps had no token to learn "
                    "from (every completion mask false); their updates were skipped",
                    iteration=i,
                    step=steps,
                )
            if metrics:
                verified = (i, good)  # its loss, metrics[0]'s, passed the checks
            if kl_target is not None and "kl" in info:
                within = (i, good)
            recent = list(losses)
            lr_scale = get_lr_scale(new_state)
            for j, m in enumerate(metrics):
                recent.append(m.get("loss", 0.0))
                rec = {"iteration": i, "step": steps + j, **m}
                if "learning_rate" in rec:  # the rate applied: the schedule's times the factor
                    rec["learning_rate"] = rec["learning_rate"] * lr_scale
                if j == len(metrics) - 1:
                    rec.update({f"rollout/{k}": v for k, v in info.items()})
                    rec["iteration_time_s"] = elapsed
                    if tokens_per_iteration:
                        rec["tokens_per_s"] = tokens_per_iteration / max(elapsed, 1e-9)
                    rec.update(
                        monitoring(i, elapsed, info, scores, ops, flops_per_iteration, peak_flops)
                    )
                rec["lr_scale"] = lr_scale
                history.append(rec)
                log.write(rec)
            committed = (i + 1, new_state, steps + len(metrics), recent[-10:])
            i, state, steps, losses = committed
            if bar is not None:
                bar.update(1)
                if metrics:
                    bar.set_postfix(loss=f"{metrics[-1].get('loss', float('nan')):.4f}")
            elif not log.quiet and metrics and (i % ops.log_every == 0 or i == num_iterations):
                shown = {
                    k: v
                    for k, v in {**metrics[-1], **info}.items()
                    if k in ("loss", "accuracy", "rewards/accuracies", "reward", "score", "kl")
                }
                log.info(
                    f"iter {i}/{num_iterations} "
                    + " ".join(f"{k} {v:.4f}" for k, v in shown.items())
                )
            if evaluate is not None and ops.eval_every and i % ops.eval_every == 0:
                if i < num_iterations:
                    log.write({"eval": True, "iteration": i, "step": steps, **evaluate(state, i)})
            if (ops.checkpoint_every and i % ops.checkpoint_every == 0) or i == num_iterations:
                save(i, state, steps, losses)
    except KeyboardInterrupt as e:
        if isinstance(e, RunInterrupted):
            raise
        i, state, steps, losses = committed
        try:
            path = save(i, state, steps, losses)
        except BaseException:
            path = None
        raise RunInterrupted(log.stage, i, num_iterations, path) from None
    finally:
        profiler.close()
        if bar is not None:
            bar.close()
    return LoopResult(committed[1], history, committed[0], stopped, rollbacks)
