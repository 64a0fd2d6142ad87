"""Losses for preference alignment: SFT, reward modelling, the DPO family, PPO, GRPO,
distillation.

Per-sample functions (one sequence, one pair, one group); batch them with `jax.vmap`
and reduce per-token values with `aggregate`. Hyperparameters may be Python numbers
(validated eagerly) or JAX scalars, traced under `jax.jit` / `jax.vmap`. The valid
string options are the public tuples `AGGREGATION_MODES`, `KL_KINDS`,
`ADVANTAGE_SCALES`, `IMPORTANCE_LEVELS` and `DPO_LOSS_TYPES`; `check_choice` validates
against them with a one-line error. The default hyperparameters, which the losses and the
step settings records of `rlhf_eqx.train` share, are the constants of
`rlhf_eqx.losses.defaults`.
"""

from . import defaults as defaults
from ._aggregate import (
    AGGREGATION_MODES as AGGREGATION_MODES,
    AggregationMode as AggregationMode,
    aggregate as aggregate,
    aggregate_parts as aggregate_parts,
    safe_divide as safe_divide,
)
from ._combine import combine_losses as combine_losses
from ._completion_losses import (
    cispo_policy_loss as cispo_policy_loss,
    gmpo_policy_loss as gmpo_policy_loss,
    sapo_policy_loss as sapo_policy_loss,
)
from ._dapo import (
    DynamicSample as DynamicSample,
    dynamic_sampling as dynamic_sampling,
    informative_groups as informative_groups,
    overlong_penalty as overlong_penalty,
)
from ._distill import generalized_jsd as generalized_jsd, reverse_kl_reward as reverse_kl_reward
from ._dpo import (
    dpo_batch_loss as dpo_batch_loss,
    dpo_implicit_rewards as dpo_implicit_rewards,
    dpo_loss as dpo_loss,
)
from ._dpo_losses import (
    DPO_BATCH_LOSS_TYPES as DPO_BATCH_LOSS_TYPES,
    DPO_LOSS_TYPES as DPO_LOSS_TYPES,
    DPO_REFERENCE_FREE_LOSS_TYPES as DPO_REFERENCE_FREE_LOSS_TYPES,
    DPOLossFn as DPOLossFn,
    DPOLossType as DPOLossType,
)
from ._dpo_registry import (
    dpo_loss_hyperparameters as dpo_loss_hyperparameters,
    dpo_loss_types as dpo_loss_types,
    register_dpo_loss as register_dpo_loss,
    registered_dpo_loss as registered_dpo_loss,
    resolve_dpo_loss as resolve_dpo_loss,
)
from ._ensemble import (
    ENSEMBLE_MODES as ENSEMBLE_MODES,
    EnsembleMode as EnsembleMode,
    conservative_reward as conservative_reward,
)
from ._grpo import (
    ADVANTAGE_SCALES as ADVANTAGE_SCALES,
    IMPORTANCE_LEVELS as IMPORTANCE_LEVELS,
    group_advantages as group_advantages,
    grpo_policy_loss as grpo_policy_loss,
    mask_truncated as mask_truncated,
    reinforce_pp_advantages as reinforce_pp_advantages,
    rloo_advantages as rloo_advantages,
)
from ._kl import (
    KL_KINDS as KL_KINDS,
    KLControllerState as KLControllerState,
    KLKind as KLKind,
    adaptive_kl_update as adaptive_kl_update,
    fixed_kl_update as fixed_kl_update,
    kl_penalty as kl_penalty,
    kl_shaped_rewards as kl_shaped_rewards,
)
from ._kto import (
    KTO_LOSS_TYPES as KTO_LOSS_TYPES,
    KTOLossType as KTOLossType,
    kto_loss as kto_loss,
    kto_reference_point as kto_reference_point,
)
from ._offpolicy import (
    MISMATCH_EXTREMES as MISMATCH_EXTREMES,
    ROLLOUT_IS_LEVELS as ROLLOUT_IS_LEVELS,
    ROLLOUT_IS_MODES as ROLLOUT_IS_MODES,
    RolloutCorrection as RolloutCorrection,
    aggregate_mismatch_metrics as aggregate_mismatch_metrics,
    importance_weights as importance_weights,
    mismatch_metrics as mismatch_metrics,
)
from ._orpo import orpo_log_odds as orpo_log_odds, orpo_loss as orpo_loss
from ._policy_loss_registry import (
    POLICY_LOSS_ADVANTAGES as POLICY_LOSS_ADVANTAGES,
    POLICY_LOSS_INPUTS as POLICY_LOSS_INPUTS,
    PolicyLossFn as PolicyLossFn,
    PolicyLossSpec as PolicyLossSpec,
    per_token_output as per_token_output,
    policy_loss_names as policy_loss_names,
    register_policy_loss as register_policy_loss,
    resolve_policy_loss as resolve_policy_loss,
)
from ._policy_losses import (
    BATCH_POLICY_LOSSES as BATCH_POLICY_LOSSES,
    COV_SELECTIONS as COV_SELECTIONS,
    POLICY_LOSSES as POLICY_LOSSES,
    PolicyLoss as PolicyLoss,
    adaptive_entropy_coef as adaptive_entropy_coef,
)
from ._ppo import (
    LOG_RATIO_CLAMP as LOG_RATIO_CLAMP,
    clipped_surrogate as clipped_surrogate,
    gae as gae,
    ppo_policy_loss as ppo_policy_loss,
    ppo_value_loss as ppo_value_loss,
    whiten_advantages as whiten_advantages,
)
from ._process_reward import (
    PRM_AGGREGATIONS as PRM_AGGREGATIONS,
    PRMAggregation as PRMAggregation,
    process_reward_loss as process_reward_loss,
    process_sequence_reward as process_sequence_reward,
    process_token_rewards as process_token_rewards,
)
from ._reward import bradley_terry_loss as bradley_terry_loss
from ._running import RunningMean as RunningMean, running_mean_update as running_mean_update
from ._selective_losses import (
    clip_cov_policy_loss as clip_cov_policy_loss,
    entropy_quantile_mask as entropy_quantile_mask,
    high_entropy_policy_loss as high_entropy_policy_loss,
    kl_cov_policy_loss as kl_cov_policy_loss,
)
from ._sft import sft_nll as sft_nll
from ._validation import Hyperparameter as Hyperparameter, check_choice as check_choice
