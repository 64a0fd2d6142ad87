"""Reward modelling: the Bradley-Terry pairwise loss."""

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from ._validation import (
    Hyperparameter,
    check_non_negative,
    check_python_number,
    is_python_number,
)
from .defaults import REWARD_CENTER_COEF, REWARD_MARGIN


def bradley_terry_loss(
    chosen_reward: Float[ArrayLike, ""],
    rejected_reward: Float[ArrayLike, ""],
    *,
    margin: Float[ArrayLike, ""] = REWARD_MARGIN,
    center_coef: Hyperparameter = REWARD_CENTER_COEF,
) -> Float[Array, ""]:
    r"""Bradley-Terry negative log-likelihood of one preference pair.

    $$\mathcal{L} = -\log\sigma\big(r_c - r_r - m\big) + \lambda_c\,(r_c + r_r)^2$$

    Bradley & Terry (1952); the reward-model loss of Ouyang et al. (2022), with the
    optional margin $m$ of Touvron et al. (2023, Llama 2) and the centring penalty
    $\lambda_c$ (`center_rewards_coefficient`) of Eisenstein et al. (2023). This is TRL's
    `RewardTrainer.compute_loss` for one pair (TRL averages over the batch, then adds
    `center_rewards_coefficient * mean((r_c + r_r)^2)`, which is the same batch mean).

    **Arguments:**

    - `chosen_reward`, `rejected_reward`: scalar rewards of the pair.
    - `margin`: scalar margin $m$ of this pair (e.g. from a rating difference: TRL's
      `margin` column, which the reward step passes as the settings' margin plus the
      batch's `PreferenceBatch.margins`); a Python number must be finite.
    - `center_coef`: $\lambda_c \geq 0$.

    **Returns:** the scalar loss.
    """
    rc = jnp.asarray(chosen_reward)
    rr = jnp.asarray(rejected_reward)
    check_python_number("margin", margin, math.isfinite, "a finite number")
    check_non_negative("center_coef", center_coef)
    loss = -jax.nn.log_sigmoid(rc - rr - margin)
    if not (is_python_number(center_coef) and center_coef == 0.0):
        loss = loss + center_coef * jnp.square(rc + rr)
    return loss
