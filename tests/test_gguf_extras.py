"""GGUF files as llama.cpp's converter writes them beyond the plain layouts: a `llama`
file holding q/k/v attention biases (read, refused for a non-zero output bias, written
back), and the model card (`general.*` metadata) carried from a loaded file to a
written one (`write_gguf(general=...)`).

The files are written by hand with llama.cpp's own `gguf.GGUFWriter` from the
Hugging Face tensors of a model built directly (`rx.save_hf`), so the reference is that
model's logits.
"""

import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlhf_eqx as rx
from rlhf_eqx.models import load_gguf_policy, write_gguf

gguf = pytest.importorskip("gguf", reason="GGUF files need the gguf package")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

T, V = gguf.GGMLQuantizationType, gguf.GGUFValueType
TOKENS = jnp.asarray([1, 7, 30, 2, 55, 61, 9, 40])
MASK = jnp.ones(TOKENS.shape, bool)
_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    **{f"self_attn.{p}_proj.{k}": f"attn_{p}.{k}" for p in "qkv" for k in ("weight", "bias")},
    **{f"mlp.{p}_proj.weight": f"ffn_{p}.weight" for p in ("gate", "up", "down")},
}


def _logits(model) -> np.ndarray:
    return np.asarray(eqx.filter_jit(lambda m, t, k: m(t, k))(model, TOKENS, MASK))


@pytest.fixture(scope="module")
def biased():
    """A Llama-layout policy with random non-zero q/k/v biases (GQA, untied head)."""
    cfg = rx.TransformerConfig(
        vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
        norm_eps=1e-5, attn_bias=True,
    )  # fmt: skip
    policy = rx.Policy(cfg, key=jax.random.key(0))
    where = lambda p: p.transformer.layers.bqkv
    bias = 0.5 * jax.random.normal(jax.random.key(1), where(policy).shape)
    return eqx.tree_at(where, policy, bias)


