"""Validation of a `PipelineConfig` before anything is loaded or compiled: one
`ConfigError` naming the first bad field, its value and the valid choices.

`validate_config` checks a whole pipeline configuration (the CLI, `run_pipeline` and
`run_on_data` call it first); `validate_stage(name, cfg)` checks one stage's settings
(`run_sft`, `run_reward`, `run_dpo`, `run_online_dpo`, `run_ppo`, `run_grpo` call it),
and `validate_ops` the operations settings every run uses.

The settings a stage shares with its training step (the `rlhf_eqx.train` records it
embeds: `DPOSettings`, `PPOSettings`, ..., `OptimizerSettings`, `StepOptions`) and the
LoRA settings check themselves when the config is built; what is left here are the
pipeline's own fields and the rules that combine several of them.
"""

import os
from typing import Any

import jax

from ..data._preferences import PREFERENCE_FORMATS
from ..data._prompts import PROMPT_FORMATS
from ..losses import (
    DPO_BATCH_LOSS_TYPES,
    ENSEMBLE_MODES,
    KTO_LOSS_TYPES,
    PRM_AGGREGATIONS,
)
from ..train import SampledSettings
from ..train._judge import JUDGE_SCORES
from ..train._prm import PRM_SCORES
from ._config import (
    REWARD_SOURCES,
    BatchStageConfig,
    ConfigError,
    OpsConfig,
    RolloutStageConfig,
)
from ._pipeline_config import (
    PipelineConfig,
)
from ._registry import find_stage, stage_names, stages
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

DATA_FORMATS: tuple[str, ...] = ("auto", *PREFERENCE_FORMATS, *PROMPT_FORMATS)
"""The values of `data.format`: preference formats for sft/reward/dpo, prompt formats for
grpo, `auto` to detect from the first record."""
JUDGE_MODELS: tuple[str, ...] = ("base", "sft")
"""The stages a judge can be taken from (`judge.model`), besides a checkpoint directory."""


def teacher_stages() -> tuple[str, ...]:
    """The stages `distill.teacher` may name: registered stages that train a policy on the
    built-in task (SFT, the student's start, and distillation itself excepted)."""
    return tuple(
        st.name
        for st in stages()
        if st.trains_policy and st.builtin is not None and st.name not in ("sft", "distill")
    )


def _fail(name: str, value: Any, why: str) -> None:
    raise ConfigError(f"{name}={value!r}: {why}")


def _check_options(name: str, c: Any, rows: int) -> None:
    """The step options a pipeline run can use: one device, no donation, micro-batches
    that divide the `rows` of each step."""
    o = c.options
    if o.axis_name is not None:
        _fail(f"{name}.options.axis_name", o.axis_name, "must be None (runs use one device)")
    if o.donate is not False:
        _fail(
            f"{name}.options.donate",
            o.donate,
            "must be false (the run keeps each iteration's state for rollback)",
        )
    if rows % o.micro_batches:
        _fail(
            f"{name}.options.micro_batches",
            o.micro_batches,
            f"must divide the {rows} rows (or groups) of each step",
        )


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        _fail(name, value, f"must be one of {', '.join(choices)}")


