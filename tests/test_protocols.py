"""Model protocols: rlhf_eqx's models inherit them, a model from elsewhere runs every
step builder and the sampler through them (examples/custom_model.py)."""

import importlib.util
import os
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlhf_eqx as rx
from rlhf_eqx.models import (
    AbstractBatchedModel,
    AbstractDecoder,
    AbstractScalarModel,
    AbstractSequenceModel,
)

CFG = rx.TransformerConfig(vocab_size=29, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=24)
_EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "custom_model.py")


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("custom_model", _EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["custom_model"] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["custom_model"]


def test_rlhf_eqx_models_inherit_the_protocols():
    key = jax.random.key(0)
    policy = rx.Policy(CFG, key=key)
    assert isinstance(policy, AbstractDecoder) and isinstance(policy, AbstractBatchedModel)
    assert isinstance(policy, AbstractSequenceModel) and policy.vocab_size == 29
    assert isinstance(rx.ValueModel(CFG, key=key), AbstractSequenceModel)
    reward = rx.RewardModel(CFG, key=key)
    assert isinstance(reward, AbstractScalarModel) and isinstance(reward, AbstractBatchedModel)
    assert not isinstance(reward, AbstractSequenceModel)
    assert isinstance(policy.transformer, AbstractBatchedModel)
    # init_cache has prefill's layout.
    _, filled = policy.prefill(jnp.arange(4), jnp.ones(4, bool), cache_size=7)
    empty = policy.init_cache(7)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), empty) == jax.tree.map(
        lambda a: (a.shape, a.dtype), filled
    )


def test_an_incomplete_decoder_cannot_be_built():
    class NoDecode(AbstractDecoder):
        vocab_size: int = 3

        def __call__(self, tokens, mask, *, key=None):
            return jnp.zeros((tokens.shape[0], 3))

        def init_cache(self, cache_size):
            return None

        def prefill(self, tokens, mask, *, cache_size):
            return jnp.zeros(3), None

    with pytest.raises(TypeError, match="decode_step"):
        NoDecode()


def test_custom_decoder_samples_with_rlhf_eqx(example):
    model = example.TinyRNN(example.VOCAB, example.DIM, key=jax.random.key(0))
    assert len(_class_source_lines(example)) <= 40
    prompts = jnp.array([[1, 2, 3], [0, 4, 5]], jnp.int32)
    masks = jnp.array([[1, 1, 1], [0, 1, 1]], bool)  # left padding
    out = rx.generate_batch(
        model, prompts, masks, jax.random.key(1), max_new_tokens=5, eos_id=[7, 9]
    )
    # The cached decode equals the full forward pass: sampled log-probs == recomputed ones.
    full = jax.vmap(lambda t, m: rx.token_logprobs(model, t, m))(out.tokens, out.mask)
    np.testing.assert_allclose(
        np.where(out.completion_mask, full, 0.0), out.logprobs, rtol=1e-5, atol=1e-5
    )
    with pytest.raises(ValueError, match="prompt row 1 has id 16"):
        rx.generate_batch(
            model, prompts.at[1, 0].set(16), masks, jax.random.key(1), max_new_tokens=2
        )


def _class_source_lines(example):
    import inspect

    lines = (
        inspect.getsource(example.RNNCache).splitlines()
        + inspect.getsource(example.TinyRNN).splitlines()
    )
    return [line for line in lines if line.strip()]


@pytest.mark.parametrize("algorithm", ["sft", "dpo", "ppo", "grpo"])
def test_custom_decoder_trains_with_every_step_builder(example, algorithm):
    policy = example.TinyRNN(example.VOCAB, example.DIM, key=jax.random.key(0))
    run = getattr(example, f"run_{algorithm}")
    losses = run(policy, jax.random.key(2), steps=4)
    assert np.all(np.isfinite(losses))
    assert losses[-1] < losses[0], losses
    # The policy passed in is untouched (steps are pure; the example does not donate it).
    assert eqx.tree_equal(
        policy, example.TinyRNN(example.VOCAB, example.DIM, key=jax.random.key(0))
    )
