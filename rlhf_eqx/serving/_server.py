"""`Server`: an OpenAI-compatible HTTP endpoint on a policy, sampled by one scheduler
thread with continuous batching, with weight updates and rollout recording."""

import concurrent.futures
import contextlib
import http.server
import itertools
import json
import math
import queue
import select
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from ._prompts import DECODE_CONTEXT, EpisodeContext, PromptBuilder
from ._protocol import RequestError, parse_request
from ._recording import Recording, Turn
from ._scheduler import (
    ClientGone,
    Finished,
    Job,
    Progress,
    Row,
    Sample,
    Scheduler,
    top_logprobs,
)
from ._text import piece_entry, token_bytes

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
_MAX_BODY = 16 * 1024 * 1024
_POLL = 0.05  # seconds between two looks at a waiting request's connection


def _stop_ids(tokenizer, stop_ids) -> tuple[int, ...]:
    if stop_ids is None:  # EOS, end-of-turn ids, BOS (the stories model's new story)
        ends = getattr(tokenizer, "stop_ids", None) or (tokenizer.eos_id,)
        stop_ids = [*ends, tokenizer.bos_id]
    elif isinstance(stop_ids, int):
        stop_ids = [stop_ids]
    out = tuple(dict.fromkeys(int(i) for i in stop_ids if i is not None and i >= 0))
    if not out:
        raise ValueError("stop_ids: need at least one stop id")
    return out


