"""Tool use: parse tool calls from a policy turn, run them with a timeout, answer with
their results.

**Format** (Hermes / Qwen style): a turn calls tools with one or more blocks

    <tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3 * 4"}}</tool_call>

(`arguments` may also be a JSON string holding the object, as OpenAI-style messages
write it). Each call is answered, in order, by

    <tool_response>14</tool_response>

and an error — malformed JSON, a missing name, an unknown tool, bad arguments, an
exception inside the tool, a timeout — by `<tool_response>error: ...</tool_response>`:
the policy sees what went wrong and the run goes on. A turn without a tool call is the
final answer and ends the episode.
"""

import dataclasses
import json
import math
import numbers
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any

from ..data import Tokenizer
from ._environment import TextEnvironment, _reward_and_done

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPEN = "<tool_call>"
_CUT = "...[cut]"
_MIN_TEXT = 2  # tokens of a cut response's text, at the least


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed tool call: `name` and `arguments`, or the `error` that made it unusable
    (then `name` may be `None`)."""

    name: str | None
    arguments: dict[str, Any]
    error: str | None = None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The tool calls of a turn, in order.

    **Arguments:**

    - `text`: the turn's text.

    **Returns:** one `ToolCall` per `<tool_call>...</tool_call>` block (see the module
    docstring for the format), with `error` set for a block that is not a JSON object
    with a string `"name"` and an object (or JSON-string object) `"arguments"`; a final
    `<tool_call>` without its closing tag gives one `ToolCall` with an error. An empty
    list means no tool was called.
    """
    calls = []
    end = 0
    for m in _CALL.finditer(text):
        end = m.end()
        calls.append(_parse_one(m.group(1)))
    if _OPEN in text[end:]:
        calls.append(ToolCall(None, {}, "unterminated <tool_call> (no </tool_call>)"))
    return calls


def _parse_one(body: str) -> ToolCall:
    try:
        value = json.loads(body.strip())
    except json.JSONDecodeError as e:
        return ToolCall(None, {}, f"invalid JSON in tool call ({e.msg} at column {e.colno})")
    if not isinstance(value, dict):
        return ToolCall(None, {}, f"a tool call must be a JSON object, got {type(value).__name__}")
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(None, {}, 'a tool call needs a string "name"')
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            return ToolCall(name, {}, f"invalid JSON in the arguments string ({e.msg})")
    if not isinstance(arguments, dict):
        return ToolCall(
            name, {}, f'"arguments" must be a JSON object, got {type(arguments).__name__}'
        )
    return ToolCall(name, arguments)


def _as_text(result: object) -> str:
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(result)


