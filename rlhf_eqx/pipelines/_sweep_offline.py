"""The batch stages of the built-in task as sweeps (SFT, KTO): the same data preparation
as the normal stage (per seed), then `steps` updates of every member's stacked state in
one vmapped program per step, member `m`'s step `i` on its separate run's batch
(`shuffled_rows` with its seed) and key (`fold_in(ctx_key, i)`)."""

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np

import rlhf_eqx as rx
from rlhf_eqx import data

from ._kto_stage import collate_unpaired_records, sampled_unpaired
from ._lr_scale import build_optimizer
from ._registry import stage_key
from ._runs import export_policy, final_policy, shuffled_rows, with_lora
from ._sweep_grid import Member
from ._sweep_program import (
    Iteration,
    SweepRun,
    hyper_arrays,
    key_data,
    make_program,
    member,
    one_seed_shared,
    stack,
    unstacked_metrics,
)
from ._sweep_starts import SeedStart
from ._task import TRAIN_PROMPTS
from ._validation import validate_stage


def offline_sweep(
    members: Sequence[Member],
    setups: Sequence[tuple],
    build_step: Callable[[dict], Callable],
    steps: int,
    *,
    evaluate: Callable[[object, int], dict],
    export: Callable[[object, int, str], None],
) -> SweepRun:
    """A sweep of fixed batches: `setups[m] = (state, batch_at, ctx_key)` for member `m`
    (its initial train state, `batch_at(i)` its batch of step `i`, its run's key);
    iteration `i` is step `i` of every alive member, in one program (`make_program`)."""
    states = stack([s[0] for s in setups])
    program = make_program(build_step, seeds=one_seed_shared(states, [m.seed for m in members]))
    hyper = hyper_arrays([dict(m.point) for m in members])
    M = len(members)

    def iteration(states, alive: np.ndarray, i: int) -> Iteration:
        batches = stack([batch_at(i) for _, batch_at, _ in setups])
        keys = key_data([jax.random.fold_in(k, i) for _, _, k in setups])
        states, metrics, ok = program(states, hyper, keys, batches, alive)
        ok = np.asarray(ok)
        records = [[unstacked_metrics(metrics, m)] if alive[m] else [] for m in range(M)]
        return Iteration(states, ok | ~alive, records, [{} for _ in range(M)])

    return SweepRun(states, steps, iteration, evaluate, export)


def _optim(c, h: dict):
    if "optim.learning_rate" in h:
        return dataclasses.replace(c.optim, learning_rate=h["optim.learning_rate"])
    return c.optim


def _policy_export(stage: str, tokenizer_file):
    def export(states, m: int, directory: str) -> None:
        model = member(states, m).model
        export_policy(
            final_policy(model), directory, stage, adapted=model, tokenizer_file=tokenizer_file
        )

    return export


