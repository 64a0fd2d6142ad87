"""Losses for preference alignment: SFT, reward modelling, the DPO family, PPO, GRPO.

Per-sample functions (one sequence, one pair, one group); batch them with `jax.vmap`
and reduce per-token values with `aggregate`. Hyperparameters may be Python numbers
(validated eagerly) or JAX scalars, traced under `jax.jit` / `jax.vmap`. The valid
string options are the public tuples `AGGREGATION_MODES`, `KL_KINDS`,
`ADVANTAGE_SCALES`, `IMPORTANCE_LEVELS` and `DPO_LOSS_TYPES`; `check_choice` validates
against them with a one-line error.
"""

from ._aggregate import AGGREGATION_MODES as AGGREGATION_MODES
from ._aggregate import AggregationMode as AggregationMode
from ._aggregate import aggregate as aggregate
from ._aggregate import aggregate_parts as aggregate_parts
from ._aggregate import safe_divide as safe_divide
from ._combine import combine_losses as combine_losses
from ._dpo_losses import DPO_BATCH_LOSS_TYPES as DPO_BATCH_LOSS_TYPES
from ._dpo_losses import DPO_LOSS_TYPES as DPO_LOSS_TYPES
from ._dpo_losses import DPO_REFERENCE_FREE_LOSS_TYPES as DPO_REFERENCE_FREE_LOSS_TYPES
from ._dpo_losses import DPOLossType as DPOLossType
from ._dpo import dpo_batch_loss as dpo_batch_loss
from ._dpo import dpo_implicit_rewards as dpo_implicit_rewards
from ._dpo import dpo_loss as dpo_loss
from ._grpo import ADVANTAGE_SCALES as ADVANTAGE_SCALES
from ._grpo import IMPORTANCE_LEVELS as IMPORTANCE_LEVELS
from ._grpo import group_advantages as group_advantages
from ._grpo import grpo_policy_loss as grpo_policy_loss
from ._grpo import mask_truncated as mask_truncated
from ._grpo import reinforce_pp_advantages as reinforce_pp_advantages
from ._grpo import rloo_advantages as rloo_advantages
from ._orpo import orpo_log_odds as orpo_log_odds
from ._orpo import orpo_loss as orpo_loss
from ._kl import KL_KINDS as KL_KINDS
from ._kl import KLControllerState as KLControllerState
from ._kl import KLKind as KLKind
from ._kl import adaptive_kl_update as adaptive_kl_update
from ._kl import fixed_kl_update as fixed_kl_update
from ._kl import kl_penalty as kl_penalty
from ._kl import kl_shaped_rewards as kl_shaped_rewards
from ._ppo import clipped_surrogate as clipped_surrogate
from ._ppo import gae as gae
from ._ppo import ppo_policy_loss as ppo_policy_loss
from ._ppo import ppo_value_loss as ppo_value_loss
from ._ppo import whiten_advantages as whiten_advantages
from ._reward import bradley_terry_loss as bradley_terry_loss
from ._running import RunningMean as RunningMean
from ._running import running_mean_update as running_mean_update
from ._sft import sft_nll as sft_nll
from ._validation import Hyperparameter as Hyperparameter
from ._validation import check_choice as check_choice
