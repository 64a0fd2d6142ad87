"""Fixed-shape batch pytrees shared by the data readers (producers) and the steps (consumers).

Every field carries a leading batch axis `B`. Sequences are right-padded (real tokens
first, then padding) unless stated otherwise; the models accept any padding, because
positions come from the mask.
"""

import equinox as eqx
from jaxtyping import Array, Bool, Float, Int

__all__ = ["SequenceBatch", "PreferenceBatch", "PromptBatch"]


class SequenceBatch(eqx.Module):
    """Prompt + completion sequences for supervised fine-tuning.

    `mask` marks real tokens; `completion_mask` marks the tokens the loss is taken on
    (a subset of `mask`).
    """

    tokens: Int[Array, "B T"]
    mask: Bool[Array, "B T"]
    completion_mask: Bool[Array, "B T"]


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


class PromptBatch(eqx.Module):
    """Left-padded prompts for generation (PPO / GRPO rollouts)."""

    tokens: Int[Array, "B P"]
    mask: Bool[Array, "B P"]
