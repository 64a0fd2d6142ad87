"""The `multiturn` stage as a sweep: GRPO on multi-turn episodes against the stage's
environment — the animal follow-up one, or the user's own (`multiturn.environment=
MODULE:NAME`, a factory `NAME(tok)`) — from each seed's SFT policy. Each member is its
separate run (`python -m rlhf_eqx multiturn --set ops.seed=S --set <grid values>`,
`run_multiturn`): per rollout, the episodes of every member in one compiled program
(`rlhf_eqx.envs.rollout_multiturn` vmapped over the members' stacked policies, prompts
and keys: each member its own prompts, `rows_at` with its seed, and key); then per
member the episode batch (`episode_batch`: the environment's tokens masked out, the
reference log-probabilities on the policy's own tokens) and the `multiturn.epochs`
updates of every member in one vmapped program, with the KL guard per member as in
the GRPO sweep. Held-out evaluation at the end: the stage's success rate (for a user
environment the mean episode reward) and the base model's NLL of the policy's own
tokens, with the win rate against the seed's SFT policy."""

from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import rlhf_eqx as rx

from ._evaluate import prompt_se, win_rate, win_rate_se
from ._multiturn_stage import (
    _length,
    _prompts,
    episode_batch,
    episode_notes,
    multiturn_metrics,
    stage_environment,
    turn_stop_ids,
)
from ._registry import stage_key
from ._rollout import filters_of
from ._sweep_grid import Member
from ._sweep_grpo import GRPOSweepState, grpo_updates, iteration_inputs
from ._sweep_program import SweepRun, key_data, member, stack
from ._sweep_setup import member_states, model_of, policy_outputs, program_of
from ._sweep_starts import SeedStart
from ._sweep_steps import grpo_step_builder


@eqx.filter_jit
def _rollout_all(models, env, ids, masks, keys, options: dict):
    """`rollout_multiturn` of each member (its policy, prompts and key), vmapped."""

    def one(model, ids, mask, key_data):
        key = jax.random.wrap_key_data(key_data)
        return rx.envs.rollout_multiturn(model, env, ids, mask, key, **options)

    return eqx.filter_vmap(one)(models, ids, masks, keys)


def multiturn_sweep(
    members: Sequence[Member], starts: dict[int, SeedStart], tok, *, tokenizer_file=None
) -> SweepRun:
    """The `multiturn` stage of `members` (see the module docstring)."""
    c0, sampling = members[0].cfg.multiturn, members[0].cfg.sampling
    n, G, P = c0.prompts_per_rollout, c0.group_size, sampling.prompt_length
    total = c0.rollouts * c0.epochs
    game = stage_environment(c0, tok)
    train0, references, ctx_keys = member_states(
        members,
        "multiturn",
        lambda mem: (starts[mem.seed].sft_policy, stage_key(starts[mem.seed].key, "multiturn")),
        total,
    )
    program, hyper = program_of(
        members,
        train0,
        grpo_step_builder(c0, sampling.temperature, total, c0.max_turns * c0.turn_tokens),
    )
    M, V = len(members), starts[members[0].seed].sft_policy.vocab_size
    states = GRPOSweepState(train0, train0, jnp.zeros((M,), bool))
    options = dict(
        max_turns=c0.max_turns,
        max_new_tokens=c0.turn_tokens,
        max_total_tokens=_length(game, c0, P),
        temperature=sampling.temperature,
        **filters_of(sampling),
        eos_id=turn_stop_ids(game, tok),
        pad_id=tok.pad_id,
        num_samples=G,
        episode_reward=c0.episode_reward,
    )

    def iteration(st: GRPOSweepState, alive: np.ndarray, r: int):
        k_sample, k_steps, prompts = iteration_inputs(ctx_keys, members, n, r)
        ids, masks = zip(*(_prompts(tok, p, P) for p in prompts))
        trajs = _rollout_all(
            st.train.model, game, jnp.stack(ids), jnp.stack(masks), key_data(k_sample), options
        )
        batches, info, events = [], [], []
        for m in range(M):
            traj = member(trajs, m)  # checked here: the vmapped rollout could not
            rx.envs.check_trajectory(traj, environment=type(game).__name__, vocab_size=V)
            batch, inf = episode_batch(traj, references[m], G, P, sampling.temperature)
            batches.append(batch)
            info.append(inf)
            if alive[m]:
                notes = episode_notes(r, inf, members[m].cfg.multiturn, "multiturn")
                events += [(m, kind, note) for kind, note in notes]
        update = (program, hyper, k_steps)
        return grpo_updates(update, st, stack(batches), alive, r, info, events, c0)

    key_eval = {s: jax.random.fold_in(start.key, 11) for s, start in starts.items()}
    samples = members[0].cfg.eval_samples
    sft_eval = {}

    def heldout(seed: int, policy):
        start = starts[seed]  # the seed's run context: the stage's sampling settings
        args = (start.env.base, game, tok, key_eval[seed], c0, start.env.ctx("multiturn"))
        return multiturn_metrics(policy, *args, samples)

    def evaluate(m: int, policy) -> dict:
        seed = members[m].seed
        if seed not in sft_eval:
            sft_eval[seed] = heldout(seed, starts[seed].sft_policy)
        (after, success), (before, sft_success) = heldout(seed, policy), sft_eval[seed]
        return {
            "multiturn_success": after["success"],
            "multiturn_success_se": prompt_se(success, samples),
            "multiturn_success_sft": before["success"],
            "multiturn_win_rate_vs_sft": win_rate(success, sft_success),
            "multiturn_win_rate_vs_sft_se": win_rate_se(success, sft_success, samples),
            "multiturn_base_nll": after["base_nll"],
            "multiturn_base_nll_sft": before["base_nll"],
        }

    evaluate, export = policy_outputs(
        "multiturn", evaluate, tokenizer_file, policy_of=lambda st, m: model_of(st.train, m)
    )
    return SweepRun(states, c0.rollouts, iteration, evaluate, export)
