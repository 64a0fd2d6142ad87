"""Supervised fine-tuning: token NLL on the completion tokens, of padded or packed rows."""

import inspect
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray, PyTree

from ..data import PackedSequenceBatch, SequenceBatch
from ..losses import aggregate_parts, sft_nll
from ..models import AbstractBatchedModel
from ..ops import logprobs_from_logits, masked_sum, previous_real_index
from ._accumulate import policy_logits, row_keys
from ._builder import step_builder
from ._settings import SFTSettings, StepOptions, settings_from
from ._state import combine
from ._step import LossFn, Step, make_step


def _takes_segment_ids(model: Any) -> bool:
    """Whether `model(tokens, mask, *, segment_ids=...)` is accepted (e.g. `rlhf_eqx.Policy`)."""
    try:
        params = inspect.signature(model).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "segment_ids" or p.kind is p.VAR_KEYWORD for p in params)


def _segment_logits(
    model: Any, batch: PackedSequenceBatch, key: PRNGKeyArray | None
) -> Float[Array, "R L V"]:
    """The model's logits on packed rows, each token attending within its segment only."""
    if not _takes_segment_ids(model):
        raise ValueError(
            "a PackedSequenceBatch needs a model whose call takes segment_ids (attention "
            f"within each packed sequence), e.g. rlhf_eqx.Policy; {type(model).__name__} "
            "does not: use a SequenceBatch (data.collate_sft)"
        )
    tokens, mask, seg = batch.tokens, batch.mask, batch.segment_ids
    kw = lambda k: {} if k is None else {"key": k}  # noqa: E731
    if isinstance(model, AbstractBatchedModel):
        out = model(tokens, mask, segment_ids=seg, **kw(key))
    else:
        keys = row_keys(key, tokens.shape[0])
        call = lambda t, m, s, k: model(t, m, segment_ids=s, **kw(k))  # noqa: E731
        out = jax.vmap(call, in_axes=(0, 0, 0, None if keys is None else 0))(
            tokens, mask, seg, keys
        )
    shape = tuple(getattr(out, "shape", ()))
    if len(shape) != 3 or shape[:2] != tuple(tokens.shape):
        raise ValueError(
            f"the policy must return next-token logits [T, V] for each sequence: "
            f"{type(model).__name__} returned shape {shape} for tokens of shape "
            f"{tuple(tokens.shape)}"
        )
    return out


def _packed_logprobs(
    model: Any, batch: PackedSequenceBatch, key: PRNGKeyArray | None
) -> tuple[Float[Array, "R L V"], Float[Array, "R L"], Int[Array, "R L"]]:
    """`(logits, logp, prev)` of packed rows: `logp[t]` as `logprobs_from_logits`, but 0
    at each sequence's first token (nothing of its own sequence precedes it), and
    `prev[t]` the position whose logits predict token `t` (its own at a sequence's first
    token, as for the first token of a padded row)."""
    logits = _segment_logits(model, batch, key)
    logp = jax.vmap(logprobs_from_logits)(logits, batch.tokens, batch.mask)
    prev, has_prev = jax.vmap(previous_real_index)(batch.mask)
    seg = batch.segment_ids
    same = has_prev & (jnp.take_along_axis(seg, prev, axis=-1) == seg)
    here = jnp.broadcast_to(jnp.arange(seg.shape[-1], dtype=prev.dtype), prev.shape)
    return logits, jnp.where(same, logp, 0.0), jnp.where(same, prev, here)


def _per_sequence(
    values: Float[Array, "R L"], mask: Bool[Array, "R L"], batch: PackedSequenceBatch
) -> tuple[Float[Array, "RK L"], Bool[Array, "RK L"]]:
    """Per-token values and mask of packed rows as one row per sequence slot, `[R·K, L]`
    (slot `k` of row `r` keeps the tokens of segment `k`), for the per-sequence
    aggregation modes."""
    R, L = values.shape
    K = batch.sequences.shape[-1]
    slots = jnp.arange(K, dtype=batch.segment_ids.dtype)[None, :, None]
    slot = batch.segment_ids[:, None, :] == slots
    per_slot = (mask[:, None, :] & slot).reshape(R * K, L)
    return jnp.broadcast_to(values[:, None, :], (R, K, L)).reshape(R * K, L), per_slot


