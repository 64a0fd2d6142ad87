"""The `multiturn` stage: GRPO on two-turn episodes of the animal follow-up environment
from the CLI, its held-out success and fluency in summary.json, and its batches train
the policy's own tokens only."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import two_turn_rollout

import rlhf_eqx as rx
from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main


@pytest.mark.slow
def test_multiturn_stage_runs_from_the_cli(tmp_path, capsys):
    out = tmp_path / "mt"
    argv = ["multiturn", "--out", str(out), "--quiet", "--set", "ops.monitor=false"]
    argv += ["--set", "sft.steps=2", "--set", "eval_samples=1", "--set", "multiturn.rollouts=2"]
    argv += ["--set", "multiturn.prompts_per_rollout=2", "--set", "multiturn.group_size=2"]
    argv += ["--set", "multiturn.turn_tokens=6"]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    mt = summary["multiturn"]
    for k in ("multiturn_success", "multiturn_success_sft", "multiturn_success_base"):
        assert 0.0 <= mt[k] <= 1.0
        assert 0.0 <= mt[f"{k}_se"] <= 0.5
    assert 0.0 <= mt["multiturn_win_rate_vs_sft_se"] <= 0.5
    assert mt["multiturn_base_nll"] > 0 and mt["multiturn_base_nll_base"] > 0
    assert 0.0 <= mt["multiturn_win_rate_vs_sft"] <= 1.0
    steps = pl.tools.read_metrics(str(out))["multiturn"]
    assert [r["step"] for r in steps] == [0, 1]
    assert all("rollout/turns" in r and 1.0 <= r["rollout/turns"] <= 2.0 for r in steps)
    assert (out / "multiturn" / "hf" / "config.json").exists()
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("rlhf_eqx multiturn: done")
    assert main([*argv[:4], "--set", "multiturn.max_turns=0", "--show-config"]) == 2


def test_multiturn_batch_trains_the_policy_tokens_only():
    """A GRPO step on a multi-turn trajectory: observation tokens carry no gradient (the
    loss does not change when their recorded log-probs change) and the first update's
    ratio is 1 on-policy."""
    policy, tok = pl.tools.load_model("builtin")
    traj, ids = two_turn_rollout(policy, tok, key=0)
    assert np.all(np.asarray(traj.num_turns) == 2)
    obs = np.asarray(traj.mask & ~traj.loss_mask)[:, len(ids) :]
    assert obs.any()  # the question sits between the turns, in the context

    def batch(old):
        return rx.train.GRPOBatch(
            tokens=traj.tokens,
            mask=traj.mask,
            completion_mask=traj.loss_mask,
            rewards=jnp.asarray([1.0, 0.0]),
            old_logp=old,
            ref_logp=None,
            truncated=traj.truncated,
        )

    opt = rx.train.make_optimizer(learning_rate=1e-3, total_steps=1, max_grad_norm=None)
    step = rx.train.make_grpo_step(opt, group_size=2, donate=False)
    state = rx.train.init_train_state(policy, opt)
    noisy = jnp.where(traj.loss_mask, traj.logprobs, 5.0)  # junk outside the loss mask
    _, m1 = state.apply(step, batch(traj.logprobs))
    _, m2 = state.apply(step, batch(noisy))
    assert float(m1["loss"]) == float(m2["loss"])
    assert float(m1["clip_ratio"]) == 0.0


@pytest.mark.slow
def test_ppo_and_dpo_train_on_the_policy_tokens_of_multiturn_trajectories():
    """PPO: the advantages and returns of a multi-turn batch live on the policy's tokens
    only, and the step's loss ignores what lies outside them. DPO: two trajectories as a
    pair score their policy tokens only (the observation is context), and the loss is
    ln 2 while the policy is the reference."""
    policy, tok = pl.tools.load_model("builtin")
    traj, _ = two_turn_rollout(policy, tok)
    value = rx.ValueModel.from_policy(policy, key=jax.random.key(0))
    own = traj.loss_mask & traj.mask
    batch, _ = rx.train.prepare_ppo_batch(
        (policy, value),
        policy,
        traj.tokens,
        traj.mask,
        own,
        jnp.asarray([1.0, 0.0]),
        kl_coef=0.05,
    )
    outside = np.asarray(~own)
    assert np.all(np.asarray(batch.advantages)[outside] == 0.0)
    assert np.all(np.asarray(batch.returns)[outside] == 0.0)
    opt = rx.train.make_optimizer(learning_rate=1e-3, total_steps=1, max_grad_norm=None)
    step = rx.train.make_ppo_step(opt, donate=False)
    state = rx.train.init_train_state((policy, value), opt)
    junk = eqx.tree_at(lambda b: b.old_logp, batch, jnp.where(own, batch.old_logp, 3.0))
    _, m1 = state.apply(step, batch)
    _, m2 = state.apply(step, junk)
    assert float(m1["loss"]) == float(m2["loss"])

    pair = rx.PreferenceBatch(
        chosen_tokens=traj.tokens[:1],
        chosen_mask=traj.mask[:1],
        chosen_completion_mask=own[:1],
        rejected_tokens=traj.tokens[1:],
        rejected_mask=traj.mask[1:],
        rejected_completion_mask=own[1:],
    )
    logp = rx.train.sequence_logps(policy, traj.tokens, traj.mask, own)
    per_token = jax.vmap(lambda t, m: rx.token_logprobs(policy, t, m))(traj.tokens, traj.mask)
    np.testing.assert_allclose(logp, jnp.sum(jnp.where(own, per_token, 0.0), -1), rtol=1e-5)
    dpo = rx.train.make_dpo_step(opt, donate=False)
    _, m = rx.train.init_train_state(policy, opt).apply(dpo, pair, reference=policy)
    np.testing.assert_allclose(float(m["loss"]), np.log(2.0), rtol=1e-5)
