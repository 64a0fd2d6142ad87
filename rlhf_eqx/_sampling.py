"""Sampling with a KV cache: one compiled prefill + decode loop.

Prompts may be left- or right-padded (positions and attention come from the mask).
Left padding is recommended for batches (`rlhf_eqx.data` collates prompts that way):
the completion then starts right after the last real prompt token in every row.
The output row is always `prompt (as given, with its padding) ++ completion`.
"""

import functools
import math
import numbers
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from .models._protocols import AbstractDecoder


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_top_k(top_k: object) -> None:
    if top_k is not None and not (_is_int(top_k) and top_k > 0):  # type: ignore[operator]
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")


def _check_top_p(top_p: object) -> None:
    if top_p is not None and not (
        isinstance(top_p, numbers.Real) and not isinstance(top_p, bool) and 0.0 < top_p <= 1.0
    ):
        raise ValueError(f"top_p must be a number in (0, 1] or None, got {top_p!r}")


def _check_temperature(temperature: object) -> None:
    if not (
        isinstance(temperature, numbers.Real)
        and not isinstance(temperature, bool)
        and temperature >= 0.0
    ):
        raise ValueError(f"temperature must be a number >= 0 (0 is greedy), got {temperature!r}")


def _stop_ids(eos_id: object) -> tuple[int, ...]:
    """`eos_id` as a tuple of ids: `None` -> `()`, `2` -> `(2,)`, `[2, 7]` -> `(2, 7)`."""
    if eos_id is None:
        return ()
    ids = (eos_id,) if not isinstance(eos_id, Sequence) else tuple(eos_id)
    for i in ids:
        if not (_is_int(i) and i >= 0):  # type: ignore[operator]
            raise ValueError(f"eos_id must be a non-negative int or a sequence of them, got {eos_id!r}")
    return tuple(int(i) for i in ids)


class SamplingOptions(eqx.Module):
    """Settings of `generate` / `generate_batch` (their keyword arguments), validated once.

    - `max_new_tokens`: number of tokens to sample (a positive int).
    - `temperature`: 0 means greedy; otherwise logits are divided by it.
    - `top_k`, `top_p`: optional filters (a positive int; a number in (0, 1]).
    - `eos_id`: a stop id, several stop ids (`[2, 13]`) or `None`; a row stops at the
      first of them, which is kept in its completion.
    - `pad_id`: fills rows after they stop.
    - `check_ids`: also check prompt ids against the vocabulary inside the compiled
      program (`eqx.error_if`), for prompts that are traced (under the caller's `jit`
      or `vmap`); concrete prompts are always checked on the host.
    - `num_samples`: completions per prompt (a positive int). Each prompt is run
      through the model once and its cache copied to its `num_samples` rows (GRPO's
      groups): the output has `B · num_samples` rows, those of prompt `i` at
      `i · num_samples …`, identical to passing every prompt repeated `num_samples`
      times.
    """

    max_new_tokens: Any
    temperature: float | int = 1.0
    top_k: Any = None
    top_p: float | int | None = None
    eos_id: tuple[int, ...] = eqx.field(default=(), converter=_stop_ids)
    pad_id: int = 0
    check_ids: bool = False
    num_samples: int = 1

    def __check_init__(self):
        if not (_is_int(self.num_samples) and self.num_samples > 0):
            raise ValueError(f"num_samples must be a positive int, got {self.num_samples!r}")
        if not (_is_int(self.max_new_tokens) and self.max_new_tokens > 0):
            raise ValueError(
                f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}"
            )
        _check_temperature(self.temperature)
        _check_top_k(self.top_k)
        _check_top_p(self.top_p)
        if not _is_int(self.pad_id):
            raise ValueError(f"pad_id must be an int, got {self.pad_id!r}")


class GenerationOutput(eqx.Module):
    """Prompt + completion of one sequence (a leading batch axis under `generate_batch`).

    - `tokens`: prompt followed by `max_new_tokens` sampled ids (`pad_id` after EOS).
    - `mask`: real tokens (the prompt's real tokens, then completion tokens up to and
      including EOS).
    - `completion_mask`: the completion's real tokens.
    - `logprobs`: log-probability of each sampled token under the model's distribution
      at the sampling temperature (`logits / temperature`, before top-k / top-p
      filtering; temperature 1 for greedy), 0 elsewhere. It matches
      `token_logprobs(policy, tokens, mask, temperature=...)`.
    """

    tokens: Int[Array, "*B T"]
    mask: Bool[Array, "*B T"]
    completion_mask: Bool[Array, "*B T"]
    logprobs: Float[Array, "*B T"]


