"""Distillation runs (GKD, Agarwal et al. 2024): a student trained toward a teacher's
token distributions with the generalized JSD, on fixed completions and, for a fraction
`lmbda` of the steps, on the student's own samples (on-policy)."""

import dataclasses
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp

import rlhf_eqx as rx
from rlhf_eqx import data

from ._lr_scale import build_optimizer
from ._rollout import sample_rollout, sampling_options
from ._runs import RunContext, RunResult, rows_at, run_loop, take_rows, with_lora
from ._stage_configs import (
    DistillConfig,
)
from ._validation import validate_stage

LOSS_TEMPERATURE = rx.train.DistillSettings.temperature
"""The temperature of the distillation stage's divergence: `DistillSettings`' default
(1.0), as TRL's `GKDTrainer` computes its loss (`generalized_jsd_loss` at its default
`temperature=1.0`); the stage's
`distill.temperature` (TRL `GKDConfig.temperature`, 0.9) is the temperature the
on-policy completions are sampled at."""


def check_same_vocabulary(student, teacher) -> None:
    """Refuse (`ValueError`) a teacher whose vocabulary differs from the student's,
    naming both sizes: distillation compares distributions over the same token ids."""
    sv, tv = student.cfg.vocab_size, teacher.cfg.vocab_size
    if sv != tv:
        raise ValueError(
            f"distill.teacher: the teacher's vocab_size={tv} differs from the student's "
            f"vocab_size={sv}; teacher and student must share a tokenizer"
        )


def load_teacher(directory: str, student) -> rx.Policy:
    """The distillation teacher of the checkpoint `directory` (`distill.teacher`; a
    `.gguf` file loads with `rx.load_gguf`): its weights only (it reads the student's
    tokens, so its own tokenizer file is not needed), checked to share the student's
    vocabulary. A `ConfigError` naming
    `distill.teacher` (with both vocabulary sizes when they differ) otherwise."""
    from ._config import ConfigError

    try:
        if directory.lower().endswith(".gguf"):
            teacher, _ = rx.load_gguf(directory)
        else:
            teacher = rx.load_hf(directory)
    except (OSError, ValueError) as e:
        raise ConfigError(f"distill.teacher={directory!r}: {str(e).splitlines()[0]}") from None
    if not isinstance(teacher, rx.Policy):
        raise ConfigError(
            f"distill.teacher={directory!r}: holds a {type(teacher).__name__}, not a policy"
        )
    try:
        check_same_vocabulary(student, teacher)
    except ValueError as e:
        raise ConfigError(f"distill.teacher={directory!r}: {str(e).split(': ', 1)[1]}") from None
    return teacher


def completions_batch(
    records: Sequence[tuple[str, str]], tok, *, max_length: int, prompt_length: int
) -> rx.train.DistillBatch:
    """`(prompt, completion)` records as a right-padded `DistillBatch` (no EOS)."""
    seqs, _ = data.tokenize_sft(
        list(records), tok, max_length=max_length, max_prompt_length=prompt_length, add_eos=False
    )
    b = data.collate_sft(seqs, max_length=max_length, pad_id=tok.pad_id)
    return rx.train.DistillBatch(b.tokens, b.mask, b.completion_mask)


