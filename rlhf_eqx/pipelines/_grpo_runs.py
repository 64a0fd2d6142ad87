"""GRPO runs: group-relative advantages on sampled groups, with verifiable rewards or any
reward source; rollouts from a stale policy with importance correction, DAPO's dynamic
sampling and overlong shaping (`GRPOConfig`)."""

import dataclasses
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import rlhf_eqx as rx

from ._lr_scale import build_optimizer
from ._monitor import model_flops
from ._reward_sources import RewardSource, as_reward_source
from ._rl_runs import _policy_and_reference, _sample_and_compare
from ._rollout import RewardFunction, Rollout, group_signal
from ._runs import RunContext, RunResult, run_loop
from ._stage_configs import (
    GRPOConfig,
)
from ._validation import validate_stage


class OffPolicyState(eqx.Module):
    """A GRPO run's state with `staleness > 0`: the `TrainState` and the trainable
    parameters of the last `staleness` policies before it, oldest first (the behaviour
    policy samples with `behind[0]`); checkpointed together, so a resumed run samples
    with the same stale policies."""

    train: rx.train.TrainState
    behind: tuple


@eqx.filter_jit
def _policy_logps(model, tokens, mask, temperature):
    return jax.vmap(lambda t, m: rx.token_logprobs(model, t, m, temperature=temperature))(
        tokens, mask
    )


def _concat_rollouts(rolls: Sequence[Rollout]) -> Rollout:
    cat = lambda *xs: jnp.concatenate(xs, axis=0)  # noqa: E731
    first = rolls[0]
    return dataclasses.replace(
        first,
        **{f: cat(*(getattr(r, f) for r in rolls)) for f in _ROW_ARRAYS},
        prompts=sum((r.prompts for r in rolls), ()),
        texts=sum((r.texts for r in rolls), ()),
    )


_ROW_ARRAYS = ("tokens", "mask", "completion_mask", "logprobs", "truncated")


def _take_groups(roll: Rollout, groups: np.ndarray, G: int) -> Rollout:
    rows = (np.asarray(groups)[:, None] * G + np.arange(G)[None, :]).reshape(-1)
    return dataclasses.replace(
        roll,
        **{f: getattr(roll, f)[rows] for f in _ROW_ARRAYS},
        prompts=tuple(roll.prompts[i] for i in rows),
        texts=tuple(roll.texts[i] for i in rows),
    )


def _dynamic_groups(rewards: list[np.ndarray], n: int, G: int) -> tuple[np.ndarray, int]:
    """Group indices (into the concatenated samplings) of a full batch: the informative
    groups first, in sampling order, then the first sampling's others to fill up."""
    all_rewards = np.concatenate(rewards)
    keep = np.asarray(rx.losses.informative_groups(jnp.asarray(all_rewards), group_size=G))
    informative = np.flatnonzero(keep)[:n]
    rest = [g for g in range(n) if g not in set(informative)]
    return np.concatenate([informative, rest[: n - len(informative)]]).astype(np.int64), len(
        informative
    )


def grpo_state_and_step(pol, spec, cfg, ctx: RunContext):
    """The `TrainState` of the policy `pol` (trainable part `spec`) and the GRPO step of
    `cfg` at the run's sampling temperature, its optimiser scheduled over
    `cfg.rollouts * cfg.epochs` updates."""
    opt = build_optimizer(cfg.optim, cfg.rollouts * cfg.epochs)
    state = rx.train.init_train_state(pol, opt, filter_spec=spec)
    cfg = dataclasses.replace(cfg, temperature=ctx.temperature)  # `sampling.temperature`
    return state, rx.train.make_grpo_step(opt, cfg, options=cfg.options)


