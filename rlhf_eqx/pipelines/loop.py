"""The machinery under every run, for code that writes its own: the iteration loop with
checkpoints, exact resume, rollback and the KL guard (`run_iterations`), the learning-rate
factor a rollback lowers, the run-directory lock and the rules of what may change on
resume, the deterministic choice of each iteration's rows, and offline DPO's batches
with their reference log-probabilities computed on first use; the callbacks' machinery
(`RunHandle`, what a hook sees; `CallbackError`; `load_callback` for `MODULE:NAME`) and
the interruptions a run raises (`RunInterrupted`, `RunDirError`)."""

from ._callbacks import (
    CallbackError as CallbackError,
    RunHandle as RunHandle,
    load_callback as load_callback,
)
from ._dpo_stage import referenced_batches as referenced_batches, referenced_rows as referenced_rows
from ._iterations import run_iterations as run_iterations
from ._loop_state import LoopResult as LoopResult, RunInterrupted as RunInterrupted
from ._lr_scale import (
    get_lr_scale as get_lr_scale,
    scale_by_lr_factor as scale_by_lr_factor,
    set_lr_scale as set_lr_scale,
)
from ._resume_rules import (
    RESUMABLE_FIELDS as RESUMABLE_FIELDS,
    RunDirError as RunDirError,
    check_resumable as check_resumable,
    config_changes as config_changes,
    iteration_fields as iteration_fields,
    resumable_fields as resumable_fields,
)
from ._rundir import RunDir as RunDir, RunLock as RunLock
from ._runs import (
    collate_pairs as collate_pairs,
    rows_at as rows_at,
    shuffled_batches as shuffled_batches,
    take_rows as take_rows,
)
from ._stopping import SPIKE_FLOOR as SPIKE_FLOOR
