"""Shared helpers for the tests (import as ``from helpers import ...``)."""

import jax
import jax.numpy as jnp
from conftest import SHARED, assert_tree_allclose, tree_allclose

import rlhf_eqx as rx

__all__ = ["SHARED", "assert_tree_allclose", "tree_allclose", "two_turn_rollout"]


def two_turn_rollout(policy, tok, *, key: int = 3, samples: int = 2):
    """`samples` two-turn episodes (6 tokens a turn) of the animal follow-up environment
    from the prompt "Once upon a time": `(trajectory, prompt ids)`."""
    env = rx.envs.AnimalFollowUpEnv(tok)
    ids = [tok.bos_id, *tok.encode("Once upon a time")]
    prompts = jnp.asarray([ids], jnp.int32)
    traj = rx.envs.rollout_multiturn(
        policy,
        env,
        prompts,
        jnp.ones_like(prompts, bool),
        jax.random.key(key),
        max_turns=2,
        max_new_tokens=6,
        max_total_tokens=len(ids) + 12 + env.max_observation_tokens,
        eos_id=env.stop_ids,
        pad_id=tok.pad_id,
        num_samples=samples,
    )
    return traj, ids
