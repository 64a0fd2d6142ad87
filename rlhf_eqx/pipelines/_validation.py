"""Validation of a `PipelineConfig` before anything is loaded or compiled: one
`ConfigError` naming the first bad field, its value and the valid choices.

`validate_config` checks a whole pipeline configuration (the CLI, `run_pipeline` and
`run_on_data` call it first); `validate_stage(name, cfg)` checks one stage's settings
(`run_sft`, `run_reward`, `run_dpo`, `run_online_dpo`, `run_ppo`, `run_grpo` call it),
and `validate_ops` the operations settings every run uses.

The settings a stage shares with its training step (the `rlhf_eqx.train` records it
embeds: `DPOSettings`, `PPOSettings`, ..., `OptimizerSettings`, `StepOptions`) and the
LoRA settings check themselves when the config is built; what is left here are the
pipeline's own fields and the rules that combine several of them: the shared sections
here; each stage's own settings in its stage module (its config's `check`, `Stage.check_run`);
the fields every batch or rollout stage shares, the stages of a run and the rules across
stages in `_run_checks.py` (those that need the model's sizes or the tokenizer, read
without loading the weights, in `_model_checks.py`).
"""

import math
import numbers
import os
from typing import Any

from ..data import (
    COLUMN_NAMES,
    DEMONSTRATION_FORMATS,
    PREFERENCE_FORMATS,
    PROMPT_FORMATS,
    DataError,
    dataset_files,
)
from ..train import JUDGE_SCORES, SampledSettings
from ._config import (
    REMAT_MODES,
    ConfigError,
    OpsConfig,
)
from ._field_checks import _above, _at_least, _choice, _fail, _positive
from ._model_checks import is_gguf_file
from ._pipeline_config import (
    PipelineConfig,
)
from ._registry import find_stage
from ._run_checks import check_section, run_stages, validate_run
from ._trackers import check_tracker_names

DATA_FORMATS: tuple[str, ...] = tuple(
    dict.fromkeys(("auto", *PREFERENCE_FORMATS, *PROMPT_FORMATS, *DEMONSTRATION_FORMATS))
)
"""The values of `data.format`: preference formats for sft/reward/dpo, prompt formats for
grpo, demonstration formats for sft, `auto` to detect from the first record."""
SFT_FORMATS: tuple[str, ...] = tuple(
    dict.fromkeys(("auto", *DEMONSTRATION_FORMATS, *PREFERENCE_FORMATS))
)
"""The values of `data.format` the sft stage reads: its demonstration formats
(`data.load_demonstrations`) and, as before them, the preference layouts."""
UNFILTERED_STAGES: tuple[str, ...] = ("grpo", "prm")
"""The data-file stages that read no `data.filter` (prompts with answers, stepwise
solutions): a filter given to them is refused rather than ignored."""
JUDGE_MODELS: tuple[str, ...] = ("base", "sft")
"""The stages a judge can be taken from (`judge.model`), besides a short model name
(`MODEL_NAMES`), a checkpoint directory or a `.gguf` file."""


