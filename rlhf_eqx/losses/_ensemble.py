r"""Combining the scores of a reward-model ensemble into one conservative reward."""

from typing import Literal

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from ._validation import Hyperparameter, check_choice, check_non_negative

ENSEMBLE_MODES: tuple[str, ...] = ("std", "var", "min", "mean")
"""The `mode`s of `conservative_reward`."""
EnsembleMode = Literal[ENSEMBLE_MODES]  # type: ignore[valid-type]


def conservative_reward(
    member_scores: Float[ArrayLike, " K"],
    *,
    penalty: Hyperparameter = 0.0,
    mode: EnsembleMode = "std",
) -> Float[Array, ""]:
    r"""One reward from the scores $r_1, \dots, r_K$ that $K$ ensemble members give a sequence.

    With $\bar r = \frac1K\sum_k r_k$ and the population variance
    $\sigma^2 = \frac1K\sum_k (r_k - \bar r)^2$:

    - `"std"`: $\bar r - \lambda\,\sigma$;
    - `"var"`: $\bar r - \lambda\,\sigma^2$ (uncertainty-weighted optimisation, UWO);
    - `"min"`: $\min_k r_k$ (worst-case optimisation, WCO; `penalty` unused);
    - `"mean"`: $\bar r$.

    Coste et al. (2024), "Reward Model Ensembles Help Mitigate Overoptimization": a
    policy optimised against a conservative ensemble reward exploits the errors of any
    single reward model less. The standard deviation is gradient-safe where every
    member agrees ($\sigma = 0$ gives a zero gradient, not NaN).

    **Arguments:**

    - `member_scores`: `[K]` the members' scores of one sequence.
    - `penalty`: $\lambda \geq 0$.
    - `mode`: one of the modes above.

    **Returns:** the scalar reward. No member (`K = 0`) raises `ValueError`.
    """
    check_choice("mode", mode, ENSEMBLE_MODES)
    check_non_negative("penalty", penalty)
    r = jnp.asarray(member_scores)
    if r.shape[-1:] == (0,):
        raise ValueError("member_scores is empty: an ensemble has at least one member")
    if mode == "min":
        return jnp.min(r)
    mean = jnp.mean(r)
    if mode == "mean":
        return mean
    var = jnp.mean(jnp.square(r - mean))
    if mode == "var":
        return mean - penalty * var
    positive = var > 0
    std = jnp.where(positive, jnp.sqrt(jnp.where(positive, var, jnp.ones_like(var))), 0.0)
    return mean - penalty * std
