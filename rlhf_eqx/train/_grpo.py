"""GRPO-family step: group-relative advantages and the clipped token/sequence-level loss."""

from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray, PyTree

from ..losses import (
    AggregationMode,
    aggregate_parts,
    group_advantages,
    grpo_policy_loss,
    mask_truncated,
    safe_divide,
)
from ..ops import entropy_from_logits, logprobs_from_logits, masked_sum
from ._accumulate import (
    accumulate_gradients,
    apply_optimizer,
    make_jitted,
    sums_to_means,
    vmap_model,
)
from ._state import combine

__all__ = ["GRPOBatch", "grpo_advantages", "make_grpo_step"]


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
    """

    tokens: Int[Array, "B T"]
    mask: Bool[Array, "B T"]
    completion_mask: Bool[Array, "B T"]
    rewards: Float[Array, " B"] | None = None
    advantages: Float[Array, " B"] | None = None
    old_logp: Float[Array, "B T"] | None = None
    ref_logp: Float[Array, "B T"] | None = None
    truncated: Bool[Array, " B"] | None = None


def grpo_advantages(
    rewards: Float[Array, " B"],
    *,
    group_size: int,
    scale: Literal["group", "batch", "none"] = "group",
    eps: float = 1e-4,
) -> Float[Array, " B"]:
    """Group-relative advantages of a flat batch whose consecutive `group_size` rows share
    a prompt: `group_advantages` on the rewards reshaped to `[B / G, G]`, flattened back.
    """
    (B,) = rewards.shape
    if B % group_size != 0:
        raise ValueError(f"batch size {B} is not a multiple of group_size={group_size}")
    grouped = rewards.reshape(B // group_size, group_size)
    return group_advantages(grouped, scale=scale, eps=eps).reshape(B)


def make_grpo_step(
    optimizer: optax.GradientTransformation,
    *,
    group_size: int,
    scale: Literal["group", "batch", "none"] = "group",
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    importance: Literal["token", "sequence"] = "token",
    beta: float = 0.0,
    delta: float | None = None,
    mode: AggregationMode = "seq-mean-token-mean",
    constant: float | None = None,
    mask_truncated_completions: bool = False,
    micro_batches: int = 1,
    donate: bool = True,
) -> Callable[..., tuple[PyTree, Any, dict]]:
    r"""Build the GRPO-family update (Shao et al. 2024; TRL `GRPOTrainer`).

    Advantages are computed once on the **full** batch (`grpo_advantages` of
    `batch.rewards`, or `batch.advantages` as given); the loss is
    `aggregate_mode(grpo_policy_loss(...))` over the completion tokens. Variants:

    - DAPO (Yu et al. 2025): `clip_eps_high > clip_eps_low` (clip-higher),
      `mode="token-mean"`, `mask_truncated_completions=True` (overlong filtering);
    - Dr.GRPO (Liu et al. 2025): `scale="none"`, `mode="seq-mean-token-sum-norm"`
      with `constant` = the maximum completion length;
    - GSPO (Zheng et al. 2025): `importance="sequence"`;
    - KL to a reference: `beta > 0` (k3 estimator; reference log-probabilities from
      `batch.ref_logp`, or from the step's `reference=` model when that is `None`).

    **Arguments:** `group_size` $G$ (rows `i*G : (i+1)*G` share a prompt), `scale`
    (see `group_advantages`), `clip_eps_low`, `clip_eps_high` (`None`: same as low),
    `importance`, `beta`, `delta` (see `grpo_policy_loss`), `mode` / `constant` (see
    `aggregate_parts`), `mask_truncated_completions`, `micro_batches`, `donate` (see
    `make_sft_step`).

    **Returns:**

    ```python
    step(params, opt_state, batch: GRPOBatch, *, frozen=None, reference=None, key=None)
        -> (params, opt_state, metrics)
    ```

    one `eqx.filter_jit` region. Metrics (token means over the completion tokens that
    count): `loss`, `clip_ratio` (and `clip_ratio/low_mean`, `clip_ratio/high_mean`),
    `kl` (k3 to the reference, 0 without one), `entropy`, `reward` (mean), `reward_std`
    (mean of the per-group standard deviations, as TRL),
    `advantages/std`, `grad_norm`, `learning_rate`.
    """
    eps_high = clip_eps_low if clip_eps_high is None else clip_eps_high

    def update(rest, params, opt_state):
        batch, frozen, ref_model, key = rest
        if batch.advantages is not None:
            adv = batch.advantages.astype(jnp.float32)
        elif batch.rewards is not None:
            adv = grpo_advantages(batch.rewards.astype(jnp.float32), group_size=group_size, scale=scale)
        else:
            raise ValueError("GRPOBatch needs `rewards` or `advantages`")
        loss_mask = batch.completion_mask & batch.mask
        if mask_truncated_completions:
            if batch.truncated is None:
                raise ValueError("mask_truncated_completions=True needs batch.truncated")
            loss_mask = jax.vmap(mask_truncated)(loss_mask, batch.truncated)
        need_ref = beta != 0.0 and batch.ref_logp is None
        if need_ref and ref_model is None:
            raise ValueError("beta != 0 needs batch.ref_logp or the step's `reference=` model")
        _, denom = aggregate_parts(
            jnp.zeros(loss_mask.shape, jnp.float32), loss_mask, mode=mode, constant=constant
        )
        parts = (batch.tokens, batch.mask, loss_mask, adv, batch.old_logp, batch.ref_logp)

        def contribution(p, mb, k):
            tokens, mask, m, a, old_logp, ref_logp = mb
            model = combine(p, frozen)
            logits = vmap_model(model, tokens, mask, k)
            logp = jax.vmap(logprobs_from_logits)(logits, tokens, mask)
            if old_logp is None:
                old_logp = jax.lax.stop_gradient(logp)
            if need_ref:
                ref_logits = vmap_model(ref_model, tokens, mask, None)
                ref_logp = jax.vmap(logprobs_from_logits)(ref_logits, tokens, mask)
            if ref_logp is not None:
                ref_logp = jax.lax.stop_gradient(ref_logp.astype(jnp.float32))

            def one(lp, olp, adv_i, mi, rlp):
                return grpo_policy_loss(
                    lp,
                    olp,
                    adv_i,
                    mi,
                    clip_eps=clip_eps_low,
                    clip_eps_high=eps_high,
                    importance=importance,
                    ref_logp=rlp,
                    beta=beta,
                    delta=delta,
                )

            if ref_logp is None:
                per_token, stats = jax.vmap(lambda a_, b_, c_, d_: one(a_, b_, c_, d_, None))(
                    logp, old_logp.astype(jnp.float32), a, m
                )
            else:
                per_token, stats = jax.vmap(one)(logp, old_logp.astype(jnp.float32), a, m, ref_logp)
            num, _ = aggregate_parts(per_token, m, mode=mode, constant=constant)
            ent = jax.vmap(entropy_from_logits)(logits, m)
            n = jnp.sum(m).astype(jnp.float32)
            sg = jax.lax.stop_gradient
            sums = {
                "clip_ratio": (masked_sum(stats["clipped"], m), n),
                "clip_ratio/low_mean": (masked_sum(stats["clipped_low"], m), n),
                "clip_ratio/high_mean": (masked_sum(stats["clipped_high"], m), n),
                "kl": (sg(masked_sum(stats["kl"], m)), n),
                "entropy": (sg(masked_sum(ent, m)), n),
            }
            return safe_divide(num, denom), (sums, {})

        loss, grads, sums, _ = accumulate_gradients(
            contribution, params, parts, micro_batches=micro_batches, key=key
        )
        params, opt_state, opt_metrics = apply_optimizer(optimizer, params, opt_state, grads)
        metrics = {"loss": loss}
        metrics.update(sums_to_means(sums))
        if batch.rewards is not None:
            rewards = batch.rewards.astype(jnp.float32)
            metrics["reward"] = jnp.mean(rewards)
            if group_size > 1:
                grouped = rewards.reshape(-1, group_size)
                metrics["reward_std"] = jnp.mean(jnp.std(grouped, axis=-1, ddof=1))
            else:
                metrics["reward_std"] = jnp.zeros((), jnp.float32)
        metrics["advantages/std"] = jnp.std(adv)
        metrics.update(opt_metrics)
        return params, opt_state, metrics

    jitted = make_jitted(update, donate=donate)

    def step(
        params: PyTree,
        opt_state: Any,
        batch: GRPOBatch,
        *,
        frozen: PyTree = None,
        reference: PyTree = None,
        key: PRNGKeyArray | None = None,
    ) -> tuple[PyTree, Any, dict]:
        return jitted((batch, frozen, reference, key), params, opt_state)

    return step
