"""Whole runs: typed config -> final `TrainState` + metrics history, for SFT, reward
modelling, DPO (cached reference; offline or online), PPO (policy + value, reward model
or rule) and GRPO (rule / verifiable reward).

Every run goes through `run_iterations` (checkpoints, exact resume, rollback, the KL
guard, metrics). Iteration `i` draws its data from `i` and its randomness from
`fold_in(key, i)`.
"""

import dataclasses
import os
from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import rlhf_eqx as rx
from rlhf_eqx import data

from ._config import (
    DPOConfig,
    GRPOConfig,
    LoRASettings,
    OpsConfig,
    PPOConfig,
    RewardConfig,
    SFTConfig,
)
from ._monitor import model_flops
from ._ops import LoopResult, MetricsLog, build_optimizer, run_iterations
from ._rollout import (
    RewardFunction,
    group_signal,
    reward_model_scores,
    sample_rollout,
    score_rollout,
    token_logps,
)

__all__ = [
    "RunContext",
    "RunResult",
    "with_lora",
    "final_policy",
    "export_policy",
    "has_lora",
    "rows_at",
    "run_sft",
    "run_reward",
    "run_dpo",
    "run_online_dpo",
    "run_ppo",
    "run_grpo",
]


@dataclasses.dataclass(frozen=True)
class RunContext:
    """Where and how a run executes: its operations settings, its metrics log, its
    checkpoint directory (`None`: no checkpoints), whether to resume, its PRNG key, and
    the sampling settings of rollouts. `evaluate(policy) -> metrics`, when given, runs
    every `ops.eval_every` iterations on the current policy (LoRA merged). `peak_flops`
    (`measure_matmul_peak`, once per run) turns on the per-iteration MFU."""

    ops: OpsConfig
    log: MetricsLog
    key: jax.Array
    checkpoint_dir: str | None = None
    resume: bool = False
    prompt_length: int = 32
    max_new_tokens: int = 40
    temperature: float = 1.0
    stop_strings: tuple[str, ...] = ()
    meta: dict | None = None
    evaluate: Callable[[object], dict] | None = None
    peak_flops: float | None = None


@dataclasses.dataclass
class RunResult:
    """The final `TrainState`, the metrics of every step and the loop's report."""

    state: rx.train.TrainState
    history: list[dict]
    loop: LoopResult


def with_lora(model, lora: LoRASettings, key: jax.Array):
    """`(model with adapters, filter spec)`; `lora.rank == 0`: `(model, None)` (train all)."""
    if lora.rank == 0:
        return model, None
    cfg = rx.LoRAConfig(
        rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, targets=lora.targets
    )
    adapted = rx.apply_lora(model, cfg, key=key)
    return adapted, rx.lora_filter(adapted)


def has_lora(model) -> bool:
    """Whether `model` carries LoRA adapters (`apply_lora`)."""
    return rx.without_lora(model) is not model


def export_policy(policy, run_dir: str, stage: str, *, adapted=None) -> None:
    """Write `policy` (merged) as a Hugging Face checkpoint in `<run_dir>/<stage>/hf/`
    (`save_hf`); when `adapted`, the trained model before merging, has LoRA adapters,
    also the adapters alone in the PEFT layout in `<run_dir>/<stage>/adapter/`
    (`save_lora_adapter`)."""
    rx.save_hf(policy, os.path.join(run_dir, stage, "hf"))
    if adapted is not None and has_lora(adapted):
        rx.save_lora_adapter(adapted, os.path.join(run_dir, stage, "adapter"))


def final_policy(model):
    """The trained policy with its LoRA adapters (if any) merged into the weights."""
    return rx.merge_lora(model)


def rows_at(n: int, batch_size: int, seed: int, i: int) -> np.ndarray:
    """Row indices of batch `i` of shuffled epochs over `n` rows (`epoch_permutation`);
    with fewer than `batch_size` rows, rows repeat (fixed shapes)."""
    if n < batch_size:
        perm = data.epoch_permutation(n, seed, i)
        return perm[np.arange(batch_size) % n]
    per_epoch = n // batch_size
    epoch, pos = divmod(i, per_epoch)
    perm = data.epoch_permutation(n, seed, epoch)
    return perm[pos * batch_size : (pos + 1) * batch_size]


def _take(batch, idx):
    return jax.tree.map(lambda x: None if x is None else x[idx], batch)


