"""Preference datasets: records of `(prompt, chosen, rejected)` text.

`load_preferences` reads four layouts (auto-detected from the keys of the first
record):

- `"hh"` — `{"chosen": str, "rejected": str}` (TRL's implicit prompt): full Anthropic
  HH-RLHF transcripts `\n\nHuman: …\n\nAssistant: …`, split at the last
  `\n\nAssistant:` inside the common prefix of the two transcripts; texts without HH
  turns (`"The sky is blue."`, `"The sky is green."`) at their common prefix, as TRL's
  `extract_prompt`, cut back to a word boundary (`split_implicit_prompt`).
- `"messages"` — `{"prompt"?, "chosen": [msg], "rejected": [msg]}` with OpenAI-style
  `{"role", "content"}` messages (UltraFeedback-binarized; TRL's conversational layout,
  where `prompt` is a message list and `chosen`/`rejected` hold only the reply); the
  prompt is the longest shared message prefix that is followed by an assistant message
  in both. A given prompt that ends with an assistant message (a prefill) is continued
  by each reply's first message (`join_reply`), as `load_prompts` continues it; one
  that ends with a system message is refused. A reply `[]` is an empty completion.
- `"sharegpt"` — `{"conversations": [{"from", "value"}, ...], "chosen": {"from",
  "value"}, "rejected": {...}}`; the conversation is the prompt.
- `"plain"` — `{"prompt": str, "chosen": str, "rejected": str}`, used as given.

Message formats are rendered with a chat template (`format_chat`, HH style by default):
the prompt is the shared messages plus the generation prompt, and each completion is
the rest of its rendered conversation, so `prompt + chosen` is exactly the rendered
chosen conversation. HH transcripts give prompts ending in `\\n\\nAssistant:` and
completions starting with a space (TRL's `extract_prompt` does the same split).

Pairs that cannot be split (no shared prefix ending in `\\n\\nAssistant:`, no shared
message prefix before an assistant turn), pairs with identical completions and pairs
with an empty (or blank) completion are skipped and counted in `dataset.report`.

**Margins.** A record of any layout may carry a numeric `margin` (TRL's
`RewardTrainer` column; e.g. a rating difference, Llama 2's margin loss): it is kept as
`PreferenceRecord.margin`, tokenised and collated into `PreferenceBatch.margins`, and the
reward-model loss becomes $-\\log\\sigma(r_c - r_r - m - m_i)$ (`rlhf_eqx.train.reward_loss`).
A margin that is not a finite number (a string, a boolean, `null`, `NaN`) is refused
naming the file, the line (a table's row) and the column; a file where some pairs have
a margin and others not is refused naming the first pair without one. DPO reads no
margin, as TRL's `DPOTrainer` does not.
"""

import dataclasses
import functools
import math
import numbers
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ._chat import (
    ChatTemplate,
    continues,
    format_chat,
    message_field,
    message_list,
    prompt_messages,
    resolve_template,
    said,
    split_conversation,
)
from ._errors import DataError
from ._io import (
    Malformed,
    RecordDataset,
    Unusable,
    common_prefix_length,
    load_records,
    string_field,
)

HH_ASSISTANT = "\n\nAssistant:"
HH_HUMAN = "\n\nHuman:"
PREFERENCE_FORMATS = ("hh", "messages", "sharegpt", "plain")
"""The record layouts `load_preferences(path, format=...)` reads (besides `"auto"`, which
detects one of them)."""


class PreferenceDataset(RecordDataset["PreferenceRecord"]):
    """An immutable sequence of `PreferenceRecord`s with the `LoadReport` of its file."""

    noun = "pairs"


@dataclasses.dataclass(frozen=True)
class PreferenceRecord:
    """One preference pair: `prompt + chosen` is preferred over `prompt + rejected`.

    `messages`: a pair of conversations as the reader split them, `{"prompt": (message,
    ...), "chosen": (...), "rejected": (...)}` (the shared messages, then each reply's),
    which a model's chat template renders itself; `None` for text pairs. Not compared.

    `margin`: the pair's own reward margin $m_i$ (a file's `margin` column, as TRL's
    `RewardTrainer` reads it), which the reward-model loss subtracts from the reward
    difference; `None` (the default): none.
    """

    prompt: str
    chosen: str
    rejected: str
    messages: Mapping[str, tuple[Mapping[str, Any], ...]] | None = dataclasses.field(
        default=None, compare=False, repr=False
    )
    margin: float | None = None


