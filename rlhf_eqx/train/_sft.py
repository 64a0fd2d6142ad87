"""Supervised fine-tuning step: token NLL on the completion tokens."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jaxtyping import PRNGKeyArray, PyTree

from .._batches import SequenceBatch
from ..losses import AggregationMode, aggregate_parts, safe_divide, sft_nll
from ..ops import logprobs_from_logits, masked_sum, previous_real_index
from ._accumulate import accumulate_gradients, apply_optimizer, make_jitted, sums_to_means, vmap_model
from ._state import combine

__all__ = ["make_sft_step"]


def make_sft_step(
    optimizer: optax.GradientTransformation,
    *,
    mode: AggregationMode = "token-mean",
    constant: float | None = None,
    micro_batches: int = 1,
    donate: bool = True,
) -> Callable[..., tuple[PyTree, Any, dict]]:
    r"""Build the supervised fine-tuning update.

    $$\mathcal{L}(\theta) = \mathrm{aggregate}_{\rm mode}\big(-\log\pi_\theta(y_t \mid y_{<t})\big)$$

    over the completion tokens (`batch.completion_mask & batch.mask`); with the default
    `"token-mean"` this is the cross-entropy of TRL's `SFTTrainer` (`completion_only_loss`).

    **Arguments:**

    - `optimizer`: e.g. from `make_optimizer`.
    - `mode`, `constant`: aggregation (see `rlhf_eqx.losses.aggregate_parts`).
    - `micro_batches`: split each batch into this many micro-batches and accumulate
      (same loss and gradient as the full batch; the batch size must be divisible).
    - `donate`: donate the buffers of `params` and `opt_state` to the update.

    **Returns:** a pure function

    ```python
    step(params, opt_state, batch: SequenceBatch, *, frozen=None, key=None)
        -> (params, opt_state, metrics)
    ```

    compiled as one `eqx.filter_jit` region. `params` is the trainable part of the model
    (or the whole model) and `frozen` the rest (`eqx.combine(params, frozen)` is called
    inside the step; `TrainState.apply` passes both). The model is any callable
    `(tokens, mask) -> logits [T, V]`; `key` (optional) is split per row and passed as
    `key=` (e.g. LoRA dropout). Metrics (float32 scalars): `loss`, `nll` (token mean),
    `mean_token_accuracy`, `num_tokens`, `grad_norm`, `learning_rate` (when the
    optimiser injects it).
    """

    def update(rest, params, opt_state):
        batch, frozen, key = rest
        full_mask = batch.completion_mask & batch.mask
        _, denom = aggregate_parts(
            jnp.zeros(full_mask.shape, jnp.float32), full_mask, mode=mode, constant=constant
        )

        def contribution(p, mb, k):
            model = combine(p, frozen)
            logits = vmap_model(model, mb.tokens, mb.mask, k)
            logp = jax.vmap(logprobs_from_logits)(logits, mb.tokens, mb.mask)
            m = mb.completion_mask & mb.mask
            nll = jax.vmap(sft_nll)(logp, m)
            num, _ = aggregate_parts(nll, m, mode=mode, constant=constant)
            prev, _ = jax.vmap(previous_real_index)(mb.mask)
            pred = jnp.take_along_axis(jnp.argmax(logits, axis=-1), prev, axis=-1)
            correct = (pred == mb.tokens).astype(jnp.float32)
            count = jnp.sum(m).astype(jnp.float32)
            sums = {
                "nll": (jax.lax.stop_gradient(masked_sum(nll, m)), count),
                "mean_token_accuracy": (masked_sum(correct, m), count),
            }
            return safe_divide(num, denom), (sums, {})

        loss, grads, sums, _ = accumulate_gradients(
            contribution, params, batch, micro_batches=micro_batches, key=key
        )
        params, opt_state, opt_metrics = apply_optimizer(optimizer, params, opt_state, grads)
        metrics = {
            "loss": loss,
            **sums_to_means(sums),
            "num_tokens": jnp.sum(full_mask).astype(jnp.float32),
            **opt_metrics,
        }
        return params, opt_state, metrics

    jitted = make_jitted(update, donate=donate)

    def step(
        params: PyTree,
        opt_state: Any,
        batch: SequenceBatch,
        *,
        frozen: PyTree = None,
        key: PRNGKeyArray | None = None,
    ) -> tuple[PyTree, Any, dict]:
        return jitted((batch, frozen, key), params, opt_state)

    return step
