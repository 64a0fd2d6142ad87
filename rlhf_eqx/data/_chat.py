"""Rendering multi-turn conversations into prompt text.

A conversation is a list of messages `{"role": ..., "content": ...}` with roles
`"system"`, `"user"`, `"assistant"` and `"tool"` (ShareGPT's `"human"`/`"gpt"`, HH's
`"Human"`/`"Assistant"`, and the tool results' `"function"` / `"ipython"` are accepted as
aliases). A `ChatTemplate` renders each message with a format string and ends with a
generation prompt when asked.

**Tool calls.** An assistant message may carry OpenAI's `tool_calls`,
`[{"type": "function", "function": {"name": ..., "arguments": ...}}, ...]` (`arguments`
an object or a string holding a JSON object), with an empty or null content (read as
`""`). A Jinja chat template receives the message with its `tool_calls` as given; a
`ChatTemplate` writes the calls in the assistant's turn after its content (a newline
between), one line per call: `{"name": ..., "arguments": {...}}` (JSON). A tool's result
is a `tool` message, rendered with the template's `tool` format.

Built-in templates:

- `"hh"` (the default), Anthropic HH-RLHF transcripts:
  `"\\n\\nHuman: {content}"`, `"\\n\\nAssistant: {content}"`, generation prompt
  `"\\n\\nAssistant:"` (the completion then starts with a space, as in HH-RLHF); a
  system message is written first as plain text; a tool result as
  `"\\n\\nTool: {content}"`.
- `"chatml"`, OpenAI ChatML / Qwen style:
  `"<|im_start|>{role}\\n{content}<|im_end|>\\n"` (a tool result's role is `tool`),
  generation prompt `"<|im_start|>assistant\\n"`.
"""

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence

from ._errors import DataError
from ._io import Malformed, record_field


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """Format strings (with a `{content}` field) for each role, and the generation prompt.

    A template can split a rendered conversation into prompt and completion when every
    rendered assistant message starts with `generation_prompt`. `tool` renders a tool's
    result (default: as a user message, `None`).
    """

    system: str
    user: str
    assistant: str
    generation_prompt: str
    tool: str | None = None


HH_TEMPLATE = ChatTemplate(
    system="{content}",
    user="\n\nHuman: {content}",
    assistant="\n\nAssistant: {content}",
    generation_prompt="\n\nAssistant:",
    tool="\n\nTool: {content}",
)

CHATML_TEMPLATE = ChatTemplate(
    system="<|im_start|>system\n{content}<|im_end|>\n",
    user="<|im_start|>user\n{content}<|im_end|>\n",
    assistant="<|im_start|>assistant\n{content}<|im_end|>\n",
    generation_prompt="<|im_start|>assistant\n",
    tool="<|im_start|>tool\n{content}<|im_end|>\n",
)

_TEMPLATES = {"hh": HH_TEMPLATE, "chatml": CHATML_TEMPLATE}

_ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "prompter": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "bot": "assistant",
    "model": "assistant",
    "tool": "tool",
    "function": "tool",
    "ipython": "tool",
}


def normalise_role(role: str) -> str:
    """`"system"`, `"user"`, `"assistant"` or `"tool"` for a role name or one of its
    aliases."""
    try:
        return _ROLE_ALIASES[role.strip().lower()]
    except KeyError:
        raise DataError(f"unknown chat role {role!r}") from None


def tool_calls_text(calls: object) -> str:
    """The plain form of an assistant message's OpenAI `tool_calls` (see the module
    docstring): one JSON line `{"name": ..., "arguments": {...}}` per call. `Malformed`
    (`"malformed tool call"`) says what is wrong with a call."""
    if not isinstance(calls, list):
        raise Malformed(
            "malformed tool call", f"'tool_calls' must be a list, got {type(calls).__name__}"
        )
    lines = []
    for k, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        # a null type is an absent one (a table's column for the rows that lack it)
        if not isinstance(fn, dict) or (call.get("type") or "function") != "function":
            raise Malformed(
                "malformed tool call",
                f'tool call {k} must be {{"type": "function", "function": {{"name", '
                f'"arguments"}}}}, got {call!r}',
            )
        name, arguments = fn.get("name"), fn.get("arguments")
        if not isinstance(name, str) or not name:
            raise Malformed("malformed tool call", f"tool call {k} needs a string function name")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(arguments, dict):
            raise Malformed(
                "malformed tool call",
                f"tool call {k} ({name}): 'arguments' must be an object or a string holding "
                f"a JSON object, got {fn.get('arguments')!r}",
            )
        lines.append(json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False))
    return "\n".join(lines)


def message_field(value: object, key: str) -> dict:
    """`{"role", "content"}` or ShareGPT `{"from", "value"}` -> `{"role", "content"}`
    (the role normalised), with an assistant message's `tool_calls` (checked:
    `tool_calls_text`; its null content read as `""`) and a message's `name` and
    `tool_call_id` kept as given."""
    if not isinstance(value, dict):
        raise Malformed(
            "wrong type", f"{key!r} must hold message objects, got {type(value).__name__}"
        )
    role = value.get("role", value.get("from"))
    content = value.get("content", value.get("value"))
    calls = value.get("tool_calls")
    if calls is not None and content is None:
        content = ""
    if not isinstance(role, str) or not isinstance(content, str):
        got = ", ".join(
            f"{name} {'missing' if v is None else type(v).__name__}"
            for name, v in (("role", role), ("content", content))
            if not isinstance(v, str)
        )
        raise Malformed(
            "wrong type",
            f"a message in {key!r} needs string role/content (or from/value), got {got}",
        )
    if role.strip().lower() not in _ROLE_ALIASES:
        raise Malformed(
            "unknown chat role",
            f"a message in {key!r} has the role {role!r}; the readers take system, user, "
            f"assistant and tool turns (and their aliases: {', '.join(sorted(_ROLE_ALIASES))})",
        )
    message = {"role": normalise_role(role), "content": content}
    if calls is not None:
        if message["role"] != "assistant":
            raise Malformed(
                "malformed tool call", f"a {message['role']} message in {key!r} has tool_calls"
            )
        tool_calls_text(calls)
        message["tool_calls"] = calls
    for extra in ("name", "tool_call_id"):
        if isinstance(value.get(extra), str):
            message[extra] = value[extra]
    return message


