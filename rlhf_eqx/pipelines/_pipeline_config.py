"""The whole pipeline's configuration (`PipelineConfig`): the shared sections and one
section for each registered stage, and the built-in task's (`animal_task_config`)."""

import dataclasses
from collections.abc import Mapping
from typing import Any

from ._config import (
    DataConfig,
    LoRASettings,
    ModelConfig,
    OpsConfig,
    SamplingConfig,
)
from ._registry import section_stages, section_types, stages as registered


@dataclasses.dataclass(frozen=True)
class JudgeConfig:
    """A generative judge as the reward (`reward_source=judge`; Zheng et al. 2023): `model`
    (`base`, the loaded model; a stage of the run, e.g. `sft`; or a Hugging Face
    checkpoint directory) reads `template` (a format string with `{prompt}` and
    `{completion}`) and the reward is `log p(yes) - log p(no)` of its next token
    (`score=log_odds`) or `p(yes)` (`prob`). The judge reads the policy's tokens, so a
    checkpoint directory must share the policy's vocabulary; `yes` and `no` must each
    encode to one token of the run's tokenizer, two different ones (both checked before
    anything is loaded). The defaults, ` Yes` and ` No`, are single tokens of GPT-2-style
    vocabularies (SmolLM2's); in the shipped 512-token tokenizer they are four tokens
    each, and the built-in task (`animal_task_config`) sets `y` and `n`, single tokens
    there."""

    model: str = "base"
    template: str = "{prompt}{completion}\nQuestion: Is this a good answer?\nAnswer:"
    yes: str = " Yes"
    no: str = " No"
    score: str = "log_odds"


@dataclasses.dataclass(frozen=True, init=False)
class PipelineConfig:
    """A whole pipeline: SFT, then reward model -> PPO, DPO and GRPO from SFT.

    The shared sections are fields (`model`, `data`, `sampling`, `ops`, `judge`); every
    registered stage (`register_stage`) has one section, `cfg.<section>` (`cfg.dpo`),
    given as a keyword (`PipelineConfig(dpo=DPOConfig(beta=0.2))`,
    `dataclasses.replace(cfg, dpo=...)`) and written as `<section>.FIELD` in files and
    `--set`; a section not given holds its settings class's defaults. `sections` holds
    the sections that differ from those defaults, so two configs with the same settings
    are equal whenever their stages were registered.

    `stages` selects stages (`"sft"` always runs first); `label_noise` is the
    probability that a preference label is flipped; `eval_samples` completions per
    held-out prompt evaluate each stage; `out` is the run directory (empty: `runs/<command>`
    under the current directory).
    """

    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    sampling: SamplingConfig = SamplingConfig()
    ops: OpsConfig = OpsConfig()
    judge: JudgeConfig = JudgeConfig()
    stages: tuple[str, ...] = ("sft", "reward", "ppo", "dpo", "grpo")
    label_noise: float = 0.1
    eval_samples: int = 8
    out: str = ""
    notes: str = ""
    sections: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __init__(self, **kwargs):
        given = dict(kwargs.pop("sections", None) or {})
        for f in dataclasses.fields(self):
            if f.name == "sections":
                continue
            if f.name in kwargs:
                value = kwargs.pop(f.name)
            elif f.default_factory is not dataclasses.MISSING:
                value = f.default_factory()
            else:
                value = f.default
            object.__setattr__(self, f.name, value)
        types = section_types()
        for key, value in kwargs.items():
            if key not in types:
                known = ", ".join(types)
                raise TypeError(
                    f"PipelineConfig: no field or stage section {key!r} (stages: {known})"
                )
            given[key] = value
        for key, value in given.items():
            cls = types.get(key)
            if cls is not None and not isinstance(value, cls):
                raise TypeError(
                    f"PipelineConfig.{key}: expected {cls.__name__}, got {type(value).__name__}"
                )
        kept = {k: v for k, v in given.items() if k not in types or v != types[k]()}
        object.__setattr__(self, "sections", kept)

    def __getattr__(self, name: str):
        # a stage's section: the one given, else its settings class's defaults
        if name.startswith("__"):
            raise AttributeError(name)
        given = self.__dict__.get("sections", {})
        if name in given:
            return given[name]
        cls = section_types().get(name)
        if cls is not None:
            return cls()
        raise AttributeError(f"{type(self).__name__} has no field or stage section {name!r}")


TASK_STAGE_SETTINGS: Mapping[str, Any] = {
    "lora": LoRASettings(
        rank=8, alpha=16.0, dropout=0.0, targets=("q", "k", "v", "o", "gate", "up", "down")
    ),
}
"""The built-in task's settings of every stage: each stage whose settings class has the
field takes it (`animal_task_config`), a stage registered later included."""

_TASK_NOTES = (
    "Built-in animal task. Overrides of the usual defaults, for a 260K-parameter model "
    "trained in minutes on 2 CPU cores: LoRA rank 8, alpha 16, no dropout, on every "
    "projection (usual: r 16, alpha 32, dropout 0.05 on q/v); learning rates 5e-4 to "
    "2e-3 (usual 1e-5: too slow for a few dozen steps); KL target 1.0 nat per token for "
    "the early stop (usual 0.05: mentioning an animal changes a few tokens a lot); the "
    "judge's verdict tokens y / n (usual ' Yes' / ' No': four tokens each in the shipped "
    "512-token tokenizer)."
)


def task_section(key: str) -> Any:
    """The built-in task's settings of the stage section `key`: its settings class's
    defaults, then `TASK_STAGE_SETTINGS` for the fields the class has (the task's LoRA
    adapters), then the `task` values of the stages registered on it (`Stage.task`)."""
    cls = section_types()[key]
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in TASK_STAGE_SETTINGS.items() if k in names}
    for st in section_stages(key):
        values.update(st.task)
    return cls(**values)


def animal_task_config() -> PipelineConfig:
    """The built-in task's configuration (`python -m rlhf_eqx`); `notes` says what it
    changes from the usual defaults and why.

    Every registered stage's section is `task_section(key)`: the settings class's
    defaults, the task's shared stage settings (`TASK_STAGE_SETTINGS`: LoRA rank 8, α 16,
    no dropout, on every projection) for each field the class has, then the stage's own
    `Stage.task` values (learning rates, step counts). So a stage registered with
    `register_stage` before this is called gets the task's LoRA adapters as the built-in
    stages do, and reads the same shared `sampling` section; its class's defaults hold
    for everything else."""
    sections = {st.key: task_section(st.key) for st in registered()}
    return PipelineConfig(judge=JudgeConfig(yes="y", no="n"), notes=_TASK_NOTES, sections=sections)
