"""Unpaired (binary-feedback) data for KTO: one completion per record, labelled desirable
or undesirable.

`load_unpaired` reads two layouts (auto-detected from the first record; both have the
keys `prompt`, `completion` and `label`):

- `"plain"` — `{"prompt": str, "completion": str, "label": bool}`, used as given;
- `"messages"` — TRL's conversational layout: `prompt` a list of `{"role", "content"}`
  messages (or a string, one user turn) and `completion` a list of messages starting
  with an assistant turn, rendered with a chat template (`format_chat`) so that
  `prompt + completion` is the rendered conversation. A prompt that ends with an
  assistant message (a prefill) is continued by the completion's first message
  (`join_reply`); one that ends with a system message is refused.

`label` must be a JSON boolean; `0` and `1` are accepted as false and true, anything
else (a string such as `"true"`, another number) is an error naming the file and line.
Records with an empty (or blank) completion (`""`, or `[]` and messages without text)
are skipped and counted in the report.

`unpaired_from_preferences` turns preference pairs into unpaired records (TRL's
`unpair_preference_dataset`); `tokenize_unpaired` and `collate_unpaired` make the
fixed-shape `KTOBatch` of the KTO step, with the mismatched prompt/completion rows that
estimate KTO's reference point (TRL's KL dataset).
"""

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from ._batches import KTOBatch
from ._chat import (
    ChatTemplate,
    format_chat,
    message_list,
    prompt_messages,
    resolve_template,
    said,
    split_conversation,
)
from ._collate import _right_padded, row_length
from ._errors import DataError
from ._io import (
    Malformed,
    RecordDataset,
    Unusable,
    boolean_field,
    load_records,
    string_field,
)
from ._preferences import _preference_texts
from ._tokenize import _check_truncation, _tokenize
from ._tokenized import SequenceLengths, TokenizedSequence, TokenizeReport, resolve_lengths
from ._tokenizer import Tokenizer

UNPAIRED_FORMATS = ("plain", "messages")


@dataclasses.dataclass(frozen=True)
class UnpairedRecord:
    """One completion of a prompt with binary feedback: `label` is true when
    `prompt + completion` is desirable, false when it is undesirable.

    `messages`: a conversational record's messages as read, `{"prompt": (message, ...),
    "completion": (...)}`, which a model's chat template renders itself; `None` for
    text records. Not compared."""

    prompt: str
    completion: str
    label: bool
    messages: Mapping[str, tuple[Mapping[str, Any], ...]] | None = dataclasses.field(
        default=None, compare=False, repr=False
    )


class UnpairedDataset(RecordDataset["UnpairedRecord"]):
    """An immutable sequence of `UnpairedRecord`s with the `LoadReport` of its file."""

    noun = "records"


def _checked(prompt: str, completion: str, label: bool) -> UnpairedRecord:
    if not completion.strip():
        raise Unusable("empty completion")
    return UnpairedRecord(prompt, completion, label)


def _parse_plain(record: dict) -> UnpairedRecord:
    return _checked(
        string_field(record, "prompt"),
        string_field(record, "completion"),
        boolean_field(record, "label"),
    )


def _message_list(record: dict, key: str) -> list[dict[str, str]]:
    """`message_list`, with a string prompt read as one user message (a prompt's list
    checked for its end: `prompt_messages`)."""
    if key == "prompt" and isinstance(record.get(key), str):
        return [{"role": "user", "content": record[key]}]
    messages = message_list(record, key)
    return prompt_messages(messages, key) if key == "prompt" else messages


def _conversation_texts(record: dict, render: Callable[..., str]) -> tuple[str, str]:
    """`(prompt, completion)` of a record of TRL's conversational prompt-completion layout
    (`prompt` messages or a string, `completion` messages starting with an assistant turn),
    rendered by `render` as `split_conversation` renders."""
    prompt_messages = _message_list(record, "prompt")
    completion_messages = _message_list(record, "completion")
    if not completion_messages:
        raise Unusable("empty completion")
    if completion_messages[0]["role"] != "assistant":
        raise Malformed("wrong type", "'completion' must start with an assistant message")
    if not any(said(m) for m in completion_messages):
        raise Unusable("empty completion")
    return split_conversation(prompt_messages, completion_messages, render)


def _parse_messages(record: dict, template: ChatTemplate) -> UnpairedRecord:
    label = boolean_field(record, "label")
    render = functools.partial(format_chat, template=template)
    checked = _checked(*_conversation_texts(record, render), label)
    messages = {key: tuple(_message_list(record, key)) for key in ("prompt", "completion")}
    return dataclasses.replace(checked, messages=messages)


def detect_unpaired_format(record: dict) -> str | None:
    """The unpaired format of a record from its keys (`None` when unknown)."""
    if not {"prompt", "completion", "label"} <= set(record):
        return None
    return "messages" if isinstance(record["completion"], list) else "plain"


