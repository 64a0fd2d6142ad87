"""Continuous batching: a fixed number of decode slots, refilled inside one compiled loop.

`generate_batch` decodes a static batch: every row steps until the longest one is done,
so on a mix of completion lengths most of the work goes to rows that have already
stopped. `generate_continuous` keeps `slots` rows in flight instead; when a row stops
(a stop id, a stop sequence or its token budget), the next waiting request is prefilled
into that row's cache region and decoding goes on, all inside one `lax.while_loop`.

The argument checks (concrete prompt ids and masks, stop sequences, one key per prompt)
and the stop-sequence table the loop matches against come first.
"""

import dataclasses
import numbers
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int, Integer, Key, Real, UInt32

from ..models import AbstractDecoder
from ._decode import (
    _check_decoder,
    _check_decoder_output,
    _check_length,
    _Completions,
    _int32_prompts,
    _row_keys,
    _row_sampler,
    _with_prompts,
    check_stop_ids,
    prompt_arrays,
)
from ._options import (
    DEFAULT_TEMPERATURE,
    Count,
    GenerationOutput,
    Number,
    SamplingOptions,
    _plain,
    check_min_p,
    check_penalty,
    check_repetition_penalty,
    check_temperature,
    check_top_p,
    penalties_on,
)
from ._penalties import Seen
from ._token import RowPenalties, sample_rows


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_stop_sequences(stop_sequences: Any, vocab_size: int) -> tuple[tuple[int, ...], ...]:
    if stop_sequences is None:
        return ()
    if isinstance(stop_sequences, str) or not isinstance(stop_sequences, Sequence):
        raise TypeError(
            "stop_sequences must be a sequence of token-id sequences (tokenize stop strings "
            f"first), got {stop_sequences!r}"
        )
    out = []
    for seq in stop_sequences:
        if isinstance(seq, str) or not isinstance(seq, Sequence) or len(seq) == 0:
            raise ValueError(
                f"stop_sequences: each entry must be a non-empty sequence of ids, got {seq!r}"
            )
        if not all(_is_int(i) and 0 <= i < vocab_size for i in seq):
            raise ValueError(
                f"stop_sequences: {list(seq)!r} has ids outside the vocabulary [0, {vocab_size})"
            )
        out.append(tuple(int(i) for i in seq))
    return tuple(out)


def _key_array(keys: Any, num_prompts: int) -> Key[Array, " R"]:
    """`keys` as typed keys `[R]` (raw `uint32[R, 2]` keys are wrapped)."""
    if not isinstance(keys, jax.Array):
        raise TypeError(f"keys must be a JAX array of PRNG keys, got {type(keys).__name__}")
    typed = jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key)
    if not typed:
        if keys.ndim != 2 or keys.shape[-1] != 2 or keys.dtype != jnp.uint32:
            raise ValueError(
                f"keys must be {num_prompts} PRNG keys (jax.random.split(key, {num_prompts}) "
                f"or raw uint32[{num_prompts}, 2]), got {keys.dtype}{list(keys.shape)}"
            )
        keys = jax.random.wrap_key_data(keys)
    if keys.shape != (num_prompts,):
        raise ValueError(
            f"keys must hold one PRNG key per prompt: expected shape ({num_prompts},), "
            f"got {keys.shape}"
        )
    return keys


def _stop_table(
    stop_sequences: tuple[tuple[int, ...], ...],
) -> tuple[np.ndarray, np.ndarray]:
    """Stop sequences right-aligned in a `[Q, L]` table, with the `[Q, L]` positions
    each one constrains (the others are wildcards)."""
    L = max(len(s) for s in stop_sequences)
    table = np.zeros((len(stop_sequences), L), np.int32)
    care = np.zeros((len(stop_sequences), L), np.bool_)
    for q, seq in enumerate(stop_sequences):
        table[q, L - len(seq) :] = seq
        care[q, L - len(seq) :] = True
    return table, care


class _Plan(eqx.Module):
    """The static settings of one compiled continuous-batching program."""

    opts: SamplingOptions
    slots: int
    prefill_rows: int
    stop_sequences: tuple[tuple[int, ...], ...]
    top_logprobs: int = 0  # alternatives kept per sampled token (`ContinuousDecoding`)


# Fields like `_DecodeState`'s (the static-batch loop's carry), but a slot is not a row: slots
# carry their row, step and position, and the staged prefills.
class _SlotState(eqx.Module):
    """Carry of the loop. `S` slots decode rows of the `[R·G, N]` output buffers.

    `staged_*` are the prefills of prompts `staged_first …` (`prefill_rows` of them, run
    as one batch); each admitted row copies its prompt's prefill into its slot. `cache`
    holds the slots' cache regions here, and the pool of pages with its bookkeeping in
    `generate_paged`'s loop.
    """

    slot_row: Int[Array, " S"]  # output row a slot decodes; -1 when the slot is free
    slot_step: Int[Array, " S"]  # tokens that row has generated so far
    slot_position: Int[Array, " S"]  # rotary position of the next token fed
    logits: Float[Array, "S V"]
    cache: Any
    recent: Int[Array, "S L"]  # the row's last L generated ids (-1 before its start)
    next_row: Int[Array, ""]
    staged_first: Int[Array, ""]
    staged_logits: Float[Array, "M V"]
    staged_cache: Any
    out: _Completions
    # `(ids, logprobs)` `[R·G, N, K]`: the K most likely tokens at each sampled position
    # (`_Plan.top_logprobs`; `None` when 0)
    top: Any = None
    # the slots' rows' context and generated counts (`Seen`, `[S, V]`) when a penalty is on
    seen: Any = None


def _zeros(n: int, tree: Any) -> Any:
    """Zeros shaped like the leaves of `tree` with their leading axis replaced by `n`."""
    return jax.tree.map(lambda x: jnp.zeros((n,) + x.shape[1:], x.dtype), tree)


