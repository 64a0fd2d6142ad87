"""Stepwise supervision for process reward models: records, tokenising, collating.

`load_stepwise` reads TRL's stepwise-supervision layout, one solution per record:

```json
{"prompt": "What is 2+3*4?", "completions": ["3*4 = 12", "2+12 = 15"], "labels": [true, false]}
```

`completions` are the reasoning steps, in order, and `labels[s]` says whether step `s`
is correct (a JSON boolean; `0` and `1` are accepted). A record whose `completions` is
not a list of strings, whose `labels` is not a list of booleans, or whose lists differ
in length, or whose `prompt` is a list of messages (the conversational layout, not read
here), is an error naming the file and line (`path:LINE: reason`); a record without
steps, or with an empty (or blank) step, is skipped and counted in the report (`"no
steps"`, `"empty step"`), as the other readers skip an empty completion.

`tokenize_stepwise` joins the steps with a separator, `BOS prompt step_1 SEP step_2 SEP
...` (BOS when the tokenizer asks for it, `wants_bos`), and marks the last token of each
separator: the position whose output the PRM learns to read (each step is tokenised on
its own, as is the separator). `collate_stepwise` right-pads solutions into the
`PRMBatch` of `rlhf_eqx.train.make_prm_step`:

```
tokens       [BOS p p p | s s SEP | s s s SEP | pad]
step_mask    [ 0  0 0 0 | 0 0  1  | 0 0 0  1  |  0 ]
step_labels  [ 0  0 0 0 | 0 0  1  | 0 0 0  0  |  0 ]
```
"""

import dataclasses
import os
from collections.abc import Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from ._batches import PRMBatch
from ._collate import _pad_rows, row_length
from ._errors import DataError
from ._io import (
    Malformed,
    RecordDataset,
    Unusable,
    boolean_value,
    load_records,
    record_field,
    string_field,
)
from ._tokenize import _cut_prompt, wants_bos
from ._tokenized import SequenceLengths, TokenizeReport, resolve_lengths
from ._tokenizer import Tokenizer

STEPWISE_FORMATS = ("stepwise",)


@dataclasses.dataclass(frozen=True)
class StepwiseRecord:
    """A prompt, its solution's steps in order, and whether each step is correct."""

    prompt: str
    completions: tuple[str, ...]
    labels: tuple[bool, ...]


class StepwiseDataset(RecordDataset["StepwiseRecord"]):
    """An immutable sequence of `StepwiseRecord`s with the `LoadReport` of its file."""

    noun = "solutions"


def _parse(record: dict) -> StepwiseRecord:
    if isinstance(record.get("prompt"), list):
        raise Malformed(
            "wrong type",
            "'prompt' must be a string, got a list (stepwise records are read in the "
            "standard layout only: render a conversational prompt to text first)",
        )
    prompt = string_field(record, "prompt")
    for key in ("completions", "labels"):
        if not isinstance(record_field(record, key), list):
            raise Malformed(
                "wrong type", f"{key!r} must be a list, got {type(record[key]).__name__}"
            )
    steps, labels = record["completions"], record["labels"]
    for s, step in enumerate(steps):
        if not isinstance(step, str):
            raise Malformed(
                "wrong type", f"'completions'[{s}] must be a string, got {type(step).__name__}"
            )
    if len(steps) != len(labels):
        raise Malformed(
            "length mismatch",
            f"{len(steps)} completions (steps) but {len(labels)} labels; give one label per step",
        )
    if not steps:
        raise Unusable("no steps")
    labelled = tuple(boolean_value(v, f"'labels'[{s}]") for s, v in enumerate(labels))
    if not all(step.strip() for step in steps):  # as an empty completion is
        raise Unusable("empty step")
    return StepwiseRecord(
        prompt,
        tuple(steps),
        labelled,
    )


def load_stepwise(
    path: str | os.PathLike,
    *,
    lenient: bool = False,
    columns: Mapping[str, str] | None = None,
    split: str | None = None,
) -> StepwiseDataset:
    """Read stepwise-supervision records (`.jsonl`, `.json` list, or gzipped; or a
    `.parquet` / `.arrow` file or a `datasets` `save_to_disk` directory,
    `dataset_files`).

    **Arguments:** `path`; `lenient`: skip malformed records (counted in
    `dataset.report`) instead of raising `DataError`; `columns`: `{field: column}` for
    a file whose columns have other names (e.g. `{"completions": "steps"}`); `split`: the
    split of a `DatasetDict` directory (or give the path as `DIR:SPLIT`).

    **Returns:** a `StepwiseDataset` of `StepwiseRecord(prompt, completions, labels)`
    (see the module docstring for the layout and what is refused).
    """
    records, report = load_records(
        path,
        "auto",
        kind="stepwise",
        formats=STEPWISE_FORMATS,
        detect=lambda r: "stepwise" if "completions" in r or "labels" in r else None,
        expected="'prompt', 'completions' (a list of steps) and 'labels' (a list of booleans)",
        make_parser=lambda fmt: _parse,
        lenient=lenient,
        columns=columns,
        split=split,
    )
    return StepwiseDataset(records, report, report.locations)


@dataclasses.dataclass(frozen=True)
class TokenizedSteps:
    """A tokenised solution: `tokens` (BOS, prompt, then each step followed by the
    separator), `step_ends` (the index in `tokens` of each kept step's last separator
    token), the kept steps' `labels`, and `prompt_length` (BOS included)."""

    tokens: tuple[int, ...]
    step_ends: tuple[int, ...]
    labels: tuple[bool, ...]
    prompt_length: int

    def __len__(self) -> int:
        return len(self.tokens)


