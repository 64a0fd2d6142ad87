"""Hugging Face chat templates (jinja2), with masks of the assistant's text.

A model's `tokenizer_config.json` carries its chat template, a jinja2 program that
renders a list of messages. `JinjaChatTemplate` renders it as `transformers` does
(sandboxed environment, `trim_blocks` / `lstrip_blocks`, `raise_exception`,
`strftime_now`, a `tojson` that keeps non-ASCII text) and can say which characters —
then, with a tokenizer, which tokens — the assistant wrote:

- templates with `{% generation %}...{% endgeneration %}` blocks (what `transformers`
  reads for `return_assistant_tokens_mask`) mark exactly the text rendered inside them;
- templates without them fall back to finding each assistant message's content in the
  rendered text (messages are searched in order, each after the previous one), plus
  the end-of-turn token (`eos_token`) when it follows the content immediately.

jinja2 is an optional dependency: `pip install 'rlhf_eqx[chat]'`.
"""

import dataclasses
import datetime
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from jaxtyping import Bool

from ._chat import cut_after_final_content
from ._chat_spans import (
    _GENERATION_TAG,
    _MARKERS,
    _generation_extension,
    _spans_from_contents,
    _spans_from_markers,
    token_offsets,
)
from ._errors import DataError
from ._tokenizer import Tokenizer


def _jinja2():
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError:
        raise ImportError(
            "Hugging Face chat templates need jinja2: pip install 'rlhf_eqx[chat]' "
            "(or 'jinja2>=3.1')"
        ) from None
    return jinja2


def _raise_exception(message: str):
    raise DataError(f"chat template: {message}")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@dataclasses.dataclass(frozen=True)
class RenderedChat:
    """A rendered conversation and what the assistant wrote in it.

    - `text`: the rendered text.
    - `spans`: `(start, end)` character ranges of assistant text, in order.
    - `char_mask`: `bool[len(text)]`, true on those characters.
    - `ids`, `token_mask` (with a tokenizer): the text's ids (`tokenizer.encode`) and
      `bool[len(ids)]`, true for a token that holds any assistant character.
    """

    text: str
    spans: tuple[tuple[int, int], ...]
    char_mask: Bool[np.ndarray, " chars"]
    ids: list[int] | None = None
    token_mask: Bool[np.ndarray, " tokens"] | None = None


