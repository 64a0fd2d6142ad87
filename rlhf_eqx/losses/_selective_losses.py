r"""Policy losses that select tokens by statistics of the whole batch: Clip-Cov and KL-Cov
(token covariance of log-probability and advantage) and the high-entropy token loss.

All take `[B, T]` arrays with one advantage per row. With `axis_name` (inside `jax.pmap` /
`shard_map`) the statistics and the selection cover the tokens of every device, so a
data-parallel run selects the same tokens as one device holding the whole batch. The
selection carries no gradient.
"""

from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from ..ops import masked_mean
from ._grpo import IMPORTANCE_LEVELS, grpo_policy_loss
from ._policy_losses import COV_SELECTIONS, Stats, _check_fraction
from ._ppo import (
    _check_clip,
    _clamped_log_ratio,
    _clip_flags,
    _clip_sides,
    _masked_outputs,
    clipped_surrogate,
)
from ._validation import Hyperparameter, check_choice, check_non_negative
from .defaults import (
    CLIP_COV_HIGH,
    CLIP_COV_LOW,
    CLIP_COV_SELECT,
    COV_FRACTION,
    ENTROPY_RHO,
    GRPO_CLIP_EPS,
    GRPO_IMPORTANCE,
    KL_COV_COEF,
)


def _all_rows(x: Array, axis_name: str | None) -> Array:
    """`x` `[B, ...]` of every device, concatenated in device order (`x` itself without
    `axis_name`)."""
    return x if axis_name is None else jax.lax.all_gather(x, axis_name, tiled=True)


def _own_rows(x: Array, rows: int, axis_name: str | None) -> Array:
    """This device's `rows` rows of an `_all_rows` array."""
    if axis_name is None:
        return x
    start = jax.lax.axis_index(axis_name) * rows
    return jax.lax.dynamic_slice_in_dim(x, start, rows, axis=0)


def _top_k(priority: Array, candidate: Array, k: Array) -> Array:
    """The `k` candidates of largest priority (ties: the earlier position in row-major
    order); fewer when there are fewer candidates."""
    flat = jnp.where(candidate, priority, -jnp.inf).reshape(-1)
    order = jnp.argsort(-flat, stable=True)
    rank = jnp.zeros(flat.shape, jnp.int32).at[order].set(jnp.arange(flat.size, dtype=jnp.int32))
    return (rank < k).reshape(priority.shape) & candidate


def _count(fraction: Hyperparameter, mask: Array, dtype) -> Array:
    """$\\max(\\lfloor \\text{fraction}\\cdot n\\rfloor, 1)$ as int32, $n$ the real tokens in
    `mask`."""
    n = jnp.sum(mask).astype(dtype)
    return jnp.maximum(jnp.floor(fraction * n).astype(jnp.int32), 1)


def _token_covariance(
    logp: Array, adv: Array, mask: Array, axis_name: str | None
) -> tuple[Array, Array]:
    """$(A_t - \\bar A)(\\log\\pi_t - \\overline{\\log\\pi})$ of every device's rows, means over
    their real tokens (log-probabilities without gradient), and those rows' mask."""
    every_mask = _all_rows(mask, axis_name)
    logp = _all_rows(jnp.where(mask, jax.lax.stop_gradient(logp), 0.0), axis_name)
    adv = _all_rows(adv, axis_name)
    cov = (adv - masked_mean(adv, every_mask)) * (logp - masked_mean(logp, every_mask))
    return cov, every_mask


def _row_advantages(advantages: Array, like: Array) -> Array:
    return jnp.broadcast_to(advantages.astype(like.dtype)[:, None], like.shape)


