"""Token-budget batches of shared-prompt packed preference pairs: every pair packed once,
every batch the same shape."""

from collections.abc import Sequence

import numpy as np

from ._batches import PackedPreferenceBatch
from ._errors import DataError
from ._packing import _check_fits, _first_fit, _positive, _sized_pieces, _write_rows
from ._tokenized import TokenizedPair


def pack_preference_steps(
    pairs: Sequence[TokenizedPair],
    *,
    pad_id: int,
    row_length: int,
    rows_per_step: int | None = None,
    pairs_per_step: int | None = None,
    pairs_per_row: int = 4,
    seed: int | None = 0,
    vocab_size: int | None = None,
) -> list[PackedPreferenceBatch]:
    """Token-budget batches: every pair packed once, all batches the same shape.

    The pairs (prompt shared, as in `pack_preferences`) are packed into rows of
    `row_length` tokens, at most `pairs_per_row` to a row, by first-fit decreasing over
    the whole list; the rows are then shuffled with `seed` (`None` keeps the packing
    order, longest pairs first) and cut into batches of `rows_per_step` rows. Every
    batch is `[rows_per_step, row_length]` — one compiled step for a whole length mix —
    and holds however many pairs fill its rows; the last one is completed with empty
    rows. A step averages its loss over the pairs present, so batches of different pair
    counts need nothing else. On multi-turn preference data this pads far less than one
    pair per row in length-sorted batches, with one shape instead of several.

    **Arguments:**

    - `pairs`: from `tokenize_preferences` (at least one).
    - `pad_id`: the id written at padded positions (always masked).
    - `row_length`: tokens per row; a pair longer than this once packed is refused,
      naming it (`packed_length`).
    - `rows_per_step`: rows per batch; or
    - `pairs_per_step`: instead, as many rows per batch as hold this many pairs on
      average (the number of rows the packing needs, divided evenly).
    - `pairs_per_row`: the most pairs one row holds (its `pairs` axis).
    - `seed`: the shuffle of the rows across batches (`None`: no shuffle).
    - `vocab_size`: when given, every id and `pad_id` must lie in `[0, vocab_size)`.

    **Returns:** a list of `PackedPreferenceBatch`es (`[rows_per_step, row_length]`
    token fields, `pairs [rows_per_step, pairs_per_row]`).
    """
    if not pairs:
        raise DataError("cannot pack an empty list of pairs")
    _positive("row_length", row_length, allow_none=False)
    if (rows_per_step is None) == (pairs_per_step is None):
        raise DataError("give one of rows_per_step and pairs_per_step")
    _positive("rows_per_step", rows_per_step)
    _positive("pairs_per_step", pairs_per_step)
    _positive("pairs_per_row", pairs_per_row, allow_none=False)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise DataError(f"seed must be an int or None, got {seed!r}")
    pieces, sizes = _sized_pieces(pairs)
    _check_fits(sizes, row_length)
    rows = _first_fit(sizes, row_length, pairs_per_row)
    if rows_per_step is None:
        rows_per_step = max(1, round(len(rows) * pairs_per_step / len(pairs)))
    if seed is not None:
        rows = [rows[i] for i in np.random.default_rng(seed).permutation(len(rows))]
    return [
        _write_rows(
            pieces,
            rows[s : s + rows_per_step],
            row_length,
            pairs_per_row,
            rows_per_step,
            pad_id,
            vocab_size,
        )
        for s in range(0, len(rows), rows_per_step)
    ]
