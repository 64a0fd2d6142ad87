r"""Policy losses adopted after DAPO, and an adaptive entropy coefficient.

- Per completion (the conventions of `grpo_policy_loss`: `logp`, `old_logp` `[T]`, a scalar
  advantage, a mask `[T]`; per-token loss and stats, 0 where masked): `cispo_policy_loss`,
  `gmpo_policy_loss`, `sapo_policy_loss`.
- Per batch (they select tokens by statistics of the whole batch): `clip_cov_policy_loss`,
  `kl_cov_policy_loss`, `high_entropy_policy_loss` (with its selection
  `entropy_quantile_mask`), all on `[B, T]` arrays with one advantage per row. With
  `axis_name` (inside `jax.pmap` / `shard_map`) the statistics and the selection cover the
  tokens of every device, so a data-parallel run selects the same tokens as one device
  holding the whole batch. The selection carries no gradient.
- `adaptive_entropy_coef`: a pure update of an entropy-bonus coefficient towards a target
  entropy.

Every log-ratio $\log\pi_\theta - \log\pi_{\rm old}$ is clamped to $[-20, 20]$ before it is
exponentiated (as `grpo_policy_loss`), so extreme log-probabilities give finite losses and
gradients. Hyperparameters may be Python numbers (checked eagerly) or JAX scalars (traced).
"""

from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, PRNGKeyArray

from ..ops import masked_mean
from ._grpo import IMPORTANCE_LEVELS, grpo_policy_loss
from ._ppo import LOG_RATIO_CLAMP, clipped_surrogate
from ._validation import Hyperparameter, check_choice, check_python_number

POLICY_LOSSES: tuple[str, ...] = (
    "grpo",
    "cispo",
    "gmpo",
    "sapo",
    "clip_cov",
    "kl_cov",
    "high_entropy",
)
"""The policy losses of the GRPO step (`make_grpo_step(policy_loss=...)`): `"grpo"` is
`grpo_policy_loss`; the others are the functions of this module."""
PolicyLoss = Literal[POLICY_LOSSES]  # type: ignore[valid-type]
COV_SELECTIONS: tuple[str, ...] = ("random", "top")
"""How `clip_cov_policy_loss` picks among its candidate tokens (`select`)."""
BATCH_POLICY_LOSSES: tuple[str, ...] = ("clip_cov", "kl_cov", "high_entropy")
"""The entries of `POLICY_LOSSES` whose token selection depends on the whole batch."""

Stats = dict[str, Float[Array, "..."]]