def clip_cov_policy_loss(
    logp: Float[Array, "B T"],
    old_logp: Float[Array, "B T"],
    advantages: Float[Array, " B"],
    mask: Bool[Array, "B T"],
    *,
    clip_eps: Hyperparameter = GRPO_CLIP_EPS,
    clip_eps_high: Hyperparameter | None = None,
    fraction: Hyperparameter = COV_FRACTION,
    cov_low: Hyperparameter = CLIP_COV_LOW,
    cov_high: Hyperparameter = CLIP_COV_HIGH,
    select: Literal["random", "top"] = CLIP_COV_SELECT,
    key: PRNGKeyArray | None = None,
    axis_name: str | None = None,
) -> tuple[Float[Array, "B T"], Stats]:
    r"""Clip-Cov: PPO's clipped loss with the gradient of a few high-covariance tokens cut.

    Cui et al. (2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
    Language Models") relate the entropy drop to the covariance between a token's
    log-probability and its advantage, and estimate it per token over the batch:

    $$\mathrm{Cov}_t = \big(A_t - \bar A\big)\big(\log\pi_\theta(y_t) -
      \overline{\log\pi_\theta}\big)$$

    with both means over the batch's real tokens (log-probabilities without gradient).
    The candidates are the real tokens with $\mathrm{Cov}_t \in$ (`cov_low`, `cov_high`)
    whose PPO clip is not already active; $k = \max(\lfloor r N\rfloor, 1)$ of them ($N$
    real tokens, $r$ = `fraction`) are taken — uniformly at random with `select="random"`
    (the paper, veRL `compute_policy_loss_clip_cov`; needs `key`), or those of largest
    covariance with `select="top"` (deterministic) — and their loss is set to 0 (value
    and gradient, as veRL). Every other token has the clipped surrogate of
    `clipped_surrogate` with `clip_eps` / `clip_eps_high`. veRL's defaults:
    $r = 2\cdot10^{-4}$, bounds (1, 5); its aggregation `"token-mean"`.

    **Arguments:** `logp`, `old_logp`, `mask` `[B, T]`; `advantages` `[B]` (one per row);
    `axis_name`: inside `pmap` / `shard_map`, take $N$, the means and the selection over
    the tokens of every device (the random priorities are drawn per device, from its own
    `key`).

    **Returns:** `(per_token_loss, stats)`, all `[B, T]`, 0 where masked; `stats` has
    `"ratio"`, `"clipped_low"`, `"clipped_high"`, `"clipped"` (as `grpo_policy_loss`),
    `"selected"` (1.0 on the tokens whose loss was cut) and `"covariance"`.
    """
    check_choice("select", select, COV_SELECTIONS)
    _check_clip(clip_eps, clip_eps_high)
    _check_fraction("fraction", fraction)
    if select == "random" and key is None:
        raise ValueError("clip_cov_policy_loss(select='random') needs a key")
    dtype = logp.dtype
    rows = logp.shape[0]
    w = jnp.exp(_clamped_log_ratio(logp, old_logp, mask))
    adv = _row_advantages(advantages, logp)
    loss, ppo_clipped = clipped_surrogate(w, adv, clip_eps=clip_eps, clip_eps_high=clip_eps_high)

    cov, every_mask = _token_covariance(logp, adv, mask, axis_name)
    candidate = _all_rows(mask & ~ppo_clipped, axis_name) & (cov > cov_low) & (cov < cov_high)
    if select == "random":
        priority = _all_rows(jax.random.uniform(key, logp.shape, dtype), axis_name)
    else:
        priority = cov
    k = _count(fraction, every_mask, dtype)
    cut = _own_rows(_top_k(priority, candidate, k), rows, axis_name)
    loss = jnp.where(cut, jnp.zeros_like(loss), loss)
    stats = {
        "ratio": w,
        "covariance": _own_rows(cov, rows, axis_name),
        **_clip_flags(dtype, *_clip_sides(w, adv, clip_eps, clip_eps_high)),
        "selected": cut.astype(dtype),
    }
    return _masked_outputs(loss, stats, mask)


def kl_cov_policy_loss(
    logp: Float[Array, "B T"],
    old_logp: Float[Array, "B T"],
    advantages: Float[Array, " B"],
    mask: Bool[Array, "B T"],
    *,
    fraction: Hyperparameter = COV_FRACTION,
    kl_coef: Hyperparameter = KL_COV_COEF,
    axis_name: str | None = None,
) -> tuple[Float[Array, "B T"], Stats]:
    r"""KL-Cov: the unclipped policy gradient, with a KL penalty on the top-covariance tokens.

    $$\ell_t = -w_t A_t + \mathbb{1}[t \in I]\;\beta\,\big\lvert\log w_t\big\rvert$$

    (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
    Language Models"; veRL `compute_policy_loss_kl_cov`, whose penalty is
    $\lvert\log\pi_\theta - \log\pi_{\rm old}\rvert$), where $I$ holds the
    $k = \max(\lfloor rN\rfloor, 1)$ real tokens of largest covariance
    $(A_t - \bar A)(\log\pi_\theta(y_t) - \overline{\log\pi_\theta})$ over the batch's $N$
    real tokens (ties: the earlier position in row-major order). $r$ = `fraction`
    (veRL's default $2\cdot10^{-4}$), $\beta$ = `kl_coef` (default 1). `axis_name`: as
    `clip_cov_policy_loss`.

    **Returns:** `(per_token_loss, stats)`, all `[B, T]`, 0 where masked; `stats` has
    `"ratio"`, `"abs_log_ratio"`, `"selected"` (1.0 on $I$), `"covariance"` and
    `"clipped"`, `"clipped_low"`, `"clipped_high"` (zeros: nothing is clipped).
    """
    _check_fraction("fraction", fraction)
    check_non_negative("kl_coef", kl_coef)
    dtype = logp.dtype
    log_w = _clamped_log_ratio(logp, old_logp, mask)
    w = jnp.exp(log_w)
    adv = _row_advantages(advantages, logp)
    cov, every_mask = _token_covariance(logp, adv, mask, axis_name)
    k = _count(fraction, every_mask, dtype)
    chosen = _own_rows(_top_k(cov, every_mask, k), logp.shape[0], axis_name)
    abs_kl = jnp.abs(log_w)
    loss = -adv * w + jnp.where(chosen, kl_coef * abs_kl, jnp.zeros_like(abs_kl))
    none = jnp.zeros_like(chosen)
    stats = {
        "ratio": w,
        "abs_log_ratio": abs_kl,
        "selected": chosen.astype(dtype),
        "covariance": _own_rows(cov, logp.shape[0], axis_name),
        **_clip_flags(dtype, none, none),
    }
    return _masked_outputs(loss, stats, mask)


