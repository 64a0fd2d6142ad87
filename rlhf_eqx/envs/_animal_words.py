"""The animal task's words: each animal with its plural forms (irregular ones included),
shared by the task's scorer (`rlhf_eqx.pipelines`) and the follow-up environment."""

ANIMALS: tuple[str, ...] = (
    "cat",
    "dog",
    "bird",
    "fish",
    "bunny",
    "rabbit",
    "bear",
    "lion",
    "frog",
    "duck",
    "horse",
    "cow",
    "pig",
    "mouse",
    "monkey",
    "elephant",
    "owl",
    "puppy",
    "kitten",
    "fox",
)
"""The animal task's words (the scorer also counts their plural forms,
`animal_word_forms`)."""
_IRREGULAR = {
    "mouse": ("mice",),
    "puppy": ("puppies",),
    "bunny": ("bunnies",),
    "fox": ("foxes",),
    "fish": ("fishes",),
}


def animal_word_forms(word: str) -> tuple[str, ...]:
    """`word` and its plural forms, as the animal task's scorer counts them: the regular
    `word + "s"` and the irregular ones (`"mouse"` gives `("mouse", "mouses", "mice")`).

    **Arguments:** `word`, an animal of `ANIMALS` (or any word).

    **Returns:** the forms, `word` first.
    """
    return (word, word + "s") + _IRREGULAR.get(word, ())
