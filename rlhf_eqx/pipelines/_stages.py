"""The built-in stages, registered in pipeline order (see `_registry.py`)."""

from . import _builtin_stages as B, _data_stages as D
from ._multiturn_dpo_runs import MultiturnDPOConfig, multiturn_dpo
from ._multiturn_runs import MultiturnConfig, multiturn
from ._registry import Stage, register_stage
from ._stage_configs import (
    DistillConfig,
    DPOConfig,
    GRPOConfig,
    KTOConfig,
    PPOConfig,
    PRMConfig,
    RewardConfig,
    SFTConfig,
)

for _stage in (
    Stage(
        "sft",
        SFTConfig,
        B.sft,
        D.sft,
        needs=lambda cfg: ("sft",),
        sections=(),
        help="supervised fine-tuning",
    ),
    Stage(
        "reward",
        RewardConfig,
        B.reward,
        D.reward,
        summary_key="reward_model",
        trains_policy=False,
        help="a Bradley-Terry reward model (or an ensemble: reward.ensemble=K)",
    ),
    Stage(
        "ppo",
        PPOConfig,
        B.ppo,
        needs=B.ppo_needs,
        sections=("reward", "sft", "judge"),
        help="PPO with a value model, rewards from ppo.reward_source",
    ),
    Stage(
        "online-dpo",
        DPOConfig,
        B.online_dpo,
        section="dpo",
        sections=("reward", "sft"),
        needs=lambda cfg: ("sft", "reward", "online-dpo"),
        help="online DPO on pairs labelled by the reward model",
    ),
    Stage("dpo", DPOConfig, B.dpo, D.dpo, help="DPO (and its loss family)"),
    Stage(
        "grpo",
        GRPOConfig,
        B.grpo,
        D.grpo,
        needs=B.grpo_needs,
        sections=("sft", "judge"),
        help="GRPO, rewards from grpo.reward_source",
    ),
    Stage("kto", KTOConfig, B.kto, D.kto, help="KTO on unpaired examples"),
    Stage(
        "distill",
        DistillConfig,
        B.distill,
        D.distill,
        needs=B.distill_needs,
        help="generalized knowledge distillation from distill.teacher",
    ),
    Stage(
        "multiturn",
        MultiturnConfig,
        multiturn,
        help="GRPO on two-turn episodes: a paragraph, then one about the animal asked for",
    ),
    Stage(
        "multiturn-dpo",
        MultiturnDPOConfig,
        multiturn_dpo,
        help="online DPO on two-turn episodes (best vs worst episode per prompt)",
    ),
    Stage(
        "prm",
        PRMConfig,
        data=D.prm,
        trains_policy=False,
        sections=(),
        help="a process reward model on a stepwise file (--data)",
    ),
):
    register_stage(_stage)
