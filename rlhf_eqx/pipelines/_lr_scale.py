"""The learning-rate factor a rollback lowers: the last transformation of every run's
optimiser, its factor part of the optimiser state (so checkpoints keep it)."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, PyTree

from .. import train
from ..train import OptimizerSettings


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


def build_optimizer(optim: OptimizerSettings, total_steps: int) -> optax.GradientTransformation:
    """AdamW + warmup/decay + clipping (`rlhf_eqx.train.make_optimizer` of the stage's
    `OptimizerSettings`), then the rollback's learning-rate factor. The step's
    `learning_rate` metric is the schedule's rate; the run loop logs it times this factor
    (the rate applied)."""
    base = train.make_optimizer(optim, total_steps=max(total_steps, 1))
    # the same object for the same `base`, so that equal steps share their programs
    return train.shared_build(("lr_factor", base), lambda: optax.chain(base, scale_by_lr_factor()))


def _is_scale(x: Any) -> bool:
    return isinstance(x, LRScaleState)


def get_lr_scale(opt_state: PyTree) -> float:
    """The learning-rate factor in `opt_state` (1.0 when there is none). An ensemble's
    optimiser state holds one factor per member, all equal: the first is returned."""
    found = [x.scale for x in jax.tree.leaves(opt_state, is_leaf=_is_scale) if _is_scale(x)]
    return float(jnp.ravel(found[0])[0]) if found else 1.0


def set_lr_scale(opt_state: PyTree, scale: float) -> PyTree:
    """`opt_state` with every `LRScaleState` factor set to `scale` (every member's, for an
    ensemble's stacked state)."""
    return jax.tree.map(
        lambda x: LRScaleState(jnp.full_like(x.scale, scale, jnp.float32)) if _is_scale(x) else x,
        opt_state,
        is_leaf=_is_scale,
    )
