"""Tokenising records and collating them into fixed-shape batches.

**Layout.** SFT and preference rows are right-padded to `max_length`:

```
tokens            [BOS p p p p | c c c EOS | pad pad]
mask              [ 1  1 1 1 1 |  1 1 1 1  |  0   0 ]
completion_mask   [ 0  0 0 0 0 |  1 1 1 1  |  0   0 ]
```

The completion mask covers the completion tokens and the EOS (the model learns to
stop), never the prompt or the padding. Prompt batches for generation are left-padded
(`[pad pad BOS p p p]`) so that every row's next token is written at the same
position.

**Prompt and completion ids.** The completion's ids are those of the *full* text
`prompt + completion` after the prompt's ids, so a pair tokenises exactly as the
concatenated text does (no spurious dummy-prefix space at the start of a completion).
When the tokenizer merges characters across the boundary (the full text's ids do not
start with the prompt's), the split moves left to where the two agree, and the merged
token counts as completion — the rule of TRL's `DPOTrainer.build_tokenized_answer`;
such pairs are counted in the report (`boundary_merged`).

**Truncation** (`truncation="keep_end"`): a prompt longer than `max_prompt_length`
keeps its end (truncated from the left; BOS, when added, stays first); then a
completion that does not fit in `max_length` is cut at the end (its EOS is lost, so
the model is not taught to stop there). `truncation="drop"` drops the record instead
of truncating anything. Both are counted in the report.
"""

import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from .._batches import PreferenceBatch, PromptBatch, SequenceBatch
from ._errors import DataError
from ._tokenizer import Tokenizer

__all__ = [
    "TokenizedSequence",
    "TokenizedPair",
    "TokenizeReport",
    "tokenize_preferences",
    "tokenize_sft",
    "tokenize_prompts",
    "collate_preferences",
    "collate_sft",
    "collate_prompts",
]

_TRUNCATIONS = ("keep_end", "drop")


@dataclasses.dataclass(frozen=True)
class TokenizedSequence:
    """Prompt ids (with BOS when added) and completion ids (with EOS when added and kept)."""

    prompt: tuple[int, ...]
    completion: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.prompt) + len(self.completion)


@dataclasses.dataclass(frozen=True)
class TokenizedPair:
    """The two sequences of a preference pair (their prompts are equal unless a token
    merged across the prompt/completion boundary)."""

    chosen: TokenizedSequence
    rejected: TokenizedSequence


@dataclasses.dataclass
class TokenizeReport:
    """Counts of a tokenisation pass (records, not sequences: a pair counts once).

    - `total`: records seen; `kept`: records returned.
    - `prompt_truncated` / `completion_truncated`: kept records with a truncated prompt /
      completion (`truncation="keep_end"`).
    - `dropped`: `{reason: count}` (`"too long"` under `truncation="drop"`,
      `"empty completion"` when nothing of a completion is left).
    - `boundary_merged`: records where a token spans the prompt/completion boundary.
    """

    total: int = 0
    kept: int = 0
    prompt_truncated: int = 0
    completion_truncated: int = 0
    boundary_merged: int = 0
    dropped: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def num_dropped(self) -> int:
        return sum(self.dropped.values())

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1


class _Drop(Exception):
    pass


def _check_lengths(max_length: int, max_prompt_length: int, truncation: str) -> None:
    if truncation not in _TRUNCATIONS:
        raise DataError(f"truncation must be one of {_TRUNCATIONS}, got {truncation!r}")
    if not 1 <= max_prompt_length < max_length:
        raise DataError(
            f"need 1 <= max_prompt_length < max_length, got {max_prompt_length} and {max_length}"
        )


def _common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    k = 0
    while k < n and a[k] == b[k]:
        k += 1
    return k


def _split_ids(
    tokenizer: Tokenizer, prompt: str, completion: str, prompt_ids: list[int]
) -> tuple[list[int], list[int], bool]:
    """`(prompt ids, completion ids, merged across the boundary)` from the full text."""
    full = tokenizer.encode(prompt + completion)
    n = len(prompt_ids)
    if full[:n] == prompt_ids:
        return prompt_ids, full[n:], False
    k = _common_prefix_length(full, prompt_ids)
    return full[:k], full[k:], True


