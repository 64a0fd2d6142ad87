"""The built-in reward-model stage as a sweep: per seed, the stage's own pairs (SFT samples
labelled by the noisy scorer; clean held-out pairs labelled by the true one) and its
validation split; per member, `run_reward`'s model and updates with its learning rate,
all members' steps in one vmapped program, and its checkpoint selection — every
`reward.eval_every` steps and at the end each member's accuracy on its seed's validation
pairs, the parameters of the best kept. A single reward model per member
(`reward.ensemble = 1`)."""

from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PyTree

import rlhf_eqx as rx
from rlhf_eqx import data

from ._config import ConfigError
from ._evaluate import binomial_se, reward_accuracy
from ._lr_scale import build_optimizer
from ._registry import stage_key
from ._reward_stage import _pairs
from ._runs import collate_pairs, export_reward_model, shuffled_rows
from ._sweep_grid import Member
from ._sweep_program import (
    Iteration,
    SweepRun,
    hyper_arrays,
    keep_where,
    key_data,
    make_program,
    member,
    stack,
    unstacked_metrics,
)
from ._sweep_starts import SeedStart
from ._sweep_steps import reward_step_builder
from ._task import HELDOUT_PROMPTS, TRAIN_PROMPTS, animal_score
from ._validation import validate_stage


class RewardSweepState(eqx.Module):
    """The members' reward-model train states and, per member, the parameters of the best
    validation accuracy so far, that accuracy (-1 before any) and its step (-1)."""

    train: PyTree
    best_params: PyTree
    best_accuracy: Float[Array, " M"]
    best_step: Int[Array, " M"]


def check_reward_sweep(c) -> None:
    """Refuse (`ConfigError`) a reward section a sweep does not run, naming the field."""
    if c.ensemble > 1:
        raise ConfigError(
            f"reward.ensemble={c.ensemble}: a sweep trains one reward model per member "
            "(reward.ensemble=1)"
        )


def reward_split(pairs: list, clean: list, c, seed: int, collate) -> dict:
    """A seed's data of `run_reward`: with `c.eval_every`, the validation split of the
    training `pairs` (`data.split_held_out` seeded by `seed`; none when a side would be
    empty); the batches (`collate`) of the training, validation and held-out (`clean`)
    pairs and their counts."""
    val: list = []
    if c.eval_every:
        train, val = data.split_held_out(pairs, fraction=c.heldout_fraction, seed=seed)
        if train and val:
            pairs = list(train)
        else:
            val = []
    return dict(
        full=collate(pairs),
        val=collate(val) if val else None,
        held=collate(clean),
        counts=(len(pairs), len(val), len(clean)),
    )


def reward_sweep(
    members: Sequence[Member], starts: dict[int, SeedStart], tok, *, tokenizer_file=None
) -> SweepRun:
    """The built-in reward stage of `members` (see the module docstring)."""
    c0 = members[0].cfg.reward
    check_reward_sweep(c0)
    prompt_length = members[0].cfg.sampling.prompt_length
    collate = lambda pairs: collate_pairs(  # noqa: E731
        pairs, tok, max_length=c0.max_length, prompt_length=prompt_length
    )
    per_seed = {}
    for seed, start in starts.items():
        env, n = start.env, 2 * c0.pairs_per_prompt
        roll = env.sample(start.sft_policy, TRAIN_PROMPTS, 1, n)
        true = np.asarray([animal_score(t) for t in roll.texts])
        pairs = _pairs(roll, true, np.asarray(start.label(roll.prompts, roll.texts, 2)))
        held_roll = env.sample(start.sft_policy, HELDOUT_PROMPTS, 2, n)
        clean = _pairs(held_roll, np.asarray([animal_score(t) for t in held_roll.texts]))
        per_seed[seed] = reward_split(pairs, clean, c0, seed, collate)
    start_of = lambda mem: (  # noqa: E731
        starts[mem.seed].sft_policy,
        stage_key(starts[mem.seed].key, "reward"),
    )
    return reward_members(members, per_seed, start_of, tokenizer_file)


