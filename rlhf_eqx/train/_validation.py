"""Build-time checks of step hyperparameters: one-line errors naming the argument.

Python numbers are checked when a step is built; JAX arrays (including tracers, so a
whole run can be `jax.vmap`-ed over a hyperparameter) are accepted as they are.
"""

import math
import numbers
from typing import Any

import jax

from ..losses import AGGREGATION_MODES, check_choice


def is_traced_or_array(value: Any) -> bool:
    """Whether `value` is a JAX array or tracer (checked by the caller, not here)."""
    return isinstance(value, jax.Array | jax.core.Tracer)


def check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


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
    if value is None:
        if allow_none:
            return
        raise ValueError(f"{name} must be a number, got None")
    if is_traced_or_array(value):
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    v = float(value)
    lo = "(" if low_open else "["
    hi = ")" if high_open else "]"
    interval = f"{lo}{'-inf' if low is None else low}, {'inf' if high is None else high}{hi}"
    bad = not math.isfinite(v)
    if low is not None:
        bad |= v <= low if low_open else v < low
    if high is not None:
        bad |= v >= high if high_open else v > high
    if bad:
        raise ValueError(f"{name}={value!r} is out of range; expected a finite value in {interval}")


def check_aggregation(mode: Any, constant: Any) -> None:
    """Check an aggregation `mode` and its Dr.GRPO `constant` (see `aggregate_parts`)."""
    check_choice("mode", mode, AGGREGATION_MODES)
    if constant is not None:
        if mode != "seq-mean-token-sum-norm":
            raise ValueError(
                f"constant={constant!r} is only used by mode='seq-mean-token-sum-norm'"
            )
        check_number("constant", constant, low=0.0, low_open=True)
