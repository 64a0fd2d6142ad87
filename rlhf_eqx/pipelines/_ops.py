"""The iteration loop shared by every run, and the learning-rate factor rollback lowers.

Checkpoints are in `_checkpoints.py`, the metrics log in `_metrics.py`.

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
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, PyTree

from ..train import make_optimizer
from ._checkpoints import latest_checkpoint, restore_checkpoint, save_checkpoint
from ._config import OpsConfig, OptimConfig
from ._metrics import MetricsLog, progress
from ._monitor import Profiler, device_memory

# --- learning-rate scale ---------------------------------------------------------------


class LRScaleState(NamedTuple):
    """Optimiser state of `scale_by_lr_factor`: the factor applied to every update."""

    scale: Float[Array, ""]


def scale_by_lr_factor() -> optax.GradientTransformation:
    """Multiply updates by a factor kept in the optimiser state (initially 1).

    Chained after the optimiser, it scales the effective learning rate; rollback lowers
    it with `set_lr_scale` without rebuilding (or recompiling) the step. It is part of
    the state, so checkpoints keep it.
    """

    def init(params):
        del params
        return LRScaleState(jnp.ones((), jnp.float32))

    def update(updates, state, params=None):
        del params
        return jax.tree.map(lambda u: u * state.scale.astype(u.dtype), updates), state

    return optax.GradientTransformation(init, update)


def build_optimizer(optim: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """AdamW + warmup/cosine + clipping (`rlhf_eqx.train.make_optimizer`), then the
    rollback's learning-rate factor."""
    base = make_optimizer(
        learning_rate=optim.lr,
        total_steps=max(total_steps, 1),
        warmup_ratio=optim.warmup_ratio,
        weight_decay=optim.weight_decay,
        max_grad_norm=optim.max_grad_norm,
        schedule=optim.schedule,
    )
    return optax.chain(base, scale_by_lr_factor())


def _is_scale(x: Any) -> bool:
    return isinstance(x, LRScaleState)


def get_lr_scale(opt_state: PyTree) -> float:
    """The learning-rate factor in `opt_state` (1.0 when there is none)."""
    found = [x.scale for x in jax.tree.leaves(opt_state, is_leaf=_is_scale) if _is_scale(x)]
    return float(found[0]) if found else 1.0


def set_lr_scale(opt_state: PyTree, scale: float) -> PyTree:
    """`opt_state` with every `LRScaleState` factor set to `scale`."""
    return jax.tree.map(
        lambda x: LRScaleState(jnp.asarray(scale, jnp.float32)) if _is_scale(x) else x,
        opt_state,
        is_leaf=_is_scale,
    )


# --- the loop --------------------------------------------------------------------------


@dataclasses.dataclass
class LoopResult:
    """What `run_iterations` returns: the final state, the metrics of every step, the
    iterations completed, why it stopped (`"done"` or `"kl_guard"`), the rollbacks."""

    state: Any
    history: list[dict]
    iterations: int
    stopped: str
    rollbacks: int


def _copy(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, tree)


