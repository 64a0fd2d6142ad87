"""A user's jittable environment that fails: an exception raised inside its `reset` or
`step` names the method it came from (in the rollouts, `check_environment` and the
multi-turn stages' one-line refusal, where an environment's own `ValueError` is not taken
for the check's message), and an observation id outside the vocabulary names the call
that returned it (`reset`, or `step` after which turn)."""

import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import rlhf_eqx as rx
from rlhf_eqx.__main__ import main
from rlhf_eqx.envs import Environment, check_environment, rollout_multiturn, rollout_multiturn_host

CFG = rx.TransformerConfig(
    vocab_size=53, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=24, max_seq_len=32
)
KW = dict(max_turns=3, max_new_tokens=4, max_total_tokens=24, eos_id=3, num_samples=2)


class Ask(Environment):
    """Asks `[40, 41]` after every turn (and before the first); reward 1; done after 3."""

    max_observation_tokens: int = eqx.field(static=True, default=2)

    def reset(self, key, prompt, prompt_mask):
        return jnp.zeros((), jnp.int32), jnp.array([40, 41], jnp.int32), jnp.ones((2,), bool)

    def step(self, turns, completion, completion_mask):
        obs, mask = jnp.array([40, 41], jnp.int32), jnp.ones((2,), bool)
        return turns + 1, obs, mask, jnp.ones((), jnp.float32), turns + 1 >= 3


class StepRaises(Ask):
    def step(self, turns, completion, completion_mask):
        raise ValueError("the board has no square 9")


class ResetRaises(Ask):
    def reset(self, key, prompt, prompt_mask):
        raise KeyError("level")


class BadResetId(Ask):
    def reset(self, key, prompt, prompt_mask):
        state, obs, mask = super().reset(key, prompt, prompt_mask)
        return state, obs.at[1].set(99), mask


class BadStepId(Ask):
    def step(self, turns, completion, completion_mask):
        out = super().step(turns, completion, completion_mask)
        return out[0], jnp.where(turns >= 1, out[1] + 60, out[1]), *out[2:]


@pytest.fixture(scope="module")
def policy():
    return rx.Policy(CFG, key=jax.random.key(0))


def _prompts():
    toks = jnp.array([[0, 7, 8, 9], [10, 11, 12, 13]], jnp.int32)
    return toks, toks != 0


@pytest.mark.parametrize("rollout", [rollout_multiturn, rollout_multiturn_host])
@pytest.mark.parametrize(
    "env, error, method",
    [(StepRaises(), ValueError, "StepRaises.step"), (ResetRaises(), KeyError, "ResetRaises.reset")],
)
def test_an_exception_inside_reset_or_step_names_the_method(policy, rollout, env, error, method):
    with pytest.raises(error) as info:
        rollout(policy, env, *_prompts(), jax.random.key(1), **KW)
    assert f"raised by {method} while it was traced" in "\n".join(info.value.__notes__)
    with pytest.raises(error) as info:
        check_environment(env, prompt_length=4, max_new_tokens=4)
    assert f"raised by {method} while it was traced" in "\n".join(info.value.__notes__)


@pytest.mark.parametrize("rollout", [rollout_multiturn, rollout_multiturn_host])
def test_an_observation_id_outside_the_vocabulary_names_the_call(policy, rollout):
    with pytest.raises(ValueError, match=r"id 99 \(episode 0, position 5, from BadResetId.reset\)"):
        rollout(policy, BadResetId(), *_prompts(), jax.random.key(1), **KW)
    step = r"id 10\d \(episode \d, position \d+, from BadStepId.step after turn 1\), outside"
    with pytest.raises(ValueError, match=step):
        rollout(policy, BadStepId(), *_prompts(), jax.random.key(1), **KW)


MODULE = textwrap.dedent(
    """
    import jax.numpy as jnp
    import rlhf_eqx as rx


    class Own(rx.envs.Environment):
        max_observation_tokens: int = 1

        def reset(self, key, prompt, prompt_mask):
            return jnp.zeros((), jnp.int32), jnp.zeros((1,), jnp.int32), jnp.zeros((1,), bool)

        def step(self, state, completion, completion_mask):
            raise ValueError("the board has no square 9")


    def make(tok):
        return Own()


    def make_class(tok):
        return Own
    """
)