def filter_logits(
    logits: Float[Array, " V"], *, top_k: int | None = None, top_p: float | int | None = None
) -> Float[Array, " V"]:
    """Set logits outside the top-k set and outside the top-p nucleus (Holtzman et al. 2020) to -inf.

    Skips all sorting when both are off; with `top_k`, top-p works on the `k` best only.
    """
    _check_top_k(top_k)
    _check_top_p(top_p)
    if top_k is None and top_p is None:
        return logits
    neg = jnp.asarray(-jnp.inf, logits.dtype)
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
    return jnp.where(logits < threshold, neg, logits)


def sample_token(
    key: PRNGKeyArray,
    logits: Float[Array, " V"],
    *,
    temperature: float | int = 1.0,
    top_k: int | None = None,
    top_p: float | int | None = None,
) -> tuple[Int[Array, ""], Float[Array, ""]]:
    """Sample one token; return it and its log-probability at `temperature` (1 when greedy)."""
    _check_temperature(temperature)
    logits = logits.astype(jnp.float32)
    if temperature == 0.0:
        token = jnp.argmax(logits).astype(jnp.int32)
        scaled = logits
    else:
        scaled = logits / temperature
        filtered = filter_logits(scaled, top_k=top_k, top_p=top_p)
        token = _inverse_cdf_sample(key, filtered)
    logprob = scaled[token] - jax.nn.logsumexp(scaled)
    return token, logprob


def _inverse_cdf_sample(key: PRNGKeyArray, logits: Float[Array, " V"]) -> Int[Array, ""]:
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


def _check_decoder(policy: object) -> AbstractDecoder:
    if not isinstance(policy, AbstractDecoder):
        raise TypeError(
            "generate needs a decoder: a model inheriting rlhf_eqx.models.AbstractDecoder "
            f"(init_cache / prefill / decode_step), such as rlhf_eqx.Policy; got {type(policy).__name__}"
        )
    return policy


def _check_prompt_ids(prompts: Any, vocab_size: int) -> None:
    """Raise naming the first bad row, position and id, if `prompts` are concrete."""
    if isinstance(prompts, jax.core.Tracer):
        return
    ids = np.asarray(prompts)
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        row, col = (int(x) for x in np.argwhere(bad)[0])
        raise ValueError(
            f"prompt row {row} has id {int(ids[row, col])} at position {col}, "
            f"outside the vocabulary [0, {vocab_size})"
        )


class _DecodeState(eqx.Module):
    """Carry of the decode loop; `tokens` / `logprobs` / `real` are the `[B, N]` outputs."""

    step: Int[Array, ""]
    logits: Float[Array, "B V"]
    cache: Any
    done: Bool[Array, " B"]
    positions: Int[Array, " B"]
    tokens: Int[Array, "B N"]
    logprobs: Float[Array, "B N"]
    real: Bool[Array, "B N"]


