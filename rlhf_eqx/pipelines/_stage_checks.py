"""The checks of one stage's settings (`validate_stage`), by the kind of config: the
fields every batch or rollout stage shares, then each stage's own; the settings a stage
inherits but does not use (`unused_fields`) must keep their defaults.

The settings records a stage embeds (`DPOSettings`, `GRPOSettings`, `OptimizerSettings`,
`StepOptions`, `LoRASettings`, `RolloutCorrection`) check themselves when the config is
built; what is here are the pipeline's own fields and the rules that combine several."""

import os
from typing import Any

import jax

from ..losses import DPO_BATCH_LOSS_TYPES, ENSEMBLE_MODES, KTO_LOSS_TYPES, PRM_AGGREGATIONS
from ..train import PRM_SCORES
from ._config import REWARD_SOURCES, BatchStageConfig, RolloutStageConfig
from ._field_checks import (
    _above,
    _at_least,
    _check_options,
    _choice,
    _divides,
    _fail,
    _positive,
    _within,
    check_unused,
)
from ._registry import stages
from ._stage_configs import (
    MAX_STALENESS,
    DistillConfig,
    DPOConfig,
    GRPOConfig,
    KTOConfig,
    PPOConfig,
    PRMConfig,
    RewardConfig,
    SFTConfig,
)


def teacher_stages() -> tuple[str, ...]:
    """The stages `distill.teacher` may name: registered stages that train a policy on the
    built-in task (SFT, the student's start, and distillation itself excepted)."""
    return tuple(
        st.name
        for st in stages()
        if st.trains_policy and st.builtin is not None and st.name not in ("sft", "distill")
    )


def _shared(name: str, c: Any, device_count: int) -> None:
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
        _above(f"{name}.kl_target", c.kl_target, 0)


def _batch_stages(name: str, c: Any) -> None:
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
        _within(f"{name}.beta", c.beta, 0, 1, " (0: forward KL, 1: reverse KL)")
        _within(f"{name}.lmbda", c.lmbda, 0, 1)
        _above(f"{name}.temperature", c.temperature, 0)
        _positive(f"{name}.samples", c.samples)
        gguf = c.teacher.lower().endswith(".gguf") and os.path.isfile(c.teacher)
        if c.teacher not in teacher_stages() and not os.path.isdir(c.teacher) and not gguf:
            _fail(
                f"{name}.teacher",
                c.teacher,
                f"must be one of {', '.join(teacher_stages())}, a checkpoint directory or a "
                ".gguf file",
            )
    if isinstance(c, KTOConfig):
        _above(f"{name}.beta", c.beta, 0)
        _at_least(f"{name}.desirable_weight", c.desirable_weight, 0)
        _at_least(f"{name}.undesirable_weight", c.undesirable_weight, 0)
        _choice(f"{name}.loss_type", c.loss_type, KTO_LOSS_TYPES)
        if c.samples < 2:
            _fail(f"{name}.samples", c.samples, "must be >= 2")


def _ppo(name: str, c: PPOConfig, device_count: int) -> None:
    _positive(f"{name}.minibatches", c.minibatches)
    if c.prompts_per_rollout % c.minibatches:
        _fail(
            f"{name}.minibatches",
            c.minibatches,
            f"must divide {name}.prompts_per_rollout={c.prompts_per_rollout}",
        )
    _divides(f"{name}.prompts_per_rollout", c.prompts_per_rollout // c.minibatches, device_count)
    _at_least(f"{name}.kl_coef", c.kl_coef, 0)
    _check_options(name, c, c.prompts_per_rollout // c.minibatches)
    _within(f"{name}.gamma", c.gamma, 0, 1)
    _within(f"{name}.lam", c.lam, 0, 1)


def _grpo(name: str, c: GRPOConfig, device_count: int) -> None:
    if c.group_size < 2:
        _fail(f"{name}.group_size", c.group_size, "must be >= 2")
    _divides(f"{name}.prompts_per_rollout", c.prompts_per_rollout * c.group_size, device_count)
    _check_options(name, c, c.prompts_per_rollout)
    _at_least(f"{name}.staleness", c.staleness, 0)
    if c.staleness and c.staleness >= c.rollouts:
        _fail(
            f"{name}.staleness",
            c.staleness,
            f"must be < {name}.rollouts={c.rollouts} (rollout r samples from the policy of "
            f"update r - staleness: with {c.staleness}, every rollout would come from the "
            "initial policy)",
        )
    if c.staleness > MAX_STALENESS:
        _fail(
            f"{name}.staleness",
            c.staleness,
            f"must be <= {MAX_STALENESS} (each stale policy's trainable parameters are held "
            "in memory and in every checkpoint)",
        )
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


def check_stage(name: str, c: Any, *, device_count: int = 1) -> None:
    """Check one stage's settings under the field prefix `name` (see `validate_stage`)."""
    check_unused(name, c)
    _shared(name, c, device_count)
    _batch_stages(name, c)
    if isinstance(c, PPOConfig):
        _ppo(name, c, device_count)
    if isinstance(c, GRPOConfig):
        _grpo(name, c, device_count)
