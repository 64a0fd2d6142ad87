"""Shared-prompt packing of preference pairs (`PackedPreferenceBatch`).

A pair's chosen and rejected sequences start with the same prompt. Packed, the prompt
is written once and both completions follow it, `[prompt | chosen | rejected]`; the
model's attention layout (`branch_ids`) lets each completion see the prompt and itself
only, with the positions it has in its own row, so every log-probability equals the
unpacked one while the prompt's projections, MLPs and keys/values are computed once.
On multi-turn data, where prompts are most of a row, this removes about a third of the
work; with several pairs per row (`pairs_per_row`, told apart by `segment_ids`) most of
the padding goes too.

If the two prompts differ (a token merged across the prompt/completion boundary when
tokenising), only their common prefix is shared; the rest of each prompt goes into its
branch, unscored.

Three ways in: `pack_preferences` packs tokenised pairs into rows (first fit, or one pair
per row at fixed offsets with `aligned=True`); `pack_preference_steps` makes token-budget
batches of the same shape in which every pair is packed once; `packed_from_preferences`
converts a padded `PreferenceBatch` into the packed batch.
"""

import dataclasses
import math
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from ._batches import PackedPreferenceBatch, PreferenceBatch
from ._collate import _check_completions, _check_ids
from ._errors import DataError
from ._tokenized import TokenizedPair, TokenizedSequence


