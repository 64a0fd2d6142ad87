"""A stage trained with LoRA on a quantised base (`model.quantized=true`: QLoRA) hands
on a dense merged policy: `pipelines.runs.final_policy` decodes the packed base before it
folds the adapters in (it raised on such a base), and on a dense model it is the fold
alone."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlhf_eqx as rx
from rlhf_eqx.models import load_gguf_policy, write_gguf
from rlhf_eqx.pipelines import runs

pytest.importorskip("gguf", reason="GGUF files need the gguf package")

TOKENS = jnp.arange(1, 17)
MASK = jnp.ones(TOKENS.shape, bool)


def _adapted(policy):
    lora = rx.apply_lora(policy, rx.LoRAConfig(rank=2, targets=("q", "v", "down")),
                         key=jax.random.key(1))  # fmt: skip
    bump = lambda x: x + 0.05 if eqx.is_inexact_array(x) else x  # noqa: E731
    return eqx.tree_at(
        lambda m: m.transformer.layers.lora, lora, jax.tree.map(bump, lora.transformer.layers.lora)
    )


def _quantized_leaves(model) -> int:
    kind = rx.models.AbstractQuantizedWeight
    leaves = jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, kind))
    return sum(isinstance(x, kind) for x in leaves)


def test_final_policy_of_a_qlora_model_is_dense_and_computes_the_adapted_model(tmp_path):
    cfg = rx.TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1,
                               d_ff=32)  # fmt: skip
    write_gguf(rx.Policy(cfg, key=jax.random.key(0)), tmp_path / "base.gguf", dtype="q8_0")
    base = load_gguf_policy(tmp_path / "base.gguf", quantized=True)
    assert _quantized_leaves(base) > 0
    trained = _adapted(base)
    merged = runs.final_policy(trained)
    assert _quantized_leaves(merged) == 0 and merged.transformer.layers.lora is None
    np.testing.assert_allclose(merged(TOKENS, MASK), trained(TOKENS, MASK), atol=1e-4)


def test_final_policy_of_a_dense_model_is_the_fold():
    cfg = rx.TransformerConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, d_ff=32)
    trained = _adapted(rx.Policy(cfg, key=jax.random.key(0)))
    merged = runs.final_policy(trained)
    folded = rx.merge_lora(trained)
    for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(folded), strict=True):
        assert (np.asarray(a) == np.asarray(b)).all()
