"""The animal task's words: each animal with its plural forms (irregular ones included),
shared by the task's scorer (`rlhf_eqx.pipelines`) and the follow-up environment."""

# The scorer's words: each with its plural forms (irregular ones included).
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
_IRREGULAR = {
    "mouse": ("mice",),
    "puppy": ("puppies",),
    "bunny": ("bunnies",),
    "fox": ("foxes",),
    "fish": ("fishes",),
}


def word_forms(word: str) -> tuple[str, ...]:
    """`word` and its plural forms, as the scorer counts them."""
    return (word, word + "s") + _IRREGULAR.get(word, ())
