"""A built-in two-turn environment for the animal task (`rlhf_eqx.pipelines`).

Turn 1: the policy writes a paragraph after the prompt (ended by EOS, BOS — llama2.c
models start the next story with it — or a newline). The environment then asks for an
animal drawn from the episode's key: "Now tell me about the cat." (plus a newline).
Turn 2: the policy's paragraph scores 1 if it names that animal (a whole word, any case,
plural forms included), else 0; the episode ends.
"""

import re
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Float32, Int, PRNGKeyArray

from ..data import Tokenizer, decode_continuation
from ._animal_words import ANIMALS, animal_word_forms as _forms
from ._environment import Environment
from ._text import TokenText, word_table
from ._trajectory import Trajectory


def _task_words(animals: Sequence[str] | None) -> tuple[tuple[str, ...], list[list[str]]]:
    """The animals (default: the animal task's) and the word forms of each."""
    names = tuple(ANIMALS if animals is None else animals)
    if not names or not all(isinstance(a, str) and a.strip() for a in names):
        raise ValueError(f"animals must be a non-empty sequence of words, got {animals!r}")
    return names, [list(_forms(a)) for a in names]


def animal_followup_score(text: str, animal: str) -> float:
    """Host-side scorer of the second turn: 1.0 if `text` names `animal` (or one of its
    plural forms, as the animal task counts them) as a whole word in any case, else 0.0.

    The same rule as `AnimalFollowUpEnv`'s in-graph reward, on decoded text with a
    regular expression — for evaluation and for checking the environment.
    """
    _, (forms,) = _task_words([animal])
    pattern = r"\b(?:" + "|".join(re.escape(f) for f in sorted(forms, key=len)[::-1]) + r")\b"
    return 1.0 if re.search(pattern, text, flags=re.IGNORECASE) else 0.0


def _newline_id(tokenizer: Tokenizer) -> int | None:
    """The id whose text is a lone newline, if the vocabulary has one."""
    anchor = tokenizer.encode("a")
    for i in tokenizer.encode("a\n")[len(anchor) :][-1:]:
        if decode_continuation(tokenizer, anchor, [i]) == "\n":
            return int(i)
    return None


class _AnimalState(eqx.Module):
    animal: Int[Array, ""]
    turn: Int[Array, ""]