def _at_least(name: str, value: Any, low: int | float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= low:
        _fail(name, value, f"must be >= {low}")


def _positive(name: str, value: int) -> None:
    if value < 1:
        _fail(name, value, "must be >= 1")


def _divides(name: str, value: int, devices: int) -> None:
    if value % devices:
        _fail(name, value, f"must divide by the device count {devices}")


def validate_config(cfg: PipelineConfig, *, device_count: int = 1) -> None:
    """Check every field before anything is loaded or compiled; raise `ConfigError`
    naming the first bad field and its value."""
    m = cfg.model
    if m.source != "builtin" and not os.path.exists(m.source):
        _fail("model.source", m.source, "no such file or directory")
    if m.tokenizer is not None and not os.path.isfile(m.tokenizer):
        _fail("model.tokenizer", m.tokenizer, "no such file")
    if m.source.endswith(".bin") and m.tokenizer is None:
        _fail("model.tokenizer", None, "a llama2.c checkpoint needs a tokenizer file")
    dc = cfg.data
    if dc.path is not None and not os.path.isfile(dc.path):
        _fail("data.path", dc.path, "is a directory" if os.path.isdir(dc.path) else "no such file")
    _choice("data.format", dc.format, DATA_FORMATS)
    _at_least("data.seed", dc.seed, 0)
    if dc.limit < 0:
        _fail("data.limit", dc.limit, "must be >= 0 (0: all records)")
    if not 0 < dc.heldout_fraction < 1:
        _fail("data.heldout_fraction", dc.heldout_fraction, "must be in (0, 1)")
    problems = ("identical", "empty", "exact_duplicate", "duplicate_prompt", "long_prompt")
    for f in dc.filter:
        if f not in problems:
            _fail("data.filter", dc.filter, f"unknown problem {f!r} (known: {', '.join(problems)})")
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
    if not all(isinstance(x, str) and x for x in s.stop_strings):
        _fail("sampling.stop_strings", s.stop_strings, "must be non-empty strings")
    validate_ops(cfg.ops)
    names = stage_names()
    for st in cfg.stages:
        if st not in names:
            _fail("stages", cfg.stages, f"unknown stage {st!r} (known: {', '.join(names)})")
        if cfg.data.path is None and find_stage(st).builtin is None:
            _fail("stages", cfg.stages, f"{st} runs on a data file only (data.path)")
    for st in ("ppo", "grpo"):
        c = getattr(cfg, st)
        if st not in cfg.stages or c.reward_model:
            continue
        if c.reward_source == "reward_model" and "reward" not in cfg.stages:
            _fail(
                "stages",
                cfg.stages,
                f"{st} with {st}.reward_source=reward_model needs the "
                f"reward stage (or {st}.reward_model=DIR)",
            )
        if c.reward_source == "prm":
            _fail(
                f"{st}.reward_model",
                "",
                "reward_source=prm needs the directory of a "
                "process reward model (rlhf_eqx prm writes <run>/prm/hf)",
            )
    uses_judge = any(
        st in cfg.stages and getattr(cfg, st).reward_source == "judge" for st in ("ppo", "grpo")
    )
    if uses_judge:
        validate_judge(cfg.judge)
    t = cfg.distill.teacher
    if "distill" in cfg.stages and t in teacher_stages():
        if cfg.data.path is not None:
            _fail("distill.teacher", t, "on a data file the teacher is a checkpoint directory")
        if t not in cfg.stages:
            _fail("distill.teacher", t, f"the teacher stage {t!r} is not among the stages")
    if cfg.data.path is None:  # the built-in task runs each stage's prerequisites first
        for st in cfg.stages:
            missing = [
                p for p in find_stage(st).prerequisites(cfg) if p not in (*cfg.stages, "sft")
            ]
            if missing:
                _fail("stages", cfg.stages, f"{st} needs the {missing[0]} stage")
    if not 0 <= cfg.label_noise < 0.5:
        _fail("label_noise", cfg.label_noise, "must be in [0, 0.5)")
    _positive("eval_samples", cfg.eval_samples)
    for key in dict.fromkeys(st.key for st in stages()):
        c = getattr(cfg, key)
        validate_stage(key, c, device_count=device_count)
        if isinstance(c, BatchStageConfig):
            used = any(st.key == key and st.name in cfg.stages for st in stages())
            if used and c.max_length <= s.prompt_length:
                _fail(
                    f"{key}.max_length",
                    c.max_length,
                    f"must exceed sampling.prompt_length={s.prompt_length}",
                )


def validate_judge(j) -> None:
    """Check the judge settings (`judge.*`)."""
    if j.model not in JUDGE_MODELS and not os.path.isdir(j.model):
        _fail("judge.model", j.model, f"must be one of {', '.join(JUDGE_MODELS)} or a directory")
    try:
        j.template.format_map({"prompt": "", "completion": ""})
    except (KeyError, IndexError, ValueError) as e:
        _fail(
            "judge.template",
            j.template,
            f"a format string with {{prompt}} and {{completion}} only (double literal braces): {e}",
        )
    for name in ("yes", "no"):
        if not getattr(j, name):
            _fail(f"judge.{name}", getattr(j, name), "must be a non-empty verdict token")
    _choice("judge.score", j.score, JUDGE_SCORES)


def validate_ops(o: OpsConfig) -> None:
    """Check the operations settings of a run (`ops.*`); `ConfigError` naming the field."""
    _at_least("ops.seed", o.seed, 0)
    if o.checkpoint_every < 0:
        _fail("ops.checkpoint_every", o.checkpoint_every, "must be >= 0")
    _positive("ops.keep", o.keep)
    if o.eval_every < 0:
        _fail("ops.eval_every", o.eval_every, "must be >= 0")
    _positive("ops.log_every", o.log_every)
    _positive("ops.compilation_cache_max_mb", o.compilation_cache_max_mb)
    _at_least("ops.max_rollbacks", o.max_rollbacks, 0)
    if not o.lr_backoff > 1:
        _fail("ops.lr_backoff", o.lr_backoff, "must be > 1")
    if not o.loss_spike > 1:
        _fail("ops.loss_spike", o.loss_spike, "must be > 1")
    if not o.kl_spike > 0:
        _fail("ops.kl_spike", o.kl_spike, "must be > 0")
    ps = o.profile_steps
    if ps and (len(ps) != 2 or not 0 <= ps[0] < ps[1]):
        _fail("ops.profile_steps", ps, "must be empty or [a, b] with 0 <= a < b")


def validate_stage(name: str, c: Any, *, device_count: int = 1) -> None:
    """Check one stage's settings (`SFTConfig`, `RewardConfig`, `DPOConfig`, `PPOConfig`,
    `GRPOConfig`) under the field prefix `name`; `ConfigError` naming the field."""
    if isinstance(c, BatchStageConfig):
        _positive(f"{name}.steps", c.steps)
        _positive(f"{name}.batch_size", c.batch_size)
        _positive(f"{name}.max_length", c.max_length)
        _divides(f"{name}.batch_size", c.batch_size, device_count)
        _check_options(name, c, c.batch_size)
    if isinstance(c, RolloutStageConfig):
        for field in ("rollouts", "prompts_per_rollout", "epochs"):
            _positive(f"{name}.{field}", getattr(c, field))
        _choice(f"{name}.reward_source", c.reward_source, REWARD_SOURCES)
        if c.reward_model and not os.path.isdir(c.reward_model):
            _fail(f"{name}.reward_model", c.reward_model, "no such directory")
        if not c.kl_target > 0:
            _fail(f"{name}.kl_target", c.kl_target, "must be > 0")
    if isinstance(c, SFTConfig):
        _positive(f"{name}.samples", c.samples)
    if isinstance(c, RewardConfig):
        _positive(f"{name}.pairs_per_prompt", c.pairs_per_prompt)
        if not 0 < c.heldout_fraction < 1:
            _fail(f"{name}.heldout_fraction", c.heldout_fraction, "must be in (0, 1)")
        _at_least(f"{name}.eval_every", c.eval_every, 0)
        _positive(f"{name}.ensemble", c.ensemble)
        _choice(f"{name}.ensemble_mode", c.ensemble_mode, ENSEMBLE_MODES)
        _at_least(f"{name}.ensemble_penalty", c.ensemble_penalty, 0)
    if isinstance(c, PRMConfig):
        if not c.separator:
            _fail(f"{name}.separator", c.separator, "must be a non-empty string")
        _choice(f"{name}.aggregation", c.aggregation, PRM_AGGREGATIONS)
        _choice(f"{name}.score", c.score, PRM_SCORES)
    if isinstance(c, DPOConfig):
        if c.reference == "model":
            _fail(
                f"{name}.reference",
                c.reference,
                "must be cached or none (the runs cache the reference log-probabilities)",
            )
        _positive(f"{name}.rounds", c.rounds)
        if c.samples < 2:
            _fail(f"{name}.samples", c.samples, "must be >= 2 (pairs need two completions)")
        if c.packing and c.loss_type in DPO_BATCH_LOSS_TYPES:
            why = f"loss_type={c.loss_type!r} sorts over a batch's pairs and needs unpacked batches"
            _fail(f"{name}.packing", c.packing, why)
    if isinstance(c, DistillConfig):
        if not 0 <= c.beta <= 1:
            _fail(f"{name}.beta", c.beta, "must be in [0, 1] (0: forward KL, 1: reverse KL)")
        if not 0 <= c.lmbda <= 1:
            _fail(f"{name}.lmbda", c.lmbda, "must be in [0, 1]")
        if not c.temperature > 0:
            _fail(f"{name}.temperature", c.temperature, "must be > 0")
        _positive(f"{name}.samples", c.samples)
        if c.teacher not in teacher_stages() and not os.path.isdir(c.teacher):
            _fail(
                f"{name}.teacher",
                c.teacher,
                f"must be one of {', '.join(teacher_stages())} or a checkpoint directory",
            )
    if isinstance(c, KTOConfig):
        if not c.beta > 0:
            _fail(f"{name}.beta", c.beta, "must be > 0")
        _at_least(f"{name}.desirable_weight", c.desirable_weight, 0)
        _at_least(f"{name}.undesirable_weight", c.undesirable_weight, 0)
        _choice(f"{name}.loss_type", c.loss_type, KTO_LOSS_TYPES)
        if c.samples < 2:
            _fail(f"{name}.samples", c.samples, "must be >= 2")
    if isinstance(c, PPOConfig):
        _positive(f"{name}.minibatches", c.minibatches)
        if c.prompts_per_rollout % c.minibatches:
            _fail(
                f"{name}.minibatches",
                c.minibatches,
                f"must divide {name}.prompts_per_rollout={c.prompts_per_rollout}",
            )
        _divides(
            f"{name}.prompts_per_rollout", c.prompts_per_rollout // c.minibatches, device_count
        )
        _at_least(f"{name}.kl_coef", c.kl_coef, 0)
        _check_options(name, c, c.prompts_per_rollout // c.minibatches)
        if not 0 <= c.gamma <= 1:
            _fail(f"{name}.gamma", c.gamma, "must be in [0, 1]")
        if not 0 <= c.lam <= 1:
            _fail(f"{name}.lam", c.lam, "must be in [0, 1]")
    if isinstance(c, GRPOConfig):
        if c.group_size < 2:
            _fail(f"{name}.group_size", c.group_size, "must be >= 2")
        _divides(f"{name}.prompts_per_rollout", c.prompts_per_rollout * c.group_size, device_count)
        _check_options(name, c, c.prompts_per_rollout)
        _at_least(f"{name}.staleness", c.staleness, 0)
        if not isinstance(c.overlap, bool):
            _fail(f"{name}.overlap", c.overlap, "must be true or false")
        _at_least(f"{name}.sampler_device", c.sampler_device, -1)
        local = jax.local_devices()
        if c.sampler_device >= len(local):
            _fail(
                f"{name}.sampler_device",
                c.sampler_device,
                f"this process has {len(local)} local device(s) ({local[0].platform}); on CPU, "
                "XLA_FLAGS=--xla_force_host_platform_device_count=2 makes two",
            )
        _at_least(f"{name}.dynamic_sampling", c.dynamic_sampling, 0)
        _at_least(f"{name}.overlong_buffer", c.overlong_buffer, 0)
