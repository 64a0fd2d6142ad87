"""The iteration loop shared by every run (`run_iterations`).

A run is a sequence of *iterations* (one optimiser step for SFT / reward / offline DPO;
one rollout and its updates for PPO / GRPO / online DPO). Iteration `i` draws its
randomness from `fold_in(key, i)` and its data from `i`, so a run restored from a
checkpoint taken after iteration `i` continues exactly as the uninterrupted run.

The loop's pieces, each in its own module: its state and checkpointed form
(`_loop_state.py`), the stopping rules — divergence, rollback, the KL guard
(`_stopping.py`) —, the records it writes about an iteration (`_iteration_records.py`),
the callbacks it calls (`_callbacks.py`); the learning-rate factor a rollback lowers is
in `_lr_scale.py`, checkpoints in `_checkpoints.py`, the metrics log in `_metrics.py`.
"""

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jaxtyping import PRNGKeyArray

from ._callbacks import CallbackError, CallbackList, RunHandle
from ._config import (
    OpsConfig,
)
from ._iteration_records import (
    iteration_records,
    monitoring,
    note_empty_batches,
    report_progress,
)
from ._loop_state import (
    LoopCheckpoints,
    LoopResult,
    Position,
    RunInterrupted,
    copy_state,
)
from ._lr_scale import get_lr_scale
from ._metrics import MetricsLog, progress
from ._monitor import Profiler
from ._stopping import Fallbacks, find_problem, handle_problem, kl_guard


def _host_metrics(records: list[dict], info: dict) -> dict[str, float]:
    """What `on_step` gets: the iteration's last step record (the rollout's numbers under
    `rollout/*`), as host floats, without its `iteration` and `step`."""
    last = records[-1] if records else {f"rollout/{k}": v for k, v in info.items()}
    out = {}
    for k, v in last.items():
        if k in ("iteration", "step"):
            continue
        try:
            out[k] = float(v)
        except (TypeError, ValueError):
            continue
    return out


def _sync(run: RunHandle, pos: Position) -> RunHandle:
    run.iteration, run.state, run.steps = pos.iteration, pos.state, pos.steps
    return run


