"""Runtime shape and dtype checks (jaxtyping + beartype).

Every public function and Module in rlhf_eqx is annotated with jaxtyping shapes.
The checks are *off* by default for users: they add Python overhead to every eager
call (data preparation, host-side metrics) and to every trace, and a library should not
impose a checker on the code that embeds it. They are *on* in rlhf_eqx's own tests.

Switch them on in one of two ways, before ``rlhf_eqx`` is first imported:

- set the environment variable ``RLHF_EQX_TYPECHECK=1``; or
- run pytest with ``--jaxtyping-packages=rlhf_eqx,beartype.beartype``.

Under ``jax.jit`` the checks run while tracing only, so compiled code pays nothing.
"""

import os

ENV_VAR = "RLHF_EQX_TYPECHECK"


def typecheck_requested() -> bool:
    """Whether ``RLHF_EQX_TYPECHECK`` asks for runtime shape checks."""
    return os.environ.get(ENV_VAR, "").strip().lower() not in ("", "0", "false", "no", "off")


def install_hook() -> None:
    """Install jaxtyping's import hook for the ``rlhf_eqx`` package (beartype checker).

    Must run before the submodules are imported; ``rlhf_eqx/__init__.py`` calls it when
    ``RLHF_EQX_TYPECHECK`` is set.
    """
    from jaxtyping import install_import_hook

    install_import_hook("rlhf_eqx", "beartype.beartype")
