r"""Group-relative policy optimisation and its relatives (GRPO, Dr.GRPO, DAPO, GSPO, RLOO,
REINFORCE++): advantages computed from groups of sampled completions, and the clipped
policy loss of one completion.
"""

from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

from ..ops import masked_mean, masked_whiten
from ._aggregate import safe_divide
from ._kl import kl_penalty
from ._ppo import LOG_RATIO_CLAMP, _clip_flags, _clip_sides, _masked_outputs, clipped_surrogate, gae
from ._validation import Hyperparameter, check_choice, check_non_negative, is_python_number
from .defaults import GRPO_BETA, GRPO_CLIP_EPS, GRPO_IMPORTANCE, GRPO_SCALE

ADVANTAGE_SCALES: tuple[str, ...] = ("group", "batch", "none")
"""The `scale`s of `group_advantages`."""
IMPORTANCE_LEVELS: tuple[str, ...] = ("token", "sequence")
"""The `importance` levels of `grpo_policy_loss`."""


def _std(x: Array, axis: int | None) -> Array:
    """Unbiased standard deviation (as `torch.std`), 0 for a single element.

    Gradient-safe at zero variance (a group of identical rewards).
    """
    keepdims = axis is not None
    n = x.size if axis is None else x.shape[axis]
    if n < 2:
        return jnp.zeros_like(jnp.mean(x, axis=axis, keepdims=keepdims))
    var = jnp.var(x, axis=axis, ddof=1, keepdims=keepdims)
    positive = var > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, var, 1.0)), 0.0)


def _centred(rewards: Array) -> Array:
    """`r - mean(r)` over the last axis, exactly 0 for groups of identical rewards."""
    centred = rewards - jnp.mean(rewards, axis=-1, keepdims=True)
    same = jnp.all(rewards == rewards[..., :1], axis=-1, keepdims=True)
    return jnp.where(same, jnp.zeros_like(centred), centred)


def group_advantages(
    rewards: Float[Array, "*batch G"],
    *,
    scale: Literal["group", "batch", "none"] = GRPO_SCALE,
    eps: Hyperparameter = 1e-4,
) -> Float[Array, "*batch G"]:
    r"""Group-relative advantages of the $G$ completions sampled for each prompt.

    $$A_i = \frac{r_i - \mathrm{mean}(r_{\rm group})}{\sigma + \epsilon}$$

    - `scale="group"`: $\sigma$ = standard deviation of the group (GRPO, Shao et al. 2024,
      "DeepSeekMath"; TRL `scale_rewards="group"`);
    - `scale="batch"`: $\sigma$ = standard deviation over *all* rewards given (TRL
      `scale_rewards="batch"`; the REINFORCE++-baseline of Hu 2025) — call it on the
      whole `[N, G]` batch, not under `vmap` over groups;
    - `scale="none"`: no division (Dr.GRPO, Liu et al. 2025, "Understanding R1-Zero-Like
      Training").

    Standard deviations are unbiased (Bessel-corrected, as `torch.std` in TRL) and
    $\epsilon$ is added to $\sigma$ (TRL `GRPOTrainer`: `advantages / (std + 1e-4)`). A
    group of identical rewards, and a group of one, gets exactly zero advantages (and zero
    gradient), `eps=0` included.

    **Arguments:**

    - `rewards`: `[..., G]` rewards, the last axis being the group.
    - `scale`: see above.
    - `eps`: $\epsilon \geq 0$.

    **Returns:** advantages of the same shape.
    """
    check_choice("scale", scale, ADVANTAGE_SCALES)
    check_non_negative("eps", eps)
    centred = _centred(rewards)
    if scale == "none":
        return centred
    std = _std(rewards, axis=-1 if scale == "group" else None)
    # The denominator is 0 only for zero spread with eps=0, where `centred` is exactly 0.
    return safe_divide(centred, jnp.broadcast_to(std + eps, centred.shape))


def rloo_advantages(rewards: Float[Array, "*batch G"]) -> Float[Array, "*batch G"]:
    r"""REINFORCE leave-one-out advantages (Ahmadian et al. 2024, "Back to Basics").

    $$A_i = r_i - \frac{1}{G-1}\sum_{j \neq i} r_j = \frac{G}{G-1}\,(r_i - \bar r)$$

    (Kool et al. 2019; TRL `RLOOTrainer`: `baseline = (sum - r) / (k - 1)`). Needs
    $G \geq 2$; the last axis is the group. Groups of identical rewards get exactly 0.
    """
    G = rewards.shape[-1]
    if G < 2:
        raise ValueError(f"RLOO needs at least 2 samples per group, got G={G}")
    total = jnp.sum(rewards, axis=-1, keepdims=True)
    adv = rewards - (total - rewards) / (G - 1)
    same = jnp.all(rewards == rewards[..., :1], axis=-1, keepdims=True)
    return jnp.where(same, jnp.zeros_like(adv), adv)


