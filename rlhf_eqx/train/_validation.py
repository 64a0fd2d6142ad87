"""Build-time checks of step hyperparameters: one-line errors
`"{name}={value!r}: must be {requirement}"` naming the argument, its value and the valid
range or choices (the settings records of `_settings.py` raise them; a pipeline config
prefixes its section, `dpo.beta=-0.1: must be > 0`).

Python numbers are checked when a step is built; JAX arrays (including tracers, so a
whole run can be `jax.vmap`-ed over a hyperparameter) are accepted as they are.
"""

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from ..losses import AGGREGATION_MODES


def is_traced_or_array(value: Any) -> bool:
    """Whether `value` is a JAX array or tracer (checked by the caller, not here)."""
    return isinstance(value, jax.Array | jax.core.Tracer)


def check_positive_int(name: str, value: Any) -> None:
    """A Python int >= 1 (never an array: it sets a shape or a loop)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name}={value!r}: must be a positive int")


def check_choice(name: str, value: Any, choices: Sequence[str]) -> None:
    """One of the strings `choices` (e.g. `AGGREGATION_MODES`)."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}={value!r}: must be one of {', '.join(choices)}")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r}: must be True or False")


def _g(x: float) -> str:
    return f"{x:g}"


def _requirement(low, high, low_open, high_open) -> str:
    if low is None and high is None:
        return ""
    if high is None:
        return f"{'>' if low_open else '>='} {_g(low)}"
    if low is None:
        return f"{'<' if high_open else '<='} {_g(high)}"
    lo, hi = "(" if low_open else "[", ")" if high_open else "]"
    return f"in {lo}{_g(low)}, {_g(high)}{hi}"


def check_number(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    allow_none: bool = False,
) -> None:
    """Check a Python number against an interval; arrays and tracers pass unchecked.

    `low_open` / `high_open` exclude the end points. Non-finite numbers always fail.
    """
    req = _requirement(low, high, low_open, high_open)
    if value is None:
        if allow_none:
            return
        raise ValueError(f"{name}=None: must be a number{' ' + req if req else ''}")
    if is_traced_or_array(value):
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}={value!r}: must be a number{' ' + req if req else ''}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name}={value!r}: must be a finite number{' ' + req if req else ''}")
    bad = False
    if low is not None:
        bad |= v <= low if low_open else v < low
    if high is not None:
        bad |= v >= high if high_open else v > high
    if bad:
        raise ValueError(f"{name}={value!r}: must be {req}")


def check_aggregation(mode: Any, constant: Any) -> None:
    """Check an aggregation `mode` and its Dr.GRPO `constant` (see `aggregate_parts`)."""
    check_choice("mode", mode, AGGREGATION_MODES)
    if constant is not None:
        if mode != "seq-mean-token-sum-norm":
            raise ValueError(
                f"constant={constant!r}: only used by mode='seq-mean-token-sum-norm' "
                f"(mode={mode!r})"
            )
        check_number("constant", constant, low=0.0, low_open=True)


def loss_kwargs_with_fields(cls: type, record: Any) -> Mapping[str, Any] | None:
    """`record.loss_kwargs` with the fields of `record` (a subclass of the settings
    record `cls`, e.g. a user's `GRPOSettings` with a field for their loss) that `cls`
    lacks and its loss takes as hyperparameters (`cls._loss_hyperparameters(record)`):
    such a field reaches the loss as if given in `loss_kwargs`, instead of being dropped
    with the subclass. A hyperparameter given both ways with other values is refused."""
    kwargs = getattr(record, "loss_kwargs", None)
    takes = getattr(cls, "_loss_hyperparameters", None)
    if takes is None or type(record) is cls:
        return kwargs
    own = {f.name for f in dataclasses.fields(cls)}
    extra = [f.name for f in dataclasses.fields(record) if f.name not in own]
    names = set(takes(record)) if extra else set()
    moved = {n: getattr(record, n) for n in extra if n in names}
    if not moved:
        return kwargs
    out = dict(kwargs or {})
    for name, value in moved.items():
        if name in out and not _same(out[name], value):
            raise ValueError(
                f"{name}={value!r} (a field of {type(record).__name__}) and loss_kwargs "
                f"{name!r}={out[name]!r}: give the loss's hyperparameter once"
            )
        out[name] = value
    return out


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if is_traced_or_array(a) or is_traced_or_array(b):
        return False
    try:
        return bool(a == b)
    except Exception:
        return False