def run_iterations(
    state: Any,
    iteration: Callable[[Any, jax.Array, int], tuple[Any, list[dict], dict]],
    *,
    num_iterations: int,
    key: PRNGKeyArray,
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
    callbacks: Sequence[Any] = (),
    policy_of: Callable[[Any], Any] | None = None,
) -> LoopResult:
    """Run `iteration(state, fold_in(key, i), i) -> (state, step_metrics, info)` for
    `i = 0 .. num_iterations - 1` with checkpoints, rollback, the KL guard, evaluation
    and callbacks.

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
    - **Callbacks** (`callbacks`, see `Callback`): `on_start`, `on_step` after each
      iteration, `on_evaluate`, `on_checkpoint`, `on_stop`; they see a `RunHandle`
      (`policy_of(state)` gives its `policy()`). A stop a callback requests ends the run
      after that iteration with `stopped="callback"` and `stop_reason`, and writes a
      checkpoint marked stopped; resuming it continues training from that checkpoint
      (a `resume` event says so), unless a later stage has step records in `log` after
      this stage's: it trained on this stage's result, which then stays as it stopped
      (`LoopCheckpoints.resume`). Their `state_dict()` goes into every checkpoint and
      `load_state_dict` gets it back on resume. A hook that raises stops the run: the
      last iteration whose hooks all completed is checkpointed and `CallbackError` (its
      `checkpoint` set) is raised.
    - **Monitoring**: on the last step line of each iteration, `iteration_time_s`,
      `tokens_per_s`, `model_flops` (`flops_per_iteration`) and `mfu` (against
      `peak_flops`), device memory where the backend reports it, and
      `reward_improvement` (the rollout score minus that of `ops.log_every` iterations
      before); `ops.profile_steps` writes a profiler trace.
    """
    ckpts = LoopCheckpoints(checkpoint_dir, key, dict(meta or {}), ops.keep, num_iterations, log)
    cbs = CallbackList(callbacks)
    history: list[dict] = []
    run = RunHandle(
        stage=log.stage,
        num_iterations=num_iterations,
        log=log,
        checkpoint_dir=checkpoint_dir,
        state=state,
        history=history,
        policy_of=policy_of,
    )
    committed = Position(0, state, 0, [])
    stopped, stop_reason, rollbacks = "done", None, 0
    resumed = ckpts.resume(state, num_iterations, log) if resume and checkpoint_dir else None
    if resumed is not None:
        committed, rollbacks = resumed.position, resumed.rollbacks
        stopped, stop_reason = resumed.stopped, resumed.stop_reason
        run.resumed = True
        _sync(run, committed)
        cbs.load_state_dict(resumed.callbacks, run)
        if stopped != "done":
            run.stop_reason = stop_reason
            cbs.call("on_start", run)
            run.after_loop = True
            cbs.call("on_stop", run, stopped)
            return LoopResult(
                committed.state, [], committed.iteration, stopped, rollbacks, stop_reason, run
            )

    bar = progress(num_iterations, committed.iteration, log.stage, ops.quiet)
    profiler = Profiler(ops.profile_steps, os.path.join(log.run_dir, "profile", log.stage))
    scores: dict[int, float] = {}
    if peak_flops is not None:
        log.write(
            {
                "event": "monitor",
                "iteration": committed.iteration,
                "step": committed.steps,
                "peak_flops": peak_flops,
                "device": str(jax.devices()[0].device_kind),
                "devices": jax.device_count(),
                "collective_share": "not measured: pipeline runs execute on one device",
            }
        )
    fallbacks = Fallbacks((committed.iteration, copy_state(committed.state)), rollbacks=rollbacks)

    def save(pos: Position, states: dict | None, **extra) -> str | None:
        return ckpts.save(pos, fallbacks.rollbacks, states, **extra)

    # `committed` is replaced in one assignment after an iteration's records are written,
    # so that Ctrl-C anywhere checkpoints a consistent (iteration, state, steps). With
    # callbacks, `hooked` is the last position whose hooks all completed, with the
    # callbacks' state then: what an error in a hook (or Ctrl-C) checkpoints.
    hooked: tuple[Position, dict | None] = (committed, None)
    last_path: str | None = None
    notified: tuple[int, str] | None = None  # the last checkpoint `on_checkpoint` was told of
    try:
        if cbs:
            cbs.call("on_start", _sync(run, committed))
            hooked = (committed, cbs.state_dict(run))
        while committed.iteration < num_iterations:
            pos = committed
            i = pos.iteration
            if run.stop_reason is not None:  # a callback asked to stop
                stopped, stop_reason = "callback", run.stop_reason
                log.event(
                    "callback_stop",
                    f"iteration {i}: {stop_reason}; stopping with the state after "
                    f"{i} of {num_iterations} iterations",
                    iteration=i,
                    step=pos.steps,
                    reason=stop_reason,
                )
                last_path = save(pos, hooked[1], stopped="callback", stop_reason=stop_reason)
                if last_path is not None and notified != (i, last_path):  # once a checkpoint
                    cbs.call("on_checkpoint", _sync(run, pos), i, last_path)
                break
            good = copy_state(pos.state)
            if cbs:
                hooked = (dataclasses.replace(pos, state=good), hooked[1])
            profiler.before(i)
            t0 = time.perf_counter()
            new_state, metrics, info = iteration(pos.state, jax.random.fold_in(key, i), i)
            metrics = [{k: float(v) for k, v in m.items()} for m in metrics]
            elapsed = time.perf_counter() - t0
            profiler.after(i)
            problem, before_ok = find_problem(metrics, info, pos.losses, ops)
            if problem is not None:
                handled = handle_problem(
                    problem,
                    before_ok,
                    i,
                    good,
                    pos,
                    fallbacks,
                    history,
                    ops=ops,
                    log=log,
                    checkpoint_dir=checkpoint_dir,
                )
                history[:] = handled.history
                if handled.action == "rollback":
                    committed = handled.position
                    if cbs:
                        hooked = (committed, hooked[1])
                    continue
                if handled.action == "diverged":
                    committed = handled.position
                    stopped = "diverged"
                    break
            stop = kl_guard(i, info, kl_target, good, pos, fallbacks, log)
            if stop is not None:
                stopped = "kl_guard"
                committed = stop
                last_path = save(stop, hooked[1], stopped="kl_guard")
                if last_path is not None:
                    cbs.call("on_checkpoint", _sync(run, stop), i, last_path)
                break
            note_empty_batches(i, pos.steps, metrics, log)
            fallbacks.accept(
                i, good, stepped=bool(metrics), measured_kl=kl_target is not None and "kl" in info
            )
            monitor = (
                monitoring(i, elapsed, info, scores, ops, flops_per_iteration, peak_flops)
                if metrics
                else {}
            )
            records = iteration_records(
                i,
                pos.steps,
                metrics,
                info,
                elapsed=elapsed,
                lr_scale=get_lr_scale(new_state),
                tokens_per_iteration=tokens_per_iteration,
                monitor=monitor,
            )
            for rec in records:
                history.append(rec)
                log.write(rec)
            recent = [*pos.losses, *(m.get("loss", 0.0) for m in metrics)][-10:]
            committed = Position(i + 1, new_state, pos.steps + len(metrics), recent)
            i, steps = committed.iteration, committed.steps
            report_progress(bar, log, i, num_iterations, metrics, info, ops)
            if cbs:
                cbs.call("on_step", _sync(run, committed), i, _host_metrics(records, info))
            if evaluate is not None and ops.eval_every and i % ops.eval_every == 0:
                if i < num_iterations:
                    results = evaluate(committed.state, i)
                    log.write({"eval": True, "iteration": i, "step": steps, **results})
                    cbs.call("on_evaluate", run, i, results)
            if cbs:
                hooked = (committed, cbs.state_dict(run))
            if (ops.checkpoint_every and i % ops.checkpoint_every == 0) or i == num_iterations:
                last_path = save(committed, hooked[1])
                if last_path is not None:
                    cbs.call("on_checkpoint", run, i, last_path)
                    notified = (i, last_path)
    except CallbackError as e:
        if e.hook == "on_checkpoint":
            e.checkpoint = last_path
        else:
            pos, states = hooked
            e.checkpoint = save(pos, states, **_stop_marks(stopped, stop_reason))
        raise
    except KeyboardInterrupt as e:
        if isinstance(e, RunInterrupted):
            raise
        pos, states = hooked if cbs else (committed, None)
        try:
            path = save(pos, states)
        except BaseException:
            path = None
        raise RunInterrupted(log.stage, pos.iteration, num_iterations, path) from None
    finally:
        profiler.close()
        if bar is not None:
            bar.close()
    _sync(run, committed)
    run.after_loop = True
    cbs.call("on_stop", run, stopped)
    n, rollbacks = committed.iteration, fallbacks.rollbacks
    return LoopResult(committed.state, history, n, stopped, rollbacks, stop_reason, run)


def _stop_marks(stopped: str, stop_reason: str | None) -> dict:
    """The marks of a checkpoint written as the run stops early (none while it runs)."""
    if stopped == "done" or stopped == "diverged":
        return {}
    return {"stopped": stopped} | ({"stop_reason": stop_reason} if stop_reason else {})