def _refused(stage, spec, tmp_path, monkeypatch, capsys) -> str:
    (tmp_path / "own_env_module.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        argv = [stage, "--out", "run", "--quiet", "--show-config"]
        assert main([*argv, "--set", f"{stage}.environment=own_env_module:{spec}"]) == 2
    finally:
        sys.modules.pop("own_env_module", None)
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    return err


@pytest.mark.parametrize("stage", ["multiturn", "multiturn-dpo"])
def test_the_stage_names_the_method_that_raised(stage, tmp_path, monkeypatch, capsys):
    """An environment's own `ValueError` is not the check's message: the one-line refusal
    says tracing raised it and names the method."""
    err = _refused(stage, "make", tmp_path, monkeypatch, capsys)
    assert (
        "tracing its reset and step raised ValueError: the board has no square 9 (in Own.step)"
    ) in err


def test_a_factory_that_returns_the_class_is_named(tmp_path, monkeypatch, capsys):
    """It said `the factory returned _ModuleMeta` (the class's metaclass)."""
    err = _refused("multiturn", "make_class", tmp_path, monkeypatch, capsys)
    assert "the factory returned the class Own, not an rlhf_eqx.envs.Environment (return an" in err


def _episodes(turn_rewards, num_turns):
    """One rollout's trajectory of 3 episodes of 6 tokens (policy tokens from position 2)."""
    E, T = turn_rewards.shape[0], 6
    zeros = jnp.zeros((E, T), jnp.int32)
    return rx.envs.Trajectory(
        tokens=zeros + 5,
        mask=zeros == 0,
        loss_mask=jnp.broadcast_to(jnp.arange(T) >= 2, (E, T)),
        logprobs=jnp.zeros((E, T)),
        turn_ids=zeros,
        turn_rewards=turn_rewards,
        reward=jnp.nansum(turn_rewards, -1),
        num_turns=num_turns,
        truncated=jnp.zeros((E,), bool),
    )


def test_check_trajectory_refuses_a_vmapped_trajectory_and_checks_its_members():
    """A `[M, E, T]` trajectory (a vmapped rollout's) is refused naming the shapes, not
    read with its axes mixed up (a NaN reward went unseen); each member is checked."""
    rewards = jnp.ones((2, 3, 3)).at[1, 0, 2].set(jnp.nan)
    turns = jnp.asarray([[3, 3, 1], [3, 3, 1]], jnp.int32)
    traj = jax.vmap(_episodes)(rewards, turns)  # as a vmapped rollout returns it
    with pytest.raises(ValueError, match=r"one rollout's episodes .* tokens \(2, 3, 6\)"):
        rx.envs.check_trajectory(traj, environment="Ask", vocab_size=53)
    member = lambda m: jax.tree.map(lambda x: x[m], traj)  # noqa: E731
    rx.envs.check_trajectory(member(0), environment="Ask", vocab_size=53)
    with pytest.raises(ValueError, match=r"Ask.step returned the reward nan \(episode 0, turn 2\)"):
        rx.envs.check_trajectory(member(1), environment="Ask", vocab_size=53)


class GymStyle(rx.envs.HostEnvironment):
    """`reset` answers `(observation, info)` as a gym environment does; `step` answers
    with a ragged observation."""

    max_observation_tokens = 4

    def reset(self, prompt):
        return [40, 41], {}

    def step(self, completion):
        return [[40, 41], [42]], 0.0, False


class RaggedStep(GymStyle):
    def reset(self, prompt):
        return [40]


@pytest.mark.parametrize(
    "env, where",
    [(GymStyle, r"GymStyle.reset of episode 0"), (RaggedStep, r"RaggedStep.step of episode 0 at")],
)
def test_a_nested_host_observation_is_named(policy, env, where):
    """A nested or ragged observation (a gym-style `(observation, info)`) was a bare numpy
    error from building an array of it; it is refused naming the call."""
    with pytest.raises(TypeError, match=where + r".* not a list of int ids: \(?\["):
        rollout_multiturn_host(policy, env, *_prompts(), jax.random.key(1), **KW)
