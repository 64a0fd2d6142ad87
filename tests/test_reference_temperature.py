"""The reference is compared with the policy at the sampling temperature: GRPO's
reference log-probabilities (its k3 KL) and the KL guard of GRPO and of the multi-turn
stages temper the reference's logits by `sampling.temperature` as the policy's are
(TRL's GRPO and PPO do so), so a policy that starts as its reference starts at KL 0 at
any temperature, not at the KL between the tempered and the untempered model."""

import jax
import numpy as np
import pytest
from helpers import TallyEnv

from rlhf_eqx import pipelines as pl
from rlhf_eqx.pipelines.runs import run_multiturn_dpo

_PROMPTS = ["Once upon a time", "One day, a little", "Tom and Sue", "The sun was"]


def _ctx(tmp_path, name, temperature):
    return pl.RunContext(
        ops=pl.OpsConfig(quiet=True, monitor=False),
        log=pl.tools.MetricsLog(str(tmp_path / name), name, quiet=True),
        key=jax.random.key(3),
        prompt_length=8,
        max_new_tokens=6,
        temperature=temperature,
    )


@pytest.mark.parametrize("temperature", [0.5, 1.0])
def test_grpo_starts_at_kl_zero_at_any_sampling_temperature(tmp_path, temperature):
    policy, tok = pl.tools.load_model("builtin")
    reward = [pl.runs.RewardFunction("length", lambda p, c: float(len(c)))]
    cfg = pl.GRPOConfig(rollouts=1, prompts_per_rollout=4, group_size=2, beta=0.04)
    ctx = _ctx(tmp_path, "grpo", temperature)
    res = pl.runs.run_grpo(policy, tok, _PROMPTS, reward=reward, cfg=cfg, ctx=ctx)
    first = res.history[0]
    # the policy is its reference (LoRA B = 0): k3 KL and the guard's sampled KL are 0
    # (not the KL of the tempered model to the untempered one)
    assert abs(first["kl"]) < 1e-6 and abs(first["rollout/kl"]) < 1e-5, first


@pytest.mark.slow
def test_multiturn_dpo_kl_guard_starts_at_zero_at_a_sampling_temperature(tmp_path):
    policy, tok = pl.tools.load_model("builtin")
    cfg = pl.MultiturnDPOConfig(
        rounds=1, prompts_per_round=2, samples=3, turn_tokens=4, steps=1, batch_size=2
    )
    ctx = _ctx(tmp_path, "multiturn-dpo", 0.5)
    res = run_multiturn_dpo(policy, tok, _PROMPTS, TallyEnv(tok), cfg=cfg, ctx=ctx)
    (end,) = [r for r in res.history if "rollout/kl" in r]
    assert abs(end["rollout/kl"]) < 1e-5 and np.isfinite(end["loss"]), end
