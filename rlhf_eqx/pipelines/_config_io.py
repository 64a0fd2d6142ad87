"""Configs to and from dicts, JSON / YAML files and dotted command-line overrides."""

import dataclasses
import difflib
import functools
import json
import os
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ._config import (
    ConfigError,
    field_message,
    prefixed,
)
from ._pipeline_config import (
    PipelineConfig,
    animal_task_config,
)
from ._registry import find_stage, section_types, stages as registered_stages


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """The resolved field types of the config class `cls` (read once per class)."""
    return typing.get_type_hints(cls)


@functools.cache
def _settings_of(cls: type) -> tuple[dataclasses.Field, ...]:
    return tuple(f for f in dataclasses.fields(cls) if _set_by(f) is None)


def _set_by(field: dataclasses.Field) -> str | None:
    """Where a field that is not a setting of its section is set from (e.g. the PPO and
    GRPO records' `temperature`: `sampling.temperature`), or `None`."""
    return field.metadata.get("set_by")


def _settings(cls: type) -> tuple[dataclasses.Field, ...]:
    return _settings_of(cls)


def _plain(value: Any) -> Any:
    if isinstance(value, PipelineConfig):
        return _pipeline_dict(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in _settings(type(value))}
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _pipeline_dict(cfg: PipelineConfig) -> dict:
    """A `PipelineConfig`'s fields with one section per registered stage (in registration
    order, after the shared `model`, `data`, `sampling`, `ops`)."""
    d = {}
    for f in dataclasses.fields(cfg):
        if f.name == "judge":
            d.update({key: _plain(getattr(cfg, key)) for key in section_types()})
        if f.name != "sections":
            d[f.name] = _plain(getattr(cfg, f.name))
    return d


def config_to_dict(cfg: Any, *, only: Sequence[str] | None = None) -> dict:
    """A JSON-friendly dict of a config dataclass (tuples become lists; fields set from
    another section, such as the PPO and GRPO `temperature`, are left out). A
    `PipelineConfig` has one section for each registered stage (`section_types()`).

    `only`: keep just these top-level names, in their order (e.g. `read_fields(cfg)`:
    what a run reads, as the command line prints it); `None` keeps everything (what
    `config.json` holds)."""
    d = json.loads(json.dumps(_plain(cfg)))
    if only is not None:
        unknown = [k for k in only if k not in d]
        if unknown:
            raise ConfigError(f"{unknown[0]}: unknown config section (known: {', '.join(d)})")
        d = {k: d[k] for k in only}
    return d


SHARED_SECTIONS: tuple[str, ...] = ("model", "data", "sampling", "ops")
"""The sections every stage reads (`data` on a data file only)."""


def read_fields(
    cfg: PipelineConfig, stages: Sequence[str] | None = None, *, data_file: bool | None = None
) -> tuple[str, ...]:
    """The top-level names of `cfg` (sections and fields) that a run of `stages` reads.

    **Arguments:**

    - `cfg`: the run's `PipelineConfig`.
    - `stages`: the stages the run executes (default: `run_stages(cfg)`, i.e. `cfg.stages`
      with SFT first on the built-in task).
    - `data_file`: whether the run reads a data file (default: `data.path` is set).

    **Returns:** `stages` and `out`; on the built-in task also `label_noise`,
    `eval_samples` and `notes` (on a data file `eval_samples` when a stage samples its
    held-out evaluation: not `UNSAMPLED_EVAL_STAGES` alone); then each stage's own
    section and the further sections it declares (`Stage.sections`: `judge`, or the
    section of a stage it starts from, kept only when that stage runs, so a data-file
    `dpo` run leaves out SFT's); then `model`, `data` (on a data file), `sampling` and
    `ops`. A stage that is not registered is skipped (`validate_config` names it).
    """
    from ._registry import find_stage, stages as registered
    from ._run_checks import UNSAMPLED_EVAL_STAGES, run_stages

    data_file = cfg.data.path is not None if data_file is None else data_file
    run = tuple(run_stages(cfg) if stages is None else stages)
    keys = {st.key for st in registered()}
    running = {find_stage(s).key for s in run if find_stage(s) is not None}
    task = ("label_noise", "eval_samples", "notes")  # the built-in task's own fields
    names = ["stages", "out", *(() if data_file else task)]
    if data_file and not set(run) <= set(UNSAMPLED_EVAL_STAGES):
        names.append("eval_samples")  # the held-out samples of a data-file stage that samples
    for name in run:
        st = find_stage(name)
        if st is not None:
            names += [st.key, *(s for s in st.sections if s not in keys or s in running)]
    names += [s for s in SHARED_SECTIONS if data_file or s != "data"]
    return tuple(dict.fromkeys(names))


