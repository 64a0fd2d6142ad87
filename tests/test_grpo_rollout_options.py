"""GRPO run options on the rollouts: a stale behaviour policy with importance correction
(`grpo.staleness`, `grpo.rollout_correction`), DAPO's dynamic sampling and overlong
shaping, and continuous-batching rollouts (`sampling.slots`)."""

import dataclasses

import jax
import numpy as np
import pytest

import rlhf_eqx as rx
from rlhf_eqx import pipelines as pl


@pytest.fixture(scope="module")
def builtin():
    return pl.tools.load_model("builtin")


def _ctx(tmp_path, name, ops=None, **sampling):
    log = pl.tools.MetricsLog(str(tmp_path), name, quiet=True)
    ops = ops or pl.OpsConfig(monitor=False, quiet=True)
    kw = dict(prompt_length=16, max_new_tokens=8, **sampling)
    return pl.RunContext(ops=ops, log=log, key=jax.random.key(0), checkpoint_dir=None, **kw)


_PROMPTS = [f"Once upon a time {i}" for i in range(8)]


def _grpo(builtin, tmp_path, name, reward=None, ops=None, **changes):
    policy, tok = builtin
    cfg = pl.animal_task_config().grpo
    optim = dataclasses.replace(cfg.optim, warmup_ratio=0.0)  # the first update moves
    cfg = dataclasses.replace(cfg, prompts_per_rollout=2, group_size=2, optim=optim)
    reward = reward or [pl.runs.RewardFunction("animal", lambda p, t: pl.task.animal_score(t))]
    changes.setdefault("rollouts", 2)
    cfg = dataclasses.replace(cfg, **changes)
    ctx = _ctx(tmp_path, name, ops)
    res = pl.runs.run_grpo(policy, tok, _PROMPTS, reward=reward, cfg=cfg, ctx=ctx)
    records = [r for r in pl.tools.read_records(str(tmp_path)) if r.get("stage") == name]
    return res, [r for r in records if "step" in r]


@pytest.mark.slow
def test_staleness_samples_with_the_previous_policy(builtin, tmp_path):
    """With staleness 1 the second rollout comes from the first policy: its tokens differ
    from the current policy's distribution (the mismatch KL is no longer ~0) while the
    first rollout, sampled by the policy being trained, shows none."""
    corr = pl.apply_overrides(pl.animal_task_config(), ["grpo.rollout_correction.mode=truncate"])
    rc = corr.grpo.rollout_correction
    fns = [pl.runs.RewardFunction("parity", lambda p, t: float(len(t) % 2))]  # a signal
    _, stale = _grpo(builtin, tmp_path, "stale", fns, staleness=1, rollout_correction=rc)
    kl = [r["rollout_corr/kl"] for r in stale]
    assert abs(kl[0]) < 1e-4 and abs(kl[1]) > 1e-3
    _, sync = _grpo(builtin, tmp_path, "sync", fns, rollout_correction=rc)
    assert all(abs(r["rollout_corr/kl"]) < 1e-4 for r in sync)
    # the first rollouts are the same: both from the initial policy, with the same keys
    assert stale[0]["reward"] == sync[0]["reward"]


_PARITY = [pl.runs.RewardFunction("parity", lambda p, t: float(len(t) % 2))]  # a signal
_TIMING = ("stage", "time", "iteration_time_s", "tokens_per_s", "rollout/overlapped")


