"""Per-row sampling settings of `generate_continuous` written as Python lists mixing
floats and ints (`top_p=[0.9, 1, 1]`) or as NumPy int arrays are taken whichever row the
shape check looks at, as `ContinuousDecoding` takes them, and sample as the floats."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlhf_eqx as rx


@pytest.fixture(scope="module")
def policy():
    cfg = rx.TransformerConfig(
        vocab_size=37, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=16
    )
    return rx.Policy(cfg, key=jax.random.key(0))


PROMPTS = jnp.array([[0, 5, 7], [3, 4, 9], [0, 0, 2]], jnp.int32)
MASKS = PROMPTS > 0
KEYS = jax.random.split(jax.random.key(1), 3)


@pytest.mark.parametrize(
    "name, mixed",
    [
        ("temperature", [0.7, 1, 0]),
        ("top_p", [0.9, 1, 1]),
        ("min_p", [0.2, 0, 0]),
        ("repetition_penalty", [1.3, 1, 1]),
        ("presence_penalty", [0.5, 0, 1]),
        ("frequency_penalty", [0.5, 0, -1]),
    ],
)
def test_mixed_lists_and_int_arrays_are_per_row_floats(policy, name, mixed):
    floats = [float(x) for x in mixed]
    run = lambda value: rx.generate_continuous(  # noqa: E731
        policy, PROMPTS, MASKS, KEYS, slots=2, max_new_tokens=4, **{name: value}
    )
    want = run(floats)
    # the shape check looks at one element of a list, drawn at random: every draw passes
    for _ in range(8):
        got = run(mixed)
        np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
        np.testing.assert_array_equal(np.asarray(got.logprobs), np.asarray(want.logprobs))
    if all(float(x).is_integer() for x in mixed):
        got = run(np.asarray(mixed, np.int64))
        np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
