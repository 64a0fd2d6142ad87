"""Equal builds share one compiled program: the cache behind `make_step` and `make_optimizer`.

`eqx.filter_jit` keeps its compiled programs per wrapped Python function, so a step
built twice — a fresh closure each time — traces and compiles twice. The builders
therefore look their jitted update up here, under a key that says what the update
computes:

- a builder's **settings records** (frozen dataclasses) by value, field by field
  (`record_key`): two `GRPOSettings` with equal fields give the same key, also when one
  of them is a pipeline's config that inherits the record (only the record's own fields
  count);
- the **optimizer** by identity: an `optax.GradientTransformation` is a tuple of
  closures that cannot be compared by value. `make_optimizer` returns the same object
  for equal arguments, so steps built from equal `OptimizerSettings` share their
  program; a user's own optax object shares it only with builds given that very object;
- a user's **loss function** (`make_step(loss_fn, ...)` without `cache_key`) by identity
  when it captures nothing (a module-level function): a closure may hold anything
  (weights, a mutable object), so a build from one is cached only under a `cache_key`
  that says what it computes; the same holds for a settings record's own loss (a
  `policy_loss` or DPO `loss_type` given as a function, or registered under a name):
  a closure or a callable object there leaves the build uncached (`user_function_key`);
- the `StepOptions` by value.

A build is not cached (it compiles on its own, as before) when a setting holds an array
— a traced hyperparameter under `jax.vmap` / `jax.jit`, or a concrete JAX / NumPy array
baked into the step — or an unhashable value, or when it happens inside a JAX
transformation. The cache keeps the last `MAX_ENTRIES` builds (least recently used
first out).
"""

import collections
import dataclasses
import threading
import types
from collections.abc import Callable, Hashable, Mapping
from typing import Any, TypeVar

import jax
import numpy as np

from ._validation import loss_kwargs_with_fields

MAX_ENTRIES = 64
"""How many built objects the cache keeps (least recently used first out)."""

T = TypeVar("T")


class Uncacheable(Exception):
    """A value that cannot be part of a cache key (an array, a tracer, an unhashable)."""


def value_key(value: Any) -> Hashable:
    """A hashable key equal for two values exactly when a builder treats them alike:
    numbers by type and `repr` (so `1` and `1.0`, `0.0` and `-0.0` differ), dataclasses
    field by field, tuples / lists / mappings item by item, other hashables (functions,
    classes, optax objects) by their own hash and equality. Raises `Uncacheable` for
    arrays (concrete or traced) and unhashable values."""
    if value is None or isinstance(value, (bool, str, bytes)):
        return (type(value), value)
    if isinstance(value, (int, float, complex, np.generic)):
        return (type(value), repr(value))
    if isinstance(value, (jax.Array, np.ndarray, jax.core.Tracer)):
        raise Uncacheable(type(value).__name__)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return record_key(type(value), value)
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(value_key(v) for v in value))
    if isinstance(value, Mapping):
        return (Mapping, frozenset((k, value_key(v)) for k, v in value.items()))
    try:
        hash(value)
    except TypeError:
        raise Uncacheable(type(value).__name__) from None
    return (type(value), value)


def record_key(cls: type, record: Any) -> Hashable:
    """The key of the fields of dataclass `cls` in `record` (an instance of `cls` or of a
    subclass: the subclass's own fields do not count)."""
    names = tuple(f.name for f in dataclasses.fields(cls))
    return (cls, tuple((n, value_key(getattr(record, n))) for n in names))


def own_record(cls: type[T], record: T) -> T:
    """`record` as a plain `cls` (the fields of `cls` only), e.g. a pipeline's stage config
    that inherits a step's settings record; `record` itself when it is one already. A
    field of the subclass that the record's loss takes as a hyperparameter moves into
    `loss_kwargs` (`loss_kwargs_with_fields`)."""
    if type(record) is cls:
        return record
    values = {f.name: getattr(record, f.name) for f in dataclasses.fields(cls)}
    if "loss_kwargs" in values:  # a subclass's fields that its loss takes go along
        values["loss_kwargs"] = loss_kwargs_with_fields(cls, record)
    return cls(**values)  # type: ignore[call-arg]


def function_key(fn: Any) -> Hashable:
    """The key of a function given to a builder: `None`, or a plain function that
    captures nothing, by identity; a closure or another callable (a `functools.partial`,
    an object) raises `Uncacheable`: it may hold anything."""
    if fn is None:
        return None
    if not isinstance(fn, types.FunctionType) or fn.__closure__:
        raise Uncacheable("a closure or a callable object")
    return value_key(fn)


class _Unkeyed:
    """Stands in a build key for a function that cannot be keyed (unhashable: the build
    is not cached)."""

    __hash__ = None  # type: ignore[assignment]


def user_function_key(fn: Any) -> Any:
    """What a user's function inside a build key stands for (a settings record's
    `policy_loss` or `loss_type`, or the function a registered name stands for): the
    function itself when it captures nothing, else a value that makes the build
    uncached, as `function_key` decides for `make_step`'s `loss_fn` (a closure or a
    callable object may hold anything, and a cell it reads may be rebound)."""
    try:
        return function_key(fn)
    except Uncacheable:
        return _Unkeyed()


def _tracing() -> bool:
    try:
        from jax._src.core import trace_state_clean
    except ImportError:  # pragma: no cover - a JAX without it: rely on the keys' checks
        return False
    return not trace_state_clean()


class BuildCache:
    """A bounded, thread-safe map from build keys to built objects (least recently used
    first out)."""

    def __init__(self, max_entries: int = MAX_ENTRIES):
        self.max_entries = max_entries
        self._items: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def get_or_build(self, key: Callable[[], Hashable], build: Callable[[], T]) -> T:
        """`build()`, or the object an earlier call with an equal `key()` built. `key` is
        a thunk: raising `Uncacheable` (or building under a JAX transformation) builds
        without caching."""
        if _tracing():
            return build()
        try:
            k = key()
            hash(k)
        except (Uncacheable, TypeError):
            return build()
        with self._lock:
            if k in self._items:
                self._items.move_to_end(k)
                return self._items[k]
        built = build()
        with self._lock:
            built = self._items.setdefault(k, built)
            self._items.move_to_end(k)
            while len(self._items) > self.max_entries:
                self._items.popitem(last=False)
        return built

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def __len__(self) -> int:
        return len(self._items)


BUILDS = BuildCache()
"""The package's cache of built steps and optimisers."""


def shared_build(key: Hashable, build: Callable[[], T]) -> T:
    """`build()`, or the object an earlier call with an equal `key` built: the cache behind
    `make_step` and `make_optimizer`, for code that assembles a step's parts itself (an
    optimiser chained with its own transformation, say) and wants equal assemblies to be
    one object, so that the steps built from them share their compiled programs.

    **Arguments:**

    - `key`: what the build computes, compared by value as `make_step` compares settings
      (numbers by type and `repr`, dataclasses field by field, tuples, lists and mappings
      item by item, other hashables such as functions and optax objects by their own
      equality). A key holding an array (concrete or traced) or an unhashable value, or a
      call inside a JAX transformation, builds without caching.
    - `build`: a function of no arguments that builds the object.

    **Returns:** the built object; the cache keeps the last `MAX_ENTRIES` builds (least
    recently used first out).
    """
    return BUILDS.get_or_build(lambda: value_key(key), build)
