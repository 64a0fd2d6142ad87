"""The members of a sweep as one program: their train states stacked along a leading
member axis, and each update `jax.vmap`ped over (state, hyperparameters, key, batch).

A member whose update is not finite (a non-finite loss, or a step that skipped its
update for a non-finite gradient or parameters) is *diverged*: from then on its state
stays the last finite one (`jnp.where` on the member axis, inside the program) and it
is no longer updated.
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, PyTree


def stack(trees: Sequence[PyTree]) -> PyTree:
    """One pytree whose array leaves stack those of `trees` along a new leading axis
    (the member axis); non-array leaves are taken from the first (they must agree)."""

    def leaf(*xs):
        return jnp.stack(xs) if eqx.is_array(xs[0]) else xs[0]

    return jax.tree.map(leaf, *trees)


def member(tree: PyTree, m: int) -> PyTree:
    """Member `m` of a stacked pytree (its array leaves indexed on the leading axis)."""
    return jax.tree.map(lambda x: x[m] if eqx.is_array(x) else x, tree)


def _per_member(ok: Bool[Array, " M"], x: Array) -> Array:
    return ok.reshape(ok.shape + (1,) * (x.ndim - 1))


def keep_where(ok: Bool[Array, " M"], new: PyTree, old: PyTree) -> PyTree:
    """`new` for the members where `ok`, `old` elsewhere (array leaves; others from `new`)."""
    return jax.tree.map(
        lambda a, b: jnp.where(_per_member(ok, a), a, b) if eqx.is_array(a) else a, new, old
    )


def _finite_params(state) -> Bool[Array, ""]:
    leaves = jax.tree.leaves(eqx.filter(state.params, eqx.is_inexact_array))
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def make_program(build_step: Callable[[dict], Callable]) -> Callable:
    """The sweep's update: one `eqx.filter_jit` program of every member.

    **Arguments:**

    - `build_step(hyper) -> step`: the stage's step for one member, built from its
      hyperparameters `{field: Float[Array, ""]}` (traced: the step is built inside the
      vmapped function, so one program serves every grid point).

    **Returns:** `program(states, hyper, keys, batches, active) -> (states, metrics,
    finite)`: `states` stacked `TrainState`s, `hyper` `{field: Float[Array, " M"]}`,
    `keys` stacked key data `[M, ...]` (`jax.random.key_data`), `batches` stacked
    batches, `active` `Bool[" M"]` (members that take this step: alive and with data).
    A member takes its update when `active` and its step was finite (`finite`, per
    member: finite loss, no skipped non-finite update, finite parameters); otherwise
    its state is returned unchanged. `metrics`: `{name: Float[" M"]}`.
    """

    def one(state, hyper: dict, key_data, batch):
        step = build_step(hyper)
        key = jax.random.wrap_key_data(key_data)
        new, metrics = state.apply(step, batch, key=key, donate=False)
        finite = jnp.isfinite(metrics["loss"]) & (metrics.get("nonfinite", 0.0) == 0)
        return new, metrics, finite & _finite_params(new)

    @eqx.filter_jit
    def program(states, hyper, keys, batches, active):
        new, metrics, finite = eqx.filter_vmap(one)(states, hyper, keys, batches)
        states = keep_where(active & finite, new, states)
        return states, metrics, finite

    return program


def hyper_arrays(points: Sequence[dict[str, float]]) -> dict[str, Float[Array, " M"]]:
    """`[{field: value}, ...]` per member -> `{field: Float[" M"]}` (float32)."""
    if not points or not points[0]:
        return {}
    return {k: jnp.asarray([p[k] for p in points], jnp.float32) for k in points[0]}


def key_data(keys: Sequence[jax.Array]) -> Array:
    """Stacked raw key data of typed keys (one per member), for `make_program`."""
    return jnp.stack([jax.random.key_data(k) for k in keys])


def unstacked_metrics(metrics: dict[str, Array], m: int) -> dict[str, float]:
    """Member `m`'s step metrics as Python floats."""
    return {k: float(v[m]) for k, v in metrics.items()}


@dataclasses.dataclass
class SweepRun:
    """A stage prepared as a sweep, for the sweep loop (`sweep`).

    - `states`: the members' initial train states, stacked.
    - `num_iterations`: iterations of the stage (steps of a batch stage, rounds of
      online DPO); iteration `i` depends only on the states and `i`, so a sweep resumed
      from a checkpoint continues exactly.
    - `iteration(states, alive, i) -> Iteration`: run iteration `i` for the members
      where `alive` (`bool[M]`).
    - `evaluate(states, m) -> dict`: member `m`'s held-out evaluation at the end (the
      numbers its separate run reports), or `{}`.
    - `export(states, m, directory)`: write member `m`'s trained model.
    """

    states: Any
    num_iterations: int
    iteration: Callable[[Any, np.ndarray, int], "Iteration"]
    evaluate: Callable[[Any, int], dict]
    export: Callable[[Any, int, str], None]


@dataclasses.dataclass
class Iteration:
    """What one iteration of a sweep did: the new stacked `states`, `finite[m]` (False
    when member `m` diverged in it), each member's step metrics `records[m]` (a list of
    dicts, as a separate run logs them), `info[m]` (logged on its last step as
    `rollout/<name>`, as a separate run does), `events`, `(m, kind, message)`, and
    `stopped[m]` (True when member `m` stopped early in it, as its separate run would,
    e.g. at GRPO's KL guard; `None`: none did)."""

    states: Any
    finite: np.ndarray
    records: list[list[dict]]
    info: list[dict]
    events: list[tuple[int, str, str]] = dataclasses.field(default_factory=list)
    stopped: np.ndarray | None = None
