"""Typed run configuration: frozen dataclasses, file loading, dotted overrides, validation.

One `PipelineConfig` holds every stage's settings. The defaults of the stage configs are
the ones users of the field expect (TRL / the papers); `animal_task_config()` is the
built-in task's configuration, which overrides some of them and lists which in its
`notes` field.
"""

import dataclasses
import json
import os
import types
import typing
from collections.abc import Sequence
from typing import Any

__all__ = [
    "ConfigError",
    "ModelConfig",
    "DataConfig",
    "LoRASettings",
    "OptimConfig",
    "SamplingConfig",
    "OpsConfig",
    "SFTConfig",
    "RewardConfig",
    "DPOConfig",
    "PPOConfig",
    "GRPOConfig",
    "PipelineConfig",
    "animal_task_config",
    "apply_overrides",
    "config_from_dict",
    "config_to_dict",
    "load_config",
    "validate_config",
]


class ConfigError(ValueError):
    """An invalid configuration value; the message names the field and the value."""


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
    (`data.filter_preferences`)."""

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
    weight instead."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.05
    targets: tuple[str, ...] = ("q", "v")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup (`warmup_ratio` of the steps) and cosine decay, global-norm
    clipping at `max_grad_norm`."""

    lr: float = 1e-5
    warmup_ratio: float = 0.1
    max_grad_norm: float = 1.0
    weight_decay: float = 0.0
    schedule: str = "cosine"


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Rollouts and evaluation samples: prompts left-padded (or rejected) at
    `prompt_length` tokens, `max_new_tokens` sampled at `temperature` (the same
    temperature is used for the steps' log-probabilities). Each completion stops at EOS
    (and BOS) and, when `stop_strings` are given, is cut where one first appears: none
    for the story task; `("\\n\\nHuman:",)` for HH-RLHF-style chat prompts, so that a
    completion that starts the next human turn ends there."""

    prompt_length: int = 32
    max_new_tokens: int = 40
    temperature: float = 1.0
    stop_strings: tuple[str, ...] = ()


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


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Supervised fine-tuning on best-of-`samples` completions (by noisy labels) of the
    base model for the training prompts."""

    steps: int = 100
    batch_size: int = 16
    samples: int = 4
    max_length: int = 80
    optim: OptimConfig = OptimConfig(lr=2e-5)
    lora: LoRASettings = LoRASettings()


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """Reward model (Bradley-Terry) on noisily labelled pairs of policy samples."""

    steps: int = 100
    batch_size: int = 16
    pairs_per_prompt: int = 4
    max_length: int = 80
    heldout_fraction: float = 0.2
    optim: OptimConfig = OptimConfig(lr=1e-5)


@dataclasses.dataclass(frozen=True)
class DPOConfig:
    """DPO (Rafailov et al. 2023) with a cached reference, over `rounds` rounds of fresh
    samples (`rounds=1`: offline on the first samples; online DPO resamples each round)."""

    beta: float = 0.1
    loss_type: str = "sigmoid"
    rounds: int = 3
    steps: int = 20
    batch_size: int = 16
    samples: int = 4
    max_length: int = 80
    optim: OptimConfig = OptimConfig(lr=1e-5)
    lora: LoRASettings = LoRASettings()


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    """PPO (Schulman et al. 2017; Ouyang et al. 2022) with a value model and KL-shaped
    rewards; `epochs` x `minibatches` updates per rollout of `prompts_per_rollout`
    completions; early stop when the per-token KL to the reference exceeds `kl_target`."""

    rollouts: int = 20
    prompts_per_rollout: int = 32
    epochs: int = 2
    minibatches: int = 2
    clip: float = 0.2
    vf_coef: float = 0.5
    ent_coef: float = 0.01
    gamma: float = 1.0
    lam: float = 0.95
    kl_coef: float = 0.05
    kl_target: float = 0.05
    optim: OptimConfig = OptimConfig(lr=1e-5)
    lora: LoRASettings = LoRASettings()


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """GRPO (Shao et al. 2024) with the task's verifiable reward: `group_size` samples per
    prompt, group-normalised advantages, k3 KL to the reference with weight `beta`; early
    stop when the per-token KL exceeds `kl_target`."""

    rollouts: int = 20
    prompts_per_rollout: int = 8
    group_size: int = 8
    epochs: int = 1
    clip: float = 0.2
    beta: float = 0.04
    kl_target: float = 0.05
    optim: OptimConfig = OptimConfig(lr=1e-5)
    lora: LoRASettings = LoRASettings()


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """A whole pipeline: SFT, then reward model -> PPO, DPO and GRPO from SFT.

    `stages` selects stages (`"sft"` always runs first); `label_noise` is the
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
    stages: tuple[str, ...] = ("sft", "reward", "ppo", "dpo", "grpo")
    label_noise: float = 0.1
    eval_samples: int = 8
    out: str = ""
    notes: str = ""


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
        sft=SFTConfig(steps=30, batch_size=16, samples=2, optim=OptimConfig(lr=5e-4), lora=lora),
        reward=RewardConfig(
            steps=80, batch_size=32, pairs_per_prompt=12, optim=OptimConfig(lr=1e-3)
        ),
        dpo=DPOConfig(
            beta=0.1,
            rounds=3,
            steps=20,
            batch_size=16,
            samples=4,
            optim=OptimConfig(lr=5e-4),
            lora=lora,
        ),
        ppo=PPOConfig(
            rollouts=16,
            prompts_per_rollout=64,
            epochs=2,
            minibatches=2,
            kl_coef=0.02,
            kl_target=1.0,
            optim=OptimConfig(lr=1e-3),
            lora=lora,
        ),
        grpo=GRPOConfig(
            rollouts=12,
            prompts_per_rollout=8,
            group_size=8,
            beta=0.02,
            kl_target=1.0,
            optim=OptimConfig(lr=2e-3),
            lora=lora,
        ),
        notes=_TASK_NOTES,
    )


# --- dict / file / overrides -----------------------------------------------------------


def config_to_dict(cfg: Any) -> dict:
    """A JSON-friendly dict of a config dataclass (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def _convert(value: Any, tp: Any, name: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{name}: expected a mapping, got {value!r}")
        return config_from_dict(tp, value, prefix=name + ".")
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(value, a, name)
            except ConfigError:
                pass
        raise ConfigError(f"{name}={value!r}: expected {tp}")
    if origin is tuple:
        if isinstance(value, str) and name.endswith("stop_strings"):
            # From the command line: comma-separated, with escapes (`\\n\\nHuman:`).
            value = [v.encode().decode("unicode_escape") for v in value.split(",") if v]
        elif isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name}={value!r}: expected a list")
        (item,) = typing.get_args(tp)[:1]
        return tuple(_convert(v, item, name) for v in value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{name}={value!r}: expected true or false")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{name}={value!r}: expected an integer")
        try:
            if isinstance(value, str) or float(value) == int(value):
                return int(value)
        except (TypeError, ValueError):
            pass
        raise ConfigError(f"{name}={value!r}: expected an integer")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{name}={value!r}: expected a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name}={value!r}: expected a number") from None
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{name}={value!r}: expected a string")
        return value
    raise ConfigError(f"{name}: unsupported field type {tp}")


def config_from_dict(cls: type, d: dict, *, prefix: str = "") -> Any:
    """Build config dataclass `cls` from a (nested) dict; unknown fields are errors,
    missing ones take their defaults."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in d:
        if key not in names:
            raise ConfigError(f"{prefix}{key}: unknown field (known: {', '.join(sorted(names))})")
    kwargs = {k: _convert(v, hints[k], prefix + k) for k, v in d.items()}
    return cls(**kwargs)


def load_config(path: str, cls: type = PipelineConfig, *, base: Any = None) -> Any:
    """Read a JSON (or, with PyYAML installed, YAML) config file over `base` (default:
    the class defaults)."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    with open(path) as f:
        text = f.read()
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            raise ConfigError(f"{path}: YAML configs need PyYAML (pip install pyyaml)") from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            line = f":{mark.line + 1}" if mark is not None else ""
            why = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ConfigError(f"{path}{line}: invalid YAML ({why})") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a mapping")
    merged = _deep_merge(config_to_dict(base if base is not None else cls()), data)
    return config_from_dict(cls, merged)


def _deep_merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = (
            _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        )
    return out


def apply_overrides(cfg: Any, overrides: Sequence[str]) -> Any:
    """Apply dotted `field.sub=value` overrides (e.g. `"dpo.beta=0.2"`); values are parsed
    by the field's type (lists comma-separated)."""
    d = config_to_dict(cfg)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected FIELD=VALUE, e.g. dpo.beta=0.2")
        path, value = item.split("=", 1)
        parts = path.strip().split(".")
        node = d
        for i, p in enumerate(parts[:-1]):
            if not isinstance(node.get(p), dict):
                raise ConfigError(f"{'.'.join(parts[: i + 1])}: unknown config section")
            node = node[p]
        if parts[-1] not in node:
            raise ConfigError(f"{path}: unknown field")
        node[parts[-1]] = None if value.lower() == "none" else value
    return config_from_dict(type(cfg), d)


# --- validation ------------------------------------------------------------------------


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
        used = name in cfg.stages or (name == "dpo" and "online-dpo" in cfg.stages)
        if used and hasattr(c, "max_length") and c.max_length <= s.prompt_length:
            _fail(
                f"{name}.max_length",
                c.max_length,
                f"must exceed sampling.prompt_length={s.prompt_length}",
            )
    for name in ("steps", "batch_size", "samples"):
        _positive(f"sft.{name}", getattr(cfg.sft, name))
    _divides("sft.batch_size", cfg.sft.batch_size, device_count)
    _positive("reward.steps", cfg.reward.steps)
    _positive("reward.batch_size", cfg.reward.batch_size)
    _divides("reward.batch_size", cfg.reward.batch_size, device_count)
    _positive("reward.pairs_per_prompt", cfg.reward.pairs_per_prompt)
    if not 0 < cfg.reward.heldout_fraction < 1:
        _fail("reward.heldout_fraction", cfg.reward.heldout_fraction, "must be in (0, 1)")
    d = cfg.dpo
    if not d.beta > 0:
        _fail("dpo.beta", d.beta, "must be > 0")
    for name in ("rounds", "steps", "batch_size"):
        _positive(f"dpo.{name}", getattr(d, name))
    if d.samples < 2:
        _fail("dpo.samples", d.samples, "must be >= 2 (pairs need two completions)")
    _divides("dpo.batch_size", d.batch_size, device_count)
    p = cfg.ppo
    for name in ("rollouts", "prompts_per_rollout", "epochs", "minibatches"):
        _positive(f"ppo.{name}", getattr(p, name))
    if p.prompts_per_rollout % p.minibatches:
        _fail(
            "ppo.minibatches",
            p.minibatches,
            f"must divide ppo.prompts_per_rollout={p.prompts_per_rollout}",
        )
    _divides("ppo.prompts_per_rollout", p.prompts_per_rollout // p.minibatches * 1, device_count)
    if not 0 < p.clip < 1:
        _fail("ppo.clip", p.clip, "must be in (0, 1)")
    if p.vf_coef < 0 or p.ent_coef < 0 or p.kl_coef < 0:
        _fail("ppo.vf_coef/ent_coef/kl_coef", (p.vf_coef, p.ent_coef, p.kl_coef), "must be >= 0")
    if not 0 <= p.gamma <= 1:
        _fail("ppo.gamma", p.gamma, "must be in [0, 1]")
    if not 0 <= p.lam <= 1:
        _fail("ppo.lam", p.lam, "must be in [0, 1]")
    if not p.kl_target > 0:
        _fail("ppo.kl_target", p.kl_target, "must be > 0")
    g = cfg.grpo
    for name in ("rollouts", "prompts_per_rollout", "epochs"):
        _positive(f"grpo.{name}", getattr(g, name))
    if g.group_size < 2:
        _fail("grpo.group_size", g.group_size, "must be >= 2")
    _divides("grpo.prompts_per_rollout", g.prompts_per_rollout * g.group_size, device_count)
    if not 0 < g.clip < 1:
        _fail("grpo.clip", g.clip, "must be in (0, 1)")
    if g.beta < 0:
        _fail("grpo.beta", g.beta, "must be >= 0")
    if not g.kl_target > 0:
        _fail("grpo.kl_target", g.kl_target, "must be > 0")
