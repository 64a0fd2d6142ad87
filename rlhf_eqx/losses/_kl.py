r"""KL estimators, KL-shaped rewards and the KL-coefficient controllers.

The per-token estimators of $\mathrm{KL}(\pi_\theta \,\|\, \pi_{\rm ref})$ from samples of
$\pi_\theta$ follow Schulman, "Approximating KL Divergence" (2020), with
$\log r = \log\pi_{\rm ref}(y_t) - \log\pi_\theta(y_t)$.
"""

from typing import Literal

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

from ._validation import Hyperparameter, check_choice, check_non_negative, check_positive

KL_KINDS: tuple[str, ...] = ("k1", "k2", "k3", "abs")
"""The per-token KL estimators of `kl_penalty`."""
KLKind = Literal[KL_KINDS]  # type: ignore[valid-type]
# Bound on |log r| before exponentiating in k3 (veRL `kl_penalty` low_var_kl clamps at 20).
_K3_LOGR_CLAMP = 20.0


def kl_penalty(
    logp: Float[Array, "*T"],
    ref_logp: Float[Array, "*T"],
    *,
    kind: KLKind = "k1",
    clamp: Hyperparameter | None = None,
) -> Float[Array, "*T"]:
    r"""Per-token KL estimator between the policy and the reference.

    With $\log r = \log\pi_{\rm ref} - \log\pi_\theta$ (tokens sampled from $\pi_\theta$):

    | `kind` | estimator | veRL name | unbiased | $\geq 0$ |
    | --- | --- | --- | --- | --- |
    | `"k1"` | $-\log r$ | `kl` | yes | no |
    | `"k2"` | $\tfrac12(\log r)^2$ | `mse` | no | yes |
    | `"k3"` | $e^{\log r} - \log r - 1$ | `low_var_kl` | yes | yes |
    | `"abs"` | $\lvert\log r\rvert$ | `abs` | no | yes |

    (Schulman 2020; TRL PPO/RLOO `kl_estimator="k1"|"k3"`; TRL GRPO's KL term is k3;
    veRL `core_algos.kl_penalty`.) For k3, $\log r$ is clamped to $[-20, 20]$ before
    exponentiating, as veRL does, so the estimate is finite for any log-probabilities.
    `clamp=c` clips the result to $[-c, c]$ (veRL clips `low_var_kl` at 10).

    Works on any shape (one sequence `[T]`, or a batch); zero where `logp == ref_logp`,
    hence zero at masked positions of `token_logprobs` outputs.
    """
    check_choice("kind", kind, KL_KINDS)
    log_r = ref_logp - logp
    if kind == "k1":
        kl = -log_r
    elif kind == "k2":
        kl = 0.5 * jnp.square(log_r)
    elif kind == "k3":
        lr = jnp.clip(log_r, -_K3_LOGR_CLAMP, _K3_LOGR_CLAMP)
        # expm1(x) - x is exact near 0, where exp(x) - x - 1 cancels catastrophically.
        kl = jnp.maximum(jnp.expm1(lr) - lr, 0.0)
    else:
        kl = jnp.abs(log_r)
    if clamp is not None:
        kl = jnp.clip(kl, -clamp, clamp)
    return kl


def kl_shaped_rewards(
    score: Float[ArrayLike, ""],
    logp: Float[Array, " T"],
    ref_logp: Float[Array, " T"],
    mask: Bool[Array, " T"],
    *,
    kl_coef: Hyperparameter,
    kind: KLKind = "k1",
) -> Float[Array, " T"]:
    r"""Per-token PPO rewards: a KL penalty on every token and the score on the last one.

    $$r_t = -\beta_{\rm KL}\,\mathrm{kl}_t + \mathbb{1}[t = t_{\rm last}]\; s$$

    for the real (`mask`) positions, 0 elsewhere; $t_{\rm last}$ is the last real
    position. Ziegler et al. (2019); Ouyang et al. (2022); TRL `PPOTrainer` (`rewards =
    -kl_coef * kl`, then `rewards[actual_end] += scores`). A fully-masked sequence gets
    no reward at all.

    **Arguments:**

    - `score`: the scalar reward-model score of the sequence.
    - `logp`, `ref_logp`: `[T]` token log-probabilities of the policy (at sampling time)
      and the reference.
    - `mask`: `[T]`, true on the completion's real tokens.
    - `kl_coef`: $\beta_{\rm KL} \geq 0$ (a float or the controller's `coef`).
    - `kind`: KL estimator (see `kl_penalty`).
    """
    check_non_negative("kl_coef", kl_coef)
    (T,) = mask.shape
    zero = jnp.zeros_like(logp)
    # zeroed where masked: a NaN there would reach the gradient through the estimator
    kl = kl_penalty(jnp.where(mask, logp, zero), jnp.where(mask, ref_logp, zero), kind=kind)
    rewards = jnp.where(mask, -kl_coef * kl, jnp.zeros_like(kl))
    idx = jnp.arange(T)
    last = jnp.max(jnp.where(mask, idx, -1))
    score = jnp.asarray(score, dtype=rewards.dtype)
    return rewards + jnp.where(idx == last, score, jnp.zeros_like(rewards))


class KLControllerState(eqx.Module):
    """Current KL coefficient $\\beta_{\\rm KL}$ of a PPO run (updates return a new state)."""

    coef: Float[Array, ""]

    def __init__(self, coef: Float[ArrayLike, ""]):
        self.coef = jnp.asarray(coef, dtype=jnp.float32)


def adaptive_kl_update(
    state: KLControllerState,
    current_kl: Float[ArrayLike, ""],
    n_steps: int | Float[ArrayLike, ""],
    *,
    target: Hyperparameter,
    horizon: Hyperparameter,
) -> KLControllerState:
    r"""Adaptive KL controller of Ziegler et al. (2019, eq. 2).

    $$e = \mathrm{clip}\Big(\frac{\mathrm{KL}}{\mathrm{KL}_{\rm target}} - 1,\; -0.2,\; 0.2\Big),
      \qquad
    \beta \leftarrow \beta\,\Big(1 + e\,\frac{n_{\rm steps}}{H}\Big)$$

    as TRL's `AdaptiveKLController.update` (`n_steps` = samples in the batch, $H$ =
    `horizon`). `target` and `horizon` must be positive (a Python number that is not
    raises `ValueError`). Pure: returns the new state.
    """
    check_positive("target", target)
    check_positive("horizon", horizon)
    kl = jnp.asarray(current_kl, dtype=jnp.float32)
    err = jnp.clip(kl / target - 1.0, -0.2, 0.2)
    n = jnp.asarray(n_steps).astype(jnp.float32)
    return KLControllerState(state.coef * (1.0 + err * n / horizon))


def fixed_kl_update(
    state: KLControllerState,
    current_kl: Float[ArrayLike, ""],
    n_steps: int | Float[ArrayLike, ""],
) -> KLControllerState:
    """Fixed KL controller (TRL `FixedKLController`): the coefficient never changes.

    Same signature as `adaptive_kl_update` minus its hyperparameters, so the two are
    interchangeable in a training loop.
    """
    del current_kl, n_steps
    return state
