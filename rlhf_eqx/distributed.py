"""Running steps on several devices and processes: pmap helpers, sharded meshes, multi-process.

The step builders of `rlhf_eqx.train` return plain jittable functions; this module only
places their inputs. Three modes:

- **pmap** (data parallel, one process): `replicate` the params and the optimiser
  state, `shard_batch_for_pmap` the global batch onto a leading device axis, run the
  step under `jax.pmap(..., axis_name="data")` (with a step built for that axis name),
  `unreplicate` the result.
- **mesh** (`jax.jit` + `NamedSharding`): `make_mesh(data, model)` builds a
  `("data", "model")` mesh; `shard_model` / `shard_train_state` place a model, its
  trainable partition and optimiser state by the model family's rules
  (`rlhf_eqx.models.partition_specs`: replicated, FSDP over `"data"`, tensor parallel
  over `"model"`); `shard_batch` splits a batch's rows over `"data"`. The unchanged
  jitted step then runs as one SPMD program; XLA inserts the collectives, and every
  reduction (token means, global denominators) stays exact because the program sees
  the global batch.
- **multi-process**: `initialize_distributed()` in each process (from arguments or the
  `RLHF_EQX_COORDINATOR`, `RLHF_EQX_NUM_PROCESSES`, `RLHF_EQX_PROCESS_ID` environment
  variables), a mesh over `jax.devices()` (all processes' devices), each process
  reads the records `process_record_indices` gives it (prompt-hash sharding) and
  `global_batch` assembles the processes' rows into one global array.

Specs name mesh axes regardless of sizes; wherever a dimension does not divide by the
size of the axis it names, that dimension is replicated instead (`fit_spec`).
"""

import os
from collections.abc import Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from .models import partition_specs

__all__ = [
    "make_mesh",
    "partition_specs",
    "fit_spec",
    "shard_model",
    "shard_opt_state",
    "shard_train_state",
    "shard_batch",
    "replicate",
    "unreplicate",
    "shard_batch_for_pmap",
    "initialize_distributed",
    "process_record_indices",
    "global_batch",
    "ENV_COORDINATOR",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
]

ENV_COORDINATOR = "RLHF_EQX_COORDINATOR"
ENV_NUM_PROCESSES = "RLHF_EQX_NUM_PROCESSES"
ENV_PROCESS_ID = "RLHF_EQX_PROCESS_ID"


def _path_str(path) -> str:
    return jax.tree_util.keystr(path) or "<root>"


# ----------------------------------------------------------------------------- mesh


