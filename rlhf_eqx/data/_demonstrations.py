"""Demonstrations for supervised fine-tuning: records of `(prompt, completion)` text, the
loss on the completion.

`load_demonstrations` reads TRL's SFT layouts, and preference pairs (auto-detected from
the keys of the first record):

- `"text"` — `{"text": str}`, language modelling: the prompt is `""`, the completion
  the text (every token is trained on).
- `"prompt_completion"` — `{"prompt": str, "completion": str}`, used as given; or TRL's
  conversational `{"prompt": [messages], "completion": [messages]}`: the prompt
  messages rendered with the generation prompt, the completion the rest of the
  rendered conversation.
- `"messages"` — `{"messages": [{"role", "content"}, ...]}`: the prompt is every
  message before the last assistant message, rendered with the generation prompt; the
  completion is that assistant message, the rest of the rendered conversation.
- `"preference"` — any layout `load_preferences` reads (detected as it detects them):
  the pair's prompt and its chosen response.

Message lists are rendered with a chat template (`format_chat`, HH style by default, or
a model's `JinjaChatTemplate`) so that `prompt + completion` is the rendered
conversation (up to and including the trained assistant message), as the preference
and unpaired readers split theirs. A conversation trains on its last assistant message
only (messages after it are not read); earlier assistant turns are part of the prompt.
A `prompt_completion` record with a `label` column is unpaired (KTO) data and is not
detected as demonstrations (give `format="prompt_completion"` to read it anyway).

Records with an empty (or blank) completion, and conversations without an assistant
message, are skipped and counted in `dataset.report`; preference pairs are skipped as
`load_preferences` skips them.

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
    format_chat,
    message_list,
    resolve_template,
    split_conversation,
)
from ._errors import DataError
from ._io import Malformed, RecordDataset, Unusable, load_records, string_field
from ._jinja_chat import JinjaChatTemplate
from ._preferences import _preference_parser, detect_preference_format
from ._tokenize import tokenize_sft
from ._tokenized import TokenizedSequence, TokenizeReport
from ._tokenizer import Tokenizer
from ._unpaired import _conversation_texts

DEMONSTRATION_FORMATS = ("text", "prompt_completion", "messages", "preference")
"""The record layouts `load_demonstrations(path, format=...)` reads (besides `"auto"`,
which detects one of them)."""


@dataclasses.dataclass(frozen=True)
class DemonstrationRecord:
    """One demonstration: `prompt + completion` is trained on, the loss on `completion`
    (`prompt` is `""` for language-modelling text)."""

    prompt: str
    completion: str


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


def _parse_prompt_completion(record: dict, render: Callable[..., str]) -> DemonstrationRecord:
    if isinstance(record.get("completion"), list):  # TRL's conversational layout
        return _checked(*_conversation_texts(record, render))
    return _checked(string_field(record, "prompt"), string_field(record, "completion"))


def _parse_messages(record: dict, render: Callable[..., str]) -> DemonstrationRecord:
    messages = message_list(record, "messages")
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None:
        raise Unusable("no assistant message")
    if not messages[last]["content"].strip():
        raise Unusable("empty completion")
    return _checked(*split_conversation(messages[:last], messages[last : last + 1], render))


def _chosen_parser(template: ChatTemplate) -> Callable[[dict], DemonstrationRecord]:
    """A parser of preference records to their chosen responses, in the preference layout
    of the first record it parses (as `load_preferences` detects it)."""
    parser = None

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


def detect_demonstration_format(record: dict) -> str | None:
    """The demonstration format of a record from its keys (`None` when unknown)."""
    if "text" in record:
        return "text"
    if "messages" in record:
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

    **Returns:** a `DemonstrationDataset` of `DemonstrationRecord(prompt, completion)`;
    `dataset.report` counts what was read, kept and skipped (with reasons).

    **Raises:** `DataError` (a `ValueError`) naming the file and line (a table's row and
    column) for malformed input when not `lenient`, and for an unknown format.
    """
    if isinstance(template, JinjaChatTemplate):
        render = template.render
    else:
        render = functools.partial(format_chat, template=resolve_template(template))

    def make_parser(fmt: str) -> Callable[[dict], DemonstrationRecord]:
        if fmt == "text":
            return _parse_text
        if fmt == "preference":
            if isinstance(template, JinjaChatTemplate):
                raise DataError(
                    "preference pairs render their messages with 'hh', 'chatml' or a "
                    "ChatTemplate, not a JinjaChatTemplate"
                )
            return _chosen_parser(resolve_template(template))
        parse = _parse_messages if fmt == "messages" else _parse_prompt_completion
        return lambda record: parse(record, render)

    records, report = load_records(
        path,
        format,
        kind="demonstration",
        formats=DEMONSTRATION_FORMATS,
        detect=detect_demonstration_format,
        expected="'text', 'prompt'/'completion' (without 'label': that is unpaired data), "
        "'messages', or a preference layout ('chosen'/'rejected', ...)",
        make_parser=make_parser,
        lenient=lenient,
        columns=columns,
        split=split,
    )
    return DemonstrationDataset(records, report)


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

    **Returns:** `(sequences, report)`: a `TokenizedSequence` for each kept record, in
    order, and the `TokenizeReport`.
    """
    seqs, report = tokenize_sft(records, tokenizer, **options)
    out = []
    for s in seqs:
        if not s.prompt:
            s = TokenizedSequence(s.completion[:1], s.completion[1:])
        if not s.completion:
            report.kept -= 1
            report.drop("empty completion")
            continue
        out.append(s)
    return out, report
