"""PPO step: the clipped policy loss, the clipped value loss and the entropy bonus."""

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from ..losses import (
    AggregationMode,
    aggregate_parts,
    ppo_policy_loss,
    ppo_value_loss,
)
from ..ops import masked_sum
from ._rollout import PPOBatch, policy_logps_and_values
from ._step import LossFn, NonFinite, Step, make_step
from ._validation import check_aggregation, check_number


def ppo_loss(
    *,
    clip_eps: float | Float[Array, ""] = 0.2,
    clip_eps_high: float | Float[Array, ""] | None = None,
    dual_clip: float | None = None,
    vf_coef: float | Float[Array, ""] = 0.1,
    vf_clip_eps: float | Float[Array, ""] | None = 0.2,
    ent_coef: float | Float[Array, ""] = 0.0,
    mode: AggregationMode = "token-mean",
    constant: float | None = None,
    temperature: float = 1.0,
) -> LossFn:
    r"""The PPO loss function (policy + value + entropy) for `make_step` on a `PPOBatch`.

    Numerators `policy`, `value` (× `vf_coef`) and `entropy` (× −`ent_coef`, when
    non-zero) share the aggregation denominator of `mode` over the completion tokens.
    """
    check_number("clip_eps", clip_eps, low=0.0, low_open=True)
    check_number("clip_eps_high", clip_eps_high, low=0.0, low_open=True, allow_none=True)
    check_number("dual_clip", dual_clip, low=1.0, low_open=True, allow_none=True)
    check_number("vf_coef", vf_coef, low=0.0)
    check_number("vf_clip_eps", vf_clip_eps, low=0.0, low_open=True, allow_none=True)
    check_number("ent_coef", ent_coef)
    check_number("temperature", temperature, low=0.0, low_open=True)
    check_aggregation(mode, constant)
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
        pg, stats = jax.vmap(
            lambda a, b, c, d: ppo_policy_loss(
                a, b, c, d, clip_eps=clip_eps, clip_eps_high=clip_eps_high, dual_clip=dual_clip
            )
        )(logp, batch.old_logp, batch.advantages, m)
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
            "policy/clipfrac": (masked_sum(stats["clipped"], m), n),
            "policy/approxkl": (masked_sum(stats["approx_kl"], m), n),
            "policy/ratio": (masked_sum(stats["ratio"], m), n),
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


def make_ppo_step(
    optimizer: optax.GradientTransformation,
    *,
    value_optimizer: optax.GradientTransformation | None = None,
    clip_eps: float | Float[Array, ""] = 0.2,
    clip_eps_high: float | Float[Array, ""] | None = None,
    dual_clip: float | None = None,
    vf_coef: float | Float[Array, ""] = 0.1,
    vf_clip_eps: float | Float[Array, ""] | None = 0.2,
    ent_coef: float | Float[Array, ""] = 0.0,
    mode: AggregationMode = "token-mean",
    constant: float | None = None,
    temperature: float = 1.0,
    micro_batches: int = 1,
    axis_name: str | None = None,
    donate: bool | None = None,
    nonfinite: NonFinite = "skip",
    check_token_ids: int | None = None,
) -> Step:
    r"""Build the PPO update of the policy and the critic (Schulman et al. 2017; TRL `PPOTrainer`).

    $$\mathcal L = \mathrm{agg}\big(\ell^{\rm clip}_t\big)
    + c_v\,\mathrm{agg}\big(\ell^{V}_t\big) - c_e\,\mathrm{agg}\big(H_t\big)$$

    with `ppo_policy_loss` (clipped surrogate; `clip_eps_high` for clip-higher,
    `dual_clip`), `ppo_value_loss` (clipped at `vf_clip_eps` around `batch.old_values`,
    includes the ½), the entropy $H_t$ of the distribution token $t$ was sampled from,
    and `agg` the aggregation `mode` over `batch.completion_mask`. Log-probabilities and
    entropies are taken at the sampling `temperature` (logits / T; TRL divides by
    `temperature` too), which must be the one the rollout was sampled at.

    Two layouts:

    - **one optimiser** (`value_optimizer=None`): `params` is a `(policy, value_model)`
      pair, or a single model returning `(logits [T, V], values [T])`; one optimiser
      state, one gradient clip over everything;
    - **two optimisers** (`value_optimizer` given): `params = (policy, value_model)`,
      `opt_state = (policy_opt_state, value_opt_state)`; each part is updated by its own
      optimiser (separately clipped).

    `frozen` has the same layout as `params` (a pair of frozen parts, or `None`).
    See `make_step` for `micro_batches`, `axis_name`, `donate`, `nonfinite`,
    `check_token_ids`. Invalid values raise `ValueError` here, at build time.

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
    loss_fn = ppo_loss(
        clip_eps=clip_eps,
        clip_eps_high=clip_eps_high,
        dual_clip=dual_clip,
        vf_coef=vf_coef,
        vf_clip_eps=vf_clip_eps,
        ent_coef=ent_coef,
        mode=mode,
        constant=constant,
        temperature=temperature,
    )
    opt, metrics_fn = optimizer, None
    if value_optimizer is not None:
        opt, metrics_fn = _pair_optimizer(optimizer, value_optimizer), _pair_grad_norms
    step = make_step(
        loss_fn,
        opt,
        micro_batches=micro_batches,
        axis_name=axis_name,
        donate=donate,
        nonfinite=nonfinite,
        check_token_ids=check_token_ids,
        metrics_fn=metrics_fn,
        batch_type=PPOBatch,
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
