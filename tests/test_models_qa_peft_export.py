"""`save_lora_adapter` refuses adapters that `load_lora_adapter` would refuse to read
back: a NaN or ±inf adapter (a diverged run) is named, and the adapter already in the
directory stays as it was."""

import os

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import rlhf_eqx as rx


@pytest.mark.parametrize("value", [jnp.nan, jnp.inf])
def test_a_non_finite_adapter_is_named_and_the_old_one_kept(tmp_path, value):
    cfg = rx.TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=32)
    adapted = rx.apply_lora(
        rx.Policy(cfg, key=jax.random.key(0)), rx.LoRAConfig(rank=2), key=jax.random.key(1)
    )
    rx.save_lora_adapter(adapted, tmp_path / "adapter")
    before = {n: (tmp_path / "adapter" / n).read_bytes() for n in os.listdir(tmp_path / "adapter")}
    poison = lambda x: x.at[1].set(value) if eqx.is_inexact_array(x) else x
    lora = jax.tree.map(poison, adapted.transformer.layers.lora)
    diverged = eqx.tree_at(lambda m: m.transformer.layers.lora, adapted, lora)
    with pytest.raises(ValueError) as e:
        rx.save_lora_adapter(diverged, tmp_path / "adapter")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"save_lora_adapter: {tmp_path / 'adapter'}: ")
    assert "'base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight'" in msg
    assert msg.endswith("(a diverged model?); nothing written")
    after = {n: (tmp_path / "adapter" / n).read_bytes() for n in os.listdir(tmp_path / "adapter")}
    assert after == before and os.listdir(tmp_path) == ["adapter"]


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    cfg = rx.TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=32)
    base = rx.Policy(cfg, key=jax.random.key(0))
    d = tmp_path_factory.mktemp("adapter")
    rx.save_lora_adapter(rx.apply_lora(base, rx.LoRAConfig(rank=2), key=jax.random.key(1)), d)
    return base, d


@pytest.mark.parametrize("dropout", ["0.1", -0.1, 1.0, True])
def test_a_lora_dropout_that_is_not_a_probability_is_named(adapter_dir, tmp_path, dropout):
    import json
    import shutil

    base, d = adapter_dir
    shutil.copytree(d, tmp_path / "ad")
    path = tmp_path / "ad" / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "lora_dropout": dropout}))
    with pytest.raises(ValueError) as e:
        rx.load_lora_adapter(base, tmp_path / "ad")
    assert str(e.value) == (f"{path}: `lora_dropout` must be a number in [0, 1), got {dropout!r}")


def test_an_adapter_path_that_is_not_a_directory_says_so(adapter_dir, tmp_path):
    base, d = adapter_dir
    cases = ((d / "adapter_config.json", "not a directory"), (tmp_path / "no", "no such"))
    for path, what in cases:
        with pytest.raises(FileNotFoundError) as e:
            rx.load_lora_adapter(base, path)
        assert str(e.value).startswith(f"{path}: {what}")
        assert "load_lora_adapter reads a PEFT adapter directory" in str(e.value)
