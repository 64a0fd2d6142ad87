"""The pipelines' LoRA settings (`pl.LoRASettings`, `<stage>.lora.*`): each field reaches
the adapters a stage trains and the PEFT directory it exports."""

import json
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlhf_eqx as rx
from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main


def _tiny_policy():
    cfg = rx.TransformerConfig(
        vocab_size=64, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=32
    )
    return rx.Policy(cfg, key=jax.random.key(0))


@pytest.mark.parametrize("use_rslora", [False, True])
def test_use_rslora_scales_the_trained_adapters_and_is_exported(use_rslora, tmp_path):
    """rank 4, alpha 8: each adapter adds `x @ A @ B · s` with `s = 8 / 4` (LoRA) or
    `8 / √4` (rank-stabilised LoRA, Kalajdzievski 2023); the exported
    `adapter_config.json` says which, and reads back to the same model."""
    settings = pl.LoRASettings(rank=4, alpha=8.0, dropout=0.0, use_rslora=use_rslora)
    adapted, spec = pl.runs.with_lora(_tiny_policy(), settings, jax.random.key(1))
    assert spec is not None
    # B starts at zero: give it values so that the scale shows in the output
    b_of = lambda m: [m.transformer.layers.lora[k].b for k in ("q", "v")]  # noqa: E731
    adapted = eqx.tree_at(b_of, adapted, [b + 0.1 for b in b_of(adapted)])
    adapter = adapted.transformer.layers.lora["q"]
    x = np.linspace(-1.0, 1.0, 16, dtype=np.float32)[None]
    scale = 8.0 / (math.sqrt(4) if use_rslora else 4)
    a, b = np.asarray(adapter.a[0]), np.asarray(adapter.b[0])
    first = jax.tree.map(lambda t: t[0] if eqx.is_array(t) else t, adapter)
    got = np.asarray(first(jnp.asarray(x)))
    np.testing.assert_allclose(got, x @ a @ b * scale, rtol=1e-5, atol=1e-6)

    pl.runs.export_policy(pl.runs.final_policy(adapted), str(tmp_path), "sft", adapted=adapted)
    config = json.loads((tmp_path / "sft" / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (4, 8.0, use_rslora)
    back = rx.load_lora_adapter(_tiny_policy(), str(tmp_path / "sft" / "adapter"))
    tokens = np.arange(8, dtype=np.int32)
    mask = np.ones(8, bool)
    np.testing.assert_allclose(
        np.asarray(back(jnp.asarray(tokens), jnp.asarray(mask))),
        np.asarray(adapted(jnp.asarray(tokens), jnp.asarray(mask))),
        rtol=1e-5,
        atol=1e-5,
    )


def test_use_rslora_is_a_checked_setting_of_every_stage(capsys):
    assert main(["dpo", "--set", "dpo.lora.use_rslora=maybe"]) == 2
    assert "dpo.lora.use_rslora='maybe': expected true or false" in capsys.readouterr().err
