r"""Process reward models: a verdict on every reasoning step, read at the step separators.

A process reward model (PRM; Lightman et al. 2023, "Let's Verify Step by Step";
Uesato et al. 2022) reads a solution whose steps each end with a separator token and
outputs, at every separator, the logit $z_s$ of "step $s$ is correct". It is trained
with a binary cross-entropy at the separator positions only (`process_reward_loss`),
and its per-step scores $p_s = \sigma(z_s)$ become rewards: per token at the separator
positions for PPO's GAE (`process_token_rewards`) or one per sequence for GRPO
(`process_sequence_reward`: the minimum, the last, or the mean step score).
"""

from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from ..ops import masked_mean
from ._validation import check_choice

PRM_AGGREGATIONS: tuple[str, ...] = ("min", "last", "mean")
"""The `aggregation`s of `process_sequence_reward`."""
PRMAggregation = Literal[PRM_AGGREGATIONS]  # type: ignore[valid-type]


def process_reward_loss(
    logits: Float[Array, " T"],
    step_mask: Bool[Array, " T"],
    step_labels: Float[Array, " T"] | Bool[Array, " T"],
) -> Float[Array, " T"]:
    r"""Per-token binary cross-entropy of a process reward model, at the step separators.

    $$\ell_t = -\big[y_t \log\sigma(z_t) + (1 - y_t)\log\sigma(-z_t)\big]\quad
    \text{where } m_t,\qquad \ell_t = 0 \text{ elsewhere}$$

    with $z_t$ the model's logit at position $t$ (a per-token scalar head, e.g.
    `rlhf_eqx.ValueModel`), $m_t$ true at the separator that ends each step and $y_t$
    the step's label (Lightman et al. 2023; the stepwise-supervision loss of TRL's
    `PRMTrainer`, whose two-class token head is this loss on the logit difference).
    Computed with `log_sigmoid`, so logits of ±1e4 give finite values and gradients.
    Reduce a batch with `aggregate(per_token, step_mask, mode=...)` (`"token-mean"`: the
    mean over every step of the batch).

    **Arguments:**

    - `logits`: `[T]` logits $z_t$ (values off the steps are ignored, even if NaN).
    - `step_mask`: `[T]`, true at the separator positions that carry a label.
    - `step_labels`: `[T]` labels $y_t$: booleans (step correct), or probabilities in
      $[0, 1]$ (soft labels, e.g. Monte-Carlo estimates of Wang et al. 2024,
      Math-Shepherd); read at the steps only.

    **Returns:** `[T]` per-token losses, 0 off the steps.
    """
    z = jnp.where(step_mask, logits, jnp.zeros_like(logits))
    y = jnp.where(step_mask, step_labels.astype(z.dtype), jnp.zeros_like(z))
    loss = -(y * jax.nn.log_sigmoid(z) + (1.0 - y) * jax.nn.log_sigmoid(-z))
    return jnp.where(step_mask, loss, jnp.zeros_like(loss))


def process_token_rewards(
    step_scores: Float[Array, " T"], step_mask: Bool[Array, " T"]
) -> Float[Array, " T"]:
    r"""Per-token rewards from per-step scores: $r_t = p_t$ at the step ends, 0 elsewhere.

    Each step's score is placed on the token that ends the step (its separator), so
    that a per-token return (PPO's GAE) credits the tokens of step $s$ with the scores of
    steps $s, s+1, \dots$ (the step-level rewards of Wang et al. 2024, Math-Shepherd).

    **Arguments:** `step_scores` `[T]` (e.g. $\sigma(z_t)$ of a PRM; values off the
    steps are ignored), `step_mask` `[T]` (the step ends).

    **Returns:** `[T]` rewards.
    """
    return jnp.where(step_mask, step_scores, jnp.zeros_like(step_scores))


def process_sequence_reward(
    step_scores: Float[Array, " T"],
    step_mask: Bool[Array, " T"],
    *,
    aggregation: PRMAggregation = "min",
) -> Float[Array, ""]:
    r"""One reward per sequence from its per-step scores $p_1, \dots, p_S$.

    - `"min"`: $\min_s p_s$ (a solution is as good as its worst step; Lightman et al.
      2023 score a solution by the product of its step probabilities, and the minimum is
      the common alternative, e.g. Wang et al. 2024);
    - `"last"`: $p_S$, the score at the last step end;
    - `"mean"`: $\frac1S\sum_s p_s$.

    A sequence without any step gets 0.

    **Arguments:** `step_scores` `[T]`, `step_mask` `[T]` (the step ends), `aggregation`.

    **Returns:** the scalar reward.
    """
    check_choice("aggregation", aggregation, PRM_AGGREGATIONS)
    zero = jnp.zeros((), step_scores.dtype)
    any_step = jnp.any(step_mask)
    if aggregation == "mean":
        return masked_mean(step_scores, step_mask)
    if aggregation == "min":
        big = jnp.asarray(jnp.finfo(step_scores.dtype).max, step_scores.dtype)
        low = jnp.min(jnp.where(step_mask, step_scores, big))
        return jnp.where(any_step, low, zero)
    (T,) = step_mask.shape
    last = jnp.max(jnp.where(step_mask, jnp.arange(T), 0))
    return jnp.where(any_step, step_scores[last], zero)
