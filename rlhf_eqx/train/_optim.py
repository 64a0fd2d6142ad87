"""Optimisers and learning-rate schedules (Optax): AdamW, warmup + decay, global-norm clipping."""

import math
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, PyTree

from ._settings import OptimizerSettings, settings_from
from ._step_cache import BUILDS, value_key
from ._validation import check_positive_int, is_traced_or_array


def make_schedule(
    settings: OptimizerSettings | None = None, *, total_steps: int, **shortcuts: Any
) -> optax.Schedule:
    r"""Learning rate as a function of the optimiser step: linear warmup, then a decay.

    `settings` is an `OptimizerSettings` (or its fields as keywords: `learning_rate`,
    `warmup_ratio`, `schedule` are read here). With $\eta$ the peak rate,
    $W = \lceil \text{warmup\_ratio} \cdot N \rceil$ warmup steps out of
    $N$ = `total_steps`:

    - warmup ($s < W$): $\eta\, s / W$ (starts at 0);
    - `"cosine"`: $\frac{\eta}{2}\big(1 + \cos(\pi \frac{s - W}{N - W})\big)$, reaching 0 at $N$;
    - `"linear"`: $\eta\,\frac{N - s}{N - W}$, reaching 0 at $N$;
    - `"constant"`: $\eta$.

    These are Hugging Face `transformers`' `get_cosine_schedule_with_warmup`,
    `get_linear_schedule_with_warmup` and `get_constant_schedule_with_warmup` (TRL's
    `lr_scheduler_type`). The returned `optax.Schedule` maps a step count to a float32
    scalar (jittable; safe under strict dtype promotion). `learning_rate` may be a JAX
    array (e.g. traced, to `jax.vmap` a whole run over learning rates).
    """
    s = settings_from(OptimizerSettings, settings, shortcuts, where="make_schedule")
    learning_rate, warmup_ratio, schedule = s.learning_rate, s.warmup_ratio, s.schedule
    check_positive_int("total_steps", total_steps)
    warmup = int(math.ceil(warmup_ratio * total_steps))
    decay_steps = max(total_steps - warmup, 1)
    if is_traced_or_array(learning_rate):
        peak = jnp.asarray(learning_rate).astype(jnp.float32)
    else:
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


# Leaves never decayed, by name: norm weights (also when stacked `[L, D]`), biases
# (`bias`, Qwen2's fused `bqkv`), norm/scale vectors and scalar heads.
_NO_DECAY = re.compile(r"(norm|bias|^bqkv$|scale)", re.IGNORECASE)


def _path_names(path) -> list[str]:
    names = []
    for entry in path:
        name = getattr(entry, "name", None)
        if name is None:
            name = getattr(entry, "key", None)
        if isinstance(name, str):
            names.append(name)
    return names


def decay_mask(params: PyTree) -> PyTree:
    """Which leaves get weight decay: weight matrices and embeddings, decided by name.

    A leaf is decayed when it has at least two dimensions **and** no name on its path
    (module field or dict key) names a norm, a bias or a scale (`attn_norm`,
    `final_norm`, `bias`, `bqkv`, ...). Stacked layers make norm weights and biases
    `[L, D]`, so the rank alone cannot tell (Hugging Face and TRL exclude `bias` and
    norm weights by name too).
    """

    def decide(path, x):
        if getattr(x, "ndim", 0) < 2:
            return False
        return not any(_NO_DECAY.search(n) for n in _path_names(path))

    return jax.tree_util.tree_map_with_path(decide, params)


def make_optimizer(
    settings: OptimizerSettings | None = None,
    *,
    total_steps: int,
    weight_decay_mask: PyTree | Callable[[PyTree], PyTree] | None = None,
    **shortcuts: Any,
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

    - `settings`: an `OptimizerSettings`:
        - `learning_rate`: peak learning rate.
        - `warmup_ratio`: fraction of `total_steps` spent in the linear warmup.
        - `weight_decay`: decoupled weight decay coefficient.
        - `max_grad_norm`: clip the gradient to this global norm; `None` disables
          clipping.
        - `schedule`: `"cosine"`, `"linear"` or `"constant"` after the warmup.
        - `b1`, `b2`, `eps`: Adam's moment decays and epsilon.
    - `total_steps`: number of optimiser updates of the run (the schedule's horizon).
    - `**shortcuts`: any field of `OptimizerSettings` as a keyword
      (`make_optimizer(learning_rate=1e-3, total_steps=100)`), replacing the record's;
      another keyword is a `TypeError`.
    - `weight_decay_mask`: which parameters are decayed (a pytree of bools or a function
      of the parameters returning one). Default: `decay_mask` (weight matrices and
      embeddings, by name; not norms, biases or scalar heads, stacked or not).

    `learning_rate` and `weight_decay` may be JAX arrays (also traced: a whole run can
    be `jax.vmap`-ed over them); Python numbers are validated by `OptimizerSettings`.

    **Returns:** an `optax.GradientTransformation` (the same object for equal arguments
    without arrays, so that steps built from it share their compiled programs; see
    `make_step`). Initialise it on the trainable
    arrays: `optimizer.init(eqx.filter(params, eqx.is_inexact_array))` (or use
    `init_train_state`).
    """
    s = settings_from(OptimizerSettings, settings, shortcuts, where="make_optimizer")
    # Equal arguments give the same object, so that steps built from it share their
    # compiled programs (see `make_step`); arrays in the settings build a new one.
    return BUILDS.get_or_build(
        lambda: ("make_optimizer", value_key(s), total_steps, value_key(weight_decay_mask)),
        lambda: _build_optimizer(s, total_steps, weight_decay_mask),
    )


def _build_optimizer(s: OptimizerSettings, total_steps: int, weight_decay_mask: Any):
    weight_decay, max_grad_norm = s.weight_decay, s.max_grad_norm
    lr = make_schedule(s, total_steps=total_steps)
    mask = decay_mask if weight_decay_mask is None else weight_decay_mask
    parts = []
    if max_grad_norm is not None:
        parts.append(optax.clip_by_global_norm(max_grad_norm))
    parts.append(optax.scale_by_adam(b1=s.b1, b2=s.b2, eps=s.eps))
    if is_traced_or_array(weight_decay) or weight_decay != 0.0:
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
