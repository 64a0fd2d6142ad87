"""Runtime shape checks: wrong shapes or dtypes name the argument and the dimensions."""

import os
import subprocess
import sys
import textwrap

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
    calls = {"n": 0}
    policy = rx.Policy(CFG, key=jax.random.key(0))

    @jax.jit
    def f(tokens, mask):
        calls["n"] += 1
        return rx.token_logprobs(policy, tokens, mask)

    f(jnp.zeros((4,), jnp.int32), jnp.ones((4,), bool))
    f(jnp.ones((4,), jnp.int32), jnp.ones((4,), bool))
    assert calls["n"] == 1  # traced once; the second call runs compiled code with no checks


_SNIPPET = textwrap.dedent(
    """
    import jax.numpy as jnp
    import rlhf_eqx as rx
    try:
        rx.masked_mean(jnp.zeros((3,), jnp.float32), jnp.ones((4,), bool))
    except Exception as e:
        print(type(e).__name__)
    else:
        print("no error")
    """
)


@pytest.mark.parametrize("value, expected", [("1", "TypeCheckError"), ("0", "")])
def test_environment_variable_switches_checks(value, expected):
    env = {**os.environ, "RLHF_EQX_TYPECHECK": value}
    out = subprocess.run(
        [sys.executable, "-c", _SNIPPET], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    if expected:
        assert out.stdout.strip() == expected
    else:
        assert out.stdout.strip() != "TypeCheckError"
