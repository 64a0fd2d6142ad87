"""PPO step (policy + value), the rollout batch it consumes, and advantage computation."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PRNGKeyArray, PyTree

from ..losses import (
    KL_KINDS,
    AggregationMode,
    KLKind,
    aggregate_parts,
    gae,
    kl_penalty,
    kl_shaped_rewards,
    ppo_policy_loss,
    ppo_value_loss,
    whiten_advantages,
)
from ..ops import (
    entropy_from_logits,
    logprobs_from_logits,
    masked_sum,
    previous_real_index,
)
from ._accumulate import vmap_model
from ._state import combine
from ._step import LossFn, NonFinite, Step, make_step
from ._validate import check_aggregation, check_choice, check_number


class PPOBatch(eqx.Module):
    """A PPO rollout, every per-token field aligned with the token it concerns.

    - `tokens`, `mask`, `completion_mask`: prompt + completion, real tokens, and the
      generated tokens (the actions).
    - `old_logp`: log-probability of each token under the policy that sampled it.
    - `old_values`: value of the state each token was sampled from (`token_values`).
    - `advantages`, `returns`: from `compute_advantages` (0 outside the completion).
    """

    tokens: Int[Array, "B T"]
    mask: Bool[Array, "B T"]
    completion_mask: Bool[Array, "B T"]
    old_logp: Float[Array, "B T"]
    old_values: Float[Array, "B T"]
    advantages: Float[Array, "B T"]
    returns: Float[Array, "B T"]


def token_values(values: Float[Array, " T"], mask: Bool[Array, " T"]) -> Float[Array, " T"]:
    """Align a critic's outputs with the tokens: `out[t] = values[prev(t)]`.

    A `ValueModel`'s `values[s]` is the value of the state after token `s`; token `t`
    is sampled from the state after the previous real token, so its value is read
    there (TRL `PPOTrainer`: `full_value[:, context_length - 1 : -1]`). 0 where `t` has
    no previous real token or is masked.
    """
    prev, has_prev = previous_real_index(mask)
    return jnp.where(mask & has_prev, values[prev], jnp.zeros_like(values))


def compute_advantages(
    scores: Float[Array, " B"],
    logp: Float[Array, "B T"],
    ref_logp: Float[Array, "B T"],
    values: Float[Array, "B T"],
    completion_mask: Bool[Array, "B T"],
    *,
    kl_coef: float | Float[Array, ""],
    gamma: float = 1.0,
    lam: float = 0.95,
    kl_kind: KLKind = "k1",
    whiten: bool = True,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"], dict[str, Float[Array, ""]]]:
    r"""PPO advantages of a rollout: KL-shaped per-token rewards → GAE → whitening.

    $$r_t = -\beta_{\rm KL}\,\mathrm{kl}_t + \mathbb 1[t = t_{\rm last}]\,s,\qquad
    (A, R) = \mathrm{GAE}_{\gamma,\lambda}(r, V),\qquad A \leftarrow \mathrm{whiten}(A)$$

    over the completion tokens (Ziegler et al. 2019; Ouyang et al. 2022; TRL
    `PPOTrainer`), with `kl_shaped_rewards`, `gae` and `whiten_advantages` (masked mean
    and variance over the whole batch). The returns are not whitened.

    **Arguments:** `scores` `[B]` (reward-model scores), `logp` / `ref_logp` `[B, T]`
    (token log-probabilities of the sampling policy and the reference), `values`
    `[B, T]` (token-aligned, see `token_values`), `completion_mask` `[B, T]`; `kl_coef`
    $\beta_{\rm KL}$, `gamma`, `lam`, `kl_kind` (see `kl_penalty`), `whiten`.

    **Returns:** `(advantages, returns, stats)` with the TRL metrics
    `objective/kl` (mean over sequences of the summed per-token KL), `objective/scores`,
    `objective/non_score_reward` (mean summed KL penalty) and `objective/rlhf_reward`.
    """
    m = completion_mask
    f32 = jnp.float32
    logp = logp.astype(f32)
    ref_logp = ref_logp.astype(f32)
    rewards = jax.vmap(
        lambda s, a, b, mi: kl_shaped_rewards(s, a, b, mi, kl_coef=kl_coef, kind=kl_kind)
    )(scores.astype(f32), logp, ref_logp, m)
    adv, ret = jax.vmap(lambda r, v, mi: gae(r, v, mi, gamma=gamma, lam=lam))(
        rewards, values.astype(f32), m
    )
    if whiten:
        adv = whiten_advantages(adv, m)
    kl = kl_penalty(logp, ref_logp, kind=kl_kind)
    seq_kl = masked_sum(kl, m, axis=-1)
    non_score = -jnp.asarray(kl_coef, f32) * jnp.mean(seq_kl)
    stats = {
        "objective/kl": jnp.mean(seq_kl),
        "objective/scores": jnp.mean(scores.astype(f32)),
        "objective/non_score_reward": non_score,
        "objective/rlhf_reward": jnp.mean(scores.astype(f32)) + non_score,
    }
    return adv, ret, stats


def _policy_and_values(model, frozen, tokens, mask, key):
    """`(logits [b, T, V], token-aligned values [b, T])` of a `(policy, value)` pair or of a
    combined model returning `(logits, values)`."""
    if isinstance(model, tuple):
        policy, value = model
        pf, vf = (None, None) if frozen is None else frozen
        kp, kv = (None, None) if key is None else tuple(jax.random.split(key))
        logits = vmap_model(combine(policy, pf), tokens, mask, kp)
        values = vmap_model(combine(value, vf), tokens, mask, kv)
    else:
        logits, values = vmap_model(combine(model, frozen), tokens, mask, key)
    values = jax.vmap(token_values)(values.astype(jnp.float32), mask)
    return logits, values


def _logprobs(logits, tokens, mask, temperature):
    return jax.vmap(lambda lg, t, m: logprobs_from_logits(lg, t, m, temperature=temperature))(
        logits, tokens, mask
    )


@eqx.filter_jit
def _prepare(model, reference, tokens, mask, completion_mask, scores, kl_coef, settings):
    gamma, lam, kl_kind, whiten, temperature = settings
    logits, values = _policy_and_values(model, None, tokens, mask, None)
    logp = _logprobs(logits, tokens, mask, temperature)
    ref_logits = vmap_model(reference, tokens, mask, None)
    ref_logp = _logprobs(ref_logits, tokens, mask, temperature)
    m = completion_mask & mask
    adv, ret, stats = compute_advantages(
        scores, logp, ref_logp, values, m,
        kl_coef=kl_coef, gamma=gamma, lam=lam, kl_kind=kl_kind, whiten=whiten,
    )
    zero = jnp.zeros_like(logp)
    batch = PPOBatch(
        tokens=tokens,
        mask=mask,
        completion_mask=m,
        old_logp=jnp.where(m, logp, zero),
        old_values=jnp.where(m, values, zero),
        advantages=adv,
        returns=ret,
    )
    return batch, stats


def prepare_ppo_batch(
    model: PyTree,
    reference: Callable[..., Float[Array, "T V"]],
    tokens: Int[Array, "B T"],
    mask: Bool[Array, "B T"],
    completion_mask: Bool[Array, "B T"],
    scores: Float[Array, " B"],
    *,
    kl_coef: float | Float[ArrayLike, ""],
    gamma: float = 1.0,
    lam: float = 0.95,
    kl_kind: KLKind = "k1",
    whiten: bool = True,
    temperature: float = 1.0,
) -> tuple[PPOBatch, dict[str, Float[Array, ""]]]:
    """Turn sampled sequences and their scores into a `PPOBatch` (one jitted pass).

    `model` is the `(policy, value_model)` pair (or one model returning
    `(logits, values)`), as used by `make_ppo_step`; `reference` the frozen reference
    policy. Computes the sampling policy's token log-probabilities and the reference's
    at the sampling `temperature` (logits / T, as `rlhf_eqx.generate` reports them, so
    an on-policy ratio is exactly 1), the token-aligned values, then
    `compute_advantages`. Pass the same `temperature` to `make_ppo_step`.

    **Returns:** `(batch, stats)`; `stats` as `compute_advantages`.
    """
    check_number("kl_coef", kl_coef, low=0.0)
    check_number("gamma", gamma, low=0.0, high=1.0)
    check_number("lam", lam, low=0.0, high=1.0)
    check_number("temperature", temperature, low=0.0, low_open=True)
    check_choice("kl_kind", kl_kind, KL_KINDS)
    coef = jnp.asarray(kl_coef, jnp.float32)
    return _prepare(
        model, reference, tokens, mask, completion_mask, scores.astype(jnp.float32), coef,
        (gamma, lam, kl_kind, whiten, float(temperature)),
    )


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
        logits, values = _policy_and_values(params, frozen, batch.tokens, batch.mask, key)
        logp = _logprobs(logits, batch.tokens, batch.mask, temperature)
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
        ent = jax.vmap(lambda lg, mk: entropy_from_logits(lg, mk, temperature=temperature))(
            logits, batch.mask
        )
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
    donate: bool = False,
    nonfinite: NonFinite = "skip",
    check_token_ids: int | None = None,
) -> Step:
    r"""Build the PPO update of the policy and the critic (Schulman et al. 2017; TRL `PPOTrainer`).

    $$\mathcal L = \mathrm{agg}\big(\ell^{\rm clip}_t\big) + c_v\,\mathrm{agg}\big(\ell^{V}_t\big) - c_e\,\mathrm{agg}\big(H_t\big)$$

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
    optimisers), `learning_rate`, `nonfinite`. The rollout metrics (`objective/kl`,
    `objective/scores`, ...) come from `compute_advantages` / `prepare_ppo_batch`.
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
