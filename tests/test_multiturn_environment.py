"""The multi-turn stages with the user's own environment (`multiturn.environment`,
`multiturn-dpo.environment`): a factory that raises, returns something else or makes
episodes longer than the model's context is refused before anything runs, naming the
field; an environment whose `reset` gives a first observation plays every turn; an
episode reward that is not finite stops the run with one clear error."""

import json
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import rlhf_eqx as rx
from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main
from rlhf_eqx.pipelines import MultiturnConfig
from rlhf_eqx.pipelines.runs import run_multiturn

MODULE = textwrap.dedent(
    """
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import rlhf_eqx as rx


    class Ask(rx.envs.Environment):
        question: jax.Array
        max_observation_tokens: int = eqx.field(static=True)

        def reset(self, key, prompt, prompt_mask):
            return jnp.zeros((), jnp.int32), self.question, self.question >= 0

        def step(self, turns, completion, completion_mask):
            reward = jnp.sum(completion_mask).astype(jnp.float32)
            return turns + 1, self.question, self.question >= 0, reward, turns + 1 >= 2


    def make(tok):
        question = jnp.asarray(tok.encode(" And then?"), jnp.int32)
        return Ask(question, max_observation_tokens=int(question.shape[0]))


    def huge(tok):
        return Ask(jnp.full((300,), 5, jnp.int32), max_observation_tokens=300)


    def broken(tok):
        raise RuntimeError("cannot build the game")


    class Stops(Ask):
        stop_ids = (9999,)


    def foreign_stops(tok):
        question = jnp.asarray(tok.encode(" And then?"), jnp.int32)
        return Stops(question, max_observation_tokens=int(question.shape[0]))


    class IntReward(Ask):
        def step(self, turns, completion, completion_mask):
            out = super().step(turns, completion, completion_mask)
            return out[:3] + (out[3].astype(jnp.int32), out[4])


    class Branchy(Ask):
        def step(self, turns, completion, completion_mask):
            if completion[0] > 3:  # Python branching on a traced value
                turns = turns + 1
            return super().step(turns, completion, completion_mask)


    class Typo(Ask):
        def step(self, turns, completion, completion_mask):
            return self.questoin


    def branchy(tok):
        return Branchy(jnp.asarray([5, 6]), max_observation_tokens=2)


    def typo(tok):
        return Typo(jnp.asarray([5, 6]), max_observation_tokens=2)


    def int_reward(tok):
        question = jnp.asarray(tok.encode(" And then?"), jnp.int32)
        return IntReward(question, max_observation_tokens=int(question.shape[0]))


    def text(tok):
        return "not an environment"


    class Host(rx.envs.HostEnvironment):
        max_observation_tokens = 1

        def reset(self, prompt):
            return []

        def step(self, completion):
            return [], 0.0, True


    def host(tok):
        return Host()
    """
)