def _prefill(policy: AbstractDecoder, prompts, prompt_masks, cache_size: int):
    """`policy.prefill` into caches of `cache_size` entries, vmapped over prompts, and the
    shapes of its output for one prompt (checked to be `(logits [vocab_size], cache)`)."""
    prefill = jax.vmap(lambda t, m: policy.prefill(t, m, cache_size=cache_size))
    one = jax.eval_shape(prefill, prompts[:1], prompt_masks[:1])
    _check_decoder_output(policy, "prefill", one)
    return prefill, one


def _start(plan: _Plan, rows: int, one: Any, width: int, penalized: bool) -> dict[str, Any]:
    """The carry fields both continuous loops start with: every slot free, no row
    admitted, no prompt staged (zeros shaped like the prefill's output `one`), the
    `[rows, max_new_tokens]` outputs empty; `width` is the stop table's `L`; with
    `penalized`, the slots' (empty) `Seen` tokens."""
    S = plan.slots
    staged_logits, staged_cache = _zeros(plan.prefill_rows, one)
    V = one[0].shape[-1]
    seen = None
    if penalized:
        seen = Seen(jnp.zeros((S, V), jnp.bool_), jnp.zeros((S, V), jnp.int32))
    return dict(
        seen=seen,
        slot_row=jnp.full((S,), -1, jnp.int32),
        slot_step=jnp.zeros((S,), jnp.int32),
        slot_position=jnp.zeros((S,), jnp.int32),
        recent=jnp.full((S, width), -1, jnp.int32),
        next_row=jnp.zeros((), jnp.int32),
        staged_first=jnp.asarray(-plan.prefill_rows, jnp.int32),
        staged_logits=staged_logits,
        staged_cache=staged_cache,
        out=_Completions.empty(rows, plan.opts.max_new_tokens, plan.opts.pad_id),
    )


def _staged(s: _SlotState, p, restage, prefill, prompts, prompt_masks, rows: int):
    """The staged prefills that hold prompt `p`: `s`'s, unless `restage`, when prompts
    `p …` (`rows` of them, one batch) are prefilled now. Returns `(first, staged_logits,
    staged_cache)` and `at`, which picks prompt `p`'s entry of a staged array."""

    def stage():
        idx = jnp.minimum(p + jnp.arange(rows, dtype=jnp.int32), prompts.shape[0] - 1)
        return p, *prefill(prompts[idx], prompt_masks[idx])

    staged = jax.lax.cond(restage, stage, lambda: (s.staged_first, s.staged_logits, s.staged_cache))
    at = lambda x: jax.lax.dynamic_index_in_dim(x, p - staged[0], 0, keepdims=False)
    return staged, at


def _admitted(s: _SlotState, slot, position, logits, cache, staged, prompt) -> _SlotState:
    """`s` with its next waiting row in slot `slot` (step 0, rotary position `position`,
    no recent tokens, its `prompt`'s real tokens as its context: `(ids [P], mask [P])`),
    the slots' new `logits` and `cache`, and the staged prefills `staged` (`(first,
    staged_logits, staged_cache)`, from `_staged`)."""
    first, staged_logits, staged_cache = staged
    return dataclasses.replace(
        s,
        slot_row=s.slot_row.at[slot].set(s.next_row),
        slot_step=s.slot_step.at[slot].set(0),
        slot_position=s.slot_position.at[slot].set(position),
        logits=logits,
        cache=cache,
        recent=s.recent.at[slot].set(-1),
        next_row=s.next_row + 1,
        staged_first=first,
        staged_logits=staged_logits,
        staged_cache=staged_cache,
        seen=None if s.seen is None else s.seen.admitted(slot, *prompt),
    )


def _stops(opts, stop_sequences) -> tuple:
    """What ends a row in the continuous loops: `(pad_id, eos_id, stop_ids, table, care,
    L)`, the stop sequences' table (`_stop_table`) and its width `L` (0: none)."""
    stop_ids = jnp.asarray(opts.eos_id, jnp.int32)
    if not stop_sequences:
        return opts.pad_id, opts.eos_id, stop_ids, None, None, 0
    table, care = (jnp.asarray(x) for x in _stop_table(stop_sequences))
    return opts.pad_id, opts.eos_id, stop_ids, table, care, table.shape[1]


def _sample_slots(s, sample, row_keys, budgets, stops):
    """One decode step's sampling for every slot of the continuous loop's state `s`
    (`slot_row`, `slot_step`, `logits`, `recent`): each active slot's token and log-prob
    from its row's key folded with its step (a free slot gets the pad id), its row, its recent
    tokens, and whether it stops (at its budget, a stop id or a stop sequence).
    `stops`: `(pad_id, eos_id, stop_ids, table, care, L)` (`_stop_table`)."""
    pad_id, eos_id, stop_ids, table, care, L = stops
    active = s.slot_row >= 0
    row = jnp.where(active, s.slot_row, 0)
    step = s.slot_step
    tok, lp = sample(jax.vmap(jax.random.fold_in)(row_keys[row], step), s.logits, row, s.seen)
    tok = jnp.where(active, tok, jnp.int32(pad_id))
    stop = step + 1 >= budgets[row]
    if eos_id:
        stop = stop | jnp.any(tok[:, None] == stop_ids[None, :], axis=-1)
    recent = s.recent
    if L:
        recent = jnp.concatenate([recent[:, 1:], tok[:, None]], axis=1)
        hit = (recent[:, None, :] == table[None]) | ~care[None]
        stop = stop | jnp.any(jnp.all(hit, axis=-1), axis=-1)
    return active, row, step, tok, lp, recent, stop


class _RowSettings(eqx.Module):
    """Per-row sampling settings, traced: `[B]` temperatures (0: greedy), top-k (0: off),
    top-p (1: off), min-p (0: off) and, when a penalty is on for some row, the
    `(repetition, presence, frequency)` penalties (1, 0, 0: off; `None`: off for all)."""

    temperature: Float[Array, " B"]
    top_k: Int[Array, " B"]
    top_p: Float[Array, " B"]
    min_p: Float[Array, " B"]
    penalties: tuple[Float[Array, " B"], Float[Array, " B"], Float[Array, " B"]] | None = None


