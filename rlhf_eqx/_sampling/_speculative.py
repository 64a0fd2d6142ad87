r"""Speculative decoding: a draft model proposes `k` tokens, the target checks them in one
pass, and the output is distributed exactly as the target's own samples.

Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with
Speculative Sampling". With `p` the target's and `q` the draft's next-token
distribution (both after temperature, top-k, top-p and min-p, as `sample_token` uses
them), a proposed token `x ~ q` is accepted with probability `min(1, p(x) / q(x))`; at
the first rejection the token is drawn from the residual
`max(0, p − q) / Σ max(0, p − q)`; when all `k` are accepted a bonus token is drawn
from `p` at the next position. Then

$$P(x) = q(x) \min(1, p(x)/q(x)) + (1 − \textstyle\sum_y \min(p(y), q(y)))
\frac{\max(0, p(x) − q(x))}{\sum_y \max(0, p(y) − q(y))} = p(x),$$

so every emitted token is a sample of the target given the tokens before it, whatever
the draft. Greedy decoding (temperature 0) is the limit of one-hot `p` and `q`: a
proposal is kept when it is the target's argmax, and the first mismatch is replaced by
the target's argmax, so the tokens are exactly `generate_batch`'s.
"""

import numbers
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int, Integer, PRNGKeyArray

from ..models import AbstractChunkDecoder, AbstractDecoder
from ._decode import (
    _check_batch,
    _check_decoder_output,
    _Completions,
    _int32_prompts,
    _row_sampler,
    _with_prompts,
)
from ._options import GenerationOutput, SamplingOptions
from ._token import filter_logits, inverse_cdf_sample


class SpeculativeStats(eqx.Module):
    """Per-row counts of a `generate_speculative` call (one entry per output row).

    - `target_passes`: verification passes of the target the row took part in (the
      first token, sampled from the prompt's prefill, is not counted).
    - `proposed`: draft tokens proposed to the row (`k` per pass).
    - `accepted`: proposed tokens the target accepted (before a stop id or the token
      budget cut the row).

    Each pass emits the accepted tokens plus one (the residual or bonus token), so the
    expected tokens per pass is `(1 − α^{k+1}) / (1 − α)` for an acceptance rate `α`
    that is the same at every position (Leviathan et al. 2023, eq. 1).
    """

    target_passes: Int[Array, "*B"]
    proposed: Int[Array, "*B"]
    accepted: Int[Array, "*B"]

    @property
    def acceptance_rate(self) -> Float[Array, ""]:
        """Accepted over proposed draft tokens, over all rows."""
        proposed = jnp.maximum(jnp.sum(self.proposed), 1)
        return jnp.sum(self.accepted) / proposed

    @property
    def mean_accepted(self) -> Float[Array, ""]:
        """Accepted draft tokens per target pass, over all rows."""
        return jnp.sum(self.accepted) / jnp.maximum(jnp.sum(self.target_passes), 1)

    @property
    def tokens_per_pass(self) -> Float[Array, ""]:
        """Tokens a target pass yields (accepted + 1), over all rows."""
        return 1.0 + self.mean_accepted


def _check_k(k: object) -> int:
    if not (isinstance(k, numbers.Integral) and not isinstance(k, bool) and k >= 1):
        raise ValueError(
            f"generate_speculative: k must be a positive int (tokens per draft), got {k!r}"
        )
    return int(k)


def _check_models(target: object, draft: object) -> None:
    for name, model in (("target", target), ("draft", draft)):
        if not isinstance(model, AbstractDecoder):
            raise TypeError(
                f"generate_speculative: {name} must be a decoder (a model inheriting "
                "rlhf_eqx.models.AbstractDecoder: init_cache / prefill / decode_step), "
                f"got {type(model).__name__}"
            )
    if draft.vocab_size != target.vocab_size:  # type: ignore[union-attr]
        raise ValueError(
            f"generate_speculative: draft has vocab_size {draft.vocab_size} but the target "  # type: ignore[union-attr]
            f"has {target.vocab_size}; the draft must share the target's vocabulary"  # type: ignore[union-attr]
        )


