"""Running steps on several devices and processes: pmap helpers, sharded meshes, multi-process.

The step builders of `rlhf_eqx.train` return plain jittable functions; this module only
places their inputs. Three modes:

- **pmap** (data parallel, one process): `replicate` the params and the optimiser
  state, `shard_batch_for_pmap` the global batch onto a leading device axis, run the
  step under `jax.pmap(..., axis_name="data")` (with a step built for that axis name:
  a step built without one refuses to run under `jax.pmap`, where each replica would
  take its own shard's step), `unreplicate` the result.
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
  `spanning_devices` picks disjoint device groups that each span every process (e.g. a
  trainer mesh and a sampler mesh), `reshard` moves arrays between such groups (through
  the hosts where `jax.device_put` cannot across processes) and `to_host` reads arrays
  sharded across processes whole on each host.

Meshes have automatic (GSPMD) axes: the placement helpers refuse a mesh with an
`AxisType.Explicit` axis (the default axis type of `jax.make_mesh`), naming its axes,
since the models' gathers and products fail to trace under sharding-in-types.

Specs name mesh axes regardless of sizes; wherever a dimension does not divide by the
size of the axis it names, that dimension is replicated instead (`fit_spec`).
"""

from ..models import partition_specs as partition_specs
from ._cross_process import (
    reshard as reshard,
    spanning_devices as spanning_devices,
    to_host as to_host,
)
from ._memory import MemoryEstimate as MemoryEstimate, estimate_memory as estimate_memory
from ._mesh import (
    fit_spec as fit_spec,
    make_mesh as make_mesh,
    opt_state_specs as opt_state_specs,
    shard_batch as shard_batch,
    shard_model as shard_model,
    shard_opt_state as shard_opt_state,
    shard_train_state as shard_train_state,
)
from ._pmap import (
    replicate as replicate,
    shard_batch_for_pmap as shard_batch_for_pmap,
    unreplicate as unreplicate,
)
from ._processes import (
    ENV_COORDINATOR as ENV_COORDINATOR,
    ENV_NUM_PROCESSES as ENV_NUM_PROCESSES,
    ENV_PROCESS_ID as ENV_PROCESS_ID,
    global_batch as global_batch,
    initialize_distributed as initialize_distributed,
    process_record_indices as process_record_indices,
)

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
    "spanning_devices",
    "reshard",
    "to_host",
    "estimate_memory",
    "MemoryEstimate",
]
