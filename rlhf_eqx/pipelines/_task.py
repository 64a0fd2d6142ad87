"""The built-in task: make stories260K write stories in which an animal appears.

The scorer is a rule on the completion text. It is the verifiable reward of GRPO only;
the reward model, SFT and DPO see it only through noisy preference labels
(`noisy_scores`), as they would see human labels.
"""

import itertools
import re
from collections.abc import Sequence

import numpy as np

from ..envs import ANIMALS as ANIMALS, animal_word_forms as _forms

_PATTERN = re.compile(
    r"\b(?:"
    + "|".join(sorted({f for w in ANIMALS for f in _forms(w)}, key=len, reverse=True))
    + r")\b",
    flags=re.IGNORECASE,
)


def animal_score(text: str) -> float:
    """1.0 if `text` contains an animal of `ANIMALS` (or its plural) as a whole word, in
    any case; else 0.0. "A doghouse" and "catalog" score 0; "Mice!" scores 1."""
    return 1.0 if _PATTERN.search(text) else 0.0


def noisy_scores(scores: Sequence[float], *, noise: float, seed: int) -> list[float]:
    """Binary labels `scores` with each one flipped with probability `noise` (seeded):
    the labels a careless human rater would give."""
    rng = np.random.default_rng(seed)
    flips = rng.random(len(scores)) < noise
    return [float(1.0 - s) if f else float(s) for s, f in zip(scores, flips)]


def _prompts(openings: list[str], templates: list[str], names: list[str]) -> tuple[str, ...]:
    """The openings, then every template filled with every name."""
    return tuple(openings) + tuple(t.format(n) for t, n in itertools.product(templates, names))


# Story openings. Training and held-out prompts share no opening and no name.
_TRAIN_OPENINGS = [
    "Once upon a time, there was a",
    "Once upon a time, in a big forest, there lived a",
    "One day, a little",
    "The sun was shining and",
    "It was a rainy day, so",
    "In the park, there was a",
    "There was a big tree in the garden. Under the tree,",
    "The old man had a small house. In the house, there was a",
    "Once upon a time, a happy",
    "The sky was blue and",
]
_TRAIN_NAMES = ["Lily", "Tim", "Ben", "Mia", "Tom", "Anna", "Max", "Sue"]
_TRAIN_TEMPLATES = [
    "Once upon a time, there was a little girl named {}. She",
    "One day, {} went to the",
    "{} liked to play with",
    "{} was very sad because",
    "{} found a box. Inside the box, there was a",
    "{} looked out of the window and saw a",
]
TRAIN_PROMPTS: tuple[str, ...] = _prompts(_TRAIN_OPENINGS, _TRAIN_TEMPLATES, _TRAIN_NAMES)

_HELDOUT_OPENINGS = [
    "Once upon a time, there was a little",
    "Once upon a time, in a small town, there was a",
    "The girl had a pretty",
    "In the morning, the boy saw a",
]
_HELDOUT_NAMES = ["Sara", "Jack", "Zoe", "Leo", "Kim"]
_HELDOUT_TEMPLATES = [
    "One morning, {} and her mom went to the",
    "{} was walking home when she saw a",
    "{} had a new toy. It was a",
    "{} and his sister went to the",
]
HELDOUT_PROMPTS: tuple[str, ...] = _prompts(_HELDOUT_OPENINGS, _HELDOUT_TEMPLATES, _HELDOUT_NAMES)
