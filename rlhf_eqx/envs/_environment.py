"""What a multi-turn rollout talks to: jittable environments and host environments.

Two kinds, one rollout contract (`rollout_multiturn`, `rollout_multiturn_host`):

| kind | runs | state | API |
| --- | --- | --- | --- |
| `Environment` | inside the compiled rollout (jit + vmap) | a pytree it returns | `reset(key, prompt, prompt_mask)`, `step(state, completion, completion_mask)` |
| `HostEnvironment` | in Python, between compiled policy turns | the object itself (one per episode) | `reset(prompt_ids)`, `step(completion_ids)` |
| `TextEnvironment` | as `HostEnvironment`, on decoded text | the object itself | `reset_text(prompt)`, `step_text(completion)` |

An episode is `prompt ++ observation_0 ++ turn_1 ++ observation_1 ++ turn_2 ++ ...`:
`reset` gives the first observation (often empty), each `step` sees one policy turn and
answers with the next observation, the turn's reward and whether the episode is over.
Observations are token ids padded to the environment's static
`max_observation_tokens` with a mask of the real ones.
"""  # noqa: E501 (markdown table rows cannot be wrapped)

import abc
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray, PyTree

from ..data import Tokenizer, decode_continuation


class Environment(eqx.Module):
    """A jittable, vmappable environment: pure functions of its state, fixed shapes.

    Subclass it (an `eqx.Module`: its arrays are fields, its settings static fields) and
    implement `reset` and `step` for **one** episode; `rollout_multiturn` vmaps them over
    the episodes of a batch and runs them inside its compiled turn loop, so they must be
    traceable: no Python branching on array values (use `jnp.where` / `lax.cond`), no
    host calls. The state is any pytree whose structure, shapes and dtypes `step` keeps.
    Randomness comes from `reset`'s key (keep a key in the state if `step` needs one).
    Python code in `reset` / `step` (a `print`, a counter, a list append) runs when they
    are traced — by the rollout's checks, then once per compile — not once per episode
    or turn: a side effect per turn needs `jax.debug.callback`, or a `HostEnvironment`.

    Rewards: each `step` returns the reward of the turn it saw. The rollout returns these
    per-turn rewards and an episode reward, their sum or the last turn's (for an
    environment that scores only at the end, give 0 before the last turn).

    A minimal example, an environment that asks for three turns and rewards each turn's
    length:

    ```python
    class Count(rlhf_eqx.envs.Environment):
        max_observation_tokens: int = eqx.field(static=True, default=1)

        def reset(self, key, prompt, prompt_mask):
            return jnp.zeros((), jnp.int32), jnp.zeros((1,), jnp.int32), jnp.zeros((1,), bool)

        def step(self, state, completion, completion_mask):
            obs, obs_mask = jnp.full((1,), 7, jnp.int32), jnp.ones((1,), bool)
            reward = jnp.sum(completion_mask).astype(jnp.float32)
            return state + 1, obs, obs_mask, reward, state + 1 >= 3
    ```

    Attributes every environment has:

    - `max_observation_tokens` (required): the static length its observations are padded
      to.
    - `stop_ids` (optional, default `()`): the token ids that end a policy turn, for
      environments whose turns end at their own markers (a chat format's end-of-turn
      token, a newline). The rollouts of the pipelines (`run_multiturn`, the
      `multiturn-dpo` stage) pass them to the sampler as `eos_id`; with `()` a turn ends
      at the tokenizer's `stop_ids` (its EOS and its model's end-of-turn ids). Override
      it with a static field
      (`stop_ids: tuple[int, ...] = eqx.field(static=True, default=(...))`, anywhere
      among the subclass's fields: it takes its place in their order), one set in
      `__init__` as `AnimalFollowUpEnv` does, or a class attribute (`stop_ids = (...)`).
    """

    max_observation_tokens: eqx.AbstractVar[int]
    # a plain class attribute, not an annotated `ClassVar`: a dataclass would place a
    # subclass's `stop_ids` field (with its default) first, before its fields without one
    stop_ids = ()  # tuple[int, ...]

    @abc.abstractmethod
    def reset(
        self, key: PRNGKeyArray, prompt: Int[Array, " P"], prompt_mask: Bool[Array, " P"]
    ) -> tuple[PyTree, Int[Array, " O"], Bool[Array, " O"]]:
        """Start an episode.

        **Arguments:**

        - `key`: this episode's PRNG key.
        - `prompt`, `prompt_mask`: the episode's prompt ids (possibly padded) and real-token
          mask.

        **Returns:** `(state, observation, observation_mask)`: the initial state, and the
        ids (`[max_observation_tokens]`, padded) and mask of an observation appended
        after the prompt before the policy's first turn (all-false mask for none).
        """
        raise NotImplementedError

    @abc.abstractmethod
    def step(
        self, state: PyTree, completion: Int[Array, " C"], completion_mask: Bool[Array, " C"]
    ) -> tuple[PyTree, Int[Array, " O"], Bool[Array, " O"], Float[Array, ""], Bool[Array, ""]]:
        """Answer one policy turn.

        **Arguments:**

        - `state`: the state `reset` or the previous `step` returned.
        - `completion`, `completion_mask`: the turn's sampled ids (`[max_new_tokens]`,
          left-aligned, including the stop token if one was sampled) and their mask.

        **Returns:** `(state, observation, observation_mask, reward, done)`: the new
        state, the observation to append (ignored when `done`), the turn's reward (a
        float scalar) and whether the episode is over (a bool scalar).
        """
        raise NotImplementedError