def _interleave(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row permutation (`LlamaModel.permute`)."""
    out, rest = w.shape[0], w.shape[1:]
    w = w.reshape(heads, 2, out // heads // 2, *rest).swapaxes(1, 2)
    return np.ascontiguousarray(w.reshape(out, *rest))


def _hf_tensors(policy, tmp_path) -> dict[str, np.ndarray]:
    directory = tmp_path / "hf"
    rx.save_hf(policy, directory, dtype="float32")
    return safetensors_numpy.load_file(os.fspath(directory / "model.safetensors"))


def _write_llama(path, policy, tmp_path, *, drop=(), extra=None, meta=None) -> str:
    """`policy` as llama.cpp's converter writes a Llama model with biases: architecture
    `llama`, q/k weight and bias rows interleaved; `meta` adds keys
    (`{key: (value, GGUFValueType)}`)."""
    cfg = policy.cfg
    w = gguf.GGUFWriter(os.fspath(path), "llama")
    for key, value in {
        "block_count": cfg.n_layers, "embedding_length": cfg.d_model,
        "feed_forward_length": cfg.d_ff, "attention.head_count": cfg.n_heads,
        "attention.head_count_kv": cfg.n_kv_heads, "context_length": cfg.max_seq_len,
        "vocab_size": cfg.vocab_size,
    }.items():  # fmt: skip
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.rope.freq_base", cfg.rope_theta)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", cfg.norm_eps)
    for key, (value, kind) in (meta or {}).items():
        w.add_key_value(key, value, kind, sub_type=V.STRING if kind == V.ARRAY else None)
    names = dict(_NAMES)
    for i in range(cfg.n_layers):
        names |= {f"model.layers.{i}.{h}": f"blk.{i}.{g}" for h, g in _LAYER.items()}
    for hf, arr in _hf_tensors(policy, tmp_path).items():
        name = names[hf]
        if name in drop:
            continue
        if ".q_proj." in hf or ".k_proj." in hf:
            arr = _interleave(arr, cfg.n_heads if ".q_proj." in hf else cfg.n_kv_heads)
        w.add_tensor(name, np.ascontiguousarray(arr, np.float32), raw_dtype=T.F32)
    for name, arr in (extra or {}).items():
        w.add_tensor(name, arr, raw_dtype=T.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return os.fspath(path)


def _fields(path) -> dict:
    reader = gguf.GGUFReader(path)
    out = {}
    for key, f in reader.fields.items():
        values = [f.contents(i) for i in range(len(f.data))] if f.types[0] == V.ARRAY else None
        out[key] = values if values is not None else f.contents()
    return out


# ---------------------------------------------------------------- attention biases


def test_llama_file_with_biases_loads_as_the_model_it_was_written_from(biased, tmp_path):
    path = _write_llama(tmp_path / "b.gguf", biased, tmp_path)
    loaded = load_gguf_policy(path)
    assert loaded.cfg.attn_bias and loaded.cfg == biased.cfg
    np.testing.assert_allclose(_logits(loaded), _logits(biased), atol=2e-5, rtol=1e-5)
    reference = rx.load_hf(tmp_path / "hf")  # the same weights through config.json
    np.testing.assert_allclose(_logits(loaded), _logits(reference), atol=2e-5, rtol=1e-5)


def test_llama_biases_in_packed_blocks_match_dense(biased, tmp_path):
    path = _write_llama(tmp_path / "b.gguf", biased, tmp_path)
    packed = load_gguf_policy(path, quantized=True)
    np.testing.assert_allclose(_logits(packed), _logits(biased), atol=2e-5, rtol=1e-5)


def test_an_absent_llama_bias_is_zero(biased, tmp_path):
    """llama.cpp takes each of the q/k/v biases as optional: a file without `attn_v.bias`
    is the model whose v bias is zero."""
    cfg = biased.cfg
    where = lambda p: p.transformer.layers.bqkv
    no_v = eqx.tree_at(where, biased, where(biased).at[:, cfg.q_size + cfg.kv_size :].set(0.0))
    path = _write_llama(
        tmp_path / "b.gguf", biased, tmp_path, drop=("blk.0.attn_v.bias", "blk.1.attn_v.bias")
    )
    np.testing.assert_allclose(_logits(load_gguf_policy(path)), _logits(no_v), atol=2e-5, rtol=1e-5)


def test_output_bias_is_refused_unless_zero(biased, tmp_path):
    D = biased.cfg.d_model
    ones = {"blk.1.attn_output.bias": np.full(D, 0.25, np.float32)}
    path = _write_llama(tmp_path / "o.gguf", biased, tmp_path, extra=ones)
    with pytest.raises(ValueError) as excinfo:
        load_gguf_policy(path)
    msg = str(excinfo.value)
    assert "\n" not in msg and "'blk.1.attn_output.bias'" in msg and path in msg
    assert "output projection" in msg and "q/k/v biases only" in msg
    zeros = {"blk.1.attn_output.bias": np.zeros(D, np.float32)}
    path = _write_llama(tmp_path / "z.gguf", biased, tmp_path, extra=zeros)
    np.testing.assert_allclose(
        _logits(load_gguf_policy(path)), _logits(biased), atol=2e-5, rtol=1e-5
    )


def test_biases_round_trip_through_write_gguf(biased, tmp_path):
    loaded = load_gguf_policy(_write_llama(tmp_path / "b.gguf", biased, tmp_path))
    again = tmp_path / "again.gguf"
    write_gguf(loaded, again, dtype="f32")
    back = load_gguf_policy(again)
    assert back.cfg == loaded.cfg
    np.testing.assert_array_equal(_logits(back), _logits(loaded))
    assert "blk.1.attn_q.bias" in {t.name for t in gguf.GGUFReader(again).tensors}


def test_llama3_rope_with_biases_is_written_as_llama(biased, tmp_path):
    """q/k/v biases with a Llama 3 rope scaling are written as `llama` (llama.cpp's
    `qwen2` has no `rope_freqs.weight`), the bias rows permuted like the weights'."""
    import dataclasses

    scaling = rx.RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    cfg = dataclasses.replace(biased.cfg, rope_scaling=scaling)
    where = lambda p: p.transformer.layers.bqkv
    model = eqx.tree_at(where, rx.Policy(cfg, key=jax.random.key(0)), where(biased))
    path = tmp_path / "l3.gguf"
    write_gguf(model, path, dtype="f32")
    fields = _fields(path)
    assert fields["general.architecture"] == "llama"
    stored = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(path).tensors}
    bq = np.asarray(model.transformer.layers.bqkv[0, : cfg.q_size])
    np.testing.assert_array_equal(stored["blk.0.attn_q.bias"], _interleave(bq, cfg.n_heads))
    back = load_gguf_policy(path)
    assert back.cfg == model.cfg
    np.testing.assert_allclose(_logits(back), _logits(model), atol=2e-5, rtol=1e-5)


# ---------------------------------------------------------------- the model card


