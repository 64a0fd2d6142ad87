"""Sweeps on a data file (`rlhf_eqx sweep STAGE --data FILE`): each member is the stage's
run on that file (`rlhf_eqx STAGE --data FILE --set ops.seed=S --set <grid values>`,
`run_on_data`) with the same data, keys and updates, and reports the held-out numbers
that run writes in `summary[<stage>]`.

The file is read, split (by `data.seed`, not by the run's seed), filtered and tokenised
once, and shared by the members; what depends on the seed is per member as in its run:
the run key `ops.seed` (LoRA adapters, step keys) and the row order (`shuffled_rows`).

- `sft`: the file's demonstrations, or a preference file's chosen responses, as the
  `sft` stage reads them (`sft_split`); the held-out NLL before and after.
- `dpo`: offline DPO on the pairs (unpacked batches: `dpo.packing` is refused), the
  reference log-probabilities of each seed's rows computed with the first batch that
  holds them (`referenced_rows`, once per seed); the held-out implicit reward accuracy.
- `kto`: an unpaired file, or pairs split into a desirable and an undesirable example
  (`kto_examples`); the held-out metrics of `kto_data_metrics`.
- `reward`: one reward model per member (`reward.ensemble = 1`), its checkpoint
  selection on the seed's validation split (keyed by `data_validation_seed`, as
  `reward_on_data` keys it); the held-out accuracy.
- `grpo`: the prompts as `grpo_on_data` reads them (`grpo_prompts`), every member from
  the base model, its rollouts `rows_at` its seed, scored by the exact-match reward,
  the user's `grpo.reward_functions` or `grpo.reward_source` (one source for all: a
  sweep does not vary them), the rollouts of all members sampled in one call and their
  updates in one program (`rollouts_sweep`: the built-in GRPO sweep's KL guard and
  divergence masking); the held-out exact-match rate before and after, or the held-out
  reward when some prompt has no answer (`heldout_scores`). The settings a GRPO sweep does not run
  are refused (`check_grpo_sweep`).
"""

import dataclasses
import os
from collections.abc import Sequence

import jax
import numpy as np

import rlhf_eqx as rx

from ._config import ConfigError
from ._data_prep import DATA_EOS, implicit_accuracy, nll, preference_split, trained_policy
from ._data_runs import check_data_reward_model
from ._dpo_stage import referenced_rows
from ._evaluate import binomial_se
from ._grpo_stage import grpo_prompts, heldout_scores
from ._kto_stage import collate_unpaired_records, kto_data_metrics, kto_examples
from ._registry import StageEnv
from ._reward_stage import data_validation_seed
from ._runs import collate_pairs
from ._sampled_eval import heldout_samples
from ._sft_stage import sft_rows, sft_samples, sft_split
from ._sweep_grid import Member
from ._sweep_grpo import check_grpo_sweep, rollouts_sweep, trained_model
from ._sweep_offline import offline_sweep, rows_sweep
from ._sweep_program import SweepRun
from ._sweep_reward import check_reward_sweep, reward_members, reward_split
from ._sweep_setup import member_states, policy_outputs
from ._sweep_starts import sweep_env
from ._sweep_steps import dpo_step_builder, kto_step_builder, sft_step_builder

DATA_STAGES = ("sft", "dpo", "kto", "reward", "grpo")
"""The stages that sweep on a data file."""


def data_dir(out: str) -> str:
    """Where a data-file sweep in `out` logs what it read (`metrics.jsonl`: the reader's
    and the filters' events)."""
    return os.path.join(out, "data")