def _fit(
    prompt: list[int],
    completion: list[int],
    *,
    max_length: int,
    max_prompt_length: int,
    truncation: str,
    add_bos: bool,
    flags: list[bool],
) -> TokenizedSequence:
    """Truncate one sequence; `flags` collects `[prompt_truncated, completion_truncated]`."""
    if len(prompt) > max_prompt_length:
        if truncation == "drop":
            raise _Drop("too long")
        head = prompt[:1] if add_bos else []
        prompt = head + prompt[len(prompt) - (max_prompt_length - len(head)) :]
        flags[0] = True
    room = max_length - len(prompt)
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
    max_length: int,
    max_prompt_length: int,
    truncation: str,
    add_bos: bool,
    add_eos: bool,
) -> tuple[list[list[TokenizedSequence]], TokenizeReport]:
    _check_lengths(max_length, max_prompt_length, truncation)
    report = TokenizeReport()
    out = []
    bos = [tokenizer.bos_id] if add_bos else []
    eos = [tokenizer.eos_id] if add_eos else []
    for prompt, completions in items:
        report.total += 1
        prompt_ids = tokenizer.encode(prompt)
        flags = [False, False]
        merged = False
        try:
            seqs = []
            for completion in completions:
                p, c, m = _split_ids(tokenizer, prompt, completion, prompt_ids)
                merged |= m
                seqs.append(
                    _fit(
                        bos + p,
                        c + eos,
                        max_length=max_length,
                        max_prompt_length=max_prompt_length,
                        truncation=truncation,
                        add_bos=add_bos,
                        flags=flags,
                    )
                )
        except _Drop as e:
            report.drop(str(e))
            continue
        report.kept += 1
        report.prompt_truncated += flags[0]
        report.completion_truncated += flags[1]
        report.boundary_merged += merged
        out.append(seqs)
    return out, report


def tokenize_preferences(
    records: Sequence,
    tokenizer: Tokenizer,
    *,
    max_length: int,
    max_prompt_length: int,
    truncation: str = "keep_end",
    add_bos: bool = True,
    add_eos: bool = True,
) -> tuple[list[TokenizedPair], TokenizeReport]:
    """Tokenise preference records (`.prompt`, `.chosen`, `.rejected`) into pairs.

    **Arguments:**

    - `records`: e.g. a `PreferenceDataset`.
    - `tokenizer`: any `Tokenizer`.
    - `max_length`: the most tokens of a sequence (prompt + completion).
    - `max_prompt_length`: the most prompt tokens (`< max_length`).
    - `truncation`: `"keep_end"` (truncate; see the module docstring) or `"drop"`.
    - `add_bos` / `add_eos`: start prompts with BOS / end completions with EOS.

    **Returns:** `(pairs, report)`: a `TokenizedPair` for each kept record, and a
    `TokenizeReport` counting truncated, dropped and boundary-merged records.
    """
    items = []
    for r in records:
        for key in ("prompt", "chosen", "rejected"):
            if not isinstance(getattr(r, key, None), str):
                raise DataError(f"preference records need a string .{key}, got {type(r).__name__}")
        items.append((r.prompt, [r.chosen, r.rejected]))
    seqs, report = _tokenize(
        items,
        tokenizer,
        max_length=max_length,
        max_prompt_length=max_prompt_length,
        truncation=truncation,
        add_bos=add_bos,
        add_eos=add_eos,
    )
    return [TokenizedPair(chosen, rejected) for chosen, rejected in seqs], report