TRL_NAMES: dict[str, tuple[str, ...]] = {
    "num_generations": ("group_size",),
    "learning_rate": ("optim.learning_rate",),
    "lr": ("optim.learning_rate", "learning_rate"),
    "max_steps": ("steps",),
    "per_device_train_batch_size": ("batch_size",),
    "max_grad_norm": ("optim.max_grad_norm",),
    "warmup_ratio": ("optim.warmup_ratio",),
    "weight_decay": ("optim.weight_decay",),
    "lr_scheduler_type": ("optim.schedule", "schedule"),
    "max_completion_length": ("sampling.max_new_tokens",),
    "max_prompt_length": ("sampling.prompt_length",),
    "top_k": ("sampling.top_k",),
    "top_p": ("sampling.top_p",),
    "min_p": ("sampling.min_p",),
    "repetition_penalty": ("sampling.repetition_penalty",),
    "seed": ("ops.seed",),
    "r": ("rank",),
    "lora_alpha": ("alpha",),
    "lora_dropout": ("dropout",),
    "target_modules": ("targets",),
}
"""TRL's (and PEFT's) names of settings that are named otherwise here, each with where
it may be, relative to the section (`grpo.num_generations` is `grpo.group_size`,
`dpo.learning_rate` is `dpo.optim.learning_rate`, `dpo.lora.r` is `dpo.lora.rank`) or
a shared one (`sampling.max_new_tokens`): the first that is a field is suggested."""


def has_field(cls: type, path: str) -> bool:
    """Whether the dotted `path` names a setting of the config class `cls` (a path of a
    shared section, `sampling.max_new_tokens`, is `PipelineConfig`'s)."""
    head, _, rest = path.partition(".")
    if not dataclasses.is_dataclass(cls):
        return False
    if cls is not PipelineConfig and head in SHARED_SECTIONS:
        return has_field(PipelineConfig, path)
    names = {f.name for f in _settings(cls)}
    if cls is PipelineConfig:
        names |= set(section_types())
    if head not in names:
        return False
    sub = _section_type(cls, head) if rest else None
    return not rest or (sub is not None and has_field(sub, rest))


def near_miss(name: str, known: Iterable[str], cls: type | None = None, prefix: str = "") -> str:
    """`"; did you mean X?"` for a misspelt `name` among `known` (`difflib`'s close
    matches), or, for a field of the config class `cls` under `prefix`, TRL's name of a
    setting named otherwise here (`TRL_NAMES`, when `cls` has it: `grpo.num_generations`
    is `grpo.group_size`); `""` when there is none."""
    found = [t for t in TRL_NAMES.get(name, ()) if cls is not None and has_field(cls, t)]
    if found:
        target = found[0]
        where = target if target.partition(".")[0] in SHARED_SECTIONS else prefix + target
        return f"; TRL's {name} is {where} here"
    close = difflib.get_close_matches(name, sorted(known), n=2)
    return f"; did you mean {' or '.join(prefix + c for c in close)}?" if close else ""