def _preference_texts(records: Sequence) -> list[tuple[str, str, str]]:
    """`(prompt, chosen, rejected)` of each record: a `PreferenceRecord`, or any object
    with string `.prompt`, `.chosen` and `.rejected` (else `DataError` naming the field)."""
    texts = []
    for r in records:
        for key in ("prompt", "chosen", "rejected"):
            if not isinstance(getattr(r, key, None), str):
                raise DataError(f"preference records need a string .{key}, got {type(r).__name__}")
        texts.append((r.prompt, r.chosen, r.rejected))
    return texts


def _preference_margins(records: Sequence) -> list[float | None]:
    """The `.margin` of each record as a float (`None` for a record without one, or an
    object without a `.margin`; `DataError` naming the record for one that is not a
    finite number)."""
    out = []
    for i, r in enumerate(records):
        margin = getattr(r, "margin", None)
        if margin is not None and not _is_finite_number(margin):
            raise DataError(
                f"preference record {i} has margin {margin!r}: a pair's margin must be a "
                "finite number (or None)"
            )
        out.append(None if margin is None else float(margin))
    return out


def _is_finite_number(value: object) -> bool:
    return (
        not isinstance(value, bool)
        and isinstance(value, numbers.Real)
        and math.isfinite(float(value))
    )


def _margin_field(record: dict) -> float | None:
    """`record["margin"]` as a float, `None` when the record has no `margin`
    (`Malformed` naming the key when it is not a finite number)."""
    if "margin" not in record:
        return None
    value = record["margin"]
    if not _is_finite_number(value):
        got = "null" if value is None else f"{type(value).__name__} {value!r}"
        raise Malformed(
            "wrong type", f"'margin' must be a finite number (the pair's margin), got {got}"
        )
    return float(value)


def _with_margin(parse):
    """`parse`, with the record's `margin` (`_margin_field`) kept on the pair it gives."""

    def parse_with_margin(record: dict) -> PreferenceRecord:
        margin = _margin_field(record)
        pair = parse(record)
        return pair if margin is None else dataclasses.replace(pair, margin=margin)

    return parse_with_margin


def _check_margins(records: Sequence[PreferenceRecord], locations: Sequence[str | None]) -> None:
    """Refuse a file where some pairs have a `margin` and others not (`DataError` naming
    the first pair without one and the first with one)."""
    has = [r.margin is not None for r in records]
    if all(has) or not any(has):
        return
    where = lambda i: locations[i] if i < len(locations) and locations[i] else f"pair {i}"
    raise DataError(
        f"{where(has.index(False))}: no 'margin' (missing or null), though "
        f"{where(has.index(True))} has one: give every pair a margin or none"
    )


def split_hh_transcript(chosen: str, rejected: str) -> tuple[str, str, str] | None:
    """Split two HH-RLHF transcripts into `(prompt, chosen, rejected)`.

    The prompt is the longest common prefix of the two transcripts cut just after its
    last `"\\n\\nAssistant:"`; the completions are the rest. `None` when the common
    prefix holds no `"\\n\\nAssistant:"`.
    """
    common = chosen[: common_prefix_length(chosen, rejected)]
    cut = common.rfind(HH_ASSISTANT)
    if cut < 0:
        return None
    end = cut + len(HH_ASSISTANT)
    return chosen[:end], chosen[end:], rejected[end:]


def _checked(prompt: str, chosen: str, rejected: str, messages=None) -> PreferenceRecord:
    if not chosen.strip() or not rejected.strip():
        raise Unusable("empty completion")
    if chosen == rejected:
        raise Unusable("identical completions")
    return PreferenceRecord(prompt, chosen, rejected, messages)


def split_implicit_prompt(chosen: str, rejected: str) -> tuple[str, str, str] | None:
    """Split two texts that share their prompt into `(prompt, chosen, rejected)`: HH-RLHF
    transcripts as `split_hh_transcript` splits them; texts without HH turns
    (`"\\n\\nHuman:"`, `"\\n\\nAssistant:"`) at their longest common prefix, as TRL's
    `extract_prompt` splits them, cut back to a word boundary: the prompt ends before
    the last whitespace character of the shared text, which starts both completions
    (`"The sky is blue."`, `"The sky is green."` -> `"The sky is"`, `" blue."`,
    `" green."`; TRL cuts where the texts part and moves one space into the completions,
    which is the same for texts that part at a word). `None` when the shared text has
    no whitespace that a non-blank prompt ends before (`"no turns here"`, `"nor
    here"`), or when HH transcripts do not split."""
    if any(m in t for t in (chosen, rejected) for m in (HH_ASSISTANT, HH_HUMAN)):
        return split_hh_transcript(chosen, rejected)
    common = chosen[: common_prefix_length(chosen, rejected)]
    cut = max((i for i, c in enumerate(common) if c.isspace()), default=-1)
    if cut < 0 or not common[:cut].strip():
        return None
    return chosen[:cut], chosen[cut:], rejected[cut:]


