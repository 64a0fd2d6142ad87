"""Training: optimisers and schedules, train state, one step factory and the algorithms' steps.

Every update is built by one factory, `make_step(loss_fn, optimizer, options)`, from a
per-algorithm loss function
`loss_fn(params, frozen, batch, key) -> (numerators, denominators, metrics)` and a
`StepOptions` (`micro_batches`, `axis_name`, `donate`, `nonfinite`, `check_token_ids`);
the builders `make_sft_step`, `make_reward_step`, `make_dpo_step`, `make_ppo_step`,
`make_grpo_step`, `make_kto_step`, `make_distill_step`, `make_onpolicy_distill_step` and
`make_prm_step` are thin wrappers around it, all of the one form `step_builder` gives them.

**Settings records.** Each algorithm's hyperparameters are one frozen, self-validating
record: `SFTSettings`, `RewardSettings`, `DPOSettings`, `PPOSettings`, `GRPOSettings`,
`KTOSettings`, `DistillSettings`, `OnPolicyDistillSettings`, `PRMSettings`, and
`OptimizerSettings` for `make_optimizer`; `make_x_step(optimizer, settings, *,
options=StepOptions(...))`, or any of their fields as keyword shortcuts. The defaults
live in the records only (the pipeline's stage configs inherit them). Each builder
returns a pure function

```python
step(params, opt_state, batch, *, frozen=None, key=None, ...) -> (params, opt_state, metrics)
```

compiled as one `eqx.filter_jit` region: `params` is the trainable partition of the
model (or the whole model), `frozen` the rest (combined inside the step), reference
models are explicit keyword arguments and never differentiated, and `metrics` is a dict
of float32 scalars. `TrainState.apply(step, batch, ...)` runs the same step on a
`TrainState`.

**Micro-batches and devices.** `micro_batches=k` accumulates over a scan and
`axis_name="data"` makes the step exact under `jax.pmap(step, axis_name="data")`:
numerators, denominators, gradients and metric sums are summed over micro-batches and
devices before dividing, so every aggregation mode gives the full-batch loss and
gradient. A step built without `axis_name` refuses (`ValueError`, when traced) to run
inside `jax.pmap` / `shard_map`, where its replicas would silently drift apart.

**Non-finite updates.** A step whose loss or gradient is not finite is skipped by
default (`params` and `opt_state` unchanged, metric `nonfinite = 1`, counted in
`TrainState.skipped`); `nonfinite="raise"` stops instead.

**Donation.** Steps called directly never donate their inputs (unless built or called
with `donate=True`); `TrainState.apply` donates the state's own buffers, which
`init_train_state` copied (unless the step was built with `donate=False`). A buffer that
appears anywhere else in the call is never donated. See `rlhf_eqx.train.make_step`.
"""

# The batch types of the steps are the data layer's (`rlhf_eqx.data`), re-exported here.
from ..data import (
    BootstrapBatch as BootstrapBatch,
    DistillBatch as DistillBatch,
    GRPOBatch as GRPOBatch,
    KTOBatch as KTOBatch,
    PPOBatch as PPOBatch,
    PRMBatch as PRMBatch,
)
from ._accumulate import (
    accumulate_gradients as accumulate_gradients,
    apply_optimizer as apply_optimizer,
    split_micro_batches as split_micro_batches,
    sums_to_means as sums_to_means,
)
from ._builder import step_builder as step_builder
from ._distill import (
    DistillSettings as DistillSettings,
    distill_loss as distill_loss,
    make_distill_step as make_distill_step,
)
from ._dpo import dpo_loss_fn as dpo_loss_fn, make_dpo_step as make_dpo_step
from ._ensemble import (
    Ensemble as Ensemble,
    bootstrap_weights as bootstrap_weights,
    ensemble_scores as ensemble_scores,
    init_ensemble_optimizer as init_ensemble_optimizer,
    init_ensemble_state as init_ensemble_state,
    make_ensemble as make_ensemble,
    make_ensemble_reward_step as make_ensemble_reward_step,
    scalar_head_filter as scalar_head_filter,
)
from ._grpo import grpo_loss as grpo_loss, make_grpo_step as make_grpo_step
from ._grpo_advantages import grpo_advantages as grpo_advantages
from ._judge import (
    JUDGE_SCORES as JUDGE_SCORES,
    JudgeReward as JudgeReward,
    judge_reward as judge_reward,
    judge_scores as judge_scores,
    verdict_scores as verdict_scores,
)
from ._kto import (
    KTOSettings as KTOSettings,
    compute_kto_reference_logps as compute_kto_reference_logps,
    make_kto_step as make_kto_step,
)
from ._onpolicy_distill import (
    OnPolicyDistillSettings as OnPolicyDistillSettings,
    make_onpolicy_distill_step as make_onpolicy_distill_step,
    onpolicy_distill_loss as onpolicy_distill_loss,
)
from ._optim import (
    decay_mask as decay_mask,
    learning_rate_from_state as learning_rate_from_state,
    make_optimizer as make_optimizer,
    make_schedule as make_schedule,
)
from ._pair_logps import (
    compute_reference_logps as compute_reference_logps,
    sequence_logps as sequence_logps,
)
from ._policy_loss_fns import make_policy_loss as make_policy_loss
from ._ppo import make_ppo_step as make_ppo_step, ppo_loss as ppo_loss
from ._ppo_rollout import (
    compute_advantages as compute_advantages,
    prepare_ppo_batch as prepare_ppo_batch,
    token_values as token_values,
)
from ._prm import (
    PRM_SCORES as PRM_SCORES,
    PRMSettings as PRMSettings,
    add_token_rewards as add_token_rewards,
    make_prm_step as make_prm_step,
    prm_loss as prm_loss,
    process_rewards as process_rewards,
    step_end_mask as step_end_mask,
)
from ._reward import make_reward_step as make_reward_step, reward_loss as reward_loss
from ._rl_settings import (
    GRPOSettings as GRPOSettings,
    PPOSettings as PPOSettings,
    SampledSettings as SampledSettings,
)
from ._settings import (
    DPOSettings as DPOSettings,
    OptimizerSettings as OptimizerSettings,
    RewardSettings as RewardSettings,
    SFTSettings as SFTSettings,
    StepOptions as StepOptions,
)
from ._sft import make_sft_step as make_sft_step, sft_loss as sft_loss
from ._state import (
    TrainState as TrainState,
    init_train_state as init_train_state,
    partition_trainable as partition_trainable,
)
from ._step import Step as Step, make_step as make_step
from ._step_cache import shared_build as shared_build
from ._validation import check_number as check_number