def tokenize_sft(
    records: Sequence,
    tokenizer: Tokenizer,
    *,
    max_length: int,
    max_prompt_length: int,
    truncation: str = "keep_end",
    add_bos: bool = True,
    add_eos: bool = True,
) -> tuple[list[TokenizedSequence], TokenizeReport]:
    """Tokenise `(prompt, completion)` records for supervised fine-tuning.

    Records are `(prompt, completion)` tuples, or objects with `.prompt` and
    `.completion` — or `.prompt` and `.chosen`, so a `PreferenceDataset` gives SFT on
    the chosen replies. Arguments and truncation as in `tokenize_preferences`.
    """
    items = [_prompt_and_completions(r) for r in records]
    seqs, report = _tokenize(
        items,
        tokenizer,
        max_length=max_length,
        max_prompt_length=max_prompt_length,
        truncation=truncation,
        add_bos=add_bos,
        add_eos=add_eos,
    )
    return [s for (s,) in seqs], report


def tokenize_prompts(
    records: Sequence,
    tokenizer: Tokenizer,
    *,
    max_prompt_length: int,
    truncation: str = "keep_end",
    add_bos: bool = True,
) -> tuple[list[tuple[int, ...]], TokenizeReport]:
    """Tokenise prompts for generation (records with `.prompt`, or strings).

    A prompt longer than `max_prompt_length` keeps its end (`"keep_end"`, BOS kept
    first) or is dropped (`"drop"`). Returns `(prompt ids, report)`.
    """
    if truncation not in _TRUNCATIONS:
        raise DataError(f"truncation must be one of {_TRUNCATIONS}, got {truncation!r}")
    if max_prompt_length < 1:
        raise DataError(f"max_prompt_length must be positive, got {max_prompt_length}")
    report = TokenizeReport()
    out = []
    for r in records:
        text = r if isinstance(r, str) else getattr(r, "prompt", None)
        if not isinstance(text, str):
            raise DataError(f"prompt records need a string .prompt, got {type(r).__name__}")
        report.total += 1
        ids = ([tokenizer.bos_id] if add_bos else []) + tokenizer.encode(text)
        if len(ids) > max_prompt_length:
            if truncation == "drop":
                report.drop("too long")
                continue
            head = ids[:1] if add_bos else []
            ids = head + ids[len(ids) - (max_prompt_length - len(head)) :]
            report.prompt_truncated += 1
        if not ids:
            report.drop("empty prompt")
            continue
        report.kept += 1
        out.append(tuple(ids))
    return out, report


def _check_ids(
    tokens: np.ndarray, mask: np.ndarray, pad_id: int, vocab_size: int | None, what: str
) -> None:
    """Refuse ids outside `[0, vocab_size)` (or, with no `vocab_size`, negative ids and
    ids that do not fit in int32), real tokens and the padding id alike."""
    if vocab_size is not None and vocab_size < 1:
        raise DataError(f"vocab_size must be positive, got {vocab_size}")
    limit = vocab_size if vocab_size is not None else int(np.iinfo(np.int32).max) + 1
    where = "the model's vocabulary" if vocab_size is not None else "the int32 range"
    if not 0 <= pad_id < limit:
        raise DataError(f"pad_id={pad_id} is outside {where} [0, {limit})")
    bad = mask & ((tokens < 0) | (tokens >= limit))
    if bad.any():
        row, col = (int(i[0]) for i in np.nonzero(bad))
        raise DataError(
            f"{what} {row} has token id {int(tokens[row, col])} at position {col}, "
            f"outside {where} [0, {limit})"
        )


