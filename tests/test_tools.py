"""Tool calls: parsing, every error path, timeouts, the safe calculator, and a tool-using
episode rolled out end to end."""

import ast
import json
import threading
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st
from jaxtyping import Array, Int

import rlhf_eqx as rx
from rlhf_eqx.envs import (
    ToolCall,
    ToolEnvironment,
    calculator,
    call_tool,
    parse_tool_calls,
    rollout_multiturn_host,
)
from rlhf_eqx.models import AbstractDecoder

TOOLS = {"calculator": calculator}


def _call(name, **arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


# ------------------------------------------------------------------------------ parsing


def test_parse_calls_in_order():
    text = (
        "Let me compute. "
        + _call("calculator", expression="1+1")
        + " and "
        + '<tool_call>\n{"name": "search", "arguments": "{\\"q\\": \\"owls\\"}"}\n</tool_call>'
    )
    assert parse_tool_calls(text) == [
        ToolCall("calculator", {"expression": "1+1"}),
        ToolCall("search", {"q": "owls"}),
    ]
    assert parse_tool_calls("The answer is 4.") == []
    assert parse_tool_calls('<tool_call>{"name": "f"}</tool_call>') == [ToolCall("f", {})]


@pytest.mark.parametrize(
    "body, message",
    [
        ("{not json}", "invalid JSON in tool call"),
        ("[1, 2]", "must be a JSON object, got list"),
        ('{"arguments": {}}', 'needs a string "name"'),
        ('{"name": 3}', 'needs a string "name"'),
        ('{"name": "f", "arguments": [1]}', '"arguments" must be a JSON object, got list'),
        ('{"name": "f", "arguments": "{oops"}', "invalid JSON in the arguments string"),
    ],
)
def test_malformed_calls_become_errors(body, message):
    (call,) = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert message in call.error
    assert call_tool(TOOLS, call).startswith("error: ")


def test_unterminated_call_is_an_error():
    calls = parse_tool_calls(_call("calculator", expression="2") + ' <tool_call>{"name": "calc')
    assert calls[0] == ToolCall("calculator", {"expression": "2"})
    assert calls[1].error == "unterminated <tool_call> (no </tool_call>)"


# ------------------------------------------------------------------------------ running


def test_call_tool_results_and_errors():
    def boom():
        raise RuntimeError("disk on fire")

    tools = {"calculator": calculator, "boom": boom, "table": lambda: {"a": [1, 2]}}
    assert call_tool(tools, ToolCall("calculator", {"expression": "2 + 3 * 4"})) == "14"
    assert call_tool(tools, ToolCall("table", {})) == '{"a": [1, 2]}'
    assert call_tool(tools, ToolCall("weather", {})) == (
        "error: unknown tool 'weather'; available tools: ['boom', 'calculator', 'table']"
    )
    assert call_tool(tools, ToolCall("boom", {})) == "error: RuntimeError: disk on fire"
    wrong = call_tool(tools, ToolCall("calculator", {"expr": "1"}))
    assert wrong.startswith("error: TypeError:") and "expr" in wrong
    assert call_tool(tools, ToolCall("calculator", {"expression": "1/0"})) == (
        "error: ValueError: division by zero"
    )


def test_slow_tool_times_out_without_hanging():
    release = threading.Event()

    def slow():
        release.wait(10.0)
        return "late"

    start = time.perf_counter()
    out = call_tool({"slow": slow}, ToolCall("slow", {}), timeout=0.2)
    elapsed = time.perf_counter() - start
    release.set()
    assert out == "error: tool 'slow' timed out after 0.2 s"
    assert 0.2 <= elapsed < 2.0
    # inside an environment the episode goes on
    env = ToolEnvironment(
        {"slow": slow}, rx.data.ByteTokenizer(), timeout=0.2, max_observation_tokens=400
    )
    release.clear()
    env.reset([])
    start = time.perf_counter()
    obs, reward, done = env.step_text(_call("slow") + _call("calculator", expression="6*7"))
    release.set()
    assert time.perf_counter() - start < 2.0
    assert obs == (
        "<tool_response>error: tool 'slow' timed out after 0.2 s</tool_response>\n"
        "<tool_response>error: unknown tool 'calculator'; available tools: ['slow']"
        "</tool_response>"
    )
    assert (reward, done) == (0.0, False)


# --------------------------------------------------------------------------- calculator


@pytest.mark.parametrize(
    "expression, value",
    [
        ("2 + 3 * 4", 14),
        ("(2 + 3) * 4", 20),
        ("-2 ** 2", -4),
        ("7 // 2 + 7 % 2", 4),
        ("1 / 4", 0.25),
        ("2 ** -2", 0.25),
        ("1.5e3 - +0.5", 1499.5),
        ("10 ** 100 // 10 ** 99", 10),
    ],
)
def test_calculator_values(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    "expression, message",
    [
        ("__import__('os').system('ls')", "Call is not allowed"),
        ("x + 1", "Name is not allowed"),
        ("(1).real", "Attribute is not allowed"),
        ("[1, 2][0]", "Subscript is not allowed"),
        ("1 < 2", "Compare is not allowed"),
        ("True + 1", "only numbers are allowed"),
        ("'a' * 3", "only numbers are allowed"),
        ("2j", "only numbers are allowed"),
        ("2 ** 1000", "exceeds the limit of 100"),
        ("99 ** 99", "exceeds 512 bits"),
        ("(10 ** 90) * (10 ** 90)", "exceeds 512 bits"),
        ("1e300 * 1e300", "not finite"),
        ("1e300 ** 2", "numeric overflow"),
        ("(-8) ** 0.5", "complex"),
        ("1 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("1 +", "not an arithmetic expression"),
        ("1" + "+1" * 150, "more than 200"),
        ("+" * 120 + "1", "syntax nodes"),
        ("lambda: 1", "Lambda is not allowed"),
    ],
)
def test_calculator_refuses(expression, message):
    with pytest.raises(ValueError, match=message):
        calculator(expression)


_numbers = st.integers(-50, 50).map(str) | st.floats(0.1, 50, allow_nan=False).map(
    lambda x: f"{x:.3f}"
)


@st.composite
def _expressions(draw, depth=0):
    if depth > 2 or draw(st.booleans()):
        return draw(_numbers)
    op = draw(st.sampled_from(["+", "-", "*", "/", "//", "%"]))
    return f"({draw(_expressions(depth + 1))} {op} {draw(_expressions(depth + 1))})"


@given(_expressions())
def test_calculator_equals_python_arithmetic(expression):
    tree = ast.parse(expression, mode="eval")
    try:
        expected = eval(compile(tree, "<test>", "eval"), {"__builtins__": {}})  # plain numbers
    except ZeroDivisionError:
        with pytest.raises(ValueError, match="division by zero"):
            calculator(expression)
        return
    assert calculator(expression) == expected


# ------------------------------------------------------------------- tool environment


def test_tool_environment_final_answer_and_reward():
    seen = []

    def reward_fn(prompt, answer):
        seen.append((prompt, answer))
        return float("14" in answer)

    env = ToolEnvironment(TOOLS, rx.data.ByteTokenizer(), reward_fn=reward_fn)
    assert env.reset(rx.data.ByteTokenizer().encode("What is 2+3*4?")) == []
    obs, reward, done = env.step_text(_call("calculator", expression="2+3*4"))
    assert (obs, reward, done) == ("<tool_response>14</tool_response>", 0.0, False)
    assert env.step_text("It is 14.") == ("", 1.0, True)
    assert seen == [("What is 2+3*4?", "It is 14.")]


def test_tool_environment_limits_calls_and_fits_observations():
    tok = rx.data.ByteTokenizer()
    calls = _call("echo", text="x" * 200) + _call("echo", text="short") + _call("echo", text="z")
    kw = dict(max_calls_per_turn=2, response_prefix="\nuser: ", response_suffix="\nassistant: ")
    env = ToolEnvironment({"echo": lambda text: text}, tok, max_observation_tokens=400, **kw)
    env.reset([])
    obs, _, _ = env.step_text(calls)
    assert obs == (
        "\nuser: <tool_response>" + "x" * 200 + "</tool_response>\n"
        "<tool_response>short</tool_response>\n"
        "<tool_response>error: at most 2 tool calls per turn</tool_response>\nassistant: "
    )
    env = ToolEnvironment({"echo": lambda text: text}, tok, max_observation_tokens=180, **kw)
    env.reset([])
    obs, _, _ = env.step_text(calls)
    assert len(tok.encode(obs)) <= 180
    assert obs.startswith("\nuser: <tool_response>xxx") and obs.endswith("\nassistant: ")
    assert "x...[cut]</tool_response>" in obs and obs.count("<tool_response>") == 3
    assert "<tool_response>short</tool_response>" in obs
    tiny = ToolEnvironment(TOOLS, tok, max_observation_tokens=5, response_prefix="x" * 10)
    tiny.reset([])
    with pytest.raises(ValueError, match="alone needs more than max_observation_tokens=5"):
        tiny.step_text(_call("calculator", expression="1"))


# ------------------------------------------------------------ a tool episode, end to end


class Replay(AbstractDecoder):
    """A decoder that always predicts `script[n]` after `n` real tokens: greedy decoding
    replays the script, and any observation that differs from it shows in the tokens."""

    script: Int[Array, " S"]
    vocab: int = eqx.field(static=True)

    @property
    def vocab_size(self):
        return self.vocab

    def _logits(self, n):
        nxt = self.script[jnp.clip(n, 0, self.script.shape[0] - 1)]
        return 10.0 * jax.nn.one_hot(nxt, self.vocab, dtype=jnp.float32)

    def __call__(self, tokens, mask, *, key=None):
        return jax.vmap(self._logits)(jnp.cumsum(mask, dtype=jnp.int32))

    def init_cache(self, cache_size):
        return jnp.zeros((), jnp.int32)

    def prefill(self, tokens, mask, *, cache_size):
        return self._logits(jnp.sum(mask, dtype=jnp.int32)), jnp.zeros((), jnp.int32)

    def decode_step(self, token, cache, *, index, position):
        return self._logits(position + 1), cache


SCRIPTS = {
    "ok": ("What is 2+3*4?", _call("calculator", expression="2+3*4"), "14", "It is 14."),
    "unknown": ("Weather?", _call("weather", city="Oslo"), None, "I cannot tell."),
    "bad_json": ("Go", "<tool_call>{name: calculator}</tool_call>", None, "Sorry, 14."),
}


@pytest.mark.parametrize("case", sorted(SCRIPTS))
def test_tool_episode_rolls_out(case):
    tok = rx.data.ByteTokenizer()
    question, call, result, answer = SCRIPTS[case]
    suffix = "\nA: "
    env_kw = dict(max_observation_tokens=160, response_suffix=suffix)
    reward_fn = lambda prompt, text: float("14" in text)
    probe = ToolEnvironment(TOOLS, tok, **env_kw)
    probe.reset([])
    expected_obs = probe.step_text(call)[0]
    if result is not None:
        assert expected_obs == f"<tool_response>{result}</tool_response>{suffix}"
    else:
        assert expected_obs.startswith("<tool_response>error: ")
    prompt = [tok.bos_id] + tok.encode(question)
    turn1 = tok.encode(call) + [tok.eos_id]
    obs = tok.encode(expected_obs)
    turn2 = tok.encode(answer) + [tok.eos_id]
    script = prompt + turn1 + obs + turn2
    policy = Replay(jnp.asarray(script + [tok.pad_id] * (400 - len(script)), jnp.int32), 259)
    envs = [ToolEnvironment(TOOLS, tok, reward_fn=reward_fn, **env_kw)]
    P = 24
    ids = jnp.asarray([[0] * (P - len(prompt)) + prompt], jnp.int32)
    tr = rollout_multiturn_host(
        policy,
        envs,
        ids,
        ids != 0,
        jax.random.key(0),
        max_turns=4,
        max_new_tokens=96,
        max_total_tokens=P + 96 + 160 + 96,
        temperature=0.0,
        eos_id=tok.eos_id,
    )
    tokens, mask, loss = (np.asarray(x[0]) for x in (tr.tokens, tr.mask, tr.loss_mask))
    assert tokens[mask].tolist() == script
    n = int(mask.sum())
    expected_loss = [False] * len(prompt) + [True] * len(turn1) + [False] * len(obs)
    assert loss[mask].tolist() == expected_loss + [True] * len(turn2)
    assert int(tr.num_turns[0]) == 2 and not bool(tr.truncated[0])
    assert float(tr.reward[0]) == float("14" in answer)
    assert n == len(script)