def _slot_sampler(opts: SamplingOptions, settings: _RowSettings | None):
    """`sample(keys [S], logits [S, V], rows [S], seen) -> (tokens [S], logprobs [S])`
    for the slots decoding `rows` (`seen`: their `Seen` tokens when a penalty is on):
    `opts`' settings, or each row's own (`settings`)."""
    if settings is None:
        static = _row_sampler(opts)
        return lambda keys, logits, rows, seen: static(keys, logits, seen)

    def sample(keys, logits, rows, seen):
        penalties = None
        if settings.penalties is not None:
            r, p, f = (x[rows] for x in settings.penalties)
            penalties = RowPenalties(repetition=r, presence=p, frequency=f, seen=seen)
        return sample_rows(
            keys,
            logits,
            settings.temperature[rows],
            settings.top_k[rows],
            settings.top_p[rows],
            settings.min_p[rows],
            penalties,
        )

    return sample


def _slot_top(
    logits: Float[Array, "S V"],
    rows: Int[Array, " S"],
    sampled: tuple[Int[Array, " S"], Float[Array, " S"]],
    opts: SamplingOptions,
    settings: _RowSettings | None,
    k: int,
) -> tuple[Int[Array, "S K"], Float[Array, "S K"]]:
    """The `k` most likely next tokens of each slot and their log-probabilities
    `log softmax(logits / τ)` at its row's temperature `τ` (1 when greedy): the
    distribution the sampled token's log-probability is read from, computed as the
    sampler computes it (`sample_token`, `sample_rows`); the entry of the token sampled
    (`sampled`: tokens and log-probabilities `[S]`) is its log-probability, so the two
    agree exactly whatever the rounding of either computation."""
    logits = logits.astype(jnp.float32)
    if settings is None:
        scaled = logits if opts.temperature == 0.0 else logits / opts.temperature
    else:
        t = settings.temperature[rows]
        scaled = logits / jnp.where(t == 0.0, 1.0, t).astype(jnp.float32)[:, None]
    logp = scaled - jax.nn.logsumexp(scaled, axis=-1, keepdims=True)
    values, ids = jax.lax.top_k(logp, min(k, logp.shape[-1]))
    tok, lp = sampled
    return ids.astype(jnp.int32), jnp.where(ids == tok[:, None], lp[:, None], values)


def _is_per_row(x: object) -> bool:
    return isinstance(x, np.ndarray | jax.Array | Sequence) and not isinstance(x, str)


def _row_values(value: Any, rows: int, name: str, off: Any, dtype) -> Any:
    """A per-row setting as a `[rows]` array (a scalar repeated; `None`: `off`)."""
    if value is None:
        value = off
    if not _is_per_row(value):
        return jnp.asarray(np.full((rows,), value, dtype))  # built on the host: no program
    arr = value if isinstance(value, jax.Array) else np.asarray(value)
    if arr.shape != (rows,):
        raise ValueError(
            f"{name}: one value per output row (R · num_samples = {rows}), got shape "
            f"{tuple(arr.shape)}"
        )
    return arr.astype(dtype) if arr.dtype != dtype else jnp.asarray(arr)


_PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")


def _row_settings(
    temperature: Any, top_k: Any, top_p: Any, min_p: Any, rows: int, penalties: tuple = (1, 0, 0)
) -> _RowSettings | None:
    """`None` when the seven settings (`penalties`: repetition, presence, frequency) are
    scalars (compiled into the sampler); else each as a `[rows]` array (traced: one
    program serves every value; the penalties only when one is per row or on), checked
    when concrete."""
    if not any(_is_per_row(x) for x in (temperature, top_k, top_p, min_p, *penalties)):
        return None
    checks = (
        (temperature, check_temperature),
        (top_p, check_top_p),
        (min_p, check_min_p),
        (penalties[0], check_repetition_penalty),
        (penalties[1], lambda x: check_penalty("presence_penalty", x)),
        (penalties[2], lambda x: check_penalty("frequency_penalty", x)),
    )
    for x, check in checks:
        if not _is_per_row(x):
            check(x)
    if not _is_per_row(top_k) and top_k is not None and not (_is_int(top_k) and top_k >= 0):
        raise ValueError(f"top_k must be a non-negative int (0: off) or None, got {top_k!r}")
    settings = _RowSettings(
        temperature=jnp.asarray(_row_values(temperature, rows, "temperature", 0.0, np.float32)),
        top_k=jnp.asarray(_row_values(top_k, rows, "top_k", 0, np.int32)),
        top_p=jnp.asarray(_row_values(top_p, rows, "top_p", 1.0, np.float32)),
        min_p=jnp.asarray(_row_values(min_p, rows, "min_p", 0.0, np.float32)),
    )
    if any(_is_per_row(x) for x in penalties) or penalties_on(*penalties):
        values = zip(penalties, _PENALTIES, (1.0, 0.0, 0.0))
        settings = dataclasses.replace(
            settings,
            penalties=tuple(
                jnp.asarray(_row_values(x, rows, name, off, np.float32)) for x, name, off in values
            ),
        )
    if not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(settings)):
        _check_row_penalties(settings.penalties)
        t, k, p, m = (np.asarray(x) for x in jax.tree.leaves(settings)[:4])
        if not (np.all(np.isfinite(t)) and np.all(t >= 0)):
            raise ValueError(f"temperature: each row's must be a number >= 0, got {t.tolist()}")
        if np.any(k < 0):
            raise ValueError(f"top_k: each row's must be >= 0 (0: off), got {k.tolist()}")
        if not np.all((p > 0) & (p <= 1)):
            raise ValueError(f"top_p: each row's must lie in (0, 1], got {p.tolist()}")
        if not np.all((m >= 0) & (m <= 1)):
            raise ValueError(f"min_p: each row's must lie in [0, 1] (0: off), got {m.tolist()}")
    return settings


