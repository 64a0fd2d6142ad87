"""Reinforcement-learning runs: what PPO and GRPO share (the policy with its reference,
sampling a rollout and its reference log-probs), and PPO with a value model (GRPO is in
`_grpo_runs.py`); the KL guard stops them early."""

import dataclasses
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import rlhf_eqx as rx

from ._config import (
    LoRASettings,
)
from ._lr_scale import build_optimizer
from ._monitor import model_flops
from ._reward_sources import RewardSource, as_reward_source
from ._rollout import (
    PendingRollout,
    RewardFunction,
    Rollout,
    dispatch_rollout,
    finish_rollout,
    sampling_options,
    token_logps,
)
from ._runs import RunContext, RunResult, rows_at, run_loop, take_rows, with_lora
from ._stage_configs import (
    PPOConfig,
)
from ._validation import validate_stage

# --- shared by PPO and GRPO -------------------------------------------------------------


def _policy_and_reference(policy, lora: LoRASettings, key: jax.Array):
    """`(trained policy, its filter spec, reference)`: the policy with LoRA adapters and
    the reference as that policy with its adapters off (the same base arrays); with
    `lora.rank == 0`, the policy itself, spec `None` (every weight trains) and the
    untouched `policy` as reference."""
    pol, spec = with_lora(policy, lora, key)
    return pol, spec, (rx.without_lora(pol) if spec is not None else policy)


def _per_token_kl(logp, ref_logp, mask) -> float:
    m = np.asarray(mask)
    return float(((np.asarray(logp) - np.asarray(ref_logp)) * m).sum() / max(m.sum(), 1))


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
) -> PendingRollout:
    """Dispatch rollout `r`'s sampling: `group_size` completions of each of `per_rollout`
    prompts (rows `rows_at(len(prompts), per_rollout, ctx.ops.seed, r)` of `prompts`)
    from `model` with the run's sampling settings (`finish_rollout` completes it)."""
    rows = rows_at(len(prompts), per_rollout, ctx.ops.seed, r)
    return dispatch_rollout(
        model, tok, [prompts[j] for j in rows], key, group_size=group_size, **sampling_options(ctx)
    )


def _compare(roll: Rollout, reference):
    """The reference's log-probs of `roll`'s completions (0 elsewhere) and `info`: the
    per-token KL of the samples to the reference (`kl`, the KL guard's measure) and the
    fraction of completions cut at `max_new_tokens` (`truncated`)."""
    m = roll.completion_mask & roll.mask
    ref_logp = token_logps(reference, roll.tokens, roll.mask)
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


# --- PPO -------------------------------------------------------------------------------


def run_ppo(
    policy,
    tok,
    prompts: Sequence[str],
    *,
    reward: "RewardSource | rx.RewardModel | Sequence[RewardFunction]",
    cfg: PPOConfig,
    ctx: RunContext,
) -> RunResult:
    """PPO with a value model (RLHF, Ouyang et al. 2022): per rollout, sample one
    completion for each of `cfg.prompts_per_rollout` prompts, score it with `reward` (a
    `RewardSource`: a reward model or ensemble, jitted; a judge; reward functions on the
    decoded text; a process reward model, whose step scores are per-token rewards,
    `add_token_rewards`), compute the reference log-probs, values and GAE advantages
    once (`prepare_ppo_batch`; `old_logp` from the sampler), then `cfg.epochs` x
    `cfg.minibatches` PPO steps. The policy trains
    LoRA adapters (`cfg.lora`; the reference is the policy without them); the value
    model (`ValueModel.from_policy`) trains every weight. Stops early when the per-token
    KL to the reference exceeds `cfg.kl_target`.
    """
    validate_stage("ppo", cfg)
    source = as_reward_source(reward)
    k_lora, k_value, ctx_key = jax.random.split(ctx.key, 3)
    pol, spec, reference = _policy_and_reference(policy, cfg.lora, k_lora)
    value = rx.ValueModel.from_policy(policy, key=k_value)
    total = cfg.rollouts * cfg.epochs * cfg.minibatches
    opt = build_optimizer(cfg.optim, total)
    filter_spec = (spec if spec is not None else eqx.is_inexact_array, eqx.is_inexact_array)
    state = rx.train.init_train_state((pol, value), opt, filter_spec=filter_spec)
    # the sampling temperature has one owner, `sampling.temperature` (the run's context)
    cfg = dataclasses.replace(cfg, temperature=ctx.temperature)
    step = rx.train.make_ppo_step(opt, cfg, options=cfg.options)
    n = cfg.prompts_per_rollout
    mb = n // cfg.minibatches
    rows = cfg.prompts_per_rollout * (ctx.prompt_length + ctx.max_new_tokens)
    n_policy, n_value = rx.count_params(pol), rx.count_params(value)

    def iteration(state, key, r):
        k_sample, k_steps = jax.random.split(key)
        pol_now, val_now = state.model
        roll, _, info = _sample_and_compare(
            pol_now, reference, tok, prompts, k_sample, r, ctx=ctx, per_rollout=n
        )
        scored = source.score(roll)
        per_token = scored.token_rewards is not None  # a PRM: its step scores, per token
        scores = jnp.asarray(0.0 * scored.scores if per_token else scored.scores, jnp.float32)
        info.update(scored.metrics, score=float(np.mean(scored.scores)))
        batch, stats = rx.train.prepare_ppo_batch(
            (pol_now, val_now),
            reference,
            roll.tokens,
            roll.mask,
            roll.completion_mask,
            scores,
            kl_coef=cfg.kl_coef,
            gamma=cfg.gamma,
            lam=cfg.lam,
            temperature=ctx.temperature,
            whiten=not per_token,
        )
        if per_token:
            batch, more = rx.train.add_token_rewards(
                batch, scored.token_rewards, gamma=cfg.gamma, lam=cfg.lam
            )
            stats = {**stats, **more}
        m = roll.completion_mask & roll.mask
        batch = eqx.tree_at(lambda b: b.old_logp, batch, jnp.where(m, roll.logprobs, 0.0))
        info.update({k: float(v) for k, v in stats.items()})
        metrics = []
        for e in range(cfg.epochs):
            perm = np.asarray(jax.random.permutation(jax.random.fold_in(k_steps, e), n))
            for j in range(cfg.minibatches):
                idx = perm[j * mb : (j + 1) * mb]
                state, met = state.apply(
                    step, take_rows(batch, idx), key=jax.random.fold_in(k_steps, 1000 + e * 100 + j)
                )
                metrics.append(met)
        return state, metrics, info

    ctx = dataclasses.replace(ctx, key=ctx_key)
    return run_loop(
        state,
        iteration,
        ctx,
        cfg.rollouts,
        kl_target=cfg.kl_target,
        policy_of=lambda s: s.model[0],
        tokens_per_iteration=cfg.prompts_per_rollout * ctx.max_new_tokens,
        # Sampling, old policy, reference (twice: shaping and the KL guard) and value
        # forward passes; epochs of training steps on policy and value.
        flops_per_iteration=model_flops(n_policy, forward_tokens=4 * rows)
        + model_flops(n_value, forward_tokens=rows, train_tokens=cfg.epochs * rows)
        + model_flops(n_policy, train_tokens=cfg.epochs * rows),
    )


# --- GRPO ------------------------------------------------------------------------------