def _generate_batch(
    policy: AbstractDecoder,
    prompts: Int[Array, "B P"],
    prompt_masks: Bool[Array, "B P"],
    key: PRNGKeyArray,
    opts: SamplingOptions,
) -> GenerationOutput:
    B, P = prompts.shape
    N = opts.max_new_tokens
    prompts = prompts.astype(jnp.int32)
    if opts.check_ids:
        bad = (prompts < 0) | (prompts >= policy.vocab_size)
        prompts = eqx.error_if(prompts, jnp.any(bad), "prompt ids outside [0, vocab_size)")
    logits, cache = jax.vmap(lambda t, m: policy.prefill(t, m, cache_size=P + N))(prompts, prompt_masks)
    if opts.num_samples > 1:
        # one prefill per prompt, its cache shared by the prompt's samples
        rep = lambda x: jnp.repeat(x, opts.num_samples, axis=0)
        logits, cache, prompts, prompt_masks = jax.tree.map(rep, (logits, cache, prompts, prompt_masks))
        B = B * opts.num_samples
    sample = jax.vmap(
        functools.partial(
            sample_token, temperature=opts.temperature, top_k=opts.top_k, top_p=opts.top_p
        )
    )
    decode = jax.vmap(
        lambda tok, c, pos, idx: policy.decode_step(tok, c, index=idx, position=pos),
        in_axes=(0, 0, 0, None),
    )
    stop_ids = jnp.asarray(opts.eos_id, jnp.int32)
    zero = jnp.zeros((), jnp.int32)  # int32 indices also under jax_enable_x64

    def cond(s: _DecodeState):
        return (s.step < N) & ~jnp.all(s.done)

    def body(s: _DecodeState) -> _DecodeState:
        tok, lp = sample(jax.random.split(jax.random.fold_in(key, s.step), B), s.logits)
        real = ~s.done
        tok = jnp.where(real, tok, jnp.asarray(opts.pad_id, jnp.int32))
        lp = jnp.where(real, lp, jnp.zeros_like(lp))
        done = s.done
        if opts.eos_id:
            done = done | (real & jnp.any(tok[:, None] == stop_ids[None, :], axis=-1))

        def advance(args):
            logits, cache, positions = args
            logits, cache = decode(tok, cache, positions, P + s.step)
            return logits, cache, positions + 1

        logits, cache, positions = jax.lax.cond(
            s.step + 1 < N, advance, lambda args: args, (s.logits, s.cache, s.positions)
        )
        at = (zero, s.step)
        return _DecodeState(
            step=s.step + 1,
            logits=logits,
            cache=cache,
            done=done,
            positions=positions,
            tokens=jax.lax.dynamic_update_slice(s.tokens, tok[:, None], at),
            logprobs=jax.lax.dynamic_update_slice(s.logprobs, lp[:, None], at),
            real=jax.lax.dynamic_update_slice(s.real, real[:, None], at),
        )

    init = _DecodeState(
        step=zero,
        logits=logits,
        cache=cache,
        done=jnp.zeros((B,), jnp.bool_),
        positions=jnp.sum(prompt_masks, axis=-1, dtype=jnp.int32),
        tokens=jnp.full((B, N), opts.pad_id, jnp.int32),
        logprobs=jnp.zeros((B, N), jnp.float32),
        real=jnp.zeros((B, N), jnp.bool_),
    )
    s = jax.lax.while_loop(cond, body, init)
    return GenerationOutput(
        tokens=jnp.concatenate([prompts, s.tokens], axis=1),
        mask=jnp.concatenate([prompt_masks, s.real], axis=1),
        completion_mask=jnp.concatenate([jnp.zeros_like(prompt_masks), s.real], axis=1),
        logprobs=jnp.concatenate([jnp.zeros((B, P), jnp.float32), s.logprobs], axis=1),
    )


_generate_batch_jit = eqx.filter_jit(_generate_batch)


def generate_batch(
    policy: AbstractDecoder,
    prompts: Int[Array, "B P"],
    prompt_masks: Bool[Array, "B P"],
    key: PRNGKeyArray,
    **options: Any,
) -> GenerationOutput:
    """Sample completions for a batch of prompts in one compiled program.

    Prefill runs all prompts at once; the decode loop is a `lax.while_loop` that stops
    as soon as every row has emitted a stop id (or after `max_new_tokens`), with no
    Python work per step. One compile per (batch, prompt length, options).

    **Arguments:**

    - `policy`: a decoder (`rlhf_eqx.models.AbstractDecoder`, e.g. `rlhf_eqx.Policy`).
    - `prompts`, `prompt_masks`: `[B, P]` ids and real-token masks; each row needs at
      least one real token. Concrete ids outside `[0, vocab_size)` raise a `ValueError`
      naming the row and the id.
    - `key`: PRNG key (ignored when greedy).
    - `**options`: the fields of `SamplingOptions`: `max_new_tokens` (required),
      `temperature=1.0` (0 is greedy), `top_k=None`, `top_p=None`, `eos_id=None` (one
      id or several), `pad_id=0`, `check_ids=False`, `num_samples=1` (completions per
      prompt, each prompt prefilled once).

    **Returns:** a `GenerationOutput` with a leading batch axis (`B · num_samples`
    rows), rows of length `P + max_new_tokens`. Cut completions at stop *strings* afterwards with
    `truncate_at_stop_strings`.
    """
    opts = SamplingOptions(**options)
    policy = _check_decoder(policy)
    if prompts.shape != prompt_masks.shape:
        raise ValueError(
            f"prompts {prompts.shape} and prompt_masks {prompt_masks.shape} differ in shape"
        )
    _check_prompt_ids(prompts, policy.vocab_size)
    return _generate_batch_jit(policy, prompts, prompt_masks, key, opts)


