"""Tokenising records into prompt and completion ids, within stated lengths.

The limits are a `SequenceLengths` (TRL's defaults); what a pass kept, cut and dropped
is a `TokenizeReport`.

**Prompt and completion ids.** The completion's ids are those of the *full* text
`prompt + completion` after the prompt's ids, so a pair tokenises exactly as the
concatenated text does (no spurious dummy-prefix space at the start of a completion).
When the tokenizer merges characters across the boundary (the full text's ids do not
start with the prompt's), the split moves left to where the two agree, and the merged
token counts as completion — the rule of TRL's `DPOTrainer.build_tokenized_answer`;
such pairs are counted in the report (`boundary_merged`).

**Truncation** (`truncation="keep_end"`): a prompt longer than `max_prompt_length`
keeps its end (truncated from the left; BOS, when added, stays first); then a
completion longer than `max_completion_length` or than the room `max_length` leaves is
cut at the end (its start is kept; its EOS is lost, so the model is not taught to stop
there). `truncation="drop"` drops the record instead of truncating anything. Both are
counted in the `TokenizeReport`, whose `summary()` states the policy and the rates in a
line a run log can print.
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import TypeVar

from ._errors import DataError
from ._io import common_prefix_length
from ._preferences import _preference_margins, _preference_texts
from ._tokenized import (
    SequenceLengths,
    TokenizedPair,
    TokenizedSequence,
    TokenizeReport,
    resolve_lengths,
)
from ._tokenizer import Tokenizer

_TRUNCATIONS = ("keep_end", "drop")
_EOS_MODES = (True, False, "auto")
T = TypeVar("T")


def ends_turn(tokenizer: Tokenizer, ids: Sequence[int]) -> bool:
    """Whether the completion `ids` already end their turn: their last id, past any
    trailing ids that decode to whitespace alone (ChatML writes `"<|im_end|>\\n"`), is
    the tokenizer's EOS or one of its `stop_ids` (an end-of-turn id such as Llama 3's
    `<|eot_id|>`)."""
    stops = {tokenizer.eos_id, *(getattr(tokenizer, "stop_ids", None) or ())}
    k = len(ids)
    while k and ids[k - 1] not in stops and not tokenizer.decode([ids[k - 1]]).strip():
        k -= 1
    return k > 0 and ids[k - 1] in stops


def _check_add_eos(add_eos: object) -> None:
    if not any(add_eos is m or (isinstance(m, str) and add_eos == m) for m in _EOS_MODES):
        raise DataError(f"add_eos must be True, False or 'auto', got {add_eos!r}")


def wants_bos(tokenizer: Tokenizer, add_bos: bool | None = None) -> bool:
    """Whether a prompt starts with BOS: `add_bos` when given, else as the tokenizer
    asks (its `add_bos_token`, true for a tokenizer without one: llama2.c and
    SentencePiece models). SmolLM2's tokenizer says false: its BOS id is
    `<|im_start|>`, which its chat template writes itself."""
    if add_bos is not None:
        return bool(add_bos)
    return bool(getattr(tokenizer, "add_bos_token", True))


class _Drop(Exception):
    pass


def _check_truncation(truncation: str) -> None:
    if truncation not in _TRUNCATIONS:
        raise DataError(f"truncation must be one of {_TRUNCATIONS}, got {truncation!r}")


def _cut_prompt(ids: list[int], limit: int, *, truncation: str, add_bos: bool) -> list[int] | None:
    """`ids` cut to `limit` keeping the end (BOS kept first); `None` when it fits;
    `_Drop` under `truncation="drop"`."""
    if len(ids) <= limit:
        return None
    if truncation == "drop":
        raise _Drop("too long")
    head = ids[:1] if add_bos else []
    return head + ids[len(ids) - (limit - len(head)) :]


def _split_ids(
    tokenizer: Tokenizer, prompt: str, completion: str, prompt_ids: list[int]
) -> tuple[list[int], list[int], bool]:
    """`(prompt ids, completion ids, merged across the boundary)` from the full text."""
    full = tokenizer.encode(prompt + completion)
    n = len(prompt_ids)
    if full[:n] == prompt_ids:
        return prompt_ids, full[n:], False
    k = common_prefix_length(full, prompt_ids)
    return full[:k], full[k:], True


def _fit(
    prompt: list[int],
    completion: list[int],
    *,
    lengths: SequenceLengths,
    truncation: str,
    add_bos: bool,
    flags: list[bool],
) -> TokenizedSequence:
    """Truncate one sequence; `flags` collects `[prompt_truncated, completion_truncated]`."""
    cut = _cut_prompt(prompt, lengths.max_prompt_length, truncation=truncation, add_bos=add_bos)
    if cut is not None:
        prompt = cut
        flags[0] = True
    room = lengths.completion_room(len(prompt))
    if len(completion) > room:
        if truncation == "drop":
            raise _Drop("too long")
        completion = completion[:room]
        flags[1] = True
    if not completion:
        raise _Drop("empty completion")
    return TokenizedSequence(tuple(prompt), tuple(completion))


def _prompt_and_completions(record: object) -> tuple[str, list[str]]:
    if isinstance(record, tuple) and len(record) == 2:
        return record[0], [record[1]]
    prompt = getattr(record, "prompt", None)
    completion = getattr(record, "completion", None)
    if completion is None:
        completion = getattr(record, "chosen", None)
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise DataError(
            "SFT records must be (prompt, completion) tuples or have string .prompt and "
            f".completion (or .chosen) attributes, got {type(record).__name__}"
        )
    return prompt, [completion]


def _tokenize(
    items: Sequence[tuple[str, list[str]]],
    tokenizer: Tokenizer,
    *,
    lengths: SequenceLengths,
    truncation: str,
    add_bos: bool | None,
    add_eos: bool | str,
    build: Callable[[int, list[TokenizedSequence]], T],
) -> tuple[list[T], TokenizeReport]:
    """`build(index in items, fitted sequences)` of each kept item, and the report
    (`build` may drop the item by raising `_Drop` with the reason)."""
    _check_truncation(truncation)
    _check_add_eos(add_eos)
    report = TokenizeReport(lengths=lengths, truncation=truncation, eos=bool(add_eos))
    out = []
    add_bos = wants_bos(tokenizer, add_bos)
    bos = [tokenizer.bos_id] if add_bos else []
    eos = [tokenizer.eos_id] if add_eos else []
    auto = add_eos == "auto"
    for i, (prompt, completions) in enumerate(items):
        report.total += 1
        prompt_ids = tokenizer.encode(prompt)
        flags = [False, False]
        merged = False
        try:
            seqs = []
            for completion in completions:
                p, c, m = _split_ids(tokenizer, prompt, completion, prompt_ids)
                merged |= m
                end = [] if auto and ends_turn(tokenizer, c) else eos
                seqs.append(
                    _fit(
                        bos + p,
                        c + end,
                        lengths=lengths,
                        truncation=truncation,
                        add_bos=add_bos,
                        flags=flags,
                    )
                )
            built = build(i, seqs)
        except _Drop as e:
            report.drop(str(e))
            continue
        report.kept += 1
        report.note_cut(prompt=flags[0], completion=flags[1])
        report.boundary_merged += merged
        out.append(built)
    return out, report


def tokenize_preferences(
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
) -> tuple[list[TokenizedPair], TokenizeReport]:
    """Tokenise preference records (`.prompt`, `.chosen`, `.rejected`) into pairs.

    **Arguments:**

    - `records`: e.g. a `PreferenceDataset`.
    - `tokenizer`: any `Tokenizer`.
    - `lengths`: the `SequenceLengths` (default: TRL's, `SequenceLengths()`).
    - `max_length`, `max_prompt_length`, `max_completion_length`: replace the field of
      that name in `lengths`.
    - `truncation`: `"keep_end"` (truncate; see the module docstring) or `"drop"`.
    - `add_bos` / `add_eos`: start prompts with BOS / end completions with EOS
      (`add_bos=None`: as the tokenizer asks, `wants_bos`; `add_eos="auto"`: EOS after
      each completion that does not end its turn already, `ends_turn`, e.g. one a chat
      template closed with its end-of-turn token, so that every completion ends
      exactly once).

    **Returns:** `(pairs, report)`: a `TokenizedPair` for each kept record (with the
    record's `margin`, when it has one), and a `TokenizeReport` counting truncated,
    dropped and boundary-merged records.
    """
    records = list(records)
    texts = _preference_texts(records)
    margins = _preference_margins(records)
    return _tokenize(
        [(prompt, [chosen, rejected]) for prompt, chosen, rejected in texts],
        tokenizer,
        lengths=resolve_lengths(lengths, max_length, max_prompt_length, max_completion_length),
        truncation=truncation,
        add_bos=add_bos,
        add_eos=add_eos,
        build=lambda i, seqs: TokenizedPair(*seqs, margin=margins[i]),
    )


def tokenize_sft(
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
) -> tuple[list[TokenizedSequence], TokenizeReport]:
    """Tokenise `(prompt, completion)` records for supervised fine-tuning.

    Records are `(prompt, completion)` tuples, or objects with `.prompt` and
    `.completion` — or `.prompt` and `.chosen`, so a `PreferenceDataset` gives SFT on
    the chosen replies. Arguments and truncation as in `tokenize_preferences`.

    A record with `spans` (a `DemonstrationRecord` of a conversation trained on every
    assistant turn) gives a sequence with a `completion_mask`: a completion token is
    trained when it holds a character of a span (a token merged across a span's start
    or end counts as trained, the rule of the prompt/completion boundary), and the EOS
    when added. The mask of a span is that of the conversation's prefix through it: the
    tokens of the text up to the span's start and up to its end are taken as the whole
    text's first tokens. Truncation cuts the completion's end as for any record; a
    record left with no trained token is dropped (`report.dropped["no trained token"]`).
    """
    records = list(records)
    items = [_prompt_and_completions(r) for r in records]
    spans = [getattr(r, "spans", None) for r in records]

    def build(i: int, seqs: list[TokenizedSequence]) -> TokenizedSequence:
        (s,) = seqs
        if spans[i] is None:
            return s
        prompt, (completion,) = items[i]
        flags = _trained_tokens(tokenizer, prompt, completion, spans[i], len(s.completion))
        flags = (flags + [True] * bool(add_eos))[: len(s.completion)]
        if not any(flags):
            raise _Drop("no trained token")
        return TokenizedSequence(s.prompt, s.completion, tuple(flags))

    return _tokenize(
        items,
        tokenizer,
        lengths=resolve_lengths(lengths, max_length, max_prompt_length, max_completion_length),
        truncation=truncation,
        add_bos=add_bos,
        add_eos=add_eos,
        build=build,
    )


def _trained_tokens(
    tokenizer: Tokenizer, prompt: str, completion: str, spans: Sequence[tuple[int, int]], kept: int
) -> list[bool]:
    """One flag per completion token (as `_split_ids` splits `prompt + completion`): true
    for a token that holds a character of one of `spans` (character ranges of
    `completion`). Only the first `kept` tokens are flagged (the rest is cut): the spans
    that start past them are not looked at, so a long conversation cut to a short
    sequence costs the encoding of its kept turns."""
    text = prompt + completion
    full = tokenizer.encode(text)
    _, ids, _ = _split_ids(tokenizer, prompt, completion, tokenizer.encode(prompt))
    offset = len(full) - len(ids)
    flags = [False] * len(ids)

    def first_tokens(end: int) -> tuple[int, bool]:
        """How many of `full` the text up to `end` gives, and whether a token of `full`
        spans `end` (the two disagree past them)."""
        ids_end = tokenizer.encode(text[:end])
        k = common_prefix_length(ids_end, full)
        return k, k < len(ids_end)

    for start, end in spans:
        a, _ = first_tokens(len(prompt) + start)
        if a >= offset + kept:
            break
        if len(prompt) + end >= len(text):
            b = len(full)
        else:
            b, merged = first_tokens(len(prompt) + end)
            b += merged
        for t in range(max(a, offset), b):
            flags[t - offset] = True
    return flags


def tokenize_prompts(
    records: Sequence,
    tokenizer: Tokenizer,
    *,
    lengths: SequenceLengths | None = None,
    max_prompt_length: int | None = None,
    truncation: str = "keep_end",
    add_bos: bool | None = None,
) -> tuple[list[tuple[int, ...]], TokenizeReport]:
    """Tokenise prompts for generation (records with `.prompt`, or strings).

    A prompt longer than `max_prompt_length` (default: `lengths.max_prompt_length`)
    keeps its end (`"keep_end"`, BOS kept first) or is dropped (`"drop"`); BOS as in
    `tokenize_preferences`. Returns `(prompt ids, report)`.
    """
    _check_truncation(truncation)
    add_bos = wants_bos(tokenizer, add_bos)
    if max_prompt_length is not None and (
        isinstance(max_prompt_length, bool) or max_prompt_length < 1
    ):
        raise DataError(f"max_prompt_length must be a positive int, got {max_prompt_length!r}")
    base = SequenceLengths() if lengths is None else lengths
    limit = base.max_prompt_length if max_prompt_length is None else max_prompt_length
    if limit >= base.max_length:  # a prompt-only pass: let the prompt limit stand alone
        base = dataclasses.replace(base, max_length=limit + 1)
    report = TokenizeReport(
        lengths=dataclasses.replace(base, max_prompt_length=limit), truncation=truncation
    )
    out = []
    for r in records:
        text = r if isinstance(r, str) else getattr(r, "prompt", None)
        if not isinstance(text, str):
            raise DataError(f"prompt records need a string .prompt, got {type(r).__name__}")
        report.total += 1
        ids = ([tokenizer.bos_id] if add_bos else []) + tokenizer.encode(text)
        try:
            cut = _cut_prompt(ids, limit, truncation=truncation, add_bos=add_bos)
        except _Drop as e:
            report.drop(str(e))
            continue
        if cut is not None:
            ids = cut
            report.note_cut(prompt=True)
        if not ids:
            report.drop("empty prompt")
            continue
        report.kept += 1
        out.append(tuple(ids))
    return out, report
