r"""The settings records of the reinforcement-learning steps: `PPOSettings` and
`GRPOSettings` (see `_settings.py` for the conventions: frozen, validated when built,
JAX arrays accepted where the step allows traced values)."""

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

from jaxtyping import Array, Float

from .._sampling import DEFAULT_TEMPERATURE
from ..losses import (
    ADVANTAGE_SCALES,
    COV_SELECTIONS,
    IMPORTANCE_LEVELS,
    PolicyLossFn,
    RolloutCorrection,
)
from ..losses.defaults import (
    CISPO_EPS_HIGH,
    CLIP_COV_HIGH,
    CLIP_COV_LOW,
    CLIP_COV_SELECT,
    COV_FRACTION,
    ENTROPY_RHO,
    GMPO_CLIP,
    GRPO_BETA,
    GRPO_CLIP_EPS,
    GRPO_IMPORTANCE,
    GRPO_SCALE,
    KL_COV_COEF,
    PPO_CLIP_EPS,
    PPO_VF_CLIP_EPS,
    SAPO_TAU_NEG,
    SAPO_TAU_POS,
)
from ._policy_loss_fns import check_loss_reads, policy_loss_spec, policy_loss_takes
from ._validation import (
    check_aggregation,
    check_choice,
    check_number,
    check_positive_int,
    is_traced_or_array,
)

AdvantageScale = Literal["group", "batch", "none"]
# Choices are plain `str` fields (see `_settings.py`): a bad value gets the record's
# one-line error.
_record = dataclasses.dataclass(frozen=True, kw_only=True)


@_record
class SampledSettings:
    """The setting every step on sampled completions shares: the sampling `temperature`
    $T > 0$ (log-probabilities and entropies are taken of logits / T). It must be the
    temperature the completions were sampled at; its default is the sampler's,
    `rlhf_eqx.DEFAULT_TEMPERATURE` (1.0)."""

    temperature: float = DEFAULT_TEMPERATURE

    def __post_init__(self):
        check_number("temperature", self.temperature, low=0.0, low_open=True)


@_record
class PPOSettings(SampledSettings):
    r"""PPO with a critic (`make_ppo_step`; Schulman et al. 2017; defaults of TRL's
    `PPOConfig` / the PPO paper for language models).

    - `clip_eps`: the ratio clip $\epsilon > 0$; `clip_eps_high` (`None`: the same) the
      upper one (clip-higher); `dual_clip` $c > 1$ (`None`: off).
    - `vf_coef`: $c_v \geq 0$, weight of the value loss, itself
      $\tfrac12\max((V - R)^2, (V_{\rm clip} - R)^2)$ as TRL's (0.5, the PPO paper's;
      TRL's `PPOConfig.vf_coef` default is 0.1).
    - `vf_clip_eps`: the value clip around the rollout's values, $> 0$ (`None`: off;
      TRL's `cliprange_value`, 0.2).
    - `ent_coef`: $c_e$, weight of the entropy bonus (0.01; 0 skips the entropies'
      gradient; TRL's `PPOTrainer` has no entropy bonus: 0 matches it).
    - `mode`, `constant`: aggregation over the completion tokens (`aggregate_parts`).
    - `temperature`: the sampling temperature (`SampledSettings`).
    - `policy_loss`: the per-token policy loss, `"ppo"` (`ppo_policy_loss` with
      `clip_eps`, `clip_eps_high`, `dual_clip`), a name registered with
      `rlhf_eqx.losses.register_policy_loss` that takes per-token advantages, or such a
      loss itself; `loss_kwargs`: its hyperparameters that are not fields here (may be
      JAX arrays). `clip_eps_high` and `dual_clip` apply only to a loss that reads
      them (set for another, they are refused).

    Numbers except `dual_clip`, `constant` and `temperature` may be JAX arrays.
    """

    clip_eps: float | Float[Array, ""] = PPO_CLIP_EPS
    clip_eps_high: float | Float[Array, ""] | None = None
    dual_clip: float | None = None
    vf_coef: float | Float[Array, ""] = 0.5
    vf_clip_eps: float | Float[Array, ""] | None = PPO_VF_CLIP_EPS
    ent_coef: float | Float[Array, ""] = 0.01
    mode: str = "token-mean"
    constant: float | None = None
    policy_loss: str | PolicyLossFn = "ppo"
    loss_kwargs: Mapping[str, Any] | None = None

    def __post_init__(self):
        super().__post_init__()
        check_number("clip_eps", self.clip_eps, low=0.0, low_open=True)
        check_number("clip_eps_high", self.clip_eps_high, low=0.0, low_open=True, allow_none=True)
        check_number("dual_clip", self.dual_clip, low=1.0, low_open=True, allow_none=True)
        check_number("vf_coef", self.vf_coef, low=0.0)
        check_number("vf_clip_eps", self.vf_clip_eps, low=0.0, low_open=True, allow_none=True)
        check_number("ent_coef", self.ent_coef)
        check_aggregation(self.mode, self.constant)
        _check_loss_kwargs(self.loss_kwargs)
        spec = policy_loss_spec(self, PPOSettings, advantages="token")
        check_loss_reads(self, spec, "dual_clip", None, "token")
        check_loss_reads(self, spec, "clip_eps_high", None, "token")

    def _loss_hyperparameters(self) -> tuple[str, ...]:
        """What the policy loss takes as hyperparameters; a subclass's field of such a
        name is passed to it (`loss_kwargs_with_fields`)."""
        return policy_loss_takes(self.policy_loss, advantages="token")


