"""Rendering multi-turn conversations into prompt text.

A conversation is a list of messages `{"role": ..., "content": ...}` with roles
`"system"`, `"user"` and `"assistant"` (ShareGPT's `"human"`/`"gpt"` and HH's
`"Human"`/`"Assistant"` are accepted as aliases). A `ChatTemplate` renders each message
with a format string and ends with a generation prompt when asked.

Built-in templates:

- `"hh"` (the default), Anthropic HH-RLHF transcripts:
  `"\\n\\nHuman: {content}"`, `"\\n\\nAssistant: {content}"`, generation prompt
  `"\\n\\nAssistant:"` (the completion then starts with a space, as in HH-RLHF); a
  system message is written first as plain text.
- `"chatml"`, OpenAI ChatML / Qwen style:
  `"<|im_start|>{role}\\n{content}<|im_end|>\\n"`, generation prompt
  `"<|im_start|>assistant\\n"`.
"""

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from ._errors import DataError
from ._io import Malformed, record_field


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """Format strings (with a `{content}` field) for each role, and the generation prompt.

    A template can split a rendered conversation into prompt and completion when every
    rendered assistant message starts with `generation_prompt`.
    """

    system: str
    user: str
    assistant: str
    generation_prompt: str


HH_TEMPLATE = ChatTemplate(
    system="{content}",
    user="\n\nHuman: {content}",
    assistant="\n\nAssistant: {content}",
    generation_prompt="\n\nAssistant:",
)

CHATML_TEMPLATE = ChatTemplate(
    system="<|im_start|>system\n{content}<|im_end|>\n",
    user="<|im_start|>user\n{content}<|im_end|>\n",
    assistant="<|im_start|>assistant\n{content}<|im_end|>\n",
    generation_prompt="<|im_start|>assistant\n",
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
}


def normalise_role(role: str) -> str:
    """`"system"`, `"user"` or `"assistant"` for a role name or one of its aliases."""
    try:
        return _ROLE_ALIASES[role.strip().lower()]
    except KeyError:
        raise DataError(f"unknown chat role {role!r}") from None


def message_field(value: object, key: str) -> dict[str, str]:
    """`{"role", "content"}` or ShareGPT `{"from", "value"}` -> `{"role", "content"}`."""
    if not isinstance(value, dict):
        raise Malformed(
            "wrong type", f"{key!r} must hold message objects, got {type(value).__name__}"
        )
    role = value.get("role", value.get("from"))
    content = value.get("content", value.get("value"))
    if not isinstance(role, str) or not isinstance(content, str):
        raise Malformed(
            "wrong type", f"a message in {key!r} needs string role/content (or from/value)"
        )
    if role.strip().lower() not in _ROLE_ALIASES:
        raise Malformed(
            "unknown chat role",
            f"a message in {key!r} has the role {role!r}; the readers take system, user "
            f"and assistant turns (and their aliases: {', '.join(sorted(_ROLE_ALIASES))})",
        )
    return {"role": normalise_role(role), "content": content}


def message_list(record: dict, key: str) -> list[dict[str, str]]:
    """`record[key]`, a list of messages, each as `message_field` reads it (`Malformed`
    naming the key when it is missing or not a list)."""
    value = record_field(record, key)
    if not isinstance(value, list):
        raise Malformed(
            "wrong type", f"{key!r} must be a list of messages, got {type(value).__name__}"
        )
    return [message_field(m, key) for m in value]


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

    - `messages`: `[{"role": "user", "content": "Hi"}, ...]`.
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
        if not isinstance(role, str) or not isinstance(content, str):
            raise DataError(
                f"message role and content must be strings, got {type(role).__name__} "
                f"and {type(content).__name__}"
            )
        role = normalise_role(role)
        fmt = {"system": tmpl.system, "user": tmpl.user, "assistant": tmpl.assistant}[role]
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
