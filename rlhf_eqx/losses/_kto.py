r"""KTO, Kahneman-Tversky optimisation (Ethayarajh et al. 2024, "KTO: Model Alignment as
Prospect Theoretic Optimization"), on unpaired data: each example is one completion
labelled desirable or undesirable.

With $h = \log\pi_\theta(y|x) - \log\pi_{\rm ref}(y|x)$ the log-ratio of one example,
$\beta$ the temperature and $z_0$ the reference point (a batch estimate of
$\mathrm{KL}(\pi_\theta \| \pi_{\rm ref})$, held constant in the gradient), the loss of
one example is (paper eq. 7, TRL `KTOTrainer` `loss_type="kto"`)

$$\ell(x, y) = \begin{cases}
\lambda_D\,\big(1 - \sigma(\beta(h - z_0))\big) & y \text{ desirable}\\
\lambda_U\,\big(1 - \sigma(\beta(z_0 - h))\big) & y \text{ undesirable}
\end{cases}$$

and the batch loss is the mean over the examples. The reference point is
$z_0 = \max\big(0, \frac1n\sum_j \log\pi_\theta(y'_j|x_j) - \log\pi_{\rm ref}(y'_j|x_j)\big)$
over *mismatched* completions $y'_j$ (another example's completion after prompt $x_j$),
as TRL estimates it (`kto_reference_point`).

The per-example function is `kto_loss`; batch it with `jax.vmap`. Sequence
log-probabilities are sums over the completion tokens.
"""

from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

from ._validation import (
    Hyperparameter,
    check_choice,
    check_non_negative,
    check_positive,
    wide_float_dtype,
)
from .defaults import KTO_BETA, KTO_DESIRABLE_WEIGHT, KTO_LOSS_TYPE, KTO_UNDESIRABLE_WEIGHT

KTO_LOSS_TYPES: tuple[str, ...] = ("kto", "apo_zero_unpaired")
"""The `loss_type`s of `kto_loss` (TRL `KTOConfig.loss_type`)."""
KTOLossType = Literal[KTO_LOSS_TYPES]  # type: ignore[valid-type]


