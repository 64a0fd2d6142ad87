"""Collating tokenised records into fixed-shape batches.

**Layout.** SFT and preference rows are right-padded to the row length `T`:

```
tokens            [BOS p p p p | c c c EOS | pad pad]
mask              [ 1  1 1 1 1 |  1 1 1 1  |  0   0 ]
completion_mask   [ 0  0 0 0 0 |  1 1 1 1  |  0   0 ]
```

The completion mask covers the completion tokens and the EOS (the model learns to
stop), never the prompt or the padding; of a sequence with a `completion_mask` (a
conversation trained on every assistant turn) it covers the flagged completion tokens
only:

```
tokens            [p p p | a a a u u u a a a | pad]
completion_mask   [0 0 0 | 1 1 1 0 0 0 1 1 1 |  0 ]
```

Prompt batches for generation are left-padded (`[pad pad BOS p p p]`) so that every
row's next token is written at the same position.

**Row length.** `T = max_length` (or `lengths.max_length`) by default: one shape for
every batch. With `bucket_size=m`, `T` is the batch's longest row rounded up to a
multiple of `m` (at most `max_length`): on real length mixes most of the padding goes,
and a handful of shapes (hence compilations) replace the one padded to the maximum.

**Ids.** With `vocab_size` (the model's), every token id and the padding id must lie in
`[0, vocab_size)` (`check_token_ids`); without it, negative ids and ids past int32 are
still refused. A `DataError` names the row, the position and the id.

**Empty batches.** A batch of SFT or preference rows none of which has a completion
token is refused (`DataError`): no loss could be taken on it. Single rows with an empty
completion are kept (they add nothing to the loss).
"""

import math
import numbers
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from ._batches import PreferenceBatch, PromptBatch, SequenceBatch
from ._errors import DataError
from ._tokenized import SequenceLengths, TokenizedPair, TokenizedSequence


def row_length(
    longest: int,
    *,
    max_length: int | None = None,
    lengths: SequenceLengths | None = None,
    bucket_size: int | None = None,
) -> int:
    """The row length `T` of a batch whose longest row has `longest` tokens.

    `max_length` (default `lengths.max_length`, then `SequenceLengths().max_length`) when
    `bucket_size` is `None`, else `longest` rounded up to a multiple of `bucket_size`
    and capped at `max_length`.
    """
    limit = max_length if max_length is not None else (lengths or SequenceLengths()).max_length
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise DataError(f"max_length must be a positive int, got {limit!r}")
    if bucket_size is None:
        return limit
    if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < 1:
        raise DataError(f"bucket_size must be a positive int, got {bucket_size!r}")
    return min(limit, max(1, math.ceil(longest / bucket_size)) * bucket_size)


