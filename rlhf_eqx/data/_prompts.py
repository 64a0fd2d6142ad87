"""Prompt datasets for generation (PPO / GRPO rollouts, evaluation).

`load_prompts` reads three layouts (auto-detected from the keys of the first record):

| format | record | prompt | answer |
| --- | --- | --- | --- |
| `"gsm8k"` | `{"question", "answer"}` | the question | the integer after `####` |
| `"mt-bench"` | `{"question_id", "category", "turns": [str, ...]}` | the first turn | `None` |
| `"plain"` | `{"prompt": str or [messages], "answer"?: str}` | the prompt | the answer, if any |

A record with a `prompt` is plain, whatever else it holds (a GSM8K `question` and
`answer` kept beside the `prompt` that TRL's layout adds). A plain record without
`answer` may name it `solution` (TRL's math datasets). An answer
is a string or a number (a JSON number, a Parquet `int64`, `double` or decimal column: `3.0`
reads as `"3"`, as `exact_match_reward` compares it); a GSM8K answer is a solution ending
`#### <number>`, or the number alone.

A plain file's prompts are all strings or all message lists, as its first record's
(`Malformed` naming `prompt` for a record of the other kind). A message list ends with
the generation prompt, or, when its last message is the assistant's (a prefill such as
`"The answer is"`), continues that message (`format_chat(...,
continue_final_message=True)`); one that ends with a system message is refused.
"""

import dataclasses
import decimal
import functools
import os
from collections.abc import Mapping
from typing import Any

from ._answers import extract_gsm8k_answer, normalise_number
from ._chat import (
    ChatTemplate,
    ColumnKind,
    format_chat,
    message_field,
    prompt_messages,
    render_prompt,
    resolve_template,
    said,
)
from ._io import (
    Malformed,
    RecordDataset,
    Unusable,
    load_records,
    record_field,
    string_field,
)

PROMPT_FORMATS = ("gsm8k", "mt-bench", "plain")
"""The record layouts `load_prompts(path, format=...)` reads (besides `"auto"`, which detects
one of them)."""


class PromptDataset(RecordDataset["PromptRecord"]):
    """An immutable sequence of `PromptRecord`s with the `LoadReport` of its file."""

    noun = "prompts"


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    """A prompt and, when the dataset has one, its reference answer; `columns`: the
    record's other fields as read (the answer's column and any other, e.g. a
    `difficulty`, under their names after the column mapping), which user reward
    functions receive as keywords, as TRL's do, and a conversational prompt's messages
    as written (`"prompt"`: a list of `{"role", "content"}`; a text prompt's is not
    kept). Not compared. `messages`: a conversational prompt's messages as the readers
    read them (roles normalised, tool calls checked), `{"prompt": (message, ...)}`, which
    a model's chat template renders itself; `None` for a text prompt. Not compared."""

    prompt: str
    answer: str | None = None
    columns: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    messages: Mapping[str, tuple[Mapping[str, Any], ...]] | None = dataclasses.field(
        default=None, compare=False, repr=False
    )


def detect_prompt_format(record: dict) -> str | None:
    """The prompt format of a record from its keys (`None` when unknown): a `prompt` is
    the prompt (TRL's column) beside any other, a GSM8K `question` too (a dataset mapped
    to TRL's layout keeps its source's columns: the `prompt` with its system message is
    what is trained on)."""
    if "prompt" in record:
        return "plain"
    if "question" in record and "answer" in record:
        return "gsm8k"
    if "turns" in record:
        return "mt-bench"
    return None


def _render(text: str, template: ChatTemplate | None) -> str:
    if not text.strip():
        raise Unusable("empty prompt")
    if template is None:
        return text
    return format_chat([{"role": "user", "content": text}], template, add_generation_prompt=True)


def _others(record: dict, prompt_key: str) -> dict:
    """The fields of `record` other than its prompt's (`PromptRecord.columns`)."""
    return {k: v for k, v in record.items() if k != prompt_key}


def _answer_value(record: dict, key: str) -> str | None:
    """The reference answer `record[key]` as text: a string as it is, a number (not a
    bool; a Parquet decimal too) in its normal form (`normalise_number`: `3.0` -> `"3"`);
    `None` when absent; `Malformed` naming the key for another type or a number that is
    not finite."""
    value = record.get(key)
    if value is None or isinstance(value, str):
        return value
    # A Parquet decimal column (Spark's, a SQL export's) holds `Decimal`s.
    if isinstance(value, bool) or not isinstance(value, (int, float, decimal.Decimal)):
        raise Malformed(
            "wrong type", f"{key!r} must be a string or a number, got {type(value).__name__}"
        )
    number = normalise_number(str(value))
    if number is None:
        raise Malformed("wrong type", f"{key!r} must be a finite number, got {value!r}")
    return number


