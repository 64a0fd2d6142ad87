"""A frozen base in llama.cpp blocks computes what its dequantised copy computes for any
number of tokens in one call. Q8_0 and Q6_K decode signed bytes; XLA's CPU backend
miscomputed the `uint8 → int8 → float32` chain once the decode was fused into a product
of more than 4096 rows, so a batch of more than 4096 tokens (an evaluation's or a
training step's) got wrong logits from a QLoRA base."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlhf_eqx as rx
from rlhf_eqx.models import GGUF_BLOCKS, GGUFWeight, quantize_gguf

pytest.importorskip("gguf", reason="quantize_gguf uses the gguf package")


def _q6_k(w):
    """Random Q6_K rows of `w`'s shape (the `gguf` package has no K-quant quantiser):
    random bytes with small float16 block scales."""
    layers, n, out = w.shape
    qk, size = GGUF_BLOCKS["Q6_K"]
    raw = np.random.default_rng(0).integers(0, 256, (layers, out, n // qk, size), np.uint8)
    scale = np.full(raw.shape[:3], 1e-3, "<f2")
    raw[..., 208:210] = scale[..., None].view(np.uint8)
    return GGUFWeight.from_numpy(raw.reshape(layers, out, -1), "Q6_K", n)


@pytest.mark.parametrize("kind", ["Q8_0", "Q6_K"])
def test_more_than_4096_tokens_through_a_packed_base(kind):
    cfg = rx.TransformerConfig(
        vocab_size=64, d_model=256, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64
    )
    policy = rx.Policy(cfg, key=jax.random.key(0))
    w = policy.transformer.layers.wqkv
    packed = quantize_gguf(w, kind) if kind == "Q8_0" else _q6_k(w)
    frozen = eqx.tree_at(lambda m: m.transformer.layers.wqkv, policy, packed)
    dense = eqx.tree_at(lambda m: m.transformer.layers.wqkv, policy, packed.dequantize(jnp.float32))
    tokens = jax.random.randint(jax.random.key(1), (57, 72), 1, 64)  # 4104 tokens
    mask = jnp.ones(tokens.shape, bool)
    np.testing.assert_allclose(frozen(tokens, mask), dense(tokens, mask), atol=1e-4)
