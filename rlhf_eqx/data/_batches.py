"""Fixed-shape batch pytrees shared by the data readers (producers) and the steps (consumers).

Every field carries a leading batch axis `B`. Sequences are right-padded (real tokens
first, then padding) unless stated otherwise; the models accept any padding, because
positions come from the mask.

**Validation.** A batch checks itself when it is constructed (`__check_init__`), from
static shapes and dtypes only, so construction works the same under `jax.jit`,
`jax.vmap` and `eqx.tree_at`: token fields must be integer arrays of rank 2, masks
boolean arrays of the same shape, cached reference log-probabilities floating arrays of
shape `[B]`, and neither `B` nor `T` may be 0. A field whose shape or dtype disagrees
with its annotation (a mask of another shape than the tokens) raises jaxtyping's
`TypeCheckError` first, with the runtime shape checks on (the default); what the
annotations cannot say (`B` or `T` of 0), and every case with the checks off, is a
`DataError` (a `ValueError`) naming the batch, the field and the shapes. Only array
fields are checked; other leaves (such as
the integers of an `in_axes` specification, or `None` for an optional field) pass
untouched. Transformations that rebuild a batch from its leaves (`jax.tree.map`,
`jax.vmap` of a per-sample function, which sees a batch without its leading axis,
`eqx.tree_at`, micro-batch reshapes) do not construct it again and are not checked.
"""

import equinox as eqx
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from ._errors import DataError


def _is_array(x: object) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _validate(
    batch: eqx.Module,
    tokens: tuple[str, ...],
    masks: tuple[str, ...],
    per_row: tuple[str, ...] = (),
) -> None:
    """Check ranks, dtypes and shared shapes of a batch's array fields (static only)."""
    kind = type(batch).__name__
    shape: tuple[int, ...] | None = None
    first = ""
    for name in tokens + masks:
        x = getattr(batch, name)
        if not _is_array(x):
            continue
        if len(x.shape) != 2:
            raise DataError(
                f"{kind}.{name} must be a batch of sequences [B, T], got shape "
                f"{tuple(x.shape)} (an unbatched row? add a leading batch axis)"
            )
        if name in tokens and not np.issubdtype(np.dtype(x.dtype), np.integer):
            raise DataError(f"{kind}.{name} must hold integer token ids, got dtype {x.dtype}")
        if name in masks and np.dtype(x.dtype) != np.bool_:
            raise DataError(
                f"{kind}.{name} must be a boolean mask, got dtype {x.dtype} "
                "(convert with `mask.astype(bool)`)"
            )
        if shape is None:
            shape, first = tuple(x.shape), name
            if 0 in shape:
                raise DataError(
                    f"{kind}.{name} has shape {shape}: a batch needs at least one row "
                    "and one position"
                )
        elif tuple(x.shape) != shape:
            raise DataError(
                f"{kind}.{name} has shape {tuple(x.shape)} but {kind}.{first} has shape "
                f"{shape}; every field must have the same [B, T]"
            )
    for name in per_row:
        x = getattr(batch, name)
        if not _is_array(x):
            continue
        if not np.issubdtype(np.dtype(x.dtype), np.floating):
            raise DataError(f"{kind}.{name} must be floating point, got dtype {x.dtype}")
        if shape is not None and tuple(x.shape) != shape[:1]:
            raise DataError(
                f"{kind}.{name} has shape {tuple(x.shape)} but the batch has "
                f"B={shape[0]} rows ({kind}.{first} has shape {shape}); expected ({shape[0]},)"
            )


class SequenceBatch(eqx.Module):
    """Prompt + completion sequences for supervised fine-tuning.

    `mask` marks real tokens; `completion_mask` marks the tokens the loss is taken on
    (a subset of `mask`).
    """

    tokens: Int[Array, "B T"]
    mask: Bool[Array, "B T"]
    completion_mask: Bool[Array, "B T"]

    def __check_init__(self):
        _validate(self, ("tokens",), ("mask", "completion_mask"))


class PreferenceBatch(eqx.Module):
    """Preference pairs: the same prompt followed by a chosen and a rejected completion.

    `ref_chosen_logp` / `ref_rejected_logp` hold the reference model's summed completion
    log-probabilities when they were computed once and cached; `None` means the step
    computes them on the fly.
    """

    chosen_tokens: Int[Array, "B T"]
    chosen_mask: Bool[Array, "B T"]
    chosen_completion_mask: Bool[Array, "B T"]
    rejected_tokens: Int[Array, "B T"]
    rejected_mask: Bool[Array, "B T"]
    rejected_completion_mask: Bool[Array, "B T"]
    ref_chosen_logp: Float[Array, " B"] | None = None
    ref_rejected_logp: Float[Array, " B"] | None = None

    def __check_init__(self):
        _validate(
            self,
            ("chosen_tokens", "rejected_tokens"),
            (
                "chosen_mask",
                "chosen_completion_mask",
                "rejected_mask",
                "rejected_completion_mask",
            ),
            ("ref_chosen_logp", "ref_rejected_logp"),
        )


