"""The one scheduler thread: requests wait in a FIFO queue; the thread takes every
request waiting at that moment and samples all their rows with one continuous-batching
run (`ContinuousDecoding`: each row with its own temperature, top-k, top-p, min-p and
penalties, traced, so one compiled sampler serves every setting), then takes the next batch; with
`batches > 1`, requests that arrive while a batch runs start a batch of their own at
once, the running batches taking turns a few steps each.

The run goes a few decode steps at a time (`Scheduler.steps`): in between, the thread
sends streamed rows their new text, stops rows whose text holds a stop string, drops
the rows of a request whose client has gone (their slots take the next rows), and
answers each request as soon as its rows are done. Each call brings only the tokens it
sampled to the host, and the text is decoded once a look (a row not streamed: only the
text its new tokens add); a batch with no stream and no stop string needs the host only
to answer and to look for clients gone, so its calls grow (twice the steps each time,
while a call stays short). A call ends early after a step in which a row with stop
strings sampled a token that may complete one of them (its bytes hold the string, or
begin with an end of it), so such a row is retired at that token, not up to `steps`
tokens later. The alternatives of `top_logprobs` are kept by the decode steps, from
the logits each token was sampled from (no forward pass of the rows).

Fairness: a batch holds every request that arrived before it started, so a request
never starts after one that arrived later (it may share a batch with it). Shapes are
bucketed to powers of two (rows, prompt length, completion length), so the number of
compiled programs stays small whatever the request mix.
"""

import collections
import concurrent.futures
import dataclasses
import itertools
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._sampling import ContinuousDecoding
from ._prompts import DECODE_CONTEXT, decode_after
from ._protocol import MAX_TOP_LOGPROBS, ParsedRequest, RequestError
from ._text import StreamedRow, token_bytes

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
    - `generated`: how many tokens were sampled, as OpenAI's and vLLM's `usage` counts
      them: `len(ids)`, or after a stop string the tokens up to the one it ends in
      (those cut from `ids` included).
    """

    ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    tail: str
    finish_reason: str
    stop_id: int | None
    top: tuple[tuple[tuple[int, float], ...], ...] | None
    policy_version: int
    generated: int


class ClientGone(Exception):
    """The client of a request closed its connection: its rows were dropped."""


@dataclasses.dataclass(frozen=True)
class Progress:
    """What a streamed row adds: `index` (the row of its request), the new `text`, and
    the new tokens whose text is all sent: `ids`, `logprobs` and `top` (per token the
    `(id, logprob)` alternatives, when asked)."""

    index: int
    text: str
    ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    top: tuple[tuple[tuple[int, float], ...], ...] | None


@dataclasses.dataclass(frozen=True)
class Finished:
    """A streamed row done: `index` (the row of its request) and its `Sample`, sent as
    soon as the row ends, while the request's other rows may go on."""

    index: int
    sample: Sample


@dataclasses.dataclass
class Job:
    """A request's rows and the checked request they come from, and the future its
    samples are set on.

    `request`: the request's sampling settings (temperature, top-k, top-p, min-p, the
    penalties), its stop strings and its `top_logprobs`. `stream`: for a streamed
    request, the queue its rows' `Progress` goes to, and each row's `Finished` as soon
    as it ends (`None` once every row is done and the future is set). `cancel()` drops
    its rows (a client gone)."""

    rows: Sequence[Row]
    request: ParsedRequest
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    prefix: str = "req"
    request_id: str = ""  # `prefix-N`, N counting submitted requests (arrival order)
    stream: "queue.SimpleQueue[Progress | Finished | None] | None" = None
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    arrived: float = 0.0  # `time.monotonic()` when submitted

    @property
    def after_prompt(self) -> bool:
        """Whether the rows' texts are decoded after the prompt (completions)."""
        return self.request.kind == "completion"

    def cancel(self) -> None:
        """Drop the request: its rows stop at the scheduler's next step."""
        self.cancelled.set()


@jax.jit
def _row_keys(seeds, choices):
    """Raw keys `uint32[R, 2]`: `key(seed)`, folded with `choice` where `choice >= 0`."""

    def one(seed, choice):
        key = jax.random.PRNGKey(seed)
        return jnp.where(choice >= 0, jax.random.fold_in(key, jnp.maximum(choice, 0)), key)

    return jax.vmap(one)(seeds, choices)