def check_data_sweep(stage: str, cfg) -> None:
    """Refuse (`ConfigError`) a data-file sweep of a stage or settings it does not run,
    naming the stage or field, before anything is loaded."""
    if stage not in DATA_STAGES:
        raise ConfigError(
            f"sweep {stage} --data: not supported (stages that sweep a data file: "
            f"{', '.join(DATA_STAGES)}; data.path must be unset for the built-in task)"
        )
    if stage in ("dpo", "sft") and getattr(cfg, stage).packing:
        raise ConfigError(
            f"{stage}.packing=True: {'an' if stage == 'sft' else 'a'} {stage.upper()} sweep "
            "trains every member on the same "
            f"fixed-shape batches of rows ({stage}.packing=false)"
        )
    if stage == "reward":
        check_reward_sweep(cfg.reward)
    if stage == "grpo":
        check_grpo_sweep(cfg.grpo, reward_source=True)
        check_data_reward_model("grpo", cfg.grpo)


def data_sweep(
    stage: str, members: Sequence[Member], base, tok, out: str, *, say, tokenizer_file=None
) -> SweepRun:
    """The data-file sweep of `stage` (see the module docstring): the file of
    `members[0].cfg.data` read once, `base` every member's start."""
    cfg = members[0].cfg
    check_data_sweep(stage, cfg)
    key = jax.random.key(cfg.ops.seed)
    env = sweep_env(cfg, base, tok, data_dir(out), key, resume=False, say=say, stage=stage)
    env.summary["data"] = cfg.data.path
    return _SWEEPS[stage](members, env, tokenizer_file)


def _starts(members: Sequence[Member], section: str, env: StageEnv, total: int):
    """`member_states` from the base model with each member's run key `key(ops.seed)`."""
    return member_states(members, section, lambda mem: (env.base, jax.random.key(mem.seed)), total)


def _outputs(stage: str, members, env: StageEnv, metrics, tokenizer_file, policy_of=None):
    """`policy_outputs` of a data-file stage: member `m`'s trained policy
    (`trained_policy` of `policy_of(states, m)`, by default the model of stacked train
    states) evaluated by `metrics(env_m, m, policy)`, `env_m` the member's environment
    (its configuration: held-out samples with its seed)."""

    def evaluate(m: int, policy) -> dict:
        return metrics(dataclasses.replace(env, cfg=members[m].cfg), m, policy)

    finish = lambda model: trained_policy(env, model)  # noqa: E731
    return policy_outputs(stage, evaluate, tokenizer_file, policy_of=policy_of, finish=finish)


def _rows(stage: str, members, started: tuple, full, outputs) -> SweepRun:
    """`rows_sweep` of `stage` (`sft`, `kto`) on the rows of `full`, shared by every seed."""
    c = getattr(members[0].cfg, stage)
    build = {"sft": sft_step_builder, "kto": kto_step_builder}[stage](c, c.steps)
    return rows_sweep(members, c, started, {mem.seed: full for mem in members}, build, outputs)


def _sft(members: Sequence[Member], env: StageEnv, tokenizer_file) -> SweepRun:
    c0, pl = members[0].cfg.sft, env.cfg.sampling.prompt_length
    train, held, prompted = sft_split(env, c0)
    full = sft_rows(train, env.tok, c0, pl, add_eos=DATA_EOS)
    held_batch = sft_rows(held, env.tok, c0, pl, add_eos=DATA_EOS)
    before = float(nll(env.base, held_batch))

    def metrics(env_m: StageEnv, m: int, policy) -> dict:
        after = float(nll(policy, held_batch))
        return {
            "heldout_nll_before": before,
            "heldout_nll": after,
            "heldout_perplexity": float(np.exp(after)),
            "sampled": sft_samples(env_m, env.base, policy, held, prompted, base_side),
        }

    base_side: dict = {}  # the base model's held-out samples, once per seed
    states, _, ctx_keys = _starts(members, "sft", env, c0.steps)
    outputs = _outputs("sft", members, env, metrics, tokenizer_file)
    return _rows("sft", members, (states, ctx_keys), full, outputs)


