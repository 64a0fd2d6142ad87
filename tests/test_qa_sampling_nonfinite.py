"""A model whose logits are NaN (broken weights) is never sampled silently: every sampler
marks the tokens it drew from them with non-finite log-probs (`GenerationOutput`)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlhf_eqx as rx


@pytest.fixture(scope="module")
def broken():
    cfg = rx.TransformerConfig(
        vocab_size=37, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=16
    )
    policy = rx.Policy(cfg, key=jax.random.key(0))
    return jax.tree.map(lambda x: x * jnp.nan if eqx.is_inexact_array(x) else x, policy)


PROMPTS = jnp.array([[0, 5, 7], [3, 4, 9]], jnp.int32)
MASKS = jnp.array([[False, True, True], [True, True, True]])
KEYS = jax.random.split(jax.random.key(1), 2)


def _all_marked(out):
    lp = np.asarray(out.logprobs)[np.asarray(out.completion_mask)]
    assert lp.size > 0 and not np.isfinite(lp).any()


@pytest.mark.parametrize(
    "settings", [dict(temperature=0.0), dict(temperature=1.0), dict(top_k=4, top_p=0.9)]
)
def test_generate_batch_marks_nan_logits(broken, settings):
    _all_marked(rx.generate_batch(broken, PROMPTS, MASKS, KEYS, max_new_tokens=3, **settings))


@pytest.mark.slow
def test_continuous_paged_and_speculative_mark_nan_logits(broken):
    _all_marked(rx.generate_continuous(broken, PROMPTS, MASKS, KEYS, slots=1, max_new_tokens=3))
    out, _ = rx.generate_paged(broken, PROMPTS, MASKS, KEYS, slots=2, max_new_tokens=3)
    _all_marked(out)
    key = jax.random.key(2)
    _all_marked(rx.generate_speculative(broken, broken, PROMPTS, MASKS, key, max_new_tokens=3, k=2))


def test_sample_token_marks_broken_logits():
    key = jax.random.key(0)
    for logits in (
        jnp.full((11,), jnp.nan),
        jnp.zeros((11,)).at[3].set(jnp.nan),
        jnp.zeros((11,)).at[3].set(jnp.inf),
        jnp.full((11,), -jnp.inf),
    ):
        for temperature in (0.0, 1.0):
            _, lp = rx.sample_token(key, logits, temperature=temperature)
            assert not np.isfinite(float(lp))
    _, lp = rx.sample_token(key, jnp.zeros((11,)).at[3].set(-jnp.inf))
    assert np.isfinite(float(lp))
