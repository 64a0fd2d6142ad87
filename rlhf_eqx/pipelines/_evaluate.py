"""Evaluation on held-out prompts: scorer rate, win rate on paired samples, fluency (NLL
under the base model), KL to the reference, reward-model accuracy, each rate with its
standard error (`prompt_se`, `binomial_se`)."""

import math
from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Float32, PRNGKeyArray, Shaped

from .._sampling import DEFAULT_TEMPERATURE
from ._rollout import Rollout, sample_rollout, token_logps

# Rows per log-probability pass of an evaluation: a GRPO rollout's rows at the built-in
# settings (8 prompts x 8 samples), so that the held-out evaluations (24 prompts x 8
# samples: three passes) and GRPO's reference pass share one compiled program; fewer
# when a pass's logits (rows x length x vocabulary floats) would exceed _LOGIT_BUDGET
# (a real vocabulary: 49,152 for SmolLM2). Each row's log-probabilities are the same in
# any batch.
_ROWS = 64
_LOGIT_BUDGET = 1 << 28


def _token_logps(model, rollout: Rollout) -> np.ndarray:
    """`token_logps` of the rollout's rows in passes of at most `_ROWS` rows (and at most
    `_LOGIT_BUDGET` logits), the last pass padded with its own last row, so that every
    pass has one shape."""
    n, t = rollout.tokens.shape
    vocab = getattr(getattr(model, "cfg", None), "vocab_size", 1)
    rows = max(1, min(_ROWS, _LOGIT_BUDGET // max(t * vocab, 1)))
    if n <= rows:
        return np.asarray(token_logps(model, rollout.tokens, rollout.mask))
    tokens, mask = np.asarray(rollout.tokens), np.asarray(rollout.mask)  # sliced on the host
    out = []
    for i in range(0, n, rows):
        idx = np.minimum(np.arange(i, i + rows), n - 1)
        lp = token_logps(model, jnp.asarray(tokens[idx]), jnp.asarray(mask[idx]))
        out.append(np.asarray(lp)[: min(rows, n - i)])
    return np.concatenate(out)


def _completion_mean(values: np.ndarray, rollout: Rollout) -> float:
    """Mean of per-token `values` over the rollout's completion tokens."""
    m = np.asarray(rollout.completion_mask & rollout.mask)
    return float((values * m).sum() / max(m.sum(), 1))


def completion_nll(model, rollout: Rollout) -> float:
    """Mean negative log-likelihood per completion token of `rollout` under `model`."""
    return -_completion_mean(_token_logps(model, rollout), rollout)


def _kl(policy, reference, rollout: Rollout) -> float:
    """Per-token KL(policy || reference) estimated on the policy's own samples (k1)."""
    return _completion_mean(
        _token_logps(policy, rollout) - _token_logps(reference, rollout), rollout
    )


def win_rate(
    scores: Sequence[float] | Float[np.ndarray, " N"],
    baseline: Sequence[float] | Float[np.ndarray, " M"],
) -> float:
    """Fraction of paired samples where `scores` beats `baseline` (ties count one half)."""
    a, b = np.asarray(scores, np.float64), np.asarray(baseline, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"win_rate needs paired scores, got {a.shape} and {b.shape}")
    return float(np.mean((a > b) + 0.5 * (a == b)))


def prompt_se(outcomes: Sequence[float | int] | Shaped[np.ndarray, " N"], group_size: int) -> float:
    """Standard error of the mean of `outcomes` (one per sample, `group_size` samples per
    prompt, each prompt's samples contiguous) over the held-out prompts.

    The samples of one prompt share its opening, so they are not independent draws:
    the unit of replication is the prompt. With `P = N / group_size` prompts and
    per-prompt means `r_p` (the prompt's rate), the mean of the outcomes is the mean
    of the `r_p`, and its standard error is

    `SE = s(r) / √P`,   `s(r)² = Σ_p (r_p − r̄)² / (P − 1)`

    (the sample standard deviation of the per-prompt rates over the square root of the
    number of prompts). It is 0 when every prompt has the same rate, and it measures
    how far the rate would move with another draw of held-out prompts and samples, e.g.
    on another machine whose floating-point order changes which tokens are sampled.
    With `group_size` 1 it is the usual `s / √N`. NaN with fewer than two prompts.

    **Arguments:**

    - `outcomes`: per-sample values (a score in [0, 1], or a win: 1, ½ for a tie, 0),
      `[N]` with `N` a multiple of `group_size`.
    - `group_size`: samples per prompt (≥ 1).

    **Returns:** the standard error (a float).
    """
    x = np.asarray(outcomes, np.float64)
    if group_size < 1 or x.ndim != 1 or x.size % group_size:
        raise ValueError(
            f"prompt_se: outcomes of shape {x.shape} do not split into groups of {group_size}"
        )
    rates = x.reshape(-1, group_size).mean(axis=1)
    if rates.size < 2:
        return math.nan
    return float(rates.std(ddof=1) / math.sqrt(rates.size))


def binomial_se(rate: float, n: int) -> float:
    """Binomial standard error `√(p (1 − p) / n)` of a rate `p` measured on `n`
    independent trials (e.g. a reward model's accuracy on `n` held-out pairs); 0 at
    `p` = 0 or 1, NaN for `n` = 0."""
    if n < 1:
        return math.nan
    return math.sqrt(max(rate * (1.0 - rate), 0.0) / n)


def win_rate_se(
    scores: Sequence[float] | Float[np.ndarray, " N"],
    baseline: Sequence[float] | Float[np.ndarray, " N"],
    group_size: int,
) -> float:
    """Standard error of `win_rate(scores, baseline)` over the prompts (`prompt_se` of the
    per-sample outcomes: 1 a win, ½ a tie, 0 a loss)."""
    a, b = np.asarray(scores, np.float64), np.asarray(baseline, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"win_rate_se needs paired scores, got {a.shape} and {b.shape}")
    return prompt_se((a > b) + 0.5 * (a == b), group_size)


def evaluate_policy(
    policy,
    tok,
    prompts: Sequence[str],
    key: PRNGKeyArray,
    *,
    scorer: Callable[[str], float],
    base,
    reference=None,
    samples: int,
    prompt_length: int,
    max_new_tokens: int,
    temperature: float = DEFAULT_TEMPERATURE,
    stop_strings: Sequence[str] = (),
    slots: int = 0,
    **filters: float | int,
) -> tuple[dict, Rollout, Float32[np.ndarray, " N"]]:
    """Sample `samples` completions per held-out prompt and measure them.

    **Returns:** `(metrics, rollout, scores)`; metrics: `score` (mean scorer value) and
    `score_se` (its standard error over the prompts, `prompt_se`), `base_nll` (NLL per
    token under `base`: fluency), `kl` (per-token KL to `reference`, when given). Two
    policies evaluated with the same `key` give paired samples for `win_rate`.
    `slots > 0`: continuous batching (see `sample_rollout`); `**filters`: the sampler's
    `top_k`, `top_p`, `min_p`, `repetition_penalty`, `presence_penalty` and
    `frequency_penalty` (`sample_rollout`'s; off by default).
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
        **filters,
    )
    scores = np.asarray([scorer(t) for t in rollout.texts], np.float32)
    metrics = {
        "score": float(scores.mean()),
        "score_se": prompt_se(scores, samples),
        "base_nll": completion_nll(base, rollout),
    }
    if reference is not None:
        metrics["kl"] = _kl(policy, reference, rollout)
    return metrics, rollout, scores


@eqx.filter_jit
def _pair_margins(model, batch) -> Float[Array, " B"]:
    """The scalar reward of each pair's chosen row minus its rejected row's."""
    chosen = jax.vmap(model)(batch.chosen_tokens, batch.chosen_mask)
    return chosen - jax.vmap(model)(batch.rejected_tokens, batch.rejected_mask)


def reward_accuracy(reward_model, batch) -> float:
    """Fraction of pairs of a `PreferenceBatch` the reward model orders chosen > rejected
    (a scalar reward model, or anything with `scores(tokens, mask) -> (scores, ...)`,
    e.g. an ensemble's `EnsembleReward`)."""
    if hasattr(reward_model, "scores"):
        chosen = reward_model.scores(batch.chosen_tokens, batch.chosen_mask)[0]
        rejected = reward_model.scores(batch.rejected_tokens, batch.rejected_mask)[0]
        return float(jnp.mean((chosen > rejected).astype(jnp.float32)))
    margin = _pair_margins(reward_model, batch)
    return float(jnp.mean((margin > 0).astype(jnp.float32)))
