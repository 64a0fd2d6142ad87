"""Sampling one token from logits: top-k / top-p / min-p filtering and an exact inverse-CDF
draw."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, Key, PRNGKeyArray

from ._options import (
    DEFAULT_TEMPERATURE,
    Count,
    Number,
    _plain,
    check_min_p,
    check_temperature,
    check_top_k,
    check_top_p,
    penalties_on,
)
from ._penalties import Seen, penalize_logits


def filter_logits(
    logits: Float[Array, " V"],
    *,
    top_k: Count | None = None,
    top_p: Number | None = None,
    min_p: Number | None = None,
) -> Float[Array, " V"]:
    """Set the logits of the tokens that top-k, top-p or min-p drop to -inf.

    The filters apply in Hugging Face's order (`GenerationMixin._get_logits_processor`:
    `TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper`,
    `MinPLogitsWarper`), to logits already divided by the temperature
    (`sample_token`). With `p = softmax(logits)`:

    - `top_k`: keep the logits `>=` the `k`-th largest (its ties too, as Hugging Face's).
    - `top_p` (nucleus, Holtzman et al. 2020): of the tokens top-k kept, sorted by
      decreasing `p` and renormalised, keep each whose mass strictly above it is
      `< top_p` (the best token always). **Ties:** the cut is a logit threshold, the
      smallest logit kept, so every token tied with the boundary token is kept too;
      Hugging Face's `TopPLogitsWarper` and vLLM cut by sorted position and keep only
      the tied tokens the sort puts first (the kept sets differ only on exact ties at
      the boundary, and by the rounding of the running sums).
    - `min_p` (Nguyen et al. 2024; `MinPLogitsWarper`): of the tokens still kept, keep
      those with `p_v >= min_p · max_u p_u`, i.e. `exp(logits_v - max logits) >= min_p`
      (the ratio does not depend on the renormalisation after top-k / top-p, so this is
      their intersection with the min-p set of the whole vocabulary). The best token is
      always kept; 0 (or `None`) is off, 1 keeps the best token and its exact ties.

    Skips all sorting when top-k and top-p are off; with `top_k`, top-p works on the
    `k` best only. Returns `logits` itself when every filter is off.
    """
    top_k, top_p, min_p = _plain(top_k), _plain(top_p), _plain(min_p)
    check_top_k(top_k)
    check_top_p(top_p)
    check_min_p(min_p)
    if not min_p:
        min_p = None
    if top_k is None and top_p is None and min_p is None:
        return logits
    neg = jnp.asarray(-jnp.inf, logits.dtype)
    if top_k is None and top_p is None:
        drop = jnp.zeros(logits.shape, bool)
        best = jnp.max(logits)
    else:
        if top_k is not None:
            best = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0]
        else:
            best = jnp.sort(logits)[::-1]
        threshold = best[-1]
        if top_p is not None:
            probs = jax.nn.softmax(best)
            before = jnp.cumsum(probs) - probs  # mass strictly above each candidate
            keep = before < top_p  # always keeps the best token
            threshold = jnp.min(jnp.where(keep, best, jnp.inf))
        drop = logits < threshold
        best = best[0]
    if min_p is not None:
        drop = drop | (jnp.exp(logits - best) < min_p)
    return jnp.where(drop, neg, logits)


def sample_token(
    key: PRNGKeyArray,
    logits: Float[Array, " V"],
    *,
    temperature: Number = DEFAULT_TEMPERATURE,
    top_k: Count | None = None,
    top_p: Number | None = None,
    min_p: Number | None = None,
    repetition_penalty: Number = 1.0,
    presence_penalty: Number = 0.0,
    frequency_penalty: Number = 0.0,
    context: Bool[Array, " V"] | None = None,
    generated: Int[Array, " V"] | None = None,
) -> tuple[Int[Array, ""], Float[Array, ""]]:
    """Sample one token from `filter_logits(penalize_logits(logits, context, generated,
    ...) / temperature, top_k=, top_p=, min_p=)` (greedy at `temperature == 0`: the
    argmax of the penalised logits); return it and its log-probability at `temperature`
    (1 when greedy) under the model's own distribution, before the penalties and the
    filters. `context` / `generated` (the row's seen tokens and generated counts,
    `penalize_logits`) are needed when a penalty is on."""
    temperature = _plain(temperature)
    repetition_penalty, presence_penalty, frequency_penalty = (
        _plain(x) for x in (repetition_penalty, presence_penalty, frequency_penalty)
    )
    check_temperature(temperature)
    logits = logits.astype(jnp.float32)
    drawn = logits
    if penalties_on(repetition_penalty, presence_penalty, frequency_penalty):
        if context is None or generated is None:
            raise ValueError(
                "sample_token: a repetition / presence / frequency penalty needs the row's "
                "context and generated counts (context=, generated=)"
            )
        drawn = penalize_logits(
            logits,
            context,
            generated,
            repetition_penalty=repetition_penalty,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
        )
    if temperature == 0.0:
        token = jnp.argmax(drawn).astype(jnp.int32)
        scaled = logits
    else:
        scaled = logits / temperature
        shown = scaled if drawn is logits else drawn / temperature
        filtered = filter_logits(shown, top_k=top_k, top_p=top_p, min_p=min_p)
        token = inverse_cdf_sample(key, filtered)
    logprob = scaled[token] - jax.nn.logsumexp(scaled)
    return token, logprob


def _filter_row(
    logits: Float[Array, " V"],
    top_k: Int[Array, ""],
    top_p: Float[Array, ""],
    min_p: Float[Array, ""],
) -> Float[Array, " V"]:
    """`filter_logits` with a traced `top_k` (0: off), `top_p` (1: off) and `min_p`
    (0: off): the `k` best are the first `k` of the sorted logits, top-p works on them
    only, min-p drops `exp(logits - max) < min_p` (nothing at 0)."""
    V = logits.shape[-1]
    best = jnp.sort(logits)[::-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    in_k = jnp.arange(V) < k
    probs = jax.nn.softmax(jnp.where(in_k, best, -jnp.inf))
    before = jnp.cumsum(probs) - probs  # mass strictly above each candidate
    keep = in_k & ((before < top_p) | (top_p >= 1.0))  # always keeps the best token
    threshold = jnp.min(jnp.where(keep, best, jnp.inf))
    drop = (logits < threshold) | (jnp.exp(logits - best[0]) < min_p)
    return jnp.where(drop, jnp.asarray(-jnp.inf, logits.dtype), logits)


class RowPenalties(eqx.Module):
    """Per-row penalties, traced: `[B]` repetition (1: off), presence and frequency (0:
    off) penalties, and the rows' `Seen` tokens (`penalize_logits`)."""

    repetition: Float[Array, " B"]
    presence: Float[Array, " B"]
    frequency: Float[Array, " B"]
    seen: Seen


def sample_rows(
    keys: Key[Array, " B"],
    logits: Float[Array, "B V"],
    temperature: Float[Array, " B"],
    top_k: Int[Array, " B"],
    top_p: Float[Array, " B"],
    min_p: Float[Array, " B"] | None = None,
    penalties: RowPenalties | None = None,
) -> tuple[Int[Array, " B"], Float[Array, " B"]]:
    """`sample_token` for a batch of rows, each with its own traced settings (one compiled
    program for every setting): row `b` is greedy where `temperature[b] == 0`, else
    draws from `logits[b] / temperature[b]` with its `top_k[b]` (0: off), `top_p[b]`
    (1: off) and `min_p[b]` (0: off; `None`: off for every row), after its penalties
    (`penalties`; `None`: none). Returns each row's token and its log-probability at its
    temperature (1 when greedy), before the penalties and the filters. Same numbers as
    `sample_token` with the row's settings (with both top-k and top-p on, up to the
    rounding of the nucleus' running sum, which could move a near-tie at its edge)."""
    logits = logits.astype(jnp.float32)
    if min_p is None:
        min_p = jnp.zeros(temperature.shape, jnp.float32)
    greedy = temperature == 0.0
    divisor = jnp.where(greedy, 1.0, temperature).astype(jnp.float32)[:, None]
    scaled = logits / divisor
    drawn, shown = logits, scaled
    if penalties is not None:
        drawn = penalize_logits(
            logits,
            penalties.seen.context,
            penalties.seen.generated,
            repetition_penalty=penalties.repetition,
            presence_penalty=penalties.presence,
            frequency_penalty=penalties.frequency,
        )
        shown = drawn / divisor
    filtering = jnp.any(~greedy & ((top_k > 0) | (top_p < 1.0) | (min_p > 0.0)))
    filtered = jax.lax.cond(
        filtering,
        lambda x: jax.vmap(_filter_row)(x, top_k, top_p, min_p),
        lambda x: x,
        shown,
    )
    drawn_token = jax.vmap(inverse_cdf_sample)(keys, filtered)
    token = jnp.where(greedy, jnp.argmax(drawn, axis=-1).astype(jnp.int32), drawn_token)
    picked = jnp.take_along_axis(scaled, token[:, None], axis=-1)[:, 0]
    return token, picked - jax.nn.logsumexp(scaled, axis=-1)


def inverse_cdf_sample(key: PRNGKeyArray, logits: Float[Array, " V"]) -> Int[Array, ""]:
    """Exact categorical sample from one uniform draw: the first index whose CDF exceeds `u`.

    Needs one random number per row instead of one per vocabulary entry (as Gumbel-max
    does), which matters on CPUs where the PRNG dominates a decode step. The CDF is
    searched in two levels — the cumulative sums of about `√V` blocks, then the running
    sum inside the one block that holds `u` — instead of a prefix sum over the whole
    vocabulary, the slow part of a sampled decode step on CPU. Tokens of probability 0
    (filtered out) are never returned.
    """
    V = logits.shape[0]
    probs = jnp.exp(logits - jnp.max(logits))
    size = max(1, math.isqrt(V - 1) + 1)
    n_blocks = -(-V // size)
    blocks = jnp.pad(probs, (0, n_blocks * size - V)).reshape(n_blocks, size)
    sums = jnp.sum(blocks, axis=-1)
    block_cdf = jnp.cumsum(sums)
    u = jax.random.uniform(key, (), jnp.float32) * block_cdf[-1]
    i32 = lambda x: jnp.asarray(x).astype(jnp.int32)  # int32 indices also under jax_enable_x64
    b = jnp.minimum(i32(jnp.searchsorted(block_cdf, u, side="right")), n_blocks - 1)
    # b may land on an empty block only through rounding at the very top: step back to
    # the last block with mass
    has_mass = sums > 0
    last_block = n_blocks - 1 - i32(jnp.argmax(has_mass[::-1]))
    b = jnp.where(has_mass[b], b, last_block)
    row = blocks[b]
    within = jnp.cumsum(row)
    j = i32(jnp.searchsorted(within, u - (block_cdf[b] - sums[b]), side="right"))
    # rounding can put the target just outside the block's running sum: clamp to its
    # first / last token with mass
    first = i32(jnp.argmax(row > 0))
    last = size - 1 - i32(jnp.argmax((row > 0)[::-1]))
    j = jnp.where(j >= size, last, j)
    j = jnp.where(row[j] > 0, j, first)
    return jnp.minimum(b * size + j, V - 1).astype(jnp.int32)
