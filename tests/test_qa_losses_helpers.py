"""`rlhf_eqx.testing` used as a user would: hand-written losses that are wrong in ways a
single fixed hyperparameter or finite padding junk does not show."""

import jax
import jax.numpy as jnp
import pytest

import rlhf_eqx.testing as rt


def dpo_fixed_beta(chosen, rejected, ref_chosen, ref_rejected, *, beta):
    """DPO with the temperature written in (0.1) instead of read from `beta`."""
    del beta
    return -jax.nn.log_sigmoid(0.1 * ((chosen - rejected) - (ref_chosen - ref_rejected)))


def dpo(chosen, rejected, ref_chosen, ref_rejected, *, beta):
    return -jax.nn.log_sigmoid(beta * ((chosen - rejected) - (ref_chosen - ref_rejected)))


def clip_without_clamp(logp, old_logp, advantages, mask, *, clip_eps, clip_eps_high):
    """PPO's clipped surrogate without the log-ratio clamp: inf * 0 at extreme ratios."""
    high = clip_eps if clip_eps_high is None else clip_eps_high
    ratio = jnp.exp(logp - old_logp)
    return -jnp.minimum(ratio * advantages, jnp.clip(ratio, 1 - clip_eps, 1 + high) * advantages)


def test_a_dpo_loss_that_ignores_beta_fails_at_a_second_beta():
    """At the default beta=0.1 the two losses are the same function; the check compares
    them again at 4 beta and names the temperature."""
    with pytest.raises(AssertionError, match=r"at beta=0\.4 .*does the loss use its `beta`"):
        rt.check_loss_matches(dpo_fixed_beta, "sigmoid")

    def dpo_fixed_beta_2(chosen, rejected, ref_chosen, ref_rejected, *, beta):
        return dpo_fixed_beta(20.0 * chosen, 20.0 * rejected, 20.0 * ref_chosen,
                              20.0 * ref_rejected, beta=beta)  # fmt: skip

    with pytest.raises(AssertionError, match=r"at beta=0\.5 "):  # beta > 1: beta / 4
        rt.check_loss_matches(dpo_fixed_beta_2, "sigmoid", beta=2.0)
    rt.check_loss_matches(dpo, "sigmoid", beta=2.0)


def test_a_mismatch_names_the_inputs_where_it_is():
    with pytest.raises(AssertionError) as dpo_error:
        rt.check_loss_matches(lambda c, r, rc, rr, *, beta: 2.0 * dpo(c, r, rc, rr, beta=beta),
                              "sigmoid")  # fmt: skip
    message = str(dpo_error.value)
    assert "inputs there: chosen_logp=" in message and "rejected_len=" in message
    with pytest.raises(AssertionError) as policy_error:
        rt.check_loss_matches(clip_without_clamp, "grpo")
    message = str(policy_error.value)
    assert "user np.float32(nan)" in message  # exp(logp - old_logp) overflows ...
    assert "old_logp=-10000.0" in message or "logp=-10000.0" in message  # ... at -1e4
    assert "advantages=" in message and "mask=True" in message


def square_under_where(x, mask):
    """Values inert to the padding, but the gradient there is `0 * 2x`: NaN at a NaN."""
    return jnp.sum(jnp.where(mask, jnp.square(x), 0.0))


def times_float_mask(x, mask):
    """Padding multiplied by 0 rather than selected: NaN where it holds NaN (eagerly)."""
    return jnp.sum(mask.astype(x.dtype) * x)


X = jnp.array([-1.0, -2.0, -3.0, -4.0])
MASK = jnp.array([True, True, False, False])


def test_nonfinite_junk_finds_what_finite_junk_does_not():
    rt.check_masked_gradients_zero(square_under_where, (X,), MASK)  # finite junk: passes
    with pytest.raises(AssertionError, match="after NaN / inf at masked positions"):
        rt.check_masked_gradients_zero(square_under_where, (X,), MASK, nonfinite=True)
    rt.check_padding_invariance(times_float_mask, (X,), MASK, jit=False)
    with pytest.raises(AssertionError, match="NaN / inf at masked positions"):
        rt.check_padding_invariance(times_float_mask, (X,), MASK, jit=False, nonfinite=True)


def test_nonfinite_junk_passes_a_loss_that_selects_its_padding():
    def selected(x, mask):
        return jnp.sum(jnp.square(jnp.where(mask, x, 0.0)))

    for jit in (True, False):
        rt.check_padding_invariance(selected, (X,), MASK, jit=jit, nonfinite=True)
        rt.check_masked_gradients_zero(selected, (X,), MASK, jit=jit, nonfinite=True)


def clip_low_written_in(logp, old_logp, advantages, mask, *, clip_eps, clip_eps_high):
    """Declares `clip_eps` but clips the low side at 0.8 (the default 0.2 written in)."""
    high = clip_eps if clip_eps_high is None else clip_eps_high
    ratio = jnp.exp(jnp.clip(logp - old_logp, -20.0, 20.0))
    return -jnp.minimum(ratio * advantages, jnp.clip(ratio, 0.8, 1 + high) * advantages)


@pytest.mark.parametrize("library", ["grpo", "ppo"])
def test_a_policy_loss_that_writes_in_its_clip_fails_at_another_clip_eps(library):
    with pytest.raises(AssertionError, match=r"at clip_eps=0\.1 .*use its `clip_eps`"):
        rt.check_loss_matches(clip_low_written_in, library)
