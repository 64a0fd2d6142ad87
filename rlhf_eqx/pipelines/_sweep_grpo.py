"""The built-in GRPO stage as a sweep: each member is `run_grpo` from its seed's SFT policy
(synchronous rollouts, the task's reward; `rollouts_sweep` is the same on other prompts,
starts and reward sources: GRPO on a data file), the rollouts of all members sampled in one
vmapped sampler call (each member its own prompts, `rows_at` with its seed, and key),
then per member the reward, the reference log-probabilities and the KL guard, and the
`grpo.epochs` updates of every member in one vmapped program (group advantages inside
the step, as in the separate run).

The KL guard acts per member as in its separate run: when a member's rollout KL to the
reference exceeds `grpo.kl_target`, that rollout's updates are dropped, the member
stops (`stopped: "kl_guard"`) and keeps the last policy whose rollout was within the
target (the state before its previous rollout), and the others go on."""

from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, PyTree

import rlhf_eqx as rx

from ._config import ConfigError
from ._registry import stage_key
from ._reward_sources import RewardSource, as_reward_source, task_reward_source
from ._rl_rollouts import _compare
from ._rollout import group_signal, no_signal_message, sampling_options
from ._runs import rows_at
from ._sweep_grid import Member
from ._sweep_program import Iteration, SweepRun, keep_where, key_data, stack
from ._sweep_rollout import sample_members
from ._sweep_setup import member_states, model_of, policy_outputs, program_of, take_steps
from ._sweep_starts import SeedStart
from ._sweep_steps import grpo_step_builder
from ._task import TRAIN_PROMPTS


class GRPOSweepState(eqx.Module):
    """The members' train states, their states before the last accepted rollout (what
    the KL guard restores) and whether that one is set yet."""

    train: PyTree
    within: PyTree
    has_within: Bool[Array, " M"]


def check_grpo_sweep(c, *, reward_source: bool = False) -> None:
    """Refuse (`ConfigError`, naming the field) the GRPO settings `c` that a sweep does not
    run: rollouts from a stale policy (`staleness`; `overlap` acts only with it,
    `partial_rollouts` needs it), `rollout_correction`, DAPO's `dynamic_sampling` and
    `overlong_buffer`, a sampler on devices of its own (`sampler_device`,
    `placement=split`: every member samples in one vmapped call); and, unless
    `reward_source` (a sweep on a data file), a `reward_source` other than the task's."""
    what = {
        "staleness": c.staleness != 0,
        "partial_rollouts": c.partial_rollouts != 0,
        "rollout_correction": c.rollout_correction is not None,
        "dynamic_sampling": c.dynamic_sampling != 0,
        "overlong_buffer": c.overlong_buffer != 0,
        "sampler_device": c.sampler_device != -1,
        "placement": c.placement != "colocated",
        "reward_source": not reward_source and c.reward_source != "task",
    }
    bad = [k for k, v in what.items() if v]
    if bad:
        scored = "" if reward_source else ", reward_source=task"
        raise ConfigError(
            f"grpo.{bad[0]}={getattr(c, bad[0])!r}: a GRPO sweep runs synchronous rollouts "
            "of every member in one sampler call on the training device (staleness 0, no "
            "rollout correction, dynamic sampling or overlong shaping, sampler_device=-1, "
            f"placement=colocated{scored})"
        )


def grpo_sweep(
    members: Sequence[Member], starts: dict[int, SeedStart], tok, *, tokenizer_file=None
) -> SweepRun:
    """The built-in GRPO stage of `members` (see the module docstring)."""
    c0 = members[0].cfg.grpo
    check_grpo_sweep(c0)
    sources = task_sources(starts, c0)
    outputs = policy_outputs(
        "grpo",
        lambda m, policy: starts[members[m].seed].against_sft(policy),
        tokenizer_file,
        policy_of=trained_model,
    )
    return rollouts_sweep(
        members,
        tok,
        lambda mem: (starts[mem.seed].sft_policy, stage_key(starts[mem.seed].key, "grpo")),
        TRAIN_PROMPTS,
        lambda mem: sources[mem.seed],
        outputs,
    )


def trained_model(st: GRPOSweepState, m: int):
    """Member `m`'s trained model (adapters unmerged) of a GRPO sweep's states."""
    return model_of(st.train, m)