def said(message: Mapping[str, object]) -> bool:
    """Whether a message (as `message_field` reads it) says anything: text that is not
    blank, or tool calls (an assistant message whose only output is a call)."""
    return bool(str(message["content"]).strip() or message.get("tool_calls"))


def message_list(record: dict, key: str) -> list[dict]:
    """`record[key]`, a list of messages, each as `message_field` reads it (`Malformed`
    naming the key when it is missing or not a list, and the message's index when one is
    malformed)."""
    value = record_field(record, key)
    if not isinstance(value, list):
        raise Malformed(
            "wrong type", f"{key!r} must be a list of messages, got {type(value).__name__}"
        )
    out = []
    for i, m in enumerate(value):
        try:
            out.append(message_field(m, key))
        except Malformed as e:
            raise Malformed(e.args[0], f"{e.args[1]} (message {i})") from None
    return out


class ColumnKind:
    """Whether a file's `key` column holds messages, told by its first record and the
    same for every record: `kind(record)` is `True` when `record[key]` is a list (of
    messages), `False` when it is a string, and `Malformed` naming the key when it is
    the other of the two than the first record's (a file mixing text and conversational
    rows, which the preference, unpaired and stepwise readers refuse by their layout).
    Another value passes as `False` (the record's parser then says what is wrong)."""

    def __init__(self, key: str):
        self.key = key
        self.first: bool | None = None

    def __call__(self, record: dict) -> bool:
        value = record.get(self.key)
        if not isinstance(value, (list, str)):
            return False
        listed = isinstance(value, list)
        if self.first is None:
            self.first = listed
        elif listed != self.first:
            want = "a list of messages" if self.first else "a string"
            raise Malformed(
                "wrong type",
                f"{self.key!r} must be {want}, as the first record's is (text and "
                f"conversational rows do not mix), got {type(value).__name__}",
            )
        return listed


def resolve_template(template: str | ChatTemplate) -> ChatTemplate:
    """A `ChatTemplate` as given, or the built-in one of that name."""
    if isinstance(template, ChatTemplate):
        return template
    try:
        return _TEMPLATES[template]
    except KeyError:
        raise DataError(
            f"unknown chat template {template!r}; use one of {sorted(_TEMPLATES)}"
        ) from None


def format_chat(
    messages: Sequence[Mapping[str, object]],
    template: str | ChatTemplate = "hh",
    *,
    add_generation_prompt: bool = True,
) -> str:
    """Render a conversation as text.

    **Arguments:**

    - `messages`: `[{"role": "user", "content": "Hi"}, ...]` (an assistant message's
      `tool_calls` are written after its content, see the module docstring).
    - `template`: `"hh"` (default), `"chatml"` or a `ChatTemplate`.
    - `add_generation_prompt`: append the template's generation prompt (the start of an
      assistant turn) so that a model continues with the assistant's reply.

    **Returns:** the concatenation of each message's rendering (plus the generation
    prompt). For example `format_chat([{"role": "user", "content": "Hi"}])` is
    `"\\n\\nHuman: Hi\\n\\nAssistant:"`.
    """
    tmpl = resolve_template(template)
    parts = []
    for message in messages:
        if "role" not in message or "content" not in message:
            raise DataError(
                f"a chat message needs 'role' and 'content', got keys {sorted(message)}"
            )
        role, content = message["role"], message["content"]
        calls = message.get("tool_calls")
        if calls is not None and content is None:
            content = ""
        if not isinstance(role, str) or not isinstance(content, str):
            raise DataError(
                f"message role and content must be strings, got {type(role).__name__} "
                f"and {type(content).__name__}"
            )
        role = normalise_role(role)
        if calls is not None:
            try:
                lines = tool_calls_text(calls)
            except Malformed as e:
                raise DataError(f"{e.args[0]}: {e.args[1]}") from None
            content = f"{content}\n{lines}" if content and lines else content or lines
        fmt = {
            "system": tmpl.system,
            "user": tmpl.user,
            "assistant": tmpl.assistant,
            "tool": tmpl.user if tmpl.tool is None else tmpl.tool,
        }[role]
        parts.append(fmt.format(content=content, role=role))
    if add_generation_prompt:
        parts.append(tmpl.generation_prompt)
    return "".join(parts)


def split_conversation(
    prompt: Sequence[Mapping[str, str]],
    reply: Sequence[Mapping[str, str]],
    render: Callable[..., str],
) -> tuple[str, str]:
    """`(prompt text, completion text)` of a conversation: the `prompt` messages rendered
    with the generation prompt, and the rest of the whole conversation `prompt + reply`
    rendered, so that the two texts concatenated are the rendered conversation.
    `render(messages, add_generation_prompt=...)` renders (`format_chat` with a template);
    `DataError` when the conversation's text does not start with the prompt's (the
    template's assistant turn does not start with its generation prompt)."""
    prompt_text = render(list(prompt), add_generation_prompt=True)
    full = render(list(prompt) + list(reply), add_generation_prompt=False)
    if not full.startswith(prompt_text):
        raise DataError(
            "the chat template's assistant turn does not start with its generation "
            "prompt, so conversations cannot be split into prompt and completion"
        )
    return prompt_text, full[len(prompt_text) :]
