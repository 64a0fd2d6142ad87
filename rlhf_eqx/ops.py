"""Per-token log-probabilities, entropy, and the masked reductions everything else uses.

All functions here are written for one sequence (no batch axis) unless their shapes say
otherwise; batch them with ``jax.vmap``. The masked reductions accept any shape.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

__all__ = [
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "previous_real_index",
    "logprobs_from_logits",
    "entropy_from_logits",
    "token_logprobs",
    "token_entropy",
]


def masked_sum(
    x: Float[Array, "*shape"],
    mask: Bool[Array, "*shape"],
    axis: int | tuple[int, ...] | None = None,
) -> Float[Array, "..."]:
    """Sum of `x` over the positions where `mask` is true (masked entries may be NaN/inf)."""
    return jnp.sum(jnp.where(mask, x, jnp.zeros_like(x)), axis=axis)


def masked_mean(
    x: Float[Array, "*shape"],
    mask: Bool[Array, "*shape"],
    axis: int | tuple[int, ...] | None = None,
) -> Float[Array, "..."]:
    """Mean of `x` over the positions where `mask` is true; 0 where nothing is selected."""
    count = jnp.sum(mask, axis=axis).astype(x.dtype)
    return masked_sum(x, mask, axis) / jnp.maximum(count, 1.0)


def masked_var(
    x: Float[Array, "*shape"], mask: Bool[Array, "*shape"], *, unbiased: bool = True
) -> Float[Array, ""]:
    """Variance of the selected entries (Bessel-corrected when `unbiased` and more than one)."""
    mean = masked_mean(x, mask)
    centred = jnp.where(mask, x - mean, jnp.zeros_like(x))
    sq = jnp.sum(centred * centred)
    count = jnp.sum(mask).astype(x.dtype)
    if unbiased:
        denom = jnp.maximum(count - 1.0, 1.0)
    else:
        denom = jnp.maximum(count, 1.0)
    return sq / denom


def masked_whiten(
    x: Float[Array, "*shape"],
    mask: Bool[Array, "*shape"],
    *,
    shift_mean: bool = True,
    eps: float = 1e-8,
) -> Float[Array, "*shape"]:
    """Whiten the selected entries: `(x - mean) / sqrt(var + eps)`; masked entries become 0
    (they may be NaN / inf: neither the value nor the gradient of a selected entry sees them).

    With `shift_mean=False` the mean is added back after scaling (as TRL's
    `masked_whiten(..., shift_mean=False)` does for PPO values).
    """
    # masked entries may be NaN / inf: zero them first, or their product with the
    # scale would reach the gradient of every entry through the mean and variance
    x = jnp.where(mask, x, jnp.zeros_like(x))
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    out = (x - mean) * jax.lax.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return jnp.where(mask, out, jnp.zeros_like(out))


def previous_real_index(mask: Bool[Array, " T"]) -> tuple[Int[Array, " T"], Bool[Array, " T"]]:
    """For each position `t`, the index of the last real position before it.

    **Returns:** `(prev, has_prev)`: `prev[t] = max{s < t : mask[s]}` (0 where there is
    none) and `has_prev[t]` whether such an `s` exists. Token `t` is predicted by the
    model's output at `prev[t]`, so sequences may carry padding anywhere (left, right or
    between a right-padded prompt and its completion).
    """
    (T,) = mask.shape
    idx = jnp.where(mask, jnp.arange(T), -1)
    running = jax.lax.cummax(idx, axis=0)
    prev = jnp.concatenate([jnp.full((1,), -1, running.dtype), running[:-1]])
    has_prev = prev >= 0
    return jnp.maximum(prev, 0), has_prev


def logprobs_from_logits(
    logits: Float[Array, "T V"],
    tokens: Int[Array, " T"],
    mask: Bool[Array, " T"],
    *,
    temperature: float = 1.0,
) -> Float[Array, " T"]:
    """`log p(tokens[t] | tokens[<t])` from next-token logits, 0 where undefined or masked.

    `logits[s]` is the model's prediction for the token after position `s`. Computed as
    the gathered logit minus the row's logsumexp (float32), so no `[T, V]` log-softmax is
    kept alive. `temperature` divides the logits first (as samplers do).
    """
    prev, has_prev = previous_real_index(mask)
    lg = logits.astype(jnp.float32)
    if temperature != 1.0:
        lg = lg / temperature
    lse = jax.nn.logsumexp(lg, axis=-1)
    target = lg[prev, tokens]
    valid = mask & has_prev
    return jnp.where(valid, target - lse[prev], 0.0)


def entropy_from_logits(
    logits: Float[Array, "T V"], mask: Bool[Array, " T"], *, temperature: float = 1.0
) -> Float[Array, " T"]:
    """Entropy of the distribution that predicted token `t` (`H = lse - Σ p·logit`); 0 where
    masked."""
    prev, has_prev = previous_real_index(mask)
    lg = logits.astype(jnp.float32)
    if temperature != 1.0:
        lg = lg / temperature
    lse = jax.nn.logsumexp(lg, axis=-1)
    p = jnp.exp(lg - lse[:, None])
    ent = lse - jnp.sum(p * lg, axis=-1)
    return jnp.where(mask & has_prev, ent[prev], 0.0)


def token_logprobs(
    model: Callable[..., Float[Array, "T V"]],
    tokens: Int[Array, " T"],
    mask: Bool[Array, " T"],
    *,
    temperature: float = 1.0,
) -> Float[Array, " T"]:
    """`log p(tokens[t] | tokens[<t])` under `model`, 0 where undefined or masked.

    `model` is any callable `(tokens, mask) -> logits[T, V]` (an rlhf_eqx `Policy` or
    your own `eqx.Module`).
    """
    return logprobs_from_logits(model(tokens, mask), tokens, mask, temperature=temperature)


def token_entropy(
    model: Callable[..., Float[Array, "T V"]],
    tokens: Int[Array, " T"],
    mask: Bool[Array, " T"],
) -> Float[Array, " T"]:
    """Per-token entropy of `model`'s next-token distribution (see `entropy_from_logits`)."""
    return entropy_from_logits(model(tokens, mask), mask)