def validate_config(
    cfg: PipelineConfig, *, device_count: int = 1, stage: str | None = None
) -> None:
    """Check every field a run of `cfg` uses before anything is loaded or compiled; raise
    `ConfigError` naming the first bad field, its value and the valid range or choices.

    The shared sections (`model`, `data`, `sampling`, `ops`) are checked, then the
    stages the run executes (`run_stages`: `stage` alone for a single-stage run on a
    data file, else `cfg.stages` with SFT first on the built-in task) with their
    sections and the limits that follow from several fields (`validate_run`)."""
    from ._pipeline import model_names, unknown_model

    m = cfg.model
    if m.source not in model_names() and not os.path.exists(m.source):
        _fail("model.source", m.source, unknown_model(m.source))
    if m.tokenizer is not None and not os.path.isfile(m.tokenizer):
        _fail("model.tokenizer", m.tokenizer, "no such file")
    if m.source.endswith(".bin") and m.tokenizer is None and not is_gguf_file(m.source):
        _fail("model.tokenizer", None, "a llama2.c checkpoint needs a tokenizer file")
    if m.quantized:
        _check_quantized(cfg, run_stages(cfg, stage))
    _choice("model.remat", m.remat, tuple(REMAT_MODES))
    dc = cfg.data
    _check_chat_template(dc.chat_template)
    if dc.split is not None and dc.path is None:
        _fail("data.split", dc.split, "only applies to a DatasetDict directory (data.path)")
    if dc.path is not None:
        try:  # a file, a Parquet / Arrow file or a datasets directory (and its split)
            dataset_files(dc.path, dc.split)
        except DataError as e:
            why = str(e)
            for prefix in (dc.path, dc.path.rpartition(":")[0]):
                why = why.removeprefix(f"{prefix}: ")
            if dc.split is not None and "split" in why:
                _fail("data.split", dc.split, why)
            _fail("data.path", dc.path, "is a directory" if why.startswith("is a dir") else why)
    unknown = [name for name in dc.columns if name not in COLUMN_NAMES]
    if unknown:
        known = ", ".join(COLUMN_NAMES)
        _fail("data.columns", dc.columns, f"unknown field {unknown[0]!r} (known: {known})")
    for name, column in dc.columns.items():
        if not isinstance(column, str) or not column:
            _fail("data.columns", dc.columns, f"{name!r} must name a column, got {column!r}")
    _choice("data.format", dc.format, DATA_FORMATS)
    _at_least("data.seed", dc.seed, 0)
    _at_least("data.eval_prompts", dc.eval_prompts, 0)
    if dc.limit < 0:
        _fail("data.limit", dc.limit, "must be >= 0 (0: all records)")
    if not 0 < dc.heldout_fraction < 1:
        _fail("data.heldout_fraction", dc.heldout_fraction, "must be in (0, 1)")
    problems = ("identical", "empty", "exact_duplicate", "duplicate_prompt", "long_prompt")
    for f in dc.filter:
        if f not in problems:
            _fail("data.filter", dc.filter, f"unknown problem {f!r} (known: {', '.join(problems)})")
    if dc.path is not None:
        _check_stage_format(dc.format, run_stages(cfg, stage))
    if dc.path is not None and dc.format != "auto" and "prm" in run_stages(cfg, stage):
        _fail("data.format", dc.format, "prm reads one layout (prompt, completions, labels): auto")
    unfiltered = [st for st in run_stages(cfg, stage) if st in UNFILTERED_STAGES]
    if dc.path is not None and dc.filter and unfiltered:
        _fail(
            "data.filter",
            dc.filter,
            f"{unfiltered[0]} does not filter its records (the filters apply to preference "
            "pairs and KTO examples; GRPO drops the prompts longer than "
            "sampling.prompt_length itself)",
        )
    s = cfg.sampling
    _positive("sampling.prompt_length", s.prompt_length)
    _positive("sampling.max_new_tokens", s.max_new_tokens)
    if s.max_new_tokens > 512:
        _fail("sampling.max_new_tokens", s.max_new_tokens, "must be <= 512")
    try:
        SampledSettings(temperature=s.temperature)  # the steps' rule
    except ValueError as e:
        raise ConfigError(f"sampling.{e}") from None
    _at_least("sampling.slots", s.slots, 0)
    _at_least("sampling.top_k", s.top_k, 0)
    if not 0 < s.top_p <= 1:
        _fail("sampling.top_p", s.top_p, "must be in (0, 1] (1: off)")
    if not 0 <= s.min_p <= 1:
        _fail("sampling.min_p", s.min_p, "must be in [0, 1] (0: off)")
    if not (_is_real(s.repetition_penalty) and 0 < s.repetition_penalty < math.inf):
        _fail("sampling.repetition_penalty", s.repetition_penalty, "must be a number > 0 (1: off)")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if not (_is_real(value) and -2 <= value <= 2):
            _fail(f"sampling.{name}", value, "must be in [-2, 2] (0: off)")
    _check_penalised_continuations(cfg, run_stages(cfg, stage))
    if not all(isinstance(x, str) and x for x in s.stop_strings):
        _fail("sampling.stop_strings", s.stop_strings, "must be non-empty strings")
    validate_ops(cfg.ops)
    if not 0 <= cfg.label_noise < 0.5:
        _fail("label_noise", cfg.label_noise, "must be in [0, 0.5)")
    _positive("eval_samples", cfg.eval_samples)
    validate_run(cfg, run_stages(cfg, stage), device_count=device_count)


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_penalised_continuations(cfg: PipelineConfig, run: tuple[str, ...]) -> None:
    """Refuse `sampling.presence_penalty` / `frequency_penalty` with a stage's
    `partial_rollouts`: a continued row is prefilled afresh with its tokens so far as its
    prompt, so its earlier tokens would no longer count as generated (the repetition
    penalty, which counts the prompt too, stays exact)."""
    s = cfg.sampling
    on = [name for name in ("presence_penalty", "frequency_penalty") if getattr(s, name) != 0]
    if not on:
        return
    for name in run:
        stage = find_stage(name)
        section = getattr(cfg, stage.key, None) if stage is not None else None
        segment = getattr(section, "partial_rollouts", 0)
        if segment:
            _fail(
                f"sampling.{on[0]}",
                getattr(s, on[0]),
                f"is not supported with {stage.key}.partial_rollouts={segment} (a continued "
                "row is prefilled afresh, so its earlier tokens would not count as "
                "generated); use sampling.repetition_penalty, or partial_rollouts=0",
            )


