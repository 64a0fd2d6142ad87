"""Rendering multi-turn conversations into prompt text.

A conversation is a list of messages `{"role": ..., "content": ...}` with roles
`"system"`, `"user"`, `"assistant"` and `"tool"` (ShareGPT's `"human"`/`"gpt"`, HH's
`"Human"`/`"Assistant"`, OpenAI's `"developer"` for `"system"`, and the tool results'
`"function"` / `"ipython"` are accepted as aliases). A content may be a list of parts,
`[{"type": "text", "text": ...}, ...]` (the Hugging Face chat format's and OpenAI's),
read as its texts joined; a part of another type (an image, audio) is refused. A
`ChatTemplate` renders each message with a format string and ends with a generation
prompt when asked.

**Continuing a prompt.** A prompt whose last message is the assistant's (a prefill such
as `"The answer is"` or `"<think>"`) is continued, as `transformers`'
`apply_chat_template(..., continue_final_message=True)` renders it (and TRL does for such
prompts): without that message's end of turn and without a new generation prompt
(`render_prompt`). Its reply's first assistant message continues that message: the two
are one message, the prefill's text followed by the reply's (`join_reply`), so that the
prompt text and the completion text concatenated are that conversation's rendering. A
prompt that ends with a system message is refused (`prompt_messages`).

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
    "developer": "system",
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


def content_text(content: object, key: str) -> object:
    """A message's content as text: a list of parts `[{"type": "text", "text": ...}, ...]`
    gives its texts joined (as a chat template writes them, one after the other); any
    other value is returned as it is. `Malformed` names a part that is not text (its
    type, e.g. `"image"`) or a text part without a string `text`."""
    if not isinstance(content, list):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind is None and isinstance(part, dict) and "text" in part:
            kind = "text"  # a part written without its type
        if kind != "text":
            got = repr(kind) if kind is not None else type(part).__name__
            raise Malformed(
                "unsupported content",
                f"a message in {key!r} has a content part of type {got} (part {j}); the "
                "readers take text parts only",
            )
        if not isinstance(part.get("text"), str):
            raise Malformed(
                "wrong type",
                f"a message in {key!r} has a text part without a string 'text' (part {j})",
            )
        texts.append(part["text"])
    return "".join(texts)


def message_field(value: object, key: str) -> dict:
    """`{"role", "content"}` or ShareGPT `{"from", "value"}` -> `{"role", "content"}`
    (the role normalised, a content of parts as its text: `content_text`), with an
    assistant message's `tool_calls` (checked: `tool_calls_text`; its null content read
    as `""`) and a message's `name` and `tool_call_id` kept as given."""
    if not isinstance(value, dict):
        raise Malformed(
            "wrong type", f"{key!r} must hold message objects, got {type(value).__name__}"
        )
    role = value.get("role", value.get("from"))
    content = content_text(value.get("content", value.get("value")), key)
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
    continue_final_message: bool = False,
) -> str:
    """Render a conversation as text.

    **Arguments:**

    - `messages`: `[{"role": "user", "content": "Hi"}, ...]` (an assistant message's
      `tool_calls` are written after its content, see the module docstring; a content
      of text parts is their text, `content_text`).
    - `template`: `"hh"` (default), `"chatml"` or a `ChatTemplate`.
    - `add_generation_prompt`: append the template's generation prompt (the start of an
      assistant turn) so that a model continues with the assistant's reply.
    - `continue_final_message`: end at the last message's text, without what its format
      writes after the text (the end of its turn), so that a model continues that
      message (a prefill); not with `add_generation_prompt`.

    **Returns:** the concatenation of each message's rendering (plus the generation
    prompt). For example `format_chat([{"role": "user", "content": "Hi"}])` is
    `"\\n\\nHuman: Hi\\n\\nAssistant:"`.
    """
    if add_generation_prompt and continue_final_message:
        raise DataError(
            "add_generation_prompt and continue_final_message do not go together: the one "
            "starts a new assistant turn, the other continues the last message"
        )
    tmpl = resolve_template(template)
    parts = []
    for message in messages:
        if "role" not in message or "content" not in message:
            raise DataError(
                f"a chat message needs 'role' and 'content', got keys {sorted(message)}"
            )
        role, content = message["role"], message["content"]
        if isinstance(content, list):  # parts: their text
            try:
                content = content_text(content, "messages")
            except Malformed as e:
                raise DataError(f"{e.args[0]}: {e.args[1]}") from None
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
    if continue_final_message and parts:
        marker = "\x00content\x00"
        head = fmt.format(content=marker, role=role).split(marker)[0]
        parts[-1] = head + content
    if add_generation_prompt:
        parts.append(tmpl.generation_prompt)
    return "".join(parts)


def continues(messages: Sequence[Mapping[str, object]]) -> bool:
    """Whether a prompt's messages end with the assistant's (a prefill the reply
    continues: see the module docstring)."""
    return bool(messages) and messages[-1].get("role") == "assistant"


