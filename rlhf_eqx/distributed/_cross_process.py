"""Disjoint device sets across processes: choosing device groups that each span every
process, and moving arrays between such groups (through the hosts where multi-controller
JAX cannot reshard on the devices)."""

from collections.abc import Sequence

import equinox as eqx
import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Sharding
from jaxtyping import PyTree


def spanning_devices(devices: Sequence, counts: Sequence[int]) -> list[list]:
    """Consecutive, disjoint groups of `devices`, group `i` of `counts[i]` devices, each
    spanning every process of `devices` equally.

    With one process, group `i` is the next `counts[i]` devices of `devices` in their
    order. With `P` processes, group `i` takes the next `counts[i] / P` local devices of
    each process (processes in ascending `process_index`, each process's devices in
    their order in `devices`), so every process holds a part of every group and takes
    part in every program run on it, as multi-controller JAX needs (a process drives
    only its own devices and reads only their shards).

    **Arguments:**

    - `devices`: the devices to split, e.g. `jax.devices()` (every process's devices;
      anything with a `process_index`).
    - `counts`: the size of each group; their sum at most `len(devices)`.

    **Returns:** one list of devices per group, ordered by process, then by local order.

    **Raises:** `ValueError` naming the group whose count does not divide by the number
    of processes (each process would hold a different number of its devices), or when
    the groups need more devices than a process has.
    """
    devices = list(devices)
    processes = sorted({d.process_index for d in devices})
    if len(processes) == 1:
        edges = np.cumsum([0, *counts])
        if edges[-1] > len(devices):
            raise ValueError(
                f"spanning_devices: counts {list(counts)} need {edges[-1]} devices, "
                f"not the {len(devices)} given"
            )
        return [devices[a:b] for a, b in zip(edges[:-1], edges[1:])]
    P = len(processes)
    local = [[d for d in devices if d.process_index == p] for p in processes]
    for i, n in enumerate(counts):
        if n % P:
            raise ValueError(
                f"spanning_devices: group {i} of {n} device(s) does not divide over the {P} "
                f"processes (each process holds counts[{i}] / {P} of its devices)"
            )
    edges = np.cumsum([0, *(n // P for n in counts)])
    if edges[-1] > min(map(len, local)):
        raise ValueError(
            f"spanning_devices: counts {list(counts)} need {edges[-1]} local devices in each "
            f"of the {P} processes; the fewest a process has is {min(map(len, local))}"
        )
    return [[d for mine in local for d in mine[a:b]] for a, b in zip(edges[:-1], edges[1:])]


def _on_host(x) -> np.ndarray:
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def to_host(tree: PyTree) -> PyTree:
    """Every array of `tree` whole, as a NumPy array on this process's host.

    A local or fully replicated array is read from one of this process's shards (no
    collective); an array sharded across processes is gathered with
    `jax.experimental.multihost_utils.process_allgather(x, tiled=True)`, a program on
    that array's devices that every process holding a shard of it must run too, in the
    same order. With one process this is `np.asarray` of each array.

    **Arguments:** `tree`, a pytree; its non-array leaves are returned as they are.

    **Returns:** `tree` with each array leaf a `numpy.ndarray` of the array's global shape.
    """
    return jax.tree.map(lambda x: _on_host(x) if eqx.is_array(x) else x, tree)


def reshard(tree: PyTree, shardings: PyTree) -> PyTree:
    """`jax.device_put(tree, shardings)` that also moves arrays between different device
    sets across processes.

    With one process, or where every array already lives on its target's device set,
    this is `jax.device_put`. Otherwise (multi-controller JAX refuses a cross-process
    reshard onto another set of devices) each array goes through the hosts: a local or
    fully replicated array is read from one of this process's shards (no collective), any
    other one is gathered whole with
    `jax.experimental.multihost_utils.process_allgather(x, tiled=True)` (every process
    holding a shard of it must call this too, in the same order), and the result is built
    on its target sharding with `jax.make_array_from_callback`, each process filling its
    own devices' shards from its host copy. The host route costs a device-to-host copy of
    every array (and a gather of the sharded ones) and a host-to-device copy per target
    device. Host arrays (NumPy) are placed the same way, without the cross-process
    equality check (and its collective) that `jax.device_put` makes: every process must
    pass the same values.

    **Arguments:**

    - `tree`: a pytree; its array leaves move, the rest is returned as it is.
    - `shardings`: one `jax.sharding.Sharding` for the whole tree, or a pytree of them
      with the structure of `tree`'s leaves (a list of shardings for a list of arrays).

    **Returns:** `tree` with every array on its sharding.
    """
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)
    leaves, treedef = jax.tree.flatten(tree)
    if isinstance(shardings, Sharding):
        targets = [shardings] * len(leaves)
    else:
        targets = treedef.flatten_up_to(shardings)

    def move(x, sharding: Sharding):
        if not (eqx.is_array(x) or isinstance(x, np.ndarray)):
            return x
        if isinstance(x, jax.Array) and x.sharding.device_set == sharding.device_set:
            return jax.device_put(x, sharding)
        host = _on_host(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.unflatten(treedef, [move(x, s) for x, s in zip(leaves, targets)])
