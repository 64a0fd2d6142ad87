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


def shared_frozen_seeds(states, seeds: Sequence[int]) -> int | None:
    """How many seeds share their frozen part across the grid: with the members in grid
    order (`make_members`: every seed of a grid point in turn, `seeds[m]` member `m`'s)
    and the frozen arrays of the stacked train `states` (e.g. a LoRA policy's base,
    the seed's SFT policy) equal for the members of one seed, the number of seeds `S`;
    otherwise (no frozen arrays, or they differ) `None`."""
    M, S = len(seeds), len(dict.fromkeys(seeds))
    if M < 2 or M % S or any(seeds[m] != seeds[m % S] for m in range(M)):
        return None
    leaves = [x for x in jax.tree.leaves(states.frozen) if eqx.is_array(x)]
    if not leaves:
        return None
    for x in leaves:
        x = np.asarray(x).reshape(M // S, S, -1)
        if not (x == x[:1]).all():
            return None
    return S


def one_seed_shared(states, seeds: Sequence[int]) -> int | None:
    """`make_program`'s `seeds=` for a sweep: `1` when every member has the same seed
    and the frozen arrays of the stacked `states` are equal (the whole grid shares one
    base, read once per update and multiplied with every grid point's rows in one
    product); `None` otherwise. On 2 CPU cores with the built-in 260K-parameter model
    neither form is measurably faster (the base products are a small part of that
    step: benchmarks/RESULTS.md); the shared one saves the per-member copies' memory
    traffic, which grows with the base."""
    return 1 if shared_frozen_seeds(states, seeds) == 1 else None


def _with_frozen(state, frozen):
    """`state` with its frozen part replaced (no re-check of the stacked fields' shapes)."""
    return eqx.tree_at(lambda s: s.frozen, state, frozen, is_leaf=lambda x: x is None)


def make_program(build_step: Callable[[dict], Callable], *, seeds: int | None = None) -> Callable:
    """The sweep's update: one `eqx.filter_jit` program of every member.

    **Arguments:**

    - `build_step(hyper) -> step`: the stage's step for one member, built from its
      hyperparameters `{field: Float[Array, ""]}` (traced: the step is built inside the
      vmapped function, so one program serves every grid point).
    - `seeds`: `shared_frozen_seeds` of the states (`None`: every member's frozen part
      its own). With `S` seeds whose grid points share their frozen part, the update is
      `vmap` over the seeds of `vmap` over the grid points with the frozen part
      unbatched in the inner one (`in_axes=None`): a frozen base's products take every
      grid point's rows in one matrix product instead of a batched product of per-member
      copies; only the trainable (e.g. low-rank) part is per member (with `S = 1`
      there is no seed axis: one `vmap` with the base closed over). The stacked states
      keep their frozen arrays (the program reads those of the first grid point).

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

    def shared(states, hyper, keys, batches):
        M = keys.shape[0]
        G = M // seeds
        # members are grid-major ([G, S]); seed-major ([S, G]) in the program, so each
        # seed's grid points are adjacent rows of its base's products (no transposes
        # of the activations around them)
        split = (
            lambda t: jax.tree.map(  # noqa: E731
                lambda x: (
                    jnp.swapaxes(x.reshape(G, seeds, *x.shape[1:]), 0, 1) if eqx.is_array(x) else x
                ),
                t,
            )
        )
        merge = (
            lambda t: jax.tree.map(  # noqa: E731
                lambda x: jnp.swapaxes(x, 0, 1).reshape(M, *x.shape[2:]) if eqx.is_array(x) else x,
                t,
            )
        )
        frozen = jax.tree.map(lambda x: x[:seeds] if eqx.is_array(x) else x, states.frozen)
        rest = _with_frozen(states, None)

        def per_seed(frozen_s, rest_s, hyper_s, keys_s, batches_s):
            def per_point(rest_g, h, k, b):
                new, metrics, ok = one(_with_frozen(rest_g, frozen_s), h, k, b)
                return _with_frozen(new, None), metrics, ok

            return eqx.filter_vmap(per_point)(rest_s, hyper_s, keys_s, batches_s)

        if seeds == 1:  # one base: no seed axis at all
            first = jax.tree.map(lambda x: x[0] if eqx.is_array(x) else x, frozen)
            new, metrics, finite = per_seed(first, rest, hyper, keys, batches)
        else:
            args = (frozen, *map(split, (rest, hyper, keys, batches)))
            new, metrics, finite = eqx.filter_vmap(per_seed)(*args)
            new, metrics, finite = merge((new, metrics, finite))
        return _with_frozen(new, states.frozen), metrics, finite

    @eqx.filter_jit
    def program(states, hyper, keys, batches, active):
        if seeds is None:
            new, metrics, finite = eqx.filter_vmap(one)(states, hyper, keys, batches)
        else:
            new, metrics, finite = shared(states, hyper, keys, batches)
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
