"""A step built with `nonfinite="raise"` says what is not finite: the loss term by name
(a user's policy loss is the `'policy'` term), or the gradient of a finite loss."""

import jax.numpy as jnp
import optax
import pytest
from test_train_common import CumMeanLM, sgd_delta
from test_train_grpo import _batch

from rlhf_eqx import train


def log_of_negative(logp, old_logp, advantages, mask):
    """A user's loss that is NaN wherever the policy lost probability."""
    return jnp.log(logp - old_logp) * advantages


def nan_gradient(logp, old_logp, advantages, mask):
    """A finite loss (0) whose gradient is NaN: sqrt at 0."""
    return jnp.sqrt(jnp.abs(logp - logp))


@pytest.mark.parametrize(
    "loss, what",
    [
        (log_of_negative, "the loss term 'policy' is not finite"),
        (nan_gradient, "the gradient of a finite loss is not finite"),
    ],
)
def test_a_non_finite_user_loss_is_named(getkey, loss, what):
    policy = CumMeanLM(getkey())
    batch = _batch(getkey(), policy, B=4)
    step = train.make_grpo_step(
        optax.sgd(1.0), group_size=2, policy_loss=loss, nonfinite="raise", donate=False
    )
    with pytest.raises(Exception, match=f"non-finite loss, gradient or update: {what}"):
        sgd_delta(step, policy, batch)
    skipped = train.make_grpo_step(optax.sgd(1.0), group_size=2, policy_loss=loss, donate=False)
    assert float(sgd_delta(skipped, policy, batch)[1]["nonfinite"]) == 1.0
