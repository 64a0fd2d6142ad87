"""Supervised fine-tuning: token NLL on the completion tokens."""

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import PRNGKeyArray, PyTree

from ..data import SequenceBatch
from ..losses import aggregate_parts, sft_nll
from ..ops import logprobs_from_logits, masked_sum, previous_real_index
from ._accumulate import policy_logits
from ._builder import step_builder
from ._settings import SFTSettings, StepOptions, settings_from
from ._state import combine
from ._step import LossFn, Step, make_step


def sft_loss(settings: SFTSettings | None = None, **shortcuts: Any) -> LossFn:
    r"""The SFT loss function for `make_step`:
    $\mathrm{aggregate}_{\rm mode}\big(-\log\pi_\theta(y_t \mid y_{<t})\big)$ over the
    completion tokens (`batch.completion_mask & batch.mask`) of a `SequenceBatch`, with
    `settings` (an `SFTSettings`, or its fields as keywords).

    Metrics: `nll` (token mean), `mean_token_accuracy`, `num_tokens` (per batch).
    """
    s = settings_from(SFTSettings, settings, shortcuts, where="sft_loss")
    mode, constant = s.mode, s.constant

    def loss_fn(params: PyTree, frozen: PyTree, batch: SequenceBatch, key: PRNGKeyArray | None):
        model = combine(params, frozen)
        logits = policy_logits(model, batch.tokens, batch.mask, key)
        logp = jax.vmap(logprobs_from_logits)(logits, batch.tokens, batch.mask)
        m = batch.completion_mask & batch.mask
        nll = jax.vmap(sft_nll)(logp, m)
        num, den = aggregate_parts(nll, m, mode=mode, constant=constant)
        prev, _ = jax.vmap(previous_real_index)(batch.mask)
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

    **Returns:** `step(params, opt_state, batch: SequenceBatch, *, frozen=None, key=None)
    -> (params, opt_state, metrics)`, one `eqx.filter_jit` region. `params` is the
    trainable part of the model (or the whole model) and `frozen` the rest; the model
    is any callable `(tokens, mask) -> logits [T, V]`; `key` (optional) is split per row
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
        batch_type=SequenceBatch,
        cache_key=("sft", settings),
    )
