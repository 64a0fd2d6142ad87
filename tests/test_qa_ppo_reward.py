"""PPO advantages, the reward stage and the judge checked as a TRL user would: every
setting is validated by name, none is accepted and then left unread."""

import jax.numpy as jnp
import pytest

import rlhf_eqx as rx
from rlhf_eqx import data, pipelines as pl
from rlhf_eqx.train import compute_advantages


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gamma": 1.5}, r"^gamma=1\.5: must be in \[0, 1\]"),
        ({"lam": -0.5}, r"^lam=-0\.5: must be in \[0, 1\]"),
        ({"kl_coef": -1.0}, r"^kl_coef=-1\.0: must be >= 0"),
        ({"gamma": float("nan")}, r"^gamma=nan: must be a finite number"),
    ],
)
def test_compute_advantages_refuses_bad_settings_by_name(kwargs, message):
    """As `prepare_ppo_batch` does: an out-of-range γ, λ or KL coefficient is refused,
    not turned into advantages (γ = 1.5 made the returns grow along the sequence)."""
    z = jnp.zeros((1, 3))
    args = {"kl_coef": 0.1, **kwargs}
    with pytest.raises(ValueError, match=message):
        compute_advantages(jnp.ones(1), z, z, z, jnp.ones((1, 3), bool), **args)
    # a JAX-array coefficient (a sweep's, or a controller's) is taken as given
    compute_advantages(jnp.ones(1), z, z, z, jnp.ones((1, 3), bool), kl_coef=jnp.asarray(0.1))


def _validate(overrides):
    cfg = pl.apply_overrides(pl.animal_task_config(), overrides)
    pl.config.validate_config(cfg)


def test_the_held_out_fraction_without_checkpoint_selection_is_refused():
    """`reward.eval_every=0` selects no checkpoint and trains on every pair: a
    `reward.heldout_fraction` would be accepted and never read."""
    with pytest.raises(pl.ConfigError, match=r"^reward\.heldout_fraction=0\.3: holds pairs out"):
        _validate(["reward.eval_every=0", "reward.heldout_fraction=0.3"])
    _validate(["reward.eval_every=0"])
    _validate(["reward.eval_every=3", "reward.heldout_fraction=0.3"])


def test_a_judge_whose_yes_and_no_are_one_token_is_refused():
    """`log p(yes) - log p(no)` of one token is 0 for every completion."""
    tok = data.ByteTokenizer()
    with pytest.raises(ValueError, match=r"yes_token='Y' and no_token=92 are the same token"):
        rx.train.judge_reward(
            None, tok, template="{prompt}{completion}?", yes_token="Y", no_token=92, max_length=64
        )
    judge = rx.train.judge_reward(
        None, tok, template="{prompt}{completion}?", yes_token="Y", no_token="N", max_length=64
    )
    assert judge.yes_id != judge.no_id
