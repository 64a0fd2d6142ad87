"""A `TextEnvironment`'s `step_text` (and a `ToolEnvironment`'s `reward_fn`) answers are
checked as a `HostEnvironment`'s are: a `done` that is not a bool (the string `"False"`
ended the episode) or a reward that is not a real number (a string was read as its
number) is a `TypeError` naming the method and the value."""

import pytest

import rlhf_eqx as rx
from rlhf_eqx.envs import TextEnvironment, ToolEnvironment


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