class Server:
    """An OpenAI-compatible server on `policy`: `POST /v1/chat/completions`,
    `POST /v1/completions` and `GET /v1/models`, on `http.server.ThreadingHTTPServer`.

    Every request goes to one scheduler thread that samples all the requests waiting at
    that moment in one continuous-batching run, in arrival order (each row with its own
    temperature, top-k, top-p, min-p and presence / frequency / repetition penalties: one
    compiled sampler serves every setting). With `"stream": true` the answer comes as
    server-sent events (OpenAI's chunks), a piece of text at a time, never a character
    cut in two. A client that disconnects, before its answer or mid-stream, has its rows
    dropped (their slots take the next rows). Each choice carries its `token_ids`, the
    response its `prompt_token_ids` (as vLLM's `return_token_ids`), and
    `policy_version`, the weights' version that sampled it. Log-probabilities are the
    sampler's: at the request's temperature (1 when greedy), before the penalties and
    top-k, top-p and min-p (`rlhf_eqx.GenerationOutput.logprobs`); each entry's `bytes`
    are the token's own. A completions request with `echo` also gets its prompt's text
    and its prompt tokens' log-probabilities (`max_tokens=0`: those only).

    **Arguments:**

    - `policy`: the decoder that samples (`rlhf_eqx.Policy`, any `AbstractDecoder`
      with a `cfg.max_seq_len`).
    - `tokenizer`: its tokenizer.
    - `slots`: decode slots of the continuous sampler.
    - `chat_template`: how `messages` become text: `None` (the tokenizer's own chat
      template, else `"hh"`), `"hh"`, `"chatml"`, a `rlhf_eqx.data.ChatTemplate` or a
      `rlhf_eqx.data.JinjaChatTemplate`.
    - `host`, `port`: where to listen (`port=0`: a free port); a host other than
      127.0.0.1 / localhost / ::1 needs `allow_remote=True`.
    - `model_name`: the `model` requests must name.
    - `max_new_tokens`: the completion budget when a request gives none (cut to the
      model's context).
    - `stop_ids`: ids that end a completion (default the tokenizer's `stop_ids`, EOS and
      its model's end-of-turn ids, then BOS).
    - `seed`: requests without a `seed` get one drawn from a generator seeded with it.
    - `max_request_rows`: the most completions one request may ask for (prompts × `n`);
      more is refused with 400 naming `n` (or `prompt`).
    - `max_request_tokens`: the most completion tokens one request may ask for (its
      completions × their `max_tokens`, or the default budget); more is refused with 400
      naming `max_tokens`.
    - `decode_steps`: decode steps between two looks at the rows (streamed text, stop
      strings, clients gone): fewer sends text sooner, more runs faster. A batch with
      no stream and no stop string doubles its steps call after call while a call
      takes under 0.125 s (clients gone are still noticed within about 0.25 s).
    - `concurrent_batches`: batches that decode at once. With 1 (the default) requests
      that arrive while a batch runs wait for all of it; with more, they start at once
      in a batch of their own, the batches taking turns `decode_steps` steps each (so a
      short request is not held up by a long one), each batch with its own slots'
      caches (up to this many times the memory).
    - `batch_gather_ms`: how long a new batch waits, from its first request's arrival, for
      more requests to join it, so that a burst of clients a few milliseconds apart is one
      batch rather than the first request alone and the rest after it; a batch whose
      rows fill the slots starts at once. 0: no wait.

    A request whose body does not arrive within `body_seconds` (30; an attribute) of
    waiting, a client that sent less than its `Content-Length`, is refused with 408 and
    its connection closed; so is one whose request line or headers stop arriving for
    `head_seconds` (30; an attribute), and a connection that sends nothing that long
    between requests is closed (a client holds no thread by sending half a request).

    `usage.completion_tokens` counts the tokens sampled, as OpenAI and vLLM bill them:
    after a stop string, those up to the token it ends in (not in `token_ids`).

    Use as a context manager, or `start()` / `stop()`; `url` is the base URL
    (`http://127.0.0.1:PORT/v1`) to give an OpenAI client.
    """

    def __init__(
        self,
        policy,
        tokenizer,
        *,
        slots: int = 8,
        chat_template: Any = None,
        host: str = "127.0.0.1",
        port: int = 0,
        model_name: str = "rlhf_eqx",
        max_new_tokens: int = 256,
        stop_ids: int | tuple[int, ...] | list[int] | None = None,
        seed: int = 0,
        allow_remote: bool = False,
        max_request_rows: int = 64,
        max_request_tokens: int = 65536,
        decode_steps: int = 8,
        concurrent_batches: int = 1,
        batch_gather_ms: float | int = 5.0,
    ):
        if host not in LOCAL_HOSTS and not allow_remote:
            raise ValueError(
                f"host={host!r}: the server listens on 127.0.0.1 only unless allow_remote=True "
                "(--allow-remote): it runs anyone's requests on this machine"
            )
        if not (isinstance(port, int) and not isinstance(port, bool) and 0 <= port <= 65535):
            raise ValueError(f"port must be an int in [0, 65535] (0: a free one), got {port!r}")
        if not (isinstance(slots, int) and slots >= 1):
            raise ValueError(f"slots must be a positive int, got {slots!r}")
        for name, value in (
            ("max_new_tokens", max_new_tokens),
            ("max_request_rows", max_request_rows),
            ("max_request_tokens", max_request_tokens),
            ("decode_steps", decode_steps),
            ("concurrent_batches", concurrent_batches),
        ):
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not (
            isinstance(batch_gather_ms, int | float)
            and not isinstance(batch_gather_ms, bool)
            and 0 <= batch_gather_ms <= 60_000
        ):
            raise ValueError(
                f"batch_gather_ms must be a number of milliseconds in [0, 60000], "
                f"got {batch_gather_ms!r}"
            )
        self.max_request_rows = max_request_rows
        self.max_request_tokens = max_request_tokens
        self.body_seconds = 30.0
        self.head_seconds = 30.0
        if not isinstance(getattr(getattr(policy, "cfg", None), "max_seq_len", None), int):
            raise TypeError("policy needs a cfg.max_seq_len (an rlhf_eqx.Policy or decoder)")
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.created = int(time.time())  # `/v1/models`' `created`: when the model was loaded
        self.max_new_tokens = max_new_tokens
        self.host = host
        self.port = port
        self.prompts = PromptBuilder(tokenizer, chat_template)
        pad = tokenizer.pad_id if tokenizer.pad_id is not None else 0
        self.scheduler = Scheduler(
            policy,
            tokenizer,
            slots=slots,
            stop_ids=_stop_ids(tokenizer, stop_ids),
            pad_id=pad,
            steps=decode_steps,
            batches=concurrent_batches,
            gather_seconds=batch_gather_ms / 1000,
        )
        self._seeds = np.random.default_rng(seed)  # seeds of requests without one
        self._recordings: list[Recording] = []
        self._echoed = 0  # requests answered without sampling (echo, max_tokens=0)
        self._lock = threading.Lock()
        self._http: http.server.ThreadingHTTPServer | None = None
        self._http_thread: threading.Thread | None = None

    # ----- lifecycle -----

    @property
    def url(self) -> str:
        """The base URL of the API, `http://HOST:PORT/v1`."""
        if self._http is None:
            raise RuntimeError("the server is not started: call start()")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def start(self) -> "Server":
        """Start the scheduler and the HTTP server (returns immediately)."""
        if self._http is not None:
            raise RuntimeError("the server is already started")
        self.scheduler.start()
        try:
            kind = _HTTPServer6 if ":" in self.host else _HTTPServer
            self._http = kind((self.host, self.port), _Handler)
        except OSError as e:
            self.scheduler.stop()
            raise OSError(e.errno, f"cannot listen on {self.host}:{self.port}: {e.strerror}") from e
        self._http.app = self  # type: ignore[attr-defined]
        self.port = self._http.server_address[1]
        self._http_thread = threading.Thread(
            target=self._http.serve_forever, name="rlhf_eqx-http", daemon=True
        )
        self._http_thread.start()
        return self

    def stop(self) -> None:
        """Stop serving: no new connections; the running batch finishes and is
        answered, requests still waiting get 503 (`"the server is stopping"`), idle
        connections are closed; returns once every thread of the server has ended. A
        `KeyboardInterrupt` that cuts the wait short (a second Ctrl-C) still fails the
        waiting requests and closes the idle connections before it propagates (the
        connections answering the running batch end once it is answered)."""
        http_server, self._http = self._http, None
        try:
            if http_server is not None:
                http_server.stopping = True  # each answer from now on closes its connection
                http_server.shutdown()  # no new connections
            if self._http_thread is not None:
                self._http_thread.join()
                self._http_thread = None
            self.scheduler.stop()  # the running batch finishes, waiting requests get 503
        finally:  # even when a second Ctrl-C cuts the wait short
            if http_server is not None:
                http_server.close_connections()  # idle ones end; busy ones once answered
                http_server.socket.close()  # the listening socket
        if http_server is not None:
            http_server.server_close()  # joins the connections' threads

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ----- weights and recordings -----

    @property
    def policy(self):
        """The policy the next batch samples with."""
        return self.scheduler.policy

    @property
    def policy_version(self) -> int:
        """0 for the policy the server started with, one more at each `update_policy`."""
        return self.scheduler.version

    def update_policy(self, policy) -> int:
        """Sample with `policy` from the next batch on; a batch already running finishes
        on the weights it started with (its completions carry their `policy_version`).

        **Returns:** the new policy version. Raises `ValueError` when `policy`'s
        vocabulary size or context differs from the served one's."""
        old = self.scheduler.policy.cfg
        new = getattr(policy, "cfg", None)
        for field in ("vocab_size", "max_seq_len"):
            if getattr(new, field, None) != getattr(old, field):
                raise ValueError(
                    f"update_policy: policy.cfg.{field}={getattr(new, field, None)!r} differs "
                    f"from the served model's {getattr(old, field)!r}"
                )
        return self.scheduler.set_policy(policy)

    @contextlib.contextmanager
    def recording(self) -> Iterator[Recording]:
        """Record every completion returned inside the block (`Recording`): an outside
        environment drives episodes over HTTP, tagging each request with its episode
        (`episode_id` in the body, e.g. the OpenAI client's `extra_body`, or `user`)."""
        rec = Recording()
        with self._lock:
            self._recordings.append(rec)
        try:
            yield rec
        finally:
            with self._lock:
                self._recordings.remove(rec)

    def reward(self, episode_id: str, body: object) -> dict:
        """Answer `POST /v1/episodes/{episode_id}/reward` with `{"reward": r}`: report
        the episode's reward to every open recording that holds it (`Recording.reward`),
        for an environment that has no handle on the recording (another process).
        Raises `RequestError`: 400 for a reward that is not a finite number, 404 when
        no open recording holds the episode."""
        reward = body.get("reward") if isinstance(body, dict) else None
        if not (isinstance(reward, int | float) and not isinstance(reward, bool)) or not (
            math.isfinite(reward)
        ):
            raise RequestError(f"reward must be a finite number, got {reward!r}", param="reward")
        with self._lock:
            recordings = list(self._recordings)
        found = False
        for rec in recordings:
            try:
                rec.reward(episode_id, float(reward))
                found = True
            except KeyError:
                pass
        if not found:
            raise RequestError(
                f"no open recording holds episode {episode_id!r}",
                param="episode_id",
                status=404,
                code="not_found",
            )
        return {"episode_id": episode_id, "reward": float(reward)}

    @property
    def batch_log(self) -> list[tuple[str, ...]]:
        """The request ids of the scheduler's last 1,024 batches, in the order it ran
        them (each batch in arrival order)."""
        return list(self.scheduler.batch_log)

    # ----- requests -----

    def _seed(self, seed: int | None) -> int:
        """The request's seed (mod 2**32), or one drawn from the server's seed."""
        if seed is not None:
            return seed % 2**32
        with self._lock:
            return int(self._seeds.integers(2**32))

    def _budget(self, max_tokens: int | None, prompt_len: int, kind: str) -> int:
        ctx = self.scheduler.policy.cfg.max_seq_len
        if prompt_len >= ctx:
            raise RequestError(
                f"the prompt is {prompt_len} tokens; the model's context is {ctx}",
                param="messages" if kind == "chat" else "prompt",
                code="context_length_exceeded",
            )
        if max_tokens is None:
            return min(self.max_new_tokens, ctx - prompt_len)
        if prompt_len + max_tokens > ctx:
            raise RequestError(
                f"max_tokens={max_tokens} with a {prompt_len}-token prompt is above the "
                f"model's context of {ctx} tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return max_tokens

    def _submit(self, req, prompts: list[list[int]], prefix: str, stream: bool = False) -> Job:
        """Check `req`'s size against the server's limits and queue its rows (every
        choice of every prompt) for the scheduler."""
        budgets = [self._budget(req.max_tokens, len(p), req.kind) for p in prompts]
        count = len(prompts) * req.n
        if count > self.max_request_rows:
            raise RequestError(
                f"{len(prompts)} prompt(s) × n={req.n} asks for {count} completions; this "
                f"server takes at most {self.max_request_rows} per request "
                "(max_request_rows, --max-request-rows)",
                param="n" if req.n > 1 else "prompt",
            )
        tokens = sum(budgets) * req.n
        if tokens > self.max_request_tokens:
            most = max(budgets)
            raise RequestError(
                f"max_tokens: {count} completion(s) of up to {most} tokens ask for {tokens} "
                f"tokens; this server takes at most {self.max_request_tokens} completion "
                "tokens per request (max_request_tokens, --max-request-tokens)",
                param="max_tokens",
            )
        seed = self._seed(req.seed)
        rows = []
        for i, (ids, budget) in enumerate(zip(prompts, budgets)):
            for g in range(req.n):
                choice = -1 if count == 1 else i * req.n + g
                rows.append(Row(prompt=tuple(ids), seed=seed, choice=choice, budget=budget))
        job = Job(
            rows=rows,
            request=req,
            prefix=prefix,
            stream=queue.SimpleQueue() if stream else None,
        )
        self.scheduler.submit(job)
        return job

    @staticmethod
    def _wait(job: Job, client_gone: Callable[[], bool] | None) -> list[Sample]:
        """`job`'s samples; when `client_gone()` turns true first, the job is dropped and
        `ClientGone` raised."""
        while True:
            try:
                return job.future.result(timeout=_POLL)
            except concurrent.futures.TimeoutError:
                if client_gone is not None and client_gone():
                    job.cancel()
                    raise ClientGone() from None

    @staticmethod
    def _progress(
        job: Job, client_gone: Callable[[], bool] | None
    ) -> Iterator[Progress | Finished]:
        """A streamed job's `Progress` and `Finished`, until its rows are done
        (`ClientGone` as `_wait`)."""
        assert job.stream is not None
        while True:
            try:
                event = job.stream.get(timeout=_POLL)
            except queue.Empty:
                if client_gone is not None and client_gone():
                    job.cancel()
                    raise ClientGone() from None
                continue
            if event is None:
                return
            yield event

    def _record(self, req, request_id, index, prompt_ids, sample, messages, text) -> str:
        """Record a choice in the open recordings and remember its episode's context;
        returns the choice's text."""
        episode = req.episode_id or request_id
        if max(len(req.prompts), 1) * req.n > 1:  # one episode per choice
            episode = f"{episode}/{index}"
        turn = Turn(
            episode_id=episode,
            prompt_ids=tuple(prompt_ids),
            completion_ids=sample.ids,
            logprobs=sample.logprobs,
            finish_reason=sample.finish_reason,
            policy_version=sample.policy_version,
            temperature=req.temperature,
            request_id=request_id,
        )
        with self._lock:
            recordings = list(self._recordings)
        for rec in recordings:
            rec.add(turn)
        if req.episode_id is not None and isinstance(text, str):
            self.prompts.remember(
                episode,
                EpisodeContext(
                    messages=None if messages is None else tuple(messages),
                    prompt_text=text,
                    ids=tuple(prompt_ids) + sample.ids,
                    content=sample.text,
                    tail=sample.tail,
                    stop_text=self.prompts.stop_text(sample.stop_id),
                ),
            )
        return sample.text

    def _token_texts(
        self, ids: Sequence[int], top, context: Sequence[int] = ()
    ) -> tuple[list[str], list[list[tuple[str, float]]]]:
        """Each token's text, and its alternatives' (`(text, logprob)`): what the token
        adds to the text decoded before it, after the tokens `context` (a lone token's
        decoding loses a leading space in SentencePiece vocabularies). A token holding
        part of a character adds U+FFFD here (`_entry` spells it by its bytes)."""

        def piece(before: list[int], prev: str, token_id: int) -> str:
            text = self.tokenizer.decode(before + [token_id])
            return text[len(prev) :] if text.startswith(prev) else self.tokenizer.decode([token_id])

        texts, tops = [], []
        for t, token_id in enumerate(ids):
            before = list(context) + list(ids[:t])
            prev = self.tokenizer.decode(before)
            texts.append(piece(before, prev, token_id))
            tops.append([(piece(before, prev, i), lp) for i, lp in ((top[t] or ()) if top else ())])
        return texts, tops

    def _entry(self, text: str, token_id: int) -> tuple[str, list[int]]:
        """`(token, bytes)` of a log-probability entry: the token's text, or for a token
        holding part of a character its bytes escaped (`\\xe2\\x80`), and its true
        bytes."""
        return piece_entry(text, token_bytes(self.tokenizer, token_id))

    def chat(self, body: object, *, client_gone: Callable[[], bool] | None = None):
        """Answer a `/v1/chat/completions` body (a decoded JSON object) with the
        response object, or for `"stream": true` an iterator of its chunks (each a
        `chat.completion.chunk`); raises `RequestError` for a request OpenAI would
        refuse. `client_gone()`, polled while waiting, drops the request when true."""
        req = parse_request(body, "chat", model_names=(self.model_name,), vocab_size=self._vocab())
        text, prompt_ids = self.prompts.chat(req.messages, req.episode_id)
        job = self._submit(req, [prompt_ids], "chatcmpl", stream=req.stream)
        if req.stream:
            return self._stream(req, job, [prompt_ids], client_gone, text)
        samples = self._wait(job, client_gone)
        choices = []
        for g, s in enumerate(samples):
            content = self._record(req, job.request_id, g, prompt_ids, s, req.messages, text)
            logprobs = None
            if req.logprobs:
                logprobs = {"content": self._chat_logprobs(s.ids, s.logprobs, s.top)}
            choices.append(
                {
                    "index": g,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": s.finish_reason,
                    "logprobs": logprobs,
                    "token_ids": list(s.ids),
                    "policy_version": s.policy_version,
                }
            )
        out = self._response(job.request_id, "chat.completion", choices, [prompt_ids], samples)
        return out | {"prompt_token_ids": list(prompt_ids)}

    def _chat_logprobs(self, ids, logprobs, top, context: Sequence[int] = ()) -> list[dict]:
        def entry(text: str, token_id: int, lp: float) -> dict:
            token, raw = self._entry(text, token_id)
            return {"token": token, "logprob": lp, "bytes": raw}

        texts, tops = self._token_texts(ids, top, context)
        alternatives = [[i for i, _ in t] for t in top] if top else [[] for _ in ids]
        return [
            entry(text, i, lp)
            | {"top_logprobs": [entry(a, j, alp) for (a, alp), j in zip(tt, alt)]}
            for text, i, lp, tt, alt in zip(texts, ids, logprobs, tops, alternatives)
        ]

    def _completion_logprobs(self, ids, logprobs, top, context, offset: int = 0) -> dict:
        texts, tops = self._token_texts(ids, top, context)
        offsets = list(itertools.accumulate([offset] + [len(x) for x in texts]))[:-1]
        alternatives = [[i for i, _ in (t or ())] for t in top] if top else []
        return {
            "tokens": [self._entry(x, i)[0] for x, i in zip(texts, ids)],
            "token_logprobs": list(logprobs),
            "top_logprobs": [
                None if t is None else {self._entry(a, j)[0]: alp for (a, alp), j in zip(tt, alt)}
                for tt, alt, t in zip(tops, alternatives, top)
            ]
            if top
            else None,
            "text_offset": offsets,
        }

    def completions(self, body: object, *, client_gone: Callable[[], bool] | None = None):
        """Answer a `/v1/completions` body, or stream it, as `chat` does."""
        req = parse_request(
            body, "completion", model_names=(self.model_name,), vocab_size=self._vocab()
        )
        prompts = [self.prompts.completion(p, req.episode_id) for p in req.prompts]
        if req.max_tokens == 0:  # echo: the prompts scored, nothing sampled
            request_id, samples = self._nothing_sampled(req, prompts)
        else:
            job = self._submit(req, prompts, "cmpl", stream=req.stream)
            if req.stream:
                return self._stream(req, job, prompts, client_gone)
            request_id, samples = job.request_id, self._wait(job, client_gone)
        scored = [self._prompt_logprobs(req, p) for p in prompts] if req.echo else None
        choices = []
        for index, s in enumerate(samples):
            p = index // req.n
            prompt = req.prompts[p]
            text = s.text
            if req.max_tokens != 0:
                text = self._record(req, request_id, index, prompts[p], s, None, prompt)
            logprobs = None
            if req.logprobs:
                context = tuple(prompts[p][-DECODE_CONTEXT:])
                offset = len(self._prompt_text(prompt)) if req.echo else 0
                logprobs = self._completion_logprobs(s.ids, s.logprobs, s.top, context, offset)
                if scored is not None:
                    logprobs = _joined_logprobs(scored[p], logprobs)
            if req.echo:
                text = self._prompt_text(prompt) + text
            choices.append(
                {
                    "index": index,
                    "text": text,
                    "finish_reason": s.finish_reason,
                    "logprobs": logprobs,
                    "token_ids": list(s.ids),
                    "prompt_token_ids": list(prompts[p]),
                    "policy_version": s.policy_version,
                }
            )
        out = self._response(request_id, "text_completion", choices, prompts, samples)
        if len(prompts) == 1:
            out["prompt_token_ids"] = list(prompts[0])
        return out

    def _prompt_text(self, prompt: str | tuple[int, ...]) -> str:
        """A prompt's text as `echo` gives it back (a token-id prompt decoded)."""
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(list(prompt))

    def _nothing_sampled(self, req, prompts: list[list[int]]) -> tuple[str, list[Sample]]:
        """`(request id, samples)` of a request with `max_tokens=0`: empty completions."""
        empty = Sample(
            ids=(),
            logprobs=(),
            text="",
            tail="",
            finish_reason="length",
            stop_id=None,
            top=() if req.top_logprobs else None,
            policy_version=self.policy_version,
            generated=0,
        )
        with self._lock:
            self._echoed += 1
            request_id = f"cmpl-echo-{self._echoed}"
        return request_id, [empty] * (len(prompts) * req.n)

    def _prompt_logprobs(self, req, ids: list[int]) -> dict:
        """The `logprobs` of a prompt's tokens for `echo`: each token's log-probability
        after the ones before it at the request's temperature (1 when greedy), `None`
        for the first, with its alternatives when asked."""
        n = len(ids)
        length = max(16, 1 << (n - 1).bit_length())  # bucketed: few compiled shapes
        tokens = np.zeros((1, length), np.int32)
        tokens[0, :n] = ids
        mask = np.arange(length)[None] < n
        top_ids, top_lp, taken = top_logprobs(
            self.scheduler.policy,
            jnp.asarray(tokens),
            jnp.asarray(mask),
            jnp.asarray([req.temperature or 1.0], jnp.float32),
        )
        k = req.top_logprobs
        top_ids, top_lp, taken = (np.asarray(x)[0] for x in (top_ids, top_lp, taken))
        top = [None] + [
            tuple((int(top_ids[t, j]), float(top_lp[t, j])) for j in range(k)) for t in range(n - 1)
        ]
        return self._completion_logprobs(ids, [None, *taken[: n - 1].tolist()], k and top, ())

    def _stream(
        self,
        req,
        job: Job,
        prompts: list[list[int]],
        client_gone: Callable[[], bool] | None,
        chat_text: str | None = None,
    ) -> Iterator[dict]:
        """The chunks of a streamed answer: each row's new text as it comes (with its
        tokens' ids and log-probabilities), each choice's last piece with its
        `finish_reason` as soon as that choice is done (its request's other choices may
        go on), then (`include_usage`) the usage. The pieces of a choice join into the
        text the request gives unstreamed. The choices are recorded once every one is
        done, before the last choice's last piece is sent."""
        chat = req.kind == "chat"
        base = {
            "id": job.request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
        }
        if req.include_usage:  # OpenAI's: every chunk but the last has `usage: null`
            base["usage"] = None
        sent_text = [""] * len(job.rows)
        sent_ids: list[list[int]] = [[] for _ in job.rows]

        def choice(k: int, text: str, ids, logprobs, top, finish) -> dict:
            p = k // req.n
            context = () if chat else tuple(prompts[p][-DECODE_CONTEXT:])
            context = context + tuple(sent_ids[k])
            entries = None
            if chat:
                if req.logprobs:
                    entries = {"content": self._chat_logprobs(ids, logprobs, top, context)}
                delta = {"content": text} if text or not finish else {}
                if not sent_text[k] and not sent_ids[k]:
                    delta = {"role": "assistant"} | delta
                out = {"index": k, "delta": delta, "logprobs": entries}
            else:
                if req.logprobs:
                    offset = len(sent_text[k])
                    entries = self._completion_logprobs(ids, logprobs, top, context, offset)
                out = {"index": k, "text": text, "logprobs": entries}
            sent_text[k] += text
            sent_ids[k] += list(ids)
            return out | {"finish_reason": finish, "token_ids": list(ids)}

        done: dict[int, Sample] = {}
        try:
            for event in self._progress(job, client_gone):
                if isinstance(event, Progress):
                    c = choice(event.index, event.text, event.ids, event.logprobs, event.top, None)
                    yield base | {"choices": [c]}
                    continue
                k, s = event.index, event.sample
                done[k] = s
                if len(done) == len(job.rows):  # recorded as the choices were unstreamed
                    for g in range(len(job.rows)):
                        p = g // req.n
                        given = (req.messages, chat_text) if chat else (None, req.prompts[p])
                        self._record(req, job.request_id, g, prompts[p], done[g], *given)
                rest = s.text[len(sent_text[k]) :] if s.text.startswith(sent_text[k]) else ""
                n = len(sent_ids[k])
                top = s.top[n:] if s.top else None
                c = choice(k, rest, s.ids[n:], s.logprobs[n:], top, s.finish_reason)
                yield base | {"choices": [c | {"policy_version": s.policy_version}]}
            samples = self._wait(job, client_gone)
            if req.include_usage:
                yield base | {"choices": [], "usage": self._usage(prompts, samples)}
        finally:
            if not job.future.done():
                job.cancel()  # the client stopped reading

    def _usage(self, prompts, samples) -> dict:
        prompt_tokens = sum(len(p) for p in prompts)
        completion_tokens = sum(s.generated for s in samples)  # stop strings' included
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    def _response(self, request_id, kind, choices, prompts, samples) -> dict:
        return {
            "id": request_id,
            "object": kind,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": self._usage(prompts, samples),
        }

    def models(self) -> dict:
        """The `/v1/models` response: the one served model, `created` (a Unix time, as
        OpenAI's) the time this server was made."""
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "rlhf_eqx",
                }
            ],
        }

    def _vocab(self) -> int:
        return self.scheduler.policy.cfg.vocab_size