def reinforce_pp_advantages(
    token_rewards: Float[Array, "B T"],
    mask: Bool[Array, "B T"],
    *,
    gamma: Hyperparameter = 1.0,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    r"""REINFORCE++ advantages (Hu 2025): per-token discounted returns, whitened over the batch.

    $$G_t = \sum_{s \geq t} \gamma^{s-t} r_s,\qquad A = \mathrm{whiten}_{\rm batch}(G)$$

    where the sum runs over real positions only and the whitening uses the mean and
    unbiased variance of all real positions of the batch (veRL
    `compute_reinforce_plus_plus_outcome_advantage`). `token_rewards` are usually KL-shaped
    rewards (`kl_shaped_rewards`). Operates on the whole batch (it is not per-sample).

    **Returns:** `(advantages, returns)`, both `[B, T]`, 0 where masked.
    """
    zeros = jnp.zeros_like(token_rewards)
    _, returns = jax.vmap(lambda r, v, m: gae(r, v, m, gamma=gamma, lam=1.0))(
        token_rewards, zeros, mask
    )
    return masked_whiten(returns, mask), returns


def grpo_policy_loss(
    logp: Float[Array, " T"],
    old_logp: Float[Array, " T"],
    advantage: Float[ArrayLike, ""],
    mask: Bool[Array, " T"],
    *,
    clip_eps: Hyperparameter = GRPO_CLIP_EPS,
    clip_eps_high: Hyperparameter | None = None,
    importance: Literal["token", "sequence"] = GRPO_IMPORTANCE,
    ref_logp: Float[Array, " T"] | None = None,
    beta: Hyperparameter = GRPO_BETA,
    delta: Hyperparameter | None = None,
) -> tuple[Float[Array, " T"], dict[str, Float[Array, " T"]]]:
    r"""Per-token clipped policy loss of one completion with a sequence-level advantage.

    $$\ell_t = -\min\big(w_t A,\;
      \mathrm{clip}(w_t, 1-\varepsilon_{\rm low}, 1+\varepsilon_{\rm high})A\big)
      + \beta\,\mathrm{KL}^{(k3)}_t$$

    - `importance="token"`: $w_t = \pi_\theta(y_t)/\pi_{\rm old}(y_t)$ (GRPO, Shao et al.
      2024; TRL `GRPOTrainer` `importance_sampling_level="token"`).
    - `importance="sequence"`: GSPO (Zheng et al. 2025): the sequence ratio
      $s = \exp\big(\frac{1}{|y|}\sum_t \log\frac{\pi_\theta(y_t)}{\pi_{\rm old}(y_t)}\big)$, in
      the token form of the paper
      $w_t = \mathrm{sg}[s]\cdot\pi_\theta(y_t)/\mathrm{sg}[\pi_\theta(y_t)]$:
      every token carries the value $s$ and the gradient $s\,\nabla\log\pi_\theta(y_t)$,
      which after `"seq-mean-token-mean"` aggregation is exactly the gradient of TRL's
      `importance_sampling_level="sequence"`.
    - $\varepsilon_{\rm low}$ is `clip_eps`, $\varepsilon_{\rm high}$ is `clip_eps_high`
      (`None`: same as `clip_eps`); a larger high side is DAPO's clip-higher (Yu et al.
      2025; TRL `epsilon_high`). The clipping is PPO's (`clipped_surrogate`).
    - `delta`: upper bound on $w_t$ in the unclipped branch (two-sided clipping, TRL
      `delta`), `None` to disable.
    - $\beta > 0$ adds the k3 KL to `ref_logp` (TRL's `beta`; `kl_penalty(kind="k3")`).

    Log-ratios are clamped to $[-20, 20]$ before exponentiating. Reduce with `aggregate`:
    `"seq-mean-token-mean"` (GRPO), `"token-mean"` (DAPO / TRL `bnpo`),
    `"seq-mean-token-sum-norm"` (Dr.GRPO).

    **Arguments:**

    - `logp`, `old_logp`: `[T]` current and sampling-time log-probabilities.
    - `advantage`: the completion's scalar advantage (e.g. from `group_advantages`).
    - `mask`: `[T]` completion tokens that count (see `mask_truncated`).
    - `ref_logp`: `[T]` reference log-probabilities (needed when `beta != 0`).

    **Returns:** `(per_token_loss, stats)`, all `[T]`, 0 where masked; `stats` has
    `"ratio"` ($w_t$), `"clipped_low"`, `"clipped_high"`, `"clipped"` (1.0 where the
    clipped branch is active on the low / high side, as TRL's clip ratios) and `"kl"`
    (k3 to the reference; zeros without `ref_logp`).
    """
    check_choice("importance", importance, IMPORTANCE_LEVELS)
    if ref_logp is None and not (is_python_number(beta) and beta == 0.0):
        raise ValueError("beta != 0 needs ref_logp")
    zero = jnp.zeros_like(logp)
    log_ratio = jnp.where(mask, logp - old_logp, zero)
    if importance == "token":
        log_w = jnp.clip(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    else:
        seq = jnp.clip(masked_mean(log_ratio, mask), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        log_w = jax.lax.stop_gradient(seq) + logp - jax.lax.stop_gradient(logp)
        log_w = jnp.where(mask, log_w, zero)
    adv = jnp.asarray(advantage, dtype=logp.dtype)
    w = jnp.exp(log_w)
    loss, _ = clipped_surrogate(
        w, adv, clip_eps=clip_eps, clip_eps_high=clip_eps_high, ratio_max=delta
    )
    kl = (
        zero
        if ref_logp is None
        # zeroed where masked: a NaN there would reach the gradient of `logp`
        else kl_penalty(jnp.where(mask, logp, zero), jnp.where(mask, ref_logp, zero), kind="k3")
    )
    if not (is_python_number(beta) and beta == 0.0):
        loss = loss + beta * kl
    low, high = _clip_sides(w, adv, clip_eps, clip_eps_high)
    stats = {"ratio": w, **_clip_flags(logp.dtype, low, high), "kl": kl}
    return _masked_outputs(loss, stats, mask)


def mask_truncated(
    completion_mask: Bool[Array, " T"], truncated: Bool[ArrayLike, ""]
) -> Bool[Array, " T"]:
    """Overlong filtering (DAPO, Yu et al. 2025; TRL `mask_truncated_completions`).

    Returns an all-false mask for a completion that was cut at the length limit (no EOS),
    so it contributes nothing to the loss, and `completion_mask` unchanged otherwise.
    With the aggregation modes of `aggregate`, such rows are also left out of every
    denominator.
    """
    return completion_mask & ~jnp.asarray(truncated)
