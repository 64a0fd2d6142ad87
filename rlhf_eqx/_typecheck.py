"""Runtime shape and dtype checks (jaxtyping + beartype), on by default.

Every public function and Module in rlhf_eqx is annotated with jaxtyping shapes, and
``import rlhf_eqx`` installs an import hook that checks them with beartype, so a wrong
shape or dtype raises ``jaxtyping.TypeCheckError`` naming the argument and the
dimension sizes. Under ``jax.jit`` the checks run while tracing only, so compiled code
pays nothing.

The hook checks the **public entry points** that take or return arrays: module-level
functions and classes whose names do not start with ``_``, and the public methods and
``__call__`` of those classes (Module fields are checked by their ``__init__``), when
their annotations name an array type (a jaxtyping array or ``PyTree``, ``jax.Array``,
``numpy.ndarray``, at any depth). Private helpers, functions nested inside others and
functions of plain Python values (readers, tokenizers, collators of token lists,
iterators) are left as written, at no cost. A helper that should not be checked even
though it is public opts out with ``@typing.no_type_check``.

Host-side loops call the same array functions again and again with arrays of the same
shapes: a checked function runs its checks once per **signature** of its arguments (the
types, shapes and dtypes of the arrays, the values of small scalars) and calls the
plain function when that signature has passed before; a new shape or dtype is checked
(and a wrong one raises) as on the first call. Arguments that cannot be keyed cheaply
(models, records, long lists) are checked on every call. Together this keeps eager host
code within a few percent of its unchecked speed (`benchmarks/bench_typecheck.py`
measures it).

Turn the checks off by setting the environment variable ``RLHF_EQX_TYPECHECK=0`` (or
``false`` / ``no`` / ``off``) before ``rlhf_eqx`` is first imported. Running pytest with
``--jaxtyping-packages=rlhf_eqx,beartype.beartype`` (as rlhf_eqx's own tests do) checks
every function, private ones included; this hook then stands aside.
"""

import ast
import dataclasses
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import marshal
import os
import sys

ENV_VAR = "RLHF_EQX_TYPECHECK"
PACKAGE = "rlhf_eqx"
_OFF = ("0", "false", "no", "off")
_DECORATOR = "_rlhf_eqx_typecheck.checked"
_IMPORTS = "import rlhf_eqx._typecheck as _rlhf_eqx_typecheck\n"
_CHECKED_DUNDERS = ("__call__",)
_HOOK_VERSION = 2  # bump when `instrument` changes: invalidates the cached bytecode


def typecheck_requested() -> bool:
    """Whether runtime shape checks are on: unless ``RLHF_EQX_TYPECHECK`` turns them off."""
    return os.environ.get(ENV_VAR, "1").strip().lower() not in _OFF


def hook_installed(package: str = PACKAGE) -> bool:
    """Whether an import hook (this one, or jaxtyping's) already instruments ``package``."""
    for finder in sys.meta_path:
        if isinstance(finder, _Finder):
            return True
        should = getattr(finder, "should_instrument", None)
        if type(finder).__name__ == "_JaxtypingFinder" and should is not None and should(package):
            return True
    return False


def _no_type_check(node: ast.AST) -> bool:
    return any(
        (isinstance(d, ast.Name) and d.id == "no_type_check")
        or (isinstance(d, ast.Attribute) and d.attr == "no_type_check")
        for d in getattr(node, "decorator_list", ())
    )


def _public(name: str) -> bool:
    return not name.startswith("_")


def _decorator(node: ast.AST) -> ast.expr:
    dec = ast.Attribute(
        value=ast.Name(id="_rlhf_eqx_typecheck", ctx=ast.Load()), attr="checked", ctx=ast.Load()
    )
    return ast.copy_location(dec, node)


def _jaxtyped(obj):
    import beartype
    import jaxtyping

    return jaxtyping.jaxtyped(obj, typechecker=beartype.beartype)


def _mentions_array(annotation, depth: int = 0) -> bool:
    """Whether an annotation names an array type (a jaxtyping array or `PyTree`, a
    `jax.Array`, a `numpy.ndarray`), at any depth of unions and generic arguments."""
    import jaxtyping

    if depth > 8:  # a self-referential alias: check, to be safe
        return True
    if isinstance(annotation, str):  # a forward reference: resolve nothing, guess
        return "Array" in annotation or "ndarray" in annotation or "PyTree" in annotation
    if isinstance(annotation, type):
        if issubclass(annotation, (jaxtyping.AbstractArray, jaxtyping.PyTree)):
            return True
        jax = sys.modules.get("jax")
        if jax is not None and issubclass(annotation, jax.Array):
            return True
        np = sys.modules.get("numpy")
        if np is not None and issubclass(annotation, np.ndarray):
            return True
    args = getattr(annotation, "__args__", None)
    if isinstance(args, tuple):
        return any(_mentions_array(a, depth + 1) for a in args)
    return False


