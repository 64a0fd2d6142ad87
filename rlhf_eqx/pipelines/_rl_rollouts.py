"""What the reinforcement-learning stages share (PPO, GRPO, the multi-turn stages): the
policy with its reference, sampling a rollout and the reference's log-probabilities of
it, and the per-token KL the KL guard reads."""

from collections.abc import Sequence

import jax
import jax.numpy as jnp

import rlhf_eqx as rx
from rlhf_eqx import distributed as dist

from ._config import (
    LoRASettings,
)
from ._rollout import (
    PendingRollout,
    Rollout,
    dispatch_rollout,
    finish_rollout,
    sampling_options,
    token_logps,
)
from ._runs import RunContext, rows_at, with_lora


def _policy_and_reference(policy, lora: LoRASettings, key: jax.Array):
    """`(trained policy, its filter spec, reference)`: the policy with LoRA adapters and
    the reference as that policy with its adapters off (the same base arrays); with
    `lora.rank == 0`, the policy itself, spec `None` (every weight trains) and the
    untouched `policy` as reference."""
    pol, spec = with_lora(policy, lora, key)
    return pol, spec, (rx.without_lora(pol) if spec is not None else policy)


def _per_token_kl(logp, ref_logp, mask) -> float:
    logp, ref_logp, m = dist.to_host((logp, ref_logp, mask))  # rows on every process's devices
    return float(((logp - ref_logp) * m).sum() / max(m.sum(), 1))


def _dispatch_sample(
    model,
    tok,
    prompts: Sequence[str],
    key: jax.Array,
    r: int,
    *,
    ctx: RunContext,
    per_rollout: int,
    group_size: int = 1,
    place=None,
) -> PendingRollout:
    """Dispatch rollout `r`'s sampling: `group_size` completions of each of `per_rollout`
    prompts (rows `rows_at(len(prompts), per_rollout, ctx.ops.seed, r)` of `prompts`)
    from `model` with the run's sampling settings (`finish_rollout` completes it);
    `place` lays the prompts out for the sampler (`dispatch_rollout`)."""
    rows = rows_at(len(prompts), per_rollout, ctx.ops.seed, r)
    return dispatch_rollout(
        model,
        tok,
        [prompts[j] for j in rows],
        key,
        group_size=group_size,
        place=place,
        **sampling_options(ctx),
    )


def _compare(roll: Rollout, reference):
    """The reference's log-probs of `roll`'s completions (0 elsewhere) at the rollout's
    sampling temperature (`roll.temperature`, that of `roll.logprobs` and of the policy's
    log-probs in the steps; TRL's GRPO and PPO temper the reference's logits too, so that
    the policy as it starts is at KL 0) and `info`: the per-token KL of the samples to
    the reference (`kl`, the k1 estimate: GRPO's KL guard measure; PPO replaces it with
    its `kl_estimator`'s, `ppo_rollout_batch`) and the fraction of completions cut at
    `max_new_tokens` (`truncated`)."""
    m = roll.completion_mask & roll.mask
    ref_logp = token_logps(reference, roll.tokens, roll.mask, roll.temperature)
    info = {
        "kl": _per_token_kl(roll.logprobs, ref_logp, m),
        "truncated": float(jnp.mean(roll.truncated.astype(jnp.float32))),
    }
    return jnp.where(m, ref_logp, 0.0), info


def _sample_and_compare(model, reference, tok, prompts, key, r, *, ctx, per_rollout, group_size=1):
    """Rollout `r` (`_dispatch_sample`, finished) and its `_compare` with the reference.

    **Returns:** `(rollout, ref_logp, info)`.
    """
    pending = _dispatch_sample(
        model, tok, prompts, key, r, ctx=ctx, per_rollout=per_rollout, group_size=group_size
    )
    roll = finish_rollout(pending, tok)
    return (roll, *_compare(roll, reference))
