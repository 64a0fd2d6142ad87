"""The settings of each stage: a stage that trains with one of the library's steps embeds
that step's settings record by inheritance (`DPOConfig` is a `rlhf_eqx.train.DPOSettings`,
`--set dpo.beta` is its `beta`); the shared fields come from `BatchStageConfig` and
`RolloutStageConfig` (`_config.py`)."""

import dataclasses

from ..train import (
    DistillSettings,
    DPOSettings,
    GRPOSettings,
    KTOSettings,
    OptimizerSettings,
    PPOSettings,
    RewardSettings,
    SFTSettings,
)
from ._config import (
    _SET_BY_SAMPLING,
    BatchStageConfig,
    LoRASettings,
    RolloutStageConfig,
    SamplingConfig,
    _optim,
)

MAX_STALENESS: int = 8
"""The largest `grpo.staleness`: each stale policy's trainable parameters are held in
memory and written with every checkpoint (asynchronous RL systems keep 1 to a few)."""


@dataclasses.dataclass(frozen=True)
class SFTConfig(BatchStageConfig, SFTSettings):
    """Supervised fine-tuning on best-of-`samples` completions (by noisy labels) of the
    base model for the training prompts; the step's settings are
    `rlhf_eqx.train.SFTSettings` (`mode`, `constant`)."""

    optim: OptimizerSettings = _optim(2e-5)
    samples: int = 4
    lora: LoRASettings = LoRASettings()


@dataclasses.dataclass(frozen=True)
class RewardConfig(BatchStageConfig, RewardSettings):
    """Reward model (Bradley-Terry; `rlhf_eqx.train.RewardSettings`: `center_coef`,
    `margin`) on noisily labelled pairs of policy samples (`pairs_per_prompt` pairs
    sampled per prompt by the pipeline).

    Checkpoint selection: about `heldout_fraction` of the training pairs' prompts are
    held out, labels as noisy as the rest; every `eval_every` steps (0: never) and at
    the end their accuracy is measured and the model with the best accuracy is kept
    (a reward model trained on noisy labels otherwise memorises them).

    Ensemble: `ensemble > 1` (>= 1) trains that many reward models in one vmapped step
    (`rlhf_eqx.train.make_ensemble_reward_step`), each on its own bootstrap resample of
    every batch, and scores a completion by the members' `mean - ensemble_penalty * std`
    (`ensemble_mode`: `std`, `var`, `min` or `mean`; Coste et al. 2024; the penalty, a
    finite number >= 0, defaults to 0, the members' mean, as in
    `rlhf_eqx.losses.conservative_reward`).
    Checkpoint selection and accuracy use that score; the export is `reward/ensemble/`."""

    pairs_per_prompt: int = 4
    heldout_fraction: float = 0.1
    eval_every: int = 10
    ensemble: int = 1
    ensemble_mode: str = "std"
    ensemble_penalty: float = 0.0


@dataclasses.dataclass(frozen=True)
class DPOConfig(BatchStageConfig, DPOSettings):
    """DPO (Rafailov et al. 2023; the step's settings are `rlhf_eqx.train.DPOSettings`:
    `beta`, `loss_type`, `label_smoothing`, `rpo_alpha`, `loss_kwargs`, and `reference`,
    here `cached`: the runs compute the reference log-probabilities once, or `none`)
    over `rounds` rounds of fresh
    samples (`rounds=1`: offline on the first samples; online DPO resamples each round).
    `packing` (offline DPO on a data file): token-budget batches
    (`data.pack_preference_steps`), each prompt written once before both completions and
    several pairs to a row, about `batch_size` pairs a step and one shape for all steps,
    instead of `batch_size` rows padded to `max_length`."""

    steps: int = 20
    reference: str = "cached"
    rounds: int = 3
    samples: int = 4
    packing: bool = False
    lora: LoRASettings = LoRASettings()


@dataclasses.dataclass(frozen=True)
class KTOConfig(BatchStageConfig):
    """KTO (Ethayarajh et al. 2024; TRL `KTOTrainer` defaults) on unpaired examples, each
    one completion labelled desirable or undesirable: `beta`, the weights of the two
    kinds (`desirable_weight`, `undesirable_weight`; the paper keeps
    `desirable_weight · n_desirable / (undesirable_weight · n_undesirable)` in [1, 4/3]),
    `loss_type` (`kto` or `apo_zero_unpaired`), the reference point estimated from
    mismatched completions in each batch, a cached reference. On the built-in task the
    examples are `samples` completions per prompt of the SFT policy, labelled by the
    noisy scorer; on a data file, unpaired JSONL (`prompt`, `completion`, `label`) or
    preference pairs split into one desirable and one undesirable example each."""

    steps: int = 40
    beta: float = KTOSettings.beta
    desirable_weight: float = KTOSettings.desirable_weight
    undesirable_weight: float = KTOSettings.undesirable_weight
    loss_type: str = KTOSettings.loss_type
    samples: int = 4
    lora: LoRASettings = LoRASettings()


