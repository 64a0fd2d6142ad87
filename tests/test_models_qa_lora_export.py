"""A quantised base trained with LoRA, taken back out: `save_gguf` folds the adapters
into the dequantised weights; `save_hf` asks for the fold, naming the call that works
for the base it has (`merge_lora(dequantize(policy))` for a quantised one)."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlhf_eqx as rx
from rlhf_eqx.models import dequantize, load_gguf_policy, write_gguf

pytest.importorskip("gguf", reason="GGUF files need the gguf package")

TOKENS = jnp.arange(1, 17)
MASK = jnp.ones(TOKENS.shape, bool)


def _trained(policy):
    """`policy` with LoRA adapters moved away from zero (as after some training)."""
    lora = rx.apply_lora(policy, rx.LoRAConfig(rank=2, targets=("q", "k", "o", "down")),
                         key=jax.random.key(1))  # fmt: skip
    bump = lambda x: x + 0.05 if eqx.is_inexact_array(x) else x
    return eqx.tree_at(
        lambda m: m.transformer.layers.lora, lora, jax.tree.map(bump, lora.transformer.layers.lora)
    )


@pytest.fixture(scope="module")
def gguf_base(tmp_path_factory):
    cfg = rx.TransformerConfig(
        vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32
    )
    path = tmp_path_factory.mktemp("base") / "base.gguf"
    write_gguf(rx.Policy(cfg, key=jax.random.key(0)), path, dtype="q8_0")
    return load_gguf_policy(path, quantized=True)


def test_a_qlora_model_exports_to_gguf_with_the_adapters_folded_in(gguf_base, tmp_path):
    trained = _trained(gguf_base)
    write_gguf(trained, tmp_path / "merged.gguf", dtype="f32")
    back = load_gguf_policy(tmp_path / "merged.gguf")
    assert back.transformer.layers.lora is None and back.cfg == trained.cfg
    np.testing.assert_allclose(back(TOKENS, MASK), trained(TOKENS, MASK), atol=1e-4)
    moved = np.abs(np.asarray(trained(TOKENS, MASK) - gguf_base(TOKENS, MASK))).max()
    assert moved > 1e-2  # the adapters changed the outputs: the fold is what is compared


@pytest.mark.parametrize("quantize", [None, rx.quantize_int8, "gguf"])
def test_save_hf_names_the_fold_for_the_base_it_has(gguf_base, tmp_path, quantize):
    if quantize == "gguf":
        base = gguf_base
    else:
        base = dequantize(gguf_base, dtype="float32")
        base = quantize(base) if quantize is not None else base
    trained = _trained(base)
    call = "merge_lora(policy)" if quantize is None else "merge_lora(dequantize(policy))"
    with pytest.raises(ValueError, match=f"fold them in with {re.escape(call)} "):
        rx.save_hf(trained, tmp_path / "hf")
    merged = rx.merge_lora(dequantize(trained, dtype="float32"))
    rx.save_hf(merged, tmp_path / "hf")
    np.testing.assert_allclose(
        rx.load_hf(tmp_path / "hf")(TOKENS, MASK), trained(TOKENS, MASK), atol=1e-4
    )