@eqx.filter_jit
def top_logprobs(policy, tokens, mask, temperature):
    """`(ids, logprobs)` `[B, T, K]` of the `K` most likely next tokens at each position,
    at each row's `temperature` `[B]` (log-softmax of `logits / temperature`), and the
    log-probabilities `[B, T - 1]` of the tokens that follow (`tokens[:, 1:]`)."""
    logits = jax.vmap(policy)(tokens, mask).astype(jnp.float32) / temperature[:, None, None]
    logp = jax.nn.log_softmax(logits, axis=-1)
    k = min(MAX_TOP_LOGPROBS, logp.shape[-1])
    values, ids = jax.lax.top_k(logp, k)
    taken = jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
    return ids, values, taken


# a run no row of which needs the host between steps (no stream, no stop string) doubles
# its steps per call while a call takes less than half this, so that clients gone are
# still looked for about this often
_LOOK_SECONDS = 0.25
# a new batch waits until no request has arrived for `gather_seconds`, at most this many
# times `gather_seconds` after its first request
_GATHER_AT_MOST = 4


@dataclasses.dataclass
class _Run:
    """One batch being sampled: its jobs, their rows (`rows[i]`, `owner[i]` the job of
    row `i`), the padded shapes and the rows each job still waits for."""

    policy: Any
    version: int
    jobs: list[Job]
    rows: list[Row]
    owner: list[Job]
    first: dict[int, int]  # id(job) -> its first row
    P: int
    N: int
    streamed: dict[int, StreamedRow]
    open: set[int]  # ids of the jobs not answered yet
    decoding: ContinuousDecoding
    host: "_Host"
    steps: int  # decode steps of the next call
    grows: bool  # whether `steps` may grow (no row needs the host between calls)
    looked: dict[int, int] = dataclasses.field(default_factory=dict)  # row -> ids at its last look
    # streamed rows done, until their job is answered: row -> its sample (sent `Finished`)
    finished: dict[int, Sample] = dataclasses.field(default_factory=dict)


