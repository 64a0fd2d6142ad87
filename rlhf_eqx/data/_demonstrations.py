"""Demonstrations for supervised fine-tuning: records of `(prompt, completion)` text, the
loss on the completion.

`load_demonstrations` reads TRL's SFT layouts, and preference pairs (auto-detected from
the keys of the first record):

- `"text"` — `{"text": str}`, language modelling: the prompt is `""`, the completion
  the text (every token is trained on).
- `"prompt_completion"` — `{"prompt": str, "completion": str}`, used as given; or TRL's
  conversational `{"prompt": [messages], "completion": [messages]}`: the prompt
  messages rendered with the generation prompt, the completion the rest of the
  rendered conversation. A file's completions are all strings or all message lists,
  as its first record's (`Malformed` naming `completion` for a record of the other
  kind). A prompt ending with an assistant message (a prefill) is continued by the
  completion's first message (`join_reply`: the prefill is prompt, the rest trained);
  one ending with a system message is refused.
- `"messages"` — `{"messages": [{"role", "content"}, ...]}` (or ShareGPT's
  `{"conversations": [{"from", "value"}, ...]}` without `"chosen"`): the prompt is every
  message before the last assistant message, rendered with the generation prompt; the
  completion is that assistant message, the rest of the rendered conversation.
- `"preference"` — any layout `load_preferences` reads (detected as it detects them):
  the pair's prompt and its chosen response.

Message lists are rendered with a chat template (`format_chat`, HH style by default, or
a model's `JinjaChatTemplate`) so that `prompt + completion` is the rendered
conversation (up to and including the trained assistant message), as the preference
and unpaired readers split theirs. Messages after the last assistant message are not
read. Which assistant messages are trained is `assistant_turns`:

- `"last"` (the default here): the last assistant message only; earlier assistant turns
  are part of the prompt.
- `"all"` (TRL's `assistant_only_loss=True`): every assistant message. The prompt is
  the conversation before the first one (with the generation prompt), the completion
  the rest of the rendered conversation, and `record.spans` the character ranges of
  the completion that are trained: each assistant message's text with the
  end-of-turn text the template writes after it (what the prompt of that turn,
  rendered with the generation prompt, leaves of the conversation rendered up to and
  including it); the system, user and tool turns between are not trained, nor is a
  blank assistant message (no text, no tool calls; `"last"` skips a conversation
  ending with one). A Jinja
  template with `{% generation %}` blocks marks the trained text itself; one whose
  rendering of a prefix does not start its rendering of the whole conversation (it
  rewrites earlier turns) falls back to finding each assistant content
  (`JinjaChatTemplate.render_with_assistant_mask`). A conversation with one assistant
  message gives the record `"last"` gives (`spans` `None`: all of the completion).

Tool results (`tool` messages) are never trained; an assistant message with
`tool_calls` is, its calls rendered as the template renders them (`format_chat`: one
JSON line per call). A Jinja template that does not write them (the message renders
the same without its calls) is refused: the calls would be lost.

A `prompt_completion` record with a `label` column is unpaired (KTO) data and is not
detected as demonstrations (give `format="prompt_completion"` to read it anyway).

Records with an empty (or blank) completion (a completion `[]` too), and conversations
without an assistant message, are skipped and counted in `dataset.report`; preference
pairs are skipped as `load_preferences` skips them.

A `"text"` record has no prompt, so its first token has nothing before it to be
predicted from unless the tokenizer adds BOS: `tokenize_demonstrations` then makes that
token the prompt. Such a record is language modelling, not a turn of a chat: it is not
meant to be rendered through a chat template.
"""

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ._chat import (
    ChatTemplate,
    ColumnKind,
    continues,
    format_chat,
    join_reply,
    message_list,
    render_prompt,
    resolve_template,
    said as _said,
    split_conversation,
)
from ._errors import DataError
from ._io import (
    Malformed,
    RecordDataset,
    Unusable,
    load_records,
    string_field,
)
from ._jinja_chat import JinjaChatTemplate
from ._preferences import _preference_parser, detect_preference_format
from ._tokenize import tokenize_sft
from ._tokenized import TokenizedSequence, TokenizeReport
from ._tokenizer import Tokenizer
from ._unpaired import _conversation_texts, _message_list

DEMONSTRATION_FORMATS = ("text", "prompt_completion", "messages", "preference")
"""The record layouts `load_demonstrations(path, format=...)` reads (besides `"auto"`,
which detects one of them)."""

ASSISTANT_TURNS = ("all", "last")
"""The values of `load_demonstrations(..., assistant_turns=...)`: which assistant
messages of a conversation are trained."""

