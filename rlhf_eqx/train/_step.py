r"""One step factory: every update of this package is `make_step(loss_fn, optimizer, ...)`.

A **loss function** describes one algorithm on one (micro-)batch:

```python
loss_fn(params, frozen, batch, key) -> (numerators, denominators, metrics)
```

- `numerators`: `{term: scalar}`, sums over the rows of the batch (e.g. the masked sum
  of per-token losses, already multiplied by the term's coefficient);
- `denominators`: `{term: scalar}`, the same keys, computed from the masks only (never
  from parameters), so that they add up over rows;
- `metrics`: `{name: (sum, count)}`, masked sums that add up over rows.

**Empty batches.** A batch with an array field of zero rows is refused when the step is
traced (`ValueError` naming the field and its shape). A batch whose every loss term has
a global denominator of 0 — e.g. every completion mask false, so that the loss is the
0 of `safe_divide` with a zero gradient — has nothing to learn from: the step leaves
`params` and `opt_state` as they are (an optimiser's momentum, weight decay and
schedule would otherwise move on) and reports `empty_batch = 1`, a metric counted like
`nonfinite` (the step stays one jitted region; callers see it in the metrics).

The loss of the whole (global) batch is $\sum_k N_k / D_k$ where $N_k$ and $D_k$ are the
sums of the numerators and denominators over every micro-batch and every device. The
factory computes the denominators of the full batch first (a mask-only pass: the model
calls in it are dead code that XLA removes), then differentiates
$\sum_k N_k^{(i)} / D_k$ on each micro-batch $i$ under a `lax.scan`, and, with
`axis_name`, `psum`s numerators, denominators, gradients and metric sums over the
device axis before dividing. Every aggregation mode is therefore exact across
micro-batches **and** devices.

**Donation (the one rule).** A step called directly never donates its inputs unless
asked to (`donate=True` at build time or per call). `TrainState.apply` asks, unless the
step was built with `donate=False`: a `TrainState` owns its trainable buffers
(`init_train_state` copies them), so they may be updated in place. Even then, a buffer that also
appears elsewhere in the call (e.g. a reference model sharing arrays with `params`, or the same
array twice) is never donated: the step falls back to its non-donating version.
"""

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from ..losses import safe_divide
from ._accumulate import Sums, accumulate_gradients, apply_optimizer, sums_to_means
from ._settings import NonFinite as NonFinite, StepOptions, settings_from
from ._step_cache import BUILDS, function_key, value_key

LossFn = Callable[
    [PyTree, PyTree, PyTree, PRNGKeyArray | None],
    tuple[Mapping[str, Array], Mapping[str, Array], Sums],
]
PrepareFn = Callable[[PyTree, str | None], tuple[PyTree, Sums]]
MetricsFn = Callable[[dict[str, Array], PyTree], dict[str, Array]]


def _psum(tree: PyTree, axis_name: str | None) -> PyTree:
    return tree if axis_name is None else jax.lax.psum(tree, axis_name)