def _loop(state, iteration, ctx: RunContext, num, *, policy_of=None, **kw) -> RunResult:
    evaluate = None
    if ctx.evaluate is not None and policy_of is not None:
        evaluate = lambda s, i: ctx.evaluate(final_policy(policy_of(s)))  # noqa: E731
    loop = run_iterations(
        state,
        iteration,
        num_iterations=num,
        key=ctx.key,
        ops=ctx.ops,
        log=ctx.log,
        checkpoint_dir=ctx.checkpoint_dir,
        resume=ctx.resume,
        meta=ctx.meta,
        evaluate=evaluate,
        peak_flops=ctx.peak_flops,
        **kw,
    )
    return RunResult(loop.state, loop.history, loop)


# --- SFT -------------------------------------------------------------------------------


def run_sft(
    model, tok, records: Sequence[tuple[str, str]], *, cfg: SFTConfig, ctx: RunContext
) -> RunResult:
    """Supervised fine-tuning (NLL of the completion tokens) on `(prompt, completion)`
    records, `cfg.steps` steps of `cfg.batch_size` rows, LoRA per `cfg.lora`."""
    seqs, _ = data.tokenize_sft(
        list(records),
        tok,
        max_length=cfg.max_length,
        max_prompt_length=ctx.prompt_length,
        add_eos=False,
    )
    full = data.collate_sft(seqs, max_length=cfg.max_length, pad_id=tok.pad_id)
    k_lora, ctx_key = jax.random.split(ctx.key)
    model, spec = with_lora(model, cfg.lora, k_lora)
    opt = build_optimizer(cfg.optim, cfg.steps)
    state = rx.train.init_train_state(model, opt, filter_spec=spec)
    step = rx.train.make_sft_step(opt, donate=False)
    n = full.tokens.shape[0]

    def iteration(state, key, i):
        batch = _take(full, rows_at(n, cfg.batch_size, ctx.ops.seed, i))
        state, m = state.apply(step, batch, key=key)
        return state, [m], {}

    ctx = dataclasses.replace(ctx, key=ctx_key)
    return _loop(
        state,
        iteration,
        ctx,
        cfg.steps,
        policy_of=lambda s: s.model,
        tokens_per_iteration=cfg.batch_size * cfg.max_length,
        flops_per_iteration=model_flops(
            rx.count_params(model), train_tokens=cfg.batch_size * cfg.max_length
        ),
    )


# --- reward model ----------------------------------------------------------------------


def collate_pairs(
    pairs: Sequence[data.PreferenceRecord], tok, *, max_length: int, prompt_length: int
) -> rx.PreferenceBatch:
    """Tokenise `prompt + chosen` / `prompt + rejected` (no EOS: completions stop at a
    length limit), right-padded to `max_length`."""
    tokenized, _ = data.tokenize_preferences(
        list(pairs), tok, max_length=max_length, max_prompt_length=prompt_length, add_eos=False
    )
    return data.collate_preferences(tokenized, max_length=max_length, pad_id=tok.pad_id)


def run_reward(
    policy, tok, pairs: Sequence[data.PreferenceRecord], *, cfg: RewardConfig, ctx: RunContext
) -> RunResult:
    """Bradley-Terry reward model (`RewardModel.from_policy`, every weight trained) on
    preference pairs."""
    full = collate_pairs(pairs, tok, max_length=cfg.max_length, prompt_length=ctx.prompt_length)
    k_init, ctx_key = jax.random.split(ctx.key)
    rm = rx.RewardModel.from_policy(policy, key=k_init)
    opt = build_optimizer(cfg.optim, cfg.steps)
    state = rx.train.init_train_state(rm, opt)
    step = rx.train.make_reward_step(opt, donate=False)
    n = full.chosen_tokens.shape[0]

    def iteration(state, key, i):
        batch = _take(full, rows_at(n, cfg.batch_size, ctx.ops.seed, i))
        state, m = state.apply(step, batch, key=key)
        return state, [m], {}

    ctx = dataclasses.replace(ctx, key=ctx_key)
    tokens = 2 * cfg.batch_size * cfg.max_length
    return _loop(
        state,
        iteration,
        ctx,
        cfg.steps,
        tokens_per_iteration=tokens,
        flops_per_iteration=model_flops(rx.count_params(rm), train_tokens=tokens),
    )


# --- DPO -------------------------------------------------------------------------------