Spans = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class DemonstrationRecord:
    """One demonstration: `prompt + completion` is trained on, the loss on `completion`
    (`prompt` is `""` for language-modelling text).

    `spans`: the `(start, end)` character ranges of `completion` the loss is on, in
    order (`None`, the default: all of it), as a conversation trained on every assistant
    turn has them (`assistant_turns="all"`).
    """

    prompt: str
    completion: str
    spans: Spans | None = None

    def last_turn(self) -> "DemonstrationRecord":
        """The record of the last trained span alone: the text before it is the prompt
        (for a conversation: up to its last assistant message, with the generation
        prompt), the rest the completion. The record itself when it has no `spans`."""
        if self.spans is None:
            return self
        start = self.spans[-1][0]
        return DemonstrationRecord(self.prompt + self.completion[:start], self.completion[start:])


class DemonstrationDataset(RecordDataset["DemonstrationRecord"]):
    """An immutable sequence of `DemonstrationRecord`s with the `LoadReport` of its file
    (`report.format`: the layout read, e.g. `"text"`)."""

    noun = "demonstrations"


def _checked(prompt: str, completion: str) -> DemonstrationRecord:
    if not completion.strip():
        raise Unusable("empty completion")
    return DemonstrationRecord(prompt, completion)


def _parse_text(record: dict) -> DemonstrationRecord:
    return _checked("", string_field(record, "text"))


def _parse_prompt_completion(
    record: dict,
    render: Callable[..., str],
    trained: Callable | None,
    jinja: bool,
    conversational: ColumnKind,
) -> DemonstrationRecord:
    if conversational(record):  # TRL's conversational layout
        if trained is None and not jinja:
            return _checked(*_conversation_texts(record, render))
        prompt = _message_list(record, "prompt")
        completion = _message_list(record, "completion")
        if jinja:
            _check_calls_rendered(prompt + completion, render)
        if trained is None:
            return _checked(*_conversation_texts(record, render))
        if not completion:
            raise Unusable("empty completion")
        if completion[0]["role"] != "assistant":
            raise Malformed("wrong type", "'completion' must start with an assistant message")
        if not continues(prompt):
            return trained(prompt + completion, len(prompt))
        if not any(_said(m) for m in completion):
            raise Unusable("empty completion")
        return trained(join_reply(prompt, completion), len(prompt) - 1, prompt=prompt)
    if isinstance(record.get("prompt"), list) and isinstance(record.get("completion"), str):
        raise Malformed(
            "wrong type",
            "'prompt' is a list of messages but 'completion' is a string; give the "
            "completion as messages too (TRL's conversational prompt-completion), or both "
            "as strings",
        )
    return _checked(string_field(record, "prompt"), string_field(record, "completion"))


def _check_calls_rendered(messages: list[dict], render: Callable[..., str]) -> None:
    """`DataError` when a Jinja template renders an assistant message with `tool_calls`
    as it renders the message without them (it does not write tool calls, as SmolLM2's
    does not): the calls would be lost from the text, and a call without content would
    train an empty turn."""
    for k, m in enumerate(messages):
        if m["role"] == "assistant" and m.get("tool_calls"):
            bare = {key: v for key, v in m.items() if key != "tool_calls"}
            head = messages[:k]
            if render([*head, m], add_generation_prompt=False) == render(
                [*head, bare], add_generation_prompt=False
            ):
                raise DataError(
                    f"message {k} (assistant) has tool_calls, but the chat template does "
                    "not render them (its text is the same without them); use a template "
                    "that writes tool calls (data.chat_template=FILE, or "
                    "template=JinjaChatTemplate(...))"
                )


def _parse_messages(
    record: dict, render: Callable[..., str], trained: Callable | None, jinja: bool
) -> DemonstrationRecord:
    messages = message_list(record, _conversation_key(record))
    if jinja:
        _check_calls_rendered(messages, render)
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None:
        raise Unusable("no assistant message")
    if trained is not None:
        return trained(messages[: last + 1], 0)
    if not _said(messages[last]):
        raise Unusable("empty completion")
    return _checked(
        *split_conversation(messages[:last], messages[last : last + 1], render, continued=False)
    )


def _every_turn(
    messages: list[dict],
    first: int,
    render: Callable[..., str],
    template: object,
    prompt: list[dict] | None = None,
) -> DemonstrationRecord:
    """The record of `messages` trained on each of its assistant messages from index
    `first` on (the module docstring's `"all"`). `prompt`: the prompt messages when its
    last one (a prefill) is continued by message `first` (`join_reply`): that message is
    trained from the end of the prompt's rendering (`render_prompt`) on."""
    turns = [k for k in range(first, len(messages)) if messages[k]["role"] == "assistant"]
    said = [k for k in turns if _said(messages[k])]
    if not said:
        raise Unusable("empty completion")
    messages = messages[: said[-1] + 1]
    turns = [k for k in turns if k <= said[-1]]
    text, spans = _turn_spans(messages, turns, said, render, template)
    if prompt is not None:
        head = render_prompt(prompt, render)
        cut = len(head)
        if not (text.startswith(head) and spans[0][1] >= cut):
            raise DataError(
                "the chat template's rendering of the continued assistant message does not "
                "start with the prompt's, so the conversation cannot be split into prompt "
                "and completion"
            )
        spans[0] = (max(spans[0][0], cut), spans[0][1])
    start = spans[0][0]
    prompt, completion = text[:start], text[start:]
    spans = tuple((a - start, b - start) for a, b in spans)
    if spans == ((0, len(completion)),):
        spans = None
    return DemonstrationRecord(prompt, completion, spans)


