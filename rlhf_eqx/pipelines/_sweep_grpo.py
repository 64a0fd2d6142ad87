"""The built-in GRPO stage as a sweep: each member is `run_grpo` from its seed's SFT policy
(synchronous rollouts, the task's reward), the rollouts of all members sampled in one
vmapped sampler call (each member its own prompts, `rows_at` with its seed, and key),
then per member the reward, the reference log-probabilities and the KL guard, and the
`grpo.epochs` updates of every member in one vmapped program (group advantages inside
the step, as in the separate run).

The KL guard acts per member as in its separate run: when a member's rollout KL to the
reference exceeds `grpo.kl_target`, that rollout's updates are dropped, the member
stops (`stopped: "kl_guard"`) and keeps the last policy whose rollout was within the
target (the state before its previous rollout), and the others go on."""

import dataclasses
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, PyTree

import rlhf_eqx as rx

from ._config import ConfigError
from ._lr_scale import build_optimizer
from ._registry import stage_key
from ._reward_sources import as_reward_source, task_reward_source
from ._rl_rollouts import _compare, _policy_and_reference
from ._rollout import group_signal
from ._runs import export_policy, final_policy, rows_at
from ._sweep_grid import Member
from ._sweep_offline import _optim
from ._sweep_program import (
    Iteration,
    SweepRun,
    hyper_arrays,
    keep_where,
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


class GRPOSweepState(eqx.Module):
    """The members' train states, their states before the last accepted rollout (what
    the KL guard restores) and whether that one is set yet."""

    train: PyTree
    within: PyTree
    has_within: Bool[Array, " M"]


def _check_simple(c) -> None:
    what = {
        "staleness": c.staleness != 0,
        "dynamic_sampling": c.dynamic_sampling != 0,
        "overlong_buffer": c.overlong_buffer != 0,
        "rollout_correction": c.rollout_correction is not None,
        "reward_source": c.reward_source != "task",
    }
    bad = [k for k, v in what.items() if v]
    if bad:
        raise ConfigError(
            f"grpo.{bad[0]}={getattr(c, bad[0])!r}: a GRPO sweep runs synchronous rollouts "
            "scored by the task's reward (staleness 0, no dynamic sampling, overlong "
            "shaping or rollout correction, reward_source=task)"
        )


def grpo_sweep(
    members: Sequence[Member], starts: dict[int, SeedStart], tok, *, tokenizer_file=None
) -> SweepRun:
    """The built-in GRPO stage of `members` (see the module docstring)."""
    c0 = members[0].cfg.grpo
    _check_simple(c0)
    sampling = members[0].cfg.sampling
    n, G = c0.prompts_per_rollout, c0.group_size
    total = c0.rollouts * c0.epochs
    trains, references, ctx_keys, sources = [], [], [], {}
    for mem in members:
        c = mem.cfg.grpo
        validate_stage("grpo", c)
        start = starts[mem.seed]
        k_lora, ctx_key = jax.random.split(stage_key(start.key, "grpo"))
        pol, spec, reference = _policy_and_reference(start.sft_policy, c.lora, k_lora)
        opt = build_optimizer(c.optim, total)
        trains.append(rx.train.init_train_state(pol, opt, filter_spec=spec))
        references.append(reference)
        ctx_keys.append(ctx_key)
        if mem.seed not in sources:
            env = start.env
            env.policies = {"sft": start.sft_policy}
            sources[mem.seed] = as_reward_source(task_reward_source(env, c))

    def build(h: dict):
        opt = build_optimizer(_optim(c0, h), total)
        traced = {k: h[k] for k in ("beta",) if k in h}
        # as `grpo_state_and_step`: the step's temperature is `sampling.temperature`
        settings = dataclasses.replace(c0, temperature=sampling.temperature, **traced)
        return rx.train.make_grpo_step(opt, settings, options=c0.options)

    train0 = stack(trains)
    program = make_program(build, seeds=one_seed_shared(train0, [m.seed for m in members]))
    hyper = hyper_arrays([dict(m.point) for m in members])
    M = len(members)
    states = GRPOSweepState(train0, train0, jnp.zeros((M,), bool))

    def iteration(st: GRPOSweepState, alive: np.ndarray, r: int) -> Iteration:
        k_sample, k_steps, prompts = iteration_inputs(ctx_keys, members, n, r)
        rolls = sample_members(
            st.train.model,
            tok,
            prompts,
            k_sample,
            group_size=G,
            prompt_length=sampling.prompt_length,
            max_new_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            stop_strings=sampling.stop_strings,
            slots=sampling.slots,
        )
        batches, info, events = [], [{} for _ in range(M)], []
        guard = np.zeros(M, bool)
        for m, mem in enumerate(members):
            roll = rolls[m]
            ref_logp, inf = _compare(roll, references[m])
            scored = sources[mem.seed].score(roll)
            rewards = np.asarray(scored.scores, np.float32)
            inf.update(scored.metrics, score=float(rewards.mean()))
            inf["frac_reward_zero_std"] = group_signal(rewards, G)
            if alive[m] and inf["frac_reward_zero_std"] == 1.0:
                msg = f"rollout {r}: every group has equal rewards; the update is zero"
                events.append((m, "no_signal", msg))
            info[m] = inf
            guard[m] = alive[m] and inf["kl"] > c0.kl_target
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
        batch = stack(batches)
        before = st.train
        trains, finite = before, np.ones(M, bool)
        records: list[list[dict]] = [[] for _ in range(M)]
        active = alive.copy()
        for e in range(c0.epochs):
            keys_e = key_data([jax.random.fold_in(k, e) for k in k_steps])
            trains, metrics, ok = program(trains, hyper, keys_e, batch, active)
            ok = np.asarray(ok)
            for m in map(int, np.flatnonzero(active)):
                records[m].append(unstacked_metrics(metrics, m))
                if not ok[m]:
                    finite[m] = False
            active = active & ok
        st, stop = kl_guard_members(
            r, st, before, trains, guard & finite, alive, records, info, events, c0.kl_target
        )
        return Iteration(st, finite, records, info, events, stopped=stop)

    def evaluate(st: GRPOSweepState, m: int) -> dict:
        model = member(st.train, m).model
        return starts[members[m].seed].against_sft(final_policy(model))

    def export(st: GRPOSweepState, m: int, directory: str) -> None:
        model = member(st.train, m).model
        export_policy(
            final_policy(model), directory, "grpo", adapted=model, tokenizer_file=tokenizer_file
        )

    return SweepRun(states, c0.rollouts, iteration, evaluate, export)


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


def iteration_inputs(ctx_keys, members, n: int, r: int):
    """Rollout iteration `r` of each member as its separate run draws it: the sampling and
    update keys (`split(fold_in(stage key, r))`) and its `n` training prompts (`rows_at`
    of its seed)."""
    keys = [jax.random.split(jax.random.fold_in(k, r)) for k in ctx_keys]
    prompts = [
        [TRAIN_PROMPTS[j] for j in rows_at(len(TRAIN_PROMPTS), n, mem.seed, r)] for mem in members
    ]
    return [k[0] for k in keys], [k[1] for k in keys], prompts