def _check_row_penalties(penalties: tuple | None) -> None:
    """Raise naming the setting and the rows' values when a concrete per-row penalty is out
    of range (repetition: finite and > 0; presence, frequency: in [-2, 2])."""
    if penalties is None:
        return
    r, p, f = (np.asarray(x) for x in penalties)
    if not (np.all(np.isfinite(r)) and np.all(r > 0)):
        raise ValueError(
            f"repetition_penalty: each row's must be a finite number > 0 (1: off), got {r.tolist()}"
        )
    for name, x in (("presence_penalty", p), ("frequency_penalty", f)):
        if not np.all((x >= -2) & (x <= 2)):
            raise ValueError(f"{name}: each row's must lie in [-2, 2] (0: off), got {x.tolist()}")


def _continuous_loop(
    policy: AbstractDecoder,
    prompts: Int[Array, "R P"],
    prompt_masks: Bool[Array, "R P"],
    keys: Key[Array, " R"],
    budgets: Int[Array, " B"],
    settings: _RowSettings | None,
    plan: _Plan,
    cancelled: Bool[Array, " B"] | None = None,
):
    """The continuous loop's pieces: `(init, cond, body, finish)`, the carry it starts
    with, whether rows remain, one decode step of every slot (the new carry and what the
    step wrote: `[S]` output rows (`R · num_samples` for a free slot), steps, tokens and
    log-probabilities, then with `plan.top_logprobs = K` the `[S, K]` ids and
    log-probabilities of the likeliest tokens), and the output of a carry.
    Rows marked in `cancelled` stop where they are (their slots are freed and a waiting
    one is never admitted)."""
    opts = plan.opts
    R, P = prompts.shape
    N, G = opts.max_new_tokens, opts.num_samples
    B = R * G
    S = plan.slots
    prompts = _int32_prompts(policy, prompts, opts, "prompts: ids outside [0, vocab_size)")
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # int32 indices also under jax_enable_x64

    prefill, one = _prefill(policy, prompts, prompt_masks, P + N)
    decode = jax.vmap(lambda tok, c, idx, pos: policy.decode_step(tok, c, index=idx, position=pos))
    sample = _slot_sampler(opts, settings)
    penalized = opts.penalized or (settings is not None and settings.penalties is not None)
    logits0, cache0 = _zeros(S, one)
    ids0 = jnp.zeros((S,), jnp.int32)
    _check_decoder_output(
        policy, "decode_step", jax.eval_shape(decode, ids0, cache0, ids0, ids0), cache0
    )
    M = plan.prefill_rows
    row_keys = _row_keys(keys, G)
    n_real = jnp.sum(prompt_masks, axis=-1, dtype=jnp.int32)
    stops = _stops(opts, plan.stop_sequences)

    def waiting(s: _SlotState):
        return (s.next_row < B) & jnp.any(s.slot_row < 0)

    def admit(s: _SlotState) -> _SlotState:
        """Put the next waiting row into the first free slot; when its prompt is not
        staged, prefill it and the next `M - 1` prompts first (one batch)."""
        slot = i32(jnp.argmax(s.slot_row < 0))
        p = s.next_row // G
        staged, at = _staged(s, p, p >= s.staged_first + M, prefill, prompts, prompt_masks, M)
        put = lambda buf, x: jax.lax.dynamic_update_index_in_dim(buf, at(x), slot, 0)
        logits = put(s.logits, staged[1])
        cache = jax.tree.map(put, s.cache, staged[2])
        prompt = (prompts[p], prompt_masks[p])
        return _admitted(s, slot, n_real[p], logits, cache, staged, prompt)

    if cancelled is not None:
        admit_one = admit

        def admit(s: _SlotState) -> _SlotState:  # noqa: F811 - a cancelled row is skipped
            skip = cancelled[jnp.minimum(s.next_row, B - 1)]
            passed = lambda s: dataclasses.replace(s, next_row=s.next_row + 1)
            return jax.lax.cond(skip, passed, admit_one, s)

    def cond(s: _SlotState):
        return (s.next_row < B) | jnp.any(s.slot_row >= 0)

    def body(s: _SlotState) -> tuple[_SlotState, tuple]:
        if cancelled is not None:
            gone = (s.slot_row >= 0) & cancelled[jnp.maximum(s.slot_row, 0)]
            s = dataclasses.replace(s, slot_row=jnp.where(gone, -1, s.slot_row))
        s = jax.lax.while_loop(waiting, admit, s)
        active, row, step, tok, lp, recent, stop = _sample_slots(
            s, sample, row_keys, budgets, stops
        )
        going = active & ~stop
        # write the sampled tokens at (row, step); free slots point past the buffers
        out_row = jnp.where(active, s.slot_row, B)
        write = lambda buf, x: buf.at[out_row, step].set(x, mode="drop")

        def advance(args):
            logits, cache = args
            index = P + jnp.minimum(step, N - 1)
            return decode(tok, cache, index, s.slot_position)

        logits, cache = jax.lax.cond(
            jnp.any(going), advance, lambda args: args, (s.logits, s.cache)
        )
        wrote, top = (out_row, step, tok, lp), s.top
        if plan.top_logprobs:
            alternatives = _slot_top(s.logits, row, (tok, lp), opts, settings, plan.top_logprobs)
            top = tuple(write(buf, x) for buf, x in zip(top, alternatives))
            wrote = wrote + alternatives
        s = dataclasses.replace(
            s,
            slot_row=jnp.where(going, s.slot_row, -1),
            slot_step=step + 1,
            slot_position=s.slot_position + 1,
            logits=logits,
            cache=cache,
            recent=recent,
            out=s.out.written(write, tok, lp, active),
            top=top,
            seen=None if s.seen is None else s.seen.after(tok, active),
        )
        return s, wrote

    K = min(plan.top_logprobs, one[0].shape[-1])
    top0 = (jnp.zeros((B, N, K), jnp.int32), jnp.zeros((B, N, K), jnp.float32)) if K else None
    init = lambda: _SlotState(
        logits=logits0, cache=cache0, top=top0, **_start(plan, B, one, stops[-1], penalized)
    )
    rep = lambda x: jnp.repeat(x, G, axis=0)
    finish = lambda s: _with_prompts(rep(prompts), rep(prompt_masks), s.out)
    return init, cond, body, finish


