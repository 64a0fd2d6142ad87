"""The OpenAI wire format: reading a request body into a checked `ParsedRequest`, and
the error object every refused request gets.

Fields follow OpenAI's API reference (`/v1/chat/completions`, `/v1/completions`); a
field of the wrong type or out of range, an unknown field, and a field this server does
not implement (`tools`, `response_format`, `logit_bias`, ...) set to anything but its "off"
value are refused with HTTP 400 and
`{"error": {"message", "type": "invalid_request_error", "param": FIELD, "code"}}`, an
unknown model with 404 (`code: "model_not_found"`), as OpenAI's server does.
"""

import dataclasses
import math
import numbers
from collections.abc import Mapping

from .._sampling import DEFAULT_TEMPERATURE

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_CHOICES = 128
MAX_TOP_LOGPROBS = 20  # chat `top_logprobs`; completions' `logprobs` allows 5

# the fields read (`episode_id`, `top_k`, `min_p`, `repetition_penalty` and
# `return_token_ids` as vLLM's extensions), and the ones that change nothing here
# (metadata, caching and routing hints)
_READ = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "n", "stop", "seed", "logprobs", "user",
    "episode_id", "stream", "stream_options", "return_token_ids",
}  # fmt: skip
_NO_EFFECT = {
    "metadata", "store", "service_tier", "parallel_tool_calls",
    "prompt_cache_key", "safety_identifier",
}  # fmt: skip
_FIELDS = {
    "chat": _READ | _NO_EFFECT | {"messages", "max_completion_tokens", "top_logprobs"},
    "completion": _READ | _NO_EFFECT | {"prompt", "echo"},
}
# fields this server does not implement, accepted only with the value that means "off"
_UNSUPPORTED = {
    "tools": lambda v: v == [],
    "tool_choice": lambda v: v == "none",
    "functions": lambda v: v == [],
    "function_call": lambda v: v == "none",
    "response_format": lambda v: v == {"type": "text"},
    "logit_bias": lambda v: v == {},
    "echo": lambda v: v is False,  # chat; completions read it
    "suffix": lambda v: v == "",
    "best_of": lambda v: v == 1,
    "modalities": lambda v: v == ["text"],
}


