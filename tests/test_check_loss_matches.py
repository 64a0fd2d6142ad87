"""`rlhf_eqx.testing.check_loss_matches` on policy losses: the extreme inputs reach
log-ratios beyond the ±20 clamp on both sides, a PPO-only library loss is compared under
PPO's settings without being told, and an unknown name is refused with the valid ones."""

import jax.numpy as jnp
import pytest

import rlhf_eqx.testing as rt
from rlhf_eqx.losses import register_dpo_loss, register_policy_loss


def clipped(logp, old_logp, advantages, mask, *, clip_eps, clip_eps_high):
    """PPO's clipped surrogate (Schulman et al. 2017, eq. 7) with the library's clamp of
    the log-ratio to [-20, 20]."""
    high = clip_eps if clip_eps_high is None else clip_eps_high
    ratio = jnp.exp(jnp.clip(logp - old_logp, -20.0, 20.0))
    return -jnp.minimum(ratio * advantages, jnp.clip(ratio, 1 - clip_eps, 1 + high) * advantages)


def unclamped(logp, old_logp, advantages, mask, *, clip_eps, clip_eps_high):
    """The same without the clamp: `exp` overflows where the policy gained e^88 over the
    old policy."""
    high = clip_eps if clip_eps_high is None else clip_eps_high
    ratio = jnp.exp(logp - old_logp)
    return -jnp.minimum(ratio * advantages, jnp.clip(ratio, 1 - clip_eps, 1 + high) * advantages)


register_policy_loss("token_clipped", clipped, advantages="token")


def test_a_loss_without_the_clamp_is_caught_on_large_log_ratios():
    rt.check_loss_matches(clipped, "grpo")
    with pytest.raises(AssertionError, match="on extreme inputs"):
        rt.check_loss_matches(unclamped, "grpo")


def test_a_ppo_loss_is_compared_under_ppo_settings_by_default():
    rt.check_loss_matches(clipped, "ppo")
    rt.check_loss_matches("token_clipped", "ppo")
    rt.check_loss_matches("ppo", "token_clipped")
    with pytest.raises(AssertionError, match="on extreme inputs"):
        rt.check_loss_matches(unclamped, "ppo")


def test_an_unknown_library_loss_is_refused_with_the_names():
    with pytest.raises(ValueError, match=r"'nope' is not a loss name: DPO losses are sigmoid.*"):
        rt.check_loss_matches(clipped, "nope")
    with pytest.raises(ValueError, match="policy losses are grpo, .*token_clipped"):
        rt.check_loss_matches(clipped, "nope")


def ipo(chosen, rejected, ref_chosen, ref_rejected, *, beta):
    """IPO (Azar et al. 2023, eq. 17): (u - 1/(2β))², on per-token averages in the library."""
    return jnp.square((chosen - rejected) - (ref_chosen - ref_rejected) - 1.0 / (2.0 * beta))


def test_a_dpo_mismatch_names_the_registration_flag_that_differs():
    register_dpo_loss("ipo_on_sums", ipo)
    register_dpo_loss("ipo_on_averages", ipo, length_normalised=True)
    rt.check_loss_matches("ipo_on_averages", "ipo")
    with pytest.raises(AssertionError, match=r"\(note: 'ipo' takes per-token averages .*"):
        rt.check_loss_matches("ipo_on_sums", "ipo")


def weighted(logp, old_logp, advantages, mask, *, weight):
    return -weight * advantages * jnp.exp(jnp.clip(logp - old_logp, -20.0, 20.0))


def test_a_missing_hyperparameter_names_the_argument_that_gives_it():
    with pytest.raises(ValueError, match="'weight', which has no default: .* gives user_kwargs"):
        rt.check_loss_matches(weighted, "grpo")
    with pytest.raises(AssertionError, match="does not match 'grpo'"):
        rt.check_loss_matches(weighted, "grpo", user_kwargs={"weight": 2.0})


def ignores_the_upper_clip(logp, old_logp, advantages, mask, *, clip_eps, clip_eps_high):
    """Declares `clip_eps_high` but clips both sides at `clip_eps`: equal to the library
    loss under the default (symmetric) settings only."""
    ratio = jnp.exp(jnp.clip(logp - old_logp, -20.0, 20.0))
    return -jnp.minimum(
        ratio * advantages, jnp.clip(ratio, 1 - clip_eps, 1 + clip_eps) * advantages
    )


@pytest.mark.parametrize("library", ["grpo", "ppo"])
def test_a_loss_that_ignores_clip_eps_high_fails_under_an_asymmetric_clip(library):
    rt.check_loss_matches(clipped, library)  # reads it: passes both comparisons
    with pytest.raises(AssertionError, match=r"asymmetric clip, clip_eps_high=0\.3"):
        rt.check_loss_matches(ignores_the_upper_clip, library)


def test_given_asymmetric_settings_are_compared_as_they_are():
    import rlhf_eqx as rx

    settings = rx.train.GRPOSettings(group_size=1, clip_eps_high=0.28)
    rt.check_loss_matches(clipped, "grpo", settings=settings)
    with pytest.raises(AssertionError, match="per-token losses") as e:
        rt.check_loss_matches(ignores_the_upper_clip, "grpo", settings=settings)
    assert "asymmetric clip" not in str(e.value)  # the given settings were asymmetric