def _generate_continuous(*inputs: Any) -> GenerationOutput:
    """The whole loop in one program (`inputs`: `_continuous_loop`'s, none cancelled)."""
    init, cond, body, finish = _continuous_loop(*inputs)
    return finish(jax.lax.while_loop(cond, lambda s: body(s)[0], init()))


_generate_continuous_jit = eqx.filter_jit(_generate_continuous)


@eqx.filter_jit
def _continuous_start(inputs: tuple) -> _SlotState:
    """The carry `ContinuousDecoding` starts from (`inputs`: the loop's arguments)."""
    init, *_ = _continuous_loop(*inputs)
    return init()


def _continuous_steps(
    args: tuple[tuple, int, Int[Array, ""], Bool[Array, "B V"] | None], state: _SlotState
) -> tuple[_SlotState, Bool[Array, ""], Int[Array, ""], tuple]:
    """Up to `steps` decode steps from `state` (`args`: the loop's arguments,
    `log_steps`, `steps` and `pause`): the new carry, whether rows remain, the steps run
    and what the first `log_steps` of them wrote (`[log_steps, S]` rows, steps, tokens
    and log-probabilities, and `[log_steps, S, K]` alternatives with
    `plan.top_logprobs = K`; rows `R · num_samples` where nothing was). The steps end
    early after one in which a row `b` sampled a token `t` with `pause[b, t]`."""
    inputs, log_steps, steps, pause = args
    _, cond, body, _ = _continuous_loop(*inputs)
    S, B = state.slot_row.shape[0], state.out.tokens.shape[0]
    log = (
        jnp.full((log_steps, S), B, jnp.int32),
        jnp.zeros((log_steps, S), jnp.int32),
        jnp.zeros((log_steps, S), jnp.int32),
        jnp.zeros((log_steps, S), jnp.float32),
    )
    if state.top is not None:
        K = state.top[0].shape[-1]
        log += (jnp.zeros((log_steps, S, K), jnp.int32), jnp.zeros((log_steps, S, K), jnp.float32))

    def logged(c):
        s, n, log, _ = c
        s, wrote = body(s)
        log = tuple(buf.at[n].set(x, mode="drop") for buf, x in zip(log, wrote))
        paused = jnp.zeros((), bool)
        if pause is not None:
            row, tok = wrote[0], wrote[2]
            paused = jnp.any((row < B) & pause[jnp.minimum(row, B - 1), tok])
        return s, n + 1, log, paused

    start = (state, jnp.zeros((), jnp.int32), log, jnp.zeros((), bool))
    state, n, log, _ = jax.lax.while_loop(
        lambda c: cond(c[0]) & (c[1] < steps) & ~c[3], logged, start
    )
    return state, cond(state), n, log


# the carry (the slots' caches) is donated: each call updates it in place
_continuous_steps_jit = eqx.filter_jit(_continuous_steps, donate="all-except-first")