class RequestError(Exception):
    """A request the server refuses: the HTTP `status` and OpenAI's error fields.

    **Arguments:**

    - `message`: one line saying what is wrong (it names the field).
    - `param`: the request field at fault, or `None`.
    - `status`: the HTTP status (400 by default; 404 for an unknown model or path).
    - `kind`: OpenAI's error `type` (`"invalid_request_error"`).
    - `code`: OpenAI's error `code`, or `None`.
    """

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.kind = kind
        self.code = code

    def body(self) -> dict:
        """`{"error": {"message", "type", "param", "code"}}` as OpenAI sends it."""
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
    """One checked `/v1/chat/completions` or `/v1/completions` request.

    - `kind`: `"chat"` or `"completion"`.
    - `messages` (chat): the conversation, each message `{"role", "content", ...}` with
      its text parts joined into one string.
    - `prompts` (completions): one entry per prompt, a string or a list of token ids.
    - `max_tokens`: the completion budget (`None`: the server's default).
    - `temperature`, `top_p` (`None` when 1), `top_k` (`None`: off), `min_p` (vLLM's, in
      [0, 1]; `None` when 0), `n`, `stop` (strings), `seed` (or `None`).
    - `presence_penalty`, `frequency_penalty` (OpenAI's, in [-2, 2]; 0: off) and
      `repetition_penalty` (vLLM's, > 0; 1: off): `rlhf_eqx.penalize_logits`, over the
      row's prompt tokens and its completion so far (the repetition penalty) or its
      completion so far (the other two).
    - `logprobs`: whether to return log-probabilities; `top_logprobs`: how many
      alternatives per token (0: none).
    - `episode_id`: the episode the request belongs to (`episode_id`, else `user`), or
      `None`.
    - `stream`: answer as server-sent events; `include_usage`: end the stream with a
      chunk holding the usage (`stream_options`).
    - `echo` (completions): the text and log-probabilities begin with the prompt's
      (`max_tokens` may then be 0: the prompt scored, nothing sampled).
    """

    kind: str
    model: str
    messages: tuple[dict, ...] = ()
    prompts: tuple[str | tuple[int, ...], ...] = ()
    max_tokens: int | None = None
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    n: int = 1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    episode_id: str | None = None
    stream: bool = False
    include_usage: bool = False
    echo: bool = False


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _int(body: Mapping, name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise RequestError(f"{name} must be an integer, got {value!r}", param=name)
    if value < low or (high is not None and value > high):
        bound = f"at least {low}" if high is None else f"between {low} and {high}"
        raise RequestError(f"{name} must be {bound}, got {value}", param=name)
    return int(value)


def _number(body: Mapping, name: str, low: float, high: float, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value):
        raise RequestError(f"{name} must be a number, got {value!r}", param=name)
    if not low <= value <= high:
        raise RequestError(f"{name} must lie in [{low:g}, {high:g}], got {value}", param=name)
    return float(value)


def _stop(body: Mapping) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(
            f"stop must be a non-empty string or a list of them, got {stop!r}", param="stop"
        )
    if len(stop) > MAX_STOP_STRINGS:
        raise RequestError(
            f"stop: at most {MAX_STOP_STRINGS} strings, got {len(stop)}", param="stop"
        )
    return tuple(stop)


def _content(message: Mapping, i: int) -> str:
    """A message's content as one string (text parts joined; `None` as empty)."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, Mapping) and part.get("type") == "text"):
                raise RequestError(
                    f"messages[{i}].content: only text parts are supported, got {part!r}",
                    param=f"messages[{i}].content",
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise RequestError(
                    f"messages[{i}].content: a text part needs a string 'text'",
                    param=f"messages[{i}].content",
                )
            parts.append(text)
        return "".join(parts)
    raise RequestError(
        f"messages[{i}].content must be a string or a list of text parts, got "
        f"{type(content).__name__}",
        param=f"messages[{i}].content",
    )


def _messages(body: Mapping) -> tuple[dict, ...]:
    messages = body.get("messages")
    if messages is None:
        raise RequestError("messages is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of messages", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise RequestError(
                f"messages[{i}] must be an object, got {type(m).__name__}", param=f"messages[{i}]"
            )
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise RequestError(
                f"messages[{i}].role must be a non-empty string, got {role!r}",
                param=f"messages[{i}].role",
            )
        out.append({**m, "role": role, "content": _content(m, i)})
    return tuple(out)


def _prompts(body: Mapping, vocab_size: int) -> tuple[str | tuple[int, ...], ...]:
    """`prompt` as OpenAI allows it: a string, a list of strings, a list of token ids or
    a list of lists of token ids."""
    prompt = body.get("prompt")
    if prompt is None:
        raise RequestError("prompt is required", param="prompt")
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(x) for x in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = prompt
    else:
        raise RequestError(
            "prompt must be a string, a list of strings, a list of token ids or a list of "
            f"lists of token ids (non-empty), got {prompt!r}"[:300],
            param="prompt",
        )
    out: list[str | tuple[int, ...]] = []
    for p in prompts:
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, list) and p and all(_is_int(x) for x in p):
            if not all(0 <= x < vocab_size for x in p):
                raise RequestError(
                    f"prompt: token ids must lie in [0, {vocab_size}), got {p!r}"[:300],
                    param="prompt",
                )
            out.append(tuple(int(x) for x in p))
        else:
            raise RequestError(
                f"prompt: each entry must be a string or a non-empty list of token ids, got {p!r}"[
                    :300
                ],
                param="prompt",
            )
    return tuple(out)


def _stream_options(options: object, stream: bool) -> bool:
    """`stream_options.include_usage` (OpenAI allows `stream_options` with `stream`
    only)."""
    if options is None:
        return False
    if not stream:
        raise RequestError(
            "stream_options is only allowed when stream is true", param="stream_options"
        )
    if not isinstance(options, Mapping) or set(options) - {"include_usage"}:
        raise RequestError(
            f"stream_options must be an object with at most include_usage, got {options!r}"[:300],
            param="stream_options",
        )
    usage = options.get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise RequestError(
            f"stream_options.include_usage must be a boolean, got {usage!r}",
            param="stream_options.include_usage",
        )
    return bool(usage)


def _check_fields(body: Mapping, kind: str) -> None:
    """Refuse a field this server does not know, and one it does not implement set to
    anything but its "off" value: either would otherwise be ignored without a word."""
    for name, value in body.items():
        if value is None:
            continue
        if name in _UNSUPPORTED and name not in _FIELDS[kind]:
            if not _UNSUPPORTED[name](value):
                raise RequestError(
                    f"{name}={value!r} is not supported by this server"[:300], param=name
                )
        elif name not in _FIELDS[kind]:
            raise RequestError(f"unrecognized request argument supplied: {name}", param=name)


def parse_request(
    body: object, kind: str, *, model_names: tuple[str, ...], vocab_size: int
) -> ParsedRequest:
    """Check a decoded JSON body and read it into a `ParsedRequest`.

    **Arguments:**

    - `body`: the decoded JSON.
    - `kind`: `"chat"` (`/v1/chat/completions`) or `"completion"` (`/v1/completions`).
    - `model_names`: the names the server answers to.
    - `vocab_size`: the model's vocabulary (token-id prompts are checked against it).

    **Returns:** the `ParsedRequest`. Raises `RequestError` naming the field at fault.
    """
    if not isinstance(body, Mapping):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("model must be a non-empty string", param="model")
    if model not in model_names:
        raise RequestError(
            f"the model {model!r} does not exist; this server serves {list(model_names)}",
            param="model",
            status=404,
            code="model_not_found",
        )
    _check_fields(body, kind)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise RequestError(f"stream must be a boolean, got {stream!r}"[:300], param="stream")
    include_usage = _stream_options(body.get("stream_options"), bool(stream))
    echo = body.get("echo") if kind == "completion" else None
    if echo is not None and not isinstance(echo, bool):
        raise RequestError(f"echo must be a boolean, got {echo!r}"[:300], param="echo")
    if echo and stream:
        raise RequestError("echo with stream=true is not supported", param="echo")
    max_tokens = _int(body, "max_tokens", 0 if echo else 1)
    if kind == "chat":
        newer = _int(body, "max_completion_tokens", 1)
        max_tokens = newer if newer is not None else max_tokens
    tag = "episode_id" if body.get("episode_id") is not None else "user"
    episode_id = body.get(tag)
    if episode_id is not None and (
        isinstance(episode_id, bool) or not (isinstance(episode_id, str | int) and episode_id != "")
    ):
        raise RequestError(f"{tag} must be a non-empty string, got {episode_id!r}"[:300], param=tag)
    top_k = _int(body, "top_k", -1, vocab_size)
    top_p = _number(body, "top_p", 0.0, 1.0, 1.0)
    if top_p == 0.0:
        raise RequestError("top_p must be above 0, got 0", param="top_p")
    min_p = _number(body, "min_p", 0.0, 1.0, 0.0)
    repetition_penalty = _number(body, "repetition_penalty", 0.0, math.inf, 1.0)
    if not (0.0 < repetition_penalty < math.inf):
        raise RequestError(
            f"repetition_penalty must be a finite number above 0 (1: off), got "
            f"{repetition_penalty}",
            param="repetition_penalty",
        )
    common = dict(
        model=model,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 0.0, 2.0, DEFAULT_TEMPERATURE),
        top_p=None if top_p == 1.0 else top_p,
        top_k=top_k if top_k and top_k > 0 else None,  # -1 or 0: off, as in vLLM
        min_p=min_p or None,  # 0: off, as in vLLM
        presence_penalty=_number(body, "presence_penalty", -2.0, 2.0, 0.0),
        frequency_penalty=_number(body, "frequency_penalty", -2.0, 2.0, 0.0),
        repetition_penalty=repetition_penalty,
        n=_int(body, "n", 1, MAX_CHOICES) or 1,
        stop=_stop(body),
        seed=_int(body, "seed", -(2**63)),
        episode_id=None if episode_id is None else str(episode_id),
        stream=bool(stream),
        include_usage=include_usage,
    )
    if kind == "chat":
        logprobs = body.get("logprobs")
        if logprobs is not None and not isinstance(logprobs, bool):
            raise RequestError(f"logprobs must be a boolean, got {logprobs!r}", param="logprobs")
        top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
        if top and not logprobs:
            raise RequestError("top_logprobs needs logprobs=true", param="top_logprobs")
        return ParsedRequest(
            kind="chat",
            messages=_messages(body),
            logprobs=bool(logprobs),
            top_logprobs=top,
            **common,
        )
    top = _int(body, "logprobs", 0, 5)
    return ParsedRequest(
        kind="completion",
        echo=bool(echo),
        prompts=_prompts(body, vocab_size),
        logprobs=top is not None,
        top_logprobs=top or 0,
        **common,
    )
