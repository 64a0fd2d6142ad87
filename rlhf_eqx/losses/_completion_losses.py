r"""Per-completion policy losses adopted after DAPO: CISPO (clipped stop-gradient weights),
GMPO (geometric mean of token ratios) and SAPO (soft sigmoid gate).

The conventions of `grpo_policy_loss`: `logp`, `old_logp` `[T]`, a scalar advantage, a mask
`[T]`; per-token loss and stats, 0 where masked.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

from ..ops import masked_mean
from ._policy_losses import Stats
from ._ppo import _check_clip, _clamped_log_ratio, _clip_flags, _masked_outputs
from ._validation import Hyperparameter, check_non_negative, check_positive
from .defaults import CISPO_EPS_HIGH, GMPO_CLIP, SAPO_TAU_NEG, SAPO_TAU_POS


def cispo_policy_loss(
    logp: Float[Array, " T"],
    old_logp: Float[Array, " T"],
    advantage: Float[ArrayLike, ""],
    mask: Bool[Array, " T"],
    *,
    clip_eps_low: Hyperparameter | None = None,
    clip_eps_high: Hyperparameter = CISPO_EPS_HIGH,
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
    check_non_negative("clip_eps_low", clip_eps_low)
    check_non_negative("clip_eps_high", clip_eps_high)
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
    stats = {"ratio": w, **_clip_flags(w.dtype, low_flag, w > high)}
    return _masked_outputs(loss, stats, mask)


def gmpo_policy_loss(
    logp: Float[Array, " T"],
    old_logp: Float[Array, " T"],
    advantage: Float[ArrayLike, ""],
    mask: Bool[Array, " T"],
    *,
    clip_eps: Hyperparameter = GMPO_CLIP,
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
    _check_clip(clip_eps, clip_eps_high)
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
        **_clip_flags(x.dtype, low, high),
    }
    return _masked_outputs(loss, stats, mask)


def sapo_policy_loss(
    logp: Float[Array, " T"],
    old_logp: Float[Array, " T"],
    advantage: Float[ArrayLike, ""],
    mask: Bool[Array, " T"],
    *,
    tau_pos: Hyperparameter = SAPO_TAU_POS,
    tau_neg: Hyperparameter = SAPO_TAU_NEG,
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
    check_positive("tau_pos", tau_pos)
    check_positive("tau_neg", tau_neg)
    w = jnp.exp(_clamped_log_ratio(logp, old_logp, mask))
    adv = jnp.asarray(advantage, dtype=logp.dtype)
    tau = jnp.where(adv > 0, jnp.asarray(tau_pos, logp.dtype), jnp.asarray(tau_neg, logp.dtype))
    s = jax.nn.sigmoid(tau * (w - 1.0))
    loss = -(4.0 / tau) * s * adv
    none = jnp.zeros_like(w, dtype=bool)
    stats = {"ratio": w, "gate": 4.0 * s * (1.0 - s) * w, **_clip_flags(w.dtype, none, none)}
    return _masked_outputs(loss, stats, mask)
