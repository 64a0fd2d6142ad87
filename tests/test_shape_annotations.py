"""Every public function and method of rlhf_eqx that takes or returns arrays names their
shapes: no annotation is a bare `jax.Array` or `numpy.ndarray`.

The runtime checks (jaxtyping + beartype, `rlhf_eqx._typecheck`) can only check the
shapes an annotation names. This walks the public surface — the public subpackages and
modules, the public names they export, the public methods and `__call__` of public
classes — and fails on any parameter or return annotation (at any depth: unions,
tuples, dicts, sequences) that is a bare array type rather than a jaxtyping one such as
`Float[Array, "B T"]`. Callable types are not inspected (their argument types belong
to the callable, not to the function).
"""

import collections.abc
import importlib
import inspect
import pkgutil
import types
import typing

import jax
import jaxtyping
import numpy as np
import pytest

import rlhf_eqx

# Justified exceptions: `qualified name -> parameters` whose annotation is allowed to
# name a bare array type.
EXCEPTIONS = {
    # optax's own alias for an optimiser state (`optax.OptState`, a union naming
    # `jax.Array`): any pytree of optax's choosing, no shape to name.
    "rlhf_eqx.train._state.TrainState.__init__": {"opt_state"},
}

# Not yet shaped: none left; a function added without shapes goes here until it has them.
# Entries must still be needed (see `test_pending_entries_are_still_needed`); remove
# one when its function gets shaped annotations.
PENDING: dict[str, set[str]] = {}


def bare_array(annotation, depth: int = 0) -> bool:
    """Whether `annotation` is, or contains, `jax.Array` / `numpy.ndarray` without a
    jaxtyping dtype and shape."""
    if depth > 8:
        return False
    if annotation is jax.Array or annotation is np.ndarray:
        return True
    if isinstance(annotation, type) and issubclass(annotation, jaxtyping.AbstractArray):
        return False
    if typing.get_origin(annotation) is collections.abc.Callable:
        return False
    args = getattr(annotation, "__args__", None) or ()
    return any(bare_array(a, depth + 1) for a in args if not isinstance(a, (str, int)))


def public_modules() -> dict[str, types.ModuleType]:
    """`rlhf_eqx` and its public subpackages and modules (no `_private` part)."""
    found = {"rlhf_eqx": rlhf_eqx}
    for info in pkgutil.walk_packages(rlhf_eqx.__path__, "rlhf_eqx."):
        if any(part.startswith("_") for part in info.name.split(".")[1:]):
            continue
        found[info.name] = importlib.import_module(info.name)
    return found


def _hints(fn) -> dict:
    fn = inspect.unwrap(fn)
    try:
        return typing.get_type_hints(fn, include_extras=True)
    except Exception:  # an annotation naming something only a type checker imports
        return dict(getattr(fn, "__annotations__", {}))


def public_callables() -> dict[str, object]:
    """`qualified name -> function` of every public function, and of the public methods
    and `__init__` / `__call__` of every public class, that rlhf_eqx defines."""
    found = {}
    for module in public_modules().values():
        names = getattr(module, "__all__", None) or [n for n in vars(module) if n[0] != "_"]
        for name in names:
            obj = getattr(module, name, None)
            if obj is None or isinstance(obj, types.ModuleType) or not callable(obj):
                continue
            origin = getattr(inspect.unwrap(obj), "__module__", None) or ""
            if not origin.startswith("rlhf_eqx"):
                continue
            if not isinstance(obj, type):
                if inspect.isfunction(inspect.unwrap(obj)):
                    found[f"{origin}.{obj.__qualname__}"] = obj
                continue
            for attr_name, attr in vars(obj).items():
                if attr_name.startswith("_") and attr_name not in ("__init__", "__call__"):
                    continue
                if isinstance(attr, (staticmethod, classmethod)):
                    attr = attr.__func__
                elif isinstance(attr, property):
                    attr = attr.fget
                if callable(attr) and inspect.isfunction(inspect.unwrap(attr)):
                    found[f"{origin}.{obj.__qualname__}.{attr_name}"] = attr
    return found


def unshaped() -> dict[str, set[str]]:
    """`qualified name -> parameters (and "return")` annotated with a bare array type."""
    found = {}
    for name, fn in public_callables().items():
        bad = {k for k, v in _hints(fn).items() if bare_array(v)}
        if bad:
            found[name] = bad
    return found


@pytest.fixture(scope="module")
def surface_unshaped():
    return unshaped()


def test_the_walk_sees_the_public_surface():
    names = public_callables()
    for expected in (
        "rlhf_eqx.losses._dpo.dpo_loss",
        "rlhf_eqx.losses._grpo.grpo_policy_loss",
        "rlhf_eqx.models._layers.matmul",
        "rlhf_eqx.testing._checks.check_finite",
    ):
        assert expected in names
    assert len(names) > 300


def test_bare_array_detection():
    from jaxtyping import Array, Float

    assert bare_array(jax.Array) and bare_array(np.ndarray)
    assert bare_array(tuple[Float[Array, " T"], dict[str, jax.Array]])
    assert bare_array(jax.Array | None)
    assert not bare_array(Float[Array, "B T"])
    assert not bare_array(tuple[Float[Array, " T"], dict[str, Float[Array, " T"]]])
    assert not bare_array(collections.abc.Callable[[jax.Array], jax.Array])


def test_public_functions_have_shaped_array_annotations(surface_unshaped):
    allowed = {**EXCEPTIONS, **PENDING}
    offenders = {
        name: sorted(params - allowed.get(name, set()))
        for name, params in surface_unshaped.items()
        if params - allowed.get(name, set())
    }
    assert not offenders, (
        "annotate these with jaxtyping shapes, e.g. Float[Array, 'B T'] "
        f"(not a bare jax.Array / numpy.ndarray): {offenders}"
    )


def test_pending_entries_are_still_needed(surface_unshaped):
    stale = {
        name: sorted(params - surface_unshaped.get(name, set()))
        for name, params in {**EXCEPTIONS, **PENDING}.items()
        if params - surface_unshaped.get(name, set())
    }
    assert not stale, f"these are shaped now: remove them from the lists: {stale}"