# Same keywords as `load_preferences` (both read through `load_records`).
def load_unpaired(
    path: str | os.PathLike,
    format: str = "auto",
    *,
    lenient: bool = False,
    template: str | ChatTemplate = "hh",
    columns: Mapping[str, str] | None = None,
    split: str | None = None,
) -> UnpairedDataset:
    """Read an unpaired (KTO) dataset of `prompt`, `completion`, `label` records.

    **Arguments:**

    - `path`: the file or `datasets` directory, read as by `load_preferences`.
    - `format`: `"auto"` (from the first record), `"plain"` or `"messages"` (see the
      module docstring).
    - `lenient`: skip malformed lines/records (invalid JSON, missing keys, wrong types,
      a label that is not a boolean) and count them in the report instead of raising.
    - `template`: chat template for `"messages"` (`"hh"`, `"chatml"` or a
      `ChatTemplate`).
    - `columns`: `{field: column}` for a file whose columns have other names, e.g.
      `{"completion": "response", "label": "thumbs_up"}` (fields: `COLUMN_NAMES`).
    - `split`: the split of a `DatasetDict` directory (or give the path as `DIR:SPLIT`).

    **Returns:** an `UnpairedDataset` of `UnpairedRecord(prompt, completion, label)`;
    `dataset.report` counts what was read, kept and skipped (with reasons).

    **Raises:** `DataError` (a `ValueError`) naming the file and line (`path:LINE: ...`)
    for malformed input when not `lenient`, and for an unknown format.
    """
    tmpl = resolve_template(template)
    records, report = load_records(
        path,
        format,
        kind="unpaired",
        formats=UNPAIRED_FORMATS,
        detect=detect_unpaired_format,
        expected="'prompt', 'completion' and 'label'",
        make_parser=lambda fmt: (
            _parse_plain if fmt == "plain" else (lambda r: _parse_messages(r, tmpl))
        ),
        lenient=lenient,
        columns=columns,
        split=split,
    )
    return UnpairedDataset(records, report, report.locations)


def unpaired_from_preferences(records: Sequence) -> list[UnpairedRecord]:
    """Unpair preference records (`.prompt`, `.chosen`, `.rejected`): each pair gives a
    desirable record `(prompt, chosen, True)` and an undesirable one
    `(prompt, rejected, False)` (TRL `unpair_preference_dataset`).

    As TRL orders them, the desirable records of every pair come first, then the
    undesirable ones, each in the order of `records`; shuffle before batching (e.g.
    `BatchIterator`), so that batches mix both labels and a prompt's two completions
    rarely sit next to each other (neighbours form the mismatched rows of
    `collate_unpaired`).
    """
    texts = _preference_texts(records)
    return [UnpairedRecord(prompt, chosen, True) for prompt, chosen, _ in texts] + [
        UnpairedRecord(prompt, rejected, False) for prompt, _, rejected in texts
    ]


@dataclasses.dataclass(frozen=True)
class TokenizedUnpaired:
    """A tokenised unpaired record: its prompt and completion ids and its label."""

    sequence: TokenizedSequence
    label: bool


def _unpaired_fields(record: object) -> tuple[str, str, bool]:
    prompt = getattr(record, "prompt", None)
    completion = getattr(record, "completion", None)
    label = getattr(record, "label", None)
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise DataError(
            f"unpaired records need string .prompt and .completion, got {type(record).__name__}"
        )
    if not isinstance(label, bool | np.bool_):
        raise DataError(
            f"unpaired records need a boolean .label, got {type(label).__name__} {label!r}"
        )
    return prompt, completion, bool(label)


# Same keywords as `tokenize_preferences` / `tokenize_sft` (one tokenising loop, `_tokenize`).
def tokenize_unpaired(
    records: Sequence,
    tokenizer: Tokenizer,
    *,
    lengths: SequenceLengths | None = None,
    max_length: int | None = None,
    max_prompt_length: int | None = None,
    max_completion_length: int | None = None,
    truncation: str = "keep_end",
    add_bos: bool | None = None,
    add_eos: bool | str = True,
) -> tuple[list[TokenizedUnpaired], TokenizeReport]:
    """Tokenise unpaired records (`.prompt`, `.completion`, `.label`).

    Prompt and completion ids, truncation and the report are those of
    `tokenize_preferences` (the completion's ids come from the full text; see
    `rlhf_eqx.data`'s tokenising notes). Arguments as in `tokenize_preferences`.

    **Returns:** `(examples, report)`: a `TokenizedUnpaired` for each kept record, in
    order, and the `TokenizeReport`.
    """
    lengths = resolve_lengths(lengths, max_length, max_prompt_length, max_completion_length)
    _check_truncation(truncation)
    fields = [_unpaired_fields(record) for record in records]
    return _tokenize(
        [(prompt, [completion]) for prompt, completion, _ in fields],
        tokenizer,
        lengths=lengths,
        truncation=truncation,
        add_bos=add_bos,
        add_eos=add_eos,
        build=lambda i, seqs: TokenizedUnpaired(seqs[0], fields[i][2]),
    )