class Scheduler:
    """The queue and the thread that samples it.

    **Arguments:**

    - `policy`: the decoder that samples (`update_policy` replaces it).
    - `tokenizer`: decodes completions for stop strings and streams.
    - `slots`: decode slots of the continuous sampler.
    - `stop_ids`: ids that end a completion.
    - `pad_id`: the padding id.
    - `steps`: decode steps between two looks at the rows (streams, stop strings,
      clients gone); a batch with no stream and no stop string doubles them call after
      call while a call takes under `_LOOK_SECONDS / 2`.
    - `batches`: batches decoding at once. A request that arrives while a batch runs
      starts at once in a batch of its own (up to this many; each holds its own slots'
      caches), decoded in turn with the others, instead of waiting for the longest row
      of the running one.
    - `gather_seconds`: a new batch starts once no request has arrived for this long
      (at most 4 times this after its first request), so that a burst of requests a few
      milliseconds apart becomes one batch instead of one request and then all the
      others; it starts at once when its rows fill the slots. 0: start as soon as a
      request is there.
    """

    def __init__(
        self,
        policy,
        tokenizer,
        *,
        slots: int,
        stop_ids: tuple[int, ...],
        pad_id: int,
        steps: int = 8,
        batches: int = 1,
        gather_seconds: float | int = 0.005,
    ):
        self.tokenizer = tokenizer
        self.batches = batches
        self.gather_seconds = gather_seconds
        self.slots = slots
        self.stop_ids = stop_ids
        self.pad_id = pad_id
        self.steps = steps
        self._policy = policy
        self._version = 0
        self._queue: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._arrivals = itertools.count()
        self.batch_log: collections.deque[tuple[str, ...]] = collections.deque(maxlen=1024)
        self.dropped_rows = 0  # rows dropped because their client went away
        # each token's bytes, read once by a thread of their own (`None` until then)
        self._token_bytes: list[bytes | None] | None = None
        self._completing_cache: dict[str, np.ndarray] = {}  # stop string -> `_completing`

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
        if self._token_bytes is None:  # seconds for a large vocabulary: not on the scheduler
            args = (self._policy.cfg.vocab_size,)
            read = threading.Thread(target=self._read_token_bytes, args=args, daemon=True)
            read.start()

    def _read_token_bytes(self, vocab_size: int) -> None:
        self._token_bytes = [self._bytes_of(i) for i in range(vocab_size)]

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        try:
            if self._thread is not None:
                self._thread.join()
                self._thread = None
        finally:  # interrupted while the running batch finishes: the waiting ones fail
            with self._cond:
                pending, self._queue = list(self._queue), collections.deque()
            for job in pending:
                self._fail(job, _stopped())

    def submit(self, job: Job) -> concurrent.futures.Future:
        with self._cond:
            if self._stopping or self._thread is None:
                raise _stopped()
            job.request_id = f"{job.prefix}-{next(self._arrivals)}"
            job.arrived = time.monotonic()
            self._queue.append(job)
            self._cond.notify()
        return job.future

    @staticmethod
    def _fail(job: Job, error: BaseException) -> None:
        if not job.future.done():
            job.future.set_exception(error)
        if job.stream is not None:
            job.stream.put(None)

    def _loop(self) -> None:
        runs: list[_Run] = []
        while True:
            batch: list[Job] = []
            with self._cond:
                while not self._queue and not runs and not self._stopping:
                    self._cond.wait()
                if self._stopping and not runs:
                    return
                if self._queue and not self._stopping and len(runs) < self.batches:
                    while not runs and not self._stopping and self._gathering():
                        self._cond.wait(self._gathering())
                if self._stopping and not runs:
                    return
                if (
                    self._queue
                    and not self._stopping
                    and len(runs) < self.batches
                    and not self._gathering()
                ):
                    batch, self._queue = list(self._queue), collections.deque()
                    policy, version = self._policy, self._version
            if batch:
                run = self._begin(policy, version, batch)
                if run is not None:
                    runs.append(run)
            for run in list(runs):  # each running batch a few steps, in turn
                try:
                    self._advance(run)
                except Exception as e:  # the requests fail, the server goes on
                    for job in run.jobs:
                        self._fail(job, e)
                    run.open.clear()
                if not run.open:
                    runs.remove(run)

    def _gathering(self) -> float:
        """Seconds the waiting requests still wait for others to join their batch: 0
        once the first has waited `gather_seconds` or their rows fill the slots (call
        with `_cond` held)."""
        if sum(len(job.rows) for job in self._queue) >= self.slots:
            return 0.0
        quiet = self._queue[-1].arrived + self.gather_seconds
        longest = self._queue[0].arrived + _GATHER_AT_MOST * self.gather_seconds
        return max(0.0, min(quiet, longest) - time.monotonic())

    def _begin(self, policy, version: int, batch: list[Job]) -> "_Run | None":
        """Start sampling `batch` (less the requests whose client left while they
        waited); `None` when none is left or the start failed (the requests fail)."""
        self.batch_log.append(tuple(job.request_id for job in batch))
        jobs = []
        for job in batch:
            if job.cancelled.is_set():
                self.dropped_rows += len(job.rows)
                self._fail(job, ClientGone())
            else:
                jobs.append(job)
        if not jobs:
            return None
        try:
            return self._start(policy, version, jobs)
        except Exception as e:  # the requests fail, the server goes on
            for job in jobs:
                self._fail(job, e)
            return None

    def _start(self, policy, version: int, jobs: list[Job]) -> "_Run":
        """Every row of `jobs` in one continuous run (`_advance` steps it; each job is
        answered once its rows are done)."""
        rows = [row for job in jobs for row in job.rows]
        owner = [job for job in jobs for _ in job.rows]
        R = len(rows)
        # rows padded to a power of two by copies with a 1-token budget (not up to `slots`:
        # a filler row costs a prefill, which on a real model outweighs one compilation)
        Rp = 1 << (R - 1).bit_length()
        rows_p = rows + [dataclasses.replace(rows[0], budget=1)] * (Rp - R)
        settings = [owner[min(i, R - 1)].request for i in range(Rp)]
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
        decoding = ContinuousDecoding(
            policy,
            jnp.asarray(prompts),
            jnp.asarray(masks),
            keys,
            slots=min(self.slots, Rp),
            max_new_tokens=N,
            budgets=np.asarray([r.budget for r in rows_p], np.int32),
            temperature=np.asarray([j.temperature for j in settings], np.float32),
            top_k=np.asarray([j.top_k or 0 for j in settings], np.int32),
            top_p=np.asarray([1.0 if j.top_p is None else j.top_p for j in settings], np.float32),
            min_p=np.asarray([j.min_p or 0.0 for j in settings], np.float32),
            presence_penalty=np.asarray([j.presence_penalty for j in settings], np.float32),
            frequency_penalty=np.asarray([j.frequency_penalty for j in settings], np.float32),
            repetition_penalty=np.asarray([j.repetition_penalty for j in settings], np.float32),
            eos_id=list(self.stop_ids),
            pad_id=self.pad_id,
            log_steps=self.steps,
            top_logprobs=MAX_TOP_LOGPROBS if any(job.request.top_logprobs for job in jobs) else 0,
            pause_tokens=self._pause_tokens([j.stop for j in settings], policy.cfg.vocab_size),
        )
        first, start = {}, 0
        for job in jobs:
            first[id(job)] = start
            start += len(job.rows)
        run = _Run(
            policy=policy, version=version, jobs=jobs, rows=rows, owner=owner, first=first,
            P=P, N=N, streamed={}, open={id(job) for job in jobs}, decoding=decoding,
            host=_Host(decoding), steps=self.steps,
            grows=not any(job.request.stop or job.stream is not None for job in jobs),
        )  # fmt: skip
        for i, row in enumerate(rows):
            job = owner[i]
            if job.stream is not None:
                context = row.prompt[-DECODE_CONTEXT:] if job.after_prompt else ()
                run.streamed[i] = StreamedRow(self.tokenizer, context, job.request.stop)
        if R < Rp:
            decoding.cancel(range(R, Rp))  # the filler rows are never needed
        return run

    def _pause_tokens(self, stops: list[tuple[str, ...]], vocab_size: int) -> np.ndarray:
        """`[rows, vocab_size]` bools: for each row, the tokens that may complete one of
        its stop strings (`stops[i]`) in its text (`may_complete`), after which the
        decoding pauses for a look, so that a row is stopped at the token its stop string
        ends in rather than at the end of the call."""
        out = np.zeros((len(stops), vocab_size), bool)
        for i, stop in enumerate(stops):
            for s in stop:
                out[i] |= self._completing(s, vocab_size)
        return out

    def _completing(self, stop: str, vocab_size: int) -> np.ndarray:
        """`[vocab_size]` bools: the tokens that may complete `stop` (kept for the last
        256 stop strings); none until the tokens' bytes are read (`start`), when rows
        stop at the end of a call as without pauses."""
        token_bytes = self._token_bytes
        if token_bytes is None or len(token_bytes) != vocab_size:
            return np.zeros(vocab_size, bool)
        if stop not in self._completing_cache:
            raw = stop.encode("utf-8")
            mask = np.fromiter((may_complete(b, raw) for b in token_bytes), bool)
            if len(self._completing_cache) >= 256:
                self._completing_cache.pop(next(iter(self._completing_cache)))
            self._completing_cache[stop] = mask
        return self._completing_cache[stop]

    def _bytes_of(self, token_id: int) -> bytes | None:
        try:
            return token_bytes(self.tokenizer, token_id)
        except Exception:  # noqa: BLE001 - an id the tokenizer cannot spell: may complete
            return None

    def _advance(self, run: "_Run") -> None:
        """`run.steps` decode steps of `run`, then a look at each of its open jobs. A run
        whose rows need the host only once done takes twice the steps next time while a
        call takes under `_LOOK_SECONDS / 2` (up to its completion length), and half
        (down to `steps`) when one takes over `_LOOK_SECONDS`."""
        start = time.perf_counter()
        run.decoding.run(run.steps)
        took = time.perf_counter() - start
        if run.grows and took < _LOOK_SECONDS / 2:
            run.steps = min(2 * run.steps, max(run.N, self.steps))
        elif took > _LOOK_SECONDS:
            run.steps = max(run.steps // 2, self.steps)
        host = run.host
        for job in run.jobs:
            if id(job) in run.open:
                self._look(run, job, host, run.decoding)
        if run.decoding.done:
            for job in run.jobs:
                if id(job) in run.open:
                    self._answer(run, job, host)

    def _look(self, run: _Run, job: Job, host: "_Host", decoding: ContinuousDecoding) -> None:
        """After some steps: drop `job` if its client has gone, stop its rows at a stop
        string, stream their new text (and a streamed row's `Finished` once it is done),
        and answer it once its rows are done."""
        lo = run.first[id(job)]
        rows = range(lo, lo + len(job.rows))
        if job.cancelled.is_set():
            decoding.cancel(rows)
            self.dropped_rows += len(job.rows)
            run.open.discard(id(job))
            self._fail(job, ClientGone())
            return
        done = []
        for k, i in enumerate(rows):
            if i in run.finished:  # a streamed row done and sent
                done.append(True)
                continue
            n = int(host.decoding.lengths[i])
            over = n >= run.rows[i].budget or (n > 0 and host.last(i) in self.stop_ids)
            ids = host.ids(i) if not over and (i in run.streamed or job.request.stop) else []
            if not over and i in run.streamed:  # its whole text, decoded once a look
                context = run.rows[i].prompt[-DECODE_CONTEXT:] if job.after_prompt else ()
                text = decode_after(self.tokenizer, context, ids)
                if job.request.stop and any(s in text for s in job.request.stop):
                    decoding.cancel([i])  # the text ends before the stop string
                    over = True
                else:
                    self._stream(run, job, k, i, ids, text, host)
            elif not over and job.request.stop and self._holds_stop(run, job, i, ids):
                decoding.cancel([i])
                over = True
            if over and job.stream is not None:
                self._finish(run, job, k, i, host)
            done.append(over)
        if all(done):
            self._answer(run, job, host)

    def _holds_stop(self, run: _Run, job: Job, i: int, ids: list[int]) -> bool:
        """Whether the text of row `i` (not streamed; `ids` so far) holds one of `job`'s
        stop strings. Only the text of the tokens since the last look (and of enough
        tokens before them to hold a stop string ending in them: 4 per character, a
        character's UTF-8 bytes in as many tokens) is decoded, after the
        `DECODE_CONTEXT` tokens before it; a stop string found there is confirmed on the
        whole text. (One missed would only let the row run on: the answer is cut at the
        first stop string of the whole text.)"""
        reach = 4 * max(len(s) for s in job.request.stop) + 4
        lo = max(0, run.looked.get(i, 0) - reach)
        run.looked[i] = len(ids)
        context = list(run.rows[i].prompt[-DECODE_CONTEXT:]) if job.after_prompt else []
        before = (context + ids[:lo])[-DECODE_CONTEXT:] if lo else context
        window = decode_after(self.tokenizer, before, ids[lo:])
        if not any(s in window for s in job.request.stop):
            return False
        text = decode_after(self.tokenizer, context, ids)
        return any(s in text for s in job.request.stop)

    def _stream(self, run: _Run, job: Job, k: int, i: int, ids: list[int], text: str, host) -> None:
        """Send row `i` (the `k`-th of `job`) its new text and fully sent tokens (`text`:
        the text of `ids`)."""
        state = run.streamed[i]
        before = state.tokens
        text, count = state.advance(ids, text)
        if not (text or count):
            return
        new = list(range(before, before + count))
        top = None
        if job.request.top_logprobs and new:
            top = tuple(_top_of(host.decoding, i, t, job.request.top_logprobs) for t in new)
        assert job.stream is not None
        job.stream.put(
            Progress(
                index=k,
                text=text,
                ids=tuple(ids[t] for t in new),
                logprobs=tuple(float(host.logprobs[i, t]) for t in new),
                top=top,
            )
        )

    def _finish(self, run: _Run, job: Job, k: int, i: int, host: "_Host") -> None:
        """Send streamed row `i` (the `k`-th of `job`), now done, its `Finished`."""
        assert job.stream is not None
        run.finished[i] = self._sample(run, job, i, host)
        job.stream.put(Finished(index=k, sample=run.finished[i]))

    def _answer(self, run: _Run, job: Job, host: "_Host") -> None:
        """Set `job`'s samples (its rows are done; a streamed row not yet sent its
        `Finished` gets it first)."""
        run.open.discard(id(job))
        lo = run.first[id(job)]
        samples = []
        for k, i in enumerate(range(lo, lo + len(job.rows))):
            if job.stream is not None and i not in run.finished:
                self._finish(run, job, k, i, host)
            sample = run.finished.pop(i, None)
            samples.append(sample if sample is not None else self._sample(run, job, i, host))
        job.future.set_result(samples)
        if job.stream is not None:
            job.stream.put(None)

    def _sample(self, run: _Run, job: Job, i: int, host: "_Host") -> Sample:
        """Row `i`'s `Sample` (the row is done)."""
        real = host.ids(i)
        context = run.rows[i].prompt[-DECODE_CONTEXT:] if job.after_prompt else ()
        n_kept, text, tail, generated = self._cut(real, context, job.request.stop)
        ids = tuple(real[:n_kept])
        stop_id = ids[-1] if ids and ids[-1] in self.stop_ids else None
        finish = "stop" if stop_id is not None or n_kept < len(real) else "length"
        top = None
        if job.request.top_logprobs:
            top = tuple(
                _top_of(host.decoding, i, t, job.request.top_logprobs) for t in range(n_kept)
            )
        return Sample(
            ids=ids,
            logprobs=tuple(float(x) for x in host.logprobs[i, :n_kept]),
            text=text,
            tail=tail,
            finish_reason=finish,
            stop_id=stop_id,
            top=top,
            policy_version=run.version,
            generated=generated,
        )

    def _cut(
        self, ids: list[int], context: Sequence[int], stop: Sequence[str]
    ) -> tuple[int, str, str, int]:
        """`(kept, text, tail, generated)` of a completion `ids` decoded after `context`:
        OpenAI's text ends before the first stop string (and never holds the stop id);
        the tokens kept are the longest prefix whose text ends at or before it, `tail`
        is the rest of the text (the start of the token the stop string begins in), and
        `generated` counts the shortest prefix whose text holds a stop string (the
        tokens sampled up to the one a stop string ends in: those a decoding that looks
        after every token samples; `len(ids)` without a stop string)."""
        body = ids[:-1] if ids and ids[-1] in self.stop_ids else ids
        text = decode_after(self.tokenizer, context, body)
        hits = [at for at in (text.find(s) for s in stop) if at >= 0]
        if not hits:
            return len(ids), text, "", len(ids)
        text = text[: min(hits)]

        def longest(fits) -> int:  # the longest prefix of `body` whose text `fits`
            lo, hi = 0, len(body)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if fits(decode_after(self.tokenizer, context, body[:mid])):
                    lo = mid
                else:
                    hi = mid - 1
            return lo

        lo = longest(lambda t: len(t) <= len(text))
        generated = 1 + longest(lambda t: not any(s in t for s in stop))
        kept = decode_after(self.tokenizer, context, body[:lo])
        return lo, text, text[len(kept) :] if text.startswith(kept) else "", generated


def _top_of(
    decoding: ContinuousDecoding, i: int, t: int, count: int
) -> tuple[tuple[int, float], ...]:
    """The `count` best `(id, logprob)` at completion position `t` of row `i`, kept by
    the decode step that sampled it (`ContinuousDecoding(top_logprobs=...)`)."""
    ids, lps = decoding.top_ids, decoding.top_logprobs
    assert ids is not None and lps is not None
    return tuple((int(ids[i, t, j]), float(lps[i, t, j])) for j in range(count))


def may_complete(raw: bytes | None, stop: bytes) -> bool:
    """Whether a token that adds the bytes `raw` to a text may complete `stop` there:
    `stop` lies in `raw`, or `raw` begins with an end of `stop` (unknown bytes: may)."""
    if raw is None or stop in raw:
        return True
    return any(raw.startswith(stop[-j:]) for j in range(1, min(len(stop), len(raw) + 1)))


class _Host:
    """A run's output so far on the host (the `ContinuousDecoding`'s completions, brought
    over a call's new tokens at a time): `logprobs` `[B, N]` of the completion positions,
    `ids(i)` row `i`'s sampled ids."""

    def __init__(self, decoding: ContinuousDecoding):
        self.decoding = decoding
        self.logprobs = decoding.logprobs

    def ids(self, i: int) -> list[int]:
        return self.decoding.tokens[i, : self.decoding.lengths[i]].tolist()

    def last(self, i: int) -> int:
        """Row `i`'s last sampled id (it has one)."""
        return int(self.decoding.tokens[i, self.decoding.lengths[i] - 1])