def _dpo(members: Sequence[Member], env: StageEnv, tokenizer_file) -> SweepRun:
    c0, pl = members[0].cfg.dpo, env.cfg.sampling.prompt_length
    train, held = preference_split(env, c0)
    lengths = dict(max_length=c0.max_length, prompt_length=pl, add_eos=DATA_EOS)
    full = collate_pairs(train, env.tok, **lengths)
    held_batch = collate_pairs(held, env.tok, **lengths)

    def metrics(env_m: StageEnv, m: int, policy) -> dict:
        acc = float(implicit_accuracy(policy, env.base, held_batch, members[m].cfg.dpo.beta))
        return {
            "heldout_reward_accuracy": acc,
            "heldout_reward_accuracy_se": binomial_se(acc, len(held)),
            "sampled": heldout_samples(env_m, env.base, policy, held, base_side),
        }

    base_side: dict = {}  # the base model's held-out samples, once per seed
    states, references, ctx_keys = _starts(members, "dpo", env, c0.steps)
    rows = {}
    for mem, reference in zip(members, references):
        if mem.seed not in rows:
            rows[mem.seed] = referenced_rows(reference, full, c0.batch_size, mem.seed)
    return offline_sweep(
        members,
        states,
        ctx_keys,
        lambda mem: rows[mem.seed],
        dpo_step_builder(c0, c0.steps),
        c0.steps,
        _outputs("dpo", members, env, metrics, tokenizer_file),
    )


def _kto(members: Sequence[Member], env: StageEnv, tokenizer_file) -> SweepRun:
    c0, pl = members[0].cfg.kto, env.cfg.sampling.prompt_length
    train, held, held_pairs = kto_examples(env, c0)
    states, references, ctx_keys = _starts(members, "kto", env, c0.steps)
    full = collate_unpaired_records(
        train, env.tok, max_length=c0.max_length, prompt_length=pl, add_eos=DATA_EOS
    )
    full = rx.train.compute_kto_reference_logps(references[0], full)  # the base, for all

    def metrics(env_m: StageEnv, m: int, policy) -> dict:
        c = members[m].cfg.kto
        return kto_data_metrics(env_m, c, policy, held, held_pairs, reuse=base_side)

    base_side: dict = {}  # the base model's held-out samples, once per seed

    outputs = _outputs("kto", members, env, metrics, tokenizer_file)
    return _rows("kto", members, (states, ctx_keys), full, outputs)


def _reward(members: Sequence[Member], env: StageEnv, tokenizer_file) -> SweepRun:
    c0, pl = members[0].cfg.reward, env.cfg.sampling.prompt_length
    train, held = preference_split(env, c0)
    collate = lambda pairs: collate_pairs(  # noqa: E731
        pairs, env.tok, max_length=c0.max_length, prompt_length=pl, add_eos=DATA_EOS
    )
    # the validation split keyed as `reward_on_data` keys it (independent of the file's
    # held-out split)
    per_seed = {
        s: reward_split(train, held, c0, data_validation_seed(s), collate)
        for s in {m.seed for m in members}
    }
    start_of = lambda mem: (env.base, jax.random.key(mem.seed))  # noqa: E731
    return reward_members(members, per_seed, start_of, tokenizer_file)


def _grpo(members: Sequence[Member], env: StageEnv, tokenizer_file) -> SweepRun:
    prompts = grpo_prompts(env, members[0].cfg.grpo)
    base_side: dict = {}  # the base model's held-out samples, once per seed
    outputs = _outputs(
        "grpo",
        members,
        env,
        lambda env_m, m, policy: heldout_scores(env_m, prompts, policy, base_side),
        tokenizer_file,
        policy_of=trained_model,
    )
    start_of = lambda mem: (env.base, jax.random.key(mem.seed))  # noqa: E731
    source_of = lambda mem: prompts.reward  # noqa: E731
    return rollouts_sweep(members, env.tok, start_of, prompts.train, source_of, outputs)


_SWEEPS = {"sft": _sft, "dpo": _dpo, "kto": _kto, "reward": _reward, "grpo": _grpo}