def _filtered(logits: Float[Array, "*N V"], opts: SamplingOptions) -> Float[Array, "*N V"]:
    """`logits / temperature` with top-k / top-p / min-p applied (`sample_token`'s
    distribution)."""
    lead, V = logits.shape[:-1], logits.shape[-1]
    scaled = logits.astype(jnp.float32) / opts.temperature
    flat = jax.vmap(
        lambda x: filter_logits(x, top_k=opts.top_k, top_p=opts.top_p, min_p=opts.min_p)
    )(scaled.reshape(-1, V))
    return flat.reshape(lead + (V,))


def _take(x: Array, idx: Int[Array, "*N"]) -> Array:
    """`x[..., idx]` along the last axis, one index per leading entry."""
    return jnp.take_along_axis(x, idx[..., None], axis=-1)[..., 0]


def _pick(stacked: Any, n: Int[Array, " B"]) -> Any:
    """Row `b` of the `n[b]`-th of a stack `[C, B, ...]` of caches."""
    rows = jnp.arange(n.shape[0])
    return jax.tree.map(lambda c: c[n, rows], stacked)


class _Feeder(eqx.Module):
    """Feeds tokens `[B, C]` to a decoder at per-row slots and positions: in one pass
    (`decode_chunk`) or one `decode_step` at a time. `logits` is `[B, C, V]`; `caches`
    (token by token only) stacks the cache after each token, `[C, B, ...]`, for
    picking the one after the last accepted token (`decode_chunk` drops later slots
    itself when the next chunk is fed)."""

    model: AbstractDecoder

    @property
    def chunked(self) -> bool:
        return isinstance(self.model, AbstractChunkDecoder)

    def __call__(self, tokens, cache, index, position):
        if self.chunked:
            feed = lambda t, c, i, p: self.model.decode_chunk(t, c, index=i, position=p)  # type: ignore[attr-defined]
            logits, cache = jax.vmap(feed)(tokens, cache, index, position)
            return logits, cache, None
        step = jax.vmap(lambda t, c, i, p: self.model.decode_step(t, c, index=i, position=p))

        def body(cache, xs):
            tok, j = xs
            logits, cache = step(tok, cache, index + j, position + j)
            return cache, (logits, cache)

        C = tokens.shape[1]
        cache, (logits, caches) = jax.lax.scan(
            body, cache, (tokens.T, jnp.arange(C, dtype=jnp.int32))
        )
        return jnp.swapaxes(logits, 0, 1), cache, caches


class _SpecState(eqx.Module):
    """Carry of the speculative loop. A row has emitted `count` tokens; the last of them,
    `last` (rotary position `position`), is not yet in either cache and sits at slot
    `P + count - 1`; `prev` is the token before it (the last prompt token at first),
    which a draft with `decode_chunk` may not have been fed yet either. `tokens` /
    `logprobs` are `[B, N + k + 1]` (a pass writes up to `k + 1` tokens from `count` on;
    the tail past `N` is cut at the end)."""

    round: Int[Array, ""]
    count: Int[Array, " B"]
    done: Bool[Array, " B"]
    prev: Int[Array, " B"]
    last: Int[Array, " B"]
    position: Int[Array, " B"]
    target_cache: Any
    draft_cache: Any
    tokens: Int[Array, "B W"]
    logprobs: Float[Array, "B W"]
    passes: Int[Array, " B"]
    accepted: Int[Array, " B"]


def _write(buf: Array, values: Array, start: Int[Array, " B"], m: Int[Array, " B"]) -> Array:
    """Per row, `buf[start : start + m] = values[:m]` (`values` is `[B, C]`)."""
    C = values.shape[1]

    def row(b, v, s, n):
        old = jax.lax.dynamic_slice(b, (s,), (C,))
        return jax.lax.dynamic_update_slice(b, jnp.where(jnp.arange(C) < n, v, old), (s,))

    return jax.vmap(row)(buf, values, start, m)


