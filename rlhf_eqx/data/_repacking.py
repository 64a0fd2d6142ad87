"""Conversion of a padded `PreferenceBatch` into a shared-prompt `PackedPreferenceBatch`."""

import jax.numpy as jnp
import numpy as np

from ._batches import PackedPreferenceBatch, PreferenceBatch
from ._errors import DataError
from ._packing import pack_preferences
from ._tokenized import TokenizedPair, TokenizedSequence


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
    return PackedPreferenceBatch(
        tokens=packed.tokens,
        mask=packed.mask,
        completion_mask=packed.completion_mask,
        segment_ids=packed.segment_ids,
        branch_ids=packed.branch_ids,
        pairs=packed.pairs,
        ref_chosen_logp=jnp.asarray(batch.ref_chosen_logp)[:, None],
        ref_rejected_logp=jnp.asarray(batch.ref_rejected_logp)[:, None],
        regions=packed.regions,
    )
