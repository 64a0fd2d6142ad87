"""`load_gguf_policy` on files laid out as llama.cpp's `convert_hf_to_gguf.py` lays them
out, written here independently of `write_gguf` from the tiny Hugging Face checkpoints
of `tests/fixtures/hf` (see `test_families.py`).

The converter's steps repeated here: metadata `{arch}.context_length`,
`.embedding_length`, `.block_count`, `.feed_forward_length`, `.attention.head_count`,
`.attention.head_count_kv`, `.attention.layer_norm_rms_epsilon`, `.rope.freq_base`,
`.attention.key_length` / `.value_length` when the config has `head_dim` (always for
Gemma), `.vocab_size` and `.rope.dimension_count` for `llama`, `.attention.sliding_window`
for Mistral and Gemma 2/3, Gemma 2's soft-caps, Gemma 3's linear rope scaling; tensor
names from the `gguf` package's own `TensorNameMap` (not the loader's table); the
`llama` q/k rows permuted (`LlamaModel.permute`), Gemma's norms stored as `1 + w` and
Gemma's tied `lm_head` left out; Llama 3's rope scaling as the tensor
`rope_freqs.weight` computed by `LlamaModel.generate_extra_tensors`' formula.

The logits are compared with transformers' own on the Hugging Face checkpoint (the
fixtures' `reference.npz`), and for Gemma 2/3, whose fixtures use an attention scale and
window pattern llama.cpp cannot express, with `load_hf` of the checkpoint under
llama.cpp's values. transformers' GGUF loader (5.25) cannot be the reference for these
files: it refuses `gemma`, takes the vocabulary size from a tokenizer (these files
have none; the loader here takes it from `token_embd.weight`), ignores `key_length` for
qwen3, `rope_freqs.weight` and a `llama` file's sliding window, and drops Gemma 3's
rope scaling.
"""

import json
import math
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

import rlhf_eqx as rx
from rlhf_eqx.models import load_gguf_policy

gguf = pytest.importorskip("gguf", reason="GGUF files need the gguf package")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

HF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")
ARCH = {"llama3": "llama", "mistral": "llama"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """`LlamaModel.permute` of `convert_hf_to_gguf.py`."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _llama3_factors(c: dict) -> np.ndarray:
    """`rope_freqs.weight` as `LlamaModel.generate_extra_tensors` computes it."""
    rs, dim = c["rope_scaling"], c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    freqs = 1.0 / (c["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def _convert(directory, path) -> str:
    """The checkpoint in `directory` written to `path` as the converter writes it."""
    with open(os.path.join(directory, "config.json")) as f:
        c = json.load(f)
    family = os.path.basename(directory).removeprefix("hf-")
    arch = ARCH.get(family, family)
    n_layers, heads = c["num_hidden_layers"], c["num_attention_heads"]
    kv = c.get("num_key_value_heads", heads)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n_layers)
    w = gguf.GGUFWriter(os.fspath(path), arch)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(n_layers)
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    if "rope_theta" in c:
        w.add_rope_freq_base(c["rope_theta"])
    if c.get("head_dim") is not None:
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
    if arch == "llama":
        w.add_vocab_size(c["vocab_size"])
        w.add_rope_dimension_count(c.get("head_dim") or c["hidden_size"] // heads)
    if family in ("mistral", "gemma2", "gemma3"):
        w.add_sliding_window(c["sliding_window"])
    if family == "gemma2":
        w.add_attn_logit_softcapping(c["attn_logit_softcapping"])
        w.add_final_logit_softcapping(c["final_logit_softcapping"])
    if family == "gemma3" and c.get("rope_scaling"):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(c["rope_scaling"]["factor"])
    if family == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_factors(c))
    tensors = safetensors_numpy.load_file(os.path.join(directory, "model.safetensors"))
    for name, t in tensors.items():
        t = np.asarray(t, np.float32)
        if arch.startswith("gemma") and name == "lm_head.weight":
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            t = _permute(t, heads if "q_proj" in name else kv)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            t = t + 1
        base, suffix = name.rsplit(".", 1)
        w.add_tensor(f"{names.get_name(base)}.{suffix}", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return os.fspath(path)


def _llama_cpp_checkpoint(family: str, tmp_path) -> str:
    """Gemma 2/3's fixtures under llama.cpp's attention scale (`head_dim^-1/2`) and, for
    Gemma 3, its window pattern (every sixth layer global)."""
    directory = tmp_path / f"hf-{family}"
    shutil.copytree(os.path.join(HF, family), directory)
    with open(directory / "config.json") as f:
        c = json.load(f)
    c["query_pre_attn_scalar"] = c["head_dim"]
    if family == "gemma3":
        c["layer_types"] = [
            ("full" if (i + 1) % 6 == 0 else "sliding") + "_attention"
            for i in range(c["num_hidden_layers"])
        ]
    with open(directory / "config.json", "w") as f:
        json.dump(c, f)
    return os.fspath(directory)


@pytest.mark.parametrize("family", ["llama3", "mistral", "qwen2", "qwen3", "gemma"])
def test_converted_files_match_transformers(family, tmp_path):
    directory = tmp_path / f"hf-{family}"
    shutil.copytree(os.path.join(HF, family), directory)
    policy = load_gguf_policy(_convert(directory, tmp_path / f"{family}.gguf"))
    assert policy.cfg == rx.load_hf(os.path.join(HF, family), dtype="float32").cfg
    ref = np.load(os.path.join(HF, family, "reference.npz"))
    for row in range(len(ref["tokens"])):
        tokens, mask = jnp.asarray(ref["tokens"][row]), jnp.asarray(ref["mask_right"][row])
        logits = np.asarray(policy(tokens, mask))[np.asarray(mask)]
        want = ref["logits_right"][row][np.asarray(mask)]
        np.testing.assert_allclose(logits, want, atol=2e-5, rtol=0)
        np.testing.assert_array_equal(logits.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_converted_gemma_files_match_load_hf(family, tmp_path):
    directory = _llama_cpp_checkpoint(family, tmp_path)
    policy = load_gguf_policy(_convert(directory, tmp_path / f"{family}.gguf"))
    dense = rx.load_hf(directory, dtype="float32")
    assert policy.cfg == dense.cfg
    ref = np.load(os.path.join(HF, family, "reference.npz"))
    tokens, mask = jnp.asarray(ref["tokens"][0]), jnp.asarray(ref["mask_right"][0])
    np.testing.assert_allclose(policy(tokens, mask), dense(tokens, mask), atol=2e-5, rtol=0)
