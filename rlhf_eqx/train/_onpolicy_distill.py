r"""On-policy distillation (Gu et al. 2024, MiniLLM; Thinking Machines, "On-Policy
Distillation", 2025): each token the student sampled is rewarded with the negative
per-token reverse KL to the teacher, and the student is trained with a policy gradient.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray, PyTree

from ..data import DistillBatch
from ..losses import aggregate_parts, ppo_policy_loss, reverse_kl_reward
from ..models import AbstractSelectiveLM
from ..ops import masked_sum
from ._accumulate import policy_logits, tempered_logprobs
from ._builder import step_builder
from ._distill import _check_vocab, _distill_step, _loss_mask, _split_teacher, _vocab_size
from ._rl_settings import SampledSettings
from ._settings import StepOptions, settings_from
from ._state import combine
from ._step import LossFn, Step
from ._validation import check_aggregation, check_number

# Bound on |log ratio| before exponentiating the importance ratio (as veRL and `ppo_policy_loss`).
_LOG_RATIO_CLAMP = 20.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class OnPolicyDistillSettings(SampledSettings):
    r"""On-policy distillation (`make_onpolicy_distill_step`; Thinking Machines 2025).

    - `kl_coef`: $\beta_{\rm KL} \geq 0$, the weight of the per-token reverse KL (may be
      a JAX array).
    - `clip_eps`: `None` (default) for the plain importance-sampling loss, or PPO's
      $\varepsilon > 0$.
    - `mode`, `constant`: aggregation over the completion tokens (`aggregate_parts`).
    - `temperature`: the sampling temperature (`SampledSettings`; a Python number: both
      log-probabilities are taken of `logits / temperature`).

    Validated when built (see `DPOSettings`): one `ValueError` line naming the field.
    """

    kl_coef: float | Float[Array, ""] = 1.0
    clip_eps: float | None = None
    mode: str = "token-mean"
    constant: float | None = None

    def __post_init__(self):
        check_number("kl_coef", self.kl_coef, low=0.0)
        check_number("clip_eps", self.clip_eps, low=0.0, low_open=True, allow_none=True)
        check_aggregation(self.mode, self.constant)
        super().__post_init__()  # the one rule of a sampling temperature
        if not isinstance(self.temperature, int | float):
            raise ValueError(f"temperature must be a Python number here, got {self.temperature!r}")


def _token_logps(
    model: Callable[..., Array],
    batch: DistillBatch,
    select: Bool[Array, "B T"],
    key: PRNGKeyArray | None,
    temperature: float,
) -> Float[Array, "B T"]:
    """Log-probabilities of the selected tokens (an `AbstractSelectiveLM` runs its LM head
    only there; any other model returns full logits). Other positions are never read."""
    if isinstance(model, AbstractSelectiveLM):
        out = model.selected_logprobs(
            batch.tokens, batch.mask, select, key=key, temperature=temperature
        )
        return out[0]
    logits = policy_logits(model, batch.tokens, batch.mask, key)
    return tempered_logprobs(logits, batch.tokens, batch.mask, temperature)


def onpolicy_distill_loss(
    settings: OnPolicyDistillSettings | None = None, **shortcuts: Any
) -> LossFn:
    r"""The on-policy distillation loss function for `make_step` on a `DistillBatch` of
    student samples, with `settings` (an `OnPolicyDistillSettings`, or its fields as
    keywords); `frozen` is `(frozen_part_of_the_student, teacher_model)` (the teacher is
    not needed when `batch.teacher_logp` is given, which then takes precedence). See
    `make_onpolicy_distill_step` for the formula.

    Metrics: `reverse_kl` (token mean of $\log\pi_{\rm old} - \log\pi_{\rm teacher}$ on
    the sampled tokens), `teacher_logp` (token mean), `num_tokens` (per batch), and
    `clipfrac` with `clip_eps`.
    """
    s = settings_from(OnPolicyDistillSettings, settings, shortcuts, where="onpolicy_distill_loss")
    kl_coef, clip_eps, mode, constant = s.kl_coef, s.clip_eps, s.mode, s.constant
    temperature = s.temperature
    sg = jax.lax.stop_gradient
    f32 = jnp.float32

    def loss_fn(params: PyTree, frozen: PyTree, batch: DistillBatch, key: PRNGKeyArray | None):
        frozen_part, teacher = _split_teacher(
            frozen, batch.teacher_logp, "make_onpolicy_distill_step", "teacher_logp"
        )
        student = combine(params, frozen_part)
        m, _ = _loss_mask(batch)
        if batch.teacher_logp is not None:
            teacher_logp = batch.teacher_logp
        else:
            _check_vocab(
                _vocab_size(student, batch.tokens, batch.mask),
                _vocab_size(teacher, batch.tokens, batch.mask),
            )
            teacher_logp = _token_logps(teacher, batch, m, None, temperature)
        teacher_logp = sg(teacher_logp.astype(f32))
        logp = _token_logps(student, batch, m, key, temperature).astype(f32)
        old_logp = sg(logp) if batch.old_logp is None else sg(batch.old_logp.astype(f32))
        reward = jax.vmap(reverse_kl_reward)(old_logp, teacher_logp, m)
        adv = kl_coef * reward
        n = jnp.sum(m).astype(f32)
        metrics = {}
        if clip_eps is None:
            log_ratio = jnp.clip(
                jnp.where(m, logp - old_logp, 0.0), -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP
            )
            per_token = jnp.where(m, -jnp.exp(log_ratio) * adv, 0.0)
        else:
            per_token, stats = jax.vmap(
                lambda a, b, c, d: ppo_policy_loss(a, b, c, d, clip_eps=clip_eps)
            )(logp, old_logp, adv, m)
            metrics["clipfrac"] = (masked_sum(stats["clipped"].astype(f32), m), n)
        num, den = aggregate_parts(per_token, m, mode=mode, constant=constant)
        metrics.update(
            {
                "reverse_kl": (masked_sum(-reward, m), n),
                "teacher_logp": (masked_sum(teacher_logp, m), n),
                "num_tokens": (n, jnp.zeros((), f32)),  # a total
            }
        )
        return {"distill": num}, {"distill": den}, metrics

    return loss_fn


@step_builder(OnPolicyDistillSettings)
def make_onpolicy_distill_step(
    optimizer, settings: OnPolicyDistillSettings, options: StepOptions
) -> Step:
    r"""Build the on-policy distillation update: a per-token reverse-KL policy gradient.

    The batch holds completions sampled from the student (`generate_batch`; `old_logp`
    their sampling log-probabilities, or `None` when the current student sampled them).
    Each sampled token $y_t$ gets the detached advantage

    $$A_t = -\beta_{\rm KL}\big(\log\pi_{\rm old}(y_t \mid y_{<t})
      - \log\pi_{\rm teacher}(y_t \mid y_{<t})\big)$$

    (`rlhf_eqx.losses.reverse_kl_reward`, no discounting across tokens) and the loss is
    the importance-sampled policy gradient

    $$\ell_t = -\rho_t A_t, \qquad \rho_t = \exp\big(\log\pi_\theta(y_t \mid y_{<t})
      - \log\pi_{\rm old}(y_t \mid y_{<t})\big),$$

    aggregated over the completion tokens (Thinking Machines, "On-Policy Distillation",
    2025, with Tinker's `importance_sampling` loss; Gu et al. 2024, MiniLLM, single-step
    term). On-policy ($\rho_t = 1$) its gradient is $\beta_{\rm KL}\,\nabla_\theta
    \log\pi_\theta(y_t)\,(\log\pi_\theta(y_t) - \log\pi_{\rm teacher}(y_t))$, whose
    expectation over $y_t \sim \pi_\theta(\cdot \mid y_{<t})$ is exactly $\beta_{\rm KL}
    \nabla_\theta \mathrm{KL}(\pi_\theta \,\|\, \pi_{\rm teacher})$ at that prefix: the
    policy-gradient (score-function) form of the per-token reverse-KL gradient, which
    needs only the teacher's log-probabilities of the sampled tokens. (The exact
    full-vocabulary gradient is `make_distill_step(beta=1.0)` on the same batch.) The
    log-ratio is clamped to $[-20, 20]$; `clip_eps` replaces the surrogate by PPO's
    clipped one (`ppo_policy_loss`).

    **Arguments:**

    - `settings`: an `OnPolicyDistillSettings` with the fields below.
    - `kl_coef`: $\beta_{\rm KL} \geq 0$ (Thinking Machines' `kl_penalty_coef`, 1; may
      be a JAX array).
    - `clip_eps`: `None` (default) for the plain importance-sampling loss, or PPO's
      $\varepsilon$.
    - `mode`, `constant`: aggregation (see `rlhf_eqx.losses.aggregate_parts`).
    - `temperature`: the sampling temperature (a Python number); both log-probabilities
      are taken of `logits / temperature`.
    - `optimizer`, `options` (a `StepOptions`) and `**shortcuts` (`kl_coef=0.5`,
      `micro_batches=2`): see `step_builder`.

    Invalid choices and out-of-range numbers raise `ValueError` when the record is built.

    **Returns:**

    ```python
    step(params, opt_state, batch: DistillBatch, *, frozen=None, teacher=None, key=None)
        -> (params, opt_state, metrics)
    ```

    one `eqx.filter_jit` region; the teacher's log-probabilities come from
    `batch.teacher_logp` or from `teacher=` (never differentiated; a vocabulary that
    differs from the student's raises `ValueError` when the step is first called).
    Metrics: `loss`, `reverse_kl` (per-token estimate, token mean), `teacher_logp`,
    `num_tokens`, `clipfrac` (with `clip_eps`), `grad_norm`, `learning_rate`, `nonfinite`.
    """
    return _distill_step(
        onpolicy_distill_loss(settings), optimizer, options, ("onpolicy_distill", settings)
    )
