"""Runtime shape and dtype checks (jaxtyping + beartype), on by default.

Every public function and Module in rlhf_eqx is annotated with jaxtyping shapes, and
``import rlhf_eqx`` installs an import hook that checks them with beartype, so a wrong
shape or dtype raises ``jaxtyping.TypeCheckError`` naming the argument and the
dimension sizes. Under ``jax.jit`` the checks run while tracing only, so compiled code
pays nothing.

The hook checks the **public entry points**: module-level functions and classes whose
names do not start with ``_``, and the public methods and ``__call__`` of those classes
(Module fields are checked by their ``__init__``). Private helpers and functions nested
inside others are not wrapped, so eager host-side code (data readers, tokenizers,
iterators) pays for one check per public call, not one per inner step, and nothing is
re-wrapped at run time. A helper that should not be checked even though it is public
opts out with ``@typing.no_type_check``.

Turn the checks off by setting the environment variable ``RLHF_EQX_TYPECHECK=0`` (or
``false`` / ``no`` / ``off``) before ``rlhf_eqx`` is first imported. Running pytest with
``--jaxtyping-packages=rlhf_eqx,beartype.beartype`` (as rlhf_eqx's own tests do) checks
every function, private ones included; this hook then stands aside.
"""

import ast
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
_HOOK_VERSION = 1  # bump when `instrument` changes: invalidates the cached bytecode


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


def checked(obj):
    """Check `obj`'s annotations with jaxtyping + beartype, built on its first use.

    A function gets a wrapper that builds the checked function when first called (most
    functions of a library are never called by a given program, and building a checker
    costs a few milliseconds). A dataclass (an `eqx.Module`) gets the same for its
    `__init__`, which checks the arguments and then the fields.
    """
    if isinstance(obj, type):
        original = obj.__dict__.get("__init__")
        if original is None:
            return obj

        @functools.wraps(original)
        def init(self, *args, **kwargs):
            if obj.__dict__.get("__init__") is init:  # first instance: build the checks
                obj.__init__ = original
                _jaxtyped(obj)
            return obj.__dict__["__init__"](self, *args, **kwargs)

        obj.__init__ = init
        return obj
    if not callable(obj) or isinstance(obj, (classmethod, staticmethod, property)):
        return _jaxtyped(obj)
    built = []

    @functools.wraps(obj)
    def wrapper(*args, **kwargs):
        __tracebackhide__ = True
        if not built:
            built.append(_jaxtyped(obj))
        return built[0](*args, **kwargs)

    return wrapper


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