class PackedPreferenceBatch(eqx.Module):
    """Preference pairs packed with a shared prompt: `[prompt | chosen | rejected]` per pair.

    Each pair's prompt is stored once, followed by its chosen and its rejected
    completion; `branch_ids` say which is which (0 prompt, 1 chosen, 2 rejected) and the
    model lets each completion attend to the prompt and to itself only
    (`rlhf_eqx.models.attention_layout`), with the positions it would have in its own
    row. Per pair, the prompt's keys and values are computed once instead of twice, and
    the log-probabilities are those of the unpacked `PreferenceBatch` (`data.pack_preferences`
    builds this batch; `data.packed_from_preferences` converts one):

    ```
    tokens        [BOS p p p | c c EOS | r r r EOS | BOS p p | c EOS | r EOS | pad]
    branch_ids    [ 0  0 0 0 | 1 1  1  | 2 2 2  2  |  0  0 0 | 1  1  | 2  2  |  0 ]
    segment_ids   [ 0  0 0 0 | 0 0  0  | 0 0 0  0  |  1  1 1 | 1  1  | 1  1  |  0 ]
    ```

    A row holds up to `K` pairs, told apart by `segment_ids` (`0 ... K-1`); `pairs[r, k]`
    says whether slot `k` of row `r` holds a pair. With `regions=(P, C, R)` (static;
    `pack_preferences(..., aligned=True)`) every row holds one pair at fixed offsets —
    prompt in `[0, P)`, chosen in `[P, P + C)`, rejected after, each right-padded — and
    the model scores each completion only against the prompt and itself
    (`region_attention`): no work goes to one completion against the other. `completion_mask` marks
    the tokens scored (each completion with its EOS). `ref_chosen_logp` / `ref_rejected_logp`
    (`[R, K]`) hold cached reference log-probabilities, as in `PreferenceBatch`.
    """

    tokens: Int[Array, "R L"]
    mask: Bool[Array, "R L"]
    completion_mask: Bool[Array, "R L"]
    segment_ids: Int[Array, "R L"]
    branch_ids: Int[Array, "R L"]
    pairs: Bool[Array, "R K"]
    ref_chosen_logp: Float[Array, "R K"] | None = None
    ref_rejected_logp: Float[Array, "R K"] | None = None
    regions: tuple[int, int, int] | None = eqx.field(static=True, default=None)

    def __check_init__(self):
        _validate(self, ("tokens", "segment_ids", "branch_ids"), ("mask", "completion_mask"))
        if self.regions is not None:
            regions = self.regions
            ok = len(regions) == 3 and all(isinstance(r, int) and r >= 0 for r in regions)
            L = self.tokens.shape[-1] if _is_array(self.tokens) else None
            if not ok or (L is not None and sum(regions) != L):
                raise DataError(
                    f"{type(self).__name__}.regions={regions!r} must be three non-negative "
                    f"ints (prompt, chosen, rejected) adding up to the row length {L}"
                )
            if _is_array(self.pairs) and self.pairs.shape[-1] != 1:
                raise DataError(f"{type(self).__name__}.regions needs one pair per row (K = 1)")
        kind = type(self).__name__
        rows = self.tokens.shape[0] if _is_array(self.tokens) else None
        pairs = self.pairs
        if _is_array(pairs):
            if len(pairs.shape) != 2 or np.dtype(pairs.dtype) != np.bool_ or 0 in pairs.shape:
                raise DataError(
                    f"{kind}.pairs must be a boolean [R, K] array with K >= 1, got "
                    f"{pairs.dtype} of shape {tuple(pairs.shape)}"
                )
            if rows is not None and pairs.shape[0] != rows:
                raise DataError(
                    f"{kind}.pairs has {pairs.shape[0]} rows but {kind}.tokens has {rows}"
                )
        for name in ("ref_chosen_logp", "ref_rejected_logp"):
            x = getattr(self, name)
            if _is_array(x) and _is_array(pairs) and tuple(x.shape) != tuple(pairs.shape):
                raise DataError(
                    f"{kind}.{name} has shape {tuple(x.shape)}; expected {tuple(pairs.shape)} "
                    "(one value per pair slot, like `pairs`)"
                )
            if _is_array(x) and not np.issubdtype(np.dtype(x.dtype), np.floating):
                raise DataError(f"{kind}.{name} must be floating point, got dtype {x.dtype}")

    @property
    def num_slots(self) -> int:
        """`K`, the pair slots per row."""
        return self.pairs.shape[-1]


class PromptBatch(eqx.Module):
    """Left-padded prompts for generation (PPO / GRPO rollouts)."""

    tokens: Int[Array, "B P"]
    mask: Bool[Array, "B P"]

    def __check_init__(self):
        _validate(self, ("tokens",), ("mask",))