def _same_run(a, b):
    for x, y in zip(jax.tree.leaves(a[0].state.params), jax.tree.leaves(b[0].state.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    strip = lambda recs: [{k: v for k, v in r.items() if k not in _TIMING} for r in recs]  # noqa: E731
    assert strip(a[1]) == strip(b[1])


def test_overlapped_rollouts_train_the_same_numbers(builtin, tmp_path):
    """With staleness 1 the next rollout is sampled, decoded and scored during the update
    (`overlap`, the default), every rollout after the first comes prepared, and the run
    is the one without overlap, number for number."""
    a = _grpo(builtin, tmp_path, "on", _PARITY, staleness=1, rollouts=3)
    assert [r["rollout/overlapped"] for r in a[1]] == [0.0, 1.0, 1.0]
    b = _grpo(builtin, tmp_path, "off", _PARITY, staleness=1, rollouts=3, overlap=False)
    assert all("rollout/overlapped" not in r for r in b[1])
    _same_run(a, b)


@pytest.mark.slow
def test_overlapped_run_interrupted_while_preparing_resumes_exactly(builtin, tmp_path):
    """Ctrl-C while the next rollout is being scored (during an update) checkpoints the
    last completed iteration; the resumed run samples that rollout again and ends where
    the uninterrupted run does."""
    policy, tok = builtin
    calls = {"n": 0, "stop_at": None}

    def parity(prompt, text):
        calls["n"] += 1
        if calls["n"] == calls["stop_at"]:
            raise KeyboardInterrupt
        return float(len(text) % 2)

    cfg = dataclasses.replace(
        pl.animal_task_config().grpo,
        prompts_per_rollout=2,
        group_size=2,
        rollouts=4,
        staleness=1,
        optim=dataclasses.replace(pl.animal_task_config().grpo.optim, warmup_ratio=0.0),
    )
    fns = [pl.runs.RewardFunction("parity", parity)]

    def run(name, resume=False):
        ctx = dataclasses.replace(
            _ctx(tmp_path, name), checkpoint_dir=str(tmp_path / "ckpt" / name), resume=resume
        )
        return pl.runs.run_grpo(policy, tok, _PROMPTS, reward=fns, cfg=cfg, ctx=ctx)

    full = run("full")
    calls.update(n=0, stop_at=2 * 4 + 1)  # rollout 2's first completion, scored in iteration 1
    with pytest.raises(pl.loop.RunInterrupted) as info:
        run("cut")
    assert info.value.iteration == 1
    calls["stop_at"] = None
    resumed = run("cut", resume=True)
    for x, y in zip(jax.tree.leaves(full.state.params), jax.tree.leaves(resumed.state.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
def test_sampler_on_its_own_device_trains_the_same_numbers(builtin, tmp_path, monkeypatch):
    """`sampler_device=1`: every rollout is sampled on device 1 (the behaviour parameters
    copied there) while the update runs on device 0; the run is the one on one device."""
    if jax.local_device_count() < 2:
        pytest.skip("needs 2 devices (XLA_FLAGS=--xla_force_host_platform_device_count=2)")
    seen = []
    sampler = rx.generate_batch

    def spy(policy, *args, **kw):
        out = sampler(policy, *args, **kw)
        seen.append(next(iter(out.tokens.devices())))
        return out

    monkeypatch.setattr(rx, "generate_batch", spy)
    a = _grpo(builtin, tmp_path, "dev1", _PARITY, staleness=1, rollouts=3, sampler_device=1)
    assert seen == [jax.local_devices()[1]] * 3
    b = _grpo(builtin, tmp_path, "dev0", _PARITY, staleness=1, rollouts=3)
    assert seen[3:] == [jax.local_devices()[0]] * 3
    _same_run(a, b)
    with pytest.raises(pl.ConfigError, match=r"grpo.sampler_device=99: this process has"):
        _grpo(builtin, tmp_path, "bad", _PARITY, sampler_device=99)


@pytest.mark.slow
def test_overlap_with_staleness_two_dynamic_sampling_and_rollbacks(builtin, tmp_path):
    """Staleness 2 (the next behaviour policy is two updates old), DAPO's extra samplings
    and a rollback (a KL spike restores a copy of an earlier state: the rollout prepared
    from the discarded state is not used) give the same run with and without overlap."""
    ops = pl.OpsConfig(monitor=False, quiet=True, kl_spike=1e-6, max_rollbacks=2)
    kw = dict(staleness=2, rollouts=5, dynamic_sampling=2, epochs=2, kl_target=10.0)
    a = _grpo(builtin, tmp_path, "on2", _PARITY, ops, **kw)
    b = _grpo(builtin, tmp_path, "off2", _PARITY, ops, overlap=False, **kw)
    assert a[0].loop.rollbacks >= 1
    flags = [r["rollout/overlapped"] for r in a[1] if "rollout/overlapped" in r]
    assert 1.0 in flags and 0.0 in flags[1:]  # the re-run after the rollback samples anew
    _same_run(a, b)


@pytest.mark.slow
def test_staleness_zero_is_the_synchronous_run(builtin, tmp_path):
    a, _ = _grpo(builtin, tmp_path, "a")
    b, _ = _grpo(builtin, tmp_path, "b", staleness=0)
    for x, y in zip(jax.tree.leaves(a.state.params), jax.tree.leaves(b.state.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
def test_dynamic_sampling_refills_uninformative_groups(builtin, tmp_path):
    # half the prompts always score 0 (their groups carry no signal)
    def reward(prompt, completion):
        return 0.0 if int(prompt.split()[-1]) % 2 else float(len(completion) % 2)

    fns = [pl.runs.RewardFunction("parity", reward)]
    _, plain = _grpo(builtin, tmp_path, "plain", reward=fns)
    _, dyn = _grpo(builtin, tmp_path, "dyn", reward=fns, dynamic_sampling=4)
    for r in dyn:
        assert 1 <= r["rollout/dynamic_sampling/samplings"] <= 4
        assert 0.0 <= r["rollout/dynamic_sampling/informative"] <= 1.0
    zero = lambda rs: np.mean([r["rollout/frac_reward_zero_std"] for r in rs])  # noqa: E731
    assert zero(dyn) <= zero(plain)


def test_overlong_penalty_shapes_the_rewards(builtin, tmp_path):
    fns = [pl.runs.RewardFunction("zero", lambda p, t: 0.0)]
    _, steps = _grpo(builtin, tmp_path, "long", reward=fns, overlong_buffer=8)
    for r in steps:
        assert r["rollout/overlong_penalty"] < 0
        assert r["rollout/score"] == pytest.approx(r["rollout/overlong_penalty"], abs=1e-6)


def test_continuous_rollouts_do_not_depend_on_the_batch(builtin):
    policy, tok = builtin
    kw = dict(group_size=2, prompt_length=16, max_new_tokens=8, temperature=1.0, slots=3)
    key = jax.random.key(1)
    few = pl.runs.sample_rollout(policy, tok, _PROMPTS[:2], key, **kw)
    many = pl.runs.sample_rollout(policy, tok, _PROMPTS[:4], key, **kw)
    assert few.texts == many.texts[:4]
    np.testing.assert_array_equal(np.asarray(few.tokens), np.asarray(many.tokens)[:4])
    static = pl.runs.sample_rollout(policy, tok, _PROMPTS[:2], key, **{**kw, "slots": 0})
    assert static.tokens.shape == few.tokens.shape
    assert np.all(np.asarray(few.completion_mask).sum(axis=1) >= 1)


def test_rollout_settings_are_checked():
    for override, message in [
        ("grpo.staleness=-1", "grpo.staleness=-1: must be >= 0"),
        ("sampling.slots=-2", "sampling.slots=-2: must be >= 0"),
        ("grpo.rollout_correction.mode=clip", "mode"),
    ]:
        with pytest.raises(pl.ConfigError) as info:
            pl.config.validate_config(pl.apply_overrides(pl.animal_task_config(), [override]))
        assert message in str(info.value) and "\n" not in str(info.value)