def rollouts_sweep(
    members: Sequence[Member],
    tok,
    start: Callable[[Member], tuple],
    prompts: Sequence[str],
    source_of: Callable[[Member], RewardSource],
    outputs: tuple[Callable, Callable],
) -> SweepRun:
    """GRPO of `members` as a sweep (see the module docstring), each as `run_grpo` runs
    it: from `start(mem) -> (model, run key)`, on the training `prompts` (rollout `r`'s
    rows `rows_at(len(prompts), n, seed, r)`), scored by `source_of(mem)`;
    `outputs`, the `(evaluate, export)` of the `SweepRun` (`policy_outputs` with
    `policy_of=trained_model`)."""
    c0 = members[0].cfg.grpo
    sampling = members[0].cfg.sampling
    n, G = c0.prompts_per_rollout, c0.group_size
    total = c0.rollouts * c0.epochs
    train0, references, ctx_keys = member_states(members, "grpo", start, total)
    program, hyper = program_of(
        members, train0, grpo_step_builder(c0, sampling.temperature, total, sampling.max_new_tokens)
    )
    M = len(members)
    states = GRPOSweepState(train0, train0, jnp.zeros((M,), bool))

    def iteration(st: GRPOSweepState, alive: np.ndarray, r: int) -> Iteration:
        k_sample, k_steps, rows = iteration_inputs(ctx_keys, members, n, r, prompts)
        rolls = sample_members(
            st.train.model, tok, rows, k_sample, group_size=G, **sampling_options(sampling)
        )
        batches, info, events = [], [{} for _ in range(M)], []
        for m, mem in enumerate(members):
            roll = rolls[m]
            ref_logp, inf = _compare(roll, references[m])
            scored = source_of(mem).score(roll)
            rewards = np.asarray(scored.scores, np.float32)
            inf.update(scored.metrics, score=float(rewards.mean()))
            inf["frac_reward_zero_std"] = group_signal(rewards, G)
            if alive[m] and inf["frac_reward_zero_std"] == 1.0:
                events.append((m, "no_signal", no_signal_message(r, mem.cfg.grpo.beta)))
            info[m] = inf
            batches.append(
                rx.train.GRPOBatch(
                    tokens=roll.tokens,
                    mask=roll.mask,
                    completion_mask=roll.completion_mask,
                    rewards=jnp.asarray(rewards),
                    old_logp=roll.logprobs,
                    ref_logp=ref_logp,
                    truncated=roll.truncated,
                    prompt_length=sampling.prompt_length,
                    samples_per_prompt=G,
                    behaviour_logp=None,
                )
            )
        update = (program, hyper, k_steps)
        return grpo_updates(update, st, stack(batches), alive, r, info, events, c0)

    return SweepRun(states, c0.rollouts, iteration, *outputs)


def grpo_updates(update, st, batch, alive: np.ndarray, r: int, info, events, c) -> Iteration:
    """The updates of a GRPO sweep's rollout `r`: `c.epochs` steps of every live member on
    its rollout (`batch`, stacked), member `m`'s keys `fold_in(k_steps[m], e)` (`update =
    (program, hyper, k_steps)`), then the KL guard (`kl_guard_members`) of the members
    whose rollout KL `info[m]["kl"]` is past `c.kl_target`, as `run_loop` guards its run.
    **Returns:** the `Iteration`."""
    program, hyper, k_steps = update
    M = len(alive)
    guard = np.asarray([bool(alive[m]) and info[m]["kl"] > c.kl_target for m in range(M)])
    before = st.train
    trains, finite = before, np.ones(M, bool)
    records: list[list[dict]] = [[] for _ in range(M)]
    active = alive.copy()
    for e in range(c.epochs):
        keys_e = key_data([jax.random.fold_in(k, e) for k in k_steps])
        trains, active = take_steps(program, trains, hyper, keys_e, batch, active, records, finite)
    st, stop = kl_guard_members(
        r, st, before, trains, guard & finite, alive, records, info, events, c.kl_target
    )
    return Iteration(st, finite, records, info, events, stopped=stop)


def kl_guard_members(r, st, before, trains, stop, alive, records, info, events, kl_target):
    """The KL guard of a rollout sweep's iteration `r`: each member in `stop` (past
    `kl_target`, finite) has its records of the iteration dropped, a `kl_guard` event and
    goes back to its last policy within the target (`st.within`, or `before` when it has
    none); every other live member's `before` becomes its last policy within the target.
    Returns the new `GRPOSweepState` and `stop`."""
    for m in map(int, np.flatnonzero(stop)):
        records[m] = []
        msg = (
            f"iteration {r}: KL to the reference {info[m]['kl']:.4f} > target "
            f"{kl_target}; stopping with the last policy within the target"
        )
        events.append((m, "kl_guard", msg))
    stop_j = jnp.asarray(stop)
    back = jnp.asarray(np.asarray(st.has_within)) & stop_j
    trains = keep_where(stop_j, keep_where(back, st.within, before), trains)
    accepted = jnp.asarray(alive & ~stop)
    within = keep_where(accepted, before, st.within)
    return GRPOSweepState(trains, within, st.has_within | accepted), stop


def task_sources(starts: dict[int, SeedStart], c) -> dict:
    """Each seed's reward source of `c.reward_source` on the built-in task, after its SFT
    (`task_reward_source`, as the pipeline makes it for the stage)."""
    sources = {}
    for seed, start in starts.items():
        start.env.policies = {"sft": start.sft_policy}
        sources[seed] = as_reward_source(task_reward_source(start.env, c))
    return sources


def iteration_inputs(ctx_keys, members, n: int, r: int, prompts: Sequence[str] = TRAIN_PROMPTS):
    """Rollout iteration `r` of each member as its separate run draws it: the sampling and
    update keys (`split(fold_in(stage key, r))`) and its `n` training prompts of
    `prompts` (`rows_at` of its seed; the built-in task's by default)."""
    keys = [jax.random.split(jax.random.fold_in(k, r)) for k in ctx_keys]
    rows = [[prompts[j] for j in rows_at(len(prompts), n, mem.seed, r)] for mem in members]
    return [k[0] for k in keys], [k[1] for k in keys], rows
