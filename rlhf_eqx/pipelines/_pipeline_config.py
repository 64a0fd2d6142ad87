"""The whole pipeline's configuration (`PipelineConfig`) and the built-in task's
(`animal_task_config`)."""

import dataclasses

from ._config import (
    DataConfig,
    LoRASettings,
    ModelConfig,
    OpsConfig,
    SamplingConfig,
    _optim,
)
from ._stage_configs import (
    DistillConfig,
    DPOConfig,
    GRPOConfig,
    JudgeConfig,
    KTOConfig,
    PPOConfig,
    PRMConfig,
    RewardConfig,
    SFTConfig,
)


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """A whole pipeline: SFT, then reward model -> PPO, DPO and GRPO from SFT.

    `stages` selects stages (`"sft"` always runs first); `extra` holds the settings of
    stages registered outside this class (`register_stage`), read as `cfg.<section>`
    and written as `<section>.FIELD` like the others; `label_noise` is the
    probability that a preference label is flipped; `eval_samples` completions per
    held-out prompt evaluate each stage; `out` is the run directory (empty: `runs/<command>`
    under the current directory).
    """

    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    sampling: SamplingConfig = SamplingConfig()
    ops: OpsConfig = OpsConfig()
    sft: SFTConfig = SFTConfig()
    reward: RewardConfig = RewardConfig()
    dpo: DPOConfig = DPOConfig()
    ppo: PPOConfig = PPOConfig()
    grpo: GRPOConfig = GRPOConfig()
    kto: KTOConfig = KTOConfig()
    distill: DistillConfig = DistillConfig()
    prm: PRMConfig = PRMConfig()
    judge: JudgeConfig = JudgeConfig()
    stages: tuple[str, ...] = ("sft", "reward", "ppo", "dpo", "grpo")
    label_noise: float = 0.1
    eval_samples: int = 8
    out: str = ""
    notes: str = ""
    extra: dict = dataclasses.field(default_factory=dict, compare=True)

    def __getattr__(self, name: str):
        # The settings of a stage registered outside this class (`register_stage`): held in
        # `extra` under its section name, its defaults until set.
        extra = self.__dict__.get("extra", {})
        if name in extra:
            return extra[name]
        from ._registry import _REGISTRY

        for st in _REGISTRY.values():
            if st.key == name:
                return st.config()
        raise AttributeError(f"{type(self).__name__} has no field or stage section {name!r}")


_TASK_NOTES = (
    "Built-in animal task. Overrides of the usual defaults, for a 260K-parameter model "
    "trained in minutes on 2 CPU cores: LoRA rank 8, alpha 16, no dropout, on every "
    "projection (usual: r 16, alpha 32, dropout 0.05 on q/v); learning rates 5e-4 to "
    "2e-3 (usual 1e-5: too slow for a few dozen steps); KL target 1.0 nat per token for "
    "the early stop (usual 0.05: mentioning an animal changes a few tokens a lot); the "
    "judge's verdict tokens y / n (usual ' Yes' / ' No': four tokens each in the shipped "
    "512-token tokenizer)."
)


def animal_task_config() -> PipelineConfig:
    """The built-in task's configuration (`python -m rlhf_eqx`); `notes` says what it
    changes from the usual defaults and why."""
    lora = LoRASettings(
        rank=8, alpha=16.0, dropout=0.0, targets=("q", "k", "v", "o", "gate", "up", "down")
    )
    return PipelineConfig(
        sft=SFTConfig(steps=30, batch_size=16, samples=2, optim=_optim(5e-4), lora=lora),
        reward=RewardConfig(
            steps=80,
            batch_size=32,
            pairs_per_prompt=24,
            eval_every=5,
            optim=_optim(1e-3),
        ),
        dpo=DPOConfig(
            beta=0.1,
            rounds=3,
            steps=20,
            batch_size=16,
            samples=4,
            optim=_optim(5e-4),
            lora=lora,
        ),
        ppo=PPOConfig(
            rollouts=16,
            prompts_per_rollout=64,
            epochs=2,
            minibatches=2,
            kl_coef=0.02,
            kl_target=1.0,
            optim=_optim(1e-3),
            lora=lora,
        ),
        kto=KTOConfig(steps=40, batch_size=16, samples=4, optim=_optim(5e-4), lora=lora),
        distill=DistillConfig(steps=40, batch_size=16, samples=2, optim=_optim(1e-3), lora=lora),
        grpo=GRPOConfig(
            rollouts=12,
            prompts_per_rollout=8,
            group_size=8,
            beta=0.02,
            kl_target=1.0,
            optim=_optim(2e-3),
            lora=lora,
        ),
        judge=JudgeConfig(yes="y", no="n"),
        notes=_TASK_NOTES,
    )
