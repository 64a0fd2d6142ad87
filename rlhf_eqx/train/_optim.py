"""Optimisers and learning-rate schedules (Optax): AdamW, warmup + decay, global-norm clipping."""

import math
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, PyTree

__all__ = ["ScheduleName", "make_schedule", "make_optimizer", "learning_rate_from_state"]

ScheduleName = Literal["cosine", "constant", "linear"]
_SCHEDULES = ("cosine", "constant", "linear")


def make_schedule(
    *,
    learning_rate: float,
    total_steps: int,
    warmup_ratio: float = 0.0,
    schedule: ScheduleName = "cosine",
) -> optax.Schedule:
    r"""Learning rate as a function of the optimiser step: linear warmup, then a decay.

    With $\eta$ the peak rate, $W = \lceil \text{warmup\_ratio} \cdot N \rceil$ warmup
    steps out of $N$ = `total_steps`:

    - warmup ($s < W$): $\eta\, s / W$ (starts at 0);
    - `"cosine"`: $\frac{\eta}{2}\big(1 + \cos(\pi \frac{s - W}{N - W})\big)$, reaching 0 at $N$;
    - `"linear"`: $\eta\,\frac{N - s}{N - W}$, reaching 0 at $N$;
    - `"constant"`: $\eta$.

    These are Hugging Face `transformers`' `get_cosine_schedule_with_warmup`,
    `get_linear_schedule_with_warmup` and `get_constant_schedule_with_warmup` (TRL's
    `lr_scheduler_type`). The returned `optax.Schedule` maps a step count to a float32
    scalar (jittable; safe under strict dtype promotion).
    """
    if schedule not in _SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {_SCHEDULES}")
    if total_steps <= 0:
        raise ValueError(f"total_steps must be positive, got {total_steps}")
    if not 0.0 <= warmup_ratio < 1.0:
        raise ValueError(f"warmup_ratio must be in [0, 1), got {warmup_ratio}")
    warmup = int(math.ceil(warmup_ratio * total_steps))
    decay_steps = max(total_steps - warmup, 1)
    peak = float(learning_rate)

    def lr(count):
        s = jnp.asarray(count).astype(jnp.float32)
        if schedule == "cosine":
            progress = jnp.clip((s - warmup) / decay_steps, 0.0, 1.0)
            after = 0.5 * (1.0 + jnp.cos(math.pi * progress))
        elif schedule == "linear":
            after = jnp.clip((total_steps - s) / decay_steps, 0.0, 1.0)
        else:
            after = jnp.ones_like(s)
        if warmup > 0:
            after = jnp.where(s < warmup, s / warmup, after)
        return peak * after

    return lr


def _matrices_only(params: PyTree) -> PyTree:
    return jax.tree.map(lambda x: getattr(x, "ndim", 0) >= 2, params)


def make_optimizer(
    *,
    learning_rate: float,
    total_steps: int,
    warmup_ratio: float = 0.0,
    weight_decay: float = 0.0,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    max_grad_norm: float | None = 1.0,
    schedule: ScheduleName = "cosine",
    weight_decay_mask: PyTree | Callable[[PyTree], PyTree] | None = None,
) -> optax.GradientTransformation:
    r"""AdamW with a warmup + decay schedule and global-norm gradient clipping.

    The chain is

    ```python
    optax.chain(
        optax.clip_by_global_norm(max_grad_norm),          # if max_grad_norm is not None
        optax.scale_by_adam(b1, b2, eps),
        optax.add_decayed_weights(weight_decay, mask),
        optax.inject_hyperparams(optax.scale_by_learning_rate)(make_schedule(...)),
    )
    ```

    i.e. `optax.adamw` (Loshchilov & Hutter 2019, decoupled weight decay scaled by the
    learning rate, as PyTorch's `AdamW` used by TRL) after clipping the gradient's global
    norm (Pascanu et al. 2013; TRL `max_grad_norm`). The learning rate is injected as a
    hyperparameter, so the rate used by the latest update can be read back from the
    optimiser state (`learning_rate_from_state`) — the step builders log it as
    `learning_rate`. `make_schedule` with the same arguments gives the schedule itself.

    **Arguments:**

    - `learning_rate`: peak learning rate.
    - `total_steps`: number of optimiser updates of the run (the schedule's horizon).
    - `warmup_ratio`: fraction of `total_steps` spent in the linear warmup.
    - `weight_decay`: decoupled weight decay coefficient.
    - `b1`, `b2`, `eps`: Adam's moment decays and epsilon.
    - `max_grad_norm`: clip the gradient to this global norm; `None` disables clipping.
    - `schedule`: `"cosine"`, `"linear"` or `"constant"` after the warmup.
    - `weight_decay_mask`: which parameters are decayed (a pytree of bools or a function
      of the parameters returning one). Default: every array with at least two
      dimensions (weight matrices and embeddings; not norms, biases or scalar heads).

    **Returns:** an `optax.GradientTransformation`. Initialise it on the trainable
    arrays: `optimizer.init(eqx.filter(params, eqx.is_inexact_array))` (or use
    `init_train_state`).
    """
    if max_grad_norm is not None and max_grad_norm <= 0:
        raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm}")
    lr = make_schedule(
        learning_rate=learning_rate,
        total_steps=total_steps,
        warmup_ratio=warmup_ratio,
        schedule=schedule,
    )
    mask = _matrices_only if weight_decay_mask is None else weight_decay_mask
    parts = []
    if max_grad_norm is not None:
        parts.append(optax.clip_by_global_norm(max_grad_norm))
    parts.append(optax.scale_by_adam(b1=b1, b2=b2, eps=eps))
    if weight_decay != 0.0:
        parts.append(optax.add_decayed_weights(weight_decay, mask))
    parts.append(optax.inject_hyperparams(optax.scale_by_learning_rate)(learning_rate=lr))
    return optax.chain(*parts)


def learning_rate_from_state(opt_state: Any) -> Float[Array, ""] | None:
    """The learning rate injected in `opt_state` (see `make_optimizer`), or `None`.

    After an update this is the rate that update used. Returns `None` when the state
    holds no (or more than one) `learning_rate` hyperparameter.
    """
    try:
        lr = optax.tree_utils.tree_get(
            opt_state, "learning_rate", filtering=lambda _, value: isinstance(value, jax.Array)
        )
    except KeyError:
        return None
    if lr is None or not hasattr(lr, "shape") or lr.shape != ():
        return None
    return jnp.asarray(lr, dtype=jnp.float32)
