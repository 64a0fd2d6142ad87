"""Evaluation on held-out prompts: scorer rate, win rate on paired samples, fluency (NLL
under the base model), KL to the reference, reward-model accuracy."""

from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from ._rollout import Rollout, sample_rollout, token_logps


def completion_nll(model, rollout: Rollout) -> float:
    """Mean negative log-likelihood per completion token of `rollout` under `model`."""
    lp = np.asarray(token_logps(model, rollout.tokens, rollout.mask))
    m = np.asarray(rollout.completion_mask & rollout.mask)
    return float(-(lp * m).sum() / max(m.sum(), 1))


def _kl(policy, reference, rollout: Rollout) -> float:
    """Per-token KL(policy || reference) estimated on the policy's own samples (k1)."""
    lp = np.asarray(token_logps(policy, rollout.tokens, rollout.mask))
    ref = np.asarray(token_logps(reference, rollout.tokens, rollout.mask))
    m = np.asarray(rollout.completion_mask & rollout.mask)
    return float(((lp - ref) * m).sum() / max(m.sum(), 1))


def win_rate(
    scores: Sequence[float] | Float[np.ndarray, " N"],
    baseline: Sequence[float] | Float[np.ndarray, " M"],
) -> float:
    """Fraction of paired samples where `scores` beats `baseline` (ties count one half)."""
    a, b = np.asarray(scores, np.float64), np.asarray(baseline, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"win_rate needs paired scores, got {a.shape} and {b.shape}")
    return float(np.mean((a > b) + 0.5 * (a == b)))


def evaluate_policy(
    policy,
    tok,
    prompts: Sequence[str],
    key: jax.Array,
    *,
    scorer: Callable[[str], float],
    base,
    reference=None,
    samples: int,
    prompt_length: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    stop_strings: Sequence[str] = (),
    slots: int = 0,
) -> tuple[dict, Rollout, np.ndarray]:
    """Sample `samples` completions per held-out prompt and measure them.

    **Returns:** `(metrics, rollout, scores)`; metrics: `score` (mean scorer value),
    `base_nll` (NLL per token under `base`: fluency), `kl` (per-token KL to `reference`,
    when given). Two policies evaluated with the same `key` give paired samples for
    `win_rate`. `slots > 0`: continuous batching (see `sample_rollout`).
    """
    rollout = sample_rollout(
        policy,
        tok,
        prompts,
        key,
        group_size=samples,
        prompt_length=prompt_length,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        stop_strings=stop_strings,
        slots=slots,
    )
    scores = np.asarray([scorer(t) for t in rollout.texts], np.float32)
    metrics = {"score": float(scores.mean()), "base_nll": completion_nll(base, rollout)}
    if reference is not None:
        metrics["kl"] = _kl(policy, reference, rollout)
    return metrics, rollout, scores


@eqx.filter_jit
def _pair_rewards(
    model,
    ct: Int[Array, "B T"],
    cm: Bool[Array, "B T"],
    rt: Int[Array, "B T"],
    rm: Bool[Array, "B T"],
) -> Float[Array, " B"]:
    return jax.vmap(model)(ct, cm) - jax.vmap(model)(rt, rm)


def reward_accuracy(reward_model, batch) -> float:
    """Fraction of pairs of a `PreferenceBatch` the reward model orders chosen > rejected
    (a scalar reward model, or anything with `scores(tokens, mask) -> (scores, ...)`,
    e.g. an ensemble's `EnsembleReward`)."""
    if hasattr(reward_model, "scores"):
        chosen = reward_model.scores(batch.chosen_tokens, batch.chosen_mask)[0]
        rejected = reward_model.scores(batch.rejected_tokens, batch.rejected_mask)[0]
        return float(jnp.mean((chosen > rejected).astype(jnp.float32)))
    margin = _pair_rewards(
        reward_model,
        batch.chosen_tokens,
        batch.chosen_mask,
        batch.rejected_tokens,
        batch.rejected_mask,
    )
    return float(jnp.mean((margin > 0).astype(jnp.float32)))
