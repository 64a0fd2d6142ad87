"""The one scheduler thread: requests wait in a FIFO queue; the thread takes every
request waiting at that moment, groups the rows by their sampling settings and samples
each group with one `generate_continuous` call, then takes the next batch.

Fairness: a batch holds every request that arrived before it started, so a request is
never served after one that arrived later (it may share a batch with it). Shapes are
bucketed to powers of two (rows, prompt length, completion length), so the number of
compiled programs stays small whatever the request mix.
"""

import collections
import concurrent.futures
import dataclasses
import functools
import itertools
import threading
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._sampling import generate_continuous
from ._prompts import DECODE_CONTEXT, decode_after
from ._protocol import MAX_TOP_LOGPROBS, RequestError

_MIN_BUCKET = 16


def _stopped() -> RequestError:
    """What a request gets once the server stops: 503, as a server going down answers."""
    return RequestError("the server is stopping", status=503, kind="server_error")


def _bucket(n: int) -> int:
    """The power of two at or above `n` (at least `_MIN_BUCKET`)."""
    return max(_MIN_BUCKET, 1 << max(0, int(n) - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class Row:
    """One completion to sample: the prompt's ids, its token budget, and its key: the
    request's `jax.random.key(seed)`, folded with `choice` when the request has more
    than one choice (`choice = -1`: not folded)."""

    prompt: tuple[int, ...]
    seed: int
    choice: int
    budget: int


@dataclasses.dataclass(frozen=True)
class Sample:
    """One sampled completion.

    - `ids`: the completion's token ids (a stop id that ended it included).
    - `logprobs`: their log-probabilities at the sampling temperature (1 when greedy).
    - `text`: the completion's text as OpenAI returns it: without the stop id, and up
      to the first stop string (which may begin inside a token: the start of that
      token's text is in `text`, the token is not in `ids`).
    - `tail`: the end of `text` that no token of `ids` covers (`""` unless a stop
      string begins inside a token).
    - `finish_reason`: `"stop"` (a stop id or a stop string) or `"length"`.
    - `stop_id`: the stop id that ended it (the last of `ids`), or `None`.
    - `top`: per token, the `(id, logprob)` alternatives, most likely first (when asked).
    - `policy_version`: the version of the weights that sampled it.
    """

    ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    tail: str
    finish_reason: str
    stop_id: int | None
    top: tuple[tuple[tuple[int, float], ...], ...] | None
    policy_version: int


@dataclasses.dataclass
class Job:
    """A request's rows and settings, and the future its samples are set on."""

    rows: Sequence[Row]
    temperature: float
    top_p: float | None
    stop: tuple[str, ...]
    top_logprobs: int
    top_k: int | None = None
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    prefix: str = "req"
    after_prompt: bool = False  # texts decoded after the prompt (completions)
    request_id: str = ""  # `prefix-N`, N counting submitted requests (arrival order)

    def group(self) -> tuple:
        """The settings one `generate_continuous` call shares."""
        return (self.temperature, self.top_p, self.top_k, self.stop)


@jax.jit
def _row_keys(seeds, choices):
    """Raw keys `uint32[R, 2]`: `key(seed)`, folded with `choice` where `choice >= 0`."""

    def one(seed, choice):
        key = jax.random.PRNGKey(seed)
        return jnp.where(choice >= 0, jax.random.fold_in(key, jnp.maximum(choice, 0)), key)

    return jax.vmap(one)(seeds, choices)


@functools.partial(eqx.filter_jit)
def _top_logprobs(policy, tokens, mask, temperature):
    """`(ids, logprobs)` `[B, T, K]` of the `K` most likely next tokens at each position,
    at `temperature` (log-softmax of `logits / temperature`)."""
    logits = jax.vmap(policy)(tokens, mask).astype(jnp.float32) / temperature
    logp = jax.nn.log_softmax(logits, axis=-1)
    k = min(MAX_TOP_LOGPROBS, logp.shape[-1])
    values, ids = jax.lax.top_k(logp, k)
    return ids, values


class Scheduler:
    """The queue and the thread that samples it.

    **Arguments:**

    - `policy`: the decoder that samples (`update_policy` replaces it).
    - `tokenizer`: decodes completions for stop strings and encodes stop strings.
    - `slots`: decode slots of `generate_continuous`.
    - `stop_ids`: ids that end a completion.
    - `pad_id`: the padding id.
    """

    def __init__(self, policy, tokenizer, *, slots: int, stop_ids: tuple[int, ...], pad_id: int):
        self.tokenizer = tokenizer
        self.slots = slots
        self.stop_ids = stop_ids
        self.pad_id = pad_id
        self._policy = policy
        self._version = 0
        self._queue: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._arrivals = itertools.count()
        self.batch_log: collections.deque[tuple[str, ...]] = collections.deque(maxlen=1024)

    @property
    def policy(self):
        with self._cond:
            return self._policy

    @property
    def version(self) -> int:
        with self._cond:
            return self._version

    def set_policy(self, policy) -> int:
        """Use `policy` from the next batch on; returns its version."""
        with self._cond:
            self._policy = policy
            self._version += 1
            return self._version

    def start(self) -> None:
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="rlhf_eqx-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._cond:
            pending, self._queue = list(self._queue), collections.deque()
        for job in pending:
            job.future.set_exception(_stopped())

    def submit(self, job: Job) -> concurrent.futures.Future:
        with self._cond:
            if self._stopping or self._thread is None:
                raise _stopped()
            job.request_id = f"{job.prefix}-{next(self._arrivals)}"
            self._queue.append(job)
            self._cond.notify()
        return job.future

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                batch, self._queue = list(self._queue), collections.deque()
                policy, version = self._policy, self._version
            self.batch_log.append(tuple(job.request_id for job in batch))
            groups: dict[tuple, list[Job]] = {}
            for job in batch:  # in arrival order; a group runs at its first request's turn
                groups.setdefault(job.group(), []).append(job)
            for jobs in groups.values():
                try:
                    samples = self._sample(policy, version, jobs)
                except Exception as e:  # the requests fail, the server goes on
                    for job in jobs:
                        job.future.set_exception(e)
                    continue
                start = 0
                for job in jobs:
                    job.future.set_result(samples[start : start + len(job.rows)])
                    start += len(job.rows)

    def _sample(self, policy, version: int, jobs: list[Job]) -> list[Sample]:
        """Every row of `jobs` (same settings) in one `generate_continuous` call."""
        rows = [row for job in jobs for row in job.rows]
        first = jobs[0]
        R = len(rows)
        # rows padded to a power of two by copies with a 1-token budget (not up to `slots`:
        # a filler row costs a prefill, which on a real model outweighs one compilation)
        Rp = 1 << (R - 1).bit_length()
        rows_p = rows + [dataclasses.replace(rows[0], budget=1)] * (Rp - R)
        longest = max(len(r.prompt) for r in rows)
        most = max(r.budget for r in rows)
        ctx = policy.cfg.max_seq_len
        N = max(most, min(_bucket(most), ctx - longest))
        P = max(longest, min(_bucket(longest), ctx - N))
        prompts = np.full((Rp, P), self.pad_id, np.int32)
        masks = np.zeros((Rp, P), bool)
        for i, r in enumerate(rows_p):  # left padding
            prompts[i, P - len(r.prompt) :] = r.prompt
            masks[i, P - len(r.prompt) :] = True
        keys = _row_keys(
            jnp.asarray([r.seed for r in rows_p], jnp.uint32),
            jnp.asarray([r.choice for r in rows_p], jnp.int32),
        )
        stop_sequences = [ids for s in first.stop if (ids := list(self.tokenizer.encode(s)))]
        out = generate_continuous(
            policy,
            jnp.asarray(prompts),
            jnp.asarray(masks),
            keys,
            slots=min(self.slots, Rp),
            max_new_tokens=N,
            budgets=np.asarray([r.budget for r in rows_p], np.int32),
            temperature=first.temperature,
            top_k=first.top_k,
            top_p=first.top_p,
            eos_id=list(self.stop_ids),
            stop_sequences=stop_sequences or None,
            pad_id=self.pad_id,
        )
        tokens = np.asarray(out.tokens)[:, P:]
        real = np.asarray(out.completion_mask)[:, P:]
        logprobs = np.asarray(out.logprobs)[:, P:]
        top: Any = None
        if any(job.top_logprobs for job in jobs):
            temperature = first.temperature or 1.0
            top_ids, top_lp = _top_logprobs(
                policy, out.tokens, out.mask, jnp.asarray(temperature, jnp.float32)
            )
            top = (np.asarray(top_ids)[:, P - 1 : -1], np.asarray(top_lp)[:, P - 1 : -1])
        samples = []
        asks = [job.top_logprobs for job in jobs for _ in job.rows]
        after = [job.after_prompt for job in jobs for _ in job.rows]
        for i in range(R):
            n_real = int(real[i].sum())
            context = rows[i].prompt[-DECODE_CONTEXT:] if after[i] else ()
            n_kept, text, tail = self._cut(tokens[i, :n_real].tolist(), context, first.stop)
            ids = tuple(int(t) for t in tokens[i, :n_kept])
            stop_id = ids[-1] if ids and ids[-1] in self.stop_ids else None
            finish = "stop" if stop_id is not None or n_kept < n_real else "length"
            alternatives = None
            if top is not None and asks[i]:
                k = asks[i]
                alternatives = tuple(
                    tuple((int(top[0][i, t, j]), float(top[1][i, t, j])) for j in range(k))
                    for t in range(n_kept)
                )
            samples.append(
                Sample(
                    ids=ids,
                    logprobs=tuple(float(x) for x in logprobs[i, :n_kept]),
                    text=text,
                    tail=tail,
                    finish_reason=finish,
                    stop_id=stop_id,
                    top=alternatives,
                    policy_version=version,
                )
            )
        return samples

    def _cut(
        self, ids: list[int], context: Sequence[int], stop: Sequence[str]
    ) -> tuple[int, str, str]:
        """`(kept, text, tail)` of a completion `ids` decoded after `context`: OpenAI's
        text ends before the first stop string (and never holds the stop id); the
        tokens kept are the longest prefix whose text ends at or before it, and `tail`
        is the rest of the text (the start of the token the stop string begins in)."""
        body = ids[:-1] if ids and ids[-1] in self.stop_ids else ids
        text = decode_after(self.tokenizer, context, body)
        hits = [at for at in (text.find(s) for s in stop) if at >= 0]
        if not hits:
            return len(ids), text, ""
        text = text[: min(hits)]
        lo, hi = 0, len(body)  # the longest prefix of tokens whose text fits in `text`
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(decode_after(self.tokenizer, context, body[:mid])) <= len(text):
                lo = mid
            else:
                hi = mid - 1
        kept = decode_after(self.tokenizer, context, body[:lo])
        return lo, text, text[len(kept) :] if text.startswith(kept) else ""