def _all_finite(loss: Array, tree: PyTree) -> Array:
    """Whether `loss` and every array of `tree` are finite: one reduction per array, which
    keeps each array's sharding (concatenating the arrays first would gather sharded
    parameters and write a temporary the size of the model)."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.logical_and(jnp.isfinite(loss), jnp.all(jnp.stack(leaves)) if leaves else True)


def _raise_nonfinite(loss: Array, grads: PyTree, terms: dict[str, Array], finite: Array) -> Array:
    """`loss`, with a runtime error unless `finite` that says what is not finite: a term
    of the loss by name (`'policy'`, `'dpo'`, ...), the loss, the gradient (of a finite
    loss) or the update (of a finite loss and gradient)."""
    names = sorted(terms)
    messages = [
        *(f"non-finite loss, gradient or update: the loss term {n!r} is not finite" for n in names),
        "non-finite loss, gradient or update: the loss is not finite",
        "non-finite loss, gradient or update: the gradient of a finite loss is not finite",
        "non-finite loss, gradient or update: the update of a finite loss and gradient is not "
        "finite (the optimizer's state or learning rate)",
    ]
    n = len(names)
    if names:
        bad_terms = jnp.stack([~jnp.isfinite(terms[k]) for k in names])
        first_bad = jnp.argmax(bad_terms)
        loss_index = jnp.where(jnp.any(bad_terms), first_bad, n)
    else:
        loss_index = jnp.asarray(n)
    grads_finite = _all_finite(jnp.zeros((), jnp.float32), grads)
    index = jnp.where(~jnp.isfinite(loss), loss_index, jnp.where(grads_finite, n + 2, n + 1))
    return eqx.branched_error_if(loss, ~finite, index, messages)


def _select(pred: Array, on_true: PyTree, on_false: PyTree) -> PyTree:
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def _check_rows(batch: PyTree) -> None:
    """Refuse (at trace time) a batch with an array field of zero rows."""
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        shape = getattr(x, "shape", None)
        if shape is not None and len(shape) >= 1 and shape[0] == 0:
            raise ValueError(
                f"{type(batch).__name__}{jax.tree_util.keystr(path)} has shape {tuple(shape)}: "
                "the batch has no rows (a step needs at least one)"
            )


def _check_micro_batches(batch: PyTree, micro_batches: int, axis_name: str | None) -> None:
    """Refuse (at trace time) a batch whose rows do not divide into `micro_batches`,
    naming the field and its shape (under `axis_name`, the rows of one device)."""
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        shape = getattr(x, "shape", None)
        if shape is None or len(shape) == 0 or shape[0] % micro_batches == 0:
            continue
        rows = f"{shape[0]} rows"
        if axis_name is not None:
            rows += (
                f" on each device of axis {axis_name!r} (under jax.pmap / shard_map a step "
                "sees its device's rows: the global batch's rows / the number of devices)"
            )
        raise ValueError(
            f"{type(batch).__name__}{jax.tree_util.keystr(path)} has shape {tuple(shape)}: "
            f"{rows}, not divisible by micro_batches={micro_batches}"
        )


def _manual_axes() -> list[str]:
    """The device axes bound where the step is traced: the `Manual` axes of the abstract
    mesh that `jax.pmap` and `jax.shard_map` set (none under `jax.jit` or `jax.vmap`)."""
    mesh = jax.sharding.get_abstract_mesh()
    return [a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Manual]


# The name `jax.pmap` gives its axis when called without `axis_name`.
_UNNAMED_PMAP_AXIS = "_internal_pmap_axis_name"


def _check_axis_bound(axis_name: str) -> None:
    """Refuse (at trace time) a step built for the device axis `axis_name` that runs
    where no such axis is bound (under `jax.jit` on a mesh, or outside any transform)."""
    try:
        jax.lax.axis_index(axis_name)
    except NameError:
        bound = [repr(a) for a in _manual_axes() if a != _UNNAMED_PMAP_AXIS]
        where = f" (the device axes bound here: {', '.join(bound)})" if bound else ""
        raise ValueError(
            f"this step was built with axis_name={axis_name!r} (StepOptions.axis_name), but it "
            f"runs where no device axis {axis_name!r} is bound{where}: call it under "
            f"jax.pmap(..., axis_name={axis_name!r}) or jax.shard_map over a mesh axis of that "
            "name, or build it without axis_name to run it under jax.jit on a sharded mesh "
            "(rlhf_eqx.distributed.shard_train_state / shard_batch)"
        ) from None


def _vma(x) -> frozenset:
    """The manual device axes `x`'s type varies over (empty outside `jax.shard_map`, or
    where the varying axes are not tracked: `check_vma=False`)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # where JAX keeps them since 0.9
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def _varying_like_batch(params: PyTree, batch: PyTree, axis_name: str | None) -> PyTree:
    """`params`' floating-point arrays cast to vary over the device axis `axis_name`
    where the batch varies over it and they do not: replicated parameters inside
    `jax.shard_map` with `check_vma=True`. Autodiff would otherwise sum a replicated
    input's cotangent over the devices itself, and the step's own `psum` of the gradients
    would sum it a second time (an update `N` times too large on `N` devices); cast, each
    device's gradient stays its own and is summed once. The values are unchanged, and so
    is everything under `jax.pmap`, `jax.jit` or `check_vma=False` (nothing to cast)."""
    if axis_name is None or not any(
        axis_name in _vma(x) for x in jax.tree.leaves(batch) if isinstance(x, jax.Array)
    ):
        return params
    return vary_over(params, frozenset((axis_name,)))