def kto_loss(
    logp: Float[ArrayLike, ""],
    ref_logp: Float[ArrayLike, ""],
    label: Bool[ArrayLike, ""],
    kl: Float[ArrayLike, ""] = 0.0,
    *,
    beta: Hyperparameter = KTO_BETA,
    desirable_weight: Hyperparameter = KTO_DESIRABLE_WEIGHT,
    undesirable_weight: Hyperparameter = KTO_UNDESIRABLE_WEIGHT,
    loss_type: KTOLossType = KTO_LOSS_TYPE,
) -> Float[Array, ""]:
    r"""Loss of one unpaired example (TRL `KTOTrainer.kto_loss`).

    With $h = \log\pi_\theta(y|x) - \log\pi_{\rm ref}(y|x)$, $z_0$ = `kl`,
    $\lambda_D$ / $\lambda_U$ the desirable / undesirable weights and $\sigma$ the
    logistic function:

    - `"kto"`: $\lambda_D\big(1 - \sigma(\beta(h - z_0))\big)$ for a desirable example,
      $\lambda_U\big(1 - \sigma(\beta(z_0 - h))\big)$ for an undesirable one. KTO,
      Ethayarajh et al. 2024 (eq. 7).
    - `"apo_zero_unpaired"`: $\lambda_D\big(1 - \sigma(\beta h)\big)$ for a desirable
      example, $\lambda_U\,\sigma(\beta h)$ for an undesirable one (no reference point).
      The unpaired form of APO-zero, D'Oosterlinck et al. 2024 (eq. 7).

    $1 - \sigma(u)$ is evaluated as $\sigma(-u)$: exact where $\sigma(u)$ rounds to 1,
    and finite with finite gradients for any finite input (log-probabilities of -1e4
    included).

    **Arguments:**

    - `logp`, `ref_logp`: policy and reference sequence log-probabilities of the
      completion (scalars; sums over the completion tokens).
    - `label`: true for a desirable example, false for an undesirable one.
    - `kl`: the reference point $z_0$, from `kto_reference_point` (which stops its
      gradient; any other value is differentiated as given). Unused by
      `"apo_zero_unpaired"`.
    - `beta`: $\beta > 0$ (TRL default 0.1).
    - `desirable_weight`, `undesirable_weight`: $\lambda_D, \lambda_U \ge 0$ (TRL
      defaults 1.0; the paper recommends
      $\lambda_D n_D / (\lambda_U n_U) \in [1, 4/3]$ for $n_D$ desirable and $n_U$
      undesirable examples).
    - `loss_type`: `"kto"` or `"apo_zero_unpaired"` (`KTO_LOSS_TYPES`).

    Hyperparameters may be JAX scalars, traced under `jax.jit` or `jax.vmap`; only
    Python numbers are range-checked.

    **Returns:** the scalar (weighted) loss of the example. TRL's batch loss is the mean
    of these over the batch's examples, desirable and undesirable together.
    """
    check_choice("loss_type", loss_type, KTO_LOSS_TYPES)
    check_positive("beta", beta)
    check_non_negative("desirable_weight", desirable_weight)
    check_non_negative("undesirable_weight", undesirable_weight)
    h = jnp.asarray(logp) - jnp.asarray(ref_logp)
    z = jnp.zeros_like(h) if loss_type == "apo_zero_unpaired" else jnp.asarray(kl).astype(h.dtype)
    desirable = desirable_weight * jax.nn.sigmoid(beta * (z - h))
    if loss_type == "kto":
        undesirable = undesirable_weight * jax.nn.sigmoid(beta * (h - z))
    else:
        undesirable = undesirable_weight * jax.nn.sigmoid(beta * h)
    return jnp.where(jnp.asarray(label), desirable, undesirable)


def kto_reference_point(
    kl_logp: Float[Array, " B"],
    ref_kl_logp: Float[Array, " B"],
    *,
    axis_name: str | None = None,
) -> Float[Array, ""]:
    r"""KTO's reference point $z_0$: the clamped batch-mean log-ratio of mismatched pairs.

    $$z_0 = \max\Big(0,\ \frac{1}{n}\sum_{j=1}^{n}
    \log\pi_\theta(y'_j|x_j) - \log\pi_{\rm ref}(y'_j|x_j)\Big)$$

    where $y'_j$ is another example's completion placed after prompt $x_j$ (TRL pairs
    prompt $j$ with the completion of example $j - 1$ of the batch). It estimates
    $\mathrm{KL}(\pi_\theta\|\pi_{\rm ref})$ (Ethayarajh et al. 2024, §4.1; TRL
    `KTOTrainer`, logged as `kl`) and is held constant: its gradient is stopped.

    **Arguments:**

    - `kl_logp`, `ref_kl_logp`: `[B]` policy and reference sequence log-probabilities of
      the mismatched completions.
    - `axis_name`: inside `jax.pmap` / `shard_map`, the device axis: the mean is taken
      over the examples of **every** device (TRL gathers the per-process means across
      processes), so $z_0$ is the same on each.

    **Returns:** the scalar $z_0 \ge 0$ (0 when `B` is 0), in float32 (float64 for
    float64 inputs).
    """
    # at least float32 (bfloat16 inputs are summed in float32), float64 kept as is
    dtype = wide_float_dtype(kl_logp, ref_kl_logp)
    diff = (kl_logp - ref_kl_logp).astype(dtype)
    total = jnp.sum(diff)
    count = jnp.asarray(diff.shape[0], dtype)
    if axis_name is not None:
        total, count = jax.lax.psum((total, count), axis_name)
    mean = total / jnp.maximum(count, 1.0)
    return jax.lax.stop_gradient(jnp.maximum(mean, 0.0))