def prompt_messages(messages: list[dict], key: str = "prompt") -> list[dict]:
    """A prompt's messages (as `message_field` reads them), checked for their end:
    `Malformed` naming `key` when the last is a system message (TRL refuses such a
    prompt: nothing asks for a reply), or an assistant message that cannot be continued
    (no text, or tool calls, which a template writes after the text)."""
    if not messages:
        return messages
    last = messages[-1]
    if last["role"] == "system":
        raise Malformed(
            "wrong role",
            f"{key!r} ends with a system message; a prompt ends with a user or tool turn, or "
            "with an assistant turn that the reply continues",
        )
    if last["role"] == "assistant" and (last.get("tool_calls") or not last["content"].strip()):
        what = "tool calls" if last.get("tool_calls") else "no text"
        raise Malformed(
            "wrong role",
            f"{key!r} ends with an assistant message with {what}, which cannot be continued "
            "(a prompt's last assistant message is a prefix of the reply)",
        )
    return messages


def join_reply(
    prompt: Sequence[Mapping[str, object]], reply: Sequence[Mapping[str, object]]
) -> list[dict]:
    """The conversation of a prompt and its reply: `prompt + reply`, or, when the prompt
    ends with an assistant message (a prefill) and the reply starts with one, the two
    as one message, the prefill's content followed by the reply's (the reply's tool calls
    kept), which continues the prompt."""
    prompt, reply = [dict(m) for m in prompt], [dict(m) for m in reply]
    if continues(prompt) and reply and reply[0].get("role") == "assistant":
        joined = {**reply[0], "content": str(prompt[-1]["content"]) + str(reply[0]["content"])}
        return prompt[:-1] + [joined] + reply[1:]
    return prompt + reply


def render_prompt(messages: Sequence[Mapping[str, object]], render: Callable[..., str]) -> str:
    """A prompt's messages rendered for its reply with `render(messages, ...)`
    (`format_chat` with a template, or `JinjaChatTemplate.render`): with the generation
    prompt, or continuing the last message when it is the assistant's
    (`continue_final_message=True`)."""
    if continues(messages):
        return render(list(messages), add_generation_prompt=False, continue_final_message=True)
    return render(list(messages), add_generation_prompt=True)


def cut_after_final_content(text: str, messages: Sequence[Mapping[str, object]]) -> str:
    """`text`, a conversation rendered without the generation prompt, cut just after its
    last message's text, as `transformers`' `apply_chat_template(...,
    continue_final_message=True)` cuts it: at the last occurrence of that text (its
    surrounding whitespace stripped; kept up to its own end where the template keeps
    it). `DataError` naming the message when its text is not in `text` (the template
    rewrites it) or it has none."""
    last = messages[-1]
    content = last.get("content")
    if isinstance(content, list):  # parts: the last text one, as transformers takes it
        texts = [p.get("text") for p in content if isinstance(p, dict) and "text" in p]
        content = texts[-1] if texts else None
    where = f"message {len(messages) - 1} ({last.get('role')})"
    if not isinstance(content, str) or not content.strip():
        raise DataError(f"{where}: no text to continue")
    at = text.rfind(content.strip())
    if at < 0:
        raise DataError(
            f"{where}: its content is not in the chat template's rendering (the template "
            "rewrites it), so the prompt cannot be continued from it"
        )
    if text[at : at + len(content.lstrip())] == content:
        return text[: at + len(content.lstrip())]
    return text[: at + len(content.strip())]


def split_conversation(
    prompt: Sequence[Mapping[str, str]],
    reply: Sequence[Mapping[str, str]],
    render: Callable[..., str],
    *,
    continued: bool = True,
) -> tuple[str, str]:
    """`(prompt text, completion text)` of a conversation: the `prompt` messages rendered
    for the reply (`render_prompt`: with the generation prompt, or continuing a final
    assistant message), and the rest of the whole conversation (`join_reply(prompt,
    reply)`) rendered, so that the two texts concatenated are the rendered conversation.
    `continued=False`: a final assistant message of `prompt` is a turn of its own (a
    conversation's earlier turn), rendered with the generation prompt after it.
    `render(messages, add_generation_prompt=..., continue_final_message=...)` renders
    (`format_chat` with a template); `DataError` when the conversation's text does not
    start with the prompt's (the template's assistant turn does not start with its
    generation prompt)."""
    if continued:
        prompt_text = render_prompt(prompt, render)
        full = render(join_reply(prompt, reply), add_generation_prompt=False)
    else:
        prompt_text = render(list(prompt), add_generation_prompt=True)
        full = render(list(prompt) + list(reply), add_generation_prompt=False)
    if not full.startswith(prompt_text):
        raise DataError(
            "the chat template's assistant turn does not start with its generation "
            "prompt, so conversations cannot be split into prompt and completion"
            if not (continued and continues(prompt))
            else "the chat template's rendering of the continued assistant message does "
            "not start with the prompt's, so the conversation cannot be split into "
            "prompt and completion"
        )
    return prompt_text, full[len(prompt_text) :]
