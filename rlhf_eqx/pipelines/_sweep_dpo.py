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

from collections.abc import Sequence

import equinox as eqx
import jax
import numpy as np

import rlhf_eqx as rx

from ._dpo_stage import best_worst_pairs, penalised_labels
from ._registry import stage_key
from ._rollout import sampling_options
from ._runs import collate_pairs, rows_at, take_rows
from ._sweep_grid import Member
from ._sweep_program import Iteration, SweepRun, key_data, member, stack
from ._sweep_rollout import sample_members
from ._sweep_setup import member_states, policy_outputs, program_of, take_steps
from ._sweep_starts import SeedStart
from ._sweep_steps import dpo_step_builder
from ._task import TRAIN_PROMPTS


@eqx.filter_jit
def _reference_all(references, batches):
    """`compute_reference_logps` of each member's batch with its reference, vmapped."""
    return eqx.filter_vmap(rx.train.compute_reference_logps)(references, batches)


def n_rows(batch) -> int:
    """The rows of a preference batch (`None`: 1, a placeholder)."""
    return 1 if batch is None else int(batch.chosen_tokens.shape[0])


def dpo_sweep(
    members: Sequence[Member], starts: dict[int, SeedStart], tok, *, tokenizer_file=None
) -> SweepRun:
    """The built-in DPO stage of `members` (see the module docstring); `starts[seed]`
    holds each seed's SFT policy and evaluation."""
    c0 = members[0].cfg.dpo
    total = c0.rounds * c0.steps
    sampling = members[0].cfg.sampling
    stacked, references, ctx_keys = member_states(
        members,
        "dpo",
        lambda mem: (starts[mem.seed].sft_policy, stage_key(starts[mem.seed].key, "dpo")),
        total,
    )
    program, hyper = program_of(members, stacked, dpo_step_builder(c0, total))
    refs = stack(references)
    rows = len(TRAIN_PROMPTS)  # best_worst_pairs: at most one pair a prompt
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
            truncated = np.asarray(roll.truncated)  # as run_online_dpo penalises them
            labels = starts[mem.seed].label(roll.prompts, roll.texts, r)
            labels = penalised_labels(labels, truncated, mem.cfg.dpo)
            pairs = best_worst_pairs(TRAIN_PROMPTS, roll.texts, labels, c0.samples)
            info[m] = {"pairs": float(len(pairs)), "label_mean": float(np.mean(labels))}
            if mem.cfg.dpo.missing_eos_penalty is not None:
                info[m]["missing_eos"] = float(np.mean(truncated))
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
            states, active = take_steps(
                program, states, hyper, keys_s, stack(batches), active, records, finite
            )
        return Iteration(states, finite, records, info, events)

    evaluate, export = policy_outputs(
        "dpo", lambda m, policy: starts[members[m].seed].against_sft(policy), tokenizer_file
    )
    return SweepRun(stacked, c0.rounds, iteration, evaluate, export)