_CARD = {
    "general.name": ("Tiny Llama Biased", V.STRING),
    "general.basename": ("tiny-llama", V.STRING),
    "general.finetune": ("instruct", V.STRING),
    "general.size_label": ("60K", V.STRING),
    "general.license": ("apache-2.0", V.STRING),
    "general.author": ("Someone", V.STRING),
    "general.tags": (["text-generation", "tiny"], V.ARRAY),
    "general.file_type": (7, V.UINT32),  # Q8_0: not what a float32 file is
    "general.quantization_version": (1, V.UINT32),
}


def test_the_model_card_is_carried_and_the_encoding_keys_are_the_new_files(biased, tmp_path):
    source = _write_llama(tmp_path / "card.gguf", biased, tmp_path, meta=_CARD)
    out = tmp_path / "out.gguf"
    write_gguf(load_gguf_policy(source), out, dtype="f32", general=source)
    fields = _fields(out)
    for key, (value, _) in _CARD.items():
        if key not in ("general.file_type", "general.quantization_version"):
            assert fields[key] == value, key
    assert fields["general.file_type"] == int(gguf.LlamaFileType.ALL_F32)
    assert fields["general.quantization_version"] == gguf.GGML_QUANT_VERSION
    assert fields["general.architecture"] == "qwen2"  # q/k/v biases, no llama-only feature


def test_a_card_mapping_is_written_and_checked(biased, tmp_path):
    out = tmp_path / "out.gguf"
    card = {"general.name": "mine", "general.finetune": "dpo", "general.tags": ["a", "b"]}
    write_gguf(biased, out, dtype="f32", general=card)
    fields = _fields(out)
    assert fields["general.name"] == "mine" and fields["general.tags"] == ["a", "b"]
    for bad, said in (
        ({"general.file_type": 1}, "`general.file_type` is not taken from general="),
        ({"general.architecture": "llama"}, "`general.architecture` is not taken"),
        ({"llama.context_length": 8}, "'llama.context_length' is not a `general.*` key"),
        ({"general.tags": []}, "is an empty list"),
        ({"general.name": None}, "general['general.name'] = None is not supported"),
    ):
        with pytest.raises(ValueError) as excinfo:
            write_gguf(biased, tmp_path / "bad.gguf", dtype="f32", general=bad)
        assert said in str(excinfo.value)
        assert not (tmp_path / "bad.gguf").exists()


def test_mistral_with_biases_round_trips_as_llama(biased, tmp_path):
    """A `llama` file with a window and biases reads as Mistral with `attn_bias`, and is
    written back as `llama` (llama.cpp's `qwen2` holds no window)."""
    path = tmp_path / "m.gguf"
    window = {"llama.attention.sliding_window": (16, V.UINT32)}
    loaded = load_gguf_policy(_write_llama(path, biased, tmp_path, meta=window))
    assert loaded.cfg.attn_bias and loaded.cfg.sliding_window == 16
    again = tmp_path / "again.gguf"
    write_gguf(loaded, again, dtype="f32")
    assert _fields(again)["general.architecture"] == "llama"
    back = load_gguf_policy(again)
    assert back.cfg == loaded.cfg
    np.testing.assert_array_equal(_logits(back), _logits(loaded))


def test_save_gguf_carries_a_card_from_a_file_or_a_mapping(tmp_path):
    from rlhf_eqx.assets import asset_path
    from rlhf_eqx.models import read_gguf_card

    policy, tok = rx.load_llama2c(asset_path("stories260K.bin"), asset_path("tok512.bin"))
    card = {"general.name": "stories260K", "general.license": "mit", "general.tags": ["tiny"]}
    first = tmp_path / "first.gguf"
    rx.save_gguf(policy, first, tokenizer=tok, dtype="f32", general=card)
    assert read_gguf_card(first) == card
    loaded, loaded_tok = rx.load_gguf(first)
    # carried from the file as it is, or edited for a fine-tune
    carried = tmp_path / "carried.gguf"
    rx.save_gguf(loaded, carried, tokenizer=loaded_tok, general=first)
    assert read_gguf_card(carried) == card
    tuned = tmp_path / "tuned.gguf"
    edited = {**read_gguf_card(first), "general.finetune": "dpo"}
    rx.save_gguf(loaded, tuned, tokenizer=loaded_tok, general=edited)
    assert read_gguf_card(tuned) == edited
    # without it, no card
    plain = tmp_path / "plain.gguf"
    rx.save_gguf(loaded, plain, tokenizer=loaded_tok)
    assert read_gguf_card(plain) == {}
