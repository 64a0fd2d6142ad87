"""PPO step (policy + value), the rollout batch it consumes, and advantage computation."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PRNGKeyArray, PyTree

from ..losses import (
    AggregationMode,
    KLKind,
    aggregate_parts,
    gae,
    kl_penalty,
    kl_shaped_rewards,
    ppo_policy_loss,
    ppo_value_loss,
    safe_divide,
    whiten_advantages,
)
from ..ops import entropy_from_logits, logprobs_from_logits, masked_mean, masked_sum, previous_real_index
from ._accumulate import (
    accumulate_gradients,
    apply_optimizer,
    make_jitted,
    sums_to_means,
    vmap_model,
)
from ._state import combine

__all__ = ["PPOBatch", "token_values", "compute_advantages", "prepare_ppo_batch", "make_ppo_step"]


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


@eqx.filter_jit
def _prepare(model, reference, tokens, mask, completion_mask, scores, kl_coef, settings):
    gamma, lam, kl_kind, whiten = settings
    logits, values = _policy_and_values(model, None, tokens, mask, None)
    logp = jax.vmap(logprobs_from_logits)(logits, tokens, mask)
    ref_logits = vmap_model(reference, tokens, mask, None)
    ref_logp = jax.vmap(logprobs_from_logits)(ref_logits, tokens, mask)
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
) -> tuple[PPOBatch, dict[str, Float[Array, ""]]]:
    """Turn sampled sequences and their scores into a `PPOBatch` (one jitted pass).

    `model` is the `(policy, value_model)` pair (or one model returning
    `(logits, values)`), as used by `make_ppo_step`; `reference` the frozen reference
    policy. Computes the sampling policy's token log-probabilities, the token-aligned
    values and the reference log-probabilities, then `compute_advantages`.

    **Returns:** `(batch, stats)`; `stats` as `compute_advantages`.
    """
    coef = jnp.asarray(kl_coef, jnp.float32)
    return _prepare(
        model, reference, tokens, mask, completion_mask, scores.astype(jnp.float32), coef,
        (gamma, lam, kl_kind, whiten),
    )


def make_ppo_step(
    optimizer: optax.GradientTransformation,
    *,
    value_optimizer: optax.GradientTransformation | None = None,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    vf_coef: float = 0.1,
    vf_clip: float | None = 0.2,
    ent_coef: float = 0.0,
    mode: AggregationMode = "token-mean",
    constant: float | None = None,
    micro_batches: int = 1,
    donate: bool = True,
) -> Callable[..., tuple[PyTree, Any, dict]]:
    r"""Build the PPO update of the policy and the critic (Schulman et al. 2017; TRL `PPOTrainer`).

    $$\mathcal L = \mathrm{agg}\big(\ell^{\rm clip}_t\big) + c_v\,\mathrm{agg}\big(\ell^{V}_t\big) - c_e\,\mathrm{agg}\big(H_t\big)$$

    with `ppo_policy_loss` (clipped surrogate; `clip_eps_high` for clip-higher,
    `dual_clip`), `ppo_value_loss` (clipped at `vf_clip` around `batch.old_values`,
    includes the ½), the entropy $H_t$ of the policy's next-token distribution, and
    `agg` the aggregation `mode` over `batch.completion_mask`.

    Two layouts:

    - **one optimiser** (`value_optimizer=None`): `params` is a `(policy, value_model)`
      pair, or a single model returning `(logits [T, V], values [T])`; one optimiser
      state, one gradient clip over everything;
    - **two optimisers** (`value_optimizer` given): `params = (policy, value_model)`,
      `opt_state = (policy_opt_state, value_opt_state)`; each part is updated by its own
      optimiser (separately clipped).

    `frozen` has the same layout as `params` (a pair of frozen parts, or `None`).

    **Returns:** `step(params, opt_state, batch: PPOBatch, *, frozen=None, key=None) ->
    (params, opt_state, metrics)`, one `eqx.filter_jit` region. Metrics (masked means
    over the completion tokens): `loss`, `loss/policy`, `loss/value`, `policy/clipfrac`,
    `policy/approxkl`, `policy/entropy`, `policy/ratio`, `val/clipfrac`, `val/vpred`,
    `val/error`, `grad_norm` (and `grad_norm/policy`, `grad_norm/value` with two
    optimisers), `learning_rate`. The rollout metrics (`objective/kl`,
    `objective/scores`, ...) come from `compute_advantages` / `prepare_ppo_batch`.
    """

    def update(rest, params, opt_state):
        batch, frozen, key = rest
        if value_optimizer is not None and not isinstance(params, tuple):
            raise ValueError("with value_optimizer, params must be a (policy, value_model) pair")
        loss_mask = batch.completion_mask & batch.mask
        _, denom = aggregate_parts(
            jnp.zeros(loss_mask.shape, jnp.float32), loss_mask, mode=mode, constant=constant
        )

        def contribution(p, mb, k):
            m = mb.completion_mask & mb.mask
            logits, values = _policy_and_values(p, frozen, mb.tokens, mb.mask, k)
            logp = jax.vmap(logprobs_from_logits)(logits, mb.tokens, mb.mask)
            pg, stats = jax.vmap(
                lambda a, b, c, d: ppo_policy_loss(
                    a, b, c, d, clip_eps=clip_eps, clip_eps_high=clip_eps_high, dual_clip=dual_clip
                )
            )(logp, mb.old_logp, mb.advantages, m)
            vf, vclipped = jax.vmap(
                lambda a, b, c, d: ppo_value_loss(a, b, c, d, clip_eps=vf_clip)
            )(values, mb.old_values, mb.returns, m)
            ent = jax.vmap(entropy_from_logits)(logits, m)
            pg_term = safe_divide(aggregate_parts(pg, m, mode=mode, constant=constant)[0], denom)
            vf_term = safe_divide(aggregate_parts(vf, m, mode=mode, constant=constant)[0], denom)
            total = pg_term + vf_coef * vf_term
            if ent_coef != 0.0:
                ent_term = safe_divide(
                    aggregate_parts(ent, m, mode=mode, constant=constant)[0], denom
                )
                total = total - ent_coef * ent_term
            sg = jax.lax.stop_gradient
            n = jnp.sum(m).astype(jnp.float32)
            zero = jnp.zeros((), jnp.float32)
            sums = {
                "loss/policy": (sg(pg_term), zero),
                "loss/value": (sg(vf_term), zero),
                "policy/clipfrac": (masked_sum(stats["clipped"], m), n),
                "policy/approxkl": (sg(masked_sum(stats["approx_kl"], m)), n),
                "policy/ratio": (sg(masked_sum(stats["ratio"], m)), n),
                "policy/entropy": (sg(masked_sum(ent, m)), n),
                "val/clipfrac": (masked_sum(vclipped, m), n),
                "val/vpred": (sg(masked_sum(values, m)), n),
                "val/error": (sg(masked_sum(jnp.square(values - mb.returns), m)), n),
            }
            return total, (sums, {})

        loss, grads, sums, _ = accumulate_gradients(
            contribution, params, batch, micro_batches=micro_batches, key=key
        )
        if value_optimizer is None:
            params, opt_state, opt_metrics = apply_optimizer(optimizer, params, opt_state, grads)
        else:
            policy, value = params
            p_state, v_state = opt_state
            policy, p_state, pm = apply_optimizer(optimizer, policy, p_state, grads[0])
            value, v_state, vm = apply_optimizer(value_optimizer, value, v_state, grads[1])
            params, opt_state = (policy, value), (p_state, v_state)
            opt_metrics = {
                "grad_norm": optax.tree.norm(grads).astype(jnp.float32),
                "grad_norm/policy": pm["grad_norm"],
                "grad_norm/value": vm["grad_norm"],
            }
            if "learning_rate" in pm:
                opt_metrics["learning_rate"] = pm["learning_rate"]
        metrics = {"loss": loss, **sums_to_means(sums), **opt_metrics}
        return params, opt_state, metrics

    jitted = make_jitted(update, donate=donate)

    def step(
        params: PyTree,
        opt_state: Any,
        batch: PPOBatch,
        *,
        frozen: PyTree = None,
        key: PRNGKeyArray | None = None,
    ) -> tuple[PyTree, Any, dict]:
        return jitted((batch, frozen, key), params, opt_state)

    return step