def generate_continuous(
    policy: AbstractDecoder,
    prompts: Integer[ArrayLike, "R P"],
    prompt_masks: Bool[ArrayLike, "R P"] | Integer[ArrayLike, "R P"],
    keys: Key[Array, " R"] | UInt32[Array, "R 2"],
    *,
    slots: Count,
    max_new_tokens: Count,
    budgets: Int[Array | np.ndarray, " B"] | Sequence[int] | None = None,
    temperature: Number | Real[Array | np.ndarray, " B"] | Sequence[float | int] = (
        DEFAULT_TEMPERATURE
    ),
    top_k: Count | None | Int[Array | np.ndarray, " B"] | Sequence[Count] = None,
    top_p: Number | None | Real[Array | np.ndarray, " B"] | Sequence[float | int] = None,
    min_p: Number | None | Real[Array | np.ndarray, " B"] | Sequence[float | int] = None,
    repetition_penalty: Number | Real[Array | np.ndarray, " B"] | Sequence[float | int] = 1.0,
    presence_penalty: Number | Real[Array | np.ndarray, " B"] | Sequence[float | int] = 0.0,
    frequency_penalty: Number | Real[Array | np.ndarray, " B"] | Sequence[float | int] = 0.0,
    eos_id: Count | Sequence[Count] | Int[np.ndarray, " S"] | None = None,
    stop_sequences: Sequence[Sequence[int]] | None = None,
    pad_id: Count = 0,
    num_samples: Count = 1,
    check_ids: bool = False,
    prefill_rows: Count | None = None,
    cache: str = "dense",
    page_size: Count | None = None,
    num_pages: Count | None = None,
) -> GenerationOutput:
    """Sample completions with continuous batching: `slots` rows decode at once, and a
    row that stops is refilled with the next waiting request inside the same compiled
    loop (Orca's iteration-level scheduling, Yu et al. 2022).

    Each slot has its own KV-cache region (`P + max_new_tokens` entries), cache index
    and rotary position; `prefill` / `decode_step` are vmapped over the slots with
    per-slot indices. Requests are admitted in order (prompt 0's samples first); when a
    slot's row stops, the next row's prompt is prefilled into that slot's cache region
    (a prompt's `num_samples` rows share one prefill, copied into each of their slots)
    and its tokens are written to its own row of the result. The loop ends when every
    row is done. Cost per step is that of `slots` rows, whatever the length mix, where
    `generate_batch` keeps every row of a batch stepping until the longest stops.

    **Determinism.** A request's randomness comes from its own key and token index
    only: with `num_samples=1` prompt `p` draws its `t`-th token with
    `fold_in(keys[p], t)`; with `num_samples=G`, sample `g` of prompt `p` has the row key
    `fold_in(keys[p], g)` and draws token `t` with `fold_in(fold_in(keys[p], g), t)`,
    exactly as if each prompt were passed `G` times with those row keys. A row's tokens
    do not depend on `slots`, on the other requests or on their order (up to the
    floating-point rounding of batched matrix products, which could flip a near-tie).

    **Arguments:**

    - `policy`: a decoder (`rlhf_eqx.models.AbstractDecoder`, e.g. `rlhf_eqx.Policy`).
    - `prompts`, `prompt_masks`: `[R, P]` ids and real-token masks (left padding
      recommended, as for `generate_batch`); each row needs at least one real token.
      As for `generate_batch`: JAX or NumPy arrays, ids of any integer dtype, masks of
      bools or the integers 0 and 1 (another value is a `ValueError` naming
      `prompt_masks`); nested Python lists are refused.
    - `keys`: one PRNG key per prompt, `[R]` (`jax.random.split(key, R)`; raw
      `uint32[R, 2]` keys are accepted). Unused when greedy.
    - `slots`: rows decoded at once (a positive int; more than `R · num_samples` is
      clamped to that).
    - `max_new_tokens`: the longest completion (the width of the result).
    - `budgets`: optional per-row token budgets, `[R · num_samples]` ints in
      `[1, max_new_tokens]` (row order as in the result); default `max_new_tokens`.
    - `temperature`, `top_k`, `top_p`, `min_p`, `repetition_penalty`,
      `presence_penalty`, `frequency_penalty`, `eos_id`, `pad_id`, `num_samples`,
      `check_ids`: as in `generate_batch` (`SamplingOptions`; a row's penalties count
      its own prompt and tokens, a slot's counts are reset when it takes a new row).
      `temperature`, `top_k`, `top_p`, `min_p` and the three penalties may also be
      given per output row, `[R · num_samples]` arrays (a scalar beside them applies to
      every row; `top_k` 0, `top_p` 1, `min_p` 0, `repetition_penalty` 1 and the other
      penalties 0 are off): they are then traced, so one compiled program serves every
      value, each row sampling as it would with its settings given alone (dense cache
      only).
    - `stop_sequences`: token-id sequences (non-empty); a row stops right after the
      first place its generated tokens end with one of them (the sequence is kept, as
      a stop id is). Only completion tokens are matched, never the prompt.
    - `prefill_rows`: prompts prefilled together (one batch) when the next waiting row's
      prompt has not been prefilled yet; default `ceil(slots / 4)`. Larger batches use
      the matrix units better; up to `prefill_rows - 1` prefills are wasted at the end.
    - `cache`: `"dense"` (default: each slot owns a cache region of `P + max_new_tokens`
      entries) or `"paged"`: the slots share a pool of `num_pages` pages of `page_size`
      tokens (default 16), allocated as rows grow and returned when they stop, with the
      full pages of common prompt prefixes shared (`generate_paged`, whose admission
      rule and defaults apply; it also returns the pool's statistics). Same outputs.

    **Returns:** a `GenerationOutput` laid out as `generate_batch`'s: `R · num_samples`
    rows (prompt `p`'s samples at `p · num_samples …`), each the prompt as given followed
    by `max_new_tokens` completion positions (`pad_id` past the row's end), with the
    sampled tokens' log-probabilities.

    Shapes of `prompts`, `prompt_masks`, `keys` that disagree (not one key per prompt)
    raise jaxtyping's `TypeCheckError` (the shape checks, on by default; `ValueError`
    with `RLHF_EQX_TYPECHECK=0`). Raises `ValueError` naming the argument for
    `slots < 1`, concrete prompt ids outside the vocabulary, an empty prompt, budgets
    out of range, malformed stop sequences, a stop id (`eos_id`) outside the vocabulary,
    or `P + max_new_tokens` above the model's `max_seq_len`.
    """
    if cache not in ("dense", "paged"):
        raise ValueError(f"cache must be 'dense' or 'paged', got {cache!r}")
    settings = dict(
        slots=slots, max_new_tokens=max_new_tokens, budgets=budgets, temperature=temperature,
        top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, eos_id=eos_id,
        stop_sequences=stop_sequences, pad_id=pad_id, num_samples=num_samples,
        check_ids=check_ids, prefill_rows=prefill_rows,
    )  # fmt: skip
    if cache == "paged":
        row_settings = (temperature, top_k, top_p, min_p, repetition_penalty)
        if any(_is_per_row(x) for x in row_settings + (presence_penalty, frequency_penalty)):
            raise ValueError(
                "per-row temperature, top_k, top_p, min_p, repetition_penalty, "
                "presence_penalty or frequency_penalty need cache='dense'"
            )
        # imported here: the paged sampler reuses this module's checks and carry
        from ._paged import generate_paged

        pool = dict(page_size=16 if page_size is None else page_size, num_pages=num_pages)
        return generate_paged(policy, prompts, prompt_masks, keys, **settings, **pool)[0]
    if page_size is not None or num_pages is not None:
        raise ValueError("page_size and num_pages apply to cache='paged' only")
    policy, prompts, prompt_masks, keys, budgets, plan, rows = _row_arguments(
        policy, prompts, prompt_masks, keys, settings
    )
    return _generate_continuous_jit(policy, prompts, prompt_masks, keys, budgets, rows, plan)


