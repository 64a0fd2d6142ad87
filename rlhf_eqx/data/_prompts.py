"""Prompt datasets for generation (PPO / GRPO rollouts, evaluation).

`load_prompts` reads three layouts (auto-detected from the keys of the first record):

| format | record | prompt | answer |
| --- | --- | --- | --- |
| `"gsm8k"` | `{"question", "answer"}` | the question | the integer after `####` |
| `"mt-bench"` | `{"question_id", "category", "turns": [str, ...]}` | the first turn | `None` |
| `"plain"` | `{"prompt": str or [messages], "answer"?: str}` | the prompt | the answer, if any |
"""

import dataclasses
import os
from collections.abc import Sequence
from typing import overload

from ._answers import extract_gsm8k_answer
from ._chat import ChatTemplate, _template, format_chat
from ._errors import DataError
from ._io import LoadReport, Malformed, Unusable, parse_records, read_json_records
from ._preferences import _message, _string

__all__ = ["PromptRecord", "PromptDataset", "load_prompts"]

PROMPT_FORMATS = ("gsm8k", "mt-bench", "plain")


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    """A prompt and, when the dataset has one, its reference answer."""

    prompt: str
    answer: str | None = None


class PromptDataset(Sequence):
    """An immutable sequence of `PromptRecord`s with the `LoadReport` of its file."""

    def __init__(self, records: Sequence[PromptRecord], report: LoadReport):
        self._records: tuple[PromptRecord, ...] = tuple(records)
        self.report: LoadReport = report

    @overload
    def __getitem__(self, index: int) -> PromptRecord: ...

    @overload
    def __getitem__(self, index: slice) -> "PromptDataset": ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            return PromptDataset(self._records[index], self.report)
        return self._records[index]

    def __len__(self) -> int:
        return len(self._records)

    def __repr__(self) -> str:
        return f"PromptDataset({len(self)} prompts; {self.report})"


def detect_prompt_format(record: dict) -> str | None:
    """The prompt format of a record from its keys (`None` when unknown)."""
    if "question" in record and "answer" in record:
        return "gsm8k"
    if "turns" in record:
        return "mt-bench"
    if "prompt" in record:
        return "plain"
    return None


def _render(text: str, template: ChatTemplate | None) -> str:
    if not text.strip():
        raise Unusable("empty prompt")
    if template is None:
        return text
    return format_chat([{"role": "user", "content": text}], template, add_generation_prompt=True)


def _parse_gsm8k(record: dict, template: ChatTemplate | None) -> PromptRecord:
    question, solution = _string(record, "question"), _string(record, "answer")
    answer = extract_gsm8k_answer(solution)
    if answer is None:
        raise Malformed("no answer", "the 'answer' has no '#### <number>'")
    return PromptRecord(_render(question, template), answer)


def _parse_mt_bench(record: dict, template: ChatTemplate | None) -> PromptRecord:
    turns = record["turns"]
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
        raise Malformed("wrong type", "'turns' must be a non-empty list of strings")
    return PromptRecord(_render(turns[0], template), None)


def _parse_plain(record: dict, template: ChatTemplate | None) -> PromptRecord:
    prompt = record.get("prompt")
    answer = record.get("answer")
    if answer is not None and not isinstance(answer, (str, int)):
        raise Malformed("wrong type", f"'answer' must be a string, got {type(answer).__name__}")
    answer = None if answer is None else str(answer)
    if isinstance(prompt, list):
        messages = [_message(m, "prompt") for m in prompt]
        if not any(m["content"].strip() for m in messages):
            raise Unusable("empty prompt")
        return PromptRecord(
            format_chat(messages, template or "hh", add_generation_prompt=True), answer
        )
    return PromptRecord(_render(_string(record, "prompt"), template), answer)


def load_prompts(
    path: str | os.PathLike,
    format: str = "auto",
    *,
    lenient: bool = False,
    template: str | ChatTemplate | None = None,
) -> PromptDataset:
    """Read a prompt dataset.

    **Arguments:**

    - `path`: a `.jsonl`, `.json` (list) or gzipped file.
    - `format`: `"auto"` (from the keys of the first record), `"gsm8k"`,
      `"mt-bench"` or `"plain"` (see the module docstring).
    - `lenient`: skip malformed lines/records instead of raising `DataError`.
    - `template`: when given (`"hh"`, `"chatml"` or a `ChatTemplate`), each prompt is
      rendered as one user turn followed by the generation prompt; otherwise the text
      is kept as it is (message-list prompts are rendered with `"hh"`).

    **Returns:** a `PromptDataset` of `PromptRecord(prompt, answer)`; `answer` is
    `None` when the dataset has none. Records with an empty prompt are skipped and
    counted in `dataset.report`.
    """
    path = os.fspath(path)
    if format != "auto" and format not in PROMPT_FORMATS:
        raise DataError(f"unknown prompt format {format!r}; use 'auto' or one of {PROMPT_FORMATS}")
    tmpl = None if template is None else _template(template)
    report = LoadReport(path=path, format=format)
    records = read_json_records(path, report, lenient=lenient)
    first = next(records, None)
    if first is None:
        report.format = format if format != "auto" else "empty"
        return PromptDataset([], report)
    if format == "auto":
        detected = detect_prompt_format(first[1])
        if detected is None:
            raise DataError(
                f"{first[0]}: cannot tell the prompt format from the keys {sorted(first[1])}; "
                "expected 'question'/'answer' (GSM8K), 'turns' (MT-Bench) or 'prompt'"
            )
        format = detected
    report.format = format
    parser = {"gsm8k": _parse_gsm8k, "mt-bench": _parse_mt_bench, "plain": _parse_plain}[format]

    def parse(record: dict) -> PromptRecord:
        if format == "mt-bench" and "turns" not in record:
            raise Malformed("missing key", f"no 'turns' in a record with keys {sorted(record)}")
        return parser(record, tmpl)

    def all_records():
        yield first
        yield from records

    return PromptDataset(parse_records(all_records(), parse, report, lenient=lenient), report)