def make_mesh(data: int, model: int = 1, *, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `("data", "model")` mesh of `data × model` devices with automatic (GSPMD) axes.

    **Arguments:**

    - `data`: data-parallel (and FSDP) size; `model`: tensor-parallel size.
    - `devices`: the devices to use (default: `jax.devices()`, all processes' devices);
      their number must be `data * model`.

    **Returns:** a `jax.sharding.Mesh` whose axes are `AxisType.Auto`, so that `jax.jit`
    of an unmodified step propagates shardings from its inputs.
    """
    devices = list(jax.devices() if devices is None else devices)
    if data < 1 or model < 1:
        raise ValueError(f"make_mesh: data={data} and model={model} must be positive")
    if data * model != len(devices):
        raise ValueError(
            f"make_mesh: data × model = {data} × {model} = {data * model} devices, "
            f"but {len(devices)} are given"
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
    rules, optimiser state like its params, the step counter replicated."""
    kw = dict(fsdp=fsdp, tensor_parallel=tensor_parallel)
    return type(state)(
        params=shard_model(state.params, mesh, **kw),
        frozen=shard_model(state.frozen, mesh, **kw),
        opt_state=shard_opt_state(state.opt_state, state.params, mesh, **kw),
        step=jax.device_put(state.step, NamedSharding(mesh, PartitionSpec())),
    )


def shard_batch(batch: PyTree, mesh: Mesh, *, axis: str = "data") -> PyTree:
    """Split the rows (leading axis) of every array of `batch` over the mesh axis `axis`.

    Scalars are replicated. Raises `ValueError` naming the field when a leading axis
    does not divide by the axis size (pad the batch or change the mesh).
    """
    n = mesh.shape[axis]

    def put(path, x):
        if not eqx.is_array(x):
            return x
        if x.ndim == 0:
            return jax.device_put(x, NamedSharding(mesh, PartitionSpec()))
        if x.shape[0] % n != 0:
            raise ValueError(
                f"shard_batch: batch field {_path_str(path)} has {x.shape[0]} rows "
                f"(shape {tuple(x.shape)}), not divisible by the {n} devices of mesh axis {axis!r}"
            )
        return jax.device_put(x, NamedSharding(mesh, PartitionSpec(axis)))

    return jax.tree_util.tree_map_with_path(put, batch)


# ----------------------------------------------------------------------------- pmap


def replicate(tree: PyTree, devices: Sequence[jax.Device] | None = None) -> PyTree:
    """Give every array of `tree` a leading device axis, one copy per device, for `jax.pmap`.

    **Arguments:** `tree` (e.g. params and optimiser state; non-array leaves are kept),
    `devices` (default `jax.local_devices()`).

    **Returns:** `tree` with each array `x` replaced by `[n_devices, *x.shape]`, the
    `i`-th copy stored on `devices[i]`.
    """
    devices = list(jax.local_devices() if devices is None else devices)
    mesh = Mesh(np.asarray(devices), ("devices",))
    sharding = NamedSharding(mesh, PartitionSpec("devices"))
    n = len(devices)

    def put(x):
        if not eqx.is_array(x):
            return x
        return jax.device_put(jnp.broadcast_to(x[None], (n,) + x.shape), sharding)

    return jax.tree.map(put, tree)


def unreplicate(tree: PyTree) -> PyTree:
    """The first copy of every array of a replicated `tree` (inverse of `replicate`)."""
    return jax.tree.map(lambda x: x[0] if eqx.is_array(x) else x, tree)


def shard_batch_for_pmap(batch: PyTree, n_devices: int) -> PyTree:
    """Reshape every array of a global batch `[B, ...]` to `[n_devices, B / n_devices, ...]`.

    Row `i` goes to device `i // (B / n_devices)`, so the concatenation of the device
    shards is the global batch. Raises `ValueError` naming the field when `B` does not
    divide by `n_devices`, or when a field is a scalar.
    """
    if n_devices < 1:
        raise ValueError(f"shard_batch_for_pmap: n_devices must be positive, got {n_devices}")

    def split(path, x):
        if not eqx.is_array(x):
            return x
        if x.ndim == 0:
            raise ValueError(
                f"shard_batch_for_pmap: batch field {_path_str(path)} is a scalar; "
                "only arrays with a leading batch axis can be split over devices"
            )
        if x.shape[0] % n_devices != 0:
            raise ValueError(
                f"shard_batch_for_pmap: batch field {_path_str(path)} has {x.shape[0]} rows "
                f"(shape {tuple(x.shape)}), not divisible by n_devices={n_devices}"
            )
        return x.reshape((n_devices, x.shape[0] // n_devices) + x.shape[1:])

    return jax.tree_util.tree_map_with_path(split, batch)


# ----------------------------------------------------------------------------- processes


def _env_int(name: str, value: int | None) -> int | None:
    if value is not None:
        return value
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: Sequence[int] | None = None,
    initialization_timeout: int = 300,
) -> tuple[int, int]:
    """Join a multi-process JAX run (`jax.distributed.initialize`); call before any computation.

    Each argument left `None` is read from the environment:

    | argument | environment variable | example |
    | --- | --- | --- |
    | `coordinator_address` | `RLHF_EQX_COORDINATOR` | `10.0.0.1:1234` (process 0's host) |
    | `num_processes` | `RLHF_EQX_NUM_PROCESSES` | `2` |
    | `process_id` | `RLHF_EQX_PROCESS_ID` | `0` … `num_processes - 1` |

    When none of the three is given anywhere, `jax.distributed.initialize()` is called
    without arguments and detects the cluster itself (Slurm, Cloud TPU, ...).

    **Returns:** `(process_id, num_processes)` as JAX sees them afterwards.
    """
    coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
    num_processes = _env_int(ENV_NUM_PROCESSES, num_processes)
    process_id = _env_int(ENV_PROCESS_ID, process_id)
    given = [coordinator_address is not None, num_processes is not None, process_id is not None]
    if any(given) and not all(given):
        missing = [
            f"{arg} (or {env})"
            for arg, env, ok in zip(
                ("coordinator_address", "num_processes", "process_id"),
                (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID),
                given,
            )
            if not ok
        ]
        raise ValueError(f"initialize_distributed: missing {', '.join(missing)}")
    if num_processes is not None and not 0 <= process_id < num_processes:
        raise ValueError(
            f"initialize_distributed: process_id={process_id} is not in "
            f"[0, num_processes={num_processes})"
        )
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=local_device_ids,
        initialization_timeout=initialization_timeout,
    )
    return jax.process_index(), jax.process_count()


def process_record_indices(
    records: Sequence,
    *,
    process_id: int | None = None,
    num_processes: int | None = None,
    local_devices: int | None = None,
) -> list[list[int]]:
    """The records this process reads, per local device (prompt-hash sharding).

    Uses `rlhf_eqx.data.assign_shards`: all records with the same prompt land on one
    device of one process, and the assignment is the same on every host.

    **Arguments:** `records` (objects with `.prompt`, or prompt strings); `process_id`,
    `num_processes`, `local_devices` default to `jax.process_index()`,
    `jax.process_count()`, `jax.local_device_count()`.

    **Returns:** `indices[device]`, the record indices of each local device.
    """
    from .data import assign_shards

    process_id = jax.process_index() if process_id is None else process_id
    num_processes = jax.process_count() if num_processes is None else num_processes
    local_devices = jax.local_device_count() if local_devices is None else local_devices
    return assign_shards(records, num_processes, local_devices)[process_id]


def global_batch(local_batch: PyTree, mesh: Mesh, *, axis: str = "data") -> PyTree:
    """Assemble the processes' local rows into one global batch sharded over `axis`.

    Each process passes its own rows (`[b, ...]`, the same `b` on every process); the
    result is a global `[b · num_processes, ...]` array per field, rows of process `p`
    at `p·b … (p+1)·b - 1` (with the mesh's devices ordered by process, as
    `make_mesh` over `jax.devices()` does). With one process it equals `shard_batch`.
    """
    sharding = NamedSharding(mesh, PartitionSpec(axis))

    def put(path, x):
        if not eqx.is_array(x):
            return x
        if x.ndim == 0:
            raise ValueError(f"global_batch: batch field {_path_str(path)} is a scalar")
        return jax.make_array_from_process_local_data(sharding, np.asarray(x))

    return jax.tree_util.tree_map_with_path(put, local_batch)