class AnimalFollowUpEnv(Environment):
    """Two turns: a paragraph, then a follow-up about an animal the environment names.

    **Arguments** (host side, once):

    - `tokenizer`: the policy's tokenizer (e.g. `tok512.bin` of stories260K).
    - `animals`: the animals to ask about (default: the animal task's
      `rlhf_eqx.pipelines.ANIMALS`).
    - `question`: the observation's text, with `{animal}`.

    Fields used by the rollout and the caller:

    - `stop_ids`: the ids that end a policy turn — pass them as `eos_id` to
      `rollout_multiturn`: EOS and the model's end-of-turn ids (the tokenizer's
      `stop_ids`), BOS and the newline id (when the vocabulary has one).
    - `max_observation_tokens`: the longest question, in tokens.
    - `animals`: the animal of each index (the state's `animal`); `question` the template.
    - `host_rewards(trajectory, tokenizer)`: the same rewards recomputed from decoded
      text with a regular expression (`animal_followup_score`), for evaluation.

    State: `(animal, turn)`; `reset` draws `animal` uniformly from the key and gives no
    observation; `step` on turn 0 returns the question (reward 0), on turn 1 the reward
    `mentions(completion, animal)` and `done`.
    """

    questions: Int[Array, "A O"]
    question_masks: Bool[Array, "A O"]
    text: TokenText
    forms: Int[Array, "A F W"]
    form_lengths: Int[Array, "A F"]
    animals: tuple[str, ...] = eqx.field(static=True)
    question: str = eqx.field(static=True)
    stop_ids: tuple[int, ...] = eqx.field(static=True)
    max_observation_tokens: int = eqx.field(static=True)

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        animals: Sequence[str] | None = None,
        question: str = "Now tell me about the {animal}.",
    ):
        if "{animal}" not in question:
            raise ValueError(f"question must contain '{{animal}}', got {question!r}")
        names, forms = _task_words(animals)
        newline = _newline_id(tokenizer)
        tail = [] if newline is None else [newline]
        encoded = [list(tokenizer.encode(question.format(animal=a))) + tail for a in names]
        width = max(len(q) for q in encoded)
        questions = np.full((len(names), width), tokenizer.pad_id, np.int32)
        masks = np.zeros((len(names), width), bool)
        for a, q in enumerate(encoded):
            questions[a, : len(q)] = q
            masks[a, : len(q)] = True
        table, lengths = word_table(forms)
        self.questions = jnp.asarray(questions)
        self.question_masks = jnp.asarray(masks)
        self.text = TokenText.from_tokenizer(tokenizer)
        self.forms = jnp.asarray(table)
        self.form_lengths = jnp.asarray(lengths)
        self.animals = names
        self.question = question
        ends = getattr(tokenizer, "stop_ids", None) or (tokenizer.eos_id,)
        stops = [*ends, tokenizer.bos_id] + tail
        self.stop_ids = tuple(dict.fromkeys(int(i) for i in stops))
        self.max_observation_tokens = width

    def host_rewards(
        self, trajectory: Trajectory, tokenizer: Tokenizer
    ) -> Float32[np.ndarray, " E"]:
        """The second-turn rewards recomputed on the host from decoded text (for evaluation
        and checks): per episode, the animal is read back from the question between the
        two turns and the second turn is scored with `animal_followup_score`; 0 for an
        episode without a second turn.

        **Returns:** `float32[E]`.
        """
        head, tail = (re.escape(part) for part in self.question.split("{animal}", 1))
        asked = re.compile(head + r"\s*(.+?)\s*" + tail)
        out = np.zeros(trajectory.tokens.shape[0], np.float32)
        for e, (tokens, mask, turns) in enumerate(
            zip(*(np.asarray(x) for x in (trajectory.tokens, trajectory.mask, trajectory.turn_ids)))
        ):
            first, second = np.flatnonzero(turns == 0), np.flatnonzero(turns == 1)
            if not (first.size and second.size):
                continue
            between = np.arange(first[-1] + 1, second[0])
            found = asked.search(tokenizer.decode(tokens[between[mask[between]]].tolist()))
            if found:
                out[e] = animal_followup_score(tokenizer.decode(tokens[second].tolist()), found[1])
        return out

    def mentions(
        self, ids: Int[Array, " C"], mask: Bool[Array, " C"], animal: Int[Array, ""]
    ) -> Bool[Array, ""]:
        """Whether the text of `ids` (where `mask`) names animal number `animal`."""
        return self.text.contains(ids, mask, self.forms[animal], self.form_lengths[animal])

    def reset(
        self, key: PRNGKeyArray, prompt: Int[Array, " P"], prompt_mask: Bool[Array, " P"]
    ) -> tuple[_AnimalState, Int[Array, " O"], Bool[Array, " O"]]:
        del prompt, prompt_mask
        animal = jax.random.randint(key, (), 0, len(self.animals), dtype=jnp.int32)
        width = self.max_observation_tokens
        state = _AnimalState(animal=animal, turn=jnp.zeros((), jnp.int32))
        return state, jnp.zeros((width,), jnp.int32), jnp.zeros((width,), jnp.bool_)

    def step(
        self, state: _AnimalState, completion: Int[Array, " C"], completion_mask: Bool[Array, " C"]
    ) -> tuple[
        _AnimalState, Int[Array, " O"], Bool[Array, " O"], Float[Array, ""], Bool[Array, ""]
    ]:
        first = state.turn == 0
        hit = self.mentions(completion, completion_mask, state.animal)
        obs = jnp.where(first, self.questions[state.animal], 0)
        obs_mask = first & self.question_masks[state.animal]
        reward = jnp.where(first, 0.0, hit.astype(jnp.float32))
        return _AnimalState(animal=state.animal, turn=state.turn + 1), obs, obs_mask, reward, ~first
