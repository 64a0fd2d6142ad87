"""Supervised fine-tuning: per-token negative log-likelihood."""

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float


def sft_nll(logp: Float[Array, " T"], mask: Bool[Array, " T"]) -> Float[Array, " T"]:
    r"""Per-token negative log-likelihood $-\log \pi_\theta(y_t \mid y_{<t})$, 0 where masked.

    The SFT objective (and the NLL term of RPO / ORPO) is its aggregate over the batch,
    usually `aggregate(..., mode="token-mean")`, which is the cross-entropy of TRL's
    `SFTTrainer`.

    **Arguments:**

    - `logp`: token log-probabilities `[T]` (e.g. from `rlhf_eqx.token_logprobs`).
    - `mask`: `[T]`, true on the tokens that are trained on (usually the completion).

    **Returns:** `[T]` per-token NLL.
    """
    return jnp.where(mask, -logp, jnp.zeros_like(logp))