def _right_padded(
    seqs: Sequence[TokenizedSequence], max_length: int, pad_id: int, vocab_size: int | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if not seqs:
        raise DataError("cannot collate an empty batch")
    if max_length < 1:
        raise DataError(f"max_length must be positive, got {max_length}")
    tokens = np.full((len(seqs), max_length), pad_id, dtype=np.int64)
    mask = np.zeros((len(seqs), max_length), dtype=bool)
    completion_mask = np.zeros((len(seqs), max_length), dtype=bool)
    for i, s in enumerate(seqs):
        n_prompt, n = len(s.prompt), len(s)
        if n > max_length:
            raise DataError(f"row {i} has {n} tokens, more than max_length={max_length}")
        tokens[i, :n_prompt] = s.prompt
        tokens[i, n_prompt:n] = s.completion
        mask[i, :n] = True
        completion_mask[i, n_prompt:n] = True
    _check_ids(tokens, mask, pad_id, vocab_size, "row")
    return tokens.astype(np.int32), mask, completion_mask


def collate_preferences(
    pairs: Sequence[TokenizedPair],
    *,
    max_length: int,
    pad_id: int,
    vocab_size: int | None = None,
) -> PreferenceBatch:
    """Right-pad pairs into a `PreferenceBatch` of shape `[len(pairs), max_length]`.

    Each row is prompt, then completion, then `pad_id`; `*_mask` marks the real tokens
    and `*_completion_mask` the completion (with its EOS). Tokens are int32, masks bool.

    **Arguments:**

    - `pairs`: from `tokenize_preferences` (at least one).
    - `max_length`: the row length `T`.
    - `pad_id`: the id written at padded positions (always masked).
    - `vocab_size`: the model's vocabulary size; when given, every token id and
      `pad_id` must lie in `[0, vocab_size)` (an id outside gives NaN logits or wraps
      around inside the model), else `DataError` names the row, position and id.

    **Returns:** the `PreferenceBatch` (with no cached reference log-probabilities).
    """
    c_tokens, c_mask, c_cmask = _right_padded(
        [p.chosen for p in pairs], max_length, pad_id, vocab_size
    )
    r_tokens, r_mask, r_cmask = _right_padded(
        [p.rejected for p in pairs], max_length, pad_id, vocab_size
    )
    return PreferenceBatch(
        chosen_tokens=jnp.asarray(c_tokens),
        chosen_mask=jnp.asarray(c_mask),
        chosen_completion_mask=jnp.asarray(c_cmask),
        rejected_tokens=jnp.asarray(r_tokens),
        rejected_mask=jnp.asarray(r_mask),
        rejected_completion_mask=jnp.asarray(r_cmask),
    )


def collate_sft(
    seqs: Sequence[TokenizedSequence],
    *,
    max_length: int,
    pad_id: int,
    vocab_size: int | None = None,
) -> SequenceBatch:
    """Right-pad sequences into a `SequenceBatch` of shape `[len(seqs), max_length]`
    (layout and arguments as `collate_preferences`)."""
    tokens, mask, completion_mask = _right_padded(seqs, max_length, pad_id, vocab_size)
    return SequenceBatch(
        tokens=jnp.asarray(tokens),
        mask=jnp.asarray(mask),
        completion_mask=jnp.asarray(completion_mask),
    )


def collate_prompts(
    prompts: Sequence[Sequence[int]],
    *,
    max_length: int,
    pad_id: int,
    vocab_size: int | None = None,
) -> PromptBatch:
    """Left-pad prompt ids into a `PromptBatch` of shape `[len(prompts), max_length]`.

    Row `i` is `[pad ... pad, prompt_i]`; `mask` marks the prompt tokens. A prompt
    longer than `max_length` is an error (truncate with `tokenize_prompts`); with
    `vocab_size`, so is an id outside `[0, vocab_size)` (see `collate_preferences`).
    """
    if not prompts:
        raise DataError("cannot collate an empty batch")
    if max_length < 1:
        raise DataError(f"max_length must be positive, got {max_length}")
    tokens = np.full((len(prompts), max_length), pad_id, dtype=np.int64)
    mask = np.zeros((len(prompts), max_length), dtype=bool)
    for i, ids in enumerate(prompts):
        n = len(ids)
        if n > max_length:
            raise DataError(f"prompt {i} has {n} tokens, more than max_length={max_length}")
        if n:
            tokens[i, max_length - n :] = ids
            mask[i, max_length - n :] = True
    _check_ids(tokens, mask, pad_id, vocab_size, "prompt")
    return PromptBatch(tokens=jnp.asarray(tokens.astype(np.int32)), mask=jnp.asarray(mask))
