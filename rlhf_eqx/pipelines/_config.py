"""Typed run configuration: the frozen dataclasses of every stage and the built-in task.

Files and dotted overrides are read in `_config_io.py`, values checked in `_validation.py`.

One `PipelineConfig` holds every stage's settings. A stage that trains with one of the
library's steps embeds that step's settings record by inheritance (`DPOConfig` is a
`rlhf_eqx.train.DPOSettings`, `--set dpo.beta` is its `beta`), and its optimiser and
step options are the train records `OptimizerSettings` (`<stage>.optim.*`) and
`StepOptions` (`<stage>.options.*`): their defaults and checks are the records' own, and
a bad value raises `ConfigError` when the config is built. The defaults are the ones
users of the field expect (TRL / the papers); `animal_task_config()` is the built-in
task's configuration, which overrides some of them and lists which in its `notes` field.
The sampling temperature has one owner, `sampling.temperature`: the runs pass it into the
PPO and GRPO records.
"""

import dataclasses
import re

from ..models import LORA_TARGETS
from ..train import (
    DPOSettings,
    GRPOSettings,
    OptimizerSettings,
    PPOSettings,
    RewardSettings,
    SFTSettings,
    StepOptions,
)
from ..train._validation import check_number

REWARD_SOURCES: tuple[str, ...] = ("task", "reward_model", "judge", "prm")
"""The values of `ppo.reward_source` and `grpo.reward_source` (`_reward_sources.py`)."""


class ConfigError(ValueError):
    """An invalid configuration value; the message names the field and the value."""


def prefixed(prefix: str, message: str) -> str:
    """`message` (`"beta=-0.1: must be > 0"`) under the field path `prefix` (`"dpo."`):
    `"dpo.beta=-0.1: must be > 0"`; a message that names no field gets `"dpo: ..."`."""
    if not prefix or message.startswith(prefix):
        return message
    if re.match(r"[A-Za-z_][\w.]*=", message):
        return prefix + message
    return f"{prefix.rstrip('.')}: {message}"


class _Checked:
    """Runs the embedded records' checks when a stage config is built, raising their
    one-line error as a `ConfigError`."""

    def __post_init__(self):
        check = getattr(super(), "__post_init__", None)
        if check is None:
            return
        try:
            check()
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(str(e)) from None


_SET_BY_SAMPLING = {"set_by": "sampling.temperature"}
"""Field metadata: not a setting of its section (not in config files or `--set`); the
runs set it from `sampling.temperature`."""


