"""Final answers of maths problems, and an exact-match reward on them.

Numbers are compared in a normal form: thousands separators removed, a zero fraction
dropped (`"1,000.00"` → `"1000"`), other decimals written without trailing zeros
(`"2.50"` → `"2.5"`), `"-0"` → `"0"`.
"""

import re
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation

import numpy as np
from jaxtyping import Float

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"
_GSM8K_ANSWER = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_ANY_NUMBER = re.compile(_NUMBER)


def normalise_number(text: str) -> str | None:
    """The normal form of a number written in `text` (`None` if it is not a number)."""
    s = text.strip().replace(",", "").lstrip("$")
    try:
        value = Decimal(s)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def extract_gsm8k_answer(text: str) -> str | None:
    """The final answer of a GSM8K solution, written after its last `"#### "`.

    Commas are stripped and the number normalised, so `"... #### 1,000"` gives
    `"1000"`. `None` when there is no `####` followed by a number.

    Reference: K. Cobbe et al., "Training Verifiers to Solve Math Word Problems"
    (GSM8K), 2021.
    """
    matches = _GSM8K_ANSWER.findall(text)
    if not matches:
        return None
    return normalise_number(matches[-1])


def extract_last_number(text: str) -> str | None:
    """The last number in `text` (a model's completion), normalised; `None` if none."""
    matches = _ANY_NUMBER.findall(text)
    if not matches:
        return None
    return normalise_number(matches[-1].rstrip(","))


def exact_match_reward(
    completions: Sequence[str], answers: Sequence[str]
) -> Float[np.ndarray, " N"]:
    """1.0 where a completion's answer equals the reference answer, else 0.0 (float32).

    A completion's answer is the number after its last `"####"` when it has one, else
    its last number; both sides are normalised (`normalise_number`) before comparison.
    A reference that is a whole GSM8K solution (`"... #### 18"`, as a file of `prompt`
    and `answer` columns may hold it) is compared by its final answer
    (`extract_gsm8k_answer`); one that is not a number is compared as stripped text. This is the
    rule-based correctness reward of GRPO on GSM8K (DeepSeekMath; TRL's and Tunix's
    GRPO examples use the same check).
    """
    if len(completions) != len(answers):
        raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
    out = np.zeros(len(completions), dtype=np.float32)
    for i, (completion, answer) in enumerate(zip(completions, answers)):
        predicted = extract_gsm8k_answer(completion)
        if predicted is None:
            predicted = extract_last_number(completion)
        reference = extract_gsm8k_answer(answer) or normalise_number(answer)
        if reference is None:
            reference = answer.strip()
        out[i] = 1.0 if predicted is not None and predicted == reference else 0.0
    return out