class JinjaChatTemplate:
    """A Hugging Face chat template (a jinja2 string), rendered in a sandbox.

    **Arguments:**

    - `template`: the jinja2 source (`tokenizer_config.json`'s `chat_template`).
    - `bos_token`, `eos_token`: the special tokens' text, available to the template (as
      in `transformers`); `eos_token` also ends an assistant turn in the fallback mask.
    - `**context`: other variables every rendering sees (e.g. `pad_token`).

    `has_generation_blocks` says whether the template marks assistant text with
    `{% generation %}`.
    """

    def __init__(self, template: str, *, bos_token: str = "", eos_token: str = "", **context: Any):
        if not isinstance(template, str) or not template:
            raise DataError("a chat template must be a non-empty string")
        jinja2 = _jinja2()
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_generation_extension(jinja2), jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(template)
        except jinja2.TemplateSyntaxError as e:
            raise DataError(f"chat template syntax error at line {e.lineno}: {e.message}") from None
        self.source = template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.context = dict(context)
        self.has_generation_blocks = bool(_GENERATION_TAG.search(template))

    def _render_raw(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        tools: Sequence[Any] | None,
        kwargs: dict[str, Any],
    ) -> str:
        jinja2 = _jinja2()
        if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
            raise DataError(
                f"messages must be a list of message dicts, got {type(messages).__name__}"
            )
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or "role" not in m:
                raise DataError(f"message {i} must be a dict with a 'role', got {m!r}")
        variables = dict(bos_token=self.bos_token, eos_token=self.eos_token, **self.context)
        variables.update(kwargs)
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as e:
            raise DataError(f"chat template error: {e}") from None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tools: Sequence[Any] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation (as `tokenizer.apply_chat_template(..., tokenize=False)`).

        **Arguments:**

        - `messages`: `[{"role": ..., "content": ...}, ...]` (any fields the template reads).
        - `add_generation_prompt`: end with the start of an assistant turn.
        - `continue_final_message`: end just after the last message's text, so that a
          model continues it (a prefill), as `transformers` does: the conversation is
          rendered without the generation prompt and cut at the last occurrence of that
          text (`DataError` naming the message when the template rewrites it so that
          it cannot be found); not with `add_generation_prompt`.
        - `tools`: tool schemas for templates that render them.
        - `**kwargs`: other template variables.
        """
        if add_generation_prompt and continue_final_message:
            raise DataError(
                "add_generation_prompt and continue_final_message do not go together: the "
                "one starts a new assistant turn, the other continues the last message"
            )
        raw = self._render_raw(messages, add_generation_prompt, tools, kwargs)
        text = _MARKERS.sub("", raw)
        if continue_final_message and messages:
            text = cut_after_final_content(text, messages)
        return text

    def render_with_assistant_mask(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        tokenizer: Tokenizer | None = None,
        tools: Sequence[Any] | None = None,
        include_eos: bool = True,
        **kwargs: Any,
    ) -> RenderedChat:
        """Render a conversation and mark the assistant's text.

        With `{% generation %}` blocks the marked text is exactly what they render;
        without, each assistant message's string content is located in the text, in
        message order (every message's content is searched after the previous one's, so a
        user message that quotes the assistant is not mistaken for it), extended over an
        immediately following `eos_token` when `include_eos`. A content that cannot be
        found (the template rewrote it) raises a `DataError` naming the message.

        **Arguments:** as `render`, plus `tokenizer` (any `Tokenizer`) for the per-token
        mask, and `include_eos`.

        **Returns:** a `RenderedChat`. Per token, a token is marked when any of its
        characters is; token offsets come from the tokenizer when it has them (an
        `HFTokenizer`), else from decoding growing prefixes of the ids, which needs a
        tokenizer that decodes the text back exactly (`DataError` otherwise).
        """
        raw = self._render_raw(messages, add_generation_prompt, tools, kwargs)
        if self.has_generation_blocks:
            text, spans = _spans_from_markers(raw)
        else:
            text = raw
            spans = _spans_from_contents(text, messages, self.eos_token, include_eos=include_eos)
        char_mask = np.zeros(len(text), bool)
        for start, end in spans:
            char_mask[start:end] = True
        if tokenizer is None:
            return RenderedChat(text=text, spans=tuple(spans), char_mask=char_mask)
        ids, offsets = token_offsets(tokenizer, text)
        token_mask = np.asarray(
            [
                bool(char_mask[s:e].any()) if e > s else bool(s < len(text) and char_mask[s])
                for s, e in offsets
            ],
            bool,
        )
        return RenderedChat(
            text=text, spans=tuple(spans), char_mask=char_mask, ids=ids, token_mask=token_mask
        )


def load_chat_template(path: str | os.PathLike, *, name: str = "default") -> JinjaChatTemplate:
    """Read a Hugging Face chat template.

    **Arguments:**

    - `path`: a `tokenizer_config.json`, a `.jinja` file, or a model directory (its
      `chat_template.jinja` if present, else its `tokenizer_config.json`).
    - `name`: which template, when the config holds a list of named ones (`"default"`,
      `"tool_use"`, ...).

    **Returns:** a `JinjaChatTemplate` with the config's `bos_token` / `eos_token` (and
    `pad_token`, `unk_token` when given). A missing file or template, or a template
    with a syntax error, is a `DataError` naming the file (and the template's line).
    """
    path = os.fspath(path)
    config_path = path
    template = None
    source = path  # the file the template text comes from
    if os.path.isdir(path):
        jinja_file = os.path.join(path, "chat_template.jinja")
        config_path = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
            source = jinja_file
    elif path.endswith(".jinja"):
        if not os.path.isfile(path):
            raise DataError(f"{path}: no such file")
        with open(path, encoding="utf-8") as f:
            template = f.read()
        config_path = os.path.join(os.path.dirname(path), "tokenizer_config.json")
    config: dict = {}
    if os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as f:
            try:
                config = json.load(f)
            except json.JSONDecodeError as e:
                raise DataError(f"{config_path}:{e.lineno}: not valid JSON ({e.msg})") from None
    elif template is None:
        raise DataError(f"{path}: no tokenizer_config.json or chat_template.jinja there")
    if template is None:
        template = config.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            if name not in named:
                raise DataError(f"{config_path}: no chat template named {name!r} ({sorted(named)})")
            template = named[name]
        if not isinstance(template, str) or not template:
            raise DataError(f"{config_path}: has no chat_template")
        source = f"{config_path} (chat_template)"

    def special(key: str) -> str:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        return value if isinstance(value, str) else ""

    extra = {k: special(k) for k in ("pad_token", "unk_token") if special(k)}
    try:
        return JinjaChatTemplate(
            template, bos_token=special("bos_token"), eos_token=special("eos_token"), **extra
        )
    except DataError as e:  # a syntax error: name the file it is in
        raise DataError(f"{source}: {e}") from None
