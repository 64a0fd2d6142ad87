"""The losses that take a mask are inert to NaN and infinities at masked positions:
`rlhf_eqx.testing`'s padding and masked-gradient checks with non-finite junk, on every
per-sequence loss (per completion, `[T]`) and batch loss (`[B, T]`) of the library."""

import jax.numpy as jnp
import numpy as np
import pytest

import rlhf_eqx.testing as rt
from rlhf_eqx import losses as L

NONFINITE = (float("nan"), float("inf"), float("-inf"), -1e4)
T = 6


def _per_sequence():
    lp, old, ref = (
        jnp.asarray(np.random.default_rng(i).uniform(-3.0, -0.1, T), jnp.float32) for i in range(3)
    )
    return lp, old, ref, jnp.array([False, True, True, True, False, False])


SEQUENCE = {
    "grpo": lambda lp, old, ref, m: L.grpo_policy_loss(lp, old, 1.5, m, ref_logp=ref, beta=0.1),
    "grpo_sequence": lambda lp, old, ref, m: L.grpo_policy_loss(
        lp, old, -1.0, m, importance="sequence", delta=2.0
    ),
    "cispo": lambda lp, old, ref, m: L.cispo_policy_loss(lp, old, 1.0, m),
    "gmpo": lambda lp, old, ref, m: L.gmpo_policy_loss(lp, old, -1.0, m),
    "sapo": lambda lp, old, ref, m: L.sapo_policy_loss(lp, old, 1.0, m),
    "ppo": lambda lp, old, ref, m: L.ppo_policy_loss(lp, old, ref, m, dual_clip=3.0),
    "ppo_value": lambda lp, old, ref, m: L.ppo_value_loss(lp, old, ref, m),
    "sft": lambda lp, old, ref, m: L.sft_nll(lp, m),
    "kl_shaped_k3": lambda lp, old, ref, m: L.kl_shaped_rewards(
        1.0, lp, ref, m, kl_coef=0.1, kind="k3"
    ),
    "kl_shaped_k2": lambda lp, old, ref, m: L.kl_shaped_rewards(
        1.0, lp, ref, m, kl_coef=0.1, kind="k2"
    ),
    "reverse_kl": lambda lp, old, ref, m: L.reverse_kl_reward(lp, ref, m),
    "gae": lambda lp, old, ref, m: L.gae(lp, old, m, gamma=0.9, lam=0.8),
    "whiten": lambda lp, old, ref, m: L.whiten_advantages(lp, m) * old,
    "importance": lambda lp, old, ref, m: L.importance_weights(lp, old, m, level="geometric")[0],
    "prm": lambda lp, old, ref, m: L.process_reward_loss(lp, m, jnp.where(m, 0.5, 0.0)),
    "prm_min": lambda lp, old, ref, m: L.process_sequence_reward(lp, m, aggregation="min"),
    "prm_mean": lambda lp, old, ref, m: L.process_sequence_reward(lp, m, aggregation="mean"),
    "prm_tokens": lambda lp, old, ref, m: L.process_token_rewards(lp, m),
}

BATCH = {
    "clip_cov": lambda lp, old, m: L.clip_cov_policy_loss(
        lp, old, jnp.array([1.0, -1.0]), m, fraction=0.3, select="top"
    ),
    "kl_cov": lambda lp, old, m: L.kl_cov_policy_loss(lp, old, jnp.array([1.0, -1.0]), m),
    "high_entropy": lambda lp, old, m: L.high_entropy_policy_loss(
        lp, old, jnp.array([1.0, -1.0]), m, -old
    ),
    "reinforce_pp": lambda lp, old, m: L.reinforce_pp_advantages(lp, m),
    "aggregate": lambda lp, old, m: L.aggregate(lp, m, mode="seq-mean-token-mean"),
    "aggregate_norm": lambda lp, old, m: L.aggregate(
        old, m, mode="seq-mean-token-sum-norm", constant=4.0
    ),
}


def _first(fn):
    """The first output of a loss returning `(per_token, stats)`, as the checks read it."""

    def first(*args):
        out = fn(*args)
        return out[0] if isinstance(out, tuple) else out

    return first


@pytest.mark.parametrize("name", sorted(SEQUENCE))
def test_sequence_losses_are_inert_to_nonfinite_padding(name):
    lp, old, ref, mask = _per_sequence()
    fn = _first(SEQUENCE[name])
    rt.check_padding_invariance(fn, (lp, old, ref), mask, fill=NONFINITE)
    rt.check_masked_gradients_zero(fn, (lp, old, ref), mask, fill=NONFINITE)


@pytest.mark.parametrize("name", sorted(BATCH))
def test_batch_losses_are_inert_to_nonfinite_padding(name):
    lp, old, _, mask = _per_sequence()
    lp, old = jnp.stack([lp, old]), jnp.stack([old, lp])
    mask = jnp.stack([mask, jnp.roll(mask, 1)])
    fn = _first(BATCH[name])
    rt.check_padding_invariance(fn, (lp, old), mask, fill=NONFINITE)
    rt.check_masked_gradients_zero(fn, (lp, old), mask, fill=NONFINITE)