def sft_loss(settings: SFTSettings | None = None, **shortcuts: Any) -> LossFn:
    r"""The SFT loss function for `make_step`:
    $\mathrm{aggregate}_{\rm mode}\big(-\log\pi_\theta(y_t \mid y_{<t})\big)$ over the
    completion tokens (`batch.completion_mask & batch.mask`) of a `SequenceBatch` or a
    `PackedSequenceBatch`, with `settings` (an `SFTSettings`, or its fields as
    keywords).

    A packed batch (`data.pack_sft`; TRL's `SFTConfig(packing=True,
    packing_strategy="bfd", padding_free=True)`) runs the model with its `segment_ids`:
    each token attends within its own sequence, positions restart at each sequence,
    and no token is predicted from another sequence (a sequence's first token, as an
    unpacked row's, gets log-probability 0). Every aggregation mode is taken per
    sequence, not per row: the sequence means of `"seq-mean-*"` average over the
    sequences present (`batch.sequences`), so the loss, the metrics and the gradient
    equal those of the same sequences unpacked (`data.collate_sft`) to float rounding.
    The one difference: `"seq-mean-token-sum-norm"` without `constant` divides by the
    row length `L` of the batch, which equals the unpacked default `T` when both are
    padded to the same `max_length` (not with `collate_sft(bucket_size=...)`).

    Metrics: `nll` (token mean), `mean_token_accuracy`, `num_tokens` (per batch).
    """
    s = settings_from(SFTSettings, settings, shortcuts, where="sft_loss")
    mode, constant = s.mode, s.constant

    def loss_fn(params: PyTree, frozen: PyTree, batch, key: PRNGKeyArray | None):
        model = combine(params, frozen)
        m = batch.completion_mask & batch.mask
        if isinstance(batch, PackedSequenceBatch):
            logits, logp, prev = _packed_logprobs(model, batch, key)
        else:
            logits = policy_logits(model, batch.tokens, batch.mask, key)
            logp = jax.vmap(logprobs_from_logits)(logits, batch.tokens, batch.mask)
            prev, _ = jax.vmap(previous_real_index)(batch.mask)
        nll = jax.vmap(sft_nll)(logp, m)
        if isinstance(batch, PackedSequenceBatch) and mode != "token-mean":
            num, den = aggregate_parts(*_per_sequence(nll, m, batch), mode=mode, constant=constant)
        else:
            num, den = aggregate_parts(nll, m, mode=mode, constant=constant)
        pred = jnp.take_along_axis(jnp.argmax(logits, axis=-1), prev, axis=-1)
        correct = (pred == batch.tokens).astype(jnp.float32)
        count = jnp.sum(m).astype(jnp.float32)
        metrics = {
            "nll": (masked_sum(nll, m), count),
            "mean_token_accuracy": (masked_sum(correct, m), count),
            "num_tokens": (count, jnp.zeros((), jnp.float32)),  # a total
        }
        return {"nll": num}, {"nll": den}, metrics

    return loss_fn


@step_builder(SFTSettings)
def make_sft_step(optimizer, settings: SFTSettings, options: StepOptions) -> Step:
    r"""Build the supervised fine-tuning update (`make_step` of `sft_loss`).

    $$\mathcal{L}(\theta) =
    \mathrm{aggregate}_{\rm mode}\big(-\log\pi_\theta(y_t \mid y_{<t})\big)$$

    over the completion tokens; with the default `"token-mean"` this is the
    cross-entropy of TRL's `SFTTrainer` (`completion_only_loss`).

    **Arguments:**

    - `settings`: an `SFTSettings` (`mode`, `constant`: the aggregation, see
      `rlhf_eqx.losses.aggregate_parts`).
    - `optimizer`, `options` (a `StepOptions`; with `micro_batches` the batch size must
      be divisible by it) and `**shortcuts` (`mode="token-mean"`, `micro_batches=2`):
      see `step_builder`.

    **Returns:** `step(params, opt_state, batch, *, frozen=None, key=None)
    -> (params, opt_state, metrics)`, one `eqx.filter_jit` region. `batch` is a
    `SequenceBatch` (padded rows) or a `PackedSequenceBatch` (whole sequences packed
    into rows, `data.pack_sft`: TRL's `SFTConfig.packing` with `packing_strategy="bfd"`
    and `padding_free`), whose loss, metrics and gradient equal those of the same
    sequences padded, in every aggregation mode (see `sft_loss`). `params` is the
    trainable part of the model (or the whole model) and `frozen` the rest; the model
    is any callable `(tokens, mask) -> logits [T, V]` (for a packed batch one that also
    takes `segment_ids=`, as `rlhf_eqx.Policy` does); `key` (optional) is split per row
    and passed as `key=` (e.g. LoRA dropout). Metrics: `loss`, `nll` (token mean),
    `mean_token_accuracy`, `num_tokens` (real completion tokens of the global batch),
    `grad_norm`, `learning_rate`, `nonfinite`, `empty_batch`.

    **Empty batches.** A batch with zero rows raises `ValueError` when the step is
    traced. A batch whose completion masks are all false (`num_tokens = 0`) has nothing
    to learn from: the update is skipped and `empty_batch = 1` (see `make_step`).
    """
    return make_step(
        sft_loss(settings),
        optimizer,
        options,
        batch_type=(SequenceBatch, PackedSequenceBatch),
        cache_key=("sft", settings),
    )
