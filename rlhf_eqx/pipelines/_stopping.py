"""The iteration loop's stopping rules: what counts as a problem after an iteration
(non-finite values, loss and KL spikes: `find_problem`), what the loop does about it
(roll back, stop as diverged, or only note a spike: `handle_problem`), and the KL guard
(`kl_guard`). The states they fall back to are kept in `Fallbacks`.
"""

import dataclasses
import math
from typing import Any

import numpy as np

from ._checkpoints import discard_checkpoints_after
from ._config import (
    OpsConfig,
)
from ._loop_state import Position
from ._lr_scale import get_lr_scale, set_lr_scale
from ._metrics import MetricsLog

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


@dataclasses.dataclass
class Fallbacks:
    """The states the stopping rules return to, each as `(iteration, state before it)`:
    `verified`, the last state whose own loss was measured finite and below the spike
    threshold (presumed good at the start); `within`, the last one whose rollout KL was
    within the KL guard's target; and the rollbacks used so far."""

    verified: tuple[int, Any]
    within: tuple[int, Any] | None = None
    rollbacks: int = 0

    def accept(self, i: int, good: Any, *, stepped: bool, measured_kl: bool) -> None:
        """Iteration `i`, started from `good`, passed the checks: its first step's loss
        verified `good` (when it took a step), and its rollout KL was within the target
        (when measured)."""
        if stepped:
            self.verified = (i, good)
        if measured_kl:
            self.within = (i, good)


@dataclasses.dataclass(frozen=True)
class Handled:
    """What `handle_problem` decided: `action` is `"rollback"` (run again from
    `position`), `"diverged"` (stop with `position`) or `"spike"` (a spike noted with
    rollback off: the iteration is kept); `history` is the metrics history to keep."""

    action: str
    position: Position
    history: list[dict]


def handle_problem(
    problem: str,
    before_ok: bool,
    i: int,
    good: Any,
    pos: Position,
    fallbacks: Fallbacks,
    history: list[dict],
    *,
    ops: OpsConfig,
    log: MetricsLog,
    checkpoint_dir: str | None,
) -> Handled:
    """Roll back, stop as diverged, or note a spike after iteration `i` (started from
    `pos`, whose state was copied as `good`) found `problem`.

    - **Rollback** (`ops.rollback`, while `fallbacks.rollbacks < ops.max_rollbacks`): back
      to the state before this iteration when only a later step failed (`before_ok`),
      else to `fallbacks.verified`; the learning-rate factor is divided by
      `ops.lr_backoff`, checkpoints past it are discarded, the history of the iterations
      undone is dropped and a `rollback` event is logged. The step count goes on.
    - **Divergence**: rollbacks exhausted, or a non-finite value with rollback off: stop
      with that same state (finite weights) and a `diverged` event.
    - A spike with rollback off is only noted (`spike` event).
    """
    back_to, restored = (i, good) if before_ok else fallbacks.verified
    steps, losses = pos.steps, pos.losses
    if ops.rollback and fallbacks.rollbacks < ops.max_rollbacks:
        fallbacks.rollbacks += 1
        scale = get_lr_scale(pos.state) / ops.lr_backoff
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
        losses = [x.get("loss", 0.0) for x in kept][-10:] if dropped else losses
        fallbacks.verified = (back_to, restored)
        return Handled(
            "rollback", Position(back_to, set_lr_scale(restored, scale), steps, losses), kept
        )
    if ops.rollback or "spike" not in problem:
        why = f"{ops.max_rollbacks} rollbacks used" if ops.rollback else "rollback is off"
        log.event(
            "diverged",
            f"iteration {i}: {problem}; {why}: stopping with the state before "
            f"iteration {back_to} (finite weights)",
            iteration=i,
            restored=back_to,
            step=steps,
        )
        return Handled("diverged", Position(back_to, restored, steps, losses), history)
    log.event("spike", f"iteration {i}: {problem} (rollback is off)", iteration=i, step=steps)
    return Handled("spike", pos, history)


def kl_guard(
    i: int,
    info: dict,
    kl_target: float | None,
    good: Any,
    pos: Position,
    fallbacks: Fallbacks,
    log: MetricsLog,
) -> Position | None:
    """The position to stop with when iteration `i`'s rollout KL to the reference
    (`info["kl"]`) exceeds `kl_target`: iteration `i` with the last policy whose rollout
    KL was within the target (`fallbacks.within`, else the state `good` the iteration
    started from); a `kl_guard` event says so. `None` while within the target."""
    if kl_target is None or info.get("kl", 0.0) <= kl_target:
        return None
    back_to, restored = fallbacks.within if fallbacks.within is not None else (i, good)
    log.event(
        "kl_guard",
        f"iteration {i}: KL to the reference {info['kl']:.4f} > target "
        f"{kl_target}; stopping with the policy before iteration {back_to}, the "
        "last one within the target",
        iteration=i,
        kl=info["kl"],
        restored=back_to,
        step=pos.steps,
    )
    return Position(i, restored, pos.steps, pos.losses)
