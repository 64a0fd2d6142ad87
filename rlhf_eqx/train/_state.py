"""Train state: the trainable partition of a model, its frozen rest, optimiser state, step."""

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Int, PRNGKeyArray, PyTree

from ._step import Step


def combine(params: PyTree, frozen: PyTree) -> PyTree:
    """Rebuild a model from its trainable and frozen parts (`frozen=None`: `params` is whole)."""
    if frozen is None:
        return params
    return eqx.combine(params, frozen)


def partition_trainable(
    model: PyTree, filter_spec: PyTree | Callable[[Any], bool] | None = None
) -> tuple[PyTree, PyTree]:
    """Split `model` into `(params, frozen)` with `eqx.partition`.

    `params` holds the leaves selected by `filter_spec` that are floating-point arrays
    (the only leaves an optimiser can update); everything else — unselected arrays,
    integer arrays (e.g. quantised weights), static Python values — goes to `frozen`.
    `filter_spec=None` trains every floating-point array. For LoRA, pass a filter
    tree that is `True` on the adapter leaves only (`eqx.tree_at` over a
    `jax.tree.map(lambda _: False, model)`), as in Levanter's `lora_trainable_params_filter`.
    `eqx.combine(params, frozen)` gives `model` back.
    """
    if filter_spec is None:
        return eqx.partition(model, eqx.is_inexact_array)
    selected, rest = eqx.partition(model, filter_spec)
    params, non_float = eqx.partition(selected, eqx.is_inexact_array)
    return params, eqx.combine(rest, non_float)


class TrainState(eqx.Module):
    """Everything one training run carries between steps (after Levanter's `TrainerState`).

    - `params`: the trainable partition of the model (floating-point arrays, `None`
      elsewhere) — what the optimiser sees.
    - `frozen`: the rest of the model (frozen weights, e.g. LoRA base weights, and
      non-array leaves), `None` where a leaf is trainable.
    - `opt_state`: the optimiser state of `params`.
    - `step`: number of updates applied.
    - `skipped`: number of updates skipped because their loss or gradient was not finite.
    - `key`: the run's PRNG key (or `None`); `apply` splits it for each step that takes
      one, so a whole run is a deterministic function of its initial key.

    `state.model` is the whole model (`eqx.combine(params, frozen)`). A step `fn`
    built by this package is applied with `state.apply(fn, batch, ...)`, which calls
    `fn(state.params, state.opt_state, batch, frozen=state.frozen, ...)` and returns the
    new state and the metrics. A reference model (DPO, PPO, GRPO) is passed separately
    as a keyword argument: with LoRA it is the frozen base (the model with its adapters
    removed), which shares its arrays with `frozen`.

    `apply` **donates** the state's `params` and `opt_state` to steps built by this
    package (they are updated in place; not to steps built with `donate=False`): the
    state passed in is consumed. Keep a copy
    (`jax.tree.map(jnp.copy, state)`) if you need it afterwards, e.g. for a rollback.
    """

    params: PyTree
    frozen: PyTree
    opt_state: optax.OptState
    step: Int[Array, ""]
    skipped: Int[Array, ""] = eqx.field(default_factory=lambda: jnp.zeros((), jnp.int32))
    key: PRNGKeyArray | None = None

    @property
    def model(self) -> PyTree:
        return combine(self.params, self.frozen)

    def apply(
        self, step_fn: Callable[..., Any], batch: PyTree, *, donate: bool = True, **kwargs: Any
    ) -> tuple["TrainState", dict]:
        """Run one update: `(new_state, metrics)`; `kwargs` go to `step_fn` (e.g. `reference=`).

        Without an explicit `key=`, a state holding a `key` splits it and passes one half
        to the step. `donate` (default on) lets steps built by this package update the
        state's buffers in place (see the class docstring); other callables are called
        without it.
        """
        new_key = self.key
        if "key" not in kwargs and self.key is not None:
            new_key, kwargs["key"] = jax.random.split(self.key)
        if isinstance(step_fn, Step) and step_fn.donate is not False:
            kwargs["donate"] = donate
        params, opt_state, metrics = step_fn(
            self.params, self.opt_state, batch, frozen=self.frozen, **kwargs
        )
        skipped = self.skipped
        if "nonfinite" in metrics:
            skipped = skipped + (metrics["nonfinite"] > 0).astype(skipped.dtype)
        new = dataclasses.replace(
            self,
            params=params,
            opt_state=opt_state,
            step=self.step + 1,
            skipped=skipped,
            key=new_key,
        )
        return new, metrics


def init_train_state(
    model: PyTree,
    optimizer: optax.GradientTransformation,
    *,
    filter_spec: PyTree | Callable[[Any], bool] | None = None,
    key: PRNGKeyArray | None = None,
) -> TrainState:
    """Partition `model` (see `partition_trainable`) and initialise `optimizer` on its trainable
    part.

    The trainable arrays are copied (each leaf separately, so a model whose parts share
    arrays, e.g. `(policy, ValueModel.from_policy(policy))`, gets distinct buffers), so
    `model` stays usable (e.g. as the reference model) after steps that donate the
    state's buffers. `key` is the run's PRNG key (see `TrainState`).
    """
    params, frozen = partition_trainable(model, filter_spec)
    # The state owns its trainable buffers: steps may donate them, and `model` (often
    # also the reference model) must stay valid.
    params = jax.tree.map(jnp.copy, params)
    with jax.numpy_dtype_promotion("standard"):  # Optax is not written for strict promotion.
        opt_state = optimizer.init(params)
    return TrainState(
        params=params,
        frozen=frozen,
        opt_state=opt_state,
        step=jnp.zeros((), jnp.int32),
        key=key,
    )