def run_grpo(
    policy,
    tok,
    prompts: Sequence[str],
    *,
    reward: "RewardSource | Sequence[RewardFunction]",
    cfg: GRPOConfig,
    ctx: RunContext,
) -> RunResult:
    """GRPO (Shao et al. 2024): per rollout, `cfg.group_size` completions for each of
    `cfg.prompts_per_rollout` prompts, scored by `reward` (weighted reward functions on
    the decoded text, e.g. verifiable rewards; or any `RewardSource`: a reward model or
    ensemble, a judge, a process reward model's aggregated step scores); group-relative
    advantages; reference log-probs computed once per rollout (k3 KL with weight
    `cfg.beta`); `cfg.epochs` steps on the rollout with `old_logp` from the sampler.
    With `cfg.staleness`, `cfg.rollout_correction`, `cfg.dynamic_sampling` and
    `cfg.overlong_buffer` (see `GRPOConfig`): rollouts from a stale policy with the
    behaviour log-probs kept and `old_logp` the trained policy's, importance
    correction, DAPO's dynamic sampling and overlong shaping. Logs
    `frac_reward_zero_std` and an event when no group carries a signal. Stops early when
    the per-token KL to the reference exceeds `cfg.kl_target`.
    """
    validate_stage("grpo", cfg)
    source = as_reward_source(reward)
    k_lora, ctx_key = jax.random.split(ctx.key)
    pol, spec, reference = _policy_and_reference(policy, cfg.lora, k_lora)
    state, step = grpo_state_and_step(pol, spec, cfg, ctx)
    cfg = dataclasses.replace(cfg, temperature=ctx.temperature)
    k, n, G = cfg.staleness, cfg.prompts_per_rollout, cfg.group_size
    if k:
        state = OffPolicyState(state, (state.params,) * k)
    recompute = k > 0 or cfg.rollout_correction is not None

    def sample(model, key, r, attempt):
        roll, ref_logp, info = _sample_and_compare(
            model, reference, tok, prompts, key, r + attempt * cfg.rollouts,
            ctx=ctx, per_rollout=n, group_size=G,
        )  # fmt: skip
        scored = source.score(roll)
        rewards = np.asarray(scored.scores, np.float32)
        if cfg.overlong_buffer:
            lengths = jnp.asarray(np.asarray(roll.completion_mask).sum(axis=1), jnp.int32)
            penalty = rx.losses.overlong_penalty(
                lengths, max_length=ctx.max_new_tokens, buffer=cfg.overlong_buffer
            )
            info["overlong_penalty"] = float(np.mean(penalty))
            rewards = rewards + np.asarray(penalty, np.float32)
        return roll, ref_logp, info, scored, rewards

    def iteration(state, key, r):
        ts = state.train if k else state
        behaviour = eqx.combine(state.behind[0], ts.frozen) if k else ts.model
        k_sample, k_steps = jax.random.split(key)
        roll, ref_logp, info, scored, rewards = sample(behaviour, k_sample, r, 0)
        if cfg.dynamic_sampling:
            parts = [(roll, ref_logp, rewards)]
            while (
                len(parts) < cfg.dynamic_sampling
                and _dynamic_groups([p[2] for p in parts], n, G)[1] < n
            ):
                key_more = jax.random.fold_in(k_sample, len(parts))
                more = sample(behaviour, key_more, r, len(parts))
                parts.append((more[0], more[1], more[4]))
            groups, found = _dynamic_groups([p[2] for p in parts], n, G)
            roll = _take_groups(_concat_rollouts([p[0] for p in parts]), groups, G)
            rows = (groups[:, None] * G + np.arange(G)[None, :]).reshape(-1)
            ref_logp = jnp.concatenate([p[1] for p in parts])[rows]
            rewards = np.concatenate([p[2] for p in parts])[rows]
            info["dynamic_sampling/samplings"] = float(len(parts))
            info["dynamic_sampling/informative"] = found / n
        info.update(scored.metrics, score=float(rewards.mean()))
        info["frac_reward_zero_std"] = group_signal(rewards, G)
        if info["frac_reward_zero_std"] == 1.0:
            ctx.log.event(
                "no_signal",
                f"rollout {r}: every group has equal rewards; the update is zero",
                iteration=r,
            )
        own = roll.completion_mask & roll.mask
        old_logp, behaviour_logp = roll.logprobs, None
        if recompute:  # the trained policy's own log-probs; the sampler's are the behaviour's
            current = _policy_logps(ts.model, roll.tokens, roll.mask, ctx.temperature)
            old_logp, behaviour_logp = jnp.where(own, current, 0.0), roll.logprobs
        batch = rx.train.GRPOBatch(
            tokens=roll.tokens,
            mask=roll.mask,
            completion_mask=roll.completion_mask,
            rewards=jnp.asarray(rewards),
            old_logp=old_logp,
            ref_logp=ref_logp,
            truncated=roll.truncated,
            prompt_length=ctx.prompt_length,  # each group's prompt runs once in the update
            samples_per_prompt=G,
            behaviour_logp=behaviour_logp,
        )
        metrics = []
        before = ts.params
        for e in range(cfg.epochs):
            ts, met = ts.apply(step, batch, key=jax.random.fold_in(k_steps, e))
            metrics.append(met)
        if k:
            return OffPolicyState(ts, (*state.behind[1:], before)), metrics, info
        return ts, metrics, info

    rows = n * G * (ctx.prompt_length + ctx.max_new_tokens)
    ctx = dataclasses.replace(ctx, key=ctx_key)
    res = run_loop(
        state,
        iteration,
        ctx,
        cfg.rollouts,
        kl_target=cfg.kl_target,
        policy_of=(lambda s: s.train.model) if k else (lambda s: s.model),
        tokens_per_iteration=n * G * ctx.max_new_tokens,
        # Sampling and the reference pass, then `epochs` steps on the rollout.
        flops_per_iteration=model_flops(
            rx.count_params(pol), forward_tokens=2 * rows, train_tokens=cfg.epochs * rows
        ),
    )
    return dataclasses.replace(res, state=res.state.train) if k else res
