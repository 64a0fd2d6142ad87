"""One-field checks of the pipeline's configuration: each raises one `ConfigError` line
`"<section>.<field>=<value>: <requirement>"` naming the dotted field, the value and the
valid range or choices (`_validation.py`, `_stage_checks.py` and `_model_checks.py`
use them)."""

import dataclasses
import math
from typing import Any

from ._config import ConfigError


def _fail(name: str, value: Any, why: str) -> None:
    raise ConfigError(f"{name}={value!r}: {why}")


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
