r"""PPO: clipped policy loss, clipped value loss, generalised advantage estimation.

All functions take the per-token arrays of **one sequence** (`[T]`, the completion's
positions selected by `mask`) and return per-token values; reduce them over a batch
with `aggregate` (`"token-mean"` is TRL's `masked_mean`).
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from ..ops import masked_whiten
from ._validation import Hyperparameter, check_non_negative, check_python_number
from .defaults import PPO_CLIP_EPS, PPO_VF_CLIP_EPS

LOG_RATIO_CLAMP = 20.0
r"""The bound on $|\log\pi_\theta - \log\pi_{\rm old}|$ before the ratio is exponentiated
(veRL `compute_policy_loss`): the policy losses (`ppo_policy_loss`, `grpo_policy_loss`,
the registered ones) and the PPO step clip the log-ratio to $[-20, 20]$."""


def _zero_where_masked(x: Array, mask: Array) -> Array:
    return jnp.where(mask, x, jnp.zeros_like(x))


def _clamped_log_ratio(logp: Array, old_logp: Array, mask: Array) -> Array:
    """`clip(logp - old_logp, -20, 20)` at real positions, 0 elsewhere."""
    log_ratio = jnp.clip(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return _zero_where_masked(log_ratio, mask)


def _masked_outputs(
    loss: Array, stats: dict[str, Array], mask: Array
) -> tuple[Array, dict[str, Array]]:
    """A policy loss's `(per_token_loss, stats)` with every array 0 where `mask` is false."""
    return _zero_where_masked(loss, mask), {
        k: _zero_where_masked(v, mask) for k, v in stats.items()
    }


def _clip_flags(dtype, low: Array, high: Array) -> dict[str, Array]:
    """The stats `"clipped_low"`, `"clipped_high"` and `"clipped"` (either) as 1.0 / 0.0."""
    return {
        "clipped_low": low.astype(dtype),
        "clipped_high": high.astype(dtype),
        "clipped": (low | high).astype(dtype),
    }


def _clip_sides(
    ratio: Array,
    advantages: Array,
    clip_eps: Hyperparameter,
    clip_eps_high: Hyperparameter | None,
) -> tuple[Array, Array]:
    """Where `clipped_surrogate`'s clipped branch is active on the low side (ratio below
    `1 - clip_eps`, negative advantage) and on the high side (above `1 + clip_eps_high`,
    positive advantage), as TRL's clip ratios."""
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    low = (ratio < 1.0 - clip_eps) & (advantages < 0)
    high = (ratio > 1.0 + eps_high) & (advantages > 0)
    return low, high


def _check_clip(clip_eps: Hyperparameter, clip_eps_high: Hyperparameter | None) -> None:
    check_non_negative("clip_eps", clip_eps)
    check_non_negative("clip_eps_high", clip_eps_high)


def clipped_surrogate(
    ratio: Float[Array, "*T"],
    advantages: Float[Array, "*#T"],
    *,
    clip_eps: Hyperparameter = PPO_CLIP_EPS,
    clip_eps_high: Hyperparameter | None = None,
    ratio_max: Hyperparameter | None = None,
) -> tuple[Float[Array, "*T"], Bool[Array, "*T"]]:
    r"""Per-token clipped surrogate of PPO, given the importance ratios.

    $$\ell_t = -\min\big(\min(\rho_t, \rho_{\max})A_t,\;
      \mathrm{clip}(\rho_t, 1-\varepsilon, 1+\varepsilon_{\rm high})A_t\big)$$

    (Schulman et al. 2017, eq. 7; asymmetric clip-higher of DAPO, Yu et al. 2025; the
    bound $\rho_{\max}$ on the unclipped branch is TRL GRPO's `delta`). Shared by
    `ppo_policy_loss` and `grpo_policy_loss`.

    **Arguments:**

    - `ratio`: importance ratios $\rho_t$ (any shape).
    - `advantages`: advantages $A_t$, same shape or broadcastable to it (a scalar).
    - `clip_eps`: $\varepsilon$ (the low side); `clip_eps_high`: the high side (`None`:
      same as `clip_eps`); `ratio_max`: $\rho_{\max}$ (`None`: no bound).

    **Returns:** `(loss, clipped)`: the per-token loss and where the clipped branch is
    strictly larger (TRL/veRL clipfrac).
    """
    _check_clip(clip_eps, clip_eps_high)
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    unclipped = ratio if ratio_max is None else jnp.minimum(ratio, ratio_max)
    pg1 = -advantages * unclipped
    pg2 = -advantages * jnp.clip(ratio, 1.0 - clip_eps, 1.0 + eps_high)
    return jnp.maximum(pg1, pg2), pg2 > pg1