def generate(
    policy: AbstractDecoder,
    prompt: Int[Array, " P"],
    prompt_mask: Bool[Array, " P"],
    key: PRNGKeyArray,
    **options: Any,
) -> GenerationOutput:
    """Sample a completion of one prompt (jitted; vmappable over a batch of prompts).

    `generate_batch` on a batch of one: same `options` (`SamplingOptions`), no batch axis.
    Under `jax.vmap` the loop runs until every row of the batch is done; `generate_batch`
    is the batched entry point.
    """
    if options.get("num_samples", 1) != 1:
        raise ValueError(
            f"generate samples one completion (got num_samples={options['num_samples']!r}); "
            "use generate_batch(..., num_samples=n)"
        )
    out = generate_batch(policy, prompt[None], prompt_mask[None], key, **options)
    return jax.tree_util.tree_map(lambda x: x[0], out)


def truncate_at_stop_strings(
    out: GenerationOutput,
    tokenizer: Any,
    stop_strings: Sequence[str],
    *,
    pad_id: int = 0,
) -> GenerationOutput:
    """Cut each row's completion where a stop string first appears in its decoded text.

    Host-side (call it on the output of `generate_batch`, outside `jit`). For every row,
    the completion is decoded with `tokenizer.decode`; if a stop string occurs, the
    completion keeps its longest token prefix whose text ends at or before the first
    occurrence (the stop string itself is dropped), and the remaining completion
    positions get `pad_id`, mask `False` and log-probability 0. A chat model that starts
    a new turn, e.g. `"\\n\\nHuman:"`, is cut there. Rows without a stop string are
    unchanged.

    **Arguments:**

    - `out`: a batched `GenerationOutput` (`[B, T]` fields).
    - `tokenizer`: anything with `decode(ids: list[int]) -> str`.
    - `stop_strings`: the strings to stop at (non-empty).
    - `pad_id`: the id written over cut tokens.

    **Returns:** a `GenerationOutput` of the same shapes.
    """
    if isinstance(stop_strings, str):
        raise TypeError("stop_strings must be a sequence of strings, not one string")
    if not all(isinstance(s, str) and s for s in stop_strings):
        raise ValueError(f"stop_strings must be non-empty strings, got {stop_strings!r}")
    tokens = np.array(out.tokens)
    mask = np.array(out.mask)
    cmask = np.array(out.completion_mask)
    logprobs = np.array(out.logprobs)
    if tokens.ndim != 2:
        raise ValueError(f"expected a batched output with [B, T] fields, got tokens of shape {tokens.shape}")
    for row in range(tokens.shape[0]):
        cols = np.flatnonzero(cmask[row])
        ids = tokens[row, cols].tolist()
        text = tokenizer.decode(ids)
        hits = [i for i in (text.find(s) for s in stop_strings) if i >= 0]
        if not hits:
            continue
        start = min(hits)
        # Longest prefix of tokens whose text ends at or before the stop string.
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(tokenizer.decode(ids[:mid])) <= start:
                lo = mid
            else:
                hi = mid - 1
        cut = cols[lo:]
        tokens[row, cut] = pad_id
        mask[row, cut] = False
        cmask[row, cut] = False
        logprobs[row, cut] = 0.0
    return GenerationOutput(
        tokens=jnp.asarray(tokens, jnp.int32),
        mask=jnp.asarray(mask),
        completion_mask=jnp.asarray(cmask),
        logprobs=jnp.asarray(logprobs, jnp.float32),
    )