def _annotations(obj) -> list:
    """The annotations a check of `obj` would enforce: a function's arguments and return;
    a class's fields (over its bases) and its `__init__`'s arguments."""
    if isinstance(obj, type):
        found = []
        for base in obj.__mro__:
            found += list(base.__dict__.get("__annotations__", {}).values())
        init = obj.__dict__.get("__init__")
        return found + list(getattr(init, "__annotations__", {}).values())
    obj = getattr(obj, "__func__", obj)  # classmethod / staticmethod
    return list(getattr(obj, "__annotations__", {}).values())


def wants_check(obj) -> bool:
    """Whether `checked` wraps `obj`: only when an annotation of it names an array type.

    A function of strings, ints and records (a tokenizer's `encode`, a reader, a record
    dataclass) has no shape to check, and a call through the jaxtyping + beartype
    wrapper costs several microseconds, so those are left as written.
    """
    return any(_mentions_array(a) for a in _annotations(obj))


_SCALARS = (bool, int, float, complex, str, bytes, type(None))
_MAX_KEYED_STR = 64  # longer strings make a call unkeyed (always checked)
_MAX_KEYED_ITEMS = 16  # so do longer tuples and lists
_MAX_SIGNATURES = 512  # signatures remembered per checked function or class


def _value_key(x, depth: int = 0):
    """What a check of `x` depends on: type, shape and dtype for an array (a tracer
    included), type and value for a small scalar; tuples and lists of those item by
    item. `None` for anything else (a model, a record, a long list): not keyed."""
    t = type(x)
    if t in _SCALARS:
        return None if t is str and len(x) > _MAX_KEYED_STR else (t, x)
    if (t is tuple or t is list) and depth < 2 and len(x) <= _MAX_KEYED_ITEMS:
        items = tuple(_value_key(v, depth + 1) for v in x)
        return None if None in items else (t, items)
    jax, np = sys.modules.get("jax"), sys.modules.get("numpy")
    if (jax is not None and isinstance(x, jax.Array)) or (
        np is not None and isinstance(x, (np.ndarray, np.generic))
    ):
        return (t, x.shape, x.dtype)
    return None


def _call_key(args: tuple, kwargs: dict):
    """The key of a call (`None` when an argument is not keyed, see `_value_key`)."""
    key = []
    for x in args:
        k = _value_key(x)
        if k is None:
            return None
        key.append(k)
    for name, x in kwargs.items():
        k = _value_key(x)
        if k is None:
            return None
        key.append((name, k))
    return tuple(key)


def _unannotated_self(fn) -> str | None:
    """`"self"` / `"cls"` when `fn`'s first parameter is an unannotated `self` / `cls`
    (which no check reads), else `None`."""
    code = getattr(fn, "__code__", None)
    if code is None or code.co_argcount == 0:
        return None
    first = code.co_varnames[0]
    if first in ("self", "cls") and first not in getattr(fn, "__annotations__", {}):
        return first
    return None


def _memoised(check, plain, *, first: str | None):
    """`check` on the first call of each signature (`_call_key`), `plain` after it passed.

    A call whose arguments match one already checked — same types, shapes and dtypes
    of arrays, same small scalars — would pass the same checks, so it skips them: a
    loop over same-shaped batches pays for one check per shape. An unannotated first
    argument (`first`: `"self"` or `"cls"`) is keyed by its type, or the class itself.
    """
    seen: dict = {}

    def call(*args, **kwargs):
        __tracebackhide__ = True
        if first is not None and args:
            owner = args[0] if first == "cls" else type(args[0])
            key = _call_key(args[1:], kwargs)
            key = None if key is None else (owner, key)
        else:
            key = _call_key(args, kwargs)
        if key is not None and key in seen:
            return plain(*args, **kwargs)
        out = check()(*args, **kwargs)
        if key is not None and len(seen) < _MAX_SIGNATURES:
            seen[key] = True
        return out

    return call