def _dpo_setup(model, cfg: DPOConfig, total_steps: int, key):
    model, spec = with_lora(model, cfg.lora, key)
    reference = rx.without_lora(model) if spec is not None else model
    opt = build_optimizer(cfg.optim, total_steps)
    state = rx.train.init_train_state(model, opt, filter_spec=spec)
    step = rx.train.make_dpo_step(
        opt, beta=cfg.beta, loss_type=cfg.loss_type, reference="cached", donate=False
    )
    return state, reference, step


def run_dpo(
    model, tok, pairs: Sequence[data.PreferenceRecord], *, cfg: DPOConfig, ctx: RunContext
) -> RunResult:
    """Offline DPO (Rafailov et al. 2023) on fixed pairs: reference log-probs computed
    once (the reference is the model without its adapters), `cfg.steps` steps."""
    k_lora, ctx_key = jax.random.split(ctx.key)
    state, reference, step = _dpo_setup(model, cfg, cfg.steps, k_lora)
    full = collate_pairs(pairs, tok, max_length=cfg.max_length, prompt_length=ctx.prompt_length)
    full = rx.train.compute_reference_logps(reference, full)
    n = full.chosen_tokens.shape[0]

    def iteration(state, key, i):
        batch = _take(full, rows_at(n, cfg.batch_size, ctx.ops.seed, i))
        state, m = state.apply(step, batch, key=key)
        return state, [m], {}

    ctx = dataclasses.replace(ctx, key=ctx_key)
    return _loop(
        state,
        iteration,
        ctx,
        cfg.steps,
        policy_of=lambda s: s.model,
        tokens_per_iteration=2 * cfg.batch_size * cfg.max_length,
        flops_per_iteration=model_flops(
            rx.count_params(state.model), train_tokens=2 * cfg.batch_size * cfg.max_length
        ),
    )


def best_worst_pairs(
    prompts: Sequence[str], texts: Sequence[str], labels: Sequence[float], samples: int
) -> list[data.PreferenceRecord]:
    """For each prompt's `samples` completions, (best, worst) by `labels` when they differ."""
    pairs = []
    for j, prompt in enumerate(prompts):
        lab = np.asarray(labels[j * samples : (j + 1) * samples])
        best, worst = int(np.argmax(lab)), int(np.argmin(lab))
        if lab[best] > lab[worst]:
            pairs.append(
                data.PreferenceRecord(prompt, texts[j * samples + best], texts[j * samples + worst])
            )
    return pairs


def run_online_dpo(
    model,
    tok,
    prompts: Sequence[str],
    label: Callable[[Sequence[str], Sequence[str], int], Sequence[float]],
    *,
    cfg: DPOConfig,
    ctx: RunContext,
) -> RunResult:
    """Online (iterative) DPO: for each of `cfg.rounds` rounds, sample `cfg.samples`
    completions per prompt from the current policy, label them with
    `label(prompts, texts, round)` (a reward model or a judge), pair best and worst,
    cache the reference log-probs and take `cfg.steps` DPO steps (Xu et al. 2023; Guo et
    al. 2024)."""
    k_lora, ctx_key = jax.random.split(ctx.key)
    state, reference, step = _dpo_setup(model, cfg, cfg.rounds * cfg.steps, k_lora)

    def iteration(state, key, r):
        k_sample, k_steps = jax.random.split(key)
        roll = sample_rollout(
            state.model,
            tok,
            prompts,
            k_sample,
            group_size=cfg.samples,
            prompt_length=ctx.prompt_length,
            max_new_tokens=ctx.max_new_tokens,
            temperature=ctx.temperature,
            stop_strings=ctx.stop_strings,
        )
        labels = label(roll.prompts, roll.texts, r)
        pairs = best_worst_pairs(prompts, roll.texts, labels, cfg.samples)
        info = {"pairs": float(len(pairs)), "label_mean": float(np.mean(labels))}
        if not pairs:
            ctx.log.event(
                "no_signal",
                f"round {r}: all completions of every prompt got the same label; no pairs",
                iteration=r,
            )
            return state, [], info
        full = collate_pairs(pairs, tok, max_length=cfg.max_length, prompt_length=ctx.prompt_length)
        full = rx.train.compute_reference_logps(reference, full)
        n = full.chosen_tokens.shape[0]
        metrics = []
        for s in range(cfg.steps):
            batch = _take(full, rows_at(n, cfg.batch_size, ctx.ops.seed + r, s))
            state, m = state.apply(step, batch, key=jax.random.fold_in(k_steps, s))
            metrics.append(m)
        return state, metrics, info

    ctx = dataclasses.replace(ctx, key=ctx_key)
    sampled = len(prompts) * cfg.samples * (ctx.prompt_length + ctx.max_new_tokens)
    flops = model_flops(
        rx.count_params(state.model),
        train_tokens=cfg.steps * 2 * cfg.batch_size * cfg.max_length,
        forward_tokens=sampled + 2 * len(prompts) * cfg.max_length,  # + reference, <= 1 pair/prompt
    )
    return _loop(
        state,
        iteration,
        ctx,
        cfg.rounds,
        policy_of=lambda s: s.model,
        tokens_per_iteration=sampled,
        flops_per_iteration=flops,
    )


