"""A step whose settings hold a user's loss that is a closure is not shared with an
earlier build: the closure's cells may have been rebound since (a module-level loss,
which captures nothing, still shares its compiled program)."""

import jax
import jax.numpy as jnp
import optax
from test_train_common import CumMeanLM, preference_batch, sgd_delta
from test_train_grpo import _batch

from rlhf_eqx import train


def plain(logp, old_logp, advantages, mask):
    return -advantages * jnp.exp(logp - old_logp)


def test_a_closure_policy_loss_is_built_with_its_current_cells(getkey):
    policy = CumMeanLM(getkey())
    batch = _batch(getkey(), policy, B=4)
    build = lambda loss: train.make_grpo_step(
        optax.sgd(1.0), group_size=2, policy_loss=loss, donate=False
    )
    weight = 1.0

    def weighted(logp, old_logp, advantages, mask):
        return weight * plain(logp, old_logp, advantages, mask)

    first = float(sgd_delta(build(weighted), policy, batch)[1]["loss"])
    weight = 3.0
    again = float(sgd_delta(build(weighted), policy, batch)[1]["loss"])
    assert abs(again - 3.0 * first) <= 1e-5 * abs(again) and first != 0.0


def test_a_closure_dpo_loss_is_built_with_its_current_cells(getkey):
    policy, reference = CumMeanLM(getkey()), CumMeanLM(getkey())
    batch = preference_batch(getkey())
    shift = 0.0

    def shifted(chosen, rejected, ref_chosen, ref_rejected, *, beta):
        u = (chosen - rejected) - (ref_chosen - ref_rejected)
        return -jax.nn.log_sigmoid(beta * u - shift)

    def loss():
        step = train.make_dpo_step(optax.sgd(1.0), loss_type=shifted, donate=False)
        return float(sgd_delta(step, policy, batch, reference=reference)[1]["loss"])

    first = loss()
    shift = 5.0
    assert loss() > first + 1.0
