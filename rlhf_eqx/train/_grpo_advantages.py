"""The GRPO batch (sampled groups with their rewards and log-probabilities) and its
group-relative advantages."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ..losses import group_advantages
from ._group_logps import check_shared_prompts
from ._rl_settings import AdvantageScale
from ._validation import check_positive_int


class GRPOBatch(eqx.Module):
    """Sampled completions of a GRPO step: `B = n_prompts * G` rows, groups contiguous.

    - `tokens`, `mask`, `completion_mask`: prompt + completion, real tokens, and the
      completion tokens.
    - `rewards`: `[B]` scalar rewards (e.g. exact-match answers); the step turns them
      into group-relative advantages. Or give `advantages` directly (e.g. RLOO).
    - `old_logp`: `[B, T]` log-probabilities at sampling time (`None`: on-policy, the
      ratio is 1 with the gradient of $\\log\\pi_\\theta$, TRL's single-iteration case).
    - `ref_logp`: `[B, T]` reference log-probabilities (for the KL term; `None`: the
      step computes them from its `reference=` model if `beta != 0`).
    - `truncated`: `[B]` completions cut at the length limit (no EOS).
    - `prompt_length`, `samples_per_prompt` (static, both or neither): each group of
      `samples_per_prompt` consecutive rows holds the same prompt in positions
      `[0, prompt_length)` and only completions after it, as `generate_batch(...,
      num_samples=G)` returns them. The step then runs each prompt once, its `G`
      completions packed after it (shared-prefix packing, as for
      `PackedPreferenceBatch`), for the same loss and gradients with a policy that
      meets `AbstractSelectiveLM`. Checked when the batch is built from concrete
      arrays (a `DataError` names the group).
    - `behaviour_logp`: `[B, T]` log-probabilities of the policy that sampled the
      completions, when it differs from the trainer's (another engine, a lower precision,
      stale parameters; veRL `rollout_log_probs`). The step then logs the mismatch
      metrics, and corrects the loss with the step's `rollout_correction`.
    """

    tokens: Int[Array, "B T"]
    mask: Bool[Array, "B T"]
    completion_mask: Bool[Array, "B T"]
    rewards: Float[Array, " B"] | None = None
    advantages: Float[Array, " B"] | None = None
    old_logp: Float[Array, "B T"] | None = None
    ref_logp: Float[Array, "B T"] | None = None
    truncated: Bool[Array, " B"] | None = None
    prompt_length: int | None = eqx.field(static=True, default=None)
    samples_per_prompt: int | None = eqx.field(static=True, default=None)
    behaviour_logp: Float[Array, "B T"] | None = None

    def __check_init__(self):
        check_shared_prompts(self)


def grpo_advantages(
    rewards: Float[Array, " B"],
    *,
    group_size: int,
    scale: AdvantageScale = "group",
    eps: float = 1e-4,
    axis_name: str | None = None,
) -> Float[Array, " B"]:
    """Group-relative advantages of a flat batch whose consecutive `group_size` rows share
    a prompt: `group_advantages` on the rewards reshaped to `[B / G, G]`, flattened back.

    With `axis_name` (inside `jax.pmap`), `scale="batch"` divides by the standard
    deviation of the rewards of **every** device, as on one device with the whole batch;
    groups never straddle devices, so the other scales are local.
    """
    check_positive_int("group_size", group_size)
    (B,) = rewards.shape
    if B % group_size != 0:
        raise ValueError(f"batch size {B} is not a multiple of group_size={group_size}")
    grouped = rewards.reshape(B // group_size, group_size)
    if scale != "batch" or axis_name is None:
        return group_advantages(grouped, scale=scale, eps=eps).reshape(B)
    centred = group_advantages(grouped, scale="none").reshape(B)
    n, s = jax.lax.psum((jnp.asarray(B, rewards.dtype), jnp.sum(rewards)), axis_name)
    ss = jax.lax.psum(jnp.sum(jnp.square(rewards - s / n)), axis_name)
    var = ss / jnp.maximum(n - 1, 1)
    positive = (var > 0) & (n > 1)
    std = jnp.where(positive, jnp.sqrt(jnp.where(positive, var, 1.0)), 0.0)
    return centred / (std + eps)