# --- PPO -------------------------------------------------------------------------------


def _prompts_at(prompts: Sequence[str], per_rollout: int, seed: int, r: int) -> list[str]:
    return [prompts[j] for j in rows_at(len(prompts), per_rollout, seed, r)]


def _per_token_kl(logp, ref_logp, mask) -> float:
    m = np.asarray(mask)
    return float(((np.asarray(logp) - np.asarray(ref_logp)) * m).sum() / max(m.sum(), 1))


def run_ppo(
    policy,
    tok,
    prompts: Sequence[str],
    *,
    reward: "rx.RewardModel | Sequence[RewardFunction]",
    cfg: PPOConfig,
    ctx: RunContext,
) -> RunResult:
    """PPO with a value model (RLHF, Ouyang et al. 2022): per rollout, sample one
    completion for each of `cfg.prompts_per_rollout` prompts, score it with `reward` (a
    `RewardModel`, jitted, or reward functions on the decoded text), compute the
    reference log-probs, values and GAE advantages once (`prepare_ppo_batch`; `old_logp`
    from the sampler), then `cfg.epochs` x `cfg.minibatches` PPO steps. The policy trains
    LoRA adapters (`cfg.lora`; the reference is the policy without them); the value
    model (`ValueModel.from_policy`) trains every weight. Stops early when the per-token
    KL to the reference exceeds `cfg.kl_target`.
    """
    k_lora, k_value, ctx_key = jax.random.split(ctx.key, 3)
    pol, spec = with_lora(policy, cfg.lora, k_lora)
    reference = rx.without_lora(pol) if spec is not None else policy
    value = rx.ValueModel.from_policy(policy, key=k_value)
    total = cfg.rollouts * cfg.epochs * cfg.minibatches
    opt = build_optimizer(cfg.optim, total)
    filter_spec = (spec if spec is not None else eqx.is_inexact_array, eqx.is_inexact_array)
    state = rx.train.init_train_state((pol, value), opt, filter_spec=filter_spec)
    step = rx.train.make_ppo_step(
        opt,
        clip_eps=cfg.clip,
        vf_coef=cfg.vf_coef,
        ent_coef=cfg.ent_coef,
        donate=False,
        temperature=ctx.temperature,
    )
    mb = cfg.prompts_per_rollout // cfg.minibatches
    rows = cfg.prompts_per_rollout * (ctx.prompt_length + ctx.max_new_tokens)
    n_policy, n_value = rx.count_params(pol), rx.count_params(value)

    def iteration(state, key, r):
        k_sample, k_steps = jax.random.split(key)
        pol_now, val_now = state.model
        roll = sample_rollout(
            pol_now,
            tok,
            _prompts_at(prompts, cfg.prompts_per_rollout, ctx.ops.seed, r),
            k_sample,
            prompt_length=ctx.prompt_length,
            max_new_tokens=ctx.max_new_tokens,
            temperature=ctx.temperature,
            stop_strings=ctx.stop_strings,
        )
        if isinstance(reward, rx.RewardModel):
            scores = reward_model_scores(reward, roll.tokens, roll.mask)
            info = {"score": float(jnp.mean(scores))}
        else:
            s, info = score_rollout(roll, reward)
            scores = jnp.asarray(s)
            info["score"] = float(s.mean())
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
            stop_strings=ctx.stop_strings,
        )
        m = roll.completion_mask & roll.mask
        batch = eqx.tree_at(lambda b: b.old_logp, batch, jnp.where(m, roll.logprobs, 0.0))
        ref_logp = token_logps(reference, roll.tokens, roll.mask)
        info["kl"] = _per_token_kl(roll.logprobs, ref_logp, m)
        info.update({k: float(v) for k, v in stats.items()})
        info["truncated"] = float(jnp.mean(roll.truncated.astype(jnp.float32)))
        metrics = []
        n = cfg.prompts_per_rollout
        for e in range(cfg.epochs):
            perm = np.asarray(jax.random.permutation(jax.random.fold_in(k_steps, e), n))
            for j in range(cfg.minibatches):
                idx = perm[j * mb : (j + 1) * mb]
                state, met = state.apply(
                    step, _take(batch, idx), key=jax.random.fold_in(k_steps, 1000 + e * 100 + j)
                )
                metrics.append(met)
        return state, metrics, info

    ctx = dataclasses.replace(ctx, key=ctx_key)
    return _loop(
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


def run_grpo(
    policy,
    tok,
    prompts: Sequence[str],
    *,
    reward_fns: Sequence[RewardFunction],
    cfg: GRPOConfig,
    ctx: RunContext,
) -> RunResult:
    """GRPO (Shao et al. 2024) with verifiable rewards: per rollout, `cfg.group_size`
    completions for each of `cfg.prompts_per_rollout` prompts, scored by the weighted
    `reward_fns` on the decoded text; group-relative advantages; reference log-probs
    computed once per rollout (k3 KL with weight `cfg.beta`); `cfg.epochs` steps on the
    rollout with `old_logp` from the sampler. Logs `frac_reward_zero_std` and an event
    when no group carries a signal. Stops early when the per-token KL to the reference
    exceeds `cfg.kl_target`.
    """
    k_lora, ctx_key = jax.random.split(ctx.key)
    pol, spec = with_lora(policy, cfg.lora, k_lora)
    reference = rx.without_lora(pol) if spec is not None else policy
    opt = build_optimizer(cfg.optim, cfg.rollouts * cfg.epochs)
    state = rx.train.init_train_state(pol, opt, filter_spec=spec)
    step = rx.train.make_grpo_step(
        opt,
        group_size=cfg.group_size,
        clip_eps=cfg.clip,
        beta=cfg.beta,
        donate=False,
        temperature=ctx.temperature,
    )

    rows = cfg.prompts_per_rollout * cfg.group_size * (ctx.prompt_length + ctx.max_new_tokens)

    def iteration(state, key, r):
        k_sample, k_steps = jax.random.split(key)
        roll = sample_rollout(
            state.model,
            tok,
            _prompts_at(prompts, cfg.prompts_per_rollout, ctx.ops.seed, r),
            k_sample,
            group_size=cfg.group_size,
            prompt_length=ctx.prompt_length,
            max_new_tokens=ctx.max_new_tokens,
            temperature=ctx.temperature,
            stop_strings=ctx.stop_strings,
        )
        rewards, info = score_rollout(roll, reward_fns)
        info["score"] = float(rewards.mean())
        info["frac_reward_zero_std"] = group_signal(rewards, cfg.group_size)
        m = roll.completion_mask & roll.mask
        ref_logp = token_logps(reference, roll.tokens, roll.mask)
        info["kl"] = _per_token_kl(roll.logprobs, ref_logp, m)
        info["truncated"] = float(jnp.mean(roll.truncated.astype(jnp.float32)))
        if info["frac_reward_zero_std"] == 1.0:
            ctx.log.event(
                "no_signal",
                f"rollout {r}: every group has equal rewards; the update is zero",
                iteration=r,
            )
        batch = rx.train.GRPOBatch(
            tokens=roll.tokens,
            mask=roll.mask,
            completion_mask=roll.completion_mask,
            rewards=jnp.asarray(rewards),
            old_logp=roll.logprobs,
            ref_logp=jnp.where(m, ref_logp, 0.0),
            truncated=roll.truncated,
        )
        metrics = []
        for e in range(cfg.epochs):
            state, met = state.apply(step, batch, key=jax.random.fold_in(k_steps, e))
            metrics.append(met)
        return state, metrics, info

    ctx = dataclasses.replace(ctx, key=ctx_key)
    return _loop(
        state,
        iteration,
        ctx,
        cfg.rollouts,
        kl_target=cfg.kl_target,
        policy_of=lambda s: s.model,
        tokens_per_iteration=cfg.prompts_per_rollout * cfg.group_size * ctx.max_new_tokens,
        # Sampling and the reference pass, then `epochs` steps on the rollout.
        flops_per_iteration=model_flops(
            rx.count_params(pol), forward_tokens=2 * rows, train_tokens=cfg.epochs * rows
        ),
    )
