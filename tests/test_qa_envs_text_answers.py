"""A `TextEnvironment`'s `step_text` (and a `ToolEnvironment`'s `reward_fn`) answers are
checked as a `HostEnvironment`'s are: a `done` that is not a bool (the string `"False"`
ended the episode) or a reward that is not a real number (a string was read as its
number) is a `TypeError` naming the method and the value."""

import pytest

import rlhf_eqx as rx
from rlhf_eqx.envs import TextEnvironment, ToolEnvironment, calculator


class Answers(TextEnvironment):
    """Answers each turn with `(" Go on.", reward, done)` as given."""

    def __init__(self, reward, done):
        super().__init__(rx.data.ByteTokenizer(), max_observation_tokens=16)
        self.answer = (reward, done)

    def reset_text(self, prompt):
        return ""

    def step_text(self, completion):
        return (" Go on.", *self.answer)


def _step(env):
    tok = env.tokenizer
    env.reset([tok.bos_id, *tok.encode("Hi")])
    return env.step(tok.encode(" there"))


@pytest.mark.parametrize(
    "reward, done, message",
    [
        (1.0, "False", r"Answers.step_text returned done='False': it must be a bool"),
        (1.0, 1, r"Answers.step_text returned done=1: it must be a bool"),
        ("0.5", False, r"Answers.step_text returned the reward '0.5': it must be a real number"),
        (None, False, r"Answers.step_text returned the reward None: it must be a real number"),
        ([1.0], False, r"Answers.step_text returned the reward \[1.0\]: it must be a real"),
    ],
)
def test_bad_step_text_answers_are_named(reward, done, message):
    with pytest.raises(TypeError, match=message):
        _step(Answers(reward, done))


def test_good_step_text_answers_pass():
    obs, reward, done = _step(Answers(True, False))
    assert (reward, done) == (1.0, False) and rx.data.ByteTokenizer().decode(obs) == " Go on."
    assert _step(Answers(2, True)) == ([], 2.0, True)


@pytest.mark.parametrize("value", ["1", None])
def test_a_tool_environment_s_reward_fn_is_checked(value):
    env = ToolEnvironment({}, rx.data.ByteTokenizer(), reward_fn=lambda prompt, answer: value)
    with pytest.raises(TypeError, match=r"ToolEnvironment's reward_fn returned the reward"):
        _step(env)
    env = ToolEnvironment({}, rx.data.ByteTokenizer(), reward_fn=lambda prompt, answer: 0.25)
    assert _step(env) == ([], 0.25, True)


@pytest.mark.parametrize(
    "reward, done, message",
    [
        ([[1.0], [1.0, 2.0]], False, r"returned the reward \[\[1.0\], \[1.0, 2.0\]\]: it must"),
        (1.0, [[True], [True, False]], r"returned done=\[\[True\], \[True, False\]\]: it must"),
    ],
)
def test_a_ragged_reward_or_done_is_named(reward, done, message):
    """A ragged list (numpy cannot make an array of it) was numpy's bare `ValueError`."""
    with pytest.raises(TypeError, match=r"Answers.step_text " + message):
        _step(Answers(reward, done))


@pytest.mark.parametrize(
    "tools, settings, message",
    [
        ([calculator], {}, r"tools"),
        (calculator, {}, r"tools"),
        (None, dict(timeout="5"), r"timeout"),
        (None, dict(timeout=float("nan")), r"timeout must be a positive .*nan"),
        (None, dict(max_calls_per_turn=True), r"max_calls_per_turn must be a positive int"),
        (None, dict(response_prefix=None), r"response_prefix"),
        (None, dict(reward_fn=3), r"reward_fn"),
    ],
)
def test_tool_environment_settings_are_checked_when_built(tools, settings, message):
    """Each bad setting is refused when the environment is built, naming it. Without the
    runtime type checks of the test suite a list of tools was an AttributeError (`'list'
    object has no attribute 'items'`), a string timeout a bare comparison error, and a
    prefix of None or a reward_fn that is not callable were accepted until the first tool
    call or final answer; `max_calls_per_turn=True` was taken for 1 in either case."""
    tools = {"calculator": calculator} if tools is None else tools
    with pytest.raises((TypeError, ValueError), match=message):
        ToolEnvironment(tools, rx.data.ByteTokenizer(), **settings)
    ToolEnvironment({"calculator": calculator}, rx.data.ByteTokenizer(), timeout=2)