def _check_stage_format(fmt: str, run: tuple[str, ...]) -> None:
    """`data.format` against the stages that read the file: sft reads `SFT_FORMATS`; the
    demonstration formats that name no other reader's layout are sft's alone, but for the
    conversations and prompt-completion records distill reads too."""
    if "sft" in run and fmt not in SFT_FORMATS:
        _fail("data.format", fmt, f"sft reads one of {', '.join(SFT_FORMATS)}")
    sft_only = [f for f in SFT_FORMATS if f not in ("auto", *PREFERENCE_FORMATS, *PROMPT_FORMATS)]
    also = {"distill": ("prompt_completion", "messages")}
    others = [st for st in run if st != "sft" and fmt not in also.get(st, ())]
    if fmt in sft_only and others:
        not_read = [f for f in sft_only if f not in also.get(others[0], ())]
        _fail(
            "data.format",
            fmt,
            f"{others[0]} does not read it ({', '.join(not_read)}: sft's demonstrations)",
        )


def _check_quantized(cfg: PipelineConfig, run: tuple[str, ...]) -> None:
    """`model.quantized` keeps a GGUF file's packed weights, which cannot train: a `.gguf`
    source (or a packaged model name) and LoRA adapters in every stage that trains."""
    from ._pipeline import MODEL_NAMES

    source = cfg.model.source
    if not (is_gguf_file(source) or source in MODEL_NAMES):
        _fail("model.quantized", True, f"needs a .gguf model.source, got {source!r}")
    for st in run:
        key = find_stage(st).key
        lora = getattr(getattr(cfg, key, None), "lora", None)
        if lora is None:
            _fail("model.quantized", True, f"the {st} stage has no LoRA adapters to train")
        if lora.rank == 0:
            _fail(
                f"{key}.lora.rank",
                0,
                "model.quantized=true needs LoRA adapters (rank > 0): packed weights cannot train",
            )


def _check_chat_template(value: str) -> None:
    if value in ("auto", "none"):
        return
    if not value.endswith(".jinja"):
        _fail("data.chat_template", value, "must be auto, none or a .jinja file")
    if not os.path.isfile(value):
        _fail("data.chat_template", value, "no such file")