def _positive(name: str, value: object, *, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DataError(f"{name} must be a positive int, got {value!r}")


def _pieces(pair: TokenizedPair) -> tuple[list[int], list[int], list[int], int, int]:
    """`(shared, chosen_tail, rejected_tail, chosen_prompt_rest, rejected_prompt_rest)`;
    `DataError` for a sequence with a `completion_mask`: packing scores whole completions."""
    c, r = pair.chosen, pair.rejected
    if c.completion_mask is not None or r.completion_mask is not None:
        raise DataError(
            "packed pairs are scored on their whole completions; a sequence with a "
            "completion_mask (some completion tokens untrained) cannot be packed"
        )
    shared = 0
    limit = min(len(c.prompt), len(r.prompt))
    while shared < limit and c.prompt[shared] == r.prompt[shared]:
        shared += 1
    c_all, r_all = list(c.prompt) + list(c.completion), list(r.prompt) + list(r.completion)
    return (
        c_all[:shared],
        c_all[shared:],
        r_all[shared:],
        len(c.prompt) - shared,
        len(r.prompt) - shared,
    )


def packed_length(pair: TokenizedPair) -> int:
    """Tokens a pair takes once packed: shared prompt + chosen + rejected completion."""
    shared, ct, rt, _, _ = _pieces(pair)
    return len(shared) + len(ct) + len(rt)


def _first_fit(sizes: Sequence[int], capacity: int, slots: int) -> list[list[int]]:
    """First-fit decreasing bin packing of `sizes` into rows of `capacity` tokens and at
    most `slots` items; returns the item indices of each row (largest first)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda j: (-sizes[j], j)):
        for r, free in enumerate(room):
            if free >= sizes[i] and len(rows[r]) < slots:
                rows[r].append(i)
                room[r] -= sizes[i]
                break
        else:
            rows.append([i])
            room.append(capacity - sizes[i])
    return rows


def pack_preferences(
    pairs: Sequence[TokenizedPair],
    *,
    pad_id: int,
    row_length: int | None = None,
    bucket_size: int | None = None,
    pairs_per_row: int = 1,
    num_rows: int | None = None,
    vocab_size: int | None = None,
    aligned: bool = False,
) -> PackedPreferenceBatch:
    """Pack preference pairs with their prompt shared into a `PackedPreferenceBatch`.

    **Arguments:**

    - `pairs`: from `tokenize_preferences` (at least one).
    - `pad_id`: the id written at padded positions (always masked).
    - `row_length`: the row length `L`. Default: the longest packed pair (`packed_length`)
      rounded up to a multiple of `bucket_size` (exactly the longest when `bucket_size`
      is `None`). A pair longer than `row_length` is refused, naming it.
    - `bucket_size`: see `row_length`; a handful of shapes replace one per batch.
    - `pairs_per_row`: `K`, the most pairs one row holds (first-fit decreasing, told
      apart by `segment_ids`); 1 puts each pair in its own row, in order.
    - `num_rows`: the number of rows `R` (fixed shapes); default as many as needed. Rows
      left over are empty (no real token, no pair). Too few rows is an error.
    - `vocab_size`: when given, every id and `pad_id` must lie in `[0, vocab_size)`.
    - `aligned`: one pair per row at fixed offsets shared by the batch — prompts in
      `[0, P)`, chosen completions in `[P, P + C)`, rejected ones in the last `R`
      positions, each region right-padded to the batch's longest (rounded up to
      `bucket_size`) — recorded as the batch's static `regions=(P, C, R)`. The model
      then scores each completion only against the prompt and itself (no work on one
      completion against the other), which pays off when completions are long; the
      per-pair layout (the default) pads less when lengths vary. Ignores `row_length`
      and `pairs_per_row`.

    **Returns:** the batch (`[R, L]` token fields, `pairs [R, K]`). With `K = 1` and no
    `num_rows`, row `i` holds pair `i`; otherwise pair slots are filled as packed, and a
    step averages over the pairs present, so the order does not matter.
    """
    if not pairs:
        raise DataError("cannot pack an empty batch")
    _positive("row_length", row_length)
    _positive("bucket_size", bucket_size)
    _positive("pairs_per_row", pairs_per_row, allow_none=False)
    _positive("num_rows", num_rows)
    pieces, sizes = _sized_pieces(pairs)
    if aligned:
        return _pack_aligned(
            pieces, pad_id=pad_id, bucket_size=bucket_size, num_rows=num_rows, vocab_size=vocab_size
        )
    if row_length is None:
        longest = max(sizes)
        row_length = (
            longest if bucket_size is None else math.ceil(longest / bucket_size) * bucket_size
        )
    _check_fits(sizes, row_length)
    if pairs_per_row == 1:
        rows = [[i] for i in range(len(pairs))]
    else:
        rows = _first_fit(sizes, row_length, pairs_per_row)
    R = len(rows) if num_rows is None else num_rows
    if len(rows) > R:
        raise DataError(
            f"{len(pairs)} pairs need {len(rows)} rows of {row_length} tokens "
            f"({pairs_per_row} pairs per row at most), more than num_rows={num_rows}"
        )
    return _write_rows(pieces, rows, row_length, pairs_per_row, R, pad_id, vocab_size)


def _sized_pieces(pairs: Sequence[TokenizedPair]):
    pieces = [_pieces(p) for p in pairs]
    return pieces, [len(s) + len(c) + len(r) for s, c, r, _, _ in pieces]


def _check_fits(sizes: Sequence[int], row_length: int) -> None:
    too_long = [i for i, n in enumerate(sizes) if n > row_length]
    if too_long:
        i = too_long[0]
        raise DataError(
            f"pair {i} takes {sizes[i]} tokens packed (prompt + chosen + rejected), more "
            f"than row_length={row_length}"
        )


def _checked_batch(
    tokens, mask, completion, segment, branch, present, *, pad_id, vocab_size, regions=None
) -> PackedPreferenceBatch:
    """The `PackedPreferenceBatch` of packed numpy rows, once their ids (within the
    vocabulary, `pad_id` at padding) and their completions (one scored token a pair at
    least) are checked."""
    _check_ids(tokens, mask, pad_id, vocab_size, "packed row")
    _check_completions([completion], "pair")
    return PackedPreferenceBatch(
        tokens=jnp.asarray(tokens.astype(np.int32)),
        mask=jnp.asarray(mask),
        completion_mask=jnp.asarray(completion),
        segment_ids=jnp.asarray(segment),
        branch_ids=jnp.asarray(branch),
        pairs=jnp.asarray(present),
        regions=regions,
    )


def _write_rows(
    pieces, rows, L: int, K: int, R: int, pad_id: int, vocab_size
) -> PackedPreferenceBatch:
    """The batch `[R, L]` whose row `r` holds the pairs `rows[r]` (indices into `pieces`)."""
    tokens = np.full((R, L), pad_id, dtype=np.int64)
    mask = np.zeros((R, L), dtype=bool)
    completion = np.zeros((R, L), dtype=bool)
    segment = np.zeros((R, L), dtype=np.int32)
    branch = np.zeros((R, L), dtype=np.int32)
    present = np.zeros((R, K), dtype=bool)
    for r, members in enumerate(rows):
        at = 0
        for k, i in enumerate(members):
            shared, ct, rt, c_rest, r_rest = pieces[i]
            present[r, k] = True
            for b, part, unscored in ((0, shared, len(shared)), (1, ct, c_rest), (2, rt, r_rest)):
                end = at + len(part)
                tokens[r, at:end] = part
                mask[r, at:end] = True
                segment[r, at:end] = k
                branch[r, at:end] = b
                completion[r, at + unscored : end] = True
                at = end
    return _checked_batch(
        tokens, mask, completion, segment, branch, present, pad_id=pad_id, vocab_size=vocab_size
    )


def _pack_aligned(pieces, *, pad_id, bucket_size, num_rows, vocab_size) -> PackedPreferenceBatch:
    up = lambda n: (
        max(1, n) if bucket_size is None else max(1, math.ceil(n / bucket_size)) * bucket_size
    )
    P = up(max(len(p[0]) for p in pieces))
    C = up(max(len(p[1]) for p in pieces))
    R_ = up(max(len(p[2]) for p in pieces))
    rows = len(pieces) if num_rows is None else num_rows
    if rows < len(pieces):
        raise DataError(
            f"{len(pieces)} pairs need {len(pieces)} aligned rows, more than num_rows={num_rows}"
        )
    L = P + C + R_
    tokens = np.full((rows, L), pad_id, dtype=np.int64)
    mask = np.zeros((rows, L), dtype=bool)
    completion = np.zeros((rows, L), dtype=bool)
    branch = np.zeros((rows, L), dtype=np.int32)
    branch[:, P : P + C] = 1
    branch[:, P + C :] = 2
    present = np.zeros((rows, 1), dtype=bool)
    for i, (shared, ct, rt, c_rest, r_rest) in enumerate(pieces):
        present[i, 0] = True
        for start, part, unscored in (
            (0, shared, len(shared)),
            (P, ct, c_rest),
            (P + C, rt, r_rest),
        ):
            tokens[i, start : start + len(part)] = part
            mask[i, start : start + len(part)] = True
            completion[i, start + unscored : start + len(part)] = True
    segment = np.zeros((rows, L), dtype=np.int32)  # one segment a row
    arrays = (tokens, mask, completion, segment, branch, present)
    return _checked_batch(*arrays, pad_id=pad_id, vocab_size=vocab_size, regions=(P, C, R_))


# --- token-budget batches, every pair packed once -------------------------------------


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


# --- a padded PreferenceBatch, packed -------------------------------------------------


def _row_sequence(
    tokens: np.ndarray, mask: np.ndarray, completion: np.ndarray
) -> TokenizedSequence:
    real = tokens[mask]
    scored = completion[mask]
    n_prompt = int(np.argmax(scored)) if scored.any() else len(real)
    if not scored[n_prompt:].all():
        raise DataError(
            "a packed pair needs each row's completion to be one block after its prompt "
            "(completion_mask set on the real tokens after the prompt only)"
        )
    return TokenizedSequence(
        prompt=tuple(int(t) for t in real[:n_prompt]),
        completion=tuple(int(t) for t in real[n_prompt:]),
    )


def packed_from_preferences(
    batch: PreferenceBatch,
    *,
    pad_id: int = 0,
    row_length: int | None = None,
    bucket_size: int | None = None,
    pairs_per_row: int = 1,
    num_rows: int | None = None,
    aligned: bool = False,
) -> PackedPreferenceBatch:
    """Convert a `PreferenceBatch` (on the host) into a `PackedPreferenceBatch`.

    Each row's real tokens are split into prompt (before the first completion token) and
    completion; the pairs are then packed by `pack_preferences` (same arguments). Cached
    reference log-probabilities are carried over when each pair has its own row
    (`pairs_per_row=1`, no `num_rows`).
    """
    arrays = {
        name: np.asarray(getattr(batch, name))
        for name in (
            "chosen_tokens",
            "chosen_mask",
            "chosen_completion_mask",
            "rejected_tokens",
            "rejected_mask",
            "rejected_completion_mask",
        )
    }
    pairs = []
    for i in range(arrays["chosen_tokens"].shape[0]):
        chosen = _row_sequence(
            arrays["chosen_tokens"][i],
            arrays["chosen_mask"][i],
            arrays["chosen_completion_mask"][i],
        )
        rejected = _row_sequence(
            arrays["rejected_tokens"][i],
            arrays["rejected_mask"][i],
            arrays["rejected_completion_mask"][i],
        )
        pairs.append(TokenizedPair(chosen=chosen, rejected=rejected))
    packed = pack_preferences(
        pairs,
        pad_id=pad_id,
        row_length=row_length,
        bucket_size=bucket_size,
        pairs_per_row=pairs_per_row,
        num_rows=num_rows,
        aligned=aligned,
    )
    if batch.ref_chosen_logp is None or batch.ref_rejected_logp is None:
        return packed
    if pairs_per_row != 1 or num_rows is not None:
        raise DataError(
            "cached reference log-probabilities are carried over only with pairs_per_row=1 "
            "and no num_rows; compute them on the packed batch instead (compute_reference_logps)"
        )
    return dataclasses.replace(
        packed,
        ref_chosen_logp=jnp.asarray(batch.ref_chosen_logp)[:, None],
        ref_rejected_logp=jnp.asarray(batch.ref_rejected_logp)[:, None],
    )
