"""The built-in DPO stage as a sweep: each member is `run_online_dpo` from its seed's SFT
policy with its own β / learning rate, the same keys, samples, labels, pairs and
batches as its separate run (`python -m rlhf_eqx dpo --set ops.seed=S --set
dpo.beta=B`), and the updates of all members in one vmapped program per step.

Per round: the members' rollouts are sampled in one vmapped sampler call
(`sample_members`); labelling and pairing are per member; the reference
log-probabilities (a forward of each member's reference, its SFT policy) are one
vmapped call over the members, their pairs padded to one pair a prompt (the most a
round gives), so that one program serves every round; then `dpo.steps` steps of the
stacked states. A member without a pair in a round takes no step in it, as its
separate run."""

import dataclasses
from collections.abc import Sequence

import equinox as eqx
import jax
import numpy as np

import rlhf_eqx as rx

from ._dpo_stage import best_worst_pairs
from ._lr_scale import build_optimizer
from ._registry import stage_key
from ._rollout import sampling_options
from ._runs import collate_pairs, export_policy, final_policy, rows_at, take_rows, with_lora
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
from ._sweep_rollout import sample_members
from ._sweep_starts import SeedStart
from ._task import TRAIN_PROMPTS
from ._validation import validate_stage


@eqx.filter_jit
def _reference_all(references, batches):
    """`compute_reference_logps` of each member's batch with its reference, vmapped."""
    return eqx.filter_vmap(rx.train.compute_reference_logps)(references, batches)


def n_rows(batch) -> int:
    """The rows of a preference batch (`None`: 1, a placeholder)."""
    return 1 if batch is None else int(batch.chosen_tokens.shape[0])


def dpo_step_builder(c, total_steps: int):
    """`build_step(hyper)` for `make_program`: `make_dpo_step` with the member's traced
    `beta`, `label_smoothing` and peak learning rate (`optim.learning_rate`)."""

    def build(h: dict):
        optim = c.optim
        if "optim.learning_rate" in h:
            optim = dataclasses.replace(optim, learning_rate=h["optim.learning_rate"])
        settings = rx.train.DPOSettings(
            **{f.name: getattr(c, f.name) for f in dataclasses.fields(rx.train.DPOSettings)}
        )
        traced = {k: h[k] for k in ("beta", "label_smoothing") if k in h}
        settings = dataclasses.replace(settings, **traced)
        return rx.train.make_dpo_step(
            build_optimizer(optim, total_steps), settings, options=c.options
        )

    return build


def dpo_sweep(
    members: Sequence[Member], starts: dict[int, SeedStart], tok, *, tokenizer_file=None
) -> SweepRun:
    """The built-in DPO stage of `members` (see the module docstring); `starts[seed]`
    holds each seed's SFT policy and evaluation."""
    c0 = members[0].cfg.dpo
    total = c0.rounds * c0.steps
    sampling = members[0].cfg.sampling
    states, references, ctx_keys = [], [], []
    for mem in members:
        c = mem.cfg.dpo
        validate_stage("dpo", c)
        start = starts[mem.seed]
        k_lora, ctx_key = jax.random.split(stage_key(start.key, "dpo"))
        model, spec = with_lora(start.sft_policy, c.lora, k_lora)
        references.append(rx.without_lora(model) if spec is not None else model)
        opt = build_optimizer(c.optim, total)
        states.append(rx.train.init_train_state(model, opt, filter_spec=spec))
        ctx_keys.append(ctx_key)
    stacked = stack(states)
    shared = one_seed_shared(stacked, [m.seed for m in members])
    program = make_program(dpo_step_builder(c0, total), seeds=shared)
    refs = stack(references)
    rows = len(TRAIN_PROMPTS)  # best_worst_pairs: at most one pair a prompt
    hyper = hyper_arrays([dict(m.point) for m in members])
    M = len(members)

    def iteration(states, alive: np.ndarray, r: int) -> Iteration:
        keys = [jax.random.split(jax.random.fold_in(k, r)) for k in ctx_keys]
        k_sample, k_steps = [k[0] for k in keys], [k[1] for k in keys]
        rolls = sample_members(
            states.model,
            tok,
            [TRAIN_PROMPTS] * M,
            k_sample,
            group_size=c0.samples,
            **sampling_options(sampling),
        )
        fulls: list = [None] * M
        info: list[dict] = [{} for _ in range(M)]
        events = []
        for m, mem in enumerate(members):
            if not alive[m]:
                continue
            roll = rolls[m]
            labels = starts[mem.seed].label(roll.prompts, roll.texts, r)
            pairs = best_worst_pairs(TRAIN_PROMPTS, roll.texts, labels, c0.samples)
            info[m] = {"pairs": float(len(pairs)), "label_mean": float(np.mean(labels))}
            if not pairs:
                msg = f"round {r}: all completions of every prompt got the same label; no pairs"
                events.append((m, "no_signal", msg))
                continue
            fulls[m] = collate_pairs(
                pairs, tok, max_length=c0.max_length, prompt_length=sampling.prompt_length
            )
        active = np.asarray([f is not None for f in fulls]) & alive
        records: list[list[dict]] = [[] for _ in range(M)]
        finite = np.ones(M, bool)
        if not active.any():
            return Iteration(states, finite, records, info, events)
        filler = next(f for f in fulls if f is not None)
        padded = [
            take_rows(f if f is not None else filler, np.arange(rows) % n_rows(f)) for f in fulls
        ]
        referenced = _reference_all(refs, stack(padded))
        for m, f in enumerate(fulls):
            if f is not None:
                fulls[m] = take_rows(member(referenced, m), np.arange(n_rows(f)))
        filler = next(f for f in fulls if f is not None)
        for s in range(c0.steps):
            batches = []
            for m, mem in enumerate(members):
                full = fulls[m] if fulls[m] is not None else filler
                n = full.chosen_tokens.shape[0]
                batches.append(take_rows(full, rows_at(n, c0.batch_size, mem.seed + r, s)))
            keys_s = key_data([jax.random.fold_in(k, s) for k in k_steps])
            states, metrics, ok = program(states, hyper, keys_s, stack(batches), active)
            ok = np.asarray(ok)
            for m in map(int, np.flatnonzero(active)):
                records[m].append(unstacked_metrics(metrics, m))
                if not ok[m]:
                    finite[m] = False
            active = active & ok
        return Iteration(states, finite, records, info, events)

    def evaluate(states, m: int) -> dict:
        return starts[members[m].seed].against_sft(final_policy(member(states, m).model))

    def export(states, m: int, directory: str) -> None:
        model = member(states, m).model
        export_policy(
            final_policy(model), directory, "dpo", adapted=model, tokenizer_file=tokenizer_file
        )

    return SweepRun(stacked, c0.rounds, iteration, evaluate, export)
