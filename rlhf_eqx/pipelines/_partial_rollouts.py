"""Partial rollouts (`grpo.partial_rollouts`): a rollout sampled ahead by a stale policy is
interrupted when newer weights arrive and its unfinished rows continue with them, every
token recording the policy that sampled it (AReaL's interruptible generation, Fu et al.
2025; veRL's fully asynchronous mode).

The interruption points are token counts, not wall time, so a run is reproducible and
resumable: rollout `q` of a run with `staleness = k` and segment length `S` is sampled in
the segments `partial_segments(q, staleness=k, segment=S, max_new_tokens=N)`, segment
`i` by the policy of update `max(q - k + i, 0)` (equal versions merged), each segment
`S` tokens except the last (by the policy of update `q`, the one that consumes the
rollout), which runs to `N`. The first segment is sampled as a whole rollout is
(`dispatch_rollout` with the rollout's key); each later one is `continue_rollout`: a
fresh prefill of prompt + tokens so far with the new weights (AReaL recomputes the KV
cache) and `S` more tokens for the rows that have not stopped, and for those rows only.

Keys: segment `i > 0` has the key `fold_in(key, i)`, and row `b` of the rollout draws
its `t`-th token of that segment with `fold_in(fold_in(fold_in(key, i), b), t)` (one key
per row, `rlhf_eqx.generate_batch`), so a row's continuation does not depend on which
other rows are still running: the unfinished rows are gathered, padded up to a bucket
size (a power of two, a multiple of the sampler mesh's `"data"` axis, at most the
rollout's rows: a few compiled shapes) with copies of one of them that are dropped,
continued, and scattered back into their rows. Which thread runs a segment, and
when, changes no number."""

import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Bool, PRNGKeyArray

import rlhf_eqx as rx

from ._config import ConfigError
from ._rollout import PendingRollout, Rollout


def partial_segments(
    rollout: int, *, staleness: int, segment: int, max_new_tokens: int
) -> tuple[tuple[int, int], ...]:
    """The segments rollout `rollout` is sampled in: `(policy version, new tokens)` pairs,
    in order.

    Segment `i` is sampled by the policy of update `max(rollout - staleness + i, 0)` for
    `i = 0 ... staleness` (versions that repeat, at the start of a run, are one segment):
    `segment` tokens each, the last (the policy of update `rollout`, the newest when the
    rollout is consumed) up to `max_new_tokens` in all; segments with nothing left are
    dropped. With `segment >= max_new_tokens` this is one segment, the stale policy's
    whole rollout.

    **Returns:** `((version, tokens), ...)`, the tokens summing to `max_new_tokens`.
    """
    versions = sorted({max(rollout - staleness + i, 0) for i in range(staleness + 1)})
    out, left = [], max_new_tokens
    for i, version in enumerate(versions):
        n = left if i == len(versions) - 1 else min(segment, left)
        if n == 0:
            break
        out.append((version, n))
        left -= n
    return tuple(out)


def check_partial_rollouts(name: str, segment: int, max_new_tokens: int) -> None:
    """`segment` (the field `name`) is 0 (off) or a length `0 < segment <
    max_new_tokens`; `ConfigError` naming the field otherwise."""
    if segment and not 0 < segment < max_new_tokens:
        raise ConfigError(
            f"{name}={segment!r}: must be 0 (off) or a segment length in tokens in "
            f"(0, sampling.max_new_tokens={max_new_tokens})"
        )


def unfinished_rows(pending: PendingRollout) -> Bool[np.ndarray, " B"]:
    """The rows of `pending` that have not stopped: every completion position sampled so
    far is a real token and the last one is no stop id."""
    out, P = pending.out, pending.prompt_length
    real = np.asarray(out.completion_mask)[:, P:].all(axis=1)
    last = np.asarray(out.tokens)[:, -1]
    return real & ~np.isin(last, np.asarray(pending.stop_ids, np.int64))


