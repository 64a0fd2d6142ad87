"""What the iteration loop checks after each iteration: divergence (non-finite values,
loss and KL spikes), records a resumed run writes again, and monitoring numbers."""

import math
from collections.abc import Callable

import numpy as np

from ._config import (
    OpsConfig,
)
from ._monitor import device_memory

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
