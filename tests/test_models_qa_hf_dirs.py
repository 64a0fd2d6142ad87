"""Hugging Face checkpoint directories broken the way copies break: a shard of a sharded
checkpoint missing is named with what the index maps to it."""

import os

import jax
import pytest

import rlhf_eqx as rx


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    cfg = rx.TransformerConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=4, d_ff=48)
    d = tmp_path_factory.mktemp("sharded")
    rx.save_hf(rx.Policy(cfg, key=jax.random.key(0)), d, max_shard_bytes=20000)
    return d


def test_a_missing_shard_is_named_with_what_the_index_maps_to_it(sharded, tmp_path):
    shards = sorted(n for n in os.listdir(sharded) if n.startswith("model-"))
    assert len(shards) > 2
    for name in os.listdir(sharded):
        if name != shards[1]:
            os.symlink(sharded / name, tmp_path / name)
    with pytest.raises(FileNotFoundError) as e:
        rx.load_hf(tmp_path)
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / shards[1]}: file not found (model.safetensors.index.json")
    assert "tensors to it: a shard missing from the checkpoint)" in msg and "\n" not in msg


def test_a_tensor_in_two_shards_is_named_with_both(sharded, tmp_path):
    from safetensors.numpy import load_file, save_file

    shards = sorted(n for n in os.listdir(sharded) if n.startswith("model-"))
    for name in os.listdir(sharded):
        os.symlink(sharded / name, tmp_path / name)
    first, second = (load_file(sharded / s) for s in shards[:2])
    name = sorted(first)[0]
    os.remove(tmp_path / shards[1])
    save_file({**second, name: first[name] * 2}, tmp_path / shards[1], metadata={"format": "pt"})
    with pytest.raises(ValueError) as e:
        rx.load_hf(tmp_path)
    assert str(e.value) == (
        f"{tmp_path / shards[1]}: tensor {name!r} is also in {tmp_path / shards[0]} (two "
        "shards hold it; which copy is meant is not known)"
    )


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_a_layer_count_past_the_tensors_is_named_at_once(sharded, tmp_path, arch):
    """A mistyped `num_hidden_layers` is compared with the layers the checkpoint holds
    before anything is built per layer (a window per layer, a stacked array)."""
    import json

    for name in os.listdir(sharded):
        if name != "config.json":
            os.symlink(sharded / name, tmp_path / name)
    config = json.loads((sharded / "config.json").read_text())
    extra = {"use_sliding_window": True, "sliding_window": 4} if arch.startswith("Qwen") else {}
    config.update(architectures=[arch], num_hidden_layers=2_000_000_000, **extra)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as e:
        rx.load_hf(tmp_path)
    assert str(e.value) == (
        f"{tmp_path / 'config.json'}: `num_hidden_layers` = 2000000000 but the checkpoint "
        "holds the tensors of 2 layers (layer 2's are missing)"
    )


def test_an_unsupported_architecture_is_named_before_its_layer_count(sharded, tmp_path):
    import json

    for name in os.listdir(sharded):
        if name != "config.json":
            os.symlink(sharded / name, tmp_path / name)
    config = json.loads((sharded / "config.json").read_text())
    config.update(architectures=["GPTNeoXForCausalLM"], num_hidden_layers=40)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="`architectures` = \\['GPTNeoXForCausalLM'\\] is not"):
        rx.load_hf(tmp_path)