def checked(obj):
    """Check `obj`'s annotations with jaxtyping + beartype, cheaply on the host.

    - Only objects with an array in their annotations are wrapped (`wants_check`); the
      rest (string, int and record functions: readers, tokenizers, collators' helpers)
      are returned unchanged, free to call.
    - The checker is built when first called (most functions of a library are never
      called by a given program, and building one costs a few milliseconds).
    - A call is checked once per signature of its arguments (`_memoised`): repeated
      calls with arrays of the shapes and dtypes already checked, as in a data loader's
      loop, run the plain function. Arguments that cannot be keyed cheaply (models,
      records, long lists) are checked on every call.

    A dataclass (an `eqx.Module`) gets the same for its `__init__`, which checks the
    arguments (the fields, for a generated `__init__`).
    """
    if not wants_check(obj):
        return obj
    if isinstance(obj, type):
        original = obj.__dict__.get("__init__")
        if original is None or not dataclasses.is_dataclass(obj):
            return obj  # jaxtyping checks the `__init__` of dataclasses only
        if getattr(obj, "__no_type_check__", False):
            return obj
        built_init = []

        def check_init():
            if not built_init:
                built_init.append(_jaxtyped(original))
            return built_init[0]

        init = functools.wraps(original)(_memoised(check_init, original, first="self"))
        obj.__init__ = init
        return obj
    if not callable(obj) or isinstance(obj, (classmethod, staticmethod, property)):
        return _jaxtyped(obj)
    built = []

    def check():
        if not built:
            built.append(_jaxtyped(obj))
        return built[0]

    return functools.wraps(obj)(_memoised(check, obj, first=_unannotated_self(obj)))


def instrument(tree: ast.Module) -> ast.Module:
    """Add the checking decorator to the public entry points of a module's AST."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if _public(node.name) and not _no_type_check(node):
                node.decorator_list.append(_decorator(node))  # innermost, as jaxtyping
        elif isinstance(node, ast.ClassDef) and _public(node.name) and not _no_type_check(node):
            node.decorator_list.insert(0, _decorator(node))  # outermost: checks __init__
            for item in node.body:
                if (
                    isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and (_public(item.name) or item.name in _CHECKED_DUNDERS)
                    and not _no_type_check(item)
                ):
                    item.decorator_list.append(_decorator(item))
    # The imports go after the docstring and any `from __future__` imports.
    at = 0
    for i, node in enumerate(tree.body):
        docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        future = isinstance(node, ast.ImportFrom) and node.module == "__future__"
        if not (docstring and i == 0) and not future:
            at = i
            break
    tree.body[at:at] = ast.parse(_IMPORTS).body
    return ast.fix_missing_locations(tree)


class _Loader(importlib.machinery.SourceFileLoader):
    """Compiles the instrumented source, cached next to (never in) the usual bytecode."""

    def get_code(self, fullname):
        path = self.get_filename(fullname)
        stats = self.path_stats(path)
        header = b"".join(
            (
                importlib.util.MAGIC_NUMBER,
                _HOOK_VERSION.to_bytes(4, "little"),
                int(stats["mtime"]).to_bytes(8, "little"),
                (int(stats["size"]) & 0xFFFFFFFF).to_bytes(4, "little"),
            )
        )
        cache = importlib.util.cache_from_source(path)[: -len(".pyc")] + ".rlhf_eqx-checks.pyc"
        try:
            with open(cache, "rb") as f:
                data = f.read()
            if data[: len(header)] == header:
                return marshal.loads(data[len(header) :])
        except (OSError, ValueError, EOFError, TypeError):
            pass
        code = self.source_to_code(self.get_data(path), path)
        try:
            os.makedirs(os.path.dirname(cache), exist_ok=True)
            tmp = f"{cache}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(header + marshal.dumps(code))
            os.replace(tmp, cache)
        except OSError:
            pass  # a read-only install: compile on every import
        return code

    def source_to_code(self, data, path, *, _optimize=-1):  # type: ignore[override]
        tree = instrument(ast.parse(data, filename=path))
        return compile(tree, path, "exec", dont_inherit=True, optimize=_optimize)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(PACKAGE + "."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            return spec
        spec.loader = _Loader(fullname, spec.origin)
        return spec


def install_hook() -> None:
    """Install the checking import hook for ``rlhf_eqx``'s submodules.

    Must run before the submodules are imported; ``rlhf_eqx/__init__.py`` calls it
    unless ``RLHF_EQX_TYPECHECK=0`` or a hook is already installed.
    """
    if not hook_installed():
        sys.meta_path.insert(0, _Finder())