class _HTTPServer(http.server.ThreadingHTTPServer):
    """One thread per connection; `stop` closes the connections and joins the threads
    (none is left running into the interpreter's exit)."""

    daemon_threads = False
    block_on_close = True
    # connections the kernel holds until they are accepted (socketserver's 5 resets the
    # sixth of many clients connecting at once)
    request_queue_size = socket.SOMAXCONN

    def __init__(self, *args: Any, **kwargs: Any):
        self._open: set[socket.socket] = set()
        self._busy: set[socket.socket] = set()  # answering a request they have read
        self._open_lock = threading.Lock()
        self.stopping = False
        super().__init__(*args, **kwargs)

    @contextlib.contextmanager
    def answering(self, sock: socket.socket) -> Iterator[None]:
        """While a connection answers a request it has read (`close_connections`
        leaves it to finish)."""
        with self._open_lock:
            self._busy.add(sock)
        try:
            yield
        finally:
            with self._open_lock:
                self._busy.discard(sock)

    def process_request(self, request, client_address) -> None:
        with self._open_lock:
            self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request) -> None:
        with self._open_lock:
            self._open.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        """End the connections that wait for a request (a busy one closes itself once
        it has answered: `stopping`)."""
        with self._open_lock:
            sockets = list(self._open - self._busy)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request, client_address) -> None:
        del request, client_address  # a client gone mid-answer: nothing to do


