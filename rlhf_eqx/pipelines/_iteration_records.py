"""What the iteration loop writes about an iteration: one record per step (with the
learning rate applied, the rollback factor and, on the iteration's last step, the
rollout's numbers and the monitoring numbers), the `empty_batch` event, and the line
printed every `ops.log_every` iterations."""

from ._config import (
    OpsConfig,
)
from ._metrics import MetricsLog
from ._monitor import device_memory


def monitoring(
    i: int,
    elapsed: float,
    info: dict,
    scores: dict[int, float],
    ops: OpsConfig,
    flops: float | None,
    peak: float | None,
) -> dict:
    """The monitoring numbers of iteration `i`: `model_flops` and `mfu` (against
    `peak`), device memory (with `ops.monitor`) and `reward_improvement` (the rollout
    score minus that of `ops.log_every` iterations before; `scores` keeps them)."""
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


def iteration_records(
    i: int,
    steps: int,
    metrics: list[dict],
    info: dict,
    *,
    elapsed: float,
    lr_scale: float,
    tokens_per_iteration: int | None,
    monitor: dict,
) -> list[dict]:
    """The records of iteration `i`'s steps, numbered from `steps`: each step's metrics,
    its `learning_rate` the rate applied (the schedule's times the rollback factor
    `lr_scale`), and on the last step the rollout's numbers (`rollout/*`),
    `iteration_time_s`, `tokens_per_s` and `monitor` (`monitoring`)."""
    records = []
    for j, m in enumerate(metrics):
        rec = {"iteration": i, "step": steps + j, **m}
        if "learning_rate" in rec:  # the rate applied: the schedule's times the factor
            rec["learning_rate"] = rec["learning_rate"] * lr_scale
        if j == len(metrics) - 1:
            rec.update({f"rollout/{k}": v for k, v in info.items()})
            rec["iteration_time_s"] = elapsed
            if tokens_per_iteration:
                rec["tokens_per_s"] = tokens_per_iteration / max(elapsed, 1e-9)
            rec.update(monitor)
        rec["lr_scale"] = lr_scale
        records.append(rec)
    return records


def note_empty_batches(i: int, steps: int, metrics: list[dict], log: MetricsLog) -> None:
    """An `empty_batch` event when steps of iteration `i` had no token to learn from."""
    empty = sum(m.get("empty_batch", 0.0) > 0 for m in metrics)
    if empty:
        log.event(
            "empty_batch",
            f"iteration {i}: {empty} of {len(metrics)} steps had no token to learn "
            "from (every completion mask false); their updates were skipped",
            iteration=i,
            step=steps,
        )


def report_progress(
    bar, log: MetricsLog, i: int, num_iterations: int, metrics: list[dict], info: dict, ops
) -> None:
    """Advance the progress bar to `i` completed iterations, or without one print the
    loss, accuracies, reward, score and KL every `ops.log_every` iterations and at the
    end."""
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
        log.info(f"iter {i}/{num_iterations} " + " ".join(f"{k} {v:.4f}" for k, v in shown.items()))
