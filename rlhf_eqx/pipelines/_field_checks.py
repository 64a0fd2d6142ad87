"""One-field checks of the pipeline's configuration: each raises one `ConfigError` line
`"<section>.<field>=<value>: <requirement>"` naming the dotted field, the value and the
valid range or choices (`_validation.py`, `_run_checks.py`, `_model_checks.py` and the
stages' own checks use them), and the checks of the fields every batch or rollout stage
shares (`check_shared_fields`)."""

import dataclasses
import math
import os
from typing import Any

from ._config import REWARD_SOURCES, BatchStageConfig, ConfigError, RolloutStageConfig


def _fail(name: str, value: Any, why: str) -> None:
    raise ConfigError(f"{name}={_shown(value)}: {why}")


def _shown(value: Any) -> str:
    """`value` as a refusal shows it: a list setting as it is written with `--set`
    (`data.filter=identical,empty`), anything else as its `repr`."""
    if isinstance(value, tuple | list) and all(isinstance(v, str | int | float) for v in value):
        return ",".join(str(v) for v in value)
    return repr(value)


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        _fail(name, value, f"must be one of {', '.join(choices)}")


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float)


def _at_least(name: str, value: Any, low: int | float) -> None:
    """A finite number `>= low`."""
    if not _is_number(value) or not value >= low:
        _fail(name, value, f"must be >= {low}")
    if not math.isfinite(value):
        _fail(name, value, f"must be a finite number >= {low}")


def _above(name: str, value: Any, low: int | float) -> None:
    """A finite number `> low`."""
    if not _is_number(value) or not value > low:
        _fail(name, value, f"must be > {low}")
    if not math.isfinite(value):
        _fail(name, value, f"must be a finite number > {low}")


def _within(name: str, value: Any, low: int | float, high: int | float, why: str = "") -> None:
    """A number in `[low, high]` (never NaN)."""
    if not _is_number(value) or not low <= value <= high:
        _fail(name, value, f"must be in [{low:g}, {high:g}]{why}")


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        _fail(name, value, "must be >= 1")


def _divides(name: str, value: int, devices: int) -> None:
    if value % devices:
        _fail(name, value, f"must divide by the device count {devices}")


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


def check_unused(name: str, c: Any) -> None:
    """Refuse a value other than the default for a setting that the stage's config
    inherits but its run does not use (the config class's `unused_fields`), naming the
    stage: a setting that would have no effect is an error, not ignored."""
    defaults = {f.name: f for f in dataclasses.fields(type(c))}
    for field in getattr(type(c), "unused_fields", ()):
        f = defaults[field]
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        value = getattr(c, field)
        if value != default:
            _fail(
                f"{name}.{field}",
                value,
                f"the {name} stage does not use this setting (its default is {default!r})",
            )


def check_shared_fields(name: str, c: Any, device_count: int) -> None:
    """The fields a stage's settings share with every batch stage (`BatchStageConfig`:
    steps, batch size, length, step options) or rollout stage (`RolloutStageConfig`:
    rollouts, reward source, KL target), under the field prefix `name`."""
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
