"""Sharded meshes: `jax.jit` + `NamedSharding` placement of models, optimiser states and batches."""

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from ..models import partition_specs


def tree_path_str(path) -> str:
    """A pytree key path as a string for error messages (`"<root>"` for the root)."""
    return jax.tree_util.keystr(path) or "<root>"


def check_auto_axes(mesh: Mesh, where: str) -> None:
    """Refuse a mesh with an `AxisType.Explicit` (or `Manual`) axis, naming the axes: the
    models and steps run on automatic (GSPMD) axes, where `jax.jit` propagates the
    inputs' shardings; under sharding-in-types (`jax.make_mesh`'s default axis types)
    their gathers and products fail to trace."""
    other = [
        f"{a!r}: {t.name}" for a, t in zip(mesh.axis_names, mesh.axis_types) if t != AxisType.Auto
    ]
    if other:
        raise ValueError(
            f"{where}: mesh axes {', '.join(other)} are not automatic; the steps and models "
            "run on meshes whose axes are all AxisType.Auto: build the mesh with "
            "rlhf_eqx.distributed.make_mesh, or jax.make_mesh(shape, names, "
            "axis_types=(jax.sharding.AxisType.Auto,) * len(names))"
        )


def check_mesh_axis(mesh: Mesh, axis: str, where: str, field: str = "axis") -> None:
    """Refuse an `axis` that is not one of `mesh`'s axes, naming it and the mesh's axes."""
    if axis not in mesh.axis_names:
        raise ValueError(
            f"{where}: {field}={axis!r} is not an axis of the mesh, whose axes are "
            f"{tuple(mesh.axis_names)} (sizes {dict(mesh.shape)}); pass {field}= one of them"
        )


def _check_rule_axes(mesh: Mesh, fsdp: bool, tensor_parallel: bool, where: str) -> None:
    """Refuse a mesh on which the sharding rules asked for would place nothing: the rules
    name the axes `"data"` (FSDP) and `"model"` (tensor parallel), and a spec naming an
    axis the mesh lacks is replicated, so another naming would replicate every parameter
    silently. Plain data parallelism (`fsdp=False, tensor_parallel=False`: every
    parameter replicated) takes a mesh of any axis names."""
    names = tuple(mesh.axis_names)
    if fsdp and "data" not in names:
        raise ValueError(
            f"{where}: fsdp=True splits parameters over the mesh axis 'data', but the mesh's "
            f"axes are {names}: every parameter would be replicated. Build the mesh with "
            "rlhf_eqx.distributed.make_mesh (axes 'data', 'model') or name its axes so"
        )
    if tensor_parallel and "data" not in names and "model" not in names:
        raise ValueError(
            f"{where}: the mesh's axes {names} include neither 'data' nor 'model', the axes "
            "the sharding rules (rlhf_eqx.models.partition_specs) split parameters over: "
            "every parameter would be replicated. Build the mesh with "
            "rlhf_eqx.distributed.make_mesh (axes 'data', 'model') or name its axes so, or "
            "pass tensor_parallel=False for plain data parallelism (parameters replicated)"
        )


