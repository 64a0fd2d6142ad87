"""Hyperparameter types and the checks shared by every loss.

Hyperparameters (β, label smoothing, clip ε, KL coefficients, margins, ...) may be Python
numbers or JAX scalars, including traced ones under `jax.jit` / `jax.vmap` (a sweep over
β is `jax.vmap(lambda b: dpo_loss(..., beta=b))(betas)`). Python numbers are validated
eagerly with a clear error; arrays are taken as given, since their values are not
known while tracing.
"""

import numbers
from collections.abc import Callable, Collection, Sequence

import jax.numpy as jnp
from jaxtyping import Array, Float, Real

# A scalar hyperparameter: a Python number or a (possibly traced) JAX scalar.
Hyperparameter = float | int | Real[Array, ""]


def is_python_number(x: object) -> bool:
    """Whether `x` is a plain (concrete, host-side) real number rather than an array."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_python_number(
    name: str, value: object, ok: Callable[[float], bool], requirement: str
) -> None:
    """Raise `ValueError` if `value` is a Python number for which `ok` is false.

    Arrays (traced or not) are not checked: their values may be unknown at trace time.
    """
    if is_python_number(value) and not ok(float(value)):  # type: ignore[arg-type]
        raise ValueError(f"{name} must be {requirement}, got {value}")


def check_non_negative(name: str, value: object) -> None:
    """`check_python_number` for a hyperparameter that must be `>= 0` (`None` passes)."""
    check_python_number(name, value, lambda v: v >= 0.0, "non-negative")


def check_positive(name: str, value: object) -> None:
    """`check_python_number` for a hyperparameter that must be `> 0` (`None` passes)."""
    check_python_number(name, value, lambda v: v > 0.0, "positive")


def wide_float_dtype(*arrays: Float[Array, "..."]) -> type:
    """float64 if any of `arrays` is float64, else float32: the dtype to sum or subtract
    log-probabilities in (bfloat16 inputs are widened, float64 ones are kept)."""
    return jnp.float64 if any(a.dtype == jnp.float64 for a in arrays) else jnp.float32


def callable_name(fn: object) -> str:
    """How an error names a user's function: its qualified name, else its name, else its
    `repr`."""
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def check_registered_name(name: object, builtin: Collection[str], kind: str) -> None:
    """Refuse a name to register a user's loss under: not a non-empty string, or the
    name of a built-in `kind` (e.g. `"loss_type"`)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    if name in builtin:
        raise ValueError(f"name {name!r} is a built-in {kind}; choose another name")


def check_choice(name: str, value: object, choices: Sequence[str]) -> None:
    """Raise a one-line `ValueError` naming `name`, `value` and the valid `choices`.

    For validating string options at build time, e.g.
    `check_choice("loss_type", loss_type, DPO_LOSS_TYPES)`.

    **Arguments:**

    - `name`: the argument's name, as the user wrote it.
    - `value`: the value given.
    - `choices`: the valid values (e.g. `AGGREGATION_MODES`, `KL_KINDS`,
      `ADVANTAGE_SCALES`, `DPO_LOSS_TYPES`).

    **Returns:** nothing; raises `ValueError` if `value` is not one of `choices`.
    """
    if not isinstance(value, str) or value not in choices:
        valid = ", ".join(repr(c) for c in choices)
        raise ValueError(f"unknown {name} {value!r}; expected one of {valid}")