def _check_loss_kwargs(loss_kwargs: object) -> None:
    if loss_kwargs is not None and not isinstance(loss_kwargs, Mapping):
        raise ValueError(f"loss_kwargs={loss_kwargs!r}: must be a mapping or None")


@_record
class GRPOSettings(SampledSettings):
    r"""The GRPO family (`make_grpo_step`; Shao et al. 2024; TRL `GRPOConfig`).

    - `group_size`: $G$, consecutive rows sharing a prompt (required).
    - `scale`: the advantages' scale, `"group"`, `"batch"` or `"none"` (Dr.GRPO).
    - `clip_eps`, `clip_eps_high` (`None`: the same): the ratio clip; `importance`:
      `"token"` or `"sequence"` (GSPO); `delta` $> 1$: the two-sided clip (`None`: off).
    - `beta`: $\beta \geq 0$, weight of the k3 KL to the reference. Default 0.0, TRL's
      `GRPOConfig.beta` default (no reference model is needed; DeepSeek-R1 used 0.001,
      the GRPO paper 0.04).
    - `mode`, `constant`: aggregation (`aggregate_parts`); `mask_truncated_completions`:
      drop completions cut at the length limit (DAPO's overlong filtering).
    - `temperature`: the sampling temperature (`SampledSettings`).
    - `policy_loss`: one of `rlhf_eqx.losses.POLICY_LOSSES`, a name registered with
      `rlhf_eqx.losses.register_policy_loss` (`loss_kwargs`: its hyperparameters that
      are not fields here; may be JAX arrays) or such a loss itself; the built-in
      ones' parameters are
      `cispo_eps_low` ($\geq 0$ or `None`), `cispo_eps_high` ($\geq 0$), `gmpo_clip`
      ($> 0$), `sapo_tau_pos`, `sapo_tau_neg` ($> 0$), `cov_fraction` (in $(0, 1]$),
      `clip_cov_low` < `clip_cov_high`, `clip_cov_select` (`"random"` or `"top"`),
      `kl_cov_coef` ($\geq 0$), `entropy_rho` (in $(0, 1]$). `importance` and `delta`
      apply only to a loss that reads them (`"grpo"`, `"high_entropy"`), and
      `clip_eps_high` too (`"grpo"`, `"clip_cov"`, `"high_entropy"`: CISPO's is
      `cispo_eps_high`); set for another loss, they are refused.
    - `rollout_correction`: a `rlhf_eqx.losses.RolloutCorrection` for off-policy
      rollouts (`None`: none).

    Numbers except `group_size`, `delta`, `constant` and `temperature` may be JAX arrays.
    """

    group_size: int
    scale: str = GRPO_SCALE
    clip_eps: float | Float[Array, ""] = GRPO_CLIP_EPS
    clip_eps_high: float | Float[Array, ""] | None = None
    importance: str = GRPO_IMPORTANCE
    beta: float | Float[Array, ""] = GRPO_BETA
    delta: float | None = None
    mode: str = "seq-mean-token-mean"
    constant: float | None = None
    mask_truncated_completions: bool = False
    policy_loss: str | PolicyLossFn = "grpo"
    loss_kwargs: Mapping[str, Any] | None = None
    cispo_eps_low: float | Float[Array, ""] | None = None
    cispo_eps_high: float | Float[Array, ""] = CISPO_EPS_HIGH
    gmpo_clip: float | Float[Array, ""] = GMPO_CLIP
    sapo_tau_pos: float | Float[Array, ""] = SAPO_TAU_POS
    sapo_tau_neg: float | Float[Array, ""] = SAPO_TAU_NEG
    cov_fraction: float | Float[Array, ""] = COV_FRACTION
    clip_cov_low: float | Float[Array, ""] = CLIP_COV_LOW
    clip_cov_high: float | Float[Array, ""] = CLIP_COV_HIGH
    clip_cov_select: str = CLIP_COV_SELECT
    kl_cov_coef: float | Float[Array, ""] = KL_COV_COEF
    entropy_rho: float | Float[Array, ""] = ENTROPY_RHO
    rollout_correction: RolloutCorrection | None = None

    def __post_init__(self):
        super().__post_init__()
        check_positive_int("group_size", self.group_size)
        check_choice("scale", self.scale, ADVANTAGE_SCALES)
        check_number("clip_eps", self.clip_eps, low=0.0, low_open=True)
        check_number("clip_eps_high", self.clip_eps_high, low=0.0, low_open=True, allow_none=True)
        check_choice("importance", self.importance, IMPORTANCE_LEVELS)
        check_number("beta", self.beta, low=0.0)
        check_number("delta", self.delta, low=1.0, low_open=True, allow_none=True)
        check_aggregation(self.mode, self.constant)
        if not isinstance(self.mask_truncated_completions, bool):
            raise ValueError(
                f"mask_truncated_completions={self.mask_truncated_completions!r}: must be "
                "True or False"
            )
        self._check_policy_loss()
        rc = self.rollout_correction
        if rc is not None and not isinstance(rc, RolloutCorrection):
            raise ValueError(f"rollout_correction={rc!r}: must be a RolloutCorrection or None")

    def _check_policy_loss(self):
        _check_loss_kwargs(self.loss_kwargs)
        spec = policy_loss_spec(self, GRPOSettings, advantages="sequence")
        check_choice("clip_cov_select", self.clip_cov_select, COV_SELECTIONS)
        check_number("cispo_eps_low", self.cispo_eps_low, low=0.0, allow_none=True)
        check_number("cispo_eps_high", self.cispo_eps_high, low=0.0)
        check_number("gmpo_clip", self.gmpo_clip, low=0.0, low_open=True)
        check_number("sapo_tau_pos", self.sapo_tau_pos, low=0.0, low_open=True)
        check_number("sapo_tau_neg", self.sapo_tau_neg, low=0.0, low_open=True)
        check_number("cov_fraction", self.cov_fraction, low=0.0, high=1.0, low_open=True)
        check_number("clip_cov_low", self.clip_cov_low)
        check_number("clip_cov_high", self.clip_cov_high)
        low, high = self.clip_cov_low, self.clip_cov_high
        if not (is_traced_or_array(low) or is_traced_or_array(high)) and low >= high:
            raise ValueError(f"clip_cov_low={low!r}: must be below clip_cov_high={high!r}")
        check_number("kl_cov_coef", self.kl_cov_coef, low=0.0)
        check_number("entropy_rho", self.entropy_rho, low=0.0, high=1.0, low_open=True)
        check_loss_reads(self, spec, "importance", "token", "sequence")
        check_loss_reads(self, spec, "delta", None, "sequence")
        check_loss_reads(self, spec, "clip_eps_high", None, "sequence")

    def _loss_hyperparameters(self) -> tuple[str, ...]:
        """What the policy loss takes as hyperparameters; a subclass's field of such a
        name is passed to it (`loss_kwargs_with_fields`)."""
        return policy_loss_takes(self.policy_loss, advantages="sequence")