def _bucket(n: int, rows: int, multiple: int) -> int:
    """The rows sampled to continue `n` of a rollout's `rows`: the next power of two, up
    to a multiple of `multiple` (the sampler mesh's `"data"` axis), at most `rows`."""
    power = 1 << (n - 1).bit_length()
    return min(-(-power // multiple) * multiple, rows)


def _data_axis(x: jax.Array) -> int:
    """The size of the `"data"` axis of the mesh `x` lies on (1 off a mesh)."""
    sharding = x.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        return int(dict(sharding.mesh.shape).get("data", 1))
    return 1


def continue_rollout(
    policy,
    pending: PendingRollout,
    key: PRNGKeyArray,
    *,
    max_new_tokens: int,
    temperature: float,
    pad_id: int,
    place: Callable | None = None,
) -> PendingRollout:
    """`pending` with up to `max_new_tokens` more tokens from `policy` for the rows that
    have not stopped (`unfinished_rows`), and only those: a fresh prefill of each row's
    prompt + tokens so far (no cache is carried over from the policy that sampled them),
    then sampling at `temperature` (with `pending`'s top-k / top-p / min-p filters and
    repetition penalty, whose context, the prompt and the tokens so far, is the same)
    until a stop id of `pending` or `max_new_tokens`. A presence or frequency penalty
    (which count the generated tokens only) is refused: the tokens so far would count
    as prompt.

    The unfinished rows are gathered and padded up to a bucket size (the next power of
    two, rounded up to a multiple of the sampler mesh's `"data"` axis when `pending`'s
    rows lie on a mesh, at most the rollout's rows; the padding repeats the first
    continued row with its key, so it stops with it, and is dropped), so a rollout of
    `B` rows compiles the sampler for at most `ceil(log2(B)) + 1` shapes.
    `rlhf_eqx.generate_batch` samples them with one key per row, `fold_in(key, b)` for
    row `b` of `pending`: a row's tokens do not depend on the other rows, on how many
    continue, nor on the padding. The new tokens, masks and log-probabilities are
    scattered back into their rows; the other rows get `pad_id`, masks off and
    log-probabilities 0 (and when no row continues, nothing is sampled). The new
    log-probabilities are `policy`'s; `place` lays the rows out for the sampler as in
    `dispatch_rollout`.

    **Returns:** the `PendingRollout` with rows `max_new_tokens` longer.
    """
    counted = sorted(set(pending.filters) & {"presence_penalty", "frequency_penalty"})
    if counted:
        raise ValueError(
            f"continue_rollout: {counted[0]}={pending.filters[counted[0]]} counts the "
            "generated tokens only, and a continued row is prefilled afresh with its tokens "
            "so far as its prompt; continue without it (repetition_penalty is exact)"
        )
    out = pending.out
    going = np.flatnonzero(unfinished_rows(pending))
    rows, length = out.tokens.shape
    new_real = np.zeros((rows, max_new_tokens), bool)
    new_tokens = np.full((rows, max_new_tokens), pad_id, out.tokens.dtype)
    new_logprobs = np.zeros((rows, max_new_tokens), out.logprobs.dtype)
    if going.size:
        n = going.size
        size = _bucket(n, rows, _data_axis(out.tokens) if place is not None else 1)
        picked = np.concatenate([going, np.full(size - n, going[0])])
        tokens = jnp.asarray(np.asarray(out.tokens)[picked])
        mask = jnp.asarray(np.asarray(out.mask)[picked])
        if place is not None:
            tokens, mask = place(tokens, mask)
        keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.asarray(picked))
        more = rx.generate_batch(
            policy,
            tokens,
            mask,
            keys,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            eos_id=list(pending.stop_ids) or None,
            pad_id=pad_id,
            **pending.filters,  # the rollout's top-k / top-p / min-p / repetition penalty
        )
        real = np.asarray(more.completion_mask)[:n, length:]
        new_real[going] = real
        new_tokens[going] = np.where(real, np.asarray(more.tokens)[:n, length:], pad_id)
        new_logprobs[going] = np.where(real, np.asarray(more.logprobs)[:n, length:], 0.0)
    cat = lambda a, b: jnp.concatenate([a, jnp.asarray(b, a.dtype)], axis=1)  # noqa: E731
    grown = rx.GenerationOutput(
        tokens=cat(out.tokens, new_tokens),
        mask=cat(out.mask, new_real),
        completion_mask=cat(out.completion_mask, new_real),
        logprobs=cat(out.logprobs, new_logprobs),
    )
    return dataclasses.replace(pending, out=grown)


@dataclasses.dataclass(frozen=True)
class InFlight:
    """A partial rollout between segments: the rows so far, the policy version of each
    completion token (`-1`: none), the segments run and the ones that sampled rows."""

    pending: PendingRollout
    versions: np.ndarray
    done: int
    sampled: int


class PartialRollouts:
    """The partial rollouts of a GRPO run (`grpo.partial_rollouts`): rollout `q` in the
    segments of `partial_segments`, each by the parameters of its version; rollouts run
    ahead (a sampler of its own) are continued before each update with the newest
    parameters, in a worker thread, and finished by the iteration that consumes them.

    `ctx` holds the run's sampling settings (`max_new_tokens`, `prompt_length`,
    `temperature`); `first(model, key, q, max_new_tokens)` dispatches a rollout's first
    segment, `continue_rollout` (with `pad_id` and `place`) the others;
    `finish(pending)` decodes, scores and compares a whole rollout (the run's `(roll,
    ref_logp, info, scored, rewards)`); `key_of(q)` is rollout `q`'s key. The `model`
    given to `queue` and `take` is `model(params) ->` the policy on the sampler, called
    on the main thread (the weight transfer)."""

    def __init__(
        self,
        *,
        staleness: int,
        segment: int,
        ctx,
        pad_id: int,
        place: Callable | None,
        first: Callable,
        finish: Callable,
        key_of: Callable,
        worker=None,
    ):
        self.k, self.segment, self.max_new_tokens = staleness, segment, ctx.max_new_tokens
        self.prompt_length, self.temperature = ctx.prompt_length, ctx.temperature
        self.pad_id, self.place, self.first = pad_id, place, first
        self.finish, self.key_of, self.worker = finish, key_of, worker
        # rollout -> (future of its `InFlight`, segments submitted, {version: params})
        self.flying: dict[int, tuple[Future, int, dict]] = {}

    def segments(self, q: int):
        return partial_segments(
            q, staleness=self.k, segment=self.segment, max_new_tokens=self.max_new_tokens
        )

    def _models(self, q, start, upto, known, r, model):
        """`(index, version, tokens, params, model)` of rollout `q`'s segments from `start`
        with versions `<= upto`, each version's parameters `known[version - r + k]`."""
        todo = []
        for i, (v, n) in enumerate(self.segments(q)):
            if i >= start and v <= upto:
                params = known[v - r + self.k]
                todo.append((i, v, n, params, model(params)))
        return todo

    def _run(self, flight: "InFlight | None", q: int, key, todo) -> InFlight:
        for i, v, n, _, model in todo:
            if i == 0:
                pending = self.first(model, key, q, n)
                before, sampled = 0, 1
            else:
                sampled = flight.sampled + bool(unfinished_rows(flight.pending).any())
                pending = continue_rollout(
                    model,
                    flight.pending,
                    jax.random.fold_in(key, i),
                    max_new_tokens=n,
                    temperature=self.temperature,
                    pad_id=self.pad_id,
                    place=self.place,
                )
                before = flight.versions.shape[1]
            new = np.asarray(pending.out.completion_mask)[:, self.prompt_length + before :]
            versions = np.where(new, v, -1).astype(np.int32)
            if flight is not None:
                versions = np.concatenate([flight.versions, versions], axis=1)
            flight = InFlight(pending, versions, i + 1, sampled)
        return flight

    def queue(self, known: Sequence, r: int, rollouts: int, depth: int, model: Callable) -> None:
        """Before update `r` (`known`: the parameters of updates `r - k ... r`, oldest
        first): start rollouts `r + 1 ... r + depth` and continue every rollout in flight
        with the versions known now, in order, in the worker."""
        for q in range(r + 1, min(r + depth, rollouts - 1) + 1):
            future, start, used = self.flying.get(q, (None, 0, {}))
            todo = self._models(q, start, r, known, r, model)
            if not todo:
                continue

            def advance(previous=future, q=q, todo=todo):
                flight = None if previous is None else previous.result()
                return self._run(flight, q, self.key_of(q), todo)

            used = {**used, **{v: params for _, v, _, params, _ in todo}}
            self.flying[q] = (self.worker.submit(advance), todo[-1][0] + 1, used)

    @property
    def in_flight(self) -> int:
        return len(self.flying)

    def take(self, known: Sequence, r: int, key, model: Callable) -> tuple[bool, tuple]:
        """Rollout `r`, finished (`known`: the parameters of updates `r - k ... r`): the
        rollout run ahead when every segment so far was sampled by these parameters (not
        after a rollback or a resume, which restore copies), else sampled whole now.

        **Returns:** `(prepared, (roll, ref_logp, info, scored, rewards))` with
        `roll.policy_version` set and `info`'s `partial_segments` (segments that sampled
        rows), `version_lag` (mean of `r - version` over completion tokens) and
        `tokens_lag_<d>` (completion tokens sampled `d` updates behind)."""
        future, start, used = self.flying.pop(r, (None, 0, {}))
        prepared = future is not None and all(
            params is known[v - r + self.k] for v, params in used.items()
        )
        if not prepared:  # a rollback or a resume: what is in flight is another policy's
            for other in [future, *(f for f, _, _ in self.flying.values())]:
                if other is not None:
                    other.cancel()
            self.flying.clear()
            flight, start = None, 0
        else:
            flight = future.result()
        flight = self._run(flight, r, key, self._models(r, start, r, known, r, model))
        roll, ref_logp, info, scored, rewards = self.finish(flight.pending)
        return prepared, (self._record(roll, flight, r, info), ref_logp, info, scored, rewards)

    def _record(self, roll: Rollout, flight: InFlight, r: int, info: dict) -> Rollout:
        """`roll` with its tokens' policy versions (`-1` where the final completion mask,
        cut at stop strings, has no token); the version metrics into `info`."""
        real = np.asarray(roll.completion_mask)[:, self.prompt_length :]
        versions = np.where(real, flight.versions, -1).astype(np.int32)
        lag = (r - versions)[real]
        info["partial_segments"] = float(flight.sampled)
        info["version_lag"] = float(lag.mean()) if lag.size else 0.0
        for d in range(self.k + 1):
            info[f"tokens_lag_{d}"] = float((lag == d).sum())
        return dataclasses.replace(roll, policy_version=jnp.asarray(versions))