@dataclasses.dataclass(frozen=True)
class DistillConfig(BatchStageConfig):
    """Generalized knowledge distillation (GKD, Agarwal et al. 2024; TRL `GKDTrainer`
    defaults): the student (SFT on the built-in task, `model.source` on a data file)
    moves toward `teacher`'s token distributions by the generalized JSD with
    interpolation `beta` (0: forward KL, 1: reverse KL) at `temperature`; a fraction
    `lmbda` of the steps trains on the student's own samples (on-policy), the rest on
    fixed completions (the data file's chosen responses, or `samples` samples per prompt
    of the teacher on the built-in task). `teacher`: a stage of the same run (`grpo`,
    `dpo`, `ppo`, `online-dpo`, `kto`) or a Hugging Face checkpoint directory; it must
    share the student's vocabulary (a directory's `vocab_size` is checked against the
    student's before anything is loaded) and may differ in size. `beta` and `lmbda` in
    [0, 1], `temperature` > 0."""

    steps: int = 40
    beta: float = DistillSettings.beta
    temperature: float = 0.9
    lmbda: float = 0.5
    teacher: str = "grpo"
    samples: int = 2
    lora: LoRASettings = LoRASettings()


@dataclasses.dataclass(frozen=True)
class PPOConfig(RolloutStageConfig, PPOSettings):
    """PPO (Schulman et al. 2017; Ouyang et al. 2022) with a value model and KL-shaped
    rewards; `epochs` x `minibatches` updates per rollout of `prompts_per_rollout`
    completions. The step's settings are `rlhf_eqx.train.PPOSettings` (`clip_eps`,
    `vf_coef`, `ent_coef`, ...; its `temperature` is `sampling.temperature`)."""

    temperature: float = dataclasses.field(
        default=SamplingConfig.temperature, metadata=_SET_BY_SAMPLING
    )
    epochs: int = 2
    minibatches: int = 2
    gamma: float = 1.0
    lam: float = 0.95
    kl_coef: float = 0.05
    reward_source: str = "reward_model"


@dataclasses.dataclass(frozen=True)
class GRPOConfig(RolloutStageConfig, GRPOSettings):
    """GRPO (Shao et al. 2024) with the task's verifiable reward: `group_size` samples per
    prompt, group-normalised advantages, k3 KL to the reference with weight `beta`
    (TRL's default 0.0: no KL term). The step's settings are
    `rlhf_eqx.train.GRPOSettings` (its `temperature` is `sampling.temperature`):
    `policy_loss` selects the token objective of `make_grpo_step`: `grpo` (the PPO-clip
    surrogate), or after DAPO `cispo`, `gmpo`, `sapo`, `clip_cov`, `kl_cov`,
    `high_entropy` (each with the step's published defaults; docs/objectives.md).

    Rollouts:

    - `staleness`: rollout `r` is sampled by the policy of `staleness` updates before
      (one-step off-policy with `1`: the next rollout need not wait for the update;
      0: synchronous); at most `MAX_STALENESS` (8) and below `rollouts` (a larger one
      samples every rollout from the initial policy). The sampler's log-probabilities
      are kept as the behaviour policy's, `old_logp` is the trained policy's own, and
      `rollout_correction` (e.g. `--set grpo.rollout_correction.mode=truncate`, a
      `rlhf_eqx.losses.RolloutCorrection`: truncated or masked importance weights at
      token, sequence or geometric level, veRL's `rollout_is`) reweights the tokens;
      the `rollout_corr/*` metrics measure the mismatch.
    - `overlap` (with `staleness >= 1`; on by default): rollout `r + 1` (whose behaviour
      policy is known before rollout `r`'s update) is sampled before that update and
      decoded and scored by a worker thread while it runs, so the host's decoding and
      reward functions (a sandbox, a verifier service, a judge behind an API) overlap the
      update. The run's numbers do not change (the next rollout depends only on the
      stale parameters and its key); two rollouts are held at once. Reward functions
      then run in that thread, not the main one (a reward that needs the main thread,
      e.g. a `signal.alarm` timeout, needs `overlap=false`).
    - `sampler_device`: the local device that samples rollouts (`jax.local_devices()`
      index; -1, the default: the training device). With `overlap`, the next rollout is
      then sampled on its own device while the update runs on the other (the split of
      asynchronous RL systems between inference and training devices); the behaviour
      parameters are copied to it for each rollout, the frozen weights once.
    - `dynamic_sampling`: DAPO's dynamic sampling (Yu et al. 2025) — groups whose
      rewards all agree are dropped and the batch refilled with fresh groups, at most
      this many samplings per rollout (0: off, >= 0); what is still missing is filled
      with dropped groups (zero advantage), so every step has one shape.
    - `overlong_buffer`: DAPO's soft overlong punishment (TRL
      `soft_overlong_punishment`): a completion longer than `max_new_tokens -
      overlong_buffer` tokens loses up to 1 reward linearly (0: off, >= 0)."""

    temperature: float = dataclasses.field(
        default=SamplingConfig.temperature, metadata=_SET_BY_SAMPLING
    )
    prompts_per_rollout: int = 8
    group_size: int = 8
    staleness: int = 0
    overlap: bool = True
    sampler_device: int = -1
    dynamic_sampling: int = 0
    overlong_buffer: int = 0


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


@dataclasses.dataclass(frozen=True)
class PRMConfig(BatchStageConfig):
    """A process reward model (Lightman et al. 2023; TRL `PRMTrainer`) trained on a
    stepwise data file (`rlhf_eqx prm --set data.path=FILE`: records `{"prompt",
    "completions": [steps], "labels": [bools]}`): a `ValueModel` on the policy's
    backbone reads the step `separator` after each step. Its use as a reward
    (`reward_source=prm`) reads the step scores (`score`: `prob` or `logit`) at the
    separators of each completion: per token for PPO, and their `aggregation` (`min`,
    `last`, `mean`) per sequence for GRPO; both are stored with the export."""

    steps: int = 100
    batch_size: int = 8
    max_length: int = 256
    separator: str = "\n"
    aggregation: str = "min"
    score: str = "prob"
