"""PPO step: the clipped policy loss, the clipped value loss and the entropy bonus."""

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jaxtyping import PRNGKeyArray, PyTree

from ..data import PPOBatch
from ..losses import LOG_RATIO_CLAMP, aggregate_parts, ppo_value_loss
from ..ops import masked_sum
from ._builder import step_builder
from ._policy_loss_fns import make_policy_loss, read_policy_loss
from ._ppo_rollout import policy_logps_and_values
from ._rl_settings import PPOSettings
from ._settings import StepOptions, settings_from
from ._step import LossFn, Step, make_step
from ._step_cache import BUILDS, value_key


def ppo_loss(settings: PPOSettings | None = None, **shortcuts: Any) -> LossFn:
    r"""The PPO loss function (policy + value + entropy) for `make_step` on a `PPOBatch`,
    with `settings` (a `PPOSettings`, or its fields as keywords).

    Numerators `policy` (`settings.policy_loss`, PPO's clipped surrogate by default),
    `value` (× `vf_coef`) and `entropy` (× −`ent_coef`, when non-zero) share the
    aggregation denominator of `mode` over the completion tokens.
    """
    s = settings_from(PPOSettings, settings, shortcuts, where="ppo_loss")
    policy_loss = make_policy_loss(s, PPOSettings, advantages="token", axis_name=None)
    vf_coef, vf_clip_eps, ent_coef = s.vf_coef, s.vf_clip_eps, s.ent_coef
    mode, constant, temperature = s.mode, s.constant, s.temperature
    use_entropy = not (isinstance(ent_coef, int | float) and ent_coef == 0)
    f32 = jnp.float32

    def loss_fn(params: PyTree, frozen: PyTree, batch: PPOBatch, key: PRNGKeyArray | None):
        m = batch.completion_mask & batch.mask
        logp, ent, values = policy_logps_and_values(
            params,
            frozen,
            batch.tokens,
            batch.mask,
            m,
            key,
            temperature=temperature,
            entropy_grad=use_entropy,
        )
        pg, stats = policy_loss(logp, batch.old_logp, batch.advantages, m, ent, None, key)
        # the policy's move, whatever the loss: the clamped log-ratio, as `ppo_policy_loss`
        zero = jnp.zeros_like(pg)
        log_ratio = jnp.clip(logp - batch.old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        log_ratio = jnp.where(m, log_ratio, zero)
        vf, vclipped = jax.vmap(
            lambda a, b, c, d: ppo_value_loss(a, b, c, d, clip_eps=vf_clip_eps)
        )(values, batch.old_values, batch.returns, m)
        # The entropy of the distribution each completion token was sampled from: the
        # predecessor is found from the real-token mask, then the completion is kept.
        ent = jnp.where(m, ent, jnp.zeros_like(ent))
        pg_num, den = aggregate_parts(pg, m, mode=mode, constant=constant)
        vf_num, _ = aggregate_parts(vf, m, mode=mode, constant=constant)
        nums = {"policy": pg_num, "value": vf_coef * vf_num}
        dens = {"policy": den, "value": den}
        if use_entropy:
            ent_num, _ = aggregate_parts(ent, m, mode=mode, constant=constant)
            nums["entropy"], dens["entropy"] = -ent_coef * ent_num, den
        n = jnp.sum(m).astype(f32)
        metrics = {
            "policy/clipfrac": (masked_sum(stats.get("clipped", zero), m), n),
            "policy/approxkl": (masked_sum(0.5 * jnp.square(log_ratio), m), n),
            "policy/ratio": (masked_sum(jnp.where(m, jnp.exp(log_ratio), zero), m), n),
            "policy/entropy": (masked_sum(ent, m), n),
            "val/clipfrac": (masked_sum(vclipped, m), n),
            "val/vpred": (masked_sum(values, m), n),
            "val/error": (masked_sum(jnp.square(values - batch.returns), m), n),
        }
        return nums, dens, metrics

    return loss_fn


def _pair_optimizer(
    policy_opt: optax.GradientTransformation, value_opt: optax.GradientTransformation
) -> optax.GradientTransformation:
    """Apply `policy_opt` to `params[0]` and `value_opt` to `params[1]` (separately clipped)."""

    def init(params):
        return (policy_opt.init(params[0]), value_opt.init(params[1]))

    def update(grads, state, params=None):
        p0, p1 = (None, None) if params is None else params
        u0, s0 = policy_opt.update(grads[0], state[0], p0)
        u1, s1 = value_opt.update(grads[1], state[1], p1)
        return (u0, u1), (s0, s1)

    return optax.GradientTransformation(init, update)


def _pair_grad_norms(metrics, grads):
    metrics = dict(metrics)
    metrics["grad_norm/policy"] = optax.tree.norm(grads[0]).astype(jnp.float32)
    metrics["grad_norm/value"] = optax.tree.norm(grads[1]).astype(jnp.float32)
    return metrics


@step_builder(PPOSettings)
def make_ppo_step(
    optimizer,
    settings: PPOSettings,
    options: StepOptions,
    *,
    value_optimizer: optax.GradientTransformation | None = None,
) -> Step:
    r"""Build the PPO update of the policy and the critic (Schulman et al. 2017; TRL `PPOTrainer`).

    $$\mathcal L = \mathrm{agg}\big(\ell^{\rm clip}_t\big)
    + c_v\,\mathrm{agg}\big(\ell^{V}_t\big) - c_e\,\mathrm{agg}\big(H_t\big)$$

    with `ppo_policy_loss` (clipped surrogate; `clip_eps_high` for clip-higher,
    `dual_clip`) or the per-token loss `policy_loss` names (one registered with
    `rlhf_eqx.losses.register_policy_loss`, or a callable; its hyperparameters from
    `loss_kwargs` and the fields of the same name), `ppo_value_loss` (clipped at
    `vf_clip_eps` around `batch.old_values`, includes the ½), the entropy $H_t$ of the
    distribution token $t$ was sampled from, and `agg` the aggregation `mode` over
    `batch.completion_mask`. Log-probabilities and entropies are taken at the sampling
    `temperature` (logits / T; TRL divides by `temperature` too), which must be the one
    the rollout was sampled at.

    Two layouts:

    - **one optimiser** (`value_optimizer=None`): `params` is a `(policy, value_model)`
      pair, or a single model returning `(logits [T, V], values [T])`; one optimiser
      state, one gradient clip over everything;
    - **two optimisers** (`value_optimizer` given): `params = (policy, value_model)`,
      `opt_state = (policy_opt_state, value_opt_state)`; each part is updated by its own
      optimiser (separately clipped).

    `frozen` has the same layout as `params` (a pair of frozen parts, or `None`).

    **Arguments:** `settings`, a `PPOSettings` (`clip_eps`, `clip_eps_high`,
    `dual_clip`, `vf_coef` 0.5, `vf_clip_eps`, `ent_coef` 0.01, `mode`, `constant`,
    `temperature`, `policy_loss`, `loss_kwargs`); `value_optimizer` (above); `optimizer`,
    `options` (a `StepOptions`) and `**shortcuts`: see `step_builder`. Invalid values
    raise `ValueError` when the record is built.

    **Returns:** `step(params, opt_state, batch: PPOBatch, *, frozen=None, key=None) ->
    (params, opt_state, metrics)`, one `eqx.filter_jit` region. Metrics (masked means
    over the completion tokens): `loss`, `loss/policy`, `loss/value` (× `vf_coef`),
    `loss/entropy` (× −`ent_coef`, when non-zero), `policy/clipfrac`,
    `policy/approxkl`, `policy/entropy`, `policy/ratio`, `val/clipfrac`, `val/vpred`,
    `val/error`, `grad_norm` (and `grad_norm/policy`, `grad_norm/value` with two
    optimisers), `learning_rate`, `nonfinite`, `empty_batch`. The rollout metrics
    (`objective/kl`, `objective/scores`, ...) come from `compute_advantages` /
    `prepare_ppo_batch`.

    **Empty batches.** A batch with zero rows raises `ValueError` when the step is
    traced. A batch whose completion masks are all false (no action to learn from) has
    every denominator 0: the update is skipped and `empty_batch = 1` (see `make_step`).
    """
    opt, metrics_fn = optimizer, None
    if value_optimizer is not None:
        opt = BUILDS.get_or_build(
            lambda: ("ppo_pair", value_key(optimizer), value_key(value_optimizer)),
            lambda: _pair_optimizer(optimizer, value_optimizer),
        )
        metrics_fn = _pair_grad_norms
    step = make_step(
        ppo_loss(settings),
        opt,
        options,
        metrics_fn=metrics_fn,
        batch_type=PPOBatch,
        cache_key=(
            "ppo",
            settings,
            read_policy_loss(settings),
            value_optimizer is not None,
        ),
    )
    if value_optimizer is None:
        return step
    return _PairStep(step)


class _PairStep(Step):
    """A two-optimiser PPO step: checks that `params` is a `(policy, value_model)` pair."""

    def __init__(self, inner: Step):
        self.__dict__.update(inner.__dict__)

    def __call__(self, params, opt_state, batch, **kwargs):
        if not (isinstance(params, tuple) and len(params) == 2):
            raise ValueError("with value_optimizer, params must be a (policy, value_model) pair")
        return super().__call__(params, opt_state, batch, **kwargs)
