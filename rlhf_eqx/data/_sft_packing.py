"""Packing whole SFT sequences into rows (`PackedSequenceBatch`, `pack_sft`).

Padded to `max_length`, a batch of SFT sequences of mixed lengths is mostly padding.
Packed, several whole sequences share a row of `max_length` tokens, each its own
segment: the model attends within a segment only and counts positions from its start
(`rlhf_eqx.models.attention_layout`), so every token's log-probability is the one it
has in its own padded row, and the step's loss, metrics and gradients are those of the
same sequences unpacked. This is TRL's `SFTConfig(packing=True,
packing_strategy="bfd")` with `padding_free=True`: best-fit decreasing packing of whole
sequences, position ids restarting per sequence, attention kept within each sequence.

```
tokens            [BOS p p c c EOS | BOS p c EOS | BOS c c | pad pad]
segment_ids       [ 0  0 0 0 0  0  |  1  1 1  1  |  2  2 2 |  3   3 ]
completion_mask   [ 0  0 0 1 1  1  |  0  0 1  1  |  0  1 1 |  0   0 ]
```
"""

import bisect
from collections.abc import Sequence

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from ._batches import _is_array, _validate
from ._collate import _check_completions, _check_ids
from ._errors import DataError
from ._packing import _positive
from ._tokenized import TokenizedSequence


class PackedSequenceBatch(eqx.Module):
    """Whole SFT sequences packed into rows of `L` tokens, one segment each (`pack_sft`).

    Row `r` holds up to `K` sequences one after the other, then padding. `segment_ids`
    number a row's sequences `0 ... K-1` in the order they are written; padding has
    segment `K` (one past the last slot), so it belongs to no sequence. Each sequence's
    tokens are contiguous. `sequences[r, k]` says whether slot `k` of row `r` holds a
    sequence (its static length `K` is the most sequences a row can hold). `mask` marks
    the real tokens and `completion_mask` the tokens the loss is on, as in
    `SequenceBatch`. The SFT step (`rlhf_eqx.train.make_sft_step`) runs the model with
    `segment_ids` (attention and positions within each sequence), so its loss equals
    that of the same sequences unpacked (TRL's `padding_free` packing).
    """

    tokens: Int[Array, "R L"]
    mask: Bool[Array, "R L"]
    completion_mask: Bool[Array, "R L"]
    segment_ids: Int[Array, "R L"]
    sequences: Bool[Array, "R K"]

    def __check_init__(self):
        _validate(self, ("tokens", "segment_ids"), ("mask", "completion_mask"))
        kind, seqs = type(self).__name__, self.sequences
        if not _is_array(seqs):
            return
        if len(seqs.shape) != 2 or np.dtype(seqs.dtype) != np.bool_ or 0 in seqs.shape:
            raise DataError(
                f"{kind}.sequences must be a boolean [R, K] array with K >= 1, got "
                f"{seqs.dtype} of shape {tuple(seqs.shape)}"
            )
        if _is_array(self.tokens) and seqs.shape[0] != self.tokens.shape[0]:
            raise DataError(
                f"{kind}.sequences has {seqs.shape[0]} rows but {kind}.tokens has shape "
                f"{tuple(self.tokens.shape)}"
            )


def _best_fit_decreasing(sizes: Sequence[int], capacity: int, slots: int | None) -> list[list[int]]:
    """Best-fit decreasing bin packing: the items, longest first (ties by index), each
    into the open row with the least room that still fits it (ties: the earliest row),
    or a new row; a row holds at most `slots` items (`None`: no limit). Returns the item
    indices of each row, rows in the order they were opened."""
    rows: list[list[int]] = []
    open_rows: list[tuple[int, int]] = []  # (room left, row), sorted
    for i in sorted(range(len(sizes)), key=lambda j: (-sizes[j], j)):
        at = bisect.bisect_left(open_rows, (sizes[i], -1))
        if at < len(open_rows):
            room, r = open_rows.pop(at)
        else:
            room, r = capacity, len(rows)
            rows.append([])
        rows[r].append(i)
        if slots is None or len(rows[r]) < slots:
            bisect.insort(open_rows, (room - sizes[i], r))
    return rows


