"""The built-in PPO stage as a sweep: each member is `run_ppo` from its seed's SFT policy
(a LoRA policy and a value model, rewards from `ppo.reward_source`, by default the
seed's reward model, trained once per seed before the members and shared by that seed's
grid points). Per rollout, the rollouts of all members are sampled in one vmapped
sampler call (each member its own prompts, `rows_at` with its seed, and key); then per
member the score, the reference log-probabilities, the KL-shaped rewards and GAE
(`ppo_rollout_batch` as in `run_ppo`: the member's `ppo.kl_coef`, `ppo.kl_estimator`,
`ppo.whiten_rewards` and `ppo.missing_eos_penalty`), and the `ppo.epochs` x
`ppo.minibatches` updates of every member in one vmapped program each, member `m`'s
minibatch its separate run's rows (its own permutation per epoch) and key.

The KL guard acts per member as in its separate run (and as in the GRPO sweep): when a
member's rollout KL to the reference exceeds `ppo.kl_target`, that rollout's updates are
dropped, the member stops (`stopped: "kl_guard"`) and keeps the last policy whose
rollout was within the target, and the others go on."""

from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import rlhf_eqx as rx

from ._config import ConfigError
from ._lr_scale import build_optimizer
from ._ppo_stage import ppo_rollout_batch
from ._registry import stage_key
from ._rl_rollouts import _compare, _policy_and_reference
from ._rollout import sampling_options
from ._runs import take_rows
from ._sweep_grid import Member
from ._sweep_grpo import GRPOSweepState, iteration_inputs, kl_guard_members, task_sources
from ._sweep_program import Iteration, SweepRun, key_data, member, stack
from ._sweep_rollout import sample_members
from ._sweep_setup import policy_outputs, program_of, take_steps
from ._sweep_starts import SeedStart
from ._sweep_steps import ppo_step_builder
from ._validation import validate_stage


def check_ppo_sweep(c) -> None:
    """Refuse (`ConfigError`) a PPO section a sweep does not run, naming the field."""
    if c.reward_source == "prm":
        raise ConfigError(
            "ppo.reward_source='prm': a PPO sweep scores whole completions (a reward model, "
            "the task's reward or a judge), not a process reward model's step scores"
        )


def ppo_sweep(
    members: Sequence[Member], starts: dict[int, SeedStart], tok, *, tokenizer_file=None
) -> SweepRun:
    """The built-in PPO stage of `members` (see the module docstring)."""
    c0 = members[0].cfg.ppo
    check_ppo_sweep(c0)
    sampling = members[0].cfg.sampling
    n = c0.prompts_per_rollout
    mb = n // c0.minibatches
    total = c0.rollouts * c0.epochs * c0.minibatches
    trains, references, ctx_keys = [], [], []
    for mem in members:
        c = mem.cfg.ppo
        validate_stage("ppo", c)
        start = starts[mem.seed]
        k_lora, k_value, ctx_key = jax.random.split(stage_key(start.key, "ppo"), 3)
        pol, spec, reference = _policy_and_reference(start.sft_policy, c.lora, k_lora)
        value = rx.ValueModel.from_policy(start.sft_policy, key=k_value)
        opt = build_optimizer(c.optim, total)
        filter_spec = (spec if spec is not None else eqx.is_inexact_array, eqx.is_inexact_array)
        trains.append(rx.train.init_train_state((pol, value), opt, filter_spec=filter_spec))
        references.append(reference)
        ctx_keys.append(ctx_key)
    sources = task_sources(starts, c0)

    train0 = stack(trains)
    program, hyper = program_of(
        members, train0, ppo_step_builder(c0, sampling.temperature, total, sampling.max_new_tokens)
    )
    M = len(members)
    states = GRPOSweepState(train0, train0, jnp.zeros((M,), bool))

    def iteration(st: GRPOSweepState, alive: np.ndarray, r: int) -> Iteration:
        k_sample, k_steps, prompts = iteration_inputs(ctx_keys, members, n, r)
        policies = st.train.model[0]
        rolls = sample_members(
            policies, tok, prompts, k_sample, group_size=1, **sampling_options(sampling)
        )
        batches, info = [], [{} for _ in range(M)]
        guard = np.zeros(M, bool)
        for m, mem in enumerate(members):
            roll = rolls[m]
            _, inf = _compare(roll, references[m])
            scored = sources[mem.seed].score(roll)
            inf.update(scored.metrics, score=float(np.mean(scored.scores)))
            batch, stats = ppo_rollout_batch(
                member(st.train, m).model,
                references[m],
                roll,
                jnp.asarray(scored.scores, jnp.float32),
                mem.cfg.ppo,
                temperature=sampling.temperature,
            )
            inf.update({k: float(v) for k, v in stats.items()})
            info[m] = inf
            guard[m] = alive[m] and inf["kl"] > c0.kl_target
            batches.append(batch)
        before = st.train
        trains, finite = before, np.ones(M, bool)
        records: list[list[dict]] = [[] for _ in range(M)]
        active = alive.copy()
        for e in range(c0.epochs):
            perms = [
                np.asarray(jax.random.permutation(jax.random.fold_in(k, e), n)) for k in k_steps
            ]
            for j in range(c0.minibatches):
                mini = stack(
                    [take_rows(b, p[j * mb : (j + 1) * mb]) for b, p in zip(batches, perms)]
                )
                keys_j = key_data([jax.random.fold_in(k, 1000 + e * 100 + j) for k in k_steps])
                trains, active = take_steps(
                    program, trains, hyper, keys_j, mini, active, records, finite
                )
        events = []
        st, stop = kl_guard_members(
            r, st, before, trains, guard & finite, alive, records, info, events, c0.kl_target
        )
        return Iteration(st, finite, records, info, events, stopped=stop)

    evaluate, export = policy_outputs(
        "ppo",
        lambda m, policy: starts[members[m].seed].against_sft(policy),
        tokenizer_file,
        policy_of=lambda st, m: member(st.train, m).model[0],
    )
    return SweepRun(states, c0.rollouts, iteration, evaluate, export)
