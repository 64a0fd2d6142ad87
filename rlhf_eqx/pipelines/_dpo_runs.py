"""DPO runs (Rafailov et al. 2023): offline on fixed pairs, and online / iterative
(sample, label, pair, train, repeat), both with a cached reference."""

import dataclasses
from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import rlhf_eqx as rx
from rlhf_eqx import data

from ._lr_scale import build_optimizer
from ._monitor import model_flops
from ._rollout import sample_rollout, sampling_options
from ._runs import (
    RunContext,
    RunResult,
    collate_pairs,
    rows_at,
    run_loop,
    run_offline,
    shuffled_batches,
    take_rows,
    with_lora,
)
from ._stage_configs import (
    DPOConfig,
)
from ._validation import validate_stage


def _dpo_setup(model, cfg: DPOConfig, total_steps: int, key):
    model, spec = with_lora(model, cfg.lora, key)
    reference = rx.without_lora(model) if spec is not None else model
    opt = build_optimizer(cfg.optim, total_steps)
    state = rx.train.init_train_state(model, opt, filter_spec=spec)
    step = rx.train.make_dpo_step(opt, cfg, options=cfg.options)
    return state, reference, step


def run_dpo(
    model, tok, pairs: Sequence[data.PreferenceRecord], *, cfg: DPOConfig, ctx: RunContext
) -> RunResult:
    """Offline DPO (Rafailov et al. 2023) on fixed pairs: reference log-probs computed
    once (the reference is the model without its adapters), `cfg.steps` steps. With
    `cfg.packing`, on token-budget batches (`packed_steps`)."""
    validate_stage("dpo", cfg)
    k_lora, ctx_key = jax.random.split(ctx.key)
    state, reference, step = _dpo_setup(model, cfg, cfg.steps, k_lora)
    run = dict(steps=cfg.steps, ctx=ctx, ctx_key=ctx_key, policy_of=lambda s: s.model)
    if cfg.packing:
        batches = packed_steps(
            pairs, tok, cfg=cfg, prompt_length=ctx.prompt_length, seed=ctx.ops.seed
        )
        return run_offline(
            state,
            step,
            referenced_batches(reference, batches, ctx.ops.seed),
            tokens_per_iteration=int(batches[0].tokens.size),
            **run,
        )
    full = collate_pairs(pairs, tok, max_length=cfg.max_length, prompt_length=ctx.prompt_length)
    return run_offline(
        state,
        step,
        referenced_rows(reference, full, cfg.batch_size, ctx.ops.seed),
        tokens_per_iteration=2 * cfg.batch_size * cfg.max_length,
        **run,
    )


def referenced_batches(reference, batches: Sequence, seed: int) -> Callable[[int], object]:
    """`shuffled_batches` with each batch's reference log-probabilities computed when it is
    first used and kept (`compute_reference_logps`, one forward of the reference per batch
    over the whole run): a run shorter than an epoch computes only what it trains on."""
    at = shuffled_batches(range(len(batches)), seed)
    done: dict[int, object] = {}

    def batch_at(i: int):
        j = at(i)
        if j not in done:
            done[j] = rx.train.compute_reference_logps(reference, batches[j])
        return done[j]

    return batch_at


def referenced_rows(reference, full, batch_size: int, seed: int) -> Callable[[int], object]:
    """`shuffled_rows` with the reference log-probabilities of each row computed with the
    first batch that holds it (one forward of a `batch_size`-row batch; its rows' values
    kept for later epochs), instead of over every row before the first step."""
    n = full.chosen_tokens.shape[0]
    ref = np.zeros((2, n), np.float32)
    known = np.zeros(n, bool)

    def batch_at(i: int):
        idx = rows_at(n, batch_size, seed, i)
        batch = take_rows(full, idx)
        if not known[idx].all():
            b = rx.train.compute_reference_logps(reference, batch)
            ref[0, idx], ref[1, idx] = (
                np.asarray(b.ref_chosen_logp),
                np.asarray(b.ref_rejected_logp),
            )
            known[idx] = True
            return b
        values = (jnp.asarray(ref[0, idx]), jnp.asarray(ref[1, idx]))
        return eqx.tree_at(
            lambda b: (b.ref_chosen_logp, b.ref_rejected_logp),
            batch,
            values,
            is_leaf=lambda x: x is None,
        )

    return batch_at


def packed_steps(
    pairs: Sequence[data.PreferenceRecord], tok, *, cfg: DPOConfig, prompt_length: int, seed: int
) -> list[rx.PackedPreferenceBatch]:
    """Token-budget DPO batches (`data.pack_preference_steps`): rows of `2 · max_length`
    tokens (any pair fits) holding up to 4 pairs each with their prompt written once, as
    many rows a step as hold `cfg.batch_size` pairs on average; one shape for every step."""
    tokenized, _ = data.tokenize_preferences(
        list(pairs), tok, max_length=cfg.max_length, max_prompt_length=prompt_length, add_eos=False
    )
    return data.pack_preference_steps(
        tokenized,
        pad_id=tok.pad_id,
        row_length=2 * cfg.max_length,
        pairs_per_step=cfg.batch_size,
        seed=seed,
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
    validate_stage("dpo", cfg)
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
            **sampling_options(ctx),
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
            batch = take_rows(full, rows_at(n, cfg.batch_size, ctx.ops.seed + r, s))
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
    return run_loop(
        state,
        iteration,
        ctx,
        cfg.rounds,
        policy_of=lambda s: s.model,
        tokens_per_iteration=sampled,
        flops_per_iteration=flops,
    )
