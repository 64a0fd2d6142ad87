"""Reward-model runs: a Bradley-Terry reward model (or an ensemble of them) with
checkpoint selection on held-out pairs."""

import dataclasses
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

import rlhf_eqx as rx
from rlhf_eqx import data

from ._evaluate import reward_accuracy
from ._lr_scale import build_optimizer
from ._monitor import model_flops
from ._runs import RunContext, RunResult, collate_pairs, run_loop, shuffled_rows
from ._stage_configs import (
    RewardConfig,
)
from ._validation import validate_stage


class RewardRunState(eqx.Module):
    """The state of a reward-model run: the `TrainState`, and the trainable parameters
    with the best held-out accuracy so far (checkpointed with it, so a resumed run keeps
    the same selection)."""

    train: rx.train.TrainState
    best_params: Any
    best_accuracy: jax.Array
    best_step: jax.Array


def run_reward(
    policy, tok, pairs: Sequence[data.PreferenceRecord], *, cfg: RewardConfig, ctx: RunContext
) -> RunResult:
    """Bradley-Terry reward model (`RewardModel.from_policy`, every weight trained) on
    preference pairs; with `cfg.ensemble = K > 1`, `K` of them stacked in an `Ensemble`
    and trained in one vmapped step, each on its own bootstrap resample of every batch
    (accuracies then use the ensemble's conservative score).

    With `cfg.eval_every > 0`, about `cfg.heldout_fraction` of the pairs' prompts are
    held out (`data.split_held_out`, seeded by `ops.seed`; their labels are as noisy as
    the training ones): every `cfg.eval_every` steps and at the end their accuracy is
    logged (`validation/accuracy`) and the parameters with the best accuracy so far
    are kept; the result is that model (checkpoint selection: a reward model trained on
    noisy labels otherwise memorises them). `res.history` then also holds
    `res.info` says which step was kept, with its training and held-out accuracy.
    """
    validate_stage("reward", cfg)
    pairs = list(pairs)
    val: list = []
    if cfg.eval_every:
        train, val = data.split_held_out(pairs, fraction=cfg.heldout_fraction, seed=ctx.ops.seed)
        if train and val:
            pairs = list(train)
        else:
            val = []
            ctx.log.event(
                "no_validation",
                f"reward.heldout_fraction={cfg.heldout_fraction}: {len(pairs)} pairs are too "
                "few to hold some out; the last model is kept",
            )
    full = collate_pairs(pairs, tok, max_length=cfg.max_length, prompt_length=ctx.prompt_length)
    val_batch = (
        collate_pairs(val, tok, max_length=cfg.max_length, prompt_length=ctx.prompt_length)
        if val
        else None
    )
    k_init, ctx_key = jax.random.split(ctx.key)
    opt = build_optimizer(cfg.optim, cfg.steps)
    K = cfg.ensemble
    if K > 1:  # K reward models stacked, one vmapped step, a bootstrap resample each
        from ._reward_sources import EnsembleReward

        make = lambda k: rx.RewardModel.from_policy(policy, key=k)
        ts = rx.train.init_ensemble_state(
            rx.train.make_ensemble(make, jax.random.split(k_init, K)), opt
        )
        step = rx.train.make_ensemble_reward_step(opt, cfg, members=K, options=cfg.options)
        scorer = lambda m: EnsembleReward(m, cfg.ensemble_penalty, cfg.ensemble_mode)
    else:
        ts = rx.train.init_train_state(rx.RewardModel.from_policy(policy, key=k_init), opt)
        step = rx.train.make_reward_step(opt, cfg, options=cfg.options)
        scorer = lambda m: m
    rows_of = shuffled_rows(full, cfg.batch_size, ctx.ops.seed)

    def batch_at(i, key):
        b = rows_of(i)
        if K == 1:
            return b
        w = rx.train.bootstrap_weights(key, b.chosen_tokens.shape[0], K)
        return rx.train.BootstrapBatch(pairs=b, weights=w)

    state = RewardRunState(
        ts, ts.params, jnp.asarray(-1.0, jnp.float32), jnp.asarray(-1, jnp.int32)
    )

    def iteration(st: RewardRunState, key, i):
        k_boot, k_step = jax.random.split(key) if K > 1 else (None, key)
        ts, m = st.train.apply(step, batch_at(i, k_boot), key=k_step)
        if val_batch is not None and ((i + 1) % cfg.eval_every == 0 or i + 1 == cfg.steps):
            acc = reward_accuracy(scorer(ts.model), val_batch)
            m = {**m, "validation/accuracy": acc}
            if acc > float(st.best_accuracy):
                best = (ts.params, jnp.asarray(acc, jnp.float32), jnp.asarray(i + 1, jnp.int32))
                return RewardRunState(ts, *best), [m], {}
        return eqx.tree_at(lambda s: s.train, st, ts), [m], {}

    tokens = 2 * cfg.batch_size * cfg.max_length
    res = run_loop(
        state,
        iteration,
        dataclasses.replace(ctx, key=ctx_key),
        cfg.steps,
        tokens_per_iteration=tokens,
        flops_per_iteration=model_flops(rx.count_params(ts.model), train_tokens=tokens),
    )
    final: RewardRunState = res.state
    ts = final.train
    if val_batch is not None and int(final.best_step) > 0:
        ts = eqx.tree_at(lambda s: s.params, ts, final.best_params)
        summary = {
            "event": "reward_selection",
            "message": (
                f"kept the model of step {int(final.best_step)} (held-out accuracy "
                f"{float(final.best_accuracy):.3f} on {len(val)} pairs)"
            ),
            "selected_step": int(final.best_step),
            "validation_accuracy": float(final.best_accuracy),
            "train_accuracy": reward_accuracy(scorer(ts.model), full),
            "validation_pairs": len(val),
            "train_pairs": len(pairs),
        }
        ctx.log.write(summary)
        info = {k: v for k, v in summary.items() if k not in ("event", "message")}
        return RunResult(ts, res.history, res.loop, info)
    return RunResult(ts, res.history, res.loop)