def make_mesh(data: int, model: int = 1, *, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `("data", "model")` mesh of `data × model` devices with automatic (GSPMD) axes.

    **Arguments:**

    - `data`: data-parallel (and FSDP) size; `model`: tensor-parallel size.
    - `devices`: the devices to use (default: `jax.devices()`, all processes' devices);
      their number must be `data * model`.

    **Returns:** a `jax.sharding.Mesh` whose axes are `AxisType.Auto`, so that `jax.jit`
    of an unmodified step propagates shardings from its inputs. (`jax.make_mesh` gives
    `AxisType.Explicit` axes by default, which the placement helpers refuse; pass it
    `axis_types=(AxisType.Auto,) * len(names)` to build such a mesh yourself.)
    """
    devices = list(jax.devices() if devices is None else devices)
    if data < 1 or model < 1:
        raise ValueError(f"make_mesh: data={data} and model={model} must be positive")
    if data * model != len(devices):
        raise ValueError(
            f"make_mesh: data × model = {data} × {model} = {data * model} devices, "
            f"but {len(devices)} are given"
            + (
                f" (for a mesh of some of them: devices=jax.devices()[:{data * model}])"
                if data * model < len(devices)
                else ""
            )
        )
    return jax.make_mesh(
        (data, model), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto), devices=devices
    )


def fit_spec(
    spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh | Mapping[str, int]
) -> PartitionSpec:
    """`spec` with every mesh axis dropped (dimension replicated) where it does not divide
    the dimension, or names no axis of `mesh` (a `Mesh`, or a mapping of axis sizes)."""
    sizes = dict(mesh.shape) if isinstance(mesh, Mesh) else dict(mesh)
    out = []
    for i, axes in enumerate(tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
        names = tuple(a for a in names if a in sizes)
        size = int(np.prod([sizes[a] for a in names])) if names else 1
        if not names or shape[i] % size != 0:
            out.append(None)
        else:
            out.append(names[0] if len(names) == 1 else names)
    return PartitionSpec(*out)


def _place(tree: PyTree, specs: PyTree, mesh: Mesh) -> PyTree:

    def put(x, spec):
        if not eqx.is_array(x):
            return x
        spec = spec if isinstance(spec, PartitionSpec) else PartitionSpec()
        return jax.device_put(x, NamedSharding(mesh, fit_spec(spec, x.shape, mesh)))

    return jax.tree.map(put, tree, specs)


def shard_model(
    model: PyTree, mesh: Mesh, *, fsdp: bool = False, tensor_parallel: bool = True
) -> PyTree:
    """Place `model` (or a partition of it) on `mesh` by its family's sharding rules.

    **Arguments:**

    - `model`: a model, a `(params, frozen)` part of one, or a pytree of models.
    - `mesh`: from `make_mesh`.
    - `fsdp`: store each parameter split over `"data"` (ZeRO-3); otherwise parameters
      are replicated over `"data"` (plain data parallel).
    - `tensor_parallel`: split heads, MLP units and the vocabulary over `"model"`.

    **Returns:** the same pytree with every array leaf a `jax.Array` sharded on `mesh`.
    """
    check_auto_axes(mesh, "shard_model")
    _check_rule_axes(mesh, fsdp, tensor_parallel, "shard_model")
    specs = partition_specs(model, fsdp=fsdp, tensor_parallel=tensor_parallel)
    return _place(model, specs, mesh)


def opt_state_specs(opt_state: PyTree, params: PyTree, param_specs: PyTree) -> PyTree:
    params_def = jax.tree.structure(params)
    leaves = jax.tree.leaves(params)
    shapes = [getattr(x, "shape", None) for x in leaves]

    def mirrors(x) -> bool:
        if x is None or eqx.is_array(x):
            return False
        try:
            if jax.tree.structure(x) != params_def:
                return False
        except Exception:  # noqa: BLE001 - unflattenable leaves are not mirrors
            return False
        return [getattr(y, "shape", None) for y in jax.tree.leaves(x)] == shapes

    def spec(x):
        if mirrors(x):
            return param_specs
        return jax.tree.map(lambda y: PartitionSpec(), x)

    if mirrors(opt_state):
        return param_specs
    return jax.tree.map(spec, opt_state, is_leaf=mirrors)


def shard_opt_state(
    opt_state: PyTree,
    params: PyTree,
    mesh: Mesh,
    *,
    fsdp: bool = False,
    tensor_parallel: bool = True,
) -> PyTree:
    """Place an optimiser state on `mesh`: every subtree that mirrors `params` (Adam's
    moments, ...) gets the parameters' specs; counts and other leaves are replicated.

    **Arguments:** the optimiser state, the (trainable) parameters it belongs to, the
    mesh and the same `fsdp` / `tensor_parallel` choice as for the parameters.

    **Returns:** the optimiser state with every array on `mesh`.
    """
    check_auto_axes(mesh, "shard_opt_state")
    _check_rule_axes(mesh, fsdp, tensor_parallel, "shard_opt_state")
    param_specs = partition_specs(params, fsdp=fsdp, tensor_parallel=tensor_parallel)
    specs = opt_state_specs(opt_state, params, param_specs)
    return jax.tree.map(
        lambda x, s: (
            x
            if not eqx.is_array(x)
            else jax.device_put(x, NamedSharding(mesh, fit_spec(s, x.shape, mesh)))
        ),
        opt_state,
        specs,
    )


def shard_train_state(
    state: Any, mesh: Mesh, *, fsdp: bool = False, tensor_parallel: bool = True
) -> Any:
    """Place a `rlhf_eqx.train.TrainState` on `mesh`: params and frozen parts by the model
    rules, optimiser state like its params, every other field (the step and skipped
    counters, the run's key) replicated and kept as it is."""
    check_auto_axes(mesh, "shard_train_state")
    _check_rule_axes(mesh, fsdp, tensor_parallel, "shard_train_state")
    kw = dict(fsdp=fsdp, tensor_parallel=tensor_parallel)
    placed = dict(
        params=shard_model(state.params, mesh, **kw),
        frozen=shard_model(state.frozen, mesh, **kw),
        opt_state=shard_opt_state(state.opt_state, state.params, mesh, **kw),
    )
    replicated = NamedSharding(mesh, PartitionSpec())
    rest = {
        f.name: jax.tree.map(
            lambda x: jax.device_put(x, replicated) if eqx.is_array(x) else x,
            getattr(state, f.name),
        )
        for f in dataclasses.fields(state)
        if f.name not in placed
    }
    return dataclasses.replace(state, **placed, **rest)


def shard_batch(batch: PyTree, mesh: Mesh, *, axis: str = "data") -> PyTree:
    """Split the rows (leading axis) of every array of `batch` over the mesh axis `axis`.

    Scalars are replicated. Raises `ValueError` naming the field when a leading axis
    does not divide by the axis size (pad the batch or change the mesh).
    """
    check_auto_axes(mesh, "shard_batch")
    check_mesh_axis(mesh, axis, "shard_batch")
    n = mesh.shape[axis]

    def put(path, x):
        if not eqx.is_array(x):
            return x
        if x.ndim == 0:
            return jax.device_put(x, NamedSharding(mesh, PartitionSpec()))
        if x.shape[0] % n != 0:
            raise ValueError(
                f"shard_batch: batch field {tree_path_str(path)} has {x.shape[0]} rows "
                f"(shape {tuple(x.shape)}), not divisible by the {n} devices of mesh axis {axis!r}"
            )
        return jax.device_put(x, NamedSharding(mesh, PartitionSpec(axis)))

    return jax.tree_util.tree_map_with_path(put, batch)
