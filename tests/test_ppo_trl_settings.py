"""The PPO stage's settings from TRL's `PPOConfig`: `ppo.kl_estimator` (the per-token KL
of the shaped rewards), `ppo.whiten_rewards` (the shaped rewards scaled before GAE) and
`ppo.missing_eos_penalty` (subtracted from the score of a completion cut at
`max_new_tokens`); with their defaults a run trains the numbers it trained before."""

import dataclasses
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_policies

import rlhf_eqx as rx
from rlhf_eqx import data, pipelines as pl

_BETA = 0.3
_SCORES = jnp.asarray([1.0, -0.5, 2.0])


def _rollout_batch():
    """Three rows of 3 prompt and 7, 5 or 4 completion tokens (right-padded to 10), a
    policy and a different reference, and the reference's tempered log-probs."""
    policy, reference = tiny_policies(259, 0, 1)
    value = rx.ValueModel.from_policy(policy, key=jax.random.key(2))
    tokens = jax.random.randint(jax.random.key(3), (3, 10), 3, 259)
    idx = jnp.arange(10)[None, :]
    ends = jnp.asarray([[10], [8], [7]])
    mask = idx < ends
    completion = mask & (idx >= 3)
    ref_logp = jax.vmap(lambda t, m: rx.token_logprobs(reference, t, m))(tokens, mask)
    return (policy, value), reference, tokens, mask, completion, ref_logp


def _rewards(batch):
    """The per-token rewards read back from the returns: with γ = λ = 1 the return is the
    sum of the rewards from `t` on (whatever the values), so `r_t = R_t - R_{t+1}`."""
    ret = np.asarray(batch.returns, np.float64)
    nxt = np.concatenate([ret[:, 1:], np.zeros((ret.shape[0], 1))], axis=1)
    m = np.asarray(batch.completion_mask)
    return np.where(m, ret - np.where(np.roll(m, -1, axis=1), nxt, 0.0), 0.0)


def _prepare(model, reference, tokens, mask, completion, **kw):
    return rx.train.prepare_ppo_batch(
        model, reference, tokens, mask, completion, _SCORES, kl_coef=_BETA, gamma=1.0, lam=1.0, **kw
    )


def test_k3_shapes_the_rewards_with_its_own_estimate():
    """`kl_kind="k3"` (`ppo.kl_estimator=k3`): every completion token's reward is
    `-β (e^{log r} - 1 - log r)` instead of k1's `β log r`, the score added at the last
    token, with `log r = log π_ref - log π` (the policy's log-probs are `old_logp`)."""
    model, reference, tokens, mask, completion, ref_logp = _rollout_batch()
    b1, s1 = _prepare(model, reference, tokens, mask, completion, whiten=False)
    b3, s3 = _prepare(model, reference, tokens, mask, completion, whiten=False, kl_kind="k3")
    m = np.asarray(completion)
    log_r = np.where(m, np.asarray(ref_logp, np.float64) - np.asarray(b1.old_logp), 0.0)
    last = np.arange(10) == np.asarray([[9], [7], [6]])
    score = np.where(last, np.asarray(_SCORES)[:, None], 0.0)
    k1 = -log_r
    k3 = np.expm1(log_r) - log_r
    np.testing.assert_allclose(_rewards(b1), np.where(m, -_BETA * k1 + score, 0), atol=2e-5)
    np.testing.assert_allclose(_rewards(b3), np.where(m, -_BETA * k3 + score, 0), atol=2e-5)
    assert np.abs(_rewards(b3) - _rewards(b1)).max() > 1e-3  # the two differ here
    # TRL's objective/kl sums each sequence's estimate
    for s, k in ((s1, k1), (s3, k3)):
        assert float(s["objective/kl"]) == pytest.approx(np.mean(np.sum(k * m, 1)), abs=1e-5)


def test_whiten_rewards_scales_the_shaped_rewards_before_gae():
    """`whiten_rewards=True`: the rewards GAE reads have unbiased variance 1 over the
    completion tokens and keep their mean (TRL `masked_whiten(rewards,
    shift_mean=False)`), 0 elsewhere; the advantages are whitened after GAE as before."""
    model, reference, tokens, mask, completion, _ = _rollout_batch()
    plain, _ = _prepare(model, reference, tokens, mask, completion, whiten=False)
    white, _ = _prepare(
        model, reference, tokens, mask, completion, whiten=False, whiten_rewards=True
    )
    m = np.asarray(completion)
    r, w = _rewards(plain)[m], _rewards(white)[m]
    assert abs(np.var(r, ddof=1) - 1) > 0.5  # far from 1: the scaling is visible
    assert np.var(w, ddof=1) == pytest.approx(1.0, abs=1e-4)
    assert np.mean(w) == pytest.approx(np.mean(r), abs=1e-5)
    np.testing.assert_allclose(w, (r - r.mean()) / np.std(r, ddof=1) + r.mean(), atol=1e-4)
    assert np.all(_rewards(white)[~m] == 0)
    both, _ = _prepare(model, reference, tokens, mask, completion, whiten_rewards=True)
    adv = np.asarray(both.advantages)[m]
    assert np.mean(adv) == pytest.approx(0.0, abs=1e-5)
    assert np.var(adv, ddof=1) == pytest.approx(1.0, abs=1e-4)