def _clamped_log_ratio(logp: Array, old_logp: Array, mask: Array) -> Array:
    """`clip(logp - old_logp, -20, 20)` at real positions, 0 elsewhere."""
    log_ratio = jnp.clip(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return jnp.where(mask, log_ratio, jnp.zeros_like(log_ratio))


def _masked(stats: Stats, mask: Array) -> Stats:
    return {k: jnp.where(mask, v, jnp.zeros_like(v)) for k, v in stats.items()}


def _flags(dtype, **flags: Array) -> Stats:
    return {k: v.astype(dtype) for k, v in flags.items()}


def _check_non_negative(name: str, value: object) -> None:
    check_python_number(name, value, lambda v: v >= 0.0, "non-negative")


def _check_fraction(name: str, value: object) -> None:
    check_python_number(name, value, lambda v: 0.0 < v <= 1.0, "in (0, 1]")


# --- per completion ----------------------------------------------------------------------


def cispo_policy_loss(
    logp: Float[Array, " T"],
    old_logp: Float[Array, " T"],
    advantage: Float[ArrayLike, ""],
    mask: Bool[Array, " T"],
    *,
    clip_eps_low: Hyperparameter | None = None,
    clip_eps_high: Hyperparameter = 4.0,
) -> tuple[Float[Array, " T"], Stats]:
    r"""CISPO: REINFORCE weighted by a clipped, stop-gradient importance weight.

    $$\ell_t = -\,\mathrm{sg}\big[\mathrm{clip}(w_t,\,1-\varepsilon_{\rm low},\,
      1+\varepsilon_{\rm high})\big]\,A\,\log\pi_\theta(y_t),\qquad
      w_t = \frac{\pi_\theta(y_t)}{\pi_{\rm old}(y_t)}$$

    (MiniMax-M1, MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with
    Lightning Attention"; veRL `compute_policy_loss_cispo`; TRL
    `loss_type="cispo"`.) The gradient is $-\hat w_t A\,\nabla\log\pi_\theta(y_t)$ for every
    token, however far its weight was clipped: unlike PPO's clip, no token is dropped.

    - `clip_eps_low`: $\varepsilon_{\rm low}$; `None` (default) puts no lower bound on
      $w_t$, as the paper does.
    - `clip_eps_high`: $\varepsilon_{\rm high}$; the default 4.0 bounds $w_t$ by 5, the
      $\varepsilon_{\max}$ of ScaleRL (Khatri et al. 2025) that TRL recommends (TRL's
      `cispo` clamps $w_t$ at `epsilon_high` itself).

    The paper aggregates over every token of the group (`"token-mean"` of `aggregate`).

    **Returns:** `(per_token_loss, stats)`, all `[T]`, 0 where masked; `stats` has
    `"ratio"` ($w_t$), `"clipped_low"`, `"clipped_high"` (1.0 where $w_t$ is below /
    above the bounds, whatever the advantage's sign) and `"clipped"` (either).
    """
    _check_non_negative("clip_eps_low", clip_eps_low)
    _check_non_negative("clip_eps_high", clip_eps_high)
    w = jnp.exp(_clamped_log_ratio(logp, old_logp, mask))
    high = 1.0 + clip_eps_high
    if clip_eps_low is None:
        w_hat = jnp.minimum(w, high)
        low_flag = jnp.zeros_like(w, dtype=bool)
    else:
        w_hat = jnp.clip(w, 1.0 - clip_eps_low, high)
        low_flag = w < 1.0 - clip_eps_low
    adv = jnp.asarray(advantage, dtype=logp.dtype)
    loss = -jax.lax.stop_gradient(w_hat) * adv * logp
    high_flag = w > high
    stats = {
        "ratio": w,
        **_flags(
            w.dtype, clipped_low=low_flag, clipped_high=high_flag, clipped=low_flag | high_flag
        ),
    }
    return jnp.where(mask, loss, jnp.zeros_like(loss)), _masked(stats, mask)


def gmpo_policy_loss(
    logp: Float[Array, " T"],
    old_logp: Float[Array, " T"],
    advantage: Float[ArrayLike, ""],
    mask: Bool[Array, " T"],
    *,
    clip_eps: Hyperparameter = 0.4,
    clip_eps_high: Hyperparameter | None = None,
) -> tuple[Float[Array, " T"], Stats]:
    r"""GMPO: the geometric mean of token ratios, clipped per token in log space.

    The sequence objective of Zhao et al. (2025, "Geometric-Mean Policy Optimization") is

    $$\mathcal{L} = -A\,\exp\Big(\frac{1}{|y|}\sum_t c_t\Big),\qquad
      c_t = \begin{cases} \min(\log w_t,\ \varepsilon_{\rm high}) & A > 0\\
      \max(\log w_t,\ -\varepsilon_{\rm low}) & A < 0 \\ \log w_t & A = 0\end{cases}$$

    i.e. $\big(\prod_t \min(w_t A, \mathrm{clip}(w_t, e^{-\varepsilon_{\rm low}},
    e^{\varepsilon_{\rm high}})A)\big)^{1/|y|}$ up to the sign of $A$ (veRL
    `compute_policy_loss_geo_mean`). The paper's default range is $(e^{-0.4}, e^{0.4})$:
    $\varepsilon_{\rm low} = \varepsilon_{\rm high} = 0.4$ (`clip_eps`, and `clip_eps_high`
    `None` for the same). Per token it is written in the form of GSPO
    (`grpo_policy_loss(importance="sequence")`):

    $$\ell_t = -A\,\exp\big(\mathrm{sg}[\bar c] + c_t - \mathrm{sg}[c_t]\big),
      \qquad \bar c = \frac{1}{|y|}\sum_t c_t,$$

    so every token carries the value $\mathcal{L}$ and the gradient
    $-A e^{\bar c}\,\nabla c_t$; the token mean of $\ell$ over the completion has exactly
    the value and gradient of $\mathcal{L}$. Hence `"seq-mean-token-mean"` aggregation
    reproduces the paper (its mean over completions; fully masked completions are left
    out of `aggregate`'s count), while `"token-mean"` weights completions by length. A
    token whose ratio is clipped on the side the advantage pushes gets no gradient.

    **Returns:** `(per_token_loss, stats)`, all `[T]`, 0 where masked; `stats` has
    `"ratio"` ($e^{\bar c}$, the clipped geometric-mean ratio, on every real token),
    `"clipped_low"` ($A < 0$ and $\log w_t < -\varepsilon_{\rm low}$), `"clipped_high"`
    ($A > 0$ and $\log w_t > \varepsilon_{\rm high}$) and `"clipped"` (either).
    """
    _check_non_negative("clip_eps", clip_eps)
    _check_non_negative("clip_eps_high", clip_eps_high)
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    sg = jax.lax.stop_gradient
    x = _clamped_log_ratio(logp, old_logp, mask)
    adv = jnp.asarray(advantage, dtype=logp.dtype)
    c = jnp.where(adv < 0, jnp.maximum(x, -clip_eps), x)
    c = jnp.where(adv > 0, jnp.minimum(x, eps_high), c)
    mean_c = masked_mean(c, mask)
    loss = -adv * jnp.exp(sg(mean_c) + c - sg(c))
    low = (adv < 0) & (x < -clip_eps)
    high = (adv > 0) & (x > eps_high)
    stats = {
        "ratio": jnp.broadcast_to(jnp.exp(mean_c), x.shape),
        **_flags(x.dtype, clipped_low=low, clipped_high=high, clipped=low | high),
    }
    return jnp.where(mask, loss, jnp.zeros_like(loss)), _masked(stats, mask)


def sapo_policy_loss(
    logp: Float[Array, " T"],
    old_logp: Float[Array, " T"],
    advantage: Float[ArrayLike, ""],
    mask: Bool[Array, " T"],
    *,
    tau_pos: Hyperparameter = 1.0,
    tau_neg: Hyperparameter = 1.05,
) -> tuple[Float[Array, " T"], Stats]:
    r"""SAPO: a soft, temperature-controlled sigmoid gate in place of the hard clip.

    $$\ell_t = -f(w_t)\,A,\qquad f(w) = \frac{4}{\tau}\,\sigma\big(\tau(w - 1)\big),
      \qquad \tau = \begin{cases}\tau_{\rm pos} & A > 0\\ \tau_{\rm neg} & A \leq 0\end{cases}$$

    (Gao et al. 2025, Qwen, "Soft Adaptive Policy Optimization", arXiv:2511.20347; TRL
    `loss_type="sapo"`.) The gradient is $-4\,\sigma(1-\sigma)\,w_t\,A\,\nabla\log\pi_\theta$:
    exactly the policy gradient on-policy ($w = 1$), decaying smoothly as $w$ leaves 1.
    The paper takes $\tau_{\rm neg} > \tau_{\rm pos}$ (1.05 and 1.0) so that updates of
    negative-advantage tokens decay faster. Its objective averages the tokens of each
    completion, then the completions (`"seq-mean-token-mean"`).

    **Returns:** `(per_token_loss, stats)`, all `[T]`, 0 where masked; `stats` has
    `"ratio"` ($w_t$), `"gate"` (the weight $4\sigma(1-\sigma)w_t$ of
    $-A\nabla\log\pi_\theta$) and `"clipped"`, `"clipped_low"`, `"clipped_high"` (zeros:
    nothing is hard-clipped).
    """
    check_python_number("tau_pos", tau_pos, lambda t: t > 0.0, "positive")
    check_python_number("tau_neg", tau_neg, lambda t: t > 0.0, "positive")
    w = jnp.exp(_clamped_log_ratio(logp, old_logp, mask))
    adv = jnp.asarray(advantage, dtype=logp.dtype)
    tau = jnp.where(adv > 0, jnp.asarray(tau_pos, logp.dtype), jnp.asarray(tau_neg, logp.dtype))
    s = jax.nn.sigmoid(tau * (w - 1.0))
    loss = -(4.0 / tau) * s * adv
    zero = jnp.zeros_like(w)
    stats = {
        "ratio": w,
        "gate": 4.0 * s * (1.0 - s) * w,
        "clipped": zero,
        "clipped_low": zero,
        "clipped_high": zero,
    }
    return jnp.where(mask, loss, zero), _masked(stats, mask)


# --- per batch ---------------------------------------------------------------------------


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


def _count(fraction: Hyperparameter, n: Array) -> Array:
    """$\\max(\\lfloor \\text{fraction}\\cdot n\\rfloor, 1)$ as int32."""
    return jnp.maximum(jnp.floor(fraction * n).astype(jnp.int32), 1)


def _token_covariance(logp: Array, adv: Array, mask: Array) -> Array:
    """$(A_t - \\bar A)(\\log\\pi_t - \\overline{\\log\\pi})$, means over the real tokens."""
    return (adv - masked_mean(adv, mask)) * (logp - masked_mean(logp, mask))


def _row_advantages(advantages: Array, like: Array) -> Array:
    return jnp.broadcast_to(advantages.astype(like.dtype)[:, None], like.shape)


def clip_cov_policy_loss(
    logp: Float[Array, "B T"],
    old_logp: Float[Array, "B T"],
    advantages: Float[Array, " B"],
    mask: Bool[Array, "B T"],
    *,
    clip_eps: Hyperparameter = 0.2,
    clip_eps_high: Hyperparameter | None = None,
    fraction: Hyperparameter = 2e-4,
    cov_low: Hyperparameter = 1.0,
    cov_high: Hyperparameter = 5.0,
    select: Literal["random", "top"] = "random",
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
    _check_non_negative("clip_eps", clip_eps)
    _check_non_negative("clip_eps_high", clip_eps_high)
    _check_fraction("fraction", fraction)
    if select == "random" and key is None:
        raise ValueError("clip_cov_policy_loss(select='random') needs a key")
    sg = jax.lax.stop_gradient
    dtype = logp.dtype
    rows = logp.shape[0]
    w = jnp.exp(_clamped_log_ratio(logp, old_logp, mask))
    adv = _row_advantages(advantages, logp)
    loss, ppo_clipped = clipped_surrogate(w, adv, clip_eps=clip_eps, clip_eps_high=clip_eps_high)
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high

    every = lambda x: _all_rows(x, axis_name)
    g_mask = every(mask)
    cov = _token_covariance(every(jnp.where(mask, sg(logp), 0.0)), every(adv), g_mask)
    candidate = every(mask & ~ppo_clipped) & (cov > cov_low) & (cov < cov_high)
    if select == "random":
        priority = every(jax.random.uniform(key, logp.shape, dtype))
    else:
        priority = cov
    k = _count(fraction, jnp.sum(g_mask).astype(dtype))
    cut = _own_rows(_top_k(priority, candidate, k), rows, axis_name)
    loss = jnp.where(cut | ~mask, jnp.zeros_like(loss), loss)
    low = (w < 1.0 - clip_eps) & (adv < 0)
    high = (w > 1.0 + eps_high) & (adv > 0)
    stats = {
        "ratio": w,
        "covariance": _own_rows(cov, rows, axis_name),
        **_flags(dtype, clipped_low=low, clipped_high=high, clipped=low | high, selected=cut),
    }
    return loss, _masked(stats, mask)


def kl_cov_policy_loss(
    logp: Float[Array, "B T"],
    old_logp: Float[Array, "B T"],
    advantages: Float[Array, " B"],
    mask: Bool[Array, "B T"],
    *,
    fraction: Hyperparameter = 2e-4,
    kl_coef: Hyperparameter = 1.0,
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
    _check_non_negative("kl_coef", kl_coef)
    sg = jax.lax.stop_gradient
    dtype = logp.dtype
    log_w = _clamped_log_ratio(logp, old_logp, mask)
    w = jnp.exp(log_w)
    adv = _row_advantages(advantages, logp)
    every = lambda x: _all_rows(x, axis_name)
    g_mask = every(mask)
    cov = _token_covariance(every(jnp.where(mask, sg(logp), 0.0)), every(adv), g_mask)
    k = _count(fraction, jnp.sum(g_mask).astype(dtype))
    chosen = _own_rows(_top_k(cov, g_mask, k), logp.shape[0], axis_name)
    abs_kl = jnp.abs(log_w)
    loss = -adv * w + jnp.where(chosen, kl_coef * abs_kl, jnp.zeros_like(abs_kl))
    zero = jnp.zeros_like(w)
    stats = {
        "ratio": w,
        "abs_log_ratio": abs_kl,
        "selected": chosen.astype(dtype),
        "covariance": _own_rows(cov, logp.shape[0], axis_name),
        "clipped": zero,
        "clipped_low": zero,
        "clipped_high": zero,
    }
    return jnp.where(mask, loss, zero), _masked(stats, mask)


def entropy_quantile_mask(
    entropy: Float[Array, "B T"],
    mask: Bool[Array, "B T"],
    *,
    rho: Hyperparameter = 0.2,
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
    rho: Hyperparameter = 0.2,
    clip_eps: Hyperparameter = 0.2,
    clip_eps_high: Hyperparameter | None = None,
    importance: Literal["token", "sequence"] = "token",
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


# --- entropy bonus -----------------------------------------------------------------------


def adaptive_entropy_coef(
    coef: Float[ArrayLike, ""],
    entropy: Float[ArrayLike, ""],
    *,
    target: Hyperparameter,
    lr: Hyperparameter,
    max_coef: Hyperparameter | None = None,
) -> Float[Array, ""]:
    r"""One update of an entropy-bonus coefficient that steers the entropy to a target.

    $$\alpha \leftarrow \mathrm{clip}\big(\alpha + \eta\,(H_{\rm target} - H),\;
      0,\; \alpha_{\max}\big)$$

    An integral controller: the coefficient of the bonus $-\alpha H$ grows while the
    policy's entropy $H$ is below the target and shrinks (never below 0) above it — the
    automatic temperature of SAC (Haarnoja et al. 2018, "Soft Actor-Critic Algorithms
    and Applications", there on $\log\alpha$) and the adaptive entropy control of
    Skywork-OR1 (He et al. 2025). Pure and jittable: a run keeps `coef` as state, passes
    it to the step that applies the bonus (`make_grpo_step`'s step takes
    `entropy_coef=`), and updates it from the step's `entropy` metric:

    ```python
    coef = jnp.asarray(0.0)
    for batch in batches:
        params, opt_state, m = step(params, opt_state, batch, entropy_coef=coef)
        coef = adaptive_entropy_coef(coef, m["entropy"], target=0.3, lr=1e-3)
    ```

    **Arguments:** `coef` $\alpha$; `entropy` $H$ (the measured mean token entropy);
    `target` $H_{\rm target}$; `lr` $\eta \geq 0$; `max_coef` $\alpha_{\max}$ (`None`: no
    upper bound).

    **Returns:** the new coefficient, a float32 scalar.
    """
    _check_non_negative("lr", lr)
    _check_non_negative("max_coef", max_coef)
    f32 = jnp.float32
    new = jnp.asarray(coef, f32) + lr * (target - jnp.asarray(entropy, f32))
    new = jnp.maximum(new, 0.0)
    return new if max_coef is None else jnp.minimum(new, max_coef)