@pytest.fixture
def env_module(tmp_path, monkeypatch):
    (tmp_path / "user_env_module.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_env_module"
    sys.modules.pop("user_env_module", None)


@pytest.mark.parametrize("stage", ["multiturn", "multiturn-dpo"])
def test_a_user_environment_is_built_and_checked_before_the_run(env_module, stage, capsys):
    argv = [stage, "--out", "run", "--quiet", "--show-config"]

    def refused(spec):
        assert main([*argv, "--set", f"{stage}.environment={env_module}:{spec}"]) == 2
        return capsys.readouterr().err

    assert f"{stage}.environment='{env_module}:broken': the factory raised RuntimeError" in (
        refused("broken")
    )
    assert "the factory returned str, not an rlhf_eqx.envs.Environment" in refused("text")
    for name, source in (("unparsable", "def make(tok)\n"), ("failing", "1 / 0\n")):
        with open(f"{env_module}_{name}.py", "w") as f:
            f.write(source)
        assert main([*argv, "--set", f"{stage}.environment={env_module}_{name}:make"]) == 2
        raised = "SyntaxError" if name == "unparsable" else "ZeroDivisionError"
        assert f"importing {env_module}_{name} raised {raised}" in capsys.readouterr().err
        sys.modules.pop(f"{env_module}_{name}", None)
    assert "returned Host, not an rlhf_eqx.envs.Environment (the stages roll out jittable" in (
        refused("host")
    )
    assert "Stops.stop_ids holds 9999, outside the vocabulary [0, 512)" in refused("foreign_stops")
    assert "IntReward.step's reward must be a float array of shape ()" in refused("int_reward")
    err = refused("branchy")
    assert "tracing its reset and step raised TracerBoolConversionError" in err
    assert "use jnp.where or jax.lax.cond" in err and len(err.strip().splitlines()) == 1
    err = refused("typo")
    assert "raised AttributeError: 'Typo' object has no attribute 'questoin'" in err
    assert len(err.strip().splitlines()) == 1
    err = refused("huge")
    assert f"{stage}.turn_tokens=40" in err and "2 observations of up to 300 tokens" in err
    assert "longer than the model's max_seq_len=512" in err
    assert main([*argv, "--set", f"{stage}.environment={env_module}:make"]) == 0
    shown = capsys.readouterr().out
    assert f'"environment": "{env_module}:make"' in shown


def test_the_other_stage_s_environment_is_not_silently_ignored(env_module, capsys):
    """`multiturn.environment` on a `multiturn-dpo` run (and the reverse) would play the
    animal game: refused, naming the field to set."""
    for stage, other in (("multiturn-dpo", "multiturn"), ("multiturn", "multiturn-dpo")):
        argv = [stage, "--out", "run", "--quiet", "--show-config"]
        assert main([*argv, "--set", f"{other}.environment={env_module}:make"]) == 2
        err = capsys.readouterr().err
        assert f"--set {other}.environment={env_module}:make: rlhf_eqx {stage} runs" in err
        assert f"set {stage}.environment" in err


@pytest.mark.parametrize("stage", ["multiturn", "multiturn-dpo"])
def test_one_turn_of_the_animal_game_is_refused(stage, capsys):
    """The animal environment rewards the second turn only: one turn would train on
    rewards that are always 0."""
    argv = [stage, "--out", "run", "--quiet", "--show-config"]
    assert main([*argv, "--set", f"{stage}.max_turns=1"]) == 2
    assert f"{stage}.max_turns=1: must be >= 2 with the animal" in capsys.readouterr().err


def _ctx(tmp_path):
    return pl.RunContext(
        ops=pl.OpsConfig(quiet=True, seed=1),
        log=pl.tools.MetricsLog(str(tmp_path), "multiturn", quiet=True),
        key=jax.random.key(4),
        prompt_length=8,
    )


@pytest.mark.slow
def test_an_environment_with_a_first_observation_plays_every_turn(env_module, tmp_path):
    """The episode buffer holds `reset`'s observation too: no turn is lost to it."""
    policy, tok = pl.tools.load_model("builtin")
    env = __import__(env_module).make(tok)
    cfg = MultiturnConfig(rollouts=1, prompts_per_rollout=2, group_size=2, turn_tokens=4)
    res = run_multiturn(
        policy, tok, ["Once upon a time", "Tom and Sue"], env, cfg=cfg, ctx=_ctx(tmp_path)
    )
    (record,) = [r for r in res.history if "rollout/turns" in r]
    assert record["rollout/turns"] == 2.0 and record["rollout/turn_limit"] == 0.0


class _NaN(rx.envs.Environment):
    max_observation_tokens: int = eqx.field(static=True, default=1)

    def reset(self, key, prompt, prompt_mask):
        return jnp.zeros((), jnp.int32), jnp.zeros((1,), jnp.int32), jnp.zeros((1,), bool)

    def step(self, state, completion, completion_mask):
        obs, mask = jnp.zeros((1,), jnp.int32), jnp.zeros((1,), bool)
        return state + 1, obs, mask, jnp.asarray(jnp.nan, jnp.float32), state >= 1


def test_a_reward_that_is_not_finite_stops_the_run_naming_the_environment(tmp_path):
    policy, tok = pl.tools.load_model("builtin")
    cfg = MultiturnConfig(rollouts=1, prompts_per_rollout=2, group_size=2, turn_tokens=4)
    with pytest.raises(
        ValueError, match=r"_NaN.step returned the reward nan \(episode 0, turn 0\)"
    ):
        run_multiturn(policy, tok, ["Once upon a time"] * 2, _NaN(), cfg=cfg, ctx=_ctx(tmp_path))


class _Counting(rx.envs.Environment):
    """Turn `t` (from 0) is rewarded `t + 1`; the episode ends after two turns."""

    max_observation_tokens: int = eqx.field(static=True, default=1)

    def reset(self, key, prompt, prompt_mask):
        return jnp.zeros((), jnp.int32), jnp.zeros((1,), jnp.int32), jnp.zeros((1,), bool)

    def step(self, turns, completion, completion_mask):
        obs, mask = jnp.zeros((1,), jnp.int32), jnp.zeros((1,), bool)
        return turns + 1, obs, mask, (turns + 1).astype(jnp.float32), turns + 1 >= 2


@pytest.mark.parametrize(("episode_reward", "score"), [("sum", 3.0), ("last", 2.0)])
def test_the_episode_reward_is_the_sum_or_the_last_turn_s(episode_reward, score, tmp_path):
    policy, tok = pl.tools.load_model("builtin")
    cfg = MultiturnConfig(
        rollouts=1,
        prompts_per_rollout=2,
        group_size=2,
        turn_tokens=4,
        episode_reward=episode_reward,
    )
    res = run_multiturn(
        policy, tok, ["Once upon a time"] * 2, _Counting(), cfg=cfg, ctx=_ctx(tmp_path)
    )
    (record,) = [r for r in res.history if "rollout/turns" in r]
    assert record["rollout/turns"] == 2.0 and record["rollout/score"] == score, record


@pytest.mark.parametrize("stage", ["multiturn", "multiturn-dpo"])
def test_an_unknown_episode_reward_is_refused_naming_the_field(stage, capsys):
    assert main([stage, "--set", f"{stage}.episode_reward=mean", "--show-config"]) == 2
    assert f"{stage}.episode_reward='mean': must be one of sum, last" in capsys.readouterr().err


@pytest.mark.slow
def test_the_periodic_evaluation_of_a_user_environment_plays_its_episodes(env_module):
    """`ops.eval_every` with the user's environment scores its own held-out episodes
    (the built-in evaluation scores single-turn animal stories)."""
    argv = ["multiturn", "--out", "run", "--quiet", "--set", "ops.monitor=false"]
    argv += ["--set", "sft.steps=2", "--set", "eval_samples=1", "--set", "multiturn.rollouts=2"]
    argv += ["--set", "multiturn.prompts_per_rollout=2", "--set", "multiturn.group_size=2"]
    argv += ["--set", "multiturn.turn_tokens=6", "--set", "ops.eval_every=1"]
    argv += ["--set", f"multiturn.environment={env_module}:make"]
    assert main(argv) == 0
    with open("run/metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    (periodic,) = [r for r in records if r.get("eval") and r["stage"] == "multiturn"]
    assert periodic["iteration"] == 1 and "score" not in periodic, periodic
    # `Ask` rewards each turn's token count: two turns of at most 6 tokens
    assert 0.0 < periodic["mean_episode_reward"] <= 12.0 and periodic["base_nll"] > 0