def validate_judge(j) -> None:
    """Check the judge settings (`judge.*`, a `JudgeConfig`): the judge model (`base`,
    `sft`, a short model name such as `smollm2-135m`, a checkpoint or run directory or a
    `.gguf` file) and the template; `ConfigError` naming the field, the value and the
    choices (and the closest name to a near miss). Whether the verdicts are single tokens
    of the run's tokenizer is checked by `validate_config`, which knows the model."""
    from ._pipeline import MODEL_NAMES, closest_name

    gguf = is_gguf_file(j.model) and os.path.isfile(j.model)
    named = j.model in JUDGE_MODELS or j.model in MODEL_NAMES
    if not named and not os.path.isdir(j.model) and not gguf:
        choices = ", ".join(JUDGE_MODELS)
        _fail(
            "judge.model",
            j.model,
            f"must be one of {choices}, a short model name ({', '.join(MODEL_NAMES)}), a "
            f"directory or a .gguf file{closest_name(j.model, (*JUDGE_MODELS, *MODEL_NAMES))}",
        )
    try:
        j.template.format_map({"prompt": "", "completion": ""})
    except (KeyError, IndexError, ValueError) as e:
        _fail(
            "judge.template",
            j.template,
            f"a format string with {{prompt}} and {{completion}} only (double literal braces): {e}",
        )
    if "{completion}" not in j.template:
        _fail("judge.template", j.template, "must contain {completion} (what the judge reads)")
    for name in ("yes", "no"):
        if not getattr(j, name):
            _fail(f"judge.{name}", getattr(j, name), "must be a non-empty verdict token")
    _choice("judge.score", j.score, JUDGE_SCORES)


def validate_ops(o: OpsConfig) -> None:
    """Check the operations settings of a run (`ops.*`); `ConfigError` naming the field.
    A setting nothing reads under the others is refused at another value than its
    default: `ops.lr_backoff` and `ops.max_rollbacks` with `ops.rollback=false`,
    `ops.tracker_group` without a tracker that groups runs."""
    _at_least("ops.seed", o.seed, 0)
    if o.checkpoint_every < 0:
        _fail("ops.checkpoint_every", o.checkpoint_every, "must be >= 0")
    _positive("ops.keep", o.keep)
    if o.eval_every < 0:
        _fail("ops.eval_every", o.eval_every, "must be >= 0")
    _positive("ops.log_every", o.log_every)
    _positive("ops.compilation_cache_max_mb", o.compilation_cache_max_mb)
    _at_least("ops.max_rollbacks", o.max_rollbacks, 0)
    _above("ops.lr_backoff", o.lr_backoff, 1)
    _above("ops.loss_spike", o.loss_spike, 1)
    _above("ops.kl_spike", o.kl_spike, 0)
    ps = o.profile_steps
    if ps and (len(ps) != 2 or not 0 <= ps[0] < ps[1]):
        _fail("ops.profile_steps", ps, "must be empty or [a, b] with 0 <= a < b")
    check_tracker_names(o.trackers)
    if not o.rollback:  # the spikes are still noted; nothing is rolled back
        for field in ("lr_backoff", "max_rollbacks"):
            value = getattr(o, field)
            if value != getattr(OpsConfig, field):
                why = "applies to the rollbacks; ops.rollback=false has none"
                _fail(f"ops.{field}", value, why)
    if o.tracker_group and not [t for t in o.trackers if t != "tensorboard"]:
        _fail(
            "ops.tracker_group",
            o.tracker_group,
            "no tracker of the run groups runs (set ops.trackers: wandb, mlflow, trackio or "
            "a registered one; TensorBoard has no groups)",
        )


def validate_stage(name: str, c: Any, *, device_count: int = 1) -> None:
    """Check one stage's settings (`SFTConfig`, `RewardConfig`, `DPOConfig`, `PPOConfig`,
    `GRPOConfig`, ...) under the field prefix `name` (a stage's section or name):
    the fields every batch or rollout stage shares, then the settings' own rules (their
    `check` method); `ConfigError` naming the field. A setting the stage inherits but
    does not use (its config's `unused_fields`) must keep its default."""
    check_section(name, c, device_count=device_count)