def sft_sweep(
    members: Sequence[Member], starts: dict[int, SeedStart], tok, *, tokenizer_file=None
) -> SweepRun:
    """The built-in SFT stage as a sweep: per seed, the base model's best-of-`samples`
    completions by noisy labels (the stage's own sampling and labels); per member,
    `run_sft`'s setup with its learning rate. Evaluation: the held-out score, the base
    model's NLL and the KL to the base, as the pipeline reports for SFT."""
    c0 = members[0].cfg.sft
    prompt_length = members[0].cfg.sampling.prompt_length
    fulls = {}
    for seed, start in starts.items():
        roll = start.env.sample(start.env.base, TRAIN_PROMPTS, 0, c0.samples)
        labels = np.asarray(start.label(roll.prompts, roll.texts, 1)).reshape(-1, c0.samples)
        best = labels.argmax(axis=1)
        records = [
            (p, roll.texts[j * c0.samples + b]) for j, (p, b) in enumerate(zip(TRAIN_PROMPTS, best))
        ]
        seqs, _ = data.tokenize_sft(
            records, tok, max_length=c0.max_length, max_prompt_length=prompt_length, add_eos=False
        )
        fulls[seed] = data.collate_sft(seqs, max_length=c0.max_length, pad_id=tok.pad_id)
    setups = []
    for mem in members:
        c = mem.cfg.sft
        validate_stage("sft", c)
        start = starts[mem.seed]
        k_lora, ctx_key = jax.random.split(stage_key(start.key, "sft"))
        model, spec = with_lora(start.env.base, c.lora, k_lora)
        opt = build_optimizer(c.optim, c.steps)
        state = rx.train.init_train_state(model, opt, filter_spec=spec)
        setups.append((state, shuffled_rows(fulls[mem.seed], c.batch_size, mem.seed), ctx_key))

    def build(h: dict):
        opt = build_optimizer(_optim(c0, h), c0.steps)
        return rx.train.make_sft_step(opt, c0, options=c0.options)

    def evaluate(states, m: int) -> dict:
        start = starts[members[m].seed]
        metrics, _, _ = start.evaluate(final_policy(member(states, m).model), start.env.base)
        return metrics

    export = _policy_export("sft", tokenizer_file)
    return offline_sweep(members, setups, build, c0.steps, evaluate=evaluate, export=export)


def kto_sweep(
    members: Sequence[Member], starts: dict[int, SeedStart], tok, *, tokenizer_file=None
) -> SweepRun:
    """The built-in KTO stage as a sweep: per seed, the SFT policy's samples labelled by
    the noisy scorer and their reference log-probabilities (the SFT policy's); per
    member, `run_kto`'s setup with its traced `beta`, `desirable_weight`,
    `undesirable_weight` and learning rate. Evaluation: against SFT, as the pipeline's."""
    c0 = members[0].cfg.kto
    sampling = members[0].cfg.sampling
    fulls = {}
    setups = []
    for mem in members:
        c = mem.cfg.kto
        validate_stage("kto", c)
        start = starts[mem.seed]
        k_lora, ctx_key = jax.random.split(stage_key(start.key, "kto"))
        model, spec = with_lora(start.sft_policy, c.lora, k_lora)
        if mem.seed not in fulls:
            records = sampled_unpaired(
                start.sft_policy,
                tok,
                TRAIN_PROMPTS,
                start.env.data_key(3),
                start.label,
                samples=c0.samples,
                salt=4,
                sampling=sampling,
            )
            if {bool(r.label) for r in records} != {True, False}:
                raise ValueError(
                    f"seed {mem.seed}: KTO needs desirable and undesirable examples; the "
                    f"{len(records)} samples are all of one kind"
                )
            full = collate_unpaired_records(
                records, tok, max_length=c0.max_length, prompt_length=sampling.prompt_length
            )
            reference = rx.without_lora(model) if spec is not None else model
            fulls[mem.seed] = rx.train.compute_kto_reference_logps(reference, full)
        opt = build_optimizer(c.optim, c.steps)
        state = rx.train.init_train_state(model, opt, filter_spec=spec)
        setups.append((state, shuffled_rows(fulls[mem.seed], c.batch_size, mem.seed), ctx_key))

    def build(h: dict):
        opt = build_optimizer(_optim(c0, h), c0.steps)
        settings = rx.train.KTOSettings(
            beta=h.get("beta", c0.beta),
            desirable_weight=h.get("desirable_weight", c0.desirable_weight),
            undesirable_weight=h.get("undesirable_weight", c0.undesirable_weight),
            loss_type=c0.loss_type,
            reference="cached",
        )
        return rx.train.make_kto_step(opt, settings, options=c0.options)

    def evaluate(states, m: int) -> dict:
        return starts[members[m].seed].against_sft(final_policy(member(states, m).model))

    export = _policy_export("kto", tokenizer_file)
    return offline_sweep(members, setups, build, c0.steps, evaluate=evaluate, export=export)