def _reward_and_done(reward: object, done: object, where: str) -> tuple[float, bool]:
    """A host environment's `reward` as a float and `done` as a bool; a `TypeError` naming
    `where` they came from for a reward that is not a real number (a string, `None`, an
    array of several values) or a `done` that is not a bool (a string, a number)."""
    value = None
    if not isinstance(reward, str | bytes) and _scalar(reward) and np.isrealobj(reward):
        try:
            value = float(reward)
        except (TypeError, ValueError):
            pass
    if value is None:
        raise TypeError(f"{where} returned the reward {reward!r}: it must be a real number")
    if not (_scalar(done) and np.asarray(done).dtype == np.bool_):
        raise TypeError(f"{where} returned done={done!r}: it must be a bool")
    return value, bool(done)


def _scalar(x: object) -> bool:
    """Whether `x` is one value (`np.ndim(x) == 0`; a ragged list, which numpy cannot
    make an array of, is not)."""
    try:
        return np.ndim(x) == 0
    except ValueError:
        return False


class HostEnvironment(abc.ABC):
    """An environment in plain Python, one object per episode, run on the host.

    `rollout_multiturn_host` creates one per episode (from a factory), calls `reset` with
    the episode's prompt ids, then, after each policy turn (one compiled call for the
    whole batch), `step` with the turn's ids. Anything Python can do is allowed: tools,
    interpreters, network-free simulators, regular expressions on decoded text.

    - `max_observation_tokens`: the longest observation (in tokens) it returns; the
      rollout pads observations to it (one compile) and raises a `ValueError` for a
      longer one.
    - `reset(prompt) -> observation`: `prompt` the real prompt ids (a list of ints);
      returns the ids appended before the first turn (`[]` for none).
    - `step(completion) -> (observation, reward, done)`: `completion` the turn's ids
      (stop token included when sampled); `observation` the ids appended before the next
      turn (ignored when `done`), `reward` a float.
    """

    max_observation_tokens: int

    @abc.abstractmethod
    def reset(self, prompt: Sequence[int]) -> Sequence[int]:
        """Start the episode; return the first observation's ids."""
        raise NotImplementedError

    @abc.abstractmethod
    def step(self, completion: Sequence[int]) -> tuple[Sequence[int], float, bool]:
        """Answer one turn: `(observation ids, reward, done)`."""
        raise NotImplementedError


_ANCHORS = ("\n", ".", "a", " ")
"""Texts an observation is encoded after, then cut off (`_encode_after`): with a
SentencePiece vocabulary the anchor takes the dummy-prefix space that `encode` puts
before a text."""
_TAIL = 16
"""Context tokens an observation's ids are decoded after to check them."""


