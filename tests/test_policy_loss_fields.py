"""A settings field that only some policy losses read is refused when set for a loss
that does not read it: `clip_eps_high` (like `dual_clip`, `importance` and `delta`)."""

import jax.numpy as jnp
import pytest

from rlhf_eqx import train
from rlhf_eqx.losses import register_policy_loss


def symmetric_clip(logp, old_logp, advantages, mask, *, clip_eps):
    """PPO's clipped surrogate with one clip range: it has no `clip_eps_high`."""
    ratio = jnp.exp(jnp.clip(logp - old_logp, -20.0, 20.0))
    clipped = jnp.clip(ratio, 1 - clip_eps, 1 + clip_eps)
    return -jnp.minimum(ratio * advantages, clipped * advantages)


register_policy_loss("symmetric_clip", symmetric_clip)


@pytest.mark.parametrize(
    "make",
    [
        lambda **kw: train.GRPOSettings(group_size=2, **kw),
        lambda **kw: train.PPOSettings(**kw),
    ],
)
def test_clip_eps_high_is_refused_for_a_loss_that_does_not_read_it(make):
    with pytest.raises(ValueError, match=r"^clip_eps_high=0\.28: applies to policy_loss .* not "):
        make(policy_loss="symmetric_clip", clip_eps_high=0.28)
    with pytest.raises(ValueError, match=r"^clip_eps_high=0\.28: .* not symmetric_clip$"):
        make(policy_loss=symmetric_clip, clip_eps_high=0.28)
    make(policy_loss="symmetric_clip")  # unset: fine
    make(clip_eps_high=0.28)  # the built-in clipped loss reads it


def test_cispo_names_its_own_bound():
    with pytest.raises(ValueError, match=r"'grpo', .*'high_entropy'.* only, not 'cispo'$"):
        train.GRPOSettings(group_size=2, policy_loss="cispo", clip_eps_high=0.28)
    train.GRPOSettings(group_size=2, policy_loss="cispo", cispo_eps_high=0.28)


def test_a_field_in_loss_kwargs_is_refused_with_both_ways_out():
    with pytest.raises(ValueError, match="set the field instead .* or rename the loss's"):
        train.GRPOSettings(
            group_size=2, policy_loss="symmetric_clip", loss_kwargs={"clip_eps": 0.1}
        )
