"""The reinforcement-learning stages' settings have the effect their fields document:
the KL guard reads the KL estimate the user chose (`ppo.kl_estimator`), the one logged."""

import dataclasses

import equinox as eqx
import jax
import numpy as np
import pytest
from helpers import tiny_policies

from rlhf_eqx import data, pipelines as pl

_PROMPTS = [f"Once {i}" for i in range(8)]


def _eos_policy():
    """A tiny policy whose EOS logit is raised on some states (completions of several
    lengths)."""
    (policy,) = tiny_policies(259, 0)
    column = 0.5 * jax.random.normal(jax.random.key(5), (16,))
    eos = data.ByteTokenizer().eos_id
    return eqx.tree_at(lambda p: p.lm_head, policy, policy.lm_head.at[:, eos].set(column))


class _Lengths(pl.runs.RewardSource):
    """Scores `len(text) % 3`; keeps each rollout's number of rows and completion tokens."""

    def __init__(self):
        self.rows, self.tokens = [], []

    def score(self, rollout):
        m = np.asarray(rollout.completion_mask & rollout.mask)
        self.rows.append(m.shape[0])
        self.tokens.append(int(m.sum()))
        s = np.asarray([float(len(t) % 3) for t in rollout.texts], np.float32)
        return pl.runs.Scored(s, {}, None)


def _ppo(tmp_path, name, source, **changes):
    cfg = pl.PipelineConfig().ppo
    optim = dataclasses.replace(cfg.optim, warmup_ratio=0.0, learning_rate=5e-2)
    cfg = dataclasses.replace(
        cfg, rollouts=2, prompts_per_rollout=8, epochs=1, minibatches=1, optim=optim, **changes
    )
    log = pl.tools.MetricsLog(str(tmp_path), name, quiet=True)
    ops = pl.OpsConfig(monitor=False, quiet=True)
    ctx = pl.RunContext(ops=ops, log=log, key=jax.random.key(0), prompt_length=16, max_new_tokens=8)
    res = pl.runs.run_ppo(
        _eos_policy(), data.ByteTokenizer(), _PROMPTS, reward=source, cfg=cfg, ctx=ctx
    )
    recs = [r for r in pl.tools.read_records(str(tmp_path)) if r.get("stage") == name]
    return res, [r for r in recs if "step" in r]


def test_the_ppo_kl_guard_reads_the_chosen_kl_estimator(tmp_path):
    """With `ppo.kl_estimator=k3`, `rollout/kl` (what `ppo.kl_target` compares) is the k3
    estimate per completion token: TRL's `objective/kl` (the summed estimate, averaged
    over the completions) times rows over tokens, not the k1 estimate of the rollout."""
    source = _Lengths()
    _, recs = _ppo(tmp_path, "k3", source, kl_estimator="k3", kl_target=10.0)
    last = recs[-1]
    per_token = last["rollout/objective/kl"] * source.rows[-1] / source.tokens[-1]
    assert last["rollout/objective/kl"] > 1e-4  # the policy has moved from the reference
    assert last["rollout/kl"] == pytest.approx(per_token, rel=1e-4)


def test_an_overlong_buffer_past_the_completion_budget_is_refused_by_name(tmp_path):
    """`grpo.overlong_buffer` longer than `sampling.max_new_tokens` (the punishment's ramp
    would start before the completion): refused naming the field with the configuration,
    and by `run_grpo` before it samples; the budget itself is accepted."""
    sets = ["sampling.max_new_tokens=16", "grpo.overlong_buffer=17"]
    cfg = dataclasses.replace(pl.apply_overrides(pl.animal_task_config(), sets), stages=("grpo",))
    with pytest.raises(pl.ConfigError, match=r"^grpo\.overlong_buffer=17: must be 0 \(off\) or"):
        pl.config.validate_config(cfg)
    ok = pl.apply_overrides(cfg, ["grpo.overlong_buffer=16"])
    pl.config.validate_config(ok)
    log = pl.tools.MetricsLog(str(tmp_path), "grpo", quiet=True)
    ctx = pl.RunContext(
        ops=pl.OpsConfig(monitor=False, quiet=True),
        log=log,
        key=jax.random.key(0),
        prompt_length=8,
        max_new_tokens=4,
    )
    grpo = dataclasses.replace(cfg.grpo, overlong_buffer=5, prompts_per_rollout=2, group_size=2)
    fns = [pl.runs.RewardFunction("length", lambda p, t: float(len(t)))]
    with pytest.raises(pl.ConfigError, match=r"^grpo\.overlong_buffer=5: .*max_new_tokens=4 "):
        pl.runs.run_grpo(
            _eos_policy(), data.ByteTokenizer(), _PROMPTS, reward=fns, cfg=grpo, ctx=ctx
        )


def _grpo(tmp_path, name, reward, **changes):
    cfg = pl.PipelineConfig().grpo
    optim = dataclasses.replace(cfg.optim, warmup_ratio=0.0, learning_rate=5e-2)
    cfg = dataclasses.replace(
        cfg, rollouts=2, prompts_per_rollout=2, group_size=2, optim=optim, **changes
    )
    log = pl.tools.MetricsLog(str(tmp_path), name, quiet=True)
    ops = pl.OpsConfig(monitor=False, quiet=True)
    ctx = pl.RunContext(ops=ops, log=log, key=jax.random.key(0), prompt_length=16, max_new_tokens=6)
    pl.runs.run_grpo(_eos_policy(), data.ByteTokenizer(), _PROMPTS, reward=reward, cfg=cfg, ctx=ctx)
    return [r for r in pl.tools.read_records(str(tmp_path)) if r.get("stage") == name]


def test_equal_rewards_with_a_kl_term_say_the_kl_term_moves_the_policy(tmp_path):
    """A rollout whose groups all tie has zero advantages, but with `grpo.beta > 0` the
    KL term still has a gradient once the policy has left the reference: the
    `no_signal` event says so rather than calling the update zero."""
    calls = []

    def first_then_tied(prompt, text):  # varied rewards in the first rollout only
        calls.append(text)
        return float(len(calls) % 2) if len(calls) <= 4 else 1.0  # 1, 0 in each group

    fns = [pl.runs.RewardFunction("tied", first_then_tied)]
    recs = _grpo(tmp_path, "tied", fns, beta=0.5, kl_target=10.0)
    steps = [r for r in recs if "step" in r and "grad_norm" in r]
    assert steps[0]["frac_reward_zero_std"] < 1.0 and steps[1]["frac_reward_zero_std"] == 1.0
    assert steps[1]["grad_norm"] > 0  # the KL term's gradient: the update is not zero
    (note,) = [r for r in recs if r.get("event") == "no_signal"]
    assert note["message"] == (
        "rollout 1: every group has equal rewards; the advantages are zero and only the "
        "KL term (grpo.beta=0.5) moves the policy"
    )