def _parse_gsm8k(record: dict, template: ChatTemplate | None) -> PromptRecord:
    question = string_field(record, "question")
    record_field(record, "answer")
    solution = _answer_value(record, "answer")
    answer = None if solution is None else extract_gsm8k_answer(solution)
    if answer is None and solution is not None:
        answer = normalise_number(solution)  # the final answer alone
    if answer is None:
        raise Malformed("no answer", "the 'answer' has no '#### <number>' and is not a number")
    return PromptRecord(_render(question, template), answer, _others(record, "question"))


def _parse_mt_bench(record: dict, template: ChatTemplate | None) -> PromptRecord:
    turns = record["turns"]
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
        raise Malformed("wrong type", "'turns' must be a non-empty list of strings")
    return PromptRecord(_render(turns[0], template), None, _others(record, "turns"))


def _parse_plain(
    record: dict, template: ChatTemplate | None, conversational: ColumnKind
) -> PromptRecord:
    prompt = record.get("prompt")
    key = "answer" if "answer" in record else "solution"  # TRL's math sets name it so
    answer = _answer_value(record, key)
    if conversational(record):
        messages = [message_field(m, "prompt") for m in prompt]
        if not any(said(m) for m in messages):
            raise Unusable("empty prompt")
        prompt_messages(messages)
        render = functools.partial(format_chat, template=template or "hh")
        rendered = render_prompt(messages, render)
        others = {**_others(record, "prompt"), "prompt": prompt}
        return PromptRecord(rendered, answer, others, {"prompt": tuple(messages)})
    prompt = _render(string_field(record, "prompt"), template)
    return PromptRecord(prompt, answer, _others(record, "prompt"))


def load_prompts(
    path: str | os.PathLike,
    format: str = "auto",
    *,
    lenient: bool = False,
    template: str | ChatTemplate | None = None,
    columns: Mapping[str, str] | None = None,
    split: str | None = None,
) -> PromptDataset:
    """Read a prompt dataset.

    **Arguments:**

    - `path`: a `.jsonl`, `.json` (list) or gzipped file; or a `.parquet` / `.arrow`
      file or a `datasets` `save_to_disk` directory (`dataset_files`).
    - `format`: `"auto"` (from the keys of the first record), `"gsm8k"`,
      `"mt-bench"` or `"plain"` (see the module docstring).
    - `lenient`: skip malformed lines/records instead of raising `DataError`.
    - `template`: when given (`"hh"`, `"chatml"` or a `ChatTemplate`), each prompt is
      rendered as one user turn followed by the generation prompt; otherwise the text
      is kept as it is (message-list prompts are rendered with `"hh"`).
    - `columns`: `{field: column}` for a file whose columns have other names, e.g.
      `{"prompt": "instruction"}` (fields: `COLUMN_NAMES`).
    - `split`: the split of a `DatasetDict` directory (or give the path as `DIR:SPLIT`).

    **Returns:** a `PromptDataset` of `PromptRecord(prompt, answer)`; `answer` is
    `None` when the dataset has none. Records with an empty prompt are skipped and
    counted in `dataset.report`.
    """
    tmpl = None if template is None else resolve_template(template)

    def make_parser(fmt: str):
        conversational = ColumnKind("prompt")
        parsers = {
            "gsm8k": _parse_gsm8k,
            "mt-bench": _parse_mt_bench,
            "plain": lambda record, tmpl: _parse_plain(record, tmpl, conversational),
        }

        def parse(record: dict) -> PromptRecord:
            if fmt == "mt-bench" and "turns" not in record:
                raise Malformed("missing key", f"no 'turns' in a record with keys {sorted(record)}")
            return parsers[fmt](record, tmpl)

        return parse

    records, report = load_records(
        path,
        format,
        kind="prompt",
        formats=PROMPT_FORMATS,
        detect=detect_prompt_format,
        expected="'question'/'answer' (GSM8K), 'turns' (MT-Bench) or 'prompt'",
        make_parser=make_parser,
        lenient=lenient,
        columns=columns,
        split=split,
    )
    return PromptDataset(records, report, report.locations)
