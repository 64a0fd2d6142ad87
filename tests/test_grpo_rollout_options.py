"""GRPO run options on the rollouts: a stale behaviour policy with importance correction
(`grpo.staleness`, `grpo.rollout_correction`), DAPO's dynamic sampling and overlong
shaping, and continuous-batching rollouts (`sampling.slots`)."""

import dataclasses

import jax
import numpy as np
import pytest

from rlhf_eqx import pipelines as pl


@pytest.fixture(scope="module")
def builtin():
    return pl.load_model("builtin")


def _ctx(tmp_path, name, **sampling):
    log = pl.MetricsLog(str(tmp_path), name, quiet=True)
    ops = pl.OpsConfig(monitor=False, quiet=True)
    kw = dict(prompt_length=16, max_new_tokens=8, **sampling)
    return pl.RunContext(ops=ops, log=log, key=jax.random.key(0), checkpoint_dir=None, **kw)


_PROMPTS = [f"Once upon a time {i}" for i in range(8)]


def _grpo(builtin, tmp_path, name, reward=None, **changes):
    policy, tok = builtin
    cfg = pl.animal_task_config().grpo
    optim = dataclasses.replace(cfg.optim, warmup_ratio=0.0)  # the first update moves
    cfg = dataclasses.replace(
        cfg, rollouts=2, prompts_per_rollout=2, group_size=2, optim=optim, **changes
    )
    reward = reward or [pl.RewardFunction("animal", lambda p, t: pl.task.animal_score(t))]
    res = pl.run_grpo(policy, tok, _PROMPTS, reward=reward, cfg=cfg, ctx=_ctx(tmp_path, name))
    records = [r for r in pl.read_records(str(tmp_path)) if r.get("stage") == name]
    return res, [r for r in records if "step" in r]


def test_staleness_samples_with_the_previous_policy(builtin, tmp_path):
    """With staleness 1 the second rollout comes from the first policy: its tokens differ
    from the current policy's distribution (the mismatch KL is no longer ~0) while the
    first rollout, sampled by the policy being trained, shows none."""
    corr = pl.apply_overrides(pl.animal_task_config(), ["grpo.rollout_correction.mode=truncate"])
    rc = corr.grpo.rollout_correction
    fns = [pl.RewardFunction("parity", lambda p, t: float(len(t) % 2))]  # a signal
    _, stale = _grpo(builtin, tmp_path, "stale", fns, staleness=1, rollout_correction=rc)
    kl = [r["rollout_corr/kl"] for r in stale]
    assert abs(kl[0]) < 1e-4 and abs(kl[1]) > 1e-3
    _, sync = _grpo(builtin, tmp_path, "sync", fns, rollout_correction=rc)
    assert all(abs(r["rollout_corr/kl"]) < 1e-4 for r in sync)
    # the first rollouts are the same: both from the initial policy, with the same keys
    assert stale[0]["reward"] == sync[0]["reward"]


@pytest.mark.slow
def test_staleness_zero_is_the_synchronous_run(builtin, tmp_path):
    a, _ = _grpo(builtin, tmp_path, "a")
    b, _ = _grpo(builtin, tmp_path, "b", staleness=0)
    for x, y in zip(jax.tree.leaves(a.state.params), jax.tree.leaves(b.state.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_dynamic_sampling_refills_uninformative_groups(builtin, tmp_path):
    # half the prompts always score 0 (their groups carry no signal)
    def reward(prompt, completion):
        return 0.0 if int(prompt.split()[-1]) % 2 else float(len(completion) % 2)

    fns = [pl.RewardFunction("parity", reward)]
    _, plain = _grpo(builtin, tmp_path, "plain", reward=fns)
    _, dyn = _grpo(builtin, tmp_path, "dyn", reward=fns, dynamic_sampling=4)
    for r in dyn:
        assert 1 <= r["rollout/dynamic_sampling/samplings"] <= 4
        assert 0.0 <= r["rollout/dynamic_sampling/informative"] <= 1.0
    zero = lambda rs: np.mean([r["rollout/frac_reward_zero_std"] for r in rs])  # noqa: E731
    assert zero(dyn) <= zero(plain)


def test_overlong_penalty_shapes_the_rewards(builtin, tmp_path):
    fns = [pl.RewardFunction("zero", lambda p, t: 0.0)]
    _, steps = _grpo(builtin, tmp_path, "long", reward=fns, overlong_buffer=8)
    for r in steps:
        assert r["rollout/overlong_penalty"] < 0
        assert r["rollout/score"] == pytest.approx(r["rollout/overlong_penalty"], abs=1e-6)


def test_continuous_rollouts_do_not_depend_on_the_batch(builtin):
    policy, tok = builtin
    kw = dict(group_size=2, prompt_length=16, max_new_tokens=8, temperature=1.0, slots=3)
    key = jax.random.key(1)
    few = pl.sample_rollout(policy, tok, _PROMPTS[:2], key, **kw)
    many = pl.sample_rollout(policy, tok, _PROMPTS[:4], key, **kw)
    assert few.texts == many.texts[:4]
    np.testing.assert_array_equal(np.asarray(few.tokens), np.asarray(many.tokens)[:4])
    static = pl.sample_rollout(policy, tok, _PROMPTS[:2], key, **{**kw, "slots": 0})
    assert static.tokens.shape == few.tokens.shape
    assert np.all(np.asarray(few.completion_mask).sum(axis=1) >= 1)


def test_rollout_settings_are_checked():
    for override, message in [
        ("grpo.staleness=-1", "grpo.staleness=-1: must be >= 0"),
        ("sampling.slots=-2", "sampling.slots=-2: must be >= 0"),
        ("grpo.rollout_correction.mode=clip", "mode"),
    ]:
        with pytest.raises(pl.ConfigError) as info:
            pl.validate_config(pl.apply_overrides(pl.animal_task_config(), [override]))
        assert message in str(info.value) and "\n" not in str(info.value)