def ppo_policy_loss(
    logp: Float[Array, " T"],
    old_logp: Float[Array, " T"],
    advantages: Float[Array, " T"],
    mask: Bool[Array, " T"],
    *,
    clip_eps: Hyperparameter = PPO_CLIP_EPS,
    clip_eps_high: Hyperparameter | None = None,
    dual_clip: Hyperparameter | None = None,
) -> tuple[Float[Array, " T"], dict[str, Float[Array, " T"]]]:
    r"""Per-token clipped surrogate loss of PPO (Schulman et al. 2017, eq. 7).

    $$\rho_t = \exp(\log\pi_\theta(y_t) - \log\pi_{\rm old}(y_t)),\qquad
    \ell_t = \max\big(-A_t\rho_t,\;
      -A_t\,\mathrm{clip}(\rho_t, 1-\varepsilon_{\rm low}, 1+\varepsilon_{\rm high})\big)$$

    - `clip_eps_high` different from `clip_eps` gives the asymmetric "clip-higher" of
      DAPO (Yu et al. 2025); `None` means symmetric.
    - `dual_clip=c` ($c > 1$) additionally bounds the loss of negative-advantage tokens
      by $-cA_t$ (dual-clip PPO, Ye et al. 2020): $\ell_t = \min(\ell_t, -cA_t)$ where
      $A_t < 0$ (veRL `clip_ratio_c`).

    The log-ratio is clamped to $[-20, 20]$ before exponentiating, as veRL does. Same
    numbers as TRL `PPOTrainer` (`pg_loss_max`) and veRL `core_algos.compute_policy_loss`
    (before aggregation). Where the ratio has left the clip region in the direction the
    advantage pushes it, the gradient with respect to `logp` is exactly zero.

    **Arguments:**

    - `logp`: `[T]` current policy log-probabilities.
    - `old_logp`: `[T]` log-probabilities of the policy that sampled the tokens.
    - `advantages`: `[T]` per-token advantages (e.g. from `gae`, whitened).
    - `mask`: `[T]` positions that count.

    **Returns:** `(per_token_loss, stats)`, all `[T]` and 0 where masked; `stats` has
    `"ratio"`, `"clipped"` (1.0 where the clipped branch is active: TRL/veRL clipfrac),
    `"clipped_dual"` (1.0 where the dual clip is active; zeros without `dual_clip`),
    `"approx_kl"` ($\tfrac12(\log\rho)^2$, TRL's `approxkl`) and `"approx_kl_k3"`
    ($\rho - 1 - \log\rho$, the k3 estimator).
    """
    check_python_number("dual_clip", dual_clip, lambda c: c > 1.0, "> 1")
    log_ratio = _clamped_log_ratio(logp, old_logp, mask)
    ratio = jnp.exp(log_ratio)
    loss, clipped = clipped_surrogate(
        ratio, advantages, clip_eps=clip_eps, clip_eps_high=clip_eps_high
    )
    clipped = clipped.astype(loss.dtype)
    if dual_clip is not None:
        pg3 = -advantages * dual_clip
        negative = advantages < 0
        dual_active = negative & (loss > pg3)
        loss = jnp.where(negative, jnp.minimum(loss, pg3), loss)
        clipped_dual = dual_active.astype(loss.dtype)
    else:
        clipped_dual = jnp.zeros_like(loss)
    stats = {
        "ratio": ratio,
        "clipped": clipped,
        "clipped_dual": clipped_dual,
        "approx_kl": 0.5 * jnp.square(log_ratio),
        "approx_kl_k3": jnp.maximum(jnp.expm1(log_ratio) - log_ratio, 0.0),
    }
    return _masked_outputs(loss, stats, mask)


