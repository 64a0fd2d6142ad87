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