def _encode_after(tokenizer: Tokenizer, context: list[int], text: str) -> list[int]:
    """Ids of `text` that decode to exactly `text` after the ids `context`
    (`decode_continuation`): `tokenizer.encode(text)` when it does (a byte-level
    vocabulary, or a context that ends in BOS), else the ids after an anchor's in
    `encode(anchor + text)` (a SentencePiece vocabulary, whose `encode` starts a text
    with a space), the first anchor whose ids split cleanly and decode back; `encode(text)`
    when none does."""
    plain = list(tokenizer.encode(text))
    tail = context[-_TAIL:]
    if not tail or decode_continuation(tokenizer, tail, plain) == text:
        return plain
    for anchor in _ANCHORS:
        head, ids = list(tokenizer.encode(anchor)), list(tokenizer.encode(anchor + text))
        rest = ids[len(head) :]
        if ids[: len(head)] == head and decode_continuation(tokenizer, tail, rest) == text:
            return rest
    return plain


class TextEnvironment(HostEnvironment):
    """A `HostEnvironment` that speaks text: subclasses implement `reset_text` and
    `step_text`; this class decodes the policy's ids and encodes the observations.

    Each turn is decoded as the continuation of everything before it
    (`rlhf_eqx.data.decode_continuation`), so a leading space is kept; BOS/EOS/padding
    ids are dropped from the text. An observation is encoded as the continuation of the
    episode so far (no BOS/EOS added): its ids decode after the previous turn to exactly
    its text — with a SentencePiece vocabulary (llama2.c, Llama 2, Gemma) without the
    space that `tokenizer.encode` puts before a text of its own.

    **Arguments:**

    - `tokenizer`: any `rlhf_eqx.data.Tokenizer`.
    - `max_observation_tokens`: the longest observation it may return, in tokens.
    """

    tokenizer: Any

    def __init__(self, tokenizer: Tokenizer, *, max_observation_tokens: int):
        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(
                "tokenizer must meet rlhf_eqx.data.Tokenizer (encode, decode, bos_id, "
                f"eos_id, pad_id, vocab_size), got {type(tokenizer).__name__}"
            )
        if not (isinstance(max_observation_tokens, int) and max_observation_tokens > 0):
            raise ValueError(
                f"max_observation_tokens must be a positive int, got {max_observation_tokens!r}"
            )
        self.tokenizer = tokenizer
        self.max_observation_tokens = max_observation_tokens
        self._context: list[int] = []

    @abc.abstractmethod
    def reset_text(self, prompt: str) -> str:
        """Start the episode from the prompt's text; return the first observation's text."""
        raise NotImplementedError

    @abc.abstractmethod
    def step_text(self, completion: str) -> tuple[str, float, bool]:
        """Answer one turn's text: `(observation text, reward, done)`, the reward a real
        number and `done` a bool (checked: anything else is a `TypeError` naming this
        method)."""
        raise NotImplementedError

    def encode_observation(self, text: str) -> list[int]:
        """The ids of an observation's text (`[]` for the empty string), encoded as the
        continuation of the episode so far (the prompt, or the turn `step_text` is
        answering): `decode_continuation(tokenizer, context, ids) == text`."""
        return _encode_after(self.tokenizer, self._context, text) if text else []

    def reset(self, prompt: Sequence[int]) -> list[int]:
        prompt = [int(i) for i in prompt]
        self._context = prompt
        text = self.reset_text(self.tokenizer.decode(prompt))
        if not isinstance(text, str):
            raise TypeError(
                f"{type(self).__name__}.reset_text must return the observation's text (a "
                f"str, '' for none), got {type(text).__name__}: {text!r}"
            )
        observation = self.encode_observation(text)
        self._context = prompt + observation
        return observation

    def step(self, completion: Sequence[int]) -> tuple[list[int], float, bool]:
        completion = [int(i) for i in completion]
        text = decode_continuation(self.tokenizer, self._context, completion)
        self._context = self._context + completion
        out = self.step_text(text)
        if not (isinstance(out, tuple | list) and len(out) == 3 and isinstance(out[0], str)):
            raise TypeError(
                f"{type(self).__name__}.step_text must return (observation text, reward, "
                f"done) with the text a str ('' for none), got {out!r}"
            )
        obs_text, reward, done = out
        reward, done = _reward_and_done(reward, done, f"{type(self).__name__}.step_text")
        observation = [] if done else self.encode_observation(obs_text)
        self._context = self._context + observation
        return observation, reward, done