def _problem(metrics: list[dict], info: dict, losses: list[float], ops: OpsConfig) -> str | None:
    for m in metrics:
        loss = m.get("loss", 0.0)
        if not math.isfinite(loss) or m.get("nonfinite", 0.0) > 0:
            return f"non-finite loss {loss}"
        if len(losses) >= 3:
            ref = float(np.median(np.abs(losses[-10:])))
            if abs(loss) > ops.loss_spike * max(ref, 1e-3):
                return f"loss spike {loss:.4g} (median of recent |loss| {ref:.4g})"
    kl = info.get("kl")
    if kl is not None and (not math.isfinite(kl) or kl > ops.kl_spike):
        return f"KL spike {kl:.4g} > {ops.kl_spike}"
    return None


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
      at the end, the state, the key and the iteration; `resume=True` continues from the
      latest one (bit-identical to an uninterrupted run: iteration `i` depends only on
      the state, `key` and `i`).
    - **Rollback** (`ops.rollback`): when a step's loss is non-finite or spikes, or
      `info["kl"]` spikes, the state goes back to the one before the iteration (a copy,
      safe from buffer donation), the learning-rate factor is divided by
      `ops.lr_backoff`, an event is logged, and the iteration is run again.
    - **KL guard** (`kl_target`): when `info["kl"]` (the per-token KL of the rollout's
      policy to the reference) exceeds it, the iteration's updates are discarded and the
      run stops early.
    - **Evaluation** (`evaluate(state, i) -> metrics`): every `ops.eval_every` iterations.
    - **Monitoring**: on the last step line of each iteration, `iteration_time_s`,
      `tokens_per_s`, `model_flops` (`flops_per_iteration`) and `mfu` (against
      `peak_flops`), device memory where the backend reports it, and
      `reward_improvement` (the rollout score minus that of `ops.log_every` iterations
      before); `ops.profile_steps` writes a profiler trace.
    """
    meta = dict(meta or {})
    start = 0
    if resume and checkpoint_dir is not None:
        path = latest_checkpoint(checkpoint_dir)
        if path is not None:
            like = {"state": state, "key": jax.random.key_data(key)}
            tree, saved = restore_checkpoint(path, like)
            state = tree["state"]
            start = int(saved["iteration"])
            log.event("resume", f"continuing from {path} (iteration {start})")
    history: list[dict] = []
    losses: list[float] = []
    rollbacks = 0
    stopped = "done"
    bar = progress(num_iterations, start, log.stage, ops.quiet)
    profiler = Profiler(ops.profile_steps, os.path.join(log.run_dir, "profile", log.stage))
    scores: dict[int, float] = {}
    if peak_flops is not None:
        log.write(
            {
                "event": "monitor",
                "peak_flops": peak_flops,
                "device": str(jax.devices()[0].device_kind),
                "devices": jax.device_count(),
                "collective_share": "not measured: pipeline runs execute on one device",
            }
        )
    i = start
    # The loss a step reports is computed before its update, so a bad update shows in
    # the next iteration's loss: rollback returns to the state before the previous
    # iteration (kept as a copy, safe from buffer donation) and runs it again.
    before_prev: tuple[int, Any] | None = None
    while i < num_iterations:
        good = _copy(state)
        profiler.before(i)
        t0 = time.perf_counter()
        new_state, metrics, info = iteration(state, jax.random.fold_in(key, i), i)
        metrics = [{k: float(v) for k, v in m.items()} for m in metrics]
        elapsed = time.perf_counter() - t0
        profiler.after(i)
        problem = _problem(metrics, info, losses, ops) if ops.rollback else None
        if problem is not None and rollbacks < ops.max_rollbacks:
            rollbacks += 1
            back_to, restored = before_prev if before_prev is not None else (i, good)
            scale = get_lr_scale(restored.opt_state) / ops.lr_backoff
            state = _with_opt_state(restored, scale)
            history = [h for h in history if h["iteration"] < back_to]
            losses = [h.get("loss", 0.0) for h in history]
            before_prev = None
            log.event(
                "rollback",
                f"iteration {i}: {problem}; restored the state before "
                f"iteration {back_to}, learning-rate factor now {scale:.3g}",
                iteration=i,
                restored=back_to,
                lr_scale=scale,
            )
            i = back_to
            continue
        if kl_target is not None and info.get("kl", 0.0) > kl_target:
            state = good
            stopped = "kl_guard"
            log.event(
                "kl_guard",
                f"iteration {i}: KL to the reference {info['kl']:.4f} > "
                f"target {kl_target}; stopping early",
                iteration=i,
                kl=info["kl"],
            )
            break
        before_prev = (i, good)
        state = new_state
        for j, m in enumerate(metrics):
            losses.append(m.get("loss", 0.0))
            rec = {"iteration": i, "step": len(history), **m}
            if j == len(metrics) - 1:
                rec.update({f"rollout/{k}": v for k, v in info.items()})
                rec["iteration_time_s"] = elapsed
                if tokens_per_iteration:
                    rec["tokens_per_s"] = tokens_per_iteration / max(elapsed, 1e-9)
                rec.update(
                    _monitoring(i, elapsed, info, scores, ops, flops_per_iteration, peak_flops)
                )
            rec["lr_scale"] = get_lr_scale(state.opt_state)
            history.append(rec)
            log.write(rec)
        i += 1
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
                f"iter {i}/{num_iterations} " + " ".join(f"{k} {v:.4f}" for k, v in shown.items())
            )
        if (
            evaluate is not None
            and ops.eval_every
            and i % ops.eval_every == 0
            and i < num_iterations
        ):
            log.write({"eval": True, "iteration": i, **evaluate(state, i)})
        if checkpoint_dir is not None and (
            (ops.checkpoint_every and i % ops.checkpoint_every == 0) or i == num_iterations
        ):
            save_checkpoint(
                checkpoint_dir,
                i,
                {"state": state, "key": jax.random.key_data(key)},
                meta,
                keep=ops.keep,
            )
    profiler.close()
    if bar is not None:
        bar.close()
    return LoopResult(state, history, i, stopped, rollbacks)


def _monitoring(
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


def _with_opt_state(state: Any, scale: float) -> Any:
    return eqx.tree_at(lambda s: s.opt_state, state, set_lr_scale(state.opt_state, scale))
