"""Validation of a `PipelineConfig` before anything is loaded or compiled: one
`ConfigError` naming the first bad field and its value."""

import os
from typing import Any

from ..losses import DPO_BATCH_LOSS_TYPES
from ._config import (
    BatchStageConfig,
    ConfigError,
    LoRASettings,
    OptimConfig,
    PipelineConfig,
    RolloutStageConfig,
)


def _fail(name: str, value: Any, why: str) -> None:
    raise ConfigError(f"{name}={value!r}: {why}")


def _check_optim(name: str, o: OptimConfig) -> None:
    if not o.lr > 0:
        _fail(f"{name}.lr", o.lr, "must be > 0")
    if not 0 <= o.warmup_ratio < 1:
        _fail(f"{name}.warmup_ratio", o.warmup_ratio, "must be in [0, 1)")
    if not o.max_grad_norm > 0:
        _fail(f"{name}.max_grad_norm", o.max_grad_norm, "must be > 0")
    if o.weight_decay < 0:
        _fail(f"{name}.weight_decay", o.weight_decay, "must be >= 0")
    if o.schedule not in ("cosine", "linear", "constant"):
        _fail(f"{name}.schedule", o.schedule, "must be cosine, linear or constant")


def _check_lora(name: str, lo: LoRASettings) -> None:
    if lo.rank < 0:
        _fail(f"{name}.rank", lo.rank, "must be >= 0 (0: no LoRA)")
    if lo.rank and not lo.alpha > 0:
        _fail(f"{name}.alpha", lo.alpha, "must be > 0")
    if not 0 <= lo.dropout < 1:
        _fail(f"{name}.dropout", lo.dropout, "must be in [0, 1)")
    known = {"q", "k", "v", "o", "gate", "up", "down"}
    for t in lo.targets:
        if t not in known:
            _fail(
                f"{name}.targets", lo.targets, f"unknown projection {t!r} (known: {sorted(known)})"
            )


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
        _fail("data.path", dc.path, "no such file")
    if dc.limit < 0:
        _fail("data.limit", dc.limit, "must be >= 0 (0: all records)")
    if not 0 < dc.heldout_fraction < 1:
        _fail("data.heldout_fraction", dc.heldout_fraction, "must be in (0, 1)")
    problems = ("identical", "empty", "exact_duplicate", "duplicate_prompt")
    for f in dc.filter:
        if f not in problems:
            _fail("data.filter", dc.filter, f"unknown problem {f!r} (known: {', '.join(problems)})")
    s = cfg.sampling
    _positive("sampling.prompt_length", s.prompt_length)
    _positive("sampling.max_new_tokens", s.max_new_tokens)
    if s.max_new_tokens > 512:
        _fail("sampling.max_new_tokens", s.max_new_tokens, "must be <= 512")
    if s.temperature <= 0:
        _fail("sampling.temperature", s.temperature, "must be > 0 for training rollouts")
    if not all(isinstance(x, str) and x for x in s.stop_strings):
        _fail("sampling.stop_strings", s.stop_strings, "must be non-empty strings")
    o = cfg.ops
    if o.checkpoint_every < 0:
        _fail("ops.checkpoint_every", o.checkpoint_every, "must be >= 0")
    _positive("ops.keep", o.keep)
    if o.eval_every < 0:
        _fail("ops.eval_every", o.eval_every, "must be >= 0")
    if not o.lr_backoff > 1:
        _fail("ops.lr_backoff", o.lr_backoff, "must be > 1")
    if not o.loss_spike > 1:
        _fail("ops.loss_spike", o.loss_spike, "must be > 1")
    if not o.kl_spike > 0:
        _fail("ops.kl_spike", o.kl_spike, "must be > 0")
    ps = o.profile_steps
    if ps and (len(ps) != 2 or not 0 <= ps[0] < ps[1]):
        _fail("ops.profile_steps", ps, "must be empty or [a, b] with 0 <= a < b")
    known = ("sft", "reward", "ppo", "dpo", "grpo", "online-dpo")
    for st in cfg.stages:
        if st not in known:
            _fail("stages", cfg.stages, f"unknown stage {st!r} (known: {', '.join(known)})")
    for st in ("ppo", "online-dpo"):
        if st in cfg.stages and "reward" not in cfg.stages:
            _fail("stages", cfg.stages, f"{st} needs the reward stage")
    if not 0 <= cfg.label_noise < 0.5:
        _fail("label_noise", cfg.label_noise, "must be in [0, 0.5)")
    _positive("eval_samples", cfg.eval_samples)
    for name, c in (
        ("sft", cfg.sft),
        ("reward", cfg.reward),
        ("dpo", cfg.dpo),
        ("ppo", cfg.ppo),
        ("grpo", cfg.grpo),
    ):
        _check_optim(f"{name}.optim", c.optim)
        if hasattr(c, "lora"):
            _check_lora(f"{name}.lora", c.lora)
        if isinstance(c, BatchStageConfig):
            used = name in cfg.stages or (name == "dpo" and "online-dpo" in cfg.stages)
            if used and c.max_length <= s.prompt_length:
                _fail(
                    f"{name}.max_length",
                    c.max_length,
                    f"must exceed sampling.prompt_length={s.prompt_length}",
                )
            _positive(f"{name}.steps", c.steps)
            _positive(f"{name}.batch_size", c.batch_size)
            _divides(f"{name}.batch_size", c.batch_size, device_count)
        if isinstance(c, RolloutStageConfig):
            for field in ("rollouts", "prompts_per_rollout", "epochs"):
                _positive(f"{name}.{field}", getattr(c, field))
            if not 0 < c.clip < 1:
                _fail(f"{name}.clip", c.clip, "must be in (0, 1)")
            if not c.kl_target > 0:
                _fail(f"{name}.kl_target", c.kl_target, "must be > 0")
    _positive("sft.samples", cfg.sft.samples)
    _positive("reward.pairs_per_prompt", cfg.reward.pairs_per_prompt)
    if not 0 < cfg.reward.heldout_fraction < 1:
        _fail("reward.heldout_fraction", cfg.reward.heldout_fraction, "must be in (0, 1)")
    d = cfg.dpo
    if not d.beta > 0:
        _fail("dpo.beta", d.beta, "must be > 0")
    _positive("dpo.rounds", d.rounds)
    if d.samples < 2:
        _fail("dpo.samples", d.samples, "must be >= 2 (pairs need two completions)")
    if d.packing and d.loss_type in DPO_BATCH_LOSS_TYPES:
        why = f"loss_type={d.loss_type!r} sorts over a batch's pairs and needs unpacked batches"
        _fail("dpo.packing", d.packing, why)
    p = cfg.ppo
    _positive("ppo.minibatches", p.minibatches)
    if p.prompts_per_rollout % p.minibatches:
        _fail(
            "ppo.minibatches",
            p.minibatches,
            f"must divide ppo.prompts_per_rollout={p.prompts_per_rollout}",
        )
    _divides("ppo.prompts_per_rollout", p.prompts_per_rollout // p.minibatches * 1, device_count)
    if p.vf_coef < 0 or p.ent_coef < 0 or p.kl_coef < 0:
        _fail("ppo.vf_coef/ent_coef/kl_coef", (p.vf_coef, p.ent_coef, p.kl_coef), "must be >= 0")
    if not 0 <= p.gamma <= 1:
        _fail("ppo.gamma", p.gamma, "must be in [0, 1]")
    if not 0 <= p.lam <= 1:
        _fail("ppo.lam", p.lam, "must be in [0, 1]")
    g = cfg.grpo
    if g.group_size < 2:
        _fail("grpo.group_size", g.group_size, "must be >= 2")
    _divides("grpo.prompts_per_rollout", g.prompts_per_rollout * g.group_size, device_count)
    if g.beta < 0:
        _fail("grpo.beta", g.beta, "must be >= 0")
