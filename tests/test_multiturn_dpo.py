"""Online DPO on multi-turn episodes: pairing episodes by reward, the pair's log-probs
over the policy's own tokens only, a short run that resumes exactly, and the
`multiturn-dpo` stage from the CLI."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TallyEnv, two_turn_rollout
from hypothesis import given, strategies as st

import rlhf_eqx as rx
from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main
from rlhf_eqx.envs import Trajectory
from rlhf_eqx.pipelines import MultiturnDPOConfig
from rlhf_eqx.pipelines.runs import episode_pairs, run_multiturn_dpo

T = 8
# one episode's layout: prompt (2), turn 1 (2), observation (1), turn 2 (2), padding (1)
MASK = np.array([1, 1, 1, 1, 1, 1, 1, 0], bool)
LOSS = np.array([0, 0, 1, 1, 0, 1, 1, 1], bool)  # junk on the padding: `& mask` drops it


def _trajectory(rewards) -> Trajectory:
    """Episodes whose tokens name their row (`tokens[e] == e`), the layout above."""
    E = len(rewards)
    zeros = jnp.zeros((E, T), jnp.float32)
    return Trajectory(
        tokens=jnp.broadcast_to(jnp.arange(E, dtype=jnp.int32)[:, None], (E, T)),
        mask=jnp.broadcast_to(jnp.asarray(MASK), (E, T)),
        loss_mask=jnp.broadcast_to(jnp.asarray(LOSS), (E, T)),
        logprobs=zeros,
        turn_ids=jnp.zeros((E, T), jnp.int32),
        turn_rewards=jnp.zeros((E, 2), jnp.float32),
        reward=jnp.asarray(rewards, jnp.float32),
        num_turns=jnp.full((E,), 2, jnp.int32),
        truncated=jnp.zeros((E,), bool),
    )


def test_episode_pairs_pick_best_and_worst_and_drop_ties():
    rewards = np.array([1.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.0, 2.0, -1.0], np.float32)
    pairs, count = episode_pairs(_trajectory(rewards), rewards, samples=3)
    assert count == 2  # the second prompt's episodes tie
    # first of the tied best (row 0) against the worst (row 1); then row 7 against row 8
    np.testing.assert_array_equal(np.asarray(pairs.chosen_tokens)[:, 0], [0, 7])
    np.testing.assert_array_equal(np.asarray(pairs.rejected_tokens)[:, 0], [1, 8])
    own = MASK & LOSS  # turns only: not the prompt, the observation or the padding
    for m in (pairs.chosen_completion_mask, pairs.rejected_completion_mask):
        np.testing.assert_array_equal(np.asarray(m), np.stack([own, own]))
    for m in (pairs.chosen_mask, pairs.rejected_mask):  # the whole context is attended
        np.testing.assert_array_equal(np.asarray(m), np.stack([MASK, MASK]))
    tied = np.zeros(6, np.float32)
    assert episode_pairs(_trajectory(tied), tied, samples=3) == (None, 0)


@given(
    st.integers(1, 4).flatmap(
        lambda s: st.tuples(
            st.just(s),
            st.lists(
                st.sampled_from([-1e30, -1.0, 0.0, 0.5, 1.0, 3e38]),
                min_size=s,
                max_size=4 * s,
            ).map(lambda r: r[: len(r) - len(r) % s]),
        )
    )
)
def test_episode_pairs_properties(case):
    samples, rewards = case
    r = np.asarray(rewards, np.float32)
    pairs, count = episode_pairs(_trajectory(r), r, samples=samples)
    groups = r.reshape(-1, samples)
    signal = np.flatnonzero(groups.max(1) > groups.min(1))
    assert count == signal.size
    if count == 0:
        assert pairs is None
        return
    chosen = np.asarray(pairs.chosen_tokens)[:, 0]
    rejected = np.asarray(pairs.rejected_tokens)[:, 0]
    np.testing.assert_array_equal(chosen // samples, signal)  # one pair per prompt, in order
    np.testing.assert_array_equal(rejected // samples, signal)
    np.testing.assert_array_equal(r[chosen], groups[signal].max(1))
    np.testing.assert_array_equal(r[rejected], groups[signal].min(1))
    assert np.all(r[chosen] > r[rejected])


def test_episode_pairs_refuse_bad_input():
    r = np.zeros(6, np.float32)
    traj = _trajectory(r)
    with pytest.raises(ValueError, match="samples=4"):
        episode_pairs(traj, r, samples=4)
    with pytest.raises(ValueError, match=r"rewards: expected shape \(6,\)"):
        episode_pairs(traj, r[:5], samples=3)
    with pytest.raises(ValueError, match="rewards: must be finite"):
        episode_pairs(traj, np.array([0, 1, np.nan, 0, 0, 0], np.float32), samples=3)


def test_multiturn_dpo_config_names_its_fields():
    for field, bad in (("max_turns", 0), ("turn_tokens", -1), ("prompts_per_round", 0)):
        with pytest.raises(pl.ConfigError, match=f"multiturn-dpo.{field}={bad}: must be"):
            MultiturnDPOConfig(**{field: bad})
    with pytest.raises(pl.ConfigError, match="multiturn-dpo.kl_target=0.0: must be"):
        MultiturnDPOConfig(kl_target=0.0)
    with pytest.raises(pl.ConfigError, match="multiturn-dpo.packing=True: must be false"):
        MultiturnDPOConfig(packing=True)


@pytest.mark.slow
def test_pairs_of_a_real_rollout_score_the_policy_tokens_only():
    """Two two-turn episodes of the shipped model as a pair: the sequence log-probs are
    the sums of the token log-probs over the policy's turns (not over the question
    between them); the DPO loss is ln 2 while the policy (LoRA at init) is its
    reference (the policy without adapters), and the chosen episode's NLL (RPO) is the
    mean over its own tokens."""
    policy, tok = pl.tools.load_model("builtin")
    traj, ids = two_turn_rollout(policy, tok)
    pairs, count = episode_pairs(traj, jnp.asarray([0.0, 1.0]), samples=2)
    assert count == 1
    np.testing.assert_array_equal(pairs.chosen_tokens[0], traj.tokens[1])
    per_token = jax.vmap(lambda t, m: rx.token_logprobs(policy, t, m))(traj.tokens, traj.mask)
    own = np.asarray(traj.loss_mask & traj.mask)
    after_prompt = np.asarray(traj.mask).copy()
    after_prompt[:, : len(ids)] = False
    assert (after_prompt & ~own).any()  # the question is in the context
    lp = np.asarray(per_token, np.float64)
    for tokens, mask, completion, row in (
        (pairs.chosen_tokens, pairs.chosen_mask, pairs.chosen_completion_mask, 1),
        (pairs.rejected_tokens, pairs.rejected_mask, pairs.rejected_completion_mask, 0),
    ):
        seq = float(rx.train.sequence_logps(policy, tokens, mask, completion)[0])
        np.testing.assert_allclose(seq, (lp[row] * own[row]).sum(), rtol=1e-5)
        with_question = (lp[row] * after_prompt[row]).sum()
        assert abs(seq - with_question) > 1e-2

    cfg = MultiturnDPOConfig(batch_size=1, steps=1, rounds=1)
    adapted, spec = pl.runs.with_lora(policy, cfg.lora, jax.random.key(0))
    reference = rx.without_lora(adapted)  # the run's reference: the adapters off
    opt = pl.runs.build_optimizer(cfg.optim, 1)
    state = rx.train.init_train_state(adapted, opt, filter_spec=spec)
    step = rx.train.make_dpo_step(opt, cfg, options=cfg.options)
    batch = rx.train.compute_reference_logps(reference, pairs)
    _, m = state.apply(step, batch, key=jax.random.key(1))
    np.testing.assert_allclose(float(m["loss/dpo"]), np.log(2.0), rtol=1e-5)
    # the chosen episode's NLL term (RPO) is the mean over its own tokens too
    nll = -(lp[1] * own[1]).sum() / own[1].sum()
    np.testing.assert_allclose(float(m["loss/nll"]), cfg.rpo_alpha * nll, rtol=1e-4)


@pytest.mark.slow
def test_run_multiturn_dpo_is_finite_and_resumes_exactly(tmp_path, monkeypatch):
    policy, tok = pl.tools.load_model("builtin")
    env = TallyEnv(tok)
    prompts = ["Once upon a time", "One day, a little", "Tom and Sue", "The sun was"]
    cfg = MultiturnDPOConfig(
        rounds=2, prompts_per_round=2, samples=3, turn_tokens=4, steps=2, batch_size=2
    )

    def run(name, resume=False):
        ctx = pl.RunContext(
            ops=pl.OpsConfig(quiet=True, checkpoint_every=1, seed=1),
            log=pl.tools.MetricsLog(str(tmp_path / name), "multiturn-dpo", quiet=True),
            key=jax.random.key(4),
            checkpoint_dir=str(tmp_path / name / "ckpt"),
            resume=resume,
            prompt_length=8,
        )
        return run_multiturn_dpo(policy, tok, prompts, env, cfg=cfg, ctx=ctx)

    full = run("full")
    assert full.loop.stopped == "done" and len(full.history) == 4
    assert all(np.isfinite(r["loss"]) for r in full.history)
    ends = [r for r in full.history if "rollout/pairs" in r]
    assert [r["iteration"] for r in ends] == [0, 1]
    assert all(1 <= r["rollout/pairs"] <= 2 and np.isfinite(r["rollout/kl"]) for r in ends)
    assert ends[0]["rollout/turns"] == 2.0
    assert ends[0]["rollout/turn_limit"] == 0.0  # the environment ends every episode
    assert 0.0 <= ends[0]["rollout/truncated"] <= 1.0
    np.testing.assert_allclose(full.history[0]["loss/dpo"], np.log(2.0), rtol=1e-5)

    calls = []
    apply = rx.train.TrainState.apply

    def interrupted(self, *a, **k):  # Ctrl-C during the second round's first step
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return apply(self, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(rx.train.TrainState, "apply", interrupted)
        with pytest.raises(pl.loop.RunInterrupted):
            run("cut")
    resumed = run("cut", resume=True)
    assert [r["iteration"] for r in resumed.history] == [1, 1]
    for a, b in zip(jax.tree.leaves(full.state), jax.tree.leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_multiturn_dpo_stage_runs_from_the_cli(tmp_path, capsys):
    out = tmp_path / "mtdpo"
    argv = ["multiturn-dpo", "--out", str(out), "--quiet", "--set", "ops.monitor=false"]
    argv += ["--set", "sft.steps=2", "--set", "eval_samples=1"]
    for k, v in (("rounds", 2), ("prompts_per_round", 2), ("samples", 4), ("turn_tokens", 6)):
        argv += ["--set", f"multiturn-dpo.{k}={v}"]
    argv += ["--set", "multiturn-dpo.steps=2", "--set", "multiturn-dpo.batch_size=2"]
    assert main(argv) == 0
    mt = json.loads((out / "summary.json").read_text())["multiturn-dpo"]
    for k in ("success", "success_sft", "success_base", "win_rate_vs_sft"):
        assert 0.0 <= mt[f"multiturn_dpo_{k}"] <= 1.0
    for k in ("base_nll", "base_nll_sft", "base_nll_base"):
        assert mt[f"multiturn_dpo_{k}"] > 0
    assert (out / "multiturn-dpo" / "hf" / "config.json").exists()
    assert (
        capsys.readouterr().out.strip().splitlines()[-1].startswith("rlhf_eqx multiturn-dpo: done")
    )
    assert main([*argv[:4], "--set", "multiturn-dpo.samples=1", "--show-config"]) == 2
    assert main([*argv[:4], "--set", "multiturn-dpo.turn_tokens=0", "--show-config"]) == 2
