"""The KTO batch: unpaired completions labelled desirable or undesirable, with the
mismatched rows that estimate the reference point."""

import equinox as eqx
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from ..data._batches import _is_array, _validate
from ..data._errors import DataError


class KTOBatch(eqx.Module):
    """Unpaired examples for KTO: prompt + completion rows, each labelled desirable or not.

    - `tokens`, `mask`, `completion_mask`: `[B, T]` right-padded rows (as a
      `SequenceBatch`); the completion mask marks the scored tokens.
    - `label`: `[B]`, true for a desirable completion, false for an undesirable one.
    - `kl_tokens`, `kl_mask`, `kl_completion_mask`: `[B, T']` the *mismatched* rows that
      estimate the reference point: prompt $i$ followed by another example's completion
      (`data.collate_unpaired` uses the completion of example $i - 1 \\bmod B$, as TRL
      does). Needed by `loss_type="kto"`; `None` for `"apo_zero_unpaired"`.
    - `ref_logp`, `ref_kl_logp`: `[B]` cached reference log-probabilities of the rows
      and of the mismatched rows (`compute_kto_reference_logps`); `None`: the step
      computes them with its `reference=` model.

    Checked at construction like the other batches (`rlhf_eqx.SequenceBatch`): ranks,
    dtypes and shared shapes; the three `kl_*` fields come together or not at all.
    """

    tokens: Int[Array, "B T"]
    mask: Bool[Array, "B T"]
    completion_mask: Bool[Array, "B T"]
    label: Bool[Array, " B"]
    kl_tokens: Int[Array, "B T2"] | None = None
    kl_mask: Bool[Array, "B T2"] | None = None
    kl_completion_mask: Bool[Array, "B T2"] | None = None
    ref_logp: Float[Array, " B"] | None = None
    ref_kl_logp: Float[Array, " B"] | None = None

    def __check_init__(self):
        kind = type(self).__name__
        _validate(self, ("tokens",), ("mask", "completion_mask"), ("ref_logp", "ref_kl_logp"))
        _validate(self, ("kl_tokens",), ("kl_mask", "kl_completion_mask"))
        kl = (self.kl_tokens, self.kl_mask, self.kl_completion_mask)
        if any(x is None for x in kl) and not all(x is None for x in kl):
            raise DataError(
                f"{kind}.kl_tokens, kl_mask and kl_completion_mask must be given together"
            )
        rows = self.tokens.shape[0] if _is_array(self.tokens) else None
        if _is_array(self.kl_tokens) and rows is not None and self.kl_tokens.shape[0] != rows:
            raise DataError(
                f"{kind}.kl_tokens has {self.kl_tokens.shape[0]} rows but {kind}.tokens has "
                f"{rows}; every example needs one mismatched row"
            )
        label = self.label
        if _is_array(label):
            if np.dtype(label.dtype) != np.bool_:
                raise DataError(
                    f"{kind}.label must be boolean (true: desirable), got dtype {label.dtype}"
                )
            if len(label.shape) != 1 or (rows is not None and label.shape[0] != rows):
                raise DataError(
                    f"{kind}.label has shape {tuple(label.shape)}; expected ({rows},), one "
                    "label per row"
                )