def varying_axes(tree: PyTree) -> frozenset:
    """The manual device axes that any array of `tree` varies over (`jax.shard_map` with
    `check_vma=True`; empty elsewhere)."""
    return frozenset().union(*(_vma(x) for x in jax.tree.leaves(tree) if eqx.is_array(x)))


def vary_over(tree: PyTree, axes: frozenset) -> PyTree:
    """`tree`'s floating-point arrays cast (`jax.lax.pcast(..., to="varying")`) to vary
    over the manual device axes `axes` where they do not yet; values unchanged, and
    `tree` itself when `axes` is empty (outside `jax.shard_map`, or `check_vma=False`).

    A replicated weight used on a shard of the rows inside a branch of `jax.lax.cond`
    must vary like the rows before the branch: the branches then have one output type
    (a skipped branch's zeros cast the same way), and the cast's transpose (a `psum` of
    the weight's cotangent over the axes) runs outside the conditional, on every device."""
    if not axes:
        return tree

    def cast(x):
        missing = tuple(sorted(axes - _vma(x), key=str)) if eqx.is_inexact_array(x) else ()
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def _check_no_device_axis() -> None:
    """Refuse (at trace time) a step built without `axis_name` that runs inside
    `jax.pmap` or `jax.shard_map`: each device would take its own shard's step and the
    replicas would drift apart, with no error."""
    axes = _manual_axes()
    if not axes:
        return
    if axes == [_UNNAMED_PMAP_AXIS]:
        where, name = "under jax.pmap without an axis name", "data"
        how = f"jax.pmap(step, axis_name={name!r}) with make_x_step(..., axis_name={name!r})"
    else:
        names = ", ".join(repr(a) for a in axes)
        where = f"over the device axis(es) {names} (jax.pmap / shard_map)"
        name = axes[0]
        how = f"make_x_step(..., axis_name={name!r}) (StepOptions.axis_name)"
    raise ValueError(
        f"this step was built without axis_name (StepOptions.axis_name) but runs {where}: "
        "each device would update its own copy with its own shard's gradient and the copies "
        f"would drift apart. Build it for the axis: {how}, which sums numerators, "
        "denominators and gradients over the devices; or run the unchanged step under "
        "jax.jit on a sharded mesh (rlhf_eqx.distributed.make_mesh, shard_train_state, "
        "shard_batch). Independent copies on purpose (one per device): jax.vmap the step "
        "over a leading copy axis and shard that axis over a mesh under jax.jit"
    )


def _explicit_leaves(named: Mapping[str, PyTree]) -> list[str]:
    """The array leaves of `named` (argument name -> tree) that are sharded over a mesh
    axis of type `AxisType.Explicit`, each as `"<argument><path> shape ... over axis ..."`."""
    found = []
    for name, tree in named.items():
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if not eqx.is_array(x):
                continue
            sharding = getattr(jax.typeof(x), "sharding", None)
            mesh = getattr(sharding, "mesh", None)
            if mesh is None or not mesh.axis_names:
                continue
            explicit = {
                a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit
            }
            axes = [
                a
                for part in sharding.spec
                if part is not None
                for a in (part if isinstance(part, tuple) else (part,))
                if a in explicit
            ]
            if axes:
                where = ", ".join(repr(a) for a in axes)
                found.append(
                    f"{name}{jax.tree_util.keystr(path)} (shape {tuple(x.shape)}) over the "
                    f"Explicit mesh axis {where}"
                )
    return found


def _device_sets_message(named: Mapping[str, PyTree]) -> str:
    """Why one jitted step cannot take these arguments: the first array (by argument and
    path) on each distinct set of devices, with its shape and device ids."""
    first: dict[tuple[int, ...], str] = {}
    for name, tree in named.items():
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
                continue
            ids = tuple(sorted(d.id for d in x.sharding.device_set))
            first.setdefault(
                ids,
                f"{name}{jax.tree_util.keystr(path)} (shape {tuple(x.shape)}) on devices "
                f"{list(ids)}",
            )
    return (
        "the step's arguments live on different sets of devices: "
        + "; ".join(first.values())
        + ". One jitted step runs on one set: place the train state, the batch and any "
        "reference model on the same mesh (rlhf_eqx.distributed.shard_train_state, "
        "shard_model, shard_batch)"
    )