def separator_ids(tokenizer: Tokenizer, separator: str) -> list[int]:
    """The ids of `separator` (`tokenizer.encode`); a `DataError` when it encodes to none."""
    ids = list(tokenizer.encode(separator))
    if not ids:
        raise DataError(f"the step separator {separator!r} encodes to no token")
    return ids


def separator_id(tokenizer: Tokenizer, separator: str = "\n") -> int:
    """The id at which a PRM trained by this module reads a step: the separator's last id
    (for `rlhf_eqx.train.step_end_mask` on sampled completions)."""
    return separator_ids(tokenizer, separator)[-1]


def tokenize_stepwise(
    records: Sequence[StepwiseRecord],
    tokenizer: Tokenizer,
    *,
    separator: str = "\n",
    lengths: SequenceLengths | None = None,
    max_length: int | None = None,
    max_prompt_length: int | None = None,
    last_step_only: bool = False,
    add_bos: bool | None = None,
) -> tuple[list[TokenizedSteps], TokenizeReport]:
    """Tokenise solutions: `BOS prompt step_1 SEP step_2 SEP ...` with the step ends marked.

    **Truncation.** A prompt longer than `max_prompt_length` keeps its end (BOS stays
    first); then whole steps are kept, in order, while they fit in `max_length` (and
    `max_completion_length`): a step is never cut, the steps after the first that does
    not fit are dropped with their labels (`completion_truncated` in the report), and a
    solution none of whose steps fits is dropped (`"too long"`).

    **Arguments:**

    - `records`: `StepwiseRecord`s (e.g. from `load_stepwise`).
    - `tokenizer`: any `Tokenizer`.
    - `separator`: the text that ends every step (TRL's default `"\\n"`).
    - `lengths`, `max_length`, `max_prompt_length`: the limits (`SequenceLengths`;
      the numbers given here replace its own).
    - `last_step_only`: mark (and label) only the last kept step.
    - `add_bos`: start with `tokenizer.bos_id` (`None`: as the tokenizer asks,
      `wants_bos`; SmolLM2's prompts get none, their chat template writes it).

    **Returns:** `(solutions, report)`.
    """
    lengths = resolve_lengths(lengths, max_length, max_prompt_length)
    add_bos = wants_bos(tokenizer, add_bos)
    sep = separator_ids(tokenizer, separator)
    report = TokenizeReport(lengths=lengths, truncation="keep_end")
    out = []
    for n, record in enumerate(records):
        report.total += 1
        prompt = getattr(record, "prompt", None)
        steps = getattr(record, "completions", None)
        labels = getattr(record, "labels", None)
        if not isinstance(prompt, str) or steps is None or labels is None:
            raise DataError(
                f"record {n}: stepwise records need .prompt (str), .completions and .labels, "
                f"got {type(record).__name__}"
            )
        if len(steps) != len(labels):
            raise DataError(f"record {n}: {len(steps)} steps but {len(labels)} labels")
        ids = ([tokenizer.bos_id] if add_bos else []) + list(tokenizer.encode(prompt))
        cut = _cut_prompt(ids, lengths.max_prompt_length, truncation="keep_end", add_bos=add_bos)
        if cut is not None:
            ids = cut
            report.note_cut(prompt=True)
        room = lengths.completion_room(len(ids))
        tokens, ends, kept = list(ids), [], []
        for step, label in zip(steps, labels):
            piece = list(tokenizer.encode(step)) + sep
            if len(tokens) + len(piece) - len(ids) > room:
                break
            tokens += piece
            ends.append(len(tokens) - 1)
            kept.append(bool(label))
        if not kept:
            report.drop("too long")
            continue
        if len(kept) < len(steps):
            report.note_cut(completion=True)
        if last_step_only:
            ends, kept = ends[-1:], kept[-1:]
        report.kept += 1
        out.append(TokenizedSteps(tuple(tokens), tuple(ends), tuple(kept), len(ids)))
    return out, report


def collate_stepwise(
    solutions: Sequence[TokenizedSteps],
    *,
    pad_id: int,
    max_length: int | None = None,
    lengths: SequenceLengths | None = None,
    bucket_size: int | None = None,
    vocab_size: int | None = None,
) -> PRMBatch:
    """Right-pad tokenised solutions into a `PRMBatch` of shape `[len(solutions), T]`.

    `step_mask` is true at each step end, `step_labels` 1.0 / 0.0 there (0 elsewhere).
    `max_length`, `lengths`, `bucket_size`, `vocab_size` and `pad_id` as for
    `collate_sft` (`T = max_length` unless `bucket_size` is given).
    """
    if not solutions:
        raise DataError("cannot collate an empty batch")
    longest = max(len(s) for s in solutions)
    T = row_length(longest, max_length=max_length, lengths=lengths, bucket_size=bucket_size)
    tokens, mask = _pad_rows(
        [s.tokens for s in solutions], T, pad_id=pad_id, vocab_size=vocab_size, what="solution"
    )
    step_mask = np.zeros(mask.shape, dtype=bool)
    labels = np.zeros(mask.shape, dtype=np.float32)
    for i, s in enumerate(solutions):
        ends = np.asarray(s.step_ends, dtype=np.int64)
        step_mask[i, ends] = True
        labels[i, ends] = np.asarray(s.labels, dtype=np.float32)
    return PRMBatch(
        tokens=jnp.asarray(tokens),
        mask=jnp.asarray(mask),
        step_mask=jnp.asarray(step_mask),
        step_labels=jnp.asarray(labels),
    )