def _parse_hh(record: dict) -> PreferenceRecord:
    chosen, rejected = string_field(record, "chosen"), string_field(record, "rejected")
    split = split_implicit_prompt(chosen, rejected)
    if split is None:
        if chosen == rejected:
            raise Unusable("identical completions")
        raise Unusable("unsplittable")
    return _checked(*split)


def _parse_plain(record: dict) -> PreferenceRecord:
    if isinstance(record.get("prompt"), list):  # TRL's layouts keep the three alike
        raise Malformed(
            "wrong type",
            "'prompt' is a list of messages but 'chosen' and 'rejected' are strings: give "
            "all three as strings, or 'chosen' and 'rejected' as lists of messages too",
        )
    return _checked(
        string_field(record, "prompt"),
        string_field(record, "chosen"),
        string_field(record, "rejected"),
    )


def _split_messages(
    chosen: list[dict[str, str]], rejected: list[dict[str, str]], template: ChatTemplate
) -> PreferenceRecord:
    """Prompt = the longest shared message prefix followed, in both, by an assistant turn
    (and not ending with one, which would be a prefill that the reply continues: two
    assistant turns in a row stay two turns)."""
    if chosen == rejected:
        raise Unusable("identical completions")
    k = common_prefix_length(chosen, rejected)
    while k >= 0:  # a prompt ending with an assistant message would be continued: not here
        if (
            k < len(chosen)
            and k < len(rejected)
            and chosen[k]["role"] == "assistant"
            and rejected[k]["role"] == "assistant"
            and not continues(chosen[:k])
        ):
            break
        k -= 1
    if k < 0:
        raise Unusable("unsplittable")
    prompt = format_chat(chosen[:k], template, add_generation_prompt=True)
    completions = []
    for messages in (chosen, rejected):
        if not any(said(m) for m in messages[k:]):
            raise Unusable("empty completion")
        full = format_chat(messages, template, add_generation_prompt=False)
        if not full.startswith(prompt):
            raise DataError(
                "the chat template's assistant turn does not start with its generation "
                "prompt, so conversations cannot be split into prompt and completion"
            )
        completions.append(full[len(prompt) :])
    messages = {"prompt": tuple(chosen[:k]), "chosen": tuple(chosen[k:])}
    messages["rejected"] = tuple(rejected[k:])
    return _checked(prompt, *completions, messages)


def _prompt_messages(record: dict) -> list[dict[str, str]]:
    prompt = record.get("prompt")
    if prompt is None:
        return []
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list):
        return [message_field(m, "prompt") for m in prompt]
    raise Malformed(
        "wrong type", f"'prompt' must be a string or messages, got {type(prompt).__name__}"
    )


def _continued(
    prompt: list[dict], chosen: list[dict], rejected: list[dict], template: ChatTemplate
) -> PreferenceRecord:
    """The pair of replies to a prompt that ends with an assistant message (a prefill):
    each reply's first message continues it (`split_conversation`)."""
    if chosen == rejected:
        raise Unusable("identical completions")
    if not all(any(said(m) for m in reply) for reply in (chosen, rejected)):
        raise Unusable("empty completion")
    render = functools.partial(format_chat, template=template)
    text, chosen_text = split_conversation(prompt, chosen, render)
    _, rejected_text = split_conversation(prompt, rejected, render)
    messages = {"prompt": tuple(prompt), "chosen": tuple(chosen), "rejected": tuple(rejected)}
    return _checked(text, chosen_text, rejected_text, messages)


def _parse_messages(record: dict, template: ChatTemplate) -> PreferenceRecord:
    chosen, rejected = message_list(record, "chosen"), message_list(record, "rejected")
    if not chosen or not rejected:  # as an empty string is
        raise Unusable("empty completion")
    # TRL's conversational layout stores only the reply under chosen/rejected.
    replies = [m[0]["role"] == "assistant" for m in (chosen, rejected)]
    prefix = _prompt_messages(record)
    if any(replies):  # the prompt is read: it must end as a prompt does
        prompt_messages(prefix)
    if all(replies) and continues(prefix):
        return _continued(prefix, chosen, rejected, template)
    if replies[0]:
        chosen = prefix + chosen
    if replies[1]:
        rejected = prefix + rejected
    return _split_messages(chosen, rejected, template)


