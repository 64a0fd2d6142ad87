"""Test configuration: strict JAX promotion rules, a key fixture, tree comparison helpers.

Shape checks are switched on for the whole package by pytest's
``--jaxtyping-packages=rlhf_eqx,beartype.beartype`` (pyproject ``addopts``).
"""

import os
import sys
import tempfile


def _selects_slow_tests(argv: list[str]) -> bool:
    """Whether the command line's `-m` expression selects the slow tests (`-m slow`)."""
    for i, arg in enumerate(argv):
        expr = argv[i + 1] if arg == "-m" and i + 1 < len(argv) else None
        expr = arg[2:] if arg.startswith("-m") and len(arg) > 2 else expr
        if expr and "slow" in expr and "not slow" not in expr:
            return True
    return False


# Tests run tiny models whose cost is almost all XLA compilation: skip the expensive
# backend optimisation passes (about 40% less wall time; numerics are unaffected at the
# tolerances used), emit fusions through XLA's direct LLVM emitters rather than its MLIR
# fusion pipeline, and compile each program as one LLVM module (about 45% less compile
# time again for a training step or a sampler of the tiny models). Set before the first
# computation initialises the CPU backend. The slow tests keep XLA's default fusion
# emitters: they compare whole runs made of different programs (a sweep's vmapped
# members against separate runs) with sampling in between, and the direct emitters
# round the two differently enough to flip a sampled token.
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if not _selects_slow_tests(sys.argv[1:]):
    FAST_COMPILE_FLAGS += (
        " --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
    )
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + FAST_COMPILE_FLAGS).strip()
# Eight simulated CPU devices, for the data-parallel, mesh and multi-device tests.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# A compilation cache on disk, shared by the test workers and kept between runs: tests
# build many steps whose programs are identical (same tiny shapes, same settings), and
# XLA compilation is most of the suite's time. RLHF_EQX_TEST_CACHE=off disables it.
# Command-line runs keep the directory JAX already has (in-process runs this one; the
# runs of subprocesses get it through the environment), so the suite never writes into
# the user's cache directory.
if os.environ.get("RLHF_EQX_TEST_CACHE", "") != "off":
    _cache_dir = os.environ.get("RLHF_EQX_TEST_CACHE") or os.path.join(
        tempfile.gettempdir(), f"rlhf_eqx-test-jax-cache-{os.getuid()}"
    )
    jax.config.update("jax_compilation_cache_dir", _cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _cache_dir)
else:
    os.environ.setdefault("RLHF_EQX_COMPILATION_CACHE", "0")

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
            np.asarray(x, np.float64),
            np.asarray(y, np.float64),
            rtol=rtol,
            atol=atol,
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


# Parametrised variants that repeat, at a new compile each, a property that the fast
# siblings left in the suite already pin for every configuration, layout or mesh kind:
# they run with the slow tests (`pytest -m slow`).
SLOW_VARIANTS = frozenset(
    {
        "tests/test_fast_paths.py::test_hidden_at_equals_full_forward_gathered[" + v + "]"
        for v in (
            "padded-gemma3_like",
            "padded-remat",
            "padded-mistral_like",
            "padded-one_layer",
            "regions-gemma3_like",
            "regions-llama",
            "regions-mistral_like",
            "regions-one_layer",
            "branches-remat",
            "branches-llama",
        )
    }
    | {
        "tests/test_fast_paths.py::test_ppo_step_fast_path_equals_full_logits_path[kw1]",
        "tests/test_fast_paths.py::test_grpo_step_fast_path_equals_full_logits_path[kw1]",
        "tests/test_mesh.py::test_ppo_step_on_a_mesh_equals_one_device[8x1-fsdp]",
        "tests/test_mesh.py::test_ppo_step_on_a_mesh_equals_one_device[4x2]",
        "tests/test_mesh.py::test_dpo_step_on_a_mesh_equals_one_device[8x1]",
        "tests/test_train_grpo.py::test_grpo_shared_prompt_equals_one_row_per_completion[kw1]",
        "tests/test_train_grpo.py::test_grpo_shared_prompt_equals_one_row_per_completion[kw2]",
        "tests/test_attention.py::test_looped_and_unrolled_tiles_match_softmax[43-43-8]",
        "tests/test_attention.py::test_looped_and_unrolled_tiles_match_softmax[24-30-8]",
        "tests/test_pmap.py::test_pmap_dpo_equals_one_device[cached]",
        "tests/test_pmap.py::test_pmap_grpo_equals_one_device[batch]",
        "tests/test_packed_preferences.py::test_packed_dpo_step_equals_unpacked[ipo-cached-0.5-True]",
        "tests/test_attention.py::test_few_queries_against_many_keys_match_softmax[None-3]",
        "tests/test_attention.py::test_few_queries_against_many_keys_match_softmax[None-8]",
        "tests/test_sampling.py::test_sampled_logprobs_equal_full_forward_logprobs[settings1]",
        "tests/test_sampling.py::test_sampled_logprobs_equal_full_forward_logprobs[settings2]",
        "tests/test_policy_losses.py::test_step_micro_batches[gmpo]",
        "tests/test_policy_losses.py::test_step_micro_batches[sapo]",
        "tests/test_attention.py::test_few_queries_against_many_keys_match_softmax[5.0-8]",
        "tests/test_attention.py::test_few_queries_against_many_keys_match_softmax[5.0-3]",
        "tests/test_attention.py::test_looped_and_unrolled_tiles_match_softmax[16-16-4]",
        "tests/test_mesh.py::test_dpo_step_on_a_mesh_equals_one_device[2x4-fsdp]",
        "tests/test_train_hardening.py::"
        "test_on_policy_ratio_is_one_at_the_sampling_temperature[1.0-False]",
        "tests/test_continuous_batching.py::"
        "test_static_sampler_with_one_key_per_prompt_equals_the_continuous_one[1]",
        "tests/test_fast_paths.py::test_hidden_at_equals_full_forward_gathered[regions-remat]",
        "tests/test_fast_paths.py::"
        "test_hidden_at_equals_full_forward_gathered[branches-gemma3_like]",
        "tests/test_fast_paths.py::test_dpo_step_fast_path_equals_full_logits_path[cached]",
        "tests/test_gguf_blocks.py::test_sft_and_dpo_steps_train_only_the_adapters[Q4_1]",
        "tests/test_callbacks.py::test_a_callback_stops_a_batch_stage[sft]",
        "tests/test_callbacks.py::test_a_callback_stops_a_batch_stage[reward]",
        "tests/test_speculative.py::test_budgets_and_num_samples[2]",
        "tests/test_speculative.py::test_sampled_logprobs_are_the_targets[settings1]",
    }
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark `SLOW_VARIANTS` slow before `-m` selects (pyproject's `-m 'not slow'`)."""
    for item in items:
        if item.nodeid in SLOW_VARIANTS:
            item.add_marker(pytest.mark.slow)
