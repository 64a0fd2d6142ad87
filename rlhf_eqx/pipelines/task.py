"""The built-in task's pieces: the story openings it trains and evaluates on, the rule that
scores a story (1 when it names an animal), the noisy labels the reward model and DPO
see, and the word list (`ANIMALS`). The task's configuration is
`rlhf_eqx.pipelines.animal_task_config()`."""

from ._task import (
    ANIMALS as ANIMALS,
    HELDOUT_PROMPTS as HELDOUT_PROMPTS,
    TRAIN_PROMPTS as TRAIN_PROMPTS,
    animal_score as animal_score,
    noisy_scores as noisy_scores,
)