def _parse_sharegpt(record: dict, template: ChatTemplate) -> PreferenceRecord:
    conversation = message_list(record, "conversations")
    for key in ("chosen", "rejected"):
        if key not in record:
            raise Malformed("missing key", f"no {key!r} in a record with keys {sorted(record)}")
    chosen = message_field(record["chosen"], "chosen")
    rejected = message_field(record["rejected"], "rejected")
    if chosen["role"] != "assistant" or rejected["role"] != "assistant":
        raise Malformed("wrong type", "'chosen' and 'rejected' must be assistant messages")
    return _split_messages(conversation + [chosen], conversation + [rejected], template)


def detect_preference_format(record: dict) -> str | None:
    """The preference format of a record from its keys (`None` when unknown)."""
    if "conversations" in record:
        return "sharegpt"
    if "chosen" in record and "rejected" in record:
        if isinstance(record["chosen"], list):
            return "messages"
        return "plain" if "prompt" in record else "hh"
    return None


def _preference_parser(fmt: str, tmpl: ChatTemplate):
    """The record parser of the preference layout `fmt` (one of `PREFERENCE_FORMATS`),
    message layouts rendered with `tmpl` (`DataError` when its assistant turn does not
    start with its generation prompt: the conversations could not be split)."""
    if fmt in ("messages", "sharegpt") and not tmpl.assistant.format(
        content="x", role="assistant"
    ).startswith(tmpl.generation_prompt):
        raise DataError(
            "the chat template's assistant turn does not start with its generation "
            "prompt, so conversations cannot be split into prompt and completion"
        )
    parse = {
        "hh": _parse_hh,
        "plain": _parse_plain,
        "messages": lambda r: _parse_messages(r, tmpl),
        "sharegpt": lambda r: _parse_sharegpt(r, tmpl),
    }[fmt]
    return _with_margin(parse)


def load_preferences(
    path: str | os.PathLike,
    format: str = "auto",
    *,
    lenient: bool = False,
    template: str | ChatTemplate = "hh",
    columns: Mapping[str, str] | None = None,
    split: str | None = None,
) -> PreferenceDataset:
    """Read a preference dataset.

    **Arguments:**

    - `path`: a `.jsonl` file (one JSON object a line), a `.json` file (a list of
      objects) or either gzipped (`.gz`); or a `.parquet` / `.arrow` file or a directory
      written by `datasets`' `save_to_disk`, whose rows are read as the same records
      (`dataset_files`).
    - `format`: `"auto"` (from the keys of the first record), `"hh"`, `"messages"`,
      `"sharegpt"` or `"plain"` (see the module docstring).
    - `lenient`: skip malformed lines/records (invalid JSON or UTF-8, missing keys,
      wrong types) and count them in the report instead of raising `DataError`.
    - `template`: chat template for message formats (`"hh"`, `"chatml"` or a
      `ChatTemplate`).
    - `columns`: `{field: column}` for a file whose columns have other names, e.g.
      `{"chosen": "response_a", "rejected": "response_b"}` (fields: `COLUMN_NAMES`).
    - `split`: the split of a `DatasetDict` directory (or give the path as `DIR:SPLIT`).

    **Returns:** a `PreferenceDataset` of `PreferenceRecord(prompt, chosen, rejected)`,
    each with its `margin` when the file has a `margin` column (see the module
    docstring); `dataset.report` counts what was read, kept and skipped (with reasons).

    **Raises:** `DataError` (a `ValueError`) naming the file and line (a table's row and
    column) for malformed input when not `lenient` (a `margin` that is not a finite
    number among it), for an unknown format, and for a file where some pairs have a
    `margin` and others not (even when `lenient`).
    """
    tmpl = resolve_template(template)
    records, report = load_records(
        path,
        format,
        kind="preference",
        formats=PREFERENCE_FORMATS,
        detect=detect_preference_format,
        expected="'chosen'/'rejected' (HH transcripts or message lists), "
        "'prompt'/'chosen'/'rejected', or 'conversations'/'chosen'/'rejected'",
        make_parser=lambda fmt: _preference_parser(fmt, tmpl),
        lenient=lenient,
        columns=columns,
        split=split,
    )
    _check_margins(records, report.locations)
    return PreferenceDataset(records, report, report.locations)
