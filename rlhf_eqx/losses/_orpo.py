r"""ORPO, odds-ratio preference optimisation (Hong et al. 2024): the log odds ratio of
per-token average log-probabilities and the pair loss (NLL plus the odds-ratio term).

The formulas follow TRL's `ORPOTrainer.odds_ratio_loss`.
"""

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Real

from ._validation import Hyperparameter
from .defaults import DPO_BETA

# Largest average log-probability fed to log(1 - p) in ORPO (keeps it finite at p = 1).
_ORPO_MAX_AVG_LOGP = -1e-7


def per_token_logp(logp: Array, length: Real[ArrayLike, "*B"] | None) -> Array:
    """`logp / max(length, 1)`, the per-token average (`logp` itself if `length` is None)."""
    if length is None:
        return logp
    n = jnp.asarray(length).astype(logp.dtype)
    return logp / jnp.maximum(n, 1.0)


def _log1mexp(x: Array) -> Array:
    """`log(1 - exp(x))` for `x < 0`, stable on both sides of `-ln 2`."""
    x = jnp.minimum(x, _ORPO_MAX_AVG_LOGP)
    small = x < -math.log(2.0)
    return jnp.where(
        small,
        jnp.log1p(-jnp.exp(jnp.where(small, x, -1.0))),
        jnp.log(-jnp.expm1(jnp.where(small, -1.0, x))),
    )


def orpo_log_odds(
    chosen_avg_logp: Float[ArrayLike, ""], rejected_avg_logp: Float[ArrayLike, ""]
) -> Float[Array, ""]:
    r"""ORPO's log odds ratio $\log\frac{\mathrm{odds}(y_w)}{\mathrm{odds}(y_l)}$ of averages.

    $$\bar\ell_w - \bar\ell_l - \big(\log(1 - e^{\bar\ell_w}) - \log(1 - e^{\bar\ell_l})\big)$$

    (Hong et al. 2024, eq. 4-6; TRL `ORPOTrainer.odds_ratio_loss`). $\log(1-e^x)$ is
    evaluated stably; averages above -1e-7 are clamped there so that it stays finite.
    """
    lw = jnp.asarray(chosen_avg_logp)
    ll = jnp.asarray(rejected_avg_logp)
    return (lw - ll) - (_log1mexp(lw) - _log1mexp(ll))


def orpo_loss(
    chosen_logp: Float[ArrayLike, ""],
    rejected_logp: Float[ArrayLike, ""],
    *,
    chosen_len: Real[ArrayLike, ""],
    rejected_len: Real[ArrayLike, ""],
    beta: Hyperparameter = DPO_BETA,
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    r"""ORPO (Hong et al. 2024): supervised NLL of the chosen completion plus $\lambda$ times
    the odds-ratio loss, for one pair.

    $$\mathcal{L} = \underbrace{-\bar\ell_w}_{\rm nll}
      \;\underbrace{-\,\lambda\log\sigma(\log\mathrm{OR})}_{\rm or}$$

    with $\bar\ell = \ell / |y|$ the per-token average log-probabilities and
    $\log\mathrm{OR}$ from `orpo_log_odds`. `beta` is $\lambda$ (TRL `ORPOConfig.beta`).
    The NLL here is the pair's token mean; TRL's is the token mean over the whole batch,
    which `aggregate(sft_nll(...), mode="token-mean")` reproduces if needed.

    **Returns:** `(loss, parts)` with `parts` holding `"nll"`, `"or_loss"` (the
    $\lambda$-weighted term), `"log_odds"` and `"ratio"` ($\log\sigma(\log\mathrm{OR})$).
    """
    c = jnp.asarray(chosen_logp)
    r = jnp.asarray(rejected_logp)
    lw = per_token_logp(c, chosen_len)
    ll = per_token_logp(r, rejected_len)
    log_odds = orpo_log_odds(lw, ll)
    ratio = jax.nn.log_sigmoid(log_odds)
    nll = -lw
    or_loss = -beta * ratio
    parts = {"nll": nll, "or_loss": or_loss, "log_odds": log_odds, "ratio": ratio}
    return nll + or_loss, parts