def _convert(value: Any, tp: Any, name: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Mapping, dict) or tp in (Mapping, dict):
        if isinstance(value, str):  # from the command line: a JSON object
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise ConfigError(f"{name}={value!r}: expected a JSON object") from None
        if not isinstance(value, dict):
            raise ConfigError(f"{name}={value!r}: expected a mapping")
        item = typing.get_args(tp)[1:2]  # the values' type (`data.columns`: str)
        return {k: _convert(v, item[0], f"{name}.{k}") if item else v for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{name}: expected a mapping, got {value!r}")
        return config_from_dict(tp, value, prefix=name + ".")
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        readable, errors = [], []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(value, a, name)
            except ConfigError as e:
                if "unsupported field type" not in str(e):
                    readable.append(getattr(a, "__name__", str(a)))
                    errors.append(e)
            if isinstance(value, dict) and dataclasses.is_dataclass(a):
                raise errors[-1]  # a nested section's own error names its field
        if len(errors) == 1:
            raise errors[0]
        raise ConfigError(f"{name}={value!r}: expected {' or '.join(readable) or tp}")
    if origin is tuple:
        listed = _json_list(value) if isinstance(value, str) else None
        if isinstance(listed, list):
            value = listed  # from the command line: items may hold commas
        elif isinstance(value, str) and name.endswith("stop_strings"):
            # From the command line: comma-separated, with escapes (`\\n\\nHuman:`)
            try:
                value = [_unescape(v) for v in value.split(",") if v]
            except UnicodeDecodeError as e:
                raise ConfigError(f"{name}={value!r}: bad escape ({e.reason})") from None
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


def _json_list(text: str) -> Any:
    """The JSON value of `text` when it starts with `[` and parses (`None` otherwise, so
    that a stop string such as `[INST]` is read as written)."""
    if not text.lstrip().startswith("["):
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _unescape(text: str) -> str:
    """`text` with its backslash escapes (`\\n`, `\\t`, `\\u20ac`) decoded and every other
    character kept: `café`, `€ 日本` as written. (`unicode_escape` reads bytes as
    Latin-1, so each character outside Latin-1 goes to it as its own `\\u` escape.)"""
    return text.encode("latin-1", "backslashreplace").decode("unicode_escape")


def config_from_dict(cls: type, d: dict, *, prefix: str = "") -> Any:
    """Build config dataclass `cls` from a (nested) dict; unknown fields are errors,
    missing ones take their defaults. A value that the config (or an embedded train
    record) refuses when built is a `ConfigError` naming the field under `prefix`
    (`dpo.beta=-0.1: must be > 0`)."""
    hints = _hints(cls)
    set_by = {f.name: _set_by(f) for f in dataclasses.fields(cls) if _set_by(f) is not None}
    names = {f.name for f in _settings(cls)} - {"sections"}
    section_of = section_types() if cls is PipelineConfig else {}
    sections = {}
    for key in d:
        if key in set_by:
            raise ConfigError(f"{prefix}{key}: not a setting of this section; set {set_by[key]}")
        if key in section_of:  # a stage's section (`PipelineConfig`)
            value = d[key]
            if not isinstance(value, dict):
                raise ConfigError(f"{prefix}{key}: expected a mapping, got {value!r}")
            sections[key] = config_from_dict(section_of[key], value, prefix=f"{prefix}{key}.")
        elif key not in names:
            known = ", ".join(sorted(names | set(section_of)))
            hint = near_miss(key, names | set(section_of), cls, prefix)
            raise ConfigError(f"{prefix}{key}: unknown field{hint} (known: {known})")
    kwargs = {k: _convert(v, hints[k], prefix + k) for k, v in d.items() if k in names}
    try:
        return cls(**kwargs, sections=sections) if cls is PipelineConfig else cls(**kwargs)
    except (ValueError, TypeError) as e:
        message = field_message(cls, str(e).splitlines()[0])
        raise ConfigError(prefixed(prefix, message)) from None


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


def _section_type(cls: type | None, name: str) -> type | None:
    """The dataclass type of section `name` of `cls` (`None` when not known)."""
    if cls is None or not dataclasses.is_dataclass(cls):
        return None
    if cls is PipelineConfig and name in section_types():
        return section_types()[name]
    tp = _hints(cls).get(name)
    if dataclasses.is_dataclass(tp):
        return tp
    return _optional_section(cls, name)


def _optional_section(cls: type, name: str) -> type | None:
    """`X` for a field `name: X | None` of `cls` whose `X` is a dataclass with defaults
    (e.g. `grpo.rollout_correction`): setting one of its fields starts from `X()`."""
    tp = _hints(cls).get(name) if dataclasses.is_dataclass(cls) else None
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
        found = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        if len(found) == 1 and type(None) in typing.get_args(tp):
            return found[0]
    return None


def apply_overrides(cfg: Any, overrides: Sequence[str]) -> Any:
    """Apply dotted `field.sub=value` overrides (e.g. `"dpo.beta=0.2"`); values are parsed
    by the field's type (lists comma-separated, or a JSON list when the value starts with
    `[`: `'sampling.stop_strings=["a,b", "c"]'`)."""
    d = config_to_dict(cfg)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected FIELD=VALUE, e.g. dpo.beta=0.2")
        path, value = item.split("=", 1)
        parts = path.strip().split(".")
        node, cls = d, type(cfg)
        for i, p in enumerate(parts[:-1]):
            if node.get(p) is None and cls is not None:  # an optional section, unset: its defaults
                section = _optional_section(cls, p)
                if section is not None:
                    node[p] = json.loads(json.dumps(dataclasses.asdict(section())))
            if not isinstance(node.get(p), dict):
                where = ".".join(parts[: i + 1])
                if p in node:  # a field, not a section
                    raise ConfigError(f"{where}: a setting, not a config section")
                known = [k for k, v in node.items() if isinstance(v, dict)]
                hint = near_miss(p, known)
                owner = find_stage(p) if i == 0 and cls is PipelineConfig else None
                if owner is not None and owner.key != p:  # `online-dpo` reads `dpo`
                    hint = f"; the {p} stage's settings are the {owner.key} section"
                    hint += f" ({owner.key}.{'.'.join(parts[1:])})"
                raise ConfigError(
                    f"{where}: unknown config section{hint} (known: {', '.join(known)})"
                )
            node = node[p]
            cls = _section_type(cls, p)
        # an unknown field is refused by `config_from_dict`, naming the known ones; `none`
        # is None except for a plain string field (`data.chat_template=none`)
        text = dataclasses.is_dataclass(cls) and _hints(cls).get(parts[-1]) is str
        node[parts[-1]] = None if value.lower() == "none" and not text else value
    return config_from_dict(type(cfg), d)


def command_line_config(args) -> PipelineConfig:
    """The configuration of a parsed command line (`args`, an `argparse.Namespace`): the
    built-in task's (`animal_task_config`), then the file `args.config` (`load_config`),
    then the `--set` overrides `args.overrides`, then the flags the namespace has, each
    as an override: `data` (`data.path`), `model` (`model.source`), `tokenizer`
    (`model.tokenizer`), `quiet` (`ops.quiet=true`). Defaults < file < flags.

    `rlhf_eqx eval --model RUN` of a run directory, or of a stage's export inside one
    (`RUN/<stage>/hf`, `RUN/<stage>/adapter`: `model_run_dir`), starts from that run's
    own evaluation settings instead of the built-in task's (`run_eval_settings`), so
    that it scores the run's exported policy as the run did; the file and the flags
    still override them."""
    cfg = animal_task_config()
    if getattr(args, "command", None) == "eval" and getattr(args, "model", None):
        cfg = run_eval_settings(cfg, model_run_dir(args.model))
    if args.config:
        cfg = load_config(args.config, base=cfg)
    overrides = list(args.overrides)
    flags = {"data": "data.path", "model": "model.source", "tokenizer": "model.tokenizer"}
    for flag, field in flags.items():
        if getattr(args, flag, None):
            overrides.append(f"{field}={getattr(args, flag)}")
    if getattr(args, "quiet", False):
        overrides.append("ops.quiet=true")
    return apply_overrides(cfg, overrides)


EVAL_SETTINGS: tuple[str, ...] = ("eval_samples", "sampling", "ops.seed")
"""What a run's held-out evaluation reads besides the model (`task_evaluator`): the
samples per opening, the sampling settings and the key's seed."""


EXPORT_DIRS: tuple[str, ...] = ("hf", "adapter")
"""The directories a stage exports its model to inside a run directory
(`RUN/<stage>/hf`, the merged model; `RUN/<stage>/adapter`, its PEFT adapter)."""


def _is_run_dir(path: str) -> bool:
    """Whether `path` holds a run's `config.json` (one with `stages` and `model`)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(saved, dict) and {"stages", "model"} <= set(saved)


def model_run_dir(source: str) -> str:
    """The run directory a model source belongs to: a stage's export inside a run
    directory (`RUN/<stage>/hf` or `RUN/<stage>/adapter`, `<stage>` a registered stage)
    gives `RUN`; anything else (a run directory itself, another model) is returned as
    given."""
    path = os.path.normpath(source)
    stage_dir, export = os.path.split(path)
    run, stage = os.path.split(stage_dir)
    stages = {st.name for st in registered_stages()} | set(section_types())
    if export in EXPORT_DIRS and stage in stages and _is_run_dir(run or "."):
        return run or "."
    return source


def run_eval_settings(cfg: PipelineConfig, run_dir: str) -> PipelineConfig:
    """`cfg` with the `EVAL_SETTINGS` of the run in `run_dir` (its `config.json`, when
    `run_dir` is a run directory: one with `stages` and `model`); `cfg` itself otherwise.
    Settings the run's version had and this one no longer has are not read
    (`unused_fields`); a run's `config.json` that does not load is a `ConfigError`
    naming it."""
    path = os.path.join(run_dir, "config.json")
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return cfg
    if not isinstance(saved, dict) or not {"stages", "model"} <= set(saved):
        return cfg
    from ._resume_rules import without_unused

    saved = without_unused(saved)  # a run of an older version: settings it no longer has
    d = config_to_dict(cfg)
    for name in EVAL_SETTINGS:  # just these: the run's other sections are not read
        *sections, key = name.split(".")
        mine, theirs = d, saved
        for section in sections:
            mine, theirs = mine[section], theirs.get(section)
            if not isinstance(theirs, dict):
                break
        else:
            if key in theirs:
                both = isinstance(mine[key], dict) and isinstance(theirs[key], dict)
                mine[key] = _deep_merge(mine[key], theirs[key]) if both else theirs[key]
    try:
        return config_from_dict(PipelineConfig, d)
    except ConfigError as e:
        raise ConfigError(f"{path} (the run's settings that eval reads): {e}") from None
