"""Multi-process runs: joining the run, per-process record shards, global batches."""

import hashlib
import os
from collections.abc import Sequence

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, PyTree

from ._mesh import check_auto_axes, check_mesh_axis, tree_path_str

ENV_COORDINATOR = "RLHF_EQX_COORDINATOR"
ENV_NUM_PROCESSES = "RLHF_EQX_NUM_PROCESSES"
ENV_PROCESS_ID = "RLHF_EQX_PROCESS_ID"


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
    heartbeat_timeout_seconds: int = 100,
    shutdown_timeout_seconds: int = 300,
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

    The timeouts are JAX's (its defaults): `initialization_timeout` bounds the wait for
    every process to join; `heartbeat_timeout_seconds` is how long a process may be
    silent before the others count it as dead and end (a peer killed with SIGKILL makes
    the next collective fail at once, and the survivors then wait about this long in
    the shutdown barrier before they abort); `shutdown_timeout_seconds` bounds that
    barrier.

    **Returns:** `(process_id, num_processes)` as JAX sees them afterwards.

    **Raises:** `ValueError` naming the setting when only some of the three are given,
    when `process_id` is not in `[0, num_processes)`, or when the run joined has another
    number of processes than `num_processes` (JAX takes the coordinator's count: a
    process started with another one is refused rather than run on).
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
        heartbeat_timeout_seconds=heartbeat_timeout_seconds,
        shutdown_timeout_seconds=shutdown_timeout_seconds,
    )
    if num_processes is not None and jax.process_count() != num_processes:
        # The coordinator's count wins in JAX; a process started with another one would
        # otherwise run on silently with settings that disagree with its peers'.
        raise ValueError(
            f"initialize_distributed: this process was started with "
            f"num_processes={num_processes} ({ENV_NUM_PROCESSES}), but the run it joined at "
            f"{coordinator_address} has {jax.process_count()} processes; start every "
            "process with the same num_processes"
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
    from ..data import assign_shards

    process_id = jax.process_index() if process_id is None else process_id
    num_processes = jax.process_count() if num_processes is None else num_processes
    local_devices = jax.local_device_count() if local_devices is None else local_devices
    return assign_shards(records, num_processes, local_devices)[process_id]


def global_batch(
    local_batch: PyTree, mesh: Mesh, *, axis: str = "data", check_shapes: bool = True
) -> PyTree:
    """Assemble the processes' local rows into one global batch sharded over `axis`.

    Each process passes its own rows (`[b, ...]`, the same `b` on every process); the
    result is a global `[b · num_processes, ...]` array per field, rows of process `p`
    at `p·b … (p+1)·b - 1` (with the mesh's devices ordered by process, as
    `make_mesh` over `jax.devices()` does). With one process it equals `shard_batch`.

    **Raises:** `ValueError` naming the field when a field is a scalar or its rows do not
    divide by the slices of `axis` on this process's devices; with several processes, in
    every process when the processes' batches differ in a field's shape or dtype (checked
    with a small all-gather of the shapes before the batch is built) or the processes
    hold different numbers of the slices of `axis`.

    `check_shapes=False` skips the cross-process shape check (one small all-gather, so one
    round trip between the hosts, per call). Every process must pass the same value, and
    batches that then differ between the processes are not refused: each process
    compiles its own program and the collectives abort or wait. Use it once the shapes
    are fixed by construction (a bucketed or fixed-length collate), e.g. after the first
    batch of a run was checked.
    """
    check_auto_axes(mesh, "global_batch")
    check_mesh_axis(mesh, axis, "global_batch")
    sharding = NamedSharding(mesh, PartitionSpec(axis))
    fields = [
        (tree_path_str(path), x)
        for path, x in jax.tree_util.tree_leaves_with_path(local_batch)
        if eqx.is_array(x)
    ]
    for name, x in fields:
        if x.ndim == 0:
            raise ValueError(f"global_batch: batch field {name} is a scalar")
    if check_shapes and jax.process_count() > 1:
        _check_same_shapes(fields)
    slices = _slices_per_process(mesh, axis)
    if len(set(slices.values())) > 1:
        held = ", ".join(f"process {p}: {n}" for p, n in sorted(slices.items()))
        raise ValueError(
            f"global_batch: the processes hold different numbers of the {mesh.shape[axis]} "
            f"slices of mesh axis {axis!r} ({held}), so their rows cannot be equal shares "
            "of the global batch; give every process as many devices of the mesh"
        )
    n = slices[jax.process_index()]
    for name, x in fields:
        if x.shape[0] % n:
            raise ValueError(
                f"global_batch: batch field {name} has {x.shape[0]} rows (shape "
                f"{tuple(x.shape)}), not divisible by the {n} slice(s) of mesh axis "
                f"{axis!r} on this process's devices"
            )

    def put(x):
        if not eqx.is_array(x):
            return x
        return jax.make_array_from_process_local_data(sharding, np.asarray(x))

    return jax.tree.map(put, local_batch)


def _slices_per_process(mesh: Mesh, axis: str) -> dict[int, int]:
    """How many positions along the mesh axis `axis` each process's devices occupy (the
    shares of the global rows that `global_batch` gives each process)."""
    devices = np.moveaxis(mesh.devices, mesh.axis_names.index(axis), 0)
    counts: dict[int, int] = {}
    for position in devices:
        for p in {d.process_index for d in position.flat}:
            counts[p] = counts.get(p, 0) + 1
    return counts


_MAX_RANK = 8


def _check_same_shapes(fields: list[tuple[str, Array]]) -> None:
    """Refuse local batches whose fields differ between the processes (`ValueError` in
    every process, naming the first field that differs and each process's shape).

    Each process derives the global shape of a field from its own rows, so batches of
    different sizes would otherwise compile different programs in different processes,
    whose collectives then fail (gloo: "Received data size doesn't match expected size")
    or wait for each other forever. Two small all-gathers of host integers: a digest of
    the fields' names, shapes and dtypes, then (when the digests differ and the processes
    hold as many fields) every field's shape."""
    from jax.experimental import multihost_utils

    described = repr([(name, tuple(x.shape), str(x.dtype)) for name, x in fields])
    digest = hashlib.blake2b(described.encode(), digest_size=4).digest()
    mine = np.asarray([len(fields), int.from_bytes(digest, "big") >> 1], np.int32)
    every = np.asarray(multihost_utils.process_allgather(mine))
    if (every == every[0]).all():
        return
    if (every[:, 0] != every[0, 0]).any():
        counts = ", ".join(f"process {p}: {int(n)}" for p, n in enumerate(every[:, 0]))
        raise ValueError(
            f"global_batch: the processes pass batches with different numbers of array "
            f"fields ({counts}); every process must pass the same batch type"
        )
    shapes = np.full((len(fields), _MAX_RANK + 1), -1, np.int32)
    for i, (_, x) in enumerate(fields):
        shapes[i, : min(x.ndim, _MAX_RANK)] = x.shape[:_MAX_RANK]
        shapes[i, _MAX_RANK] = np.dtype(x.dtype).num
    gathered = np.asarray(multihost_utils.process_allgather(shapes))  # [process, field, ...]
    for i, (name, _) in enumerate(fields):
        if (gathered[:, i] == gathered[0, i]).all():
            continue
        per_process = ", ".join(
            f"process {p}: shape {tuple(int(d) for d in row[:_MAX_RANK] if d >= 0)}"
            for p, row in enumerate(gathered[:, i])
        )
        raise ValueError(
            f"global_batch: batch field {name} differs between the processes "
            f"({per_process}); every process must pass the same shapes and dtypes "
            "(pad or drop rows to a common count)"
        )
    raise ValueError(
        "global_batch: the processes pass batches whose fields are named differently; "
        "every process must pass the same batch type"
    )