def run_distill(
    student,
    teacher,
    tok,
    prompts: Sequence[str],
    completions: rx.train.DistillBatch,
    *,
    cfg: DistillConfig,
    ctx: RunContext,
) -> RunResult:
    """GKD (Agarwal et al. 2024; TRL `GKDTrainer`): `cfg.steps` steps of
    `make_distill_step` (generalized JSD with interpolation `cfg.beta`, teacher logits
    computed on the fly, LM head on completion positions only) on `cfg.batch_size` rows.
    Step `i` is on-policy with probability `cfg.lmbda` (drawn from `fold_in(key, i)`):
    its completions are sampled from the current student for the rows' prompts with the
    run's sampling settings at temperature `cfg.temperature`; otherwise they are the
    rows of `completions` (dataset completions, or the teacher's own samples).
    `prompts[j]` is the prompt of row `j`. As in TRL, `cfg.temperature` (0.9) is the
    sampling temperature only: the divergence is computed at `LOSS_TEMPERATURE` (τ = 1;
    TRL 1.16 `trl/experimental/gkd/gkd_trainer.py`: `compute_loss` calls
    `generalized_jsd_loss` without a temperature, and `GKDConfig.temperature` goes to
    the generation config).
    The student trains LoRA adapters per `cfg.lora`; teacher and student must share a
    vocabulary (`check_same_vocabulary`) and may differ in size."""
    validate_stage("distill", cfg)
    check_same_vocabulary(student, teacher)
    n = completions.tokens.shape[0]
    if len(prompts) != n:
        raise ValueError(f"run_distill: {len(prompts)} prompts for {n} completion rows")
    k_lora, ctx_key = jax.random.split(ctx.key)
    model, spec = with_lora(student, cfg.lora, k_lora)
    opt = build_optimizer(cfg.optim, cfg.steps)
    state = rx.train.init_train_state(model, opt, filter_spec=spec)
    settings = rx.train.DistillSettings(beta=cfg.beta, temperature=LOSS_TEMPERATURE)
    step = rx.train.make_distill_step(opt, settings, options=cfg.options)
    sampling = on_policy_sampling(ctx, cfg)

    def iteration(state, key, i):
        rows = rows_at(n, cfg.batch_size, ctx.ops.seed, i)
        k_coin, k_sample, k_step = jax.random.split(key, 3)
        on_policy = float(jax.random.uniform(k_coin)) < cfg.lmbda
        if on_policy:
            roll = sample_rollout(
                state.model, tok, [prompts[j] for j in rows], k_sample, **sampling
            )
            batch = rx.train.DistillBatch(roll.tokens, roll.mask, roll.completion_mask)
        else:
            batch = take_rows(completions, rows)
        state, m = state.apply(step, batch, key=k_step, teacher=teacher)
        return state, [{**m, "on_policy": float(on_policy)}], {}

    tokens = cfg.batch_size * cfg.max_length
    return run_loop(
        state,
        iteration,
        dataclasses.replace(ctx, key=ctx_key),
        cfg.steps,
        policy_of=lambda s: s.model,
        tokens_per_iteration=tokens,
    )


def on_policy_sampling(ctx: RunContext, cfg: DistillConfig) -> dict:
    """The sampling keywords of the on-policy steps: the run's, at `cfg.temperature`."""
    return dict(sampling_options(ctx), temperature=cfg.temperature)


@eqx.filter_jit
def _jsd(student, teacher, batch, beta, temperature):
    params, frozen = eqx.partition(student, eqx.is_inexact_array)
    loss = rx.train.distill_loss(beta=beta, temperature=temperature)
    _, _, metrics = loss(params, (frozen, teacher), batch, None)
    num, den = metrics["jsd"]
    return num / jnp.maximum(den, 1.0)


def distill_divergence(
    student, teacher, batch, *, beta: float, temperature: float = LOSS_TEMPERATURE
) -> float:
    """Mean generalized JSD per completion token between `student` and `teacher` on a
    `DistillBatch` at `temperature` (the held-out measure of a distillation run, at the
    temperature of its loss)."""
    f32 = jnp.float32  # traced: one compile for every beta and temperature
    return float(
        _jsd(student, teacher, batch, jnp.asarray(beta, f32), jnp.asarray(temperature, f32))
    )


def sampled_completions(
    teacher, tok, prompts: Sequence[str], key, *, samples: int, sampling
) -> tuple[list[str], list[tuple[str, str]]]:
    """`samples` completions per prompt from `teacher` as `(prompt, completion)` records
    (the off-policy half of GKD on a task without reference completions)."""
    roll = sample_rollout(
        teacher, tok, prompts, key, group_size=samples, **sampling_options(sampling)
    )
    return list(roll.prompts), list(zip(roll.prompts, roll.texts))