def pack_sft(
    seqs: Sequence[TokenizedSequence],
    *,
    max_length: int,
    pad_id: int,
    sequences_per_row: int | None = None,
    num_rows: int | None = None,
    vocab_size: int | None = None,
) -> PackedSequenceBatch:
    """Pack whole SFT sequences into rows of `max_length` tokens (best-fit decreasing).

    TRL's `SFTConfig(packing=True, packing_strategy="bfd", padding_free=True)`: the
    sequences, longest first, each go into the row with the least room left that holds
    them whole, or into a new row; none is split, and each is its own segment (the
    step attends and counts positions within it). Deterministic: equal inputs give
    equal rows.

    **Arguments:**

    - `seqs`: from `tokenize_sft` / `tokenize_demonstrations` (at least one); a
      sequence's `completion_mask`, when it has one, says which completion tokens are
      trained, as in `collate_sft`.
    - `max_length`: the row length `L`. A sequence longer than it is refused, naming
      its index and length, as `collate_sft` refuses it (cut sequences when tokenising:
      `tokenize_sft(..., max_length=)`).
    - `pad_id`: the id written at padded positions (always masked).
    - `sequences_per_row`: `K`, the most sequences one row holds (the batch's
      `sequences` axis). Default: no limit, `K` the most any row got.
    - `num_rows`: the number of rows `R` (fixed shapes; rows left over are padding).
      Default: as many as the packing needs. Too few rows is an error.
    - `vocab_size`: when given, every id and `pad_id` must lie in `[0, vocab_size)`.

    **Returns:** the `PackedSequenceBatch` (`[R, max_length]` token fields,
    `sequences [R, K]`), rows in the order the packing opened them (the first holds the
    longest sequence), each row's sequences longest first.
    """
    if not seqs:
        raise DataError("cannot pack an empty batch")
    _positive("max_length", max_length, allow_none=False)
    _positive("sequences_per_row", sequences_per_row)
    _positive("num_rows", num_rows)
    sizes = [len(s) for s in seqs]
    too_long = [i for i, n in enumerate(sizes) if n > max_length]
    if too_long:
        i = too_long[0]
        raise DataError(
            f"sequence {i} has {sizes[i]} tokens, more than max_length={max_length} "
            "(cut it when tokenising: tokenize_sft(..., max_length=))"
        )
    rows = _best_fit_decreasing(sizes, max_length, sequences_per_row)
    R = len(rows) if num_rows is None else num_rows
    if len(rows) > R:
        raise DataError(
            f"{len(seqs)} sequences need {len(rows)} rows of {max_length} tokens, more than "
            f"num_rows={num_rows}"
        )
    K = sequences_per_row or max(len(r) for r in rows)
    tokens = np.full((R, max_length), pad_id, dtype=np.int64)
    mask = np.zeros((R, max_length), dtype=bool)
    completion = np.zeros((R, max_length), dtype=bool)
    segment = np.full((R, max_length), K, dtype=np.int32)
    present = np.zeros((R, K), dtype=bool)
    for r, members in enumerate(rows):
        at = 0
        for k, i in enumerate(members):
            s = seqs[i]
            end = at + len(s)
            tokens[r, at:end] = (*s.prompt, *s.completion)
            mask[r, at:end] = True
            segment[r, at:end] = k
            trained = True if s.completion_mask is None else s.completion_mask
            completion[r, at + len(s.prompt) : end] = trained
            present[r, k] = True
            at = end
    _check_ids(tokens, mask, pad_id, vocab_size, "packed row")
    _check_completions([completion], "sequence")
    return PackedSequenceBatch(
        tokens=jnp.asarray(tokens.astype(np.int32)),
        mask=jnp.asarray(mask),
        completion_mask=jnp.asarray(completion),
        segment_ids=jnp.asarray(segment),
        sequences=jnp.asarray(present),
    )