def _optim(learning_rate: float) -> OptimizerSettings:
    """The pipeline's optimiser at `learning_rate`: 10% linear warmup, then cosine decay."""
    return OptimizerSettings(learning_rate=learning_rate, warmup_ratio=0.1)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Where the policy comes from.

    `source`: `"builtin"` (the shipped stories260K), a llama2.c `.bin` file or a Hugging
    Face checkpoint directory (`config.json` + `*.safetensors`). `tokenizer`: a
    tokenizer file (llama2.c `.bin`, SentencePiece `.model`, HF `tokenizer.json`);
    `None` with `"builtin"` takes the shipped one, and with an HF directory its
    `tokenizer.json`.
    """

    source: str = "builtin"
    tokenizer: str | None = None


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """A data file for a single-stage run (`rlhf_eqx dpo|reward|sft|grpo --set
    data.path=...`): preferences (HH-RLHF, OpenAI messages, ShareGPT, plain) for
    `sft`/`reward`/`dpo`, prompts with answers (GSM8K) for `grpo`. The first `limit`
    records are read (0: all); about `heldout_fraction` of their prompts, chosen with
    `seed` (`data.split_held_out`), are held out for evaluation. Before preference
    training a data-quality report is logged; `filter` (e.g.
    `identical,empty,exact_duplicate`) drops those problems first
    (`data.filter_preferences`; `long_prompt` drops pairs whose prompt does not fit
    `sampling.prompt_length`, so that no prompt is cut)."""

    path: str | None = None
    format: str = "auto"
    limit: int = 512
    heldout_fraction: float = 0.1
    seed: int = 0
    filter: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class LoRASettings:
    """LoRA adapters (Hu et al. 2021; PEFT defaults): rank `rank`, scale `alpha / rank`,
    `dropout` on the adapter input, on the projections `targets`. `rank=0`: train every
    weight instead. With `rank > 0` these are the fields of the models' record
    `rlhf_eqx.LoRAConfig` (`lora_config()`), which cannot express "no adapters"; checked
    when built (`ConfigError`)."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.05
    targets: tuple[str, ...] = ("q", "v")

    def __post_init__(self):
        try:
            if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
                raise ValueError(f"rank={self.rank!r}: must be an int >= 0 (0: no LoRA)")
            check_number("alpha", self.alpha, low=0.0, low_open=True)
            check_number("dropout", self.dropout, low=0.0, high=1.0, high_open=True)
            unknown = [t for t in self.targets if t not in LORA_TARGETS]
            if unknown:
                raise ValueError(
                    f"targets={self.targets!r}: unknown projection {unknown[0]!r} (known: "
                    f"{', '.join(LORA_TARGETS)})"
                )
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def lora_config(self):
        """The models' `rlhf_eqx.LoRAConfig` of these settings (`None` when `rank == 0`)."""
        from ..models import LoRAConfig

        if self.rank == 0:
            return None
        return LoRAConfig(
            rank=self.rank, alpha=self.alpha, dropout=self.dropout, targets=self.targets
        )


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Rollouts and evaluation samples: prompts left-padded (or rejected) at
    `prompt_length` tokens, `max_new_tokens` sampled at `temperature` (the same
    temperature is used for the steps' log-probabilities). Each completion stops at EOS
    (and BOS) and, when `stop_strings` are given, is cut where one first appears: none
    for the story task; `("\\n\\nHuman:",)` for HH-RLHF-style chat prompts, so that a
    completion that starts the next human turn ends there. `slots > 0` samples rollouts
    with continuous batching (`rlhf_eqx.generate_continuous`: that many decode rows,
    refilled as completions finish; each prompt's samples from its own key), 0 with the
    static batch loop (`generate_batch`)."""

    prompt_length: int = 32
    max_new_tokens: int = 40
    temperature: float = 1.0
    stop_strings: tuple[str, ...] = ()
    slots: int = 0


@dataclasses.dataclass(frozen=True)
class OpsConfig:
    """Operations of every run.

    - `checkpoint_every`: save a checkpoint every this many iterations (0: only at the
      end); `keep`: how many to keep.
    - `eval_every`: evaluate every this many iterations (0: only at the end).
    - `rollback`: on a non-finite loss, a loss spike (`loss > loss_spike` times the median
      of the last 10 losses) or a KL spike (`kl > kl_spike`), restore the last good
      state and divide the learning rate by `lr_backoff`; at most `max_rollbacks` times.
    - `quiet`: no progress bars or per-step lines.
    - `monitor`: measure a float32 matmul peak at the start of the run and log each
      iteration's model FLOPs, MFU and device memory (where the backend reports it).
    - `profile_steps`: `[a, b]` writes a `jax.profiler` trace of iterations `a <= i < b`
      to `<run dir>/profile/<stage>/` (empty: no trace).
    - `tensorboard`: also write the step metrics as TensorBoard scalars to
      `<run dir>/tensorboard/<stage>/` (needs `tensorboardX`; skipped with a note
      otherwise).
    """

    seed: int = 0
    checkpoint_every: int = 0
    keep: int = 2
    eval_every: int = 0
    rollback: bool = True
    lr_backoff: float = 10.0
    loss_spike: float = 10.0
    kl_spike: float = 10.0
    max_rollbacks: int = 3
    log_every: int = 10
    quiet: bool = False
    monitor: bool = True
    profile_steps: tuple[int, ...] = ()
    tensorboard: bool = False


_RUN_OPTIONS = StepOptions(donate=False)
"""The step options of a pipeline run: one device, and no donation (the loop keeps each
iteration's state for rollback and checkpoints)."""


@dataclasses.dataclass(frozen=True)
class BatchStageConfig(_Checked):
    """The fields every stage that trains on fixed batches shares (SFT, reward model,
    DPO): `steps` optimiser steps on batches of `batch_size` rows of at most
    `max_length` tokens, with `optim` (`rlhf_eqx.train.OptimizerSettings`: learning rate
    1e-5, 10% warmup, cosine decay, clipping at 1.0) and the step's `options`
    (`rlhf_eqx.train.StepOptions`, e.g. `options.micro_batches`)."""

    steps: int = 100
    batch_size: int = 16
    max_length: int = 80
    optim: OptimizerSettings = _optim(1e-5)
    options: StepOptions = _RUN_OPTIONS


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

    Ensemble: `ensemble > 1` trains that many reward models in one vmapped step
    (`rlhf_eqx.train.make_ensemble_reward_step`), each on its own bootstrap resample of
    every batch, and scores a completion by the members' `mean - ensemble_penalty * std`
    (`ensemble_mode`: `std`, `var`, `min` or `mean`; Coste et al. 2024; the penalty
    defaults to 0, the members' mean, as in `rlhf_eqx.losses.conservative_reward`).
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
    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    loss_type: str = "kto"
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
    share the student's vocabulary and may differ in size."""

    steps: int = 40
    beta: float = 0.5
    temperature: float = 0.9
    lmbda: float = 0.5
    teacher: str = "grpo"
    samples: int = 2
    lora: LoRASettings = LoRASettings()


@dataclasses.dataclass(frozen=True)
class RolloutStageConfig(_Checked):
    """The fields every reinforcement-learning stage shares (PPO, GRPO): `rollouts`
    rounds of sampling from `prompts_per_rollout` prompts, `epochs` passes over each
    rollout, an early stop when the per-token KL to the reference exceeds `kl_target`,
    `optim` (`rlhf_eqx.train.OptimizerSettings`), the step's `options`
    (`rlhf_eqx.train.StepOptions`) and the policy's LoRA adapters. The policy ratio's
    clip (`clip_eps`) and the other step settings come from the stage's train record.

    `reward_source`: `task` (the task's reward functions), `reward_model` (a reward
    model or ensemble), `judge` (a generative judge, `judge.*`) or `prm` (a process
    reward model). `reward_model`: the directory of an exported reward model, ensemble
    or PRM (`<run>/reward/hf`, `<run>/reward/ensemble`, `<run>/prm/hf`); empty: the
    run's own reward stage."""

    rollouts: int = 20
    prompts_per_rollout: int = 32
    epochs: int = 1
    kl_target: float = 0.05
    optim: OptimizerSettings = _optim(1e-5)
    options: StepOptions = _RUN_OPTIONS
    lora: LoRASettings = LoRASettings()
    reward_source: str = "task"
    reward_model: str = ""


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
      0: synchronous). The sampler's log-probabilities are kept as the behaviour
      policy's, `old_logp` is the trained policy's own, and
      `rollout_correction` (e.g. `--set grpo.rollout_correction.mode=truncate`, a
      `rlhf_eqx.losses.RolloutCorrection`: truncated or masked importance weights at
      token, sequence or geometric level, veRL's `rollout_is`) reweights the tokens;
      the `rollout_corr/*` metrics measure the mismatch.
    - `dynamic_sampling`: DAPO's dynamic sampling (Yu et al. 2025) — groups whose
      rewards all agree are dropped and the batch refilled with fresh groups, at most
      this many samplings per rollout (0: off); what is still missing is filled with
      dropped groups (zero advantage), so every step has one shape.
    - `overlong_buffer`: DAPO's soft overlong punishment (TRL
      `soft_overlong_punishment`): a completion longer than `max_new_tokens -
      overlong_buffer` tokens loses up to 1 reward linearly (0: off)."""

    temperature: float = dataclasses.field(
        default=SamplingConfig.temperature, metadata=_SET_BY_SAMPLING
    )
    prompts_per_rollout: int = 8
    group_size: int = 8
    staleness: int = 0
    dynamic_sampling: int = 0
    overlong_buffer: int = 0


@dataclasses.dataclass(frozen=True)
class JudgeConfig:
    """A generative judge as the reward (`reward_source=judge`; Zheng et al. 2023): `model`
    (`base`, the loaded model; a stage of the run, e.g. `sft`; or a Hugging Face
    checkpoint directory) reads `template` (a format string with `{prompt}` and
    `{completion}`) and the reward is `log p(yes) - log p(no)` of its next token
    (`score=log_odds`) or `p(yes)` (`prob`). `yes` and `no` must each encode to one
    token of the model's tokenizer."""

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
    "the early stop (usual 0.05: mentioning an animal changes a few tokens a lot)."
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
        notes=_TASK_NOTES,
    )
