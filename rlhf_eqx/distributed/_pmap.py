"""Data parallelism with `jax.pmap`: replicating trees and splitting a batch over devices."""

from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from ._mesh import tree_path_str


def replicate(tree: PyTree, devices: Sequence[jax.Device] | None = None) -> PyTree:
    """Give every array of `tree` a leading device axis, one copy per device, for `jax.pmap`.

    **Arguments:** `tree` (e.g. params and optimiser state; non-array leaves are kept),
    `devices` (default `jax.local_devices()`).

    **Returns:** `tree` with each array `x` replaced by `[n_devices, *x.shape]`, the
    `i`-th copy stored on `devices[i]`. Each copy is placed on its device directly: no
    device ever holds the `n_devices` copies together (a model that fits one device once
    is replicated without holding it `n_devices` times on the first).
    """
    devices = list(jax.local_devices() if devices is None else devices)
    mesh = Mesh(np.asarray(devices), ("devices",))
    sharding = NamedSharding(mesh, PartitionSpec("devices"))
    n = len(devices)

    def put(x):
        if not eqx.is_array(x):
            return x
        one = jnp.expand_dims(x, 0)
        copies = [jax.device_put(one, d) for d in devices]
        return jax.make_array_from_single_device_arrays((n,) + x.shape, sharding, copies)

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
                f"shard_batch_for_pmap: batch field {tree_path_str(path)} is a scalar; "
                "only arrays with a leading batch axis can be split over devices"
            )
        if x.shape[0] % n_devices != 0:
            raise ValueError(
                f"shard_batch_for_pmap: batch field {tree_path_str(path)} has {x.shape[0]} rows "
                f"(shape {tuple(x.shape)}), not divisible by n_devices={n_devices}"
            )
        return x.reshape((n_devices, x.shape[0] // n_devices) + x.shape[1:])

    return jax.tree_util.tree_map_with_path(split, batch)