def _other_prompt_sources(prompts: Sequence[tuple[int, ...]]) -> list[int]:
    """For each example `i`, the example whose completion its mismatched row takes: `i - 1`
    (cyclically, TRL's shift) when that one has another prompt, else the nearest earlier
    example (cyclically) with another prompt, i.e. the last one before the run of equal
    prompts that holds `i`; `i - 1` when every prompt is the same.

    Several completions of one prompt often sit next to each other (a prompt's samples,
    a file grouped by prompt); shifted by one, they would pair a prompt with its own
    completions, and $z_0$ would estimate the matched log-ratio instead of the KL."""
    n = len(prompts)
    start = [0] * n  # the first index of the run of equal prompts ending at i
    for i in range(1, n):
        start[i] = start[i - 1] if prompts[i] == prompts[i - 1] else i
    out = []
    for i in range(n):
        j = start[i] - 1
        if j < 0:  # the run reaches the front: continue from the end
            j = n - 1
            if prompts[j] == prompts[i]:
                j = start[j] - 1
        out.append(j if j >= 0 and prompts[j] != prompts[i] else (i - 1) % n)
    return out


def _mismatched_sequences(seqs: Sequence[TokenizedSequence], limit: int) -> list[TokenizedSequence]:
    """The mismatched rows of KTO's reference point: prompt `i` followed by the completion
    of example `i - 1` (cyclically; TRL's KL dataset), or, when example `i - 1` has the
    same prompt, of the nearest earlier example with another prompt
    (`_other_prompt_sources`), cut to at most `limit` tokens.

    With the same `limit` as the rows, a mismatched row fits whenever the rows do; its
    completion is cut at the end (like `truncation="keep_end"`) when the other example's
    completion does not fit after this prompt.
    """
    if len(seqs) < 2:
        raise DataError(
            f"the mismatched rows need at least two examples, got {len(seqs)} (with one, the "
            "mismatched row is the example itself and the reference point is its own reward)"
        )
    sources = _other_prompt_sources([tuple(s.prompt) for s in seqs])
    out = []
    for i, s in enumerate(seqs):
        room = limit - len(s.prompt)
        if room < 1:
            raise DataError(
                f"row {i} has a prompt of {len(s.prompt)} tokens, leaving no room for a "
                f"completion within max_length={limit}"
            )
        out.append(TokenizedSequence(s.prompt, seqs[sources[i]].completion[:room]))
    return out


def collate_unpaired(
    examples: Sequence[TokenizedUnpaired],
    *,
    pad_id: int,
    max_length: int | None = None,
    lengths: SequenceLengths | None = None,
    bucket_size: int | None = None,
    vocab_size: int | None = None,
    kl: bool = True,
) -> KTOBatch:
    """Right-pad tokenised unpaired examples into a `KTOBatch` of shape `[len(examples), T]`.

    Rows are laid out as in `collate_sft` (prompt, completion with its EOS, padding;
    `completion_mask` on the completion). With `kl=True` (needed by
    `make_kto_step(loss_type="kto")`) the batch also holds the mismatched rows that
    estimate KTO's reference point: prompt `i` followed by the completion of example
    `i - 1` (cyclically), as TRL's KL dataset shifts the completions of each batch by
    one, or, when example `i - 1` has the same prompt (a prompt's completions next to
    each other), of the nearest earlier example with another prompt; they share the row
    length `T`. `label` is the examples' labels (bool).

    **Arguments:**

    - `examples`: from `tokenize_unpaired` (at least one; at least two with `kl=True`).
    - `pad_id`, `max_length`, `lengths`, `bucket_size`, `vocab_size`: as in
      `collate_preferences`.
    - `kl`: build the mismatched rows (`False`: for `loss_type="apo_zero_unpaired"`).

    **Returns:** the `KTOBatch` (with no cached reference log-probabilities).
    """
    if not examples:
        raise DataError("cannot collate an empty batch")
    for i, e in enumerate(examples):
        if not isinstance(e, TokenizedUnpaired):
            raise DataError(
                f"example {i} is a {type(e).__name__}; expected a TokenizedUnpaired "
                "(from tokenize_unpaired)"
            )
    seqs = [e.sequence for e in examples]
    groups = [seqs]
    if kl:
        limit = row_length(1, max_length=max_length, lengths=lengths)
        groups.append(_mismatched_sequences(seqs, limit))
    padded = _right_padded(
        groups,
        max_length=max_length,
        lengths=lengths,
        bucket_size=bucket_size,
        pad_id=pad_id,
        vocab_size=vocab_size,
    )
    (tokens, mask, completion_mask) = padded[0]
    label = jnp.asarray(np.array([bool(e.label) for e in examples], dtype=bool))
    fields = {}
    if kl:
        kl_tokens, kl_mask, kl_completion_mask = padded[1]
        fields = dict(
            kl_tokens=jnp.asarray(kl_tokens),
            kl_mask=jnp.asarray(kl_mask),
            kl_completion_mask=jnp.asarray(kl_completion_mask),
        )
    return KTOBatch(
        tokens=jnp.asarray(tokens),
        mask=jnp.asarray(mask),
        completion_mask=jnp.asarray(completion_mask),
        label=label,
        **fields,
    )
