"""Runtime shape checks: wrong shapes or dtypes name the argument and the dimensions."""

import os
import subprocess
import sys
import textwrap

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jaxtyping import TypeCheckError

import rlhf_eqx as rx

CFG = rx.TransformerConfig(vocab_size=20, d_model=16, n_layers=1, n_heads=2, d_ff=16)


def test_wrong_shape_names_argument_and_dimensions():
    logits = jnp.zeros((5, 20), jnp.float32)
    tokens = jnp.zeros((5,), jnp.int32)
    with pytest.raises(TypeCheckError) as info:
        rx.logprobs_from_logits(logits, tokens, jnp.ones((4,), bool))
    msg = str(info.value)
    assert "mask" in msg and "T=5" in msg


def test_wrong_dtype_is_rejected():
    logits = jnp.zeros((5, 20), jnp.float32)
    with pytest.raises(TypeCheckError) as info:
        rx.logprobs_from_logits(logits, jnp.zeros((5,), jnp.float32), jnp.ones((5,), bool))
    assert "tokens" in str(info.value)


def test_model_call_is_checked():
    policy = rx.Policy(CFG, key=jax.random.key(0))
    with pytest.raises(TypeCheckError) as info:
        policy(jnp.zeros((2, 5), jnp.int32), jnp.ones((2, 4), bool))  # mask shorter than tokens
    assert "mask" in str(info.value) and "T=5" in str(info.value)


def test_checks_run_at_trace_time_only():
    policy = rx.Policy(CFG, key=jax.random.key(0))

    @jax.jit
    @chex.assert_max_traces(n=1)  # the second call runs compiled code, with no checks
    def f(tokens, mask):
        return rx.token_logprobs(policy, tokens, mask)

    f(jnp.zeros((4,), jnp.int32), jnp.ones((4,), bool))
    f(jnp.ones((4,), jnp.int32), jnp.ones((4,), bool))
    with pytest.raises(AssertionError):  # a new shape would trace (and check) again
        f(jnp.ones((5,), jnp.int32), jnp.ones((5,), bool))


_SNIPPET = textwrap.dedent(
    """
    import jax.numpy as jnp
    import rlhf_eqx as rx
    try:
        rx.masked_mean(jnp.zeros((3,), jnp.float32), jnp.ones((4,), bool))
    except Exception as e:
        print(type(e).__name__, "mask" in str(e))
    else:
        print("no error")
    """
)


@pytest.mark.parametrize(
    "value, expected", [(None, "TypeCheckError True"), ("1", "TypeCheckError True"), ("0", "")]
)
def test_checks_are_on_by_default_and_switch_off(value, expected):
    """A fresh interpreter, as a user runs it: no pytest hook, default settings."""
    env = {k: v for k, v in os.environ.items() if k != "RLHF_EQX_TYPECHECK"}
    if value is not None:
        env["RLHF_EQX_TYPECHECK"] = value
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, "-c", _SNIPPET], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    if expected:
        assert out.stdout.strip() == expected
    else:
        assert not out.stdout.strip().startswith("TypeCheckError")


def test_hook_is_not_installed_twice():
    from rlhf_eqx import _typecheck

    finders = [f for f in sys.meta_path if type(f).__name__ == "_JaxtypingFinder"]
    assert _typecheck.hook_installed()  # by pytest's --jaxtyping-packages
    _typecheck.install_hook()
    assert [f for f in sys.meta_path if type(f).__name__ == "_JaxtypingFinder"] == finders


def test_default_hook_wraps_public_entry_points_only():
    import ast
    import typing

    from rlhf_eqx._typecheck import instrument

    source = textwrap.dedent(
        '''
        """Doc."""
        def public(x):
            def nested(y):
                return y
            return nested(x)
        def _private(x):
            return x
        @typing.no_type_check
        def opted_out(x):
            return x
        class Model:
            def __call__(self, x):
                return x
            def method(self, x):
                return x
            def _helper(self, x):
                return x
        class _Hidden:
            def method(self, x):
                return x
        '''
    )
    tree = instrument(ast.parse(source))
    decorated = {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.ClassDef))
        and any(ast.unparse(d) == "_rlhf_eqx_typecheck.checked" for d in node.decorator_list)
    }
    assert decorated == {"public", "Model", "__call__", "method"}
    assert (
        len([n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "_Hidden"]) == 1
    )
    assert ast.unparse(tree.body[1]) == "import rlhf_eqx._typecheck as _rlhf_eqx_typecheck"
    del typing


def test_checked_builds_on_first_call_and_checks_modules():
    from jaxtyping import Float

    from rlhf_eqx._typecheck import checked

    @checked
    def f(x: Float[jax.Array, " n"], y: Float[jax.Array, " n"]) -> Float[jax.Array, " n"]:
        return x + y

    assert f(jnp.ones(2), jnp.ones(2)).shape == (2,)
    with pytest.raises(TypeCheckError, match="y"):
        f(jnp.ones(2), jnp.ones(3))

    @checked
    class M(eqx.Module):
        a: Float[jax.Array, " n"]
        b: Float[jax.Array, " n"]

    M(jnp.ones(2), jnp.ones(2))
    with pytest.raises(TypeCheckError):
        M(jnp.ones(2), jnp.ones(3))