class _HTTPServer6(_HTTPServer):
    address_family = socket.AF_INET6


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "rlhf_eqx"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        del format, args

    def handle_one_request(self) -> None:
        """`http.server`'s, with the wait for a request bounded by `Server.head_seconds`
        between two bytes: a connection that sends nothing that long is closed (idle
        between requests), one whose request line or headers stop arriving that long
        gets 408 and is closed."""
        seconds = self.server.app.head_seconds  # type: ignore[attr-defined]
        self.connection.settimeout(seconds)
        try:
            try:
                if not self.rfile.peek(1):  # the client closed its side
                    self.close_connection = True
                    return
            except OSError:  # idle for `seconds` (a timeout), or reset
                self.close_connection = True
                return
            self.requestline, self.request_version, self.command = "", "", ""
            try:
                self.raw_requestline = self.rfile.readline(65537)
                if len(self.raw_requestline) > 65536:
                    self.send_error(414)
                    return
                if not self.parse_request():  # refused (an error sent)
                    return
            except TimeoutError:
                self.close_connection = True
                self.send_error(
                    408,
                    f"the request line and headers did not arrive: no byte came for {seconds:g} s",
                )
                return
        finally:
            self.connection.settimeout(None)
        method = getattr(self, f"do_{self.command}", None)
        if method is None:
            self.send_error(501)
            return
        method()
        self.wfile.flush()

    def send_error(self, code: int, message: str | None = None, explain: str | None = None):
        """`http.server`'s own refusals (an unknown method, a malformed request line or
        header) as OpenAI's JSON error, not an HTML page."""
        del explain
        reason = self.responses.get(code, ("error",))[0]
        err = RequestError(message or reason, status=code)
        if code == 501:  # an unknown method
            err = RequestError(f"method {self.command} is not allowed here", status=405)
        self.close_connection = True
        try:
            self._send(err.status, err.body())
        except OSError:
            pass

    def _send(self, status: int, body: dict) -> None:
        if getattr(self.server, "stopping", False):
            self.close_connection = True
        payload = json.dumps(body).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(payload)

    def _client_gone(self) -> bool:
        """Whether the client has closed its connection (it reads as ended: no request
        of its own waits in it)."""
        try:
            if hasattr(socket, "MSG_DONTWAIT"):  # any descriptor, however many are open
                peek = socket.MSG_PEEK | socket.MSG_DONTWAIT
                return self.connection.recv(1, peek) == b""
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (BlockingIOError, InterruptedError):  # nothing to read: still there
            return False
        except (OSError, ValueError):  # reset, or closed here
            return True

    def _send_stream(self, chunks: Iterator[dict]) -> None:
        """Send `chunks` as server-sent events (`data: JSON`, then `data: [DONE]`), in a
        chunked body. A client gone mid-stream ends it (the generator's `close` drops the
        request's rows); an error once the stream has begun is sent as an event
        `{"error": ...}`."""
        if getattr(self.server, "stopping", False):
            self.close_connection = True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()

        def event(data: bytes) -> None:
            payload = b"data: " + data + b"\n\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(payload), payload))

        try:
            try:
                for chunk in chunks:
                    event(json.dumps(chunk).encode("utf-8"))
            except ClientGone:
                raise
            except RequestError as e:
                event(json.dumps(e.body()).encode("utf-8"))
            except Exception as e:  # noqa: BLE001 - the server keeps serving
                event(json.dumps(_server_error(e)).encode("utf-8"))
            event(b"[DONE]")
            self.wfile.write(b"0\r\n\r\n")
        except (OSError, ClientGone):
            self.close_connection = True
        finally:
            if hasattr(chunks, "close"):
                chunks.close()  # type: ignore[attr-defined]

    def _path(self) -> str:
        return self.path.split("?", 1)[0].rstrip("/")

    def do_GET(self) -> None:
        app: Server = self.server.app  # type: ignore[attr-defined]
        if self._path() == "/v1/models":
            self._send(200, app.models())
        elif urllib.parse.unquote(self._path()) == f"/v1/models/{app.model_name}":
            self._send(200, app.models()["data"][0])
        elif self._path() == "/health":
            self._send(200, {"status": "ok"})
        else:
            err = RequestError(f"no route GET {self._path()}", status=404, code="not_found")
            self._send(err.status, err.body())

    def _length(self) -> int:
        """The body's length; a body whose length is not given is refused (411) and
        the connection closed (its bytes would be read as the next request)."""
        value = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding") or (value is not None and not value.isdigit()):
            self.close_connection = True
            raise RequestError(
                "the body needs a Content-Length (chunked bodies are not read), got "
                f"Content-Length={value!r}",
                status=411 if value is None else 400,
            )
        return int(value or 0)

    def _body(self, length: int, seconds: float) -> bytes:
        """The body's `length` bytes. One that stops arriving for `seconds`, or ends
        before `length` (the client closed its side), is refused and the connection
        closed (408 / 400)."""
        if length <= 0:
            return b""
        self.connection.settimeout(seconds)
        try:
            raw = self.rfile.read(length)
        except TimeoutError:
            self.close_connection = True
            raise RequestError(
                f"the body did not arrive: Content-Length is {length} bytes, and no byte came "
                f"for {seconds:g} s",
                status=408,
            ) from None
        finally:
            self.connection.settimeout(None)
        if len(raw) < length:
            self.close_connection = True
            raise RequestError(
                f"the body ended after {len(raw)} of its Content-Length {length} bytes"
            )
        return raw

    def do_POST(self) -> None:
        app: Server = self.server.app  # type: ignore[attr-defined]
        routes: dict[str, Callable[[object], Any]] = {
            "/v1/chat/completions": lambda body: app.chat(body, client_gone=self._client_gone),
            "/v1/completions": lambda body: app.completions(body, client_gone=self._client_gone),
        }
        try:
            length = self._length()
            if length > _MAX_BODY:
                self.close_connection = True  # the body is left unread
                raise RequestError(f"the body is above {_MAX_BODY} bytes", status=413)
            raw = self._body(length, app.body_seconds)
            handler = routes.get(self._path())
            parts = self._path().split("/")  # "", "v1", "episodes", ID, "reward"
            if len(parts) >= 5 and parts[1:3] == ["v1", "episodes"] and parts[-1] == "reward":
                # an ID may hold "/" as is: choice g of a request is episode "ID/g"
                episode_id = urllib.parse.unquote("/".join(parts[3:-1]))
                handler = lambda body: app.reward(episode_id, body)  # noqa: E731
            if handler is None:
                raise RequestError(f"no route POST {self._path()}", status=404, code="not_found")
            try:
                body = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise RequestError(f"the body is not valid JSON: {e}") from None
            except RecursionError:  # arrays or objects nested thousands deep
                raise RequestError("the body is not valid JSON: nested too deeply") from None
            with self.server.answering(self.connection):  # type: ignore[attr-defined]
                answer = handler(body)
                if isinstance(answer, dict):
                    self._send(200, answer)
                else:
                    self._send_stream(answer)
        except ClientGone:
            self.close_connection = True  # nobody to answer
        except RequestError as e:
            self._send(e.status, e.body())
        except ValueError as e:  # what the sampler refuses (a prompt it cannot take)
            self._send(400, RequestError(str(e)).body())
        except Exception as e:  # noqa: BLE001 - the server keeps serving
            self._send(500, _server_error(e))


def _joined_logprobs(head: dict, tail: dict) -> dict:
    """Completions `logprobs` of a text followed by another (offsets of `tail` already
    after `head`'s text)."""
    out = {k: head[k] + tail[k] for k in ("tokens", "token_logprobs", "text_offset")}
    tops = (head["top_logprobs"], tail["top_logprobs"])
    out["top_logprobs"] = None if tops == (None, None) else (tops[0] or []) + (tops[1] or [])
    return out


def _server_error(e: Exception) -> dict:
    """OpenAI's error object for an unexpected failure."""
    return {
        "error": {
            "message": f"{type(e).__name__}: {e}",
            "type": "server_error",
            "param": None,
            "code": None,
        }
    }