def _validate(overrides):
    cfg = pl.apply_overrides(pl.animal_task_config(), overrides)
    pl.config.validate_config(cfg)
    return cfg.ppo


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("ppo.kl_estimator=k2", r"^ppo\.kl_estimator='k2': must be one of k1, k3"),
        ("ppo.missing_eos_penalty=-0.5", r"^ppo\.missing_eos_penalty=-0\.5: must be >= 0"),
        ("ppo.missing_eos_penalty=inf", r"^ppo\.missing_eos_penalty=inf: must be a finite"),
        ("ppo.whiten_rewards=maybe", r"^ppo\.whiten_rewards='maybe': expected true or false"),
    ],
)
def test_the_settings_are_refused_by_name(override, message):
    with pytest.raises(pl.ConfigError, match=message):
        _validate([override])


def test_the_settings_default_to_trls_and_parse():
    c = pl.PipelineConfig().ppo
    assert (c.kl_estimator, c.whiten_rewards, c.missing_eos_penalty) == ("k1", False, None)
    sets = ["ppo.kl_estimator=k3", "ppo.whiten_rewards=true", "ppo.missing_eos_penalty=1"]
    c = _validate(sets)
    assert (c.kl_estimator, c.whiten_rewards, c.missing_eos_penalty) == ("k3", True, 1.0)
    assert _validate(["ppo.missing_eos_penalty=0"]).missing_eos_penalty == 0
    # a process reward model's step rewards join after GAE: whitening could not see them
    with pytest.raises(pl.ConfigError, match=r"^ppo\.whiten_rewards=True: not with ppo\.rew"):
        _validate(["ppo.whiten_rewards=true", "ppo.reward_source=prm"])


_PROMPTS = [f"Once {i}" for i in range(8)]


def _eos_policy():
    """A tiny policy whose EOS logit is raised on some states: of 8 completions of 8
    tokens, some end with EOS and some are cut at `max_new_tokens`."""
    (policy,) = tiny_policies(259, 0)
    column = 0.5 * jax.random.normal(jax.random.key(5), (16,))
    eos = data.ByteTokenizer().eos_id
    return eqx.tree_at(lambda p: p.lm_head, policy, policy.lm_head.at[:, eos].set(column))


class _Recorded(pl.runs.RewardSource):
    """Scores `len(text) % 3`; keeps each rollout's `truncated`."""

    def __init__(self, token_rewards=False):
        self.truncated, self.scores, self.token_rewards = [], [], token_rewards

    def score(self, rollout):
        self.truncated.append(np.asarray(rollout.truncated))
        s = np.asarray([float(len(t) % 3) for t in rollout.texts], np.float32)
        self.scores.append(s)
        extra = np.zeros(rollout.tokens.shape, np.float32) if self.token_rewards else None
        return pl.runs.Scored(s, {}, extra)


def _run(tmp_path, name, source, monkeypatch=None, rollouts=1, **changes):
    """`run_ppo` of the EOS policy, 8 prompts a rollout; with `monkeypatch`, the scores
    and keywords each `prepare_ppo_batch` call was given."""
    calls = []
    if monkeypatch is not None:
        prepare = rx.train.prepare_ppo_batch

        def spy(*args, **kw):
            calls.append((np.asarray(args[5]), kw))
            return prepare(*args, **kw)

        monkeypatch.setattr(rx.train, "prepare_ppo_batch", spy)
    cfg = pl.PipelineConfig().ppo
    optim = dataclasses.replace(cfg.optim, warmup_ratio=0.0, learning_rate=1e-2)
    cfg = dataclasses.replace(
        cfg, rollouts=rollouts, prompts_per_rollout=8, epochs=1, optim=optim, **changes
    )
    log = pl.tools.MetricsLog(str(tmp_path), name, quiet=True)
    ctx = pl.RunContext(
        ops=pl.OpsConfig(monitor=False, quiet=True),
        log=log,
        key=jax.random.key(0),
        prompt_length=16,
        max_new_tokens=8,
    )
    res = pl.runs.run_ppo(
        _eos_policy(), data.ByteTokenizer(), _PROMPTS, reward=source, cfg=cfg, ctx=ctx
    )
    recs = [r for r in pl.tools.read_records(str(tmp_path)) if r.get("stage") == name]
    return res, [r for r in recs if "step" in r], calls