def entropy_quantile_mask(
    entropy: Float[Array, "B T"],
    mask: Bool[Array, "B T"],
    *,
    rho: Hyperparameter = ENTROPY_RHO,
    axis_name: str | None = None,
) -> Bool[Array, "B T"]:
    r"""The real tokens whose entropy is in the top `rho` fraction of the batch's.

    $H_t \geq \tau_\rho$, where $\tau_\rho$ is the $(1-\rho)$-quantile of the entropies of
    the batch's real tokens, linearly interpolated (`numpy.quantile`'s default; TRL
    `top_entropy_quantile`). Ties at the threshold are kept; `rho=1` keeps every real
    token. Wang et al. (2025, "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive
    Effective Reinforcement Learning for LLM Reasoning") use $\rho = 0.2$. With
    `axis_name` the quantile is over the tokens of every device. No gradient flows
    through the selection.
    """
    _check_fraction("rho", rho)
    g_mask = _all_rows(mask, axis_name)
    ent = _all_rows(jnp.where(mask, jax.lax.stop_gradient(entropy), 0.0), axis_name)
    n = jnp.sum(g_mask, dtype=jnp.int32)
    last = jnp.maximum(n - 1, 0)
    ordered = jnp.sort(jnp.where(g_mask, ent, jnp.inf).reshape(-1))
    pos = (1.0 - rho) * last.astype(ent.dtype)
    lo = jnp.minimum(jnp.floor(pos).astype(jnp.int32), last)
    hi = jnp.minimum(lo + 1, last)
    frac = pos - lo.astype(ent.dtype)
    v_lo, v_hi = ordered[lo], ordered[hi]
    threshold = jnp.where(n > 0, v_lo + frac * jnp.where(n > 0, v_hi - v_lo, 0.0), jnp.inf)
    return _own_rows(g_mask & (ent >= threshold), mask.shape[0], axis_name)


def high_entropy_policy_loss(
    logp: Float[Array, "B T"],
    old_logp: Float[Array, "B T"],
    advantages: Float[Array, " B"],
    mask: Bool[Array, "B T"],
    entropy: Float[Array, "B T"],
    *,
    rho: Hyperparameter = ENTROPY_RHO,
    clip_eps: Hyperparameter = GRPO_CLIP_EPS,
    clip_eps_high: Hyperparameter | None = None,
    importance: Literal["token", "sequence"] = GRPO_IMPORTANCE,
    delta: Hyperparameter | None = None,
    axis_name: str | None = None,
) -> tuple[Float[Array, "B T"], Stats]:
    r"""The clipped GRPO / DAPO loss on the high-entropy ("forking") tokens only.

    $$\ell_t = \mathbb{1}\big[H_t \geq \tau_\rho\big]\;\ell^{\rm GRPO}_t$$

    (Wang et al. 2025, "Beyond the 80/20 Rule": the policy gradient restricted to
    the top-$\rho$ entropy tokens of the batch, $\rho = 0.2$, on DAPO's clip-higher loss.)
    $\ell^{\rm GRPO}$ is `grpo_policy_loss` with `clip_eps`, `clip_eps_high`,
    `importance`, `delta`; the selection is `entropy_quantile_mask(entropy, mask, rho=rho,
    axis_name=axis_name)`. Other tokens have loss 0 and no gradient, but still count in
    the aggregation's denominator (the paper normalises by all tokens, `"token-mean"`):
    reduce with `aggregate(loss, mask, ...)`, not with the selection as the mask.

    **Returns:** `(per_token_loss, stats)`, all `[B, T]`, 0 where masked; `stats` are
    `grpo_policy_loss`'s and `"selected"` (1.0 on the kept tokens).
    """
    check_choice("importance", importance, IMPORTANCE_LEVELS)
    keep = entropy_quantile_mask(entropy, mask, rho=rho, axis_name=axis_name)
    loss, stats = jax.vmap(
        lambda lp, olp, a, m: grpo_policy_loss(
            lp,
            olp,
            a,
            m,
            clip_eps=clip_eps,
            clip_eps_high=clip_eps_high,
            importance=importance,
            delta=delta,
        )
    )(logp, old_logp, advantages.astype(logp.dtype), mask)
    stats = {**stats, "selected": keep.astype(logp.dtype)}
    return jnp.where(keep, loss, jnp.zeros_like(loss)), stats
