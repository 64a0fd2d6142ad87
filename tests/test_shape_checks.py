"""Runtime shape checks: wrong shapes or dtypes name the argument and the dimensions."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
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
    import json
    import jax
    import jax.numpy as jnp
    import rlhf_eqx as rx

    def error(f, *args):
        try:
            f(*args)
        except Exception as e:
            return [type(e).__name__, str(e)]
        return [None, ""]

    def wrapped(f):
        return "__wrapped__" in vars(f)

    x, mask = jnp.zeros((3,), jnp.float32), jnp.ones((3,), bool)
    short = jnp.ones((1,), bool)  # broadcasts: only the checks refuse it
    first = error(rx.masked_mean, x, short)
    for _ in range(3):  # the same signature again and again: checked once
        rx.masked_mean(x, mask)
    again = error(rx.masked_mean, x, short)
    dtype = error(rx.masked_mean, jnp.zeros((3,), jnp.int32), mask)
    traced = error(jax.jit(rx.masked_mean), x, short)
    host = (
        rx.data.Llama2cTokenizer.encode,
        rx.data.tokenize_preferences,
        rx.data.collate_preferences,
        rx.data.PreferenceRecord.__init__,
    )
    print(json.dumps({
        "first": [first[0], "mask" in first[1]],
        "again": [again[0], "mask" in again[1]],
        "dtype": [dtype[0], "'x'" in dtype[1]],
        "traced": [traced[0], "mask" in traced[1]],
        "array_function_wrapped": wrapped(rx.masked_mean),
        "host_functions_wrapped": [wrapped(f) for f in host],
    }))
    """
)


@pytest.mark.parametrize("value, on", [(None, True), ("1", True), ("0", False)])
def test_checks_are_on_by_default_and_switch_off(value, on):
    """A fresh interpreter, as a user runs it: no pytest hook, default settings. With the
    checks on, a wrong shape or dtype at a public array function raises, also after
    calls of the same function that passed (and under `jax.jit`); functions of plain
    Python values (a tokenizer, the host-side data functions) are not wrapped. With them
    off nothing is wrapped and nothing raises."""
    env = {k: v for k, v in os.environ.items() if k != "RLHF_EQX_TYPECHECK"}
    if value is not None:
        env["RLHF_EQX_TYPECHECK"] = value
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, "-c", _SNIPPET], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    raised = ["TypeCheckError", True] if on else [None, False]
    assert [got[k] for k in ("first", "again", "dtype", "traced")] == [raised] * 4
    assert got["array_function_wrapped"] is on
    assert got["host_functions_wrapped"] == [False] * 4


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


def test_only_array_annotations_are_wrapped():
    from jaxtyping import Array, Float, Int, PyTree

    from rlhf_eqx._typecheck import checked, wants_check

    def host(text: str, ids: list[int], n: int | None = None) -> tuple[int, ...]:
        return tuple(ids[:n])

    def untyped(x, y):
        return x

    def optional(x: Float[Array, " n"] | None) -> int:
        return 0

    def nested(xs: list[Int[np.ndarray, " n"]]) -> int:
        return 0

    def tree(t: PyTree) -> int:
        return 0

    def returns(n: int) -> jax.Array:
        return jnp.zeros(n)

    @dataclasses.dataclass(frozen=True)
    class Record:
        prompt: str
        ids: tuple[int, ...]

    class Batch(eqx.Module):
        tokens: Int[Array, "B T"]
        name: str = "b"

    assert [wants_check(f) for f in (host, untyped, optional, nested, tree, returns)] == [
        False,
        False,
        True,
        True,
        True,
        True,
    ]
    assert checked(host) is host and checked(untyped) is untyped
    init = Record.__init__
    assert checked(Record) is Record and Record.__init__ is init  # free to construct
    assert wants_check(Batch) and not wants_check(Record)
    init = Batch.__init__
    assert checked(Batch) is Batch and Batch.__init__.__wrapped__ is init
    with pytest.raises(TypeCheckError, match="tokens"):
        Batch(jnp.zeros((2, 3)))


def test_call_keys_tell_apart_what_the_checks_read():
    from rlhf_eqx._typecheck import _call_key

    a, b = jnp.zeros((2, 3)), jnp.ones((2, 3))
    assert _call_key((a,), {"k": 1}) == _call_key((b,), {"k": 1})  # values do not matter
    different = [
        ((jnp.zeros((2, 4)),), {"k": 1}),  # shape
        ((jnp.zeros((2, 3), jnp.int32),), {"k": 1}),  # dtype
        ((np.zeros((2, 3), np.float32),), {"k": 1}),  # array type
        ((a,), {"k": 2}),  # scalar value
        ((a,), {"k": True}),  # bool is not int
        ((a,), {"k": 1.0}),  # nor float
        ((a,), {"j": 1}),  # keyword name
    ]
    keys = [_call_key(args, kw) for args, kw in different]
    assert len(set(keys + [_call_key((a,), {"k": 1})])) == len(keys) + 1
    assert _call_key((a, (1, "x")), {}) == _call_key((b, (1, "x")), {})
    assert _call_key((a, (1, "x")), {}) != _call_key((a, [1, "x"]), {})
    for unkeyed in (
        object(),
        "x" * 100,
        list(range(100)),
        eqx.nn.Linear(2, 2, key=jax.random.key(0)),
    ):
        assert _call_key((a, unkeyed), {}) is None


def test_memoised_checks_still_refuse_new_wrong_signatures():
    from jaxtyping import Array, Float, Int

    from rlhf_eqx._typecheck import checked

    @checked
    def f(x: Float[Array, " n"], y: Float[Array, " n"], *, k: int = 1) -> Float[Array, " n"]:
        return k * (x + y)

    for _ in range(3):
        assert f(jnp.ones(2), jnp.ones(2), k=2).tolist() == [4.0, 4.0]
    for bad in ((jnp.ones(2), jnp.ones(3)), (jnp.ones(2), jnp.ones(2, jnp.int32))):
        with pytest.raises(TypeCheckError, match="y"):
            f(*bad)
    with pytest.raises(TypeCheckError, match="k"):
        f(jnp.ones(2), jnp.ones(2), k="2")
    with pytest.raises(TypeCheckError, match="y"):  # traced: checked at trace time
        jax.jit(f)(jnp.ones(2), jnp.ones(3))
    assert f(jnp.ones(5), jnp.ones(5)).shape == (5,)

    @checked
    class M(eqx.Module):
        a: Float[Array, " n"]
        b: Int[Array, " n"]

    for _ in range(3):
        M(jnp.ones(2), jnp.ones(2, jnp.int32))
    with pytest.raises(TypeCheckError):
        M(jnp.ones(2), jnp.ones(3, jnp.int32))
    with pytest.raises(TypeCheckError):
        M(jnp.ones(2), jnp.ones(2))  # float where int is required
    with pytest.raises(TypeCheckError):
        M(jnp.ones(2), b=jnp.ones(3, jnp.int32))

    class Tokens:
        @checked
        def count(self, ids: Int[Array, " n"]) -> int:
            return int(ids.shape[0])

    t = Tokens()
    assert t.count(jnp.ones(3, jnp.int32)) == Tokens().count(jnp.ones(3, jnp.int32)) == 3
    with pytest.raises(TypeCheckError, match="ids"):
        t.count(jnp.ones(3))