def _check_token_ids(batch: PyTree, vocab_size: int) -> PyTree:
    """Raise at run time (`eqx.error_if`) if an integer leaf of `batch` leaves `[0, vocab_size)`."""

    def check(x):
        if not (eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.integer)):
            return x
        bad = (x < 0) | (x >= vocab_size)
        return eqx.error_if(x, jnp.any(bad), f"token id outside [0, {vocab_size}) in the batch")

    return jax.tree.map(check, batch)


def _leaf_ids(tree: PyTree) -> list[int]:
    return [id(x) for x in jax.tree.leaves(tree) if eqx.is_array(x)]


def _safe_to_donate(donated: PyTree, kept: PyTree) -> bool:
    """Donate only concrete arrays that appear once and nowhere else in the call."""
    leaves = [x for x in jax.tree.leaves(donated) if eqx.is_array(x)]
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        return False
    ids = [id(x) for x in leaves]
    return len(set(ids)) == len(ids) and not set(ids) & set(_leaf_ids(kept))


class Step:
    """A compiled update `step(params, opt_state, batch, *, frozen=None, key=None, ...)`.

    Built by `make_step`. Calling it runs one `eqx.filter_jit` region and returns
    `(params, opt_state, metrics)`. Keyword arguments named in `extras` (e.g.
    `reference=`) are passed to the loss function inside `frozen`, as the tuple
    `(frozen, *extras)`. `donate=True` (per call, or the build-time default) updates
    `params` and `opt_state` in place when no other argument shares their buffers;
    see the module docstring for the rule. Steps built with equal keys (`shared`, a
    thunk returning the key; see `make_step`'s `cache_key`) share their jitted update and
    hence its compiled programs.
    """

    def __init__(
        self,
        update: Callable[..., Any],
        *,
        donate: bool | None,
        batch_type: type | tuple[type, ...] | None = None,
        extras: Sequence[str] = (),
        shared: Callable[[], Hashable] | None = None,
    ):
        def jit():
            return eqx.filter_jit(update), eqx.filter_jit(update, donate="all-except-first")

        self._plain, self._donating = jit() if shared is None else BUILDS.get_or_build(shared, jit)
        self.donate = donate
        self.batch_type = batch_type
        self.extras = tuple(extras)

    def __call__(
        self,
        params: PyTree,
        opt_state: Any,
        batch: PyTree,
        *,
        frozen: PyTree = None,
        key: PRNGKeyArray | None = None,
        donate: bool | None = None,
        **extras: Any,
    ) -> tuple[PyTree, Any, dict[str, Float[Array, ""]]]:
        unknown = set(extras) - set(self.extras)
        if unknown:
            allowed = ("frozen", "key", "donate") + self.extras
            raise TypeError(f"unexpected keyword argument(s) {sorted(unknown)}; expected {allowed}")
        if self.batch_type is not None and not isinstance(batch, self.batch_type):
            raise TypeError(
                f"batch must be a {getattr(self.batch_type, '__name__', self.batch_type)}, "
                f"got {type(batch).__name__}"
            )
        named = dict(params=params, opt_state=opt_state, batch=batch, frozen=frozen, **extras)
        if self.extras:
            frozen = (frozen, *(extras.get(name) for name in self.extras))
        rest = (batch, frozen, key)
        want = bool(self.donate) if donate is None else donate
        update = self._plain
        if want and _safe_to_donate((params, opt_state), rest):
            update = self._donating
        try:
            return update(rest, params, opt_state)
        except ValueError as e:
            if "incompatible devices" not in str(e):
                raise
            raise ValueError(_device_sets_message({**named, "key": key})) from e