def check_token_ids(ids: Any, vocab_size: int, *, where: str = "row") -> None:
    """Refuse token ids outside `[0, vocab_size)`.

    An id at or past `vocab_size` gives NaN logits (or reads another row of the
    embedding), and a negative one silently wraps around, so ids are checked where they
    enter: the collate functions run this on every batch they build (with their
    `vocab_size`), the sampler on concrete prompts.

    **Arguments:**

    - `ids`: one sequence (1-D) or rows of sequences (2-D, or a list of lists of any
      lengths) of integer ids: Python ints, numpy arrays or concrete jax arrays.
    - `vocab_size`: the model's vocabulary size (`TransformerConfig.vocab_size`).
    - `where`: what a row is called in the message (`"row"`, `"prompt"`, ...).

    **Raises:** `DataError` naming the first bad id, its row and position, e.g.
    `prompt 1 has token id -1 at position 2, outside the model's vocabulary [0, 512)`
    (`{where} has token id ...` for one sequence); also for ids that are not integers.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral):
        raise DataError(f"vocab_size must be a positive int, got {vocab_size!r}")
    if vocab_size < 1:
        raise DataError(f"vocab_size must be a positive int, got {vocab_size!r}")
    if hasattr(ids, "shape") and hasattr(ids, "dtype"):
        arr = np.asarray(ids)
        if arr.ndim not in (1, 2):
            raise DataError(f"token ids must be 1-D or 2-D, got shape {arr.shape}")
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise DataError(f"token ids must be integers, got dtype {arr.dtype}")
        single, rows = arr.ndim == 1, (list(arr) if arr.ndim == 2 else [arr])
    else:
        items = list(ids)
        single = not any(hasattr(x, "__len__") and not isinstance(x, str) for x in items)
        rows = [items] if single else [list(x) for x in items]
    for r, row in enumerate(rows):
        if not isinstance(row, np.ndarray):
            for c, i in enumerate(row):
                if isinstance(i, bool | np.bool_) or not isinstance(i, numbers.Integral):
                    label = where if single else f"{where} {r}"
                    raise DataError(
                        f"{label} has {i!r} at position {c}: token ids must be integers"
                    )
            row = np.asarray([int(i) for i in row], dtype=object)
        bad = (row < 0) | (row >= vocab_size)
        if np.any(bad):
            c = int(np.argmax(bad))
            label = where if single else f"{where} {r}"
            raise DataError(
                f"{label} has token id {int(row[c])} at position {c}, outside the model's "
                f"vocabulary [0, {vocab_size})"
            )


def _check_ids(
    tokens: np.ndarray, mask: np.ndarray, pad_id: int, vocab_size: int | None, what: str
) -> None:
    """Refuse ids outside `[0, vocab_size)` (`check_token_ids`; or, with no `vocab_size`,
    negative ids and ids that do not fit in int32), real tokens and the padding id alike."""
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


def _pad_rows(
    rows: Sequence[Sequence[int]],
    length: int,
    *,
    pad_id: int,
    vocab_size: int | None,
    what: str,
    left: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """`(tokens, mask)` of shape `[len(rows), length]`: each row's ids then `pad_id`
    (before them with `left=True`), `mask` true on the ids; tokens int32. A row longer
    than `length` and an id outside range (`_check_ids`) are refused, naming the `what`."""
    tokens = np.full((len(rows), length), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), length), dtype=bool)
    for i, ids in enumerate(rows):
        n = len(ids)
        if n > length:
            raise DataError(f"{what} {i} has {n} tokens, more than max_length={length}")
        span = slice(length - n, length) if left else slice(0, n)
        tokens[i, span] = ids
        mask[i, span] = True
    _check_ids(tokens, mask, pad_id, vocab_size, what)
    return tokens.astype(np.int32), mask


def _check_completions(completion_masks: Sequence[np.ndarray], what: str) -> None:
    """Refuse a batch with no completion token at all: every loss would be 0/0 and the
    step would have nothing to learn from."""
    if not any(m.any() for m in completion_masks):
        raise DataError(
            f"no completion token in the batch: every {what} has an empty completion (or a "
            "completion_mask with no trained token), so the loss would have nothing to learn "
            "from"
        )


def _right_padded(
    groups: Sequence[Sequence[TokenizedSequence]],
    *,
    max_length: int | None,
    lengths: SequenceLengths | None,
    bucket_size: int | None,
    pad_id: int,
    vocab_size: int | None,
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """`(tokens, mask, completion_mask)` for each group of sequences, all of one row length."""
    if not groups or not groups[0]:
        raise DataError("cannot collate an empty batch")
    longest = max(len(s) for seqs in groups for s in seqs)
    T = row_length(longest, max_length=max_length, lengths=lengths, bucket_size=bucket_size)
    out = []
    for seqs in groups:
        tokens, mask = _pad_rows(
            [(*s.prompt, *s.completion) for s in seqs],
            T,
            pad_id=pad_id,
            vocab_size=vocab_size,
            what="row",
        )
        completion_mask = np.zeros((len(seqs), T), dtype=bool)
        for i, s in enumerate(seqs):
            trained = True if s.completion_mask is None else s.completion_mask
            completion_mask[i, len(s.prompt) : len(s)] = trained
        out.append((tokens, mask, completion_mask))
    _check_completions([cm for _, _, cm in out], "row")
    return out


def collate_preferences(
    pairs: Sequence[TokenizedPair],
    *,
    pad_id: int,
    max_length: int | None = None,
    lengths: SequenceLengths | None = None,
    bucket_size: int | None = None,
    vocab_size: int | None = None,
) -> PreferenceBatch:
    """Right-pad pairs into a `PreferenceBatch` of shape `[len(pairs), T]`.

    Each row is prompt, then completion, then `pad_id`; `*_mask` marks the real tokens
    and `*_completion_mask` the completion (with its EOS). Tokens are int32, masks bool.
    Chosen and rejected rows share one `T`.

    **Arguments:**

    - `pairs`: from `tokenize_preferences` (at least one).
    - `pad_id`: the id written at padded positions (always masked).
    - `max_length`: the row length `T` (default `lengths.max_length`).
    - `lengths`: the `SequenceLengths` the pairs were tokenised with.
    - `bucket_size`: pad to the longest row rounded up to a multiple of this instead
      (at most `max_length`; see the module docstring).
    - `vocab_size`: the model's vocabulary size; when given, every token id and
      `pad_id` must lie in `[0, vocab_size)` (an id outside gives NaN logits or wraps
      around inside the model), else `DataError` names the row, position and id.

    **Returns:** the `PreferenceBatch` (with no cached reference log-probabilities), its
    `margins` the pairs' own margins (float32 `[B]`) when every pair has one, `None`
    when none has (a batch where some pairs have a margin and others not is refused:
    `DataError` naming the first pair without one).
    """
    (c_tokens, c_mask, c_cmask), (r_tokens, r_mask, r_cmask) = _right_padded(
        [[p.chosen for p in pairs], [p.rejected for p in pairs]],
        max_length=max_length,
        lengths=lengths,
        bucket_size=bucket_size,
        pad_id=pad_id,
        vocab_size=vocab_size,
    )
    return PreferenceBatch(
        chosen_tokens=jnp.asarray(c_tokens),
        chosen_mask=jnp.asarray(c_mask),
        chosen_completion_mask=jnp.asarray(c_cmask),
        rejected_tokens=jnp.asarray(r_tokens),
        rejected_mask=jnp.asarray(r_mask),
        rejected_completion_mask=jnp.asarray(r_cmask),
        margins=_pair_margins(pairs),
    )


def _pair_margins(pairs: Sequence[TokenizedPair]) -> jnp.ndarray | None:
    """The pairs' margins as float32 `[B]`, `None` when no pair has one (`DataError`
    naming the first pair without one when only some have)."""
    margins = [getattr(p, "margin", None) for p in pairs]
    if all(m is None for m in margins):
        return None
    if any(m is None for m in margins):
        i, j = margins.index(None), next(k for k, m in enumerate(margins) if m is not None)
        raise DataError(
            f"pair {i} has no margin, though pair {j} has one: collate pairs that all "
            "have a margin, or none"
        )
    return jnp.asarray(np.asarray(margins, dtype=np.float32))


def collate_sft(
    seqs: Sequence[TokenizedSequence],
    *,
    pad_id: int,
    max_length: int | None = None,
    lengths: SequenceLengths | None = None,
    bucket_size: int | None = None,
    vocab_size: int | None = None,
) -> SequenceBatch:
    """Right-pad sequences into a `SequenceBatch` of shape `[len(seqs), T]` (layout and
    arguments as `collate_preferences`; a sequence's `completion_mask`, when it has one,
    says which of its completion tokens `completion_mask` marks)."""
    ((tokens, mask, completion_mask),) = _right_padded(
        [seqs],
        max_length=max_length,
        lengths=lengths,
        bucket_size=bucket_size,
        pad_id=pad_id,
        vocab_size=vocab_size,
    )
    return SequenceBatch(
        tokens=jnp.asarray(tokens),
        mask=jnp.asarray(mask),
        completion_mask=jnp.asarray(completion_mask),
    )


def collate_prompts(
    prompts: Sequence[Sequence[int]],
    *,
    pad_id: int,
    max_length: int | None = None,
    lengths: SequenceLengths | None = None,
    bucket_size: int | None = None,
    vocab_size: int | None = None,
) -> PromptBatch:
    """Left-pad prompt ids into a `PromptBatch` of shape `[len(prompts), P]`.

    Row `i` is `[pad ... pad, prompt_i]`; `mask` marks the prompt tokens. `P` is
    `max_length` (default `lengths.max_prompt_length`), or with `bucket_size` the
    longest prompt rounded up to a multiple of it. A prompt longer than `P` is an error
    (truncate with `tokenize_prompts`); with `vocab_size`, so is an id outside
    `[0, vocab_size)` (see `collate_preferences`).
    """
    if not prompts:
        raise DataError("cannot collate an empty batch")
    if max_length is None:
        max_length = (lengths or SequenceLengths()).max_prompt_length
    P = row_length(max(len(p) for p in prompts), max_length=max_length, bucket_size=bucket_size)
    tokens, mask = _pad_rows(
        prompts, P, pad_id=pad_id, vocab_size=vocab_size, what="prompt", left=True
    )
    return PromptBatch(tokens=jnp.asarray(tokens), mask=jnp.asarray(mask))


def padding_stats(batches: Sequence) -> dict[str, float | int]:
    """How much of some collated batches is padding, and how many shapes they have.

    **Arguments:** `batches`: `SequenceBatch`, `PreferenceBatch` or `PromptBatch`es.

    **Returns:** `{"padding_fraction": padded positions / all positions,
    "num_shapes": distinct [B, T] shapes, "tokens": real tokens, "positions": all}`
    (`padding_fraction` is 0 for no batches).
    """
    real = total = 0
    shapes = set()
    for batch in batches:
        masks = (
            [batch.chosen_mask, batch.rejected_mask]
            if isinstance(batch, PreferenceBatch)
            else [batch.mask]
        )
        for m in masks:
            real += int(np.asarray(m).sum())
            total += int(np.prod(m.shape))
        shapes.add(tuple(masks[0].shape))
    return {
        "padding_fraction": 1.0 - real / total if total else 0.0,
        "num_shapes": len(shapes),
        "tokens": real,
        "positions": total,
    }
