"""The batch of the distillation steps (`DistillBatch`) and the helpers both steps share:
the vocabulary check and the mask of the scored completion tokens."""

from collections.abc import Callable

import equinox as eqx
import jax
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from ..data._batches import _validate
from ..data._errors import DataError
from ..models import AbstractDecoder
from ..ops import previous_real_index
from ._accumulate import vmap_model


def _is_array(x: object) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


class DistillBatch(eqx.Module):
    """Sequences (prompt + completion) on which a student is distilled from a teacher.

    - `tokens`, `mask`, `completion_mask`: `[B, T]` ids, real tokens, and the completion
      tokens the loss is taken on (as `SequenceBatch`; from a dataset, or a student's
      `generate_batch` output).
    - `teacher_logits`: `[B, T, V]` cached teacher logits, aligned with the model's
      output (`teacher_logits[b, s]` predicts the token after position `s`); `None`
      (default): the GKD step runs its `teacher=` model. Only `make_distill_step` reads it.
    - `old_logp`: `[B, T]` log-probabilities of the tokens under the student when they
      were sampled (`GenerationOutput.logprobs`); `None`: on-policy, the current student
      (importance ratio 1). Only `make_onpolicy_distill_step` reads it.
    - `teacher_logp`: `[B, T]` cached teacher log-probabilities of the tokens; `None`: the
      on-policy step runs its `teacher=` model. Only `make_onpolicy_distill_step` reads it.

    Shapes and dtypes are checked at construction (a `DataError` names the field).
    """

    tokens: Int[Array, "B T"]
    mask: Bool[Array, "B T"]
    completion_mask: Bool[Array, "B T"]
    teacher_logits: Float[Array, "B T V"] | None = None
    old_logp: Float[Array, "B T"] | None = None
    teacher_logp: Float[Array, "B T"] | None = None

    def __check_init__(self):
        _validate(self, ("tokens",), ("mask", "completion_mask"))
        shape = tuple(self.tokens.shape) if _is_array(self.tokens) else None
        for name in ("teacher_logits", "old_logp", "teacher_logp"):
            x = getattr(self, name)
            if not _is_array(x):
                continue
            if not np.issubdtype(np.dtype(x.dtype), np.floating):
                raise DataError(f"DistillBatch.{name} must be floating point, got dtype {x.dtype}")
            got = tuple(x.shape)
            if name == "teacher_logits":
                ok = len(got) == 3 and (shape is None or got[:2] == shape)
                want = "[B, T, V]"
            else:
                ok = len(got) == 2 and (shape is None or got == shape)
                want = "[B, T]"
            if not ok:
                raise DataError(
                    f"DistillBatch.{name} has shape {got}; expected {want} with "
                    f"[B, T] = {shape} (the shape of DistillBatch.tokens)"
                )


def _check_vocab(student: int, teacher: int) -> None:
    if student != teacher:
        raise ValueError(
            f"teacher vocab_size={teacher} differs from student vocab_size={student}: "
            "distillation compares next-token distributions over one shared vocabulary "
            "(use a teacher with the student's tokenizer)"
        )


def _vocab_size(model: Callable[..., Array], tokens: Array, mask: Array) -> int:
    """The size of `model`'s output distribution (from its shape only: nothing runs)."""
    if isinstance(model, AbstractDecoder):
        return int(model.vocab_size)
    out = eqx.filter_eval_shape(vmap_model, model, tokens[:1], mask[:1], None)
    return int(out.shape[-1])


def _loss_mask(batch: DistillBatch) -> tuple[Bool[Array, "B T"], Int[Array, "B T"]]:
    """Completion tokens that have a real token before them (so a prediction), and for each
    position the index of that earlier token."""
    prev, has_prev = jax.vmap(previous_real_index)(batch.mask)
    return batch.completion_mask & batch.mask & has_prev, prev