def _generate_speculative(
    target: AbstractDecoder,
    draft: AbstractDecoder,
    prompts: Int[Array, "B P"],
    prompt_masks: Bool[Array, "B P"],
    key: PRNGKeyArray,
    opts: SamplingOptions,
    k: int,
) -> tuple[GenerationOutput, SpeculativeStats]:
    B, P = prompts.shape
    N = opts.max_new_tokens
    greedy = opts.temperature == 0.0
    prompts = _int32_prompts(target, prompts, opts, "prompt ids outside [0, vocab_size)")
    size = P + N + k  # a pass writes up to k slots past the last emitted token
    out = jax.vmap(lambda t, m: target.prefill(t, m, cache_size=size))(prompts, prompt_masks)
    _check_decoder_output(target, "prefill", out)
    logits0, tcache = out
    feed_target, feed_draft = _Feeder(target), _Feeder(draft)
    # A draft with decode_chunk gets its prompts left-aligned (the same positions; its
    # cache is its own), so that the last prompt token sits in slot P - 1, right before
    # the first new token, and can be fed again with it as a chunk of two (below).
    order = jnp.argsort(prompt_masks, axis=1, stable=True)
    aligned = jnp.take_along_axis(prompts, order, axis=1)
    dprompts, dmasks = (
        (aligned, jnp.take_along_axis(prompt_masks, order, axis=1))
        if feed_draft.chunked
        else (prompts, prompt_masks)
    )
    dout = jax.vmap(lambda t, m: draft.prefill(t, m, cache_size=size))(dprompts, dmasks)
    _check_decoder_output(draft, "prefill", dout)
    dcache = dout[1]
    prev0 = aligned[:, -1]
    if opts.num_samples > 1:
        rep = lambda x: jnp.repeat(x, opts.num_samples, axis=0)
        logits0, tcache, dcache, prompts, prompt_masks, prev0 = jax.tree.map(
            rep, (logits0, tcache, dcache, prompts, prompt_masks, prev0)
        )
        B = B * opts.num_samples
    stop_ids = jnp.asarray(opts.eos_id, jnp.int32)

    def is_stop(t):
        if not opts.eos_id:
            return jnp.zeros(t.shape, jnp.bool_)
        return jnp.any(t[..., None] == stop_ids.reshape((1,) * t.ndim + (-1,)), axis=-1)

    first_key, loop_key = jax.random.split(key)
    rows = jnp.arange(B)
    W = N + k + 1
    zero = jnp.zeros((), jnp.int32)

    # the first token comes from the prompt's prefill, as in generate_batch
    tok0, lp0 = _row_sampler(opts)(jax.random.split(first_key, B), logits0)
    init = _SpecState(
        round=zero,
        count=jnp.ones((B,), jnp.int32),
        done=is_stop(tok0) | (N == 1),
        prev=prev0,
        last=tok0,
        position=jnp.sum(prompt_masks, axis=-1, dtype=jnp.int32),
        target_cache=tcache,
        draft_cache=dcache,
        tokens=jnp.full((B, W), opts.pad_id, jnp.int32).at[:, 0].set(tok0),
        logprobs=jnp.zeros((B, W), jnp.float32).at[:, 0].set(lp0),
        passes=jnp.zeros((B,), jnp.int32),
        accepted=jnp.zeros((B,), jnp.int32),
    )

    def propose(key, logits):
        """A draft token per row and (sampling) the draft's distribution `q`."""
        if greedy:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
        filtered = _filtered(logits, opts)
        tok = jax.vmap(inverse_cdf_sample)(jax.random.split(key, B), filtered)
        return tok, jax.nn.softmax(filtered, axis=-1)

    def body(s: _SpecState) -> _SpecState:
        kround, ku, kr = jax.random.split(jax.random.fold_in(loop_key, s.round), 3)
        kd = jax.random.split(kround, k)
        index = P + s.count - 1

        if feed_draft.chunked:
            # `prev` and `last` in one chunk (`prev` is in the draft's cache already
            # unless all k proposals were accepted: feeding it again rewrites its slot
            # with the same keys and values), then the first k - 1 proposals: k draft
            # passes, none spent on a proposal that only the next pass would use
            two = jnp.stack([s.prev, s.last], axis=1)
            logits, dcache, _ = feed_draft(two, s.draft_cache, index - 1, s.position - 1)
            d0, q0 = propose(kd[0], logits[:, 1])

            def draft_step(carry, xs):
                tok, cache = carry
                j, dkey = xs
                logits, cache, _ = feed_draft(tok[:, None], cache, index + j, s.position + j)
                d, q = propose(dkey, logits[:, 0])
                return (d, cache), (d, q)

            (_, dcache), (rest, q_rest) = jax.lax.scan(
                draft_step, (d0, dcache), (jnp.arange(1, k, dtype=jnp.int32), kd[1:])
            )
            drafts = jnp.concatenate([d0[:, None], rest.T], axis=1)  # [B, k]
            q = None if greedy else jnp.concatenate([q0[None], q_rest], axis=0)
        else:
            # feed the last emitted token and every proposal, keeping the cache after
            # each step for the one after the last accepted token
            def draft_step(carry, xs):
                tok, cache = carry
                j, dkey = xs
                logits, cache, _ = feed_draft(tok[:, None], cache, index + j, s.position + j)
                d, q = propose(dkey, logits[:, 0])
                return (d, cache), (d, q, cache)

            (d_last, dcache), (drafts, q, dcaches) = jax.lax.scan(
                draft_step, (s.last, s.draft_cache), (jnp.arange(k, dtype=jnp.int32), kd)
            )
            drafts = drafts.T  # [B, k]
            # the last proposal enters the cache too, for when all k are accepted
            _, dcache, _ = feed_draft(d_last[:, None], dcache, index + k, s.position + k)
            dcaches = jax.tree.map(
                lambda a, b: jnp.concatenate([a, b[None]], axis=0), dcaches, dcache
            )

        # the target scores the last emitted token and the k proposals in one pass
        chunk = jnp.concatenate([s.last[:, None], drafts], axis=1)  # [B, k + 1]
        tlogits, tcache, tcaches = feed_target(chunk, s.target_cache, index, s.position)
        tlogits = tlogits.astype(jnp.float32)

        if greedy:
            best = jnp.argmax(tlogits, axis=-1).astype(jnp.int32)  # [B, k + 1]
            ok = drafts == best[:, :k]
            n = jnp.sum(jnp.cumprod(ok, axis=1), axis=1, dtype=jnp.int32)
            new = best[rows, n]
        else:
            q = jnp.swapaxes(q, 0, 1)  # [B, k, V]
            filtered = _filtered(tlogits, opts)
            p = jax.nn.softmax(filtered, axis=-1)  # [B, k + 1, V]
            u = jax.random.uniform(ku, (B, k), jnp.float32)
            # accept x with probability min(1, p(x) / q(x)); q(x) > 0 for a drawn x
            ok = u * _take(q, drafts) < _take(p[:, :k], drafts)
            n = jnp.sum(jnp.cumprod(ok, axis=1), axis=1, dtype=jnp.int32)
            # residual max(0, p - q) at the first rejection; with q = 0 after the last
            # proposal it is p itself there (the bonus token)
            q_n = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)[rows, n]
            p_n = p[rows, n]
            residual = jnp.maximum(p_n - q_n, 0.0)
            residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_n)
            new = jax.vmap(inverse_cdf_sample)(jax.random.split(kr, B), jnp.log(residual))

        steps = jnp.arange(k + 1, dtype=jnp.int32)
        emitted = jnp.where(
            steps[None, :] == n[:, None],
            new[:, None],
            jnp.concatenate([drafts, drafts[:, :1]], axis=1),
        )
        # log-probabilities under the target at the sampling temperature (1 when greedy)
        scaled = tlogits if greedy else tlogits / opts.temperature
        lp = _take(scaled, emitted) - jax.nn.logsumexp(scaled, axis=-1)

        # a row keeps the accepted tokens and the new one, up to its first stop id and
        # its token budget
        active = ~s.done
        stop = is_stop(emitted) & (steps[None, :] <= n[:, None])
        first_stop = jnp.argmax(stop, axis=1).astype(jnp.int32)
        stopped = jnp.any(stop, axis=1)
        m = jnp.where(stopped, first_stop + 1, n + 1)
        m = jnp.where(active, jnp.minimum(m, N - s.count), 0)
        done = s.done | (active & ((stopped & (first_stop < m)) | (s.count + m >= N)))

        if not feed_target.chunked:
            tcache = _pick(tcaches, n)
        if not feed_draft.chunked:
            dcache = _pick(dcaches, n)
        return _SpecState(
            round=s.round + 1,
            count=s.count + m,
            done=done,
            prev=jnp.where(active, jnp.where(n > 0, drafts[rows, n - 1], s.last), s.prev),
            last=jnp.where(active, new, s.last),
            position=jnp.where(active, s.position + n + 1, s.position),
            target_cache=tcache,
            draft_cache=dcache,
            tokens=_write(s.tokens, emitted, s.count, m),
            logprobs=_write(s.logprobs, lp, s.count, m),
            passes=s.passes + active.astype(jnp.int32),
            accepted=s.accepted + jnp.where(active, n, 0),
        )

    s = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, init)
    real = jnp.arange(N)[None, :] < s.count[:, None]
    tokens = jnp.where(real, s.tokens[:, :N], jnp.asarray(opts.pad_id, jnp.int32))
    logprobs = jnp.where(real, s.logprobs[:, :N], 0.0)
    stats = SpeculativeStats(target_passes=s.passes, proposed=k * s.passes, accepted=s.accepted)
    return _with_prompts(prompts, prompt_masks, _Completions(tokens, logprobs, real)), stats