def _row_arguments(policy, prompts, prompt_masks, keys, settings: dict) -> tuple:
    """`_continuous_arguments` with per-row `temperature` / `top_k` / `top_p` / `min_p`
    and penalties taken out of the static options into `_RowSettings` (or `None` when
    they are scalars)."""
    rows = prompts.shape[0] * _plain(settings["num_samples"]) if prompts.ndim == 2 else 0
    names = ("temperature", "top_k", "top_p", "min_p")
    penalties = tuple(settings[name] for name in _PENALTIES)
    per_row = _row_settings(*(settings[name] for name in names), rows, penalties)
    if per_row is not None:
        settings = settings | dict(
            temperature=DEFAULT_TEMPERATURE, top_k=None, top_p=None, min_p=None
        )
        settings |= dict(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
    checked = _continuous_arguments(policy, prompts, prompt_masks, keys, **settings)
    return (*checked, per_row)


class ContinuousDecoding:
    """`generate_continuous` (dense cache) run a few decode steps at a time: between
    calls the caller reads the tokens sampled so far (to stream them, to look for stop
    strings in their text) and may cancel rows (a client gone, a stop string found),
    whose slots then take the next waiting rows. Run to the end, the tokens and
    log-probabilities are exactly those `generate_continuous` returns with the same
    arguments; a cancelled row keeps what it had sampled.

    **Arguments:** those of `generate_continuous` (`temperature`, `top_k`, `top_p`,
    `min_p` and the three penalties per row or scalars), except `cache`, `page_size` and
    `num_pages`; and

    - `log_steps`: a call of up to this many steps sends the host only the tokens it
      sampled (longer calls send the whole `[R · num_samples, max_new_tokens]`
      completions once).
    - `top_logprobs`: `K >= 0`; with `K > 0` each step also keeps, at every sampled
      position, the `K` most likely tokens and their log-probabilities
      `log softmax(logits / τ)` at the row's temperature `τ` (1 when greedy), from the
      logits the token was sampled from (no other forward pass): `top_ids` and
      `top_logprobs` `[R · num_samples, max_new_tokens, K]`, most likely first (0 past a
      row's end). The sampled token's log-probability equals its entry there.
    - `pause_tokens`: optional `[R · num_samples, vocab_size]` bools: a `run` ends early,
      right after the step in which a row `b` samples a token `t` with
      `pause_tokens[b, t]`, so the caller looks at that row at once (e.g. at the token
      that may complete a stop string in its text). The tokens sampled are the same.

    `run(steps)` decodes up to `steps` steps (one token for every busy slot each);
    afterwards `tokens`, `logprobs` (`[R · num_samples, max_new_tokens]` NumPy arrays on
    the host, `pad_id` and 0 past a row's end) and `lengths` (`[R · num_samples]`) hold
    every row's completion so far, `done` says whether every row has stopped, and
    `output()` lays them out as `generate_continuous`'s result. The carry stays on the
    device between calls (the slots' caches updated in place, donated); two compiled
    programs (the start and the steps), whatever `steps`.

    Example: stream the rows of a batch as they grow, and stop row 0 early.

    ```python
    import jax, jax.numpy as jnp, rlhf_eqx as rx

    cfg = rx.TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=64)
    policy = rx.Policy(cfg, key=jax.random.key(0))
    prompts = jnp.asarray([[5, 6, 7], [8, 9, 10]], jnp.int32)
    masks = jnp.ones_like(prompts, bool)
    keys = jax.random.split(jax.random.key(1), 2)
    decoding = rx.ContinuousDecoding(
        policy, prompts, masks, keys, slots=1, max_new_tokens=16, temperature=1.0
    )
    decoding.run(4)
    print(decoding.tokens[0, : decoding.lengths[0]])  # row 0's first 4 tokens
    decoding.cancel([0])  # row 0 stops; row 1 takes its slot at the next run
    while not decoding.done:
        decoding.run(8)
    out = decoding.output()  # GenerationOutput: rows prompt ++ completion
    ```
    """

    def __init__(
        self,
        policy: AbstractDecoder,
        prompts: Integer[ArrayLike, "R P"],
        prompt_masks: Bool[ArrayLike, "R P"] | Integer[ArrayLike, "R P"],
        keys: Key[Array, " R"] | UInt32[Array, "R 2"],
        *,
        log_steps: int = 16,
        top_logprobs: int = 0,
        pause_tokens: Bool[Array | np.ndarray, "B V"] | None = None,
        **options: Any,
    ):
        if not (_is_int(log_steps) and log_steps >= 1):
            raise ValueError(f"log_steps must be a positive int, got {log_steps!r}")
        if not (_is_int(top_logprobs) and top_logprobs >= 0):
            raise ValueError(f"top_logprobs must be an int >= 0, got {top_logprobs!r}")
        settings = dict(
            budgets=None, temperature=DEFAULT_TEMPERATURE, top_k=None, top_p=None, min_p=None,
            repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, eos_id=None,
            stop_sequences=None, pad_id=0, num_samples=1, check_ids=False, prefill_rows=None,
        ) | options  # fmt: skip
        policy, prompts, prompt_masks, keys, budgets, plan, rows = _row_arguments(
            policy, prompts, prompt_masks, keys, settings
        )
        plan = dataclasses.replace(plan, top_logprobs=int(top_logprobs))
        self._inputs = (policy, prompts, prompt_masks, keys, budgets, rows, plan)
        self._prompts = (prompts, prompt_masks)
        self._log_steps = int(log_steps)
        self.rows = B = prompts.shape[0] * plan.opts.num_samples
        N = plan.opts.max_new_tokens
        if pause_tokens is not None:
            pause_tokens = jnp.asarray(pause_tokens)
            if pause_tokens.shape != (B, policy.vocab_size) or pause_tokens.dtype != bool:
                raise ValueError(
                    f"pause_tokens must be bools [R · num_samples, vocab_size] = "
                    f"[{B}, {policy.vocab_size}], got {pause_tokens.dtype}"
                    f"{list(pause_tokens.shape)}"
                )
        self._pause = pause_tokens
        self.tokens = np.full((B, N), plan.opts.pad_id, np.int32)
        self.logprobs = np.zeros((B, N), np.float32)
        self.lengths = np.zeros((B,), np.int32)
        self.top_ids: np.ndarray | None = None
        self.top_logprobs: np.ndarray | None = None
        if top_logprobs:
            K = min(int(top_logprobs), policy.vocab_size)
            self.top_ids = np.zeros((B, N, K), np.int32)
            self.top_logprobs = np.zeros((B, N, K), np.float32)
        self._cancelled = np.zeros(B, bool)
        self._cancelled_on_device = jnp.asarray(self._cancelled)
        self._steps_on_device: dict[int, Array] = {}
        self._state = _continuous_start(self._inputs)
        self.done = False

    def cancel(self, rows: Sequence[int]) -> None:
        """Stop `rows` (output rows) at the next `run`: a decoding one is dropped from
        its slot, a waiting one is never admitted."""
        rows = list(rows)
        if rows and not self._cancelled[rows].all():
            self._cancelled[rows] = True
            self._cancelled_on_device = jnp.asarray(self._cancelled)

    def run(self, steps: int) -> int:
        """Decode up to `steps` steps (fewer when every row stops first) and bring the
        new tokens to the host (`tokens`, `logprobs`, `lengths`); returns the steps run."""
        if not (_is_int(steps) and steps >= 1):
            raise ValueError(f"steps must be a positive int, got {steps!r}")
        if self.done:
            return 0
        if steps not in self._steps_on_device:
            self._steps_on_device[steps] = jnp.asarray(steps, jnp.int32)
        args = ((*self._inputs, self._cancelled_on_device), self._log_steps)
        self._state, going, n, log = _continuous_steps_jit(
            (*args, self._steps_on_device[steps], self._pause), self._state
        )
        n = int(n)
        if n <= self._log_steps:  # the new tokens only
            rows, at, toks, lps = (np.asarray(x)[:n].ravel() for x in log[:4])
            wrote = rows < self.rows
            rows, at = rows[wrote], at[wrote]
            self.tokens[rows, at] = toks[wrote]
            self.logprobs[rows, at] = lps[wrote]
            np.maximum.at(self.lengths, rows, at + 1)
            if self.top_ids is not None and self.top_logprobs is not None:
                K = self.top_ids.shape[-1]
                top_ids, top_lps = (np.asarray(x)[:n].reshape(-1, K)[wrote] for x in log[4:])
                self.top_ids[rows, at] = top_ids
                self.top_logprobs[rows, at] = top_lps
        else:  # a long call: the whole completions once (copied before the next call)
            out = self._state.out
            self.tokens[:] = np.asarray(out.tokens)
            self.logprobs[:] = np.asarray(out.logprobs)
            self.lengths[:] = np.asarray(out.real).sum(axis=1)
            if self.top_ids is not None and self.top_logprobs is not None:
                self.top_ids[:] = np.asarray(self._state.top[0])
                self.top_logprobs[:] = np.asarray(self._state.top[1])
        self.done = not bool(going)
        return n

    def output(self) -> GenerationOutput:
        """The completions so far laid out as `generate_continuous`'s result: each row
        its prompt as given, then its completion (`pad_id` past its end)."""
        prompts, prompt_masks = (np.asarray(x) for x in self._prompts)
        G = self.rows // prompts.shape[0]
        prompts, prompt_masks = np.repeat(prompts, G, 0), np.repeat(prompt_masks, G, 0)
        real = np.arange(self.tokens.shape[1])[None, :] < self.lengths[:, None]
        return GenerationOutput(
            tokens=jnp.asarray(np.concatenate([prompts.astype(np.int32), self.tokens], 1)),
            mask=jnp.asarray(np.concatenate([prompt_masks, real], 1)),
            completion_mask=jnp.asarray(np.concatenate([np.zeros_like(prompt_masks), real], 1)),
            logprobs=jnp.asarray(
                np.concatenate([np.zeros(prompts.shape, np.float32), self.logprobs], 1)
            ),
        )


def _continuous_arguments(
    policy: Any,
    prompts: Any,
    prompt_masks: Any,
    keys: Any,
    *,
    slots: Any,
    budgets: Any,
    stop_sequences: Any,
    prefill_rows: Any,
    **sampling: Any,
) -> tuple[AbstractDecoder, Any, Any, Key[Array, " R"], Int[Array, " B"], _Plan]:
    """`generate_continuous`'s arguments checked: the decoder, the prompts and their
    masks (`prompt_arrays`: JAX arrays, bool masks), typed keys, int32 budgets and the
    static plan (raises naming the argument at fault). `**sampling` are the fields of
    `SamplingOptions`."""
    opts = SamplingOptions(**sampling)
    max_new_tokens, num_samples = opts.max_new_tokens, opts.num_samples
    policy = _check_decoder(policy)
    if not (_is_int(slots) and slots >= 1):
        raise ValueError(f"slots must be a positive int, got {slots!r}")
    if prompts.ndim != 2 or prompts.shape != prompt_masks.shape:
        raise ValueError(
            f"prompts {prompts.shape} and prompt_masks {prompt_masks.shape} must be the "
            "same [R, P] shape"
        )
    R, P = prompts.shape
    if R == 0:
        raise ValueError("prompts: need at least one prompt, got R=0")
    keys = _key_array(keys, R)
    prompts, prompt_masks = prompt_arrays(prompts, prompt_masks, policy.vocab_size, "prompts: row")
    _check_length(policy, P, max_new_tokens)
    check_stop_ids(opts.eos_id, policy.vocab_size)
    stops = _check_stop_sequences(stop_sequences, policy.vocab_size)
    rows = R * num_samples
    if budgets is None:
        budgets = jnp.full((rows,), max_new_tokens, jnp.int32)
    else:
        budgets = jnp.asarray(budgets)
        if budgets.shape != (rows,) or not jnp.issubdtype(budgets.dtype, jnp.integer):
            raise ValueError(
                f"budgets must be {rows} ints (one per output row, R · num_samples), got "
                f"{budgets.dtype}{list(budgets.shape)}"
            )
        if not isinstance(budgets, jax.core.Tracer):
            b = np.asarray(budgets)
            if b.min() < 1 or b.max() > max_new_tokens:
                raise ValueError(
                    f"budgets must lie in [1, max_new_tokens={max_new_tokens}], got values "
                    f"from {int(b.min())} to {int(b.max())}"
                )
        budgets = budgets.astype(jnp.int32)
    if prefill_rows is None:
        prefill_rows = -(-int(slots) // 4)
    elif not (_is_int(prefill_rows) and prefill_rows >= 1):
        raise ValueError(f"prefill_rows must be a positive int or None, got {prefill_rows!r}")
    # slots beyond the rows and prefill batches beyond the prompts change nothing
    plan = _Plan(
        opts=opts,
        slots=min(int(slots), rows),
        prefill_rows=min(int(prefill_rows), R),
        stop_sequences=stops,
    )
    return policy, prompts, prompt_masks, keys, budgets, plan