def _turn_spans(
    messages: list[dict],
    turns: list[int],
    said: list[int],
    render: Callable[..., str],
    template: object,
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character range of each assistant message in
    `said` (those of the assistant messages `turns` that say something; a blank one is
    not trained, as a conversation ending with it is not): what its prompt (the messages
    before it, with the generation prompt) leaves of the conversation rendered through
    it, or a Jinja template's `{% generation %}` blocks; a Jinja template that rewrites
    earlier turns falls back to the content search of `render_with_assistant_mask`."""
    jinja = isinstance(template, JinjaChatTemplate)
    if not (jinja and template.has_generation_blocks):
        full = render(messages, add_generation_prompt=False)
        spans = []
        for k in said:
            before = render(messages[:k], add_generation_prompt=True)
            through = render(messages[: k + 1], add_generation_prompt=False)
            if not (through.startswith(before) and full.startswith(through)):
                break
            spans.append((len(before), len(through)))
        else:
            return full, spans
        if not jinja:
            raise DataError(
                "the chat template's assistant turn does not start with its generation "
                "prompt, so conversations cannot be split into prompt and completion"
            )
    rendered = template.render_with_assistant_mask(messages)
    spans = list(rendered.spans)
    if len(spans) >= len(turns):  # one span for each assistant message, blank ones too
        marked = dict(zip(turns, spans[len(spans) - len(turns) :]))
        return rendered.text, [marked[k] for k in said]
    if len(spans) < len(said):
        raise DataError(
            f"the chat template marks {len(spans)} assistant spans for {len(said)} assistant "
            "messages (it rewrites earlier turns, and an assistant message without text "
            "cannot be found in its output); use a template with {% generation %} blocks"
        )
    return rendered.text, spans[len(spans) - len(said) :]  # a blank message marks none


def _chosen_parser(
    template: ChatTemplate, layout: str | None = None
) -> Callable[[dict], DemonstrationRecord]:
    """A parser of preference records to their chosen responses, in the preference
    `layout` (`None`: that of the first record it parses, as `load_preferences` detects
    it)."""
    parser = None if layout is None else _preference_parser(layout, template)

    def parse(record: dict) -> DemonstrationRecord:
        nonlocal parser
        if parser is None:
            layout = detect_preference_format(record)
            if layout is None:
                raise Malformed(
                    "missing key", f"no preference layout fits the keys {sorted(record)}"
                )
            parser = _preference_parser(layout, template)
        pair = parser(record)
        return DemonstrationRecord(pair.prompt, pair.chosen)

    return parse


def _conversation_key(record: dict) -> str:
    """`"messages"`, or ShareGPT's `"conversations"` in a record without `"messages"`."""
    if "messages" not in record and "conversations" in record:
        return "conversations"
    return "messages"


def detect_demonstration_format(record: dict) -> str | None:
    """The demonstration format of a record from its keys (`None` when unknown): a
    ShareGPT `"conversations"` list without `"chosen"` is one conversation (`messages`)."""
    if "text" in record:
        return "text"
    if "messages" in record or ("conversations" in record and "chosen" not in record):
        return "messages"
    if {"prompt", "completion"} <= set(record):
        return None if "label" in record else "prompt_completion"
    return "preference" if detect_preference_format(record) is not None else None


def load_demonstrations(
    path: str | os.PathLike,
    format: str = "auto",
    *,
    lenient: bool = False,
    template: str | ChatTemplate | JinjaChatTemplate = "hh",
    columns: Mapping[str, str] | None = None,
    split: str | None = None,
    assistant_turns: str = "last",
) -> DemonstrationDataset:
    """Read a supervised fine-tuning dataset (see the module docstring for the layouts).

    **Arguments:**

    - `path`: the file or `datasets` directory, read as by `load_preferences`.
    - `format`: `"auto"` (from the keys of the first record), `"text"`,
      `"prompt_completion"`, `"messages"` or `"preference"`.
    - `lenient`: skip malformed lines/records (invalid JSON, missing keys, wrong types)
      and count them in the report instead of raising.
    - `template`: chat template for message lists (`"hh"`, `"chatml"`, a `ChatTemplate`,
      or a model's `JinjaChatTemplate`, e.g. `tokenizer.jinja_chat_template()`; the
      preference layouts take the first three).
    - `columns`: `{field: column}` for a file whose columns have other names, e.g.
      `{"text": "content"}` or `{"messages": "conversation"}` (fields: `COLUMN_NAMES`).
    - `split`: the split of a `DatasetDict` directory (or give the path as `DIR:SPLIT`).
    - `assistant_turns`: the assistant messages of a conversation that are trained,
      `"last"` or `"all"` (see the module docstring; conversational prompt-completion
      records: those of the completion).

    **Returns:** a `DemonstrationDataset` of `DemonstrationRecord(prompt, completion)`
    (with `spans` where a conversation trains on several turns); `dataset.report`
    counts what was read, kept and skipped (with reasons).

    **Raises:** `DataError` (a `ValueError`) naming the file and line (a table's row and
    column) for malformed input when not `lenient`, and for an unknown format.
    """
    if assistant_turns not in ASSISTANT_TURNS:
        raise DataError(
            f"assistant_turns must be one of {', '.join(ASSISTANT_TURNS)}, got {assistant_turns!r}"
        )
    if isinstance(template, JinjaChatTemplate):
        render = template.render
    else:
        render = functools.partial(format_chat, template=resolve_template(template))
    trained = None
    if assistant_turns == "all":
        trained = functools.partial(_every_turn, render=render, template=template)

    # The preference layout of the first record as `load_records` detects its format:
    # a table's row with its null columns, where a null `prompt` is a pair's (refused by
    # its column), not an implicit prompt.
    layouts: list[str | None] = []

    def detect(record: dict) -> str | None:
        fmt = detect_demonstration_format(record)
        if fmt == "preference" and not layouts:
            layouts.append(detect_preference_format(record))
        return fmt

    def make_parser(fmt: str) -> Callable[[dict], DemonstrationRecord]:
        if fmt == "text":
            return _parse_text
        if fmt == "preference":
            if isinstance(template, JinjaChatTemplate):
                raise DataError(
                    "preference pairs render their messages with 'hh', 'chatml' or a "
                    "ChatTemplate, not a JinjaChatTemplate"
                )
            return _chosen_parser(resolve_template(template), layouts[0] if layouts else None)
        jinja = isinstance(template, JinjaChatTemplate)
        if fmt == "messages":
            return lambda record: _parse_messages(record, render, trained, jinja)
        conversational = ColumnKind("completion")
        return lambda record: _parse_prompt_completion(
            record, render, trained, jinja, conversational
        )

    records, report = load_records(
        path,
        format,
        kind="demonstration",
        formats=DEMONSTRATION_FORMATS,
        detect=detect,
        expected="'text', 'prompt'/'completion' (without 'label': that is unpaired data), "
        "'messages', or a preference layout ('chosen'/'rejected', ...)",
        make_parser=make_parser,
        lenient=lenient,
        columns=columns,
        split=split,
    )
    return DemonstrationDataset(records, report, report.locations)


def tokenize_demonstrations(
    records: Sequence, tokenizer: Tokenizer, **options: Any
) -> tuple[list[TokenizedSequence], TokenizeReport]:
    """Tokenise demonstrations as `tokenize_sft` does (`options`: its keyword arguments),
    with one rule for a record that has no prompt ids (an empty prompt, a `"text"`
    record, on a tokenizer that adds no BOS, such as SmolLM2's): its first token becomes
    the prompt. No token comes before it, so it cannot be predicted; as a completion
    token it would count in a token-mean loss's denominator with nothing in its
    numerator (TRL's language modelling leaves it out the same way). A record of one
    token is then dropped (`report.dropped["empty completion"]`).

    A record with `spans` gets its `completion_mask` as in `tokenize_sft`; one left with
    no trained token is dropped (`report.dropped["no trained token"]`).

    **Returns:** `(sequences, report)`: a `TokenizedSequence` for each kept record, in
    order, and the `TokenizeReport`.
    """
    return _first_token_as_prompt(*tokenize_sft(records, tokenizer, **options))


def _first_token_as_prompt(
    seqs: list[TokenizedSequence], report: TokenizeReport
) -> tuple[list[TokenizedSequence], TokenizeReport]:
    """The sequences with an empty prompt given their first token as prompt; those left
    with no completion (or no trained token) dropped and counted."""
    out = []
    for s in seqs:
        if not s.prompt:
            mask = s.completion_mask
            s = TokenizedSequence(
                s.completion[:1], s.completion[1:], None if mask is None else mask[1:]
            )
        reason = "empty completion" if not s.completion else None
        if reason is None and not s.trained:
            reason = "no trained token"
        if reason is not None:
            report.kept -= 1
            report.drop(reason)
            continue
        out.append(s)
    return out, report
