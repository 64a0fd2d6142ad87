r"""The default hyperparameters of the losses, each written once.

A per-sample loss (`dpo_loss(beta=...)`, `kto_loss`, `grpo_policy_loss`, ...) and the
settings record of the step that calls it (`rlhf_eqx.train.DPOSettings.beta`, ...) both
take their default from here, so a loss called alone computes what the step does and a
default changes in one place. The values are TRL's defaults (or the cited paper's) where
TRL has the setting; each constant's note names the loss keywords and the record fields
that read it.

A default of `None` (a switch that is off: `clip_eps_high`, `dual_clip`, `delta`,
`cispo_eps_low`) is not a number to tune and stays written where it is. The sampling
temperature's default is `rlhf_eqx.DEFAULT_TEMPERATURE`.
"""

# --- DPO family (TRL `DPOConfig`, `CPOConfig`, `ORPOConfig`) -------------------------------
DPO_BETA = 0.1
"""`beta` of `dpo_loss`, `dpo_batch_loss`, `dpo_implicit_rewards`, `orpo_loss`;
`DPOSettings.beta`."""
DPO_LOSS_TYPE = "sigmoid"
"""`loss_type` of `dpo_loss`, `dpo_batch_loss`; `DPOSettings.loss_type`."""
DPO_LABEL_SMOOTHING = 0.0
"""`label_smoothing` of `dpo_loss`, `dpo_batch_loss`; `DPOSettings.label_smoothing`."""
BCO_DELTA = 0.0
"""`bco_delta` of `dpo_loss`, `dpo_batch_loss` (a `DPOSettings.loss_kwargs` entry)."""
DISCOPOP_TAU = 0.05
"""`discopop_tau` of `dpo_loss`, `dpo_batch_loss` (a `DPOSettings.loss_kwargs` entry)."""
SIMPO_GAMMA = 0.5
"""`simpo_gamma` of `dpo_loss`, `dpo_batch_loss` (a `DPOSettings.loss_kwargs` entry)."""

# --- KTO (TRL `KTOConfig`) -----------------------------------------------------------------
KTO_BETA = 0.1
"""`beta` of `kto_loss`; `KTOSettings.beta`."""
KTO_DESIRABLE_WEIGHT = 1.0
"""`desirable_weight` of `kto_loss`; `KTOSettings.desirable_weight`."""
KTO_UNDESIRABLE_WEIGHT = 1.0
"""`undesirable_weight` of `kto_loss`; `KTOSettings.undesirable_weight`."""
KTO_LOSS_TYPE = "kto"
"""`loss_type` of `kto_loss`; `KTOSettings.loss_type`."""

# --- distillation (TRL `GKDConfig`) --------------------------------------------------------
DISTILL_BETA = 0.5
"""`beta` of `generalized_jsd`; `DistillSettings.beta`."""

# --- PPO (TRL `PPOConfig`) -----------------------------------------------------------------
PPO_CLIP_EPS = 0.2
"""`clip_eps` of `ppo_policy_loss`, `clipped_surrogate`; `PPOSettings.clip_eps`."""
PPO_VF_CLIP_EPS = 0.2
"""`clip_eps` of `ppo_value_loss`; `PPOSettings.vf_clip_eps`."""

# --- GRPO family (TRL `GRPOConfig`; the cited papers for the later policy losses) -----------
GRPO_CLIP_EPS = 0.2
"""`clip_eps` of `grpo_policy_loss`, `clip_cov_policy_loss`, `high_entropy_policy_loss`;
`GRPOSettings.clip_eps`."""
GRPO_IMPORTANCE = "token"
"""`importance` of `grpo_policy_loss`, `high_entropy_policy_loss`;
`GRPOSettings.importance`."""
GRPO_BETA = 0.0
"""`beta` of `grpo_policy_loss`; `GRPOSettings.beta`."""
GRPO_SCALE = "group"
"""`scale` of `group_advantages`; `GRPOSettings.scale`."""
CISPO_EPS_HIGH = 4.0
"""`clip_eps_high` of `cispo_policy_loss`; `GRPOSettings.cispo_eps_high`."""
GMPO_CLIP = 0.4
"""`clip_eps` of `gmpo_policy_loss`; `GRPOSettings.gmpo_clip`."""
SAPO_TAU_POS = 1.0
"""`tau_pos` of `sapo_policy_loss`; `GRPOSettings.sapo_tau_pos`."""
SAPO_TAU_NEG = 1.05
"""`tau_neg` of `sapo_policy_loss`; `GRPOSettings.sapo_tau_neg`."""
COV_FRACTION = 2e-4
"""`fraction` of `clip_cov_policy_loss`, `kl_cov_policy_loss`; `GRPOSettings.cov_fraction`."""
CLIP_COV_LOW = 1.0
"""`cov_low` of `clip_cov_policy_loss`; `GRPOSettings.clip_cov_low`."""
CLIP_COV_HIGH = 5.0
"""`cov_high` of `clip_cov_policy_loss`; `GRPOSettings.clip_cov_high`."""
CLIP_COV_SELECT = "random"
"""`select` of `clip_cov_policy_loss`; `GRPOSettings.clip_cov_select`."""
KL_COV_COEF = 1.0
"""`kl_coef` of `kl_cov_policy_loss`; `GRPOSettings.kl_cov_coef`."""
ENTROPY_RHO = 0.2
"""`rho` of `high_entropy_policy_loss`, `entropy_quantile_mask`; `GRPOSettings.entropy_rho`."""

# --- reward models (TRL `RewardTrainer`: no margin, no centering unless set) ----------------
REWARD_MARGIN = 0.0
"""`margin` of `bradley_terry_loss`; `RewardSettings.margin`."""
REWARD_CENTER_COEF = 0.0
"""`center_coef` of `bradley_terry_loss`; `RewardSettings.center_coef`."""