def make_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    options: StepOptions | None = None,
    *,
    prepare: PrepareFn | None = None,
    metrics_fn: MetricsFn | None = None,
    batch_type: type | tuple[type, ...] | None = None,
    extras: Sequence[str] = (),
    cache_key: Hashable = None,
    **shortcuts: Any,
) -> Step:
    r"""Build one pure, jitted update from a loss function (see the module docstring).

    **Arguments:**

    - `loss_fn`: `(params, frozen, batch, key) -> (numerators, denominators, metrics)`.
    - `optimizer`: an `optax.GradientTransformation` (e.g. `make_optimizer`).
    - `options`: a `StepOptions` (or its fields as keyword shortcuts, e.g.
      `micro_batches=2`):
        - `micro_batches`: split the (per-device) batch into this many micro-batches
          and accumulate; same loss and gradient as the full batch. Rows that do not
          divide are refused when the step is traced (`ValueError` naming the field,
          its shape and, under `axis_name`, the device axis).
        - `axis_name`: the device axis of `jax.pmap` (or `shard_map`) this step runs
          under; numerators, denominators, gradients and metric sums are
          `psum`-reduced over it. A `key` is folded with the device index, so dropout
          differs across devices. Called where no axis of that name is bound (e.g.
          under `jax.jit` on a sharded mesh, which needs no axis name) the step raises
          `ValueError` when traced; so does a step built without `axis_name` traced
          inside `jax.pmap` or `jax.shard_map` (a `Manual` axis of
          `jax.sharding.get_abstract_mesh()`), where each device would otherwise take its
          own shard's step and the replicas would drift apart. Inputs sharded over
          `AxisType.Explicit` mesh axes (sharding-in-types) that fail to trace are
          named in a `ValueError`: the steps run on automatic axes
          (`rlhf_eqx.distributed.make_mesh`).
        - `donate`: donating `params` / `opt_state`: `None` (default) only through
          `TrainState.apply`, `True` also on direct calls, `False` never (see the
          module docstring).
        - `nonfinite`: what to do when the loss or a gradient is not finite: `"skip"`
          (default) leaves `params` and `opt_state` unchanged (also when the update
          itself is not finite, e.g. with an infinite learning rate) and reports
          `nonfinite = 1`; `"raise"` stops with an error (`eqx.error_if`).
        - `check_token_ids`: a vocabulary size; every integer array of the batch is
          checked to lie in `[0, vocab)` inside the step (an opt-in `eqx.error_if`).
    - `prepare`: `(batch, axis_name) -> (batch, metric sums)`, run once on the full
      (per-device) batch before micro-batching (e.g. group-relative advantages).
    - `metrics_fn`: `(metrics, grads) -> metrics`, applied last (derived metrics).
    - `batch_type`, `extras`: see `Step`.
    - `cache_key`: what `loss_fn`, `prepare` and `metrics_fn` compute, as a value
      compared by value (dataclasses field by field; e.g. the builders pass their name
      and settings record). Two builds with equal keys, the same `optimizer` object,
      equal `options`, `batch_type` and `extras` share one jitted update: the second
      build compiles nothing (same-shaped batches). `None` (default): the functions'
      identity when they are plain functions that capture nothing, else no sharing (a
      closure may hold anything). A key holding an array (e.g. a traced
      hyperparameter) and a build under a JAX transformation are not shared.

    **Returns:** a `Step`,
    `step(params, opt_state, batch, *, frozen=None, key=None, donate=None, **extras)
    -> (params, opt_state, metrics)`. Metrics: `loss`, `loss/<term>` (when the loss has
    several terms), the loss function's metric means, `grad_norm`, `learning_rate`
    (when the optimiser injects it), `nonfinite` (1.0 when this update was skipped for a
    non-finite loss, gradient or update) and `empty_batch` (1.0 when every loss term's
    denominator was 0 over the global batch: the update was skipped). A batch with zero
    rows raises `ValueError` at trace time (see the module docstring).
    """
    options = settings_from(StepOptions, options, shortcuts, where="make_step")
    micro_batches, axis_name = options.micro_batches, options.axis_name
    nonfinite, check_token_ids = options.nonfinite, options.check_token_ids
    sg = jax.lax.stop_gradient

    def update(rest, params, opt_state):
        try:
            return run(rest, params, opt_state)
        except ValueError:
            raise
        except Exception as e:
            batch, frozen, _ = rest
            named = dict(params=params, opt_state=opt_state, batch=batch, frozen=frozen)
            explicit = _explicit_leaves(named)
            if not explicit:
                raise
            # sharding-in-types (jax.make_mesh's default axis types): the model's
            # gathers and products need each output's sharding spelled out
            raise ValueError(
                f"the step failed to trace ({type(e).__name__}) with inputs sharded over "
                f"Explicit mesh axes: {'; '.join(explicit[:3])}"
                f"{f' and {len(explicit) - 3} more' if len(explicit) > 3 else ''}. The steps "
                "run on meshes with automatic (GSPMD) axes: build the mesh with "
                "rlhf_eqx.distributed.make_mesh, or jax.make_mesh(..., "
                "axis_types=(jax.sharding.AxisType.Auto,) * n)"
            ) from e

    def run(rest, params, opt_state):
        batch, frozen, key = rest
        _check_rows(batch)
        if axis_name is not None:
            _check_axis_bound(axis_name)
        else:
            _check_no_device_axis()
        if micro_batches > 1:
            _check_micro_batches(batch, micro_batches, axis_name)
        if key is not None and axis_name is not None:
            key = jax.random.fold_in(key, jax.lax.axis_index(axis_name))
        if check_token_ids is not None:
            batch = _check_token_ids(batch, check_token_ids)
        prep_sums: Sums = {}
        if prepare is not None:
            batch, prep_sums = prepare(batch, axis_name)
        full_denoms = None
        if micro_batches > 1:
            # Denominators of the full batch: mask arithmetic only (the forward passes
            # in this call are unused, and XLA removes them).
            _, dens, _ = loss_fn(params, frozen, batch, key)
            full_denoms = _psum(sg(dict(dens)), axis_name)

        def contribution(p, mb, k):
            nums, dens, sums = loss_fn(p, frozen, mb, k)
            if set(nums) != set(dens):
                raise ValueError(
                    f"loss_fn returned numerators {sorted(nums)} but denominators {sorted(dens)}"
                )
            dens = _psum(sg(dict(dens)), axis_name) if full_denoms is None else full_denoms
            terms = {
                n: safe_divide(nums[n].astype(jnp.float32), dens[n].astype(jnp.float32))
                for n in nums
            }
            total = sum(terms.values(), start=jnp.zeros((), jnp.float32))
            sums = {
                n: (sg(s).astype(jnp.float32), sg(c).astype(jnp.float32))
                for n, (s, c) in sums.items()
            }
            # the global denominators (the same in every micro-batch): all 0 = empty batch
            counts = {n: sg(d).astype(jnp.float32) for n, d in dens.items()}
            return total, (sg(terms), sums, counts)

        loss, grads, (terms, sums, counts) = accumulate_gradients(
            contribution,
            _varying_like_batch(params, batch, axis_name),
            batch,
            micro_batches=micro_batches,
            key=key,
        )
        loss, grads, terms, sums, prep_sums = _psum(
            (loss, grads, terms, sums, prep_sums), axis_name
        )
        empty = jnp.asarray(bool(counts))
        for c in counts.values():
            empty = empty & (c == 0)
        new_params, new_opt_state, opt_metrics = apply_optimizer(
            optimizer, params, opt_state, grads
        )
        # A finite gradient can still give non-finite parameters (e.g. an infinite
        # learning rate): check both.
        finite = _all_finite(loss, (grads, eqx.filter(new_params, eqx.is_inexact_array)))
        if nonfinite == "raise":
            loss = _raise_nonfinite(loss, grads, terms, finite)
        # An empty batch (nothing to learn from) leaves the state as it is; so does a
        # non-finite update under "skip".
        keep = finite & ~empty if nonfinite == "skip" else ~empty
        new_params = _select(keep, new_params, params)
        new_opt_state = _select(keep, new_opt_state, opt_state)
        metrics = {"loss": loss}
        if len(terms) > 1:
            metrics.update({f"loss/{n}": v for n, v in terms.items()})
        metrics.update(sums_to_means({**prep_sums, **sums}))
        metrics.update(opt_metrics)
        metrics["nonfinite"] = (~finite).astype(jnp.float32)
        metrics["empty_batch"] = empty.astype(jnp.float32)
        if metrics_fn is not None:
            metrics = metrics_fn(metrics, grads)
        return new_params, new_opt_state, metrics

    def shared():
        if cache_key is None:
            what = tuple(function_key(f) for f in (loss_fn, prepare, metrics_fn))
        else:
            what = value_key(cache_key)
        parts = (optimizer, options, batch_type, tuple(extras))
        return ("make_step", what, *(value_key(p) for p in parts))

    return Step(update, donate=options.donate, batch_type=batch_type, extras=extras, shared=shared)
