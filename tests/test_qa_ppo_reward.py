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


def test_gae_and_kl_shaped_rewards_refuse_out_of_range_numbers():
    """A discount or GAE λ above 1 (or NaN) and a negative KL coefficient are refused by
    name; the edge values 0 and 1 are accepted, and arrays are taken as given."""
    r, v, m = jnp.ones(3), jnp.zeros(3), jnp.ones(3, bool)
    with pytest.raises(ValueError, match=r"^gamma must be in \[0, 1\], got 1\.5"):
        rx.losses.gae(r, v, m, gamma=1.5, lam=0.9)
    with pytest.raises(ValueError, match=r"^lam must be in \[0, 1\], got nan"):
        rx.losses.gae(r, v, m, gamma=0.9, lam=float("nan"))
    values = jnp.asarray([0.5, 0.25, 0.0])
    adv, ret = rx.losses.gae(r, values, m, gamma=1.0, lam=0.0)  # λ = 0: the TD error
    assert adv.tolist() == [0.75, 0.75, 1.0] and ret.tolist() == [1.25, 1.0, 1.0]
    with pytest.raises(ValueError, match=r"^kl_coef must be non-negative, got -0\.1"):
        rx.losses.kl_shaped_rewards(1.0, v, v, m, kl_coef=-0.1)
    shaped = rx.losses.kl_shaped_rewards(1.0, v, v, m, kl_coef=jnp.asarray(0.1))
    assert shaped.tolist() == [0.0, 0.0, 1.0]  # the score at the last real token


def _tiny_reward_dir(path, vocab):
    import jax

    cfg = rx.TransformerConfig(
        vocab_size=vocab, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=16
    )
    policy = rx.Policy(cfg, key=jax.random.key(0))
    rx.save_hf(rx.RewardModel.from_policy(policy, key=jax.random.key(1)), str(path))
    return str(path)


def test_a_reward_model_with_a_smaller_vocabulary_than_the_tokenizer_is_refused(tmp_path):
    """Its embedding would read the policy's larger ids as NaN, and every reward of a
    completion holding one would be NaN; refused when loaded, naming the directory."""
    tok = data.ByteTokenizer()  # 259 ids
    small = _tiny_reward_dir(tmp_path / "small", 32)
    with pytest.raises(ValueError, match=r"small'?: its vocabulary has 32 ids, the policy's"):
        pl.runs.load_reward_source(small, tok)
    fits = pl.runs.load_reward_source(_tiny_reward_dir(tmp_path / "fits", 259), tok)
    s, _ = fits.scores(jnp.asarray([[1, 200, 258]]), jnp.ones((1, 3), bool))
    assert bool(jnp.all(jnp.isfinite(s)))


def test_bradley_terry_and_the_ensemble_refuse_what_would_be_nan():
    """A NaN margin and an ensemble of no member made every loss or reward NaN; a tie
    (chosen and rejected scored alike) is log 2 plus the centring term, as in TRL."""
    with pytest.raises(ValueError, match=r"^margin must be a finite number, got nan"):
        rx.losses.bradley_terry_loss(1.0, 0.0, margin=float("nan"))
    tie = rx.losses.bradley_terry_loss(0.5, 0.5, center_coef=0.01)
    assert float(tie) == pytest.approx(float(jnp.log(2.0)) + 0.01)
    with pytest.raises(ValueError, match="member_scores is empty"):
        rx.losses.conservative_reward(jnp.zeros((0,)), penalty=1.0)
    one = rx.losses.conservative_reward(jnp.asarray([1.5]), penalty=1.0)  # σ = 0
    assert float(one) == 1.5


def test_a_directory_of_the_other_kind_of_reward_model_is_refused_by_its_field(tmp_path):
    """`ppo.reward_source=prm` with a plain reward model's directory: the refusal names
    the stage's fields, as every other refusal of a setting does."""
    import dataclasses

    tok = data.ByteTokenizer()
    rm = _tiny_reward_dir(tmp_path / "rm", 259)
    c = dataclasses.replace(pl.animal_task_config().ppo, reward_source="prm", reward_model=rm)
    kw = dict(task=[], tokenizer=tok, judge=None, judges={})
    with pytest.raises(ValueError, match=r"^ppo\.reward_source='prm' but ppo\.reward_model='"):
        pl.runs.stage_reward_source(c, key="ppo", **kw)
    with pytest.raises(ValueError, match=r"^reward_source='prm' but reward_model='"):
        pl.runs.stage_reward_source(c, **kw)  # without a section, the bare field names