def call_tool(
    tools: Mapping[str, Callable[..., Any]], call: ToolCall, *, timeout: float = 5.0
) -> str:
    """Run one parsed call and return its result as text, or `"error: ..."`; never raises.

    The tool runs in a daemon thread; after `timeout` seconds the call is answered with
    a timeout error and the thread is abandoned (Python cannot stop a thread: a tool
    that can run forever should bound its own work, as `calculator` does). Results that
    are not strings are written as JSON (or `str`).

    **Arguments:**

    - `tools`: name → callable, called with the call's arguments as keywords.
    - `call`: a `ToolCall` (from `parse_tool_calls`).
    - `timeout`: seconds to wait for the result.
    """
    if call.error is not None:
        return f"error: {call.error}"
    if call.name not in tools:
        return f"error: unknown tool {call.name!r}; available tools: {sorted(tools)}"
    fn = tools[call.name]
    outcome: dict[str, object] = {}

    def run():
        try:
            outcome["result"] = fn(**call.arguments)
        except BaseException as e:  # noqa: BLE001 (every failure becomes an observation)
            outcome["error"] = f"{type(e).__name__}: {e}"

    thread = threading.Thread(target=run, name=f"tool-{call.name}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return f"error: tool {call.name!r} timed out after {timeout:g} s"
    if "error" in outcome:
        return f"error: {outcome['error']}"
    return _as_text(outcome.get("result"))


class ToolEnvironment(TextEnvironment):
    """A `TextEnvironment` in which the policy calls tools until it answers.

    Each turn is parsed with `parse_tool_calls`. With tool calls, each (at most
    `max_calls_per_turn`; the rest are answered with an error) runs through
    `call_tool`, and the observation is
    `response_prefix + "<tool_response>r1</tool_response>\\n..." + response_suffix`
    (reward 0, not done). Without one, the turn is the final answer: the episode ends
    with reward `reward_fn(prompt_text, answer_text)` (0 without `reward_fn`).

    The prefix and suffix place the responses in a chat format, e.g. for ChatML
    `response_prefix="<|im_end|>\\n<|im_start|>user\\n"`,
    `response_suffix="<|im_end|>\\n<|im_start|>assistant\\n"`. Responses too long for
    `max_observation_tokens` share it: each keeps a part (the shorter ones whole), cut at
    a word boundary where possible and marked `...[cut]`.

    **Arguments:**

    - `tools`: name → callable (keyword arguments from the call's `arguments`).
    - `tokenizer`: any `rlhf_eqx.data.Tokenizer`.
    - `max_observation_tokens`: the observations' static token budget.
    - `timeout`: seconds per tool call.
    - `max_calls_per_turn`: calls run per turn.
    - `reward_fn`: `(prompt_text, answer_text) -> float`, the final answer's reward.
    - `response_prefix`, `response_suffix`: text around the responses.
    """

    def __init__(
        self,
        tools: Mapping[str, Callable[..., Any]],
        tokenizer: Tokenizer,
        *,
        max_observation_tokens: int = 128,
        timeout: float | int = 5.0,
        max_calls_per_turn: int = 4,
        reward_fn: Callable[[str, str], float] | None = None,
        response_prefix: str = "",
        response_suffix: str = "",
    ):
        super().__init__(tokenizer, max_observation_tokens=max_observation_tokens)
        if not isinstance(tools, Mapping):
            raise TypeError(
                "tools must map names to callables (e.g. {'calculator': calculator}); got "
                f"{type(tools).__name__}: {tools!r}"
            )
        for name, fn in tools.items():
            if not (isinstance(name, str) and callable(fn)):
                raise TypeError(f"tools must map names to callables; got {name!r}: {fn!r}")
        real = isinstance(timeout, numbers.Real) and not isinstance(timeout, bool)
        if not (real and 0 < timeout < math.inf):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if isinstance(max_calls_per_turn, bool) or not (
            isinstance(max_calls_per_turn, int) and max_calls_per_turn > 0
        ):
            raise ValueError(
                f"max_calls_per_turn must be a positive int, got {max_calls_per_turn!r}"
            )
        if not (reward_fn is None or callable(reward_fn)):
            raise TypeError(
                f"reward_fn must be None or (prompt, answer) -> float, got {reward_fn!r}"
            )
        for name, text in (
            ("response_prefix", response_prefix),
            ("response_suffix", response_suffix),
        ):
            if not isinstance(text, str):
                raise TypeError(f"{name} must be a str, got {text!r}")
        self.tools = dict(tools)
        self.timeout = float(timeout)
        self.max_calls_per_turn = max_calls_per_turn
        self.reward_fn = reward_fn
        self.response_prefix = response_prefix
        self.response_suffix = response_suffix
        self.prompt = ""

    def reset_text(self, prompt: str) -> str:
        self.prompt = prompt
        return ""

    def step_text(self, completion: str) -> tuple[str, float, bool]:
        calls = parse_tool_calls(completion)
        if not calls:
            if self.reward_fn is None:
                return "", 0.0, True
            value = self.reward_fn(self.prompt, completion)
            reward, _ = _reward_and_done(value, True, f"{type(self).__name__}'s reward_fn")
            return "", reward, True
        results = []
        for i, call in enumerate(calls):
            if i < self.max_calls_per_turn:
                results.append(call_tool(self.tools, call, timeout=self.timeout))
            else:
                results.append(f"error: at most {self.max_calls_per_turn} tool calls per turn")
        return self._fit(results), 0.0, False

    def _render(self, results: list[str]) -> str:
        body = "\n".join(f"<tool_response>{r}</tool_response>" for r in results)
        return self.response_prefix + body + self.response_suffix

    def _fit(self, results: list[str]) -> str:
        """The rendered responses within `max_observation_tokens`: the tokens left after
        the frame are shared (a response shorter than its share is kept whole, its unused
        part goes to the others); a longer one keeps its beginning, cut at a word boundary
        where possible, followed by `...[cut]`. A budget too small for that (each cut
        response at least `_MIN_TEXT` tokens of text and the marker) is a `ValueError`
        naming the budget it needs."""
        budget = self.max_observation_tokens
        text = self._render(results)
        if len(self.encode_observation(text)) <= budget:
            return text
        n = lambda t: len(self.encode_observation(t))  # noqa: E731
        frame = n(self._render([""] * len(results)))
        if frame > budget:
            raise ValueError(
                f"the tool responses' frame ({self.response_prefix!r} ... "
                f"{self.response_suffix!r}) alone needs more than max_observation_tokens="
                f"{budget} tokens"
            )
        sizes, marker = [n(r) for r in results], n(_CUT)
        room = budget - frame
        need = len(results) * (marker + _MIN_TEXT)
        if room < need:
            raise ValueError(
                f"max_observation_tokens={budget} leaves {room} tokens for the text of "
                f"{len(results)} tool responses after their frame ({frame} tokens); each "
                f"needs at least {marker + _MIN_TEXT} to keep a readable part and {_CUT!r}: "
                f"raise max_observation_tokens to at least {frame + need}"
            )
        while True:  # token counts are not additive at the joins: shrink until it fits
            shares = _shares(sizes, room)
            cut = [
                r if k >= size else _cut(r, k - marker, n) if k >= marker else ""
                for r, k, size in zip(results, shares, sizes)
            ]
            text = self._render(cut)
            over = n(text) - budget
            if over <= 0 or room == 0:
                return text
            room = max(room - over, 0)


def _shares(sizes: list[int], room: int) -> list[int]:
    """`room` tokens shared fairly: in order of size, each gets its size or an equal part
    of what is left, whichever is smaller."""
    shares = [0] * len(sizes)
    left = room
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    for k, i in enumerate(order):
        shares[i] = min(sizes[i], left // (len(order) - k))
        left -= shares[i]
    return shares


def _cut(text: str, tokens: int, n: Callable[[str], int]) -> str:
    """The longest beginning of `text` of at most `tokens` tokens (`n` counts them), cut
    back to the last word boundary in it (if any: a first word longer than the budget is
    cut inside), then `...[cut]`."""
    lo, hi = 0, len(text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if n(text[:mid]) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    head = text[:lo]
    space = max(head.rfind(" "), head.rfind("\n"))
    if lo < len(text) and not text[lo].isspace() and space > 0:
        head = head[:space]
    return head.rstrip() + _CUT