_generate_speculative_jit = eqx.filter_jit(_generate_speculative)


def generate_speculative(
    target: AbstractDecoder,
    draft: Any,  # checked below, so that a wrong draft or k gets a one-line error
    prompts: Integer[ArrayLike, "B P"],
    prompt_masks: Bool[ArrayLike, "B P"] | Integer[ArrayLike, "B P"],
    key: PRNGKeyArray,
    *,
    k: Any = 4,
    with_stats: bool = False,
    **options: Any,
) -> GenerationOutput | tuple[GenerationOutput, SpeculativeStats]:
    r"""Sample completions of the `target` with a `draft` model proposing `k` tokens at a
    time, all in one compiled `lax.while_loop` (speculative sampling: Leviathan et al.
    2023; Chen et al. 2023).

    Each pass, the draft proposes `x_1 … x_k ~ q` one decode step at a time; the target
    scores the last emitted token and the `k` proposals in one pass over its KV cache
    (`decode_chunk` when it is an `AbstractChunkDecoder`, such as `Policy`; `k + 1`
    decode steps otherwise); proposal `i` is accepted with probability `min(1,
    p(x_i)/q(x_i))`, the first rejected one is replaced by a draw from `max(0, p −
    q)` normalised, and when all are accepted a bonus token is drawn from `p`. `p` and
    `q` are the target's and the draft's distributions after temperature, top-k,
    top-p and min-p (those `generate_batch` samples from), so the completions are
    distributed as `generate_batch(target, ...)`'s, whatever the draft; greedy
    (`temperature=0`) gives exactly its tokens. Rows accept different numbers of
    tokens: each keeps its own count, positions and cache slots. A decoder's cache is
    rolled back to the last accepted token (a chunk fed at a slot drops the slots after
    it; other decoders keep the cache after each step of the pass and the right one is
    picked).

    **Arguments:**

    - `target`: the model to sample from (`rlhf_eqx.models.AbstractDecoder`).
    - `draft`: any decoder over the same vocabulary, e.g. a small model of the same
      family or `rlhf_eqx.models.truncated_draft(target, n_layers)`.
    - `prompts`, `prompt_masks`, `key`: as for `generate_batch` (JAX or NumPy integer
      ids; bool or 0 / 1 integer masks).
    - `k`: tokens the draft proposes per target pass (a positive int).
    - `with_stats`: also return a `SpeculativeStats` (target passes, proposed and
      accepted tokens per row).
    - `**options`: the fields of `SamplingOptions`, as for `generate_batch`, except the
      penalties: a `repetition_penalty` other than 1 or a non-zero `presence_penalty` /
      `frequency_penalty` is refused (the target's penalised distribution at each
      proposal depends on the proposals before it; sample with `generate_batch`).

    **Returns:** a `GenerationOutput` with the same fields as `generate_batch`'s:
    `logprobs` are the log-probabilities of the sampled tokens under the target at the
    sampling temperature; with `with_stats`, the pair `(output, stats)`.

    Bad arguments raise one line naming them: `k`, a `draft` (or `target`) that is not
    a decoder, a draft whose `vocab_size` differs from the target's, a penalty that is on.
    """
    k = _check_k(k)
    _check_models(target, draft)
    opts = SamplingOptions(**options)
    if opts.penalized:
        on = [
            f"{name}={getattr(opts, name)!r}"
            for name, off in (
                ("repetition_penalty", 1),
                ("presence_penalty", 0),
                ("frequency_penalty", 0),
            )
            if getattr(opts, name) != off
        ]
        raise ValueError(
            f"generate_speculative does not take sampling penalties (got {', '.join(on)}): "
            "use generate_batch or generate_continuous for penalised sampling"
        )
    prompts, prompt_masks = _check_batch(target, prompts, prompt_masks, opts)
    out, stats = _generate_speculative_jit(target, draft, prompts, prompt_masks, key, opts, k)
    return (out, stats) if with_stats else out