def test_the_missing_eos_penalty_is_subtracted_from_the_cut_completions_only(tmp_path, monkeypatch):
    """TRL's `missing_eos_penalty`: `scores[~contains_eos] -= penalty`, here on the rows
    the sampler cut at `max_new_tokens` (`Rollout.truncated`); `rollout/missing_eos`
    logs their fraction, `rollout/objective/scores` the mean of the lowered scores."""
    source = _Recorded()
    _, recs, calls = _run(tmp_path, "eos", source, monkeypatch, missing_eos_penalty=0.75)
    cut, raw = source.truncated[0], source.scores[0]
    assert 0 < cut.sum() < len(cut)  # both kinds of completion
    ((given, kw),) = calls
    np.testing.assert_array_equal(given, raw - np.float32(0.75) * cut)
    assert kw["kl_kind"] == "k1" and kw["whiten_rewards"] is False
    last = recs[-1]
    assert last["rollout/missing_eos"] == pytest.approx(cut.mean())
    assert last["rollout/truncated"] == pytest.approx(cut.mean())
    assert last["rollout/objective/scores"] == pytest.approx(np.mean(given), abs=1e-6)
    assert last["rollout/score"] == pytest.approx(np.mean(raw), abs=1e-6)  # the reward's own


# The losses of the 4 steps of `_run(..., rollouts=2)` with the defaults, as the stage
# trained them before it had these settings (the second rollout's KL is not 0).
_LOSSES_BEFORE = [0.7722691297531128, 0.6130500435829163, -0.08575639128684998, 0.6714272499084473]


def test_the_defaults_train_the_numbers_of_before(tmp_path, monkeypatch):
    """k1, no reward whitening and no penalty: `prepare_ppo_batch` gets the reward's own
    scores and the stage's losses are those it trained before, step for step."""
    source = _Recorded()
    res, recs, calls = _run(tmp_path, "defaults", source, monkeypatch, rollouts=2)
    assert [h["loss"] for h in res.history] == pytest.approx(_LOSSES_BEFORE, rel=1e-5)
    for (given, kw), raw in zip(calls, source.scores, strict=True):
        np.testing.assert_array_equal(given, raw)
        assert kw["kl_kind"] == "k1" and kw["whiten_rewards"] is False and kw["whiten"]
    assert all("rollout/missing_eos" not in r for r in recs)


def test_a_run_refuses_whitened_rewards_with_step_rewards(tmp_path):
    """A reward source with per-token rewards (a PRM's) adds them after GAE, which
    whitening the shaped rewards could not see: refused naming the field."""
    with pytest.raises(ValueError, match=r"^ppo\.whiten_rewards=True: a process reward"):
        _run(tmp_path, "prm", _Recorded(token_rewards=True), whiten_rewards=True)


@pytest.mark.slow
def test_a_ppo_sweep_member_with_the_settings_equals_its_separate_run(tmp_path):
    """The sweep reads `ppo.kl_estimator`, `ppo.whiten_rewards` and
    `ppo.missing_eos_penalty` as its separate run does (`ppo_rollout_batch`)."""
    from test_sweep_runs import POLICY_SUMMARY, assert_same_run, step_records, tiny_config

    sets = [
        "reward.steps=2",
        "ppo.rollouts=2",
        "ppo.prompts_per_rollout=4",
        "ppo.minibatches=2",
        "ppo.epochs=1",
        "ppo.kl_estimator=k3",
        "ppo.whiten_rewards=true",
        "ppo.missing_eos_penalty=0.5",
    ]
    cfg = pl.apply_overrides(tiny_config(), sets)
    grid = {"ppo.kl_coef": [0.2]}
    res = pl.sweep("ppo", cfg, seeds=1, grid=grid, out=str(tmp_path / "s"), export=True)
    (mem,) = res.members
    run_dir = str(tmp_path / mem.name)
    summary = pl.run_pipeline(dataclasses.replace(mem.cfg, out=run_dir))
    member_dir = os.path.join(res.out, "members", mem.name)
    assert_same_run(member_dir, run_dir, "ppo")
    # the member's rollouts were penalised (and the fraction logged) as the run's
    assert any("rollout/missing_eos" in r for r in step_records(member_dir, "ppo"))
    for k in POLICY_SUMMARY:
        assert res.summaries[mem.name][k] == pytest.approx(summary["ppo"][k], abs=1e-4), k