def ppo_value_loss(
    values: Float[Array, " T"],
    old_values: Float[Array, " T"],
    returns: Float[Array, " T"],
    mask: Bool[Array, " T"],
    *,
    clip_eps: Hyperparameter | None = PPO_VF_CLIP_EPS,
) -> tuple[Float[Array, " T"], Float[Array, " T"]]:
    r"""Per-token clipped value loss.

    $$\ell_t = \tfrac12\max\big((V_t - R_t)^2,\;
      (\mathrm{clip}(V_t, V^{\rm old}_t - \epsilon, V^{\rm old}_t + \epsilon) - R_t)^2\big)$$

    (OpenAI baselines PPO2; TRL `PPOTrainer` with `cliprange_value`; veRL `compute_value_loss`.)
    $\epsilon$ is `clip_eps`; `clip_eps=None` gives the unclipped $\tfrac12(V_t - R_t)^2$.

    **Returns:** `(per_token_loss, clipped)`, both `[T]`, 0 where masked; `clipped` is
    1.0 where the clipped branch is larger (TRL `val/clipfrac`).
    """
    check_non_negative("clip_eps", clip_eps)
    # masked entries may be NaN / inf: zeroed, so that no gradient passes through them
    values, old_values, returns = (
        _zero_where_masked(x, mask) for x in (values, old_values, returns)
    )
    l1 = jnp.square(values - returns)
    if clip_eps is None:
        loss = 0.5 * l1
        clipped = jnp.zeros_like(l1)
    else:
        v_clipped = jnp.clip(values, old_values - clip_eps, old_values + clip_eps)
        l2 = jnp.square(v_clipped - returns)
        loss = 0.5 * jnp.maximum(l1, l2)
        clipped = (l2 > l1).astype(l1.dtype)
    return _zero_where_masked(loss, mask), _zero_where_masked(clipped, mask)


def gae(
    rewards: Float[Array, " T"],
    values: Float[Array, " T"],
    mask: Bool[Array, " T"],
    *,
    gamma: Hyperparameter,
    lam: Hyperparameter,
) -> tuple[Float[Array, " T"], Float[Array, " T"]]:
    r"""Generalised advantage estimation (Schulman et al. 2016) over the real positions.

    $$\delta_t = r_t + \gamma V_{t'} - V_t,\qquad A_t = \delta_t + \gamma\lambda A_{t'}$$

    where $t'$ is the next *real* position after $t$ (masked positions are skipped, so
    padding anywhere — right, left or in between — is harmless) and $V = A = 0$ after the
    last real position. Returns $R_t = A_t + V_t$. Written as a reverse `jax.lax.scan`
    (PureJaxRL `_calculate_gae`); matches TRL `PPOTrainer`'s loop on right-padded
    sequences (whose padded values and rewards are zero). Special cases: $\lambda = 1$
    gives the discounted return minus $V_t$; $\lambda = 0$ the TD error $\delta_t$.

    **Arguments:**

    - `rewards`: `[T]` per-token rewards (e.g. `kl_shaped_rewards`).
    - `values`: `[T]` value estimates $V_t$.
    - `mask`: `[T]` real positions; values at other positions are never read.
    - `gamma`, `lam`: discount $\gamma$ and GAE $\lambda$.

    **Returns:** `(advantages, returns)`, both `[T]`, 0 where masked. A Python `gamma` or
    `lam` outside $[0, 1]$ (or not finite) raises `ValueError`; JAX arrays are taken as
    given.
    """
    for name, value in (("gamma", gamma), ("lam", lam)):
        check_python_number(name, value, lambda v: 0.0 <= v <= 1.0, "in [0, 1]")
    zero = jnp.zeros_like(rewards)
    r = jnp.where(mask, rewards, zero)
    v = jnp.where(mask, values, zero)

    def step(carry, x):
        next_value, next_adv = carry
        r_t, v_t, m_t = x
        delta = r_t + gamma * next_value - v_t
        adv = delta + (gamma * lam) * next_adv
        carry = (jnp.where(m_t, v_t, next_value), jnp.where(m_t, adv, next_adv))
        return carry, jnp.where(m_t, adv, jnp.zeros_like(adv))

    init = (jnp.zeros((), rewards.dtype), jnp.zeros((), rewards.dtype))
    _, advantages = jax.lax.scan(step, init, (r, v, mask), reverse=True)
    returns = jnp.where(mask, advantages + v, zero)
    return advantages, returns


def whiten_advantages(
    advantages: Float[Array, "*shape"],
    mask: Bool[Array, "*shape"],
    *,
    shift_mean: bool = True,
) -> Float[Array, "*shape"]:
    r"""Whiten advantages over every real position given (call it on the whole batch).

    $(A - \mu) / \sqrt{\sigma^2 + 10^{-8}}$ with the masked mean and unbiased variance
    (TRL `masked_whiten`, veRL `masked_whiten`); 0 where masked. `shift_mean=False`
    adds the mean back after scaling.
    """
    return masked_whiten(advantages, mask, shift_mean=shift_mean)
