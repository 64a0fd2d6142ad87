"""`TextEnvironment` (and `ToolEnvironment`) observations are encoded as continuations:
their ids decode after the previous turn to exactly the observation's text, with a
SentencePiece vocabulary (the shipped llama2.c tokenizer, which puts a space before a
text of its own) as with byte-level ones."""

import pytest
from helpers import train_byte_bpe

import rlhf_eqx as rx
from rlhf_eqx.assets import asset_path
from rlhf_eqx.data import decode_continuation
from rlhf_eqx.envs import TextEnvironment, ToolEnvironment, calculator

REPLIES = ["Now tell me.", " And then?", "\nQ: why?\n", "x", "é ok", "<tool_response>14"]
WORDS = ["once", "upon", "a", "time", "the", "dog", "ran", "and", "then", "now", "tell", "me"]


class Replies(TextEnvironment):
    """Answers `reset` and each turn with the next of `replies`."""

    def __init__(self, tokenizer, replies):
        super().__init__(tokenizer, max_observation_tokens=64)
        self.replies = list(replies)
        self.turns: list[str] = []

    def reset_text(self, prompt):
        return self.replies.pop(0)

    def step_text(self, completion):
        self.turns.append(completion)
        return self.replies.pop(0), 0.0, False


def _byte_bpe(tmp_path):
    train_byte_bpe(tmp_path, WORDS)
    return rx.data.load_tokenizer(tmp_path)


@pytest.fixture(params=["llama2c", "bytes", "byte-bpe"])
def tok(request, tmp_path):
    if request.param == "llama2c":
        return rx.data.Llama2cTokenizer.from_file(asset_path("tok512.bin"))
    if request.param == "bytes":
        return rx.data.ByteTokenizer()
    return _byte_bpe(tmp_path)


@pytest.mark.parametrize("turn", [" the dog ran.", "ran", "\n"])
def test_observations_decode_to_their_text_after_the_turn_before(tok, turn):
    prompt = [tok.bos_id, *tok.encode("Once upon a time")]
    for i in range(len(REPLIES) - 1):
        replies = REPLIES[i:] + REPLIES[:i]
        env = Replies(tok, replies)
        context = list(prompt)
        obs = env.reset(prompt)
        assert decode_continuation(tok, context, obs) == replies[0]
        text = tok.decode(prompt)
        for k in range(1, 3):
            context += obs
            text += replies[k - 1]
            completion = list(tok.encode(turn))[-3:] or [tok.eos_id]
            obs, _, _ = env.step(completion)
            assert env.turns[-1] == decode_continuation(tok, context, completion)
            text += env.turns[-1]
            context += completion
            assert decode_continuation(tok, context, obs) == replies[k], (replies[k], obs)
            assert tok.decode(context + obs) == text + replies[k]


def test_tool_responses_follow_the_turn_without_a_space(tok):
    env = ToolEnvironment({"calculator": calculator}, tok, max_observation_tokens=64)
    prompt = [tok.bos_id, *tok.encode("What is 2+3*4?")]
    env.reset(prompt)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3*4"}}</tool_call>'
    turn = list(tok.encode(call))
    obs, reward, done = env.step(turn)
    assert (reward, done) == (0.0, False)
    assert decode_continuation(tok, prompt + turn, obs) == "<tool_response>14</tool_response>"


def test_an_observation_that_is_not_text_is_named():
    tok = rx.data.ByteTokenizer()

    class Numbers(Replies):
        def step_text(self, completion):
            return 14, 0.0, False

    env = Numbers(tok, [7])
    with pytest.raises(TypeError, match=r"Numbers.reset_text must return the observation's text"):
        env.reset([tok.bos_id])
    env = Numbers(tok, [""])
    env.reset([tok.bos_id])
    with pytest.raises(TypeError, match=r"Numbers.step_text must return \(observation text, "):
        env.step(tok.encode("hi"))
