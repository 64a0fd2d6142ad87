"""Test configuration: strict JAX promotion rules, a key fixture, tree comparison helpers.

Shape checks are switched on for the whole package by pytest's
``--jaxtyping-packages=rlhf_eqx,beartype.beartype`` (pyproject ``addopts``).
"""

import os

# Tests run tiny models whose cost is almost all XLA compilation: skip the expensive
# backend optimisation passes (about 40% less wall time; numerics are unaffected at the
# tolerances used). Set before the first computation initialises the CPU backend.
_FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FAST_COMPILE).strip()
# Eight simulated CPU devices, for the data-parallel, mesh and multi-device tests.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, settings

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

settings.register_profile(
    "default",
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

SHARED = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "shared"))


@pytest.fixture
def getkey():
    """Return a function producing fresh PRNG keys (deterministic per test)."""
    state = {"key": jax.random.key(0)}

    def _getkey():
        state["key"], sub = jax.random.split(state["key"])
        return sub

    return _getkey


@pytest.fixture
def shared_dir():
    """Path of the read-only shared material (models, datasets); skip if absent."""
    if not os.path.isdir(SHARED):
        pytest.skip("../shared is not present")
    return SHARED


def tree_allclose(a, b, *, rtol=1e-5, atol=1e-6) -> bool:
    """Whether two pytrees have equal structure and allclose array leaves."""
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    if ta != tb:
        return False
    return all(
        np.allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=rtol, atol=atol)
        for x, y in zip(la, lb)
    )


def assert_tree_allclose(a, b, *, rtol=1e-5, atol=1e-6):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb, f"tree structures differ: {ta} vs {tb}"
    for i, (x, y) in enumerate(zip(la, lb)):
        np.testing.assert_allclose(
            np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=rtol, atol=atol,
            err_msg=f"leaf {i}",
        )


__all__ = ["tree_allclose", "assert_tree_allclose", "SHARED"]


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled programs and trace caches after each test module: a worker
    process otherwise keeps every executable of the whole suite alive, and after some
    hundreds of tests XLA's CPU compiler was seen to crash in such a process."""
    yield
    jax.clear_caches()