def reward_members(
    members: Sequence[Member], per_seed: dict, start_of, tokenizer_file=None
) -> SweepRun:
    """The reward stage's sweep of `members` on `per_seed[seed]` (`reward_split`), member
    `mem`'s model `RewardModel.from_policy(policy, key=k_init)` with `(policy, key) =
    start_of(mem)` and `k_init, ctx_key = split(key)`, as `run_reward` starts."""
    c0 = members[0].cfg.reward
    setups = []
    for mem in members:
        c = mem.cfg.reward
        validate_stage("reward", c)
        policy, key = start_of(mem)
        k_init, ctx_key = jax.random.split(key)
        model = rx.RewardModel.from_policy(policy, key=k_init)
        ts = rx.train.init_train_state(model, build_optimizer(c.optim, c.steps))
        setups.append(
            (ts, shuffled_rows(per_seed[mem.seed]["full"], c.batch_size, mem.seed), ctx_key)
        )

    program = make_program(reward_step_builder(c0, c0.steps))
    hyper = hyper_arrays([dict(m.point) for m in members])
    M = len(members)
    trains = stack([s[0] for s in setups])
    states = RewardSweepState(
        trains,
        jax.tree.map(jnp.copy, trains.params),
        jnp.full((M,), -1.0, jnp.float32),
        jnp.full((M,), -1, jnp.int32),
    )

    def iteration(st: RewardSweepState, alive: np.ndarray, i: int) -> Iteration:
        batches = stack([batch_at(i) for _, batch_at, _ in setups])
        keys = key_data([jax.random.fold_in(k, i) for _, _, k in setups])
        trains, metrics, ok = program(st.train, hyper, keys, batches, alive)
        ok = np.asarray(ok)
        records = [[unstacked_metrics(metrics, m)] if alive[m] else [] for m in range(M)]
        every = c0.eval_every
        if every and ((i + 1) % every == 0 or i + 1 == c0.steps):
            acc = np.full(M, -1.0, np.float32)
            for m, mem in enumerate(members):
                val = per_seed[mem.seed]["val"]
                if alive[m] and ok[m] and val is not None:
                    acc[m] = reward_accuracy(member(trains, m).model, val)
                    records[m][0]["validation/accuracy"] = float(acc[m])
            better = jnp.asarray(acc > np.asarray(st.best_accuracy))
            st = RewardSweepState(
                trains,
                keep_where(better, trains.params, st.best_params),
                jnp.where(better, jnp.asarray(acc), st.best_accuracy),
                jnp.where(better, i + 1, st.best_step),
            )
        else:
            st = RewardSweepState(trains, st.best_params, st.best_accuracy, st.best_step)
        return Iteration(st, ok | ~alive, records, [{} for _ in range(M)])

    def selected(st: RewardSweepState, m: int):
        one = member(st.train, m)
        if per_seed[members[m].seed]["val"] is not None and int(st.best_step[m]) > 0:
            one = eqx.tree_at(lambda s: s.params, one, member(st.best_params, m))
        return one.model

    def evaluate(st: RewardSweepState, m: int) -> dict:
        d = per_seed[members[m].seed]
        rm = selected(st, m)
        acc = reward_accuracy(rm, d["held"])
        train_pairs, val_pairs, held_pairs = d["counts"]
        out = {
            "heldout_accuracy": acc,
            "heldout_accuracy_se": binomial_se(acc, held_pairs),
            "selected_step": int(st.best_step[m]) if d["val"] is not None else c0.steps,
            "train_pairs": train_pairs,
            "validation_pairs": val_pairs,
            "heldout_pairs": held_pairs,
        }
        if d["val"] is not None and int(st.best_step[m]) > 0:
            out["validation_accuracy"] = float(st.best_accuracy[m])
            out["train_accuracy"] = reward_accuracy(rm, d["full"])
        return out

    def export(st: RewardSweepState, m: int, directory: str) -> None:
        export_reward_model(selected(st, m), directory, tokenizer_file=tokenizer_file)

    return SweepRun(states, c0.steps, iteration, evaluate, export)
