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


def split_devices(
    name: str, cfg, devices: Sequence[jax.Device]
) -> tuple[list[jax.Device], list[jax.Device], MeshShape, MeshShape]:
    """The trainer's and the sampler's devices (the first `trainer_devices` of `devices`,
    then the next `sampler_devices`: disjoint) and their mesh shapes, for the settings
    `cfg` of the section `name`; `ConfigError` naming the field when they do not fit, or
    naming `<name>.placement` in a multi-process run (`check_one_process`)."""
    check_one_process(name)
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
    trainer_mesh = parse_mesh(f"{name}.trainer_mesh", cfg.trainer_mesh, t)
    sampler_mesh = parse_mesh(f"{name}.sampler_mesh", cfg.sampler_mesh, s)
    return list(devices[:t]), list(devices[t : t + s]), trainer_mesh, sampler_mesh


def check_one_process(name: str) -> None:
    """A `ConfigError` naming `<name>.placement` in a multi-process run
    (`jax.process_count() > 1`). Multi-controller JAX cannot run the split placement
    there: `jax.device_put` refuses to reshard an array across processes onto another
    set of devices (the weight transfer from the trainer's devices to the sampler's),
    and meshes of one process's devices each (the first devices of `jax.devices()` are
    process 0's) leave the other process unable to read the rollouts it decodes."""
    if jax.process_count() > 1:
        _fail(
            f"{name}.placement",
            "split",
            f"runs in one process, not across the {jax.process_count()} of this run: "
            "multi-controller JAX cannot move the weights from the trainer's devices to "
            "the sampler's across processes (a cross-process reshard needs the same "
            "devices on both sides); use placement=colocated here",
        )


def _arrays(tree) -> list:
    return [x for x in jax.tree.leaves(tree) if eqx.is_array(x)]


def _place_like(tree, mesh: Mesh, fsdp: bool):
    """`tree`'s arrays on `mesh` by the model family's sharding rules (one resharding
    `jax.device_put` of all of them)."""
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
    placed = jax.device_put(leaves, shardings)
    return eqx.combine(jax.tree.unflatten(treedef, placed), rest)


class SplitPlacement:
    """The split placement of a GRPO run: the train state, the reference and the update on
    the trainer mesh; the sampler's copy of the policy and the sampling on the sampler
    mesh (the prompts split over its `"data"` axis). `model(params, frozen)` moves the
    behaviour parameters to the sampler's layout by one resharding `jax.device_put` (the
    frozen part, e.g. a LoRA base, only when it changes: once a run), timed; `info()` is
    the iteration's `weight_sync_s`, `weight_sync_bytes` and `base_transfers`."""

    separate = True

    def __init__(self, name: str, cfg, devices: Sequence[jax.Device] | None = None):
        devices = jax.devices() if devices is None else devices
        trainer, sampler, self.trainer_shape, self.sampler_shape = split_devices(name, cfg, devices)
        t, s = self.trainer_shape, self.sampler_shape
        self.trainer_mesh = dist.make_mesh(t.data, t.model, devices=trainer)
        self.sampler_mesh = dist.make_mesh(s.data, s.model, devices=sampler)
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
        mesh = self.trainer_mesh
        spec = PartitionSpec("data") if x.shape[0] % mesh.shape["data"] == 0 else PartitionSpec()
        return jax.device_put(x, NamedSharding(mesh, spec))

    # --- the sampler's side ---------------------------------------------------------

    def prompts(self, tokens, mask):
        """The prompt batch on the sampler mesh: rows over `"data"` when they divide it,
        replicated otherwise."""
        mesh = self.sampler_mesh
        spec = (
            PartitionSpec("data") if tokens.shape[0] % mesh.shape["data"] == 0 else PartitionSpec()
        )
        return jax.device_put((tokens, mask), NamedSharding(mesh, spec))

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
