"""The batch stages of the built-in task as sweeps (SFT, KTO): the same data preparation
as the normal stage (per seed), then `steps` updates of every member's stacked state in
one vmapped program per step, member `m`'s step `i` on its separate run's batch
(`shuffled_rows` with its seed) and key (`fold_in(ctx_key, i)`)."""

from collections.abc import Callable, Sequence

import jax
import numpy as np

import rlhf_eqx as rx

from ._kto_stage import collate_unpaired_records, sampled_unpaired
from ._registry import stage_key
from ._runs import shuffled_rows
from ._sft_stage import sft_rows
from ._sweep_grid import Member
from ._sweep_program import Iteration, SweepRun, key_data, stack
from ._sweep_setup import member_states, policy_outputs, program_of, take_steps
from ._sweep_starts import SeedStart
from ._sweep_steps import kto_step_builder, sft_step_builder
from ._task import TRAIN_PROMPTS


def offline_sweep(
    members: Sequence[Member],
    states,
    ctx_keys: Sequence[jax.Array],
    batch_at: Callable[[Member], Callable[[int], object]],
    build_step: Callable[[dict], Callable],
    steps: int,
    outputs: tuple[Callable, Callable],
) -> SweepRun:
    """A sweep of fixed batches: the members' stacked initial train `states`, their run
    keys `ctx_keys`, `batch_at(mem)(i)` member `mem`'s batch of step `i`; iteration `i`
    is step `i` of every alive member, in one program (`make_program`). `outputs`:
    `(evaluate, export)` of the `SweepRun`."""
    program, hyper = program_of(members, states, build_step)
    batches_of = [batch_at(mem) for mem in members]
    M = len(members)

    def iteration(states, alive: np.ndarray, i: int) -> Iteration:
        batches = stack([b(i) for b in batches_of])
        keys = key_data([jax.random.fold_in(k, i) for k in ctx_keys])
        records: list[list[dict]] = [[] for _ in range(M)]
        finite = np.ones(M, bool)
        states, _ = take_steps(program, states, hyper, keys, batches, alive, records, finite)
        return Iteration(states, finite, records, [{} for _ in range(M)])

    return SweepRun(states, steps, iteration, *outputs)


def rows_sweep(members, c, started: tuple, fulls: dict, build_step, outputs) -> SweepRun:
    """`offline_sweep` on shuffled rows, as `run_sft` and `run_kto` train: `started` the
    `(states, ctx_keys)` of `member_states`, `fulls[seed]` the batch of every row of the
    members of that seed, member `m`'s step `i` on `shuffled_rows` of it with its seed
    and `c.batch_size` (the stage's settings `c`), `c.steps` steps."""
    states, ctx_keys = started
    return offline_sweep(
        members,
        states,
        ctx_keys,
        lambda mem: shuffled_rows(fulls[mem.seed], c.batch_size, mem.seed),
        build_step,
        c.steps,
        outputs,
    )


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
        fulls[seed] = sft_rows(records, tok, c0, prompt_length)
    states, _, ctx_keys = member_states(
        members,
        "sft",
        lambda mem: (starts[mem.seed].env.base, stage_key(starts[mem.seed].key, "sft")),
        c0.steps,
    )

    def evaluate(m: int, policy) -> dict:
        start = starts[members[m].seed]
        return start.evaluate(policy, start.env.base)[0]

    outputs = policy_outputs("sft", evaluate, tokenizer_file)
    return rows_sweep(
        members, c0, (states, ctx_keys), fulls, sft_step_builder(c0, c0.steps), outputs
    )


def kto_sweep(
    members: Sequence[Member], starts: dict[int, SeedStart], tok, *, tokenizer_file=None
) -> SweepRun:
    """The built-in KTO stage as a sweep: per seed, the SFT policy's samples labelled by
    the noisy scorer and their reference log-probabilities (the SFT policy's); per
    member, `run_kto`'s setup with its traced `beta`, `desirable_weight`,
    `undesirable_weight` and learning rate. Evaluation: against SFT, as the pipeline's."""
    c0 = members[0].cfg.kto
    sampling = members[0].cfg.sampling
    states, references, ctx_keys = member_states(
        members,
        "kto",
        lambda mem: (starts[mem.seed].sft_policy, stage_key(starts[mem.seed].key, "kto")),
        c0.steps,
    )
    fulls = {}
    for mem, reference in zip(members, references):
        if mem.seed in fulls:
            continue
        start = starts[mem.seed]
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
        fulls[mem.seed] = rx.train.compute_kto_reference_logps(reference, full)
    outputs = policy_outputs(
        "kto", lambda m, policy: starts[members[m].seed].against_sft(policy), tokenizer_file
    )
    return rows_sweep(
        members, c0, (states, ctx_keys), fulls, kto_step_builder(c0, c0.steps), outputs
    )
