"""Whole runs: typed config -> final `TrainState` + metrics history. Here: the run
context and the pieces shared by every run, SFT and reward modelling; DPO (offline and
online) is in `_dpo_runs.py`, PPO and GRPO in `_rl_runs.py`.

Every run goes through `run_iterations` (checkpoints, exact resume, rollback, the KL
guard, metrics). Iteration `i` draws its data from `i` and its randomness from
`fold_in(key, i)`.
"""

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import rlhf_eqx as rx
from rlhf_eqx import data

from ._config import (
    LoRASettings,
    OpsConfig,
    RewardConfig,
    SFTConfig,
)
from ._metrics import MetricsLog
from ._monitor import model_flops
from ._ops import LoopResult, build_optimizer, run_iterations


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


def export_reward_model(model, run_dir: str) -> None:
    """Write a reward model as a `...ForSequenceClassification` checkpoint in
    `<run_dir>/reward/hf/`. That head has no bias, so the bias is dropped first: a
    Bradley-Terry reward is shift-invariant, and the exported scores differ from
    `model`'s by that one constant."""
    model = eqx.tree_at(lambda m: m.bias, model, jnp.zeros_like(model.bias))
    rx.save_hf(model, os.path.join(run_dir, "reward", "hf"))


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


def take_rows(batch, idx):
    return jax.tree.map(lambda x: None if x is None else x[idx], batch)


def run_loop(state, iteration, ctx: RunContext, num, *, policy_of=None, **kw) -> RunResult:
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
    return run_offline(
        state, step, shuffled_rows(full, cfg.batch_size, ctx.ops.seed), steps=cfg.steps,
        tokens_per_iteration=cfg.batch_size * cfg.max_length, ctx=ctx, ctx_key=ctx_key,
        policy_of=lambda s: s.model,
    )


# --- reward model ----------------------------------------------------------------------


def shuffled_rows(full, batch_size: int, seed: int) -> Callable[[int], Any]:
    """Batch `i` of shuffled epochs over the rows of `full`: the rows `rows_at(i)`."""
    n = jax.tree.leaves(full)[0].shape[0]
    return lambda i: take_rows(full, rows_at(n, batch_size, seed, i))


def shuffled_batches(batches: Sequence[Any], seed: int) -> Callable[[int], Any]:
    """Batch `i` of epochs over a fixed list of batches, each epoch in its own order
    (`epoch_permutation`)."""
    n = len(batches)
    return lambda i: batches[int(data.epoch_permutation(n, seed, i // n)[i % n])]


def run_offline(
    state, step, batch_at: Callable[[int], Any], *, steps: int, tokens_per_iteration: int,
    ctx: RunContext, ctx_key, policy_of=None,
) -> RunResult:
    """`steps` updates of `step` on the batches `batch_at(i)` (SFT, reward model,
    offline DPO; `shuffled_rows`, `shuffled_batches`)."""

    def iteration(state, key, i):
        state, m = state.apply(step, batch_at(i), key=key)
        return state, [m], {}

    tokens = tokens_per_iteration
    return run_loop(
        state,
        iteration,
        dataclasses.replace(ctx, key=ctx_key),
        steps,
        policy_of=policy_of,
        tokens_per_iteration=tokens,
        flops_per_iteration=model_flops(rx.count_params(state.model), train_tokens=tokens),
    )


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
    return run_offline(
        state, step, shuffled_rows(full, cfg.batch_size, ctx.ops.seed), steps=cfg.steps,
        tokens_per_iteration=2 * cfg.batch_size * cfg.max_length, ctx=ctx, ctx_key=ctx_key,
    )
