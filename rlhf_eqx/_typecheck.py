"""Runtime shape and dtype checks (jaxtyping + beartype), on by default.

Every public function and Module in rlhf_eqx is annotated with jaxtyping shapes, and
``import rlhf_eqx`` installs jaxtyping's import hook for the package, so a wrong shape
or dtype raises ``jaxtyping.TypeCheckError`` naming the argument and the dimension
sizes. Under ``jax.jit`` the checks run while tracing only, so compiled code pays
nothing; eager calls pay a few microseconds per call.

Turn them off by setting the environment variable ``RLHF_EQX_TYPECHECK=0`` (or
``false`` / ``no`` / ``off``) before ``rlhf_eqx`` is first imported. Running pytest with
``--jaxtyping-packages=rlhf_eqx,beartype.beartype`` installs the same hook (then it is
not installed twice).

Host-side helpers that run per element (per record, per token) opt out with
``@typing.no_type_check``; their public entry points stay checked.
"""

import os
import sys

ENV_VAR = "RLHF_EQX_TYPECHECK"
_OFF = ("0", "false", "no", "off")


def typecheck_requested() -> bool:
    """Whether runtime shape checks are on: unless ``RLHF_EQX_TYPECHECK`` turns them off."""
    return os.environ.get(ENV_VAR, "1").strip().lower() not in _OFF


def hook_installed(package: str = "rlhf_eqx") -> bool:
    """Whether a jaxtyping import hook already instruments ``package``."""
    for finder in sys.meta_path:
        should = getattr(finder, "should_instrument", None)
        if type(finder).__name__ == "_JaxtypingFinder" and should is not None and should(package):
            return True
    return False


def install_hook() -> None:
    """Install jaxtyping's import hook for the ``rlhf_eqx`` package (beartype checker).

    Must run before the submodules are imported; ``rlhf_eqx/__init__.py`` calls it
    unless ``RLHF_EQX_TYPECHECK=0`` or a hook is already installed.
    """
    if hook_installed():
        return
    from jaxtyping import install_import_hook

    install_import_hook("rlhf_eqx", "beartype.beartype")
