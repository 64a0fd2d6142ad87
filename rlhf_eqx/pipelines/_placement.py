"""Where a GRPO run samples and trains: the split placement (`grpo.placement=split`), a
trainer mesh and a sampler mesh on disjoint devices, with the policy moved from the
trainer's layout to the sampler's after each update (weight transfer), and the checks
of its settings (`grpo.sampler_devices`, `grpo.trainer_devices`, `grpo.sampler_mesh`,
`grpo.trainer_mesh`)."""

import dataclasses
import math
import time
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlhf_eqx import distributed as dist

from ._config import ConfigError

PLACEMENTS = ("colocated", "split")
MESH_AXES = ("data", "fsdp", "model")


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """A mesh setting (`"fsdp:4"`, `"data:2,model:2"`): `data` devices on the `"data"`
    axis (FSDP over it with `fsdp`), `model` on the tensor-parallel `"model"` axis."""

    data: int
    model: int
    fsdp: bool

    @property
    def size(self) -> int:
        return self.data * self.model


def _fail(field: str, value, why: str):
    raise ConfigError(f"{field}={value!r}: {why}")


def check_device_setting(field: str, value) -> None:
    """A device setting's form: a whole count `>= 1` or a fraction in (0, 1)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        _fail(field, value, "must be a device count >= 1 or a fraction in (0, 1)")
    if value <= 0:
        _fail(field, value, "must be a device count >= 1 or a fraction in (0, 1)")
    if value >= 1 and value != int(value):
        _fail(field, value, "must be a whole number of devices (or a fraction < 1)")


def device_count_of(field: str, value, available: int) -> int:
    """A device setting as a count: `value >= 1` a whole number of devices, `0 < value <
    1` that fraction of the `available` devices (rounded down, at least one)."""
    check_device_setting(field, value)
    if value >= 1:
        return int(value)
    n = int(math.floor(value * available))
    if n < 1:
        _fail(field, value, f"must be at least one of the {available} device(s)")
    return n


def parse_mesh(field: str, text: str, n: int | None = None) -> MeshShape:
    """The mesh setting `text` for `n` devices: comma-separated `axis:size` with axes
    `data` (data parallel, parameters replicated), `fsdp` (data parallel with parameters,
    gradients and optimiser state split over the data axis) and `model` (tensor parallel);
    `""` is `data:n`. The sizes must multiply to `n` (unchecked when `n` is `None`)."""
    if text == "":
        return MeshShape(n or 1, 1, False)
    sizes: dict[str, int] = {}
    for part in str(text).split(","):
        axis, _, size = part.strip().partition(":")
        if axis not in MESH_AXES or not size.strip().isdigit() or int(size) < 1:
            _fail(
                field,
                text,
                "must be comma-separated axis:size with axes data, fsdp or model "
                "(e.g. fsdp:4, data:2,model:2)",
            )
        if axis in sizes:
            _fail(field, text, f"must name each axis once ({axis} twice)")
        sizes[axis] = int(size)
    if "data" in sizes and "fsdp" in sizes:
        _fail(field, text, "must name data or fsdp, not both (one data axis, with or without FSDP)")
    shape = MeshShape(
        sizes.get("data", sizes.get("fsdp", 1)), sizes.get("model", 1), "fsdp" in sizes
    )
    if n is not None and shape.size != n:
        _fail(field, text, f"must span the {n} device(s) assigned to it, not {shape.size}")
    return shape


AGREED_FIELDS = (
    "trainer_devices",
    "sampler_devices",
    "trainer_mesh",
    "sampler_mesh",
    "staleness",
    "overlap",
    "partial_rollouts",
)
"""The settings of a split placement that every process of a multi-process run must share:
they fix which programs run on which devices, and in what order."""

_SETTING_BYTES = 48


def same_in_every_process(name: str, cfg, fields: Sequence[str]) -> None:
    """`ConfigError` in every process naming the first of `fields` (of the section `name`)
    whose value differs between the processes of a multi-process run, with each process's
    value (the first 48 bytes of its `repr`).

    Every process compiles and runs the programs its own settings give; with another mesh
    or another order in one process, the cross-process collectives would not match
    (gloo aborts, or the processes wait for each other). One all-gather of the values."""
    from jax.experimental import multihost_utils

    values = [repr(getattr(cfg, f, None)).encode()[:_SETTING_BYTES] for f in fields]
    mine = np.zeros((len(fields), _SETTING_BYTES), np.int32)
    for i, v in enumerate(values):
        mine[i, : len(v)] = list(v)
    every = np.asarray(multihost_utils.process_allgather(mine))  # [process, field, byte]
    for i, field in enumerate(fields):
        if (every[:, i] == every[0, i]).all():
            continue
        seen = ", ".join(
            f"process {p}: {bytes(int(b) for b in row if b).decode(errors='replace')}"
            for p, row in enumerate(every[:, i])
        )
        _fail(
            f"{name}.{field}",
            getattr(cfg, field, None),
            f"must be the same in every process of this run ({seen})",
        )


def split_devices(
    name: str, cfg, devices: Sequence[jax.Device]
) -> tuple[list[jax.Device], list[jax.Device], MeshShape, MeshShape]:
    """The trainer's and the sampler's devices (disjoint) and their mesh shapes, for the
    settings `cfg` of the section `name`; `ConfigError` naming the field when they do not
    fit.

    In one process the trainer takes the first `trainer_devices` of `devices`, the
    sampler the next `sampler_devices`. With `P` processes each mesh spans every process
    (every process takes part in every program, as multi-controller JAX needs): the
    trainer takes the first `trainer_devices / P` local devices of each process, the
    sampler the next `sampler_devices / P` (`rlhf_eqx.distributed.spanning_devices`),
    and a count that does not divide by `P` is a `ConfigError` naming its field."""
    available = len(devices)
    t = device_count_of(f"{name}.trainer_devices", cfg.trainer_devices, available)
    s = device_count_of(f"{name}.sampler_devices", cfg.sampler_devices, available)
    if t + s > available:
        _fail(
            f"{name}.sampler_devices",
            cfg.sampler_devices,
            f"{s} sampler + {t} trainer devices ({name}.trainer_devices={cfg.trainer_devices!r}) "
            f"must fit in the {available} available; on CPU, "
            "XLA_FLAGS=--xla_force_host_platform_device_count=8 makes eight",
        )
    processes = len({d.process_index for d in devices})
    for field, n in (("trainer_devices", t), ("sampler_devices", s)):
        if n % processes:
            _fail(
                f"{name}.{field}",
                getattr(cfg, field),
                f"{n} device(s) must divide evenly over the {processes} processes of this "
                "run (each process holds the same share of the trainer's and the sampler's "
                "devices)",
            )
    if processes > 1 and getattr(cfg, "partial_rollouts", 0):
        _fail(
            f"{name}.partial_rollouts",
            cfg.partial_rollouts,
            f"must be 0 with {name}.placement=split across the {processes} processes of this "
            "run (partial rollouts are continued on the sampler's devices, which one process "
            "does not hold alone)",
        )
    trainer_mesh = parse_mesh(f"{name}.trainer_mesh", cfg.trainer_mesh, t)
    sampler_mesh = parse_mesh(f"{name}.sampler_mesh", cfg.sampler_mesh, s)
    trainer, sampler = dist.spanning_devices(devices, (t, s))
    return trainer, sampler, trainer_mesh, sampler_mesh


def _rows_on(mesh: Mesh, tree):
    """`tree`'s arrays (rows first, all with as many rows) on `mesh`: rows over its
    `"data"` axis when they divide it, replicated otherwise."""
    rows = jax.tree.leaves(tree)[0].shape[0]
    spec = PartitionSpec("data") if rows % mesh.shape["data"] == 0 else PartitionSpec()
    return dist.reshard(tree, NamedSharding(mesh, spec))


def _arrays(tree) -> list:
    return [x for x in jax.tree.leaves(tree) if eqx.is_array(x)]


def _place_like(tree, mesh: Mesh, fsdp: bool):
    """`tree`'s arrays on `mesh` by the model family's sharding rules (one
    `rlhf_eqx.distributed.reshard` of all of them: a resharding `jax.device_put` in one
    process, the host route across processes)."""
    arrays, rest = eqx.partition(tree, eqx.is_array)
    specs = dist.partition_specs(arrays, fsdp=fsdp)
    leaves, treedef = jax.tree.flatten(arrays)
    spec_leaves = treedef.flatten_up_to(specs)
    shardings = [
        NamedSharding(
            mesh,
            dist.fit_spec(s if isinstance(s, PartitionSpec) else PartitionSpec(), x.shape, mesh),
        )
        for x, s in zip(leaves, spec_leaves)
    ]
    placed = dist.reshard(leaves, shardings)
    return eqx.combine(jax.tree.unflatten(treedef, placed), rest)


class SplitPlacement:
    """The split placement of a GRPO run: the train state, the reference and the update on
    the trainer mesh; the sampler's copy of the policy and the sampling on the sampler
    mesh (the prompts split over its `"data"` axis). `model(params, frozen)` moves the
    behaviour parameters to the sampler's layout (the frozen part, e.g. a LoRA base, only
    when it changes: once a run), timed; `info()` is the iteration's `weight_sync_s`,
    `weight_sync_bytes` and `base_transfers`.

    In one process every move is one resharding `jax.device_put`, and with `separate`
    the sampler samples the next rollouts while the trainer updates. Across processes
    (`jax.distributed`) each mesh spans every process (`split_devices`), and the moves
    between the two device sets go through the hosts (`rlhf_eqx.distributed.reshard`:
    the trainer's shards gathered with `process_allgather`, the sampler's arrays built
    with `jax.make_array_from_callback`; replicated arrays read locally), as
    multi-controller JAX does not reshard onto another set of devices across
    processes; the sampled rows are gathered to every host for decoding and rewards
    (`readable`). There every program runs from the main thread, in the same order on
    every process (`separate` is false: a rollout is sampled before the update that
    overlaps its decoding and rewards, not during it): with the sampler's and the
    trainer's programs in flight at once from two threads, their cross-process
    collectives were seen to deadlock on CPU (gloo)."""

    def __init__(self, name: str, cfg, devices: Sequence[jax.Device] | None = None):
        devices = jax.devices() if devices is None else devices
        if len({d.process_index for d in devices}) > 1:
            same_in_every_process(name, cfg, AGREED_FIELDS)
        trainer, sampler, self.trainer_shape, self.sampler_shape = split_devices(name, cfg, devices)
        t, s = self.trainer_shape, self.sampler_shape
        self.trainer_mesh = dist.make_mesh(t.data, t.model, devices=trainer)
        self.sampler_mesh = dist.make_mesh(s.data, s.model, devices=sampler)
        self.separate = jax.process_count() == 1
        self._frozen: tuple = (None, None)
        self._params: tuple = (None, None)
        self.base_transfers = 0
        self._seconds = 0.0
        self._bytes = 0

    # --- the trainer's side ---------------------------------------------------------

    def _on_trainer(self, tree) -> bool:
        leaves = _arrays(tree)
        if not leaves:
            return True
        sharding = leaves[0].sharding
        return isinstance(sharding, NamedSharding) and sharding.mesh == self.trainer_mesh

    def trainer_state(self, state):
        """A `TrainState` on the trainer mesh (a restored checkpoint's state is placed
        again; a state already there is returned as it is)."""
        if self._on_trainer(state.params):
            return state
        return dist.shard_train_state(state, self.trainer_mesh, fsdp=self.trainer_shape.fsdp)

    def trainer_model(self, model):
        """A model (the reference) on the trainer mesh."""
        if self._on_trainer(model):
            return model
        return dist.shard_model(model, self.trainer_mesh, fsdp=self.trainer_shape.fsdp)

    def back(self, roll, like=None):
        """The rows of `roll` (a `Rollout`) split over the trainer mesh's `"data"` axis."""
        del like
        fields = ("tokens", "mask", "completion_mask", "logprobs", "truncated")
        return dataclasses.replace(roll, **{f: self._rows(getattr(roll, f)) for f in fields})

    def _rows(self, x):
        return _rows_on(self.trainer_mesh, x)

    # --- the sampler's side ---------------------------------------------------------

    def readable(self, pending):
        """The sampled rollout `pending` (a `PendingRollout`) with its arrays readable on
        this process's host, for decoding and rewards: as it is in one process; across
        processes, whose sampled rows lie on other processes' devices too, each array
        whole on the host (`rlhf_eqx.distributed.to_host`: gathered on the sampler's
        devices, a program every process runs in the same order), then on this process's
        default device."""
        if jax.process_count() == 1:
            return pending
        out = jax.tree.map(jnp.asarray, dist.to_host(pending.out))
        return dataclasses.replace(pending, out=out)

    def prompts(self, tokens, mask):
        """The prompt batch on the sampler mesh: rows over `"data"` when they divide it,
        replicated otherwise."""
        return _rows_on(self.sampler_mesh, (tokens, mask))

    def model(self, params, frozen):
        """The policy `params` + `frozen` in the sampler's layout. The same `params` object
        is moved once; `frozen` only when its arrays change."""
        ids = tuple(map(id, _arrays(frozen)))
        if self._frozen[0] != ids:
            self._frozen = (ids, _place_like(frozen, self.sampler_mesh, self.sampler_shape.fsdp))
            self.base_transfers += 1
        if self._params[0] is not params:
            start = time.perf_counter()
            placed = _place_like(params, self.sampler_mesh, self.sampler_shape.fsdp)
            jax.block_until_ready(_arrays(placed))
            self._seconds += time.perf_counter() - start
            self._bytes += int(sum(np.prod(x.shape) * x.dtype.itemsize for x in _arrays(params)))
            self._params = (params, placed)
        return eqx.combine(self._params[1], self._frozen[1])

    def info(self) -> dict:
        """The weight transfers since the last call: seconds, bytes, and the number of
        times the frozen part has been placed on the sampler mesh in the run."""
        out = {
            "weight_sync_s": self._seconds,
            "weight_sync_bytes": float(self._bytes),
            "base_transfers": float(self.base_transfers),
        }
        self._seconds, self._bytes = 0.0, 0
        return out
