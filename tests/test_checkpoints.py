"""Checkpoint import/export: llama2.c `.bin` files and Hugging Face safetensors.

The layouts are pinned by numpy reference forward passes written here in each source's
own conventions (llama2.c `run.c` with interleaved rotary pairs; Hugging Face Llama /
Qwen2 with rotate-half and `[out, in]` weights), independent of the loaders.
"""

import json
import os
import struct

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlhf_eqx as rx
from rlhf_eqx import load_llama2c
from rlhf_eqx.models import config_from_hf, load_hf, read_llama2c, save_hf

# --------------------------------------------------------------------------------------
# numpy references
# --------------------------------------------------------------------------------------


def _softmax(x):
    x = x - np.max(x, axis=-1, keepdims=True)
    e = np.exp(x)
    return e / np.sum(e, axis=-1, keepdims=True)


def _rmsnorm(x, g, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g


def _causal_attention(q, k, v):
    """q [H, T, hd], k/v [H, T, hd] -> [T, H*hd]."""
    H, T, hd = q.shape
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(hd)
    s = np.where(np.tril(np.ones((T, T), bool))[None], s, -np.inf)
    return np.swapaxes(_softmax(s) @ v, 0, 1).reshape(T, H * hd)


def llama2c_reference(w, sizes, shared, tokens):
    """llama2.c `run.c` forward (float64), interleaved rotary pairs (2i, 2i+1) per head."""
    D, L, H, K = sizes["dim"], sizes["n_layers"], sizes["n_heads"], sizes["n_kv_heads"]
    hd = D // H
    T = len(tokens)
    pos = np.arange(T, dtype=np.float64)
    x = w["token_embedding"][np.asarray(tokens)].astype(np.float64)

    def rope(z):
        z = z.copy()
        for i in range(0, z.shape[1], 2):
            freq = 1.0 / 10000.0 ** ((i % hd) / hd)
            c, s = np.cos(pos * freq), np.sin(pos * freq)
            z0, z1 = z[:, i].copy(), z[:, i + 1].copy()
            z[:, i] = z0 * c - z1 * s
            z[:, i + 1] = z0 * s + z1 * c
        return z

    for i in range(L):
        xb = _rmsnorm(x, w["rms_att"][i], 1e-5)
        q = rope(xb @ w["wq"][i].T).reshape(T, H, hd).transpose(1, 0, 2)
        k = rope(xb @ w["wk"][i].T).reshape(T, K, hd).transpose(1, 0, 2)
        v = (xb @ w["wv"][i].T).reshape(T, K, hd).transpose(1, 0, 2)
        k, v = np.repeat(k, H // K, axis=0), np.repeat(v, H // K, axis=0)
        x = x + _causal_attention(q, k, v) @ w["wo"][i].T
        xb = _rmsnorm(x, w["rms_ffn"][i], 1e-5)
        h1, h3 = xb @ w["w1"][i].T, xb @ w["w3"][i].T
        x = x + (h1 / (1.0 + np.exp(-h1)) * h3) @ w["w2"][i].T
    x = _rmsnorm(x, w["rms_final"], 1e-5)
    return x @ (w["token_embedding"] if shared else w["wcls"]).T


def hf_reference(t, c, tokens):
    """Hugging Face Llama/Qwen2 forward (float64): `[out, in]` weights, rotate-half rotary."""
    D, H = c["hidden_size"], c["num_attention_heads"]
    K = c.get("num_key_value_heads", H)
    hd = c.get("head_dim") or D // H
    eps, theta = c["rms_norm_eps"], c["rope_theta"]
    T = len(tokens)
    inv_freq = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    freqs = np.arange(T, dtype=np.float64)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb)[None], np.sin(emb)[None]

    def rotate_half(z):
        return np.concatenate([-z[..., hd // 2 :], z[..., : hd // 2]], axis=-1)

    def proj(x, name, n):
        y = x @ t[name + ".weight"].T
        if name + ".bias" in t:
            y = y + t[name + ".bias"]
        return y.reshape(T, n, hd).transpose(1, 0, 2)

    x = t["model.embed_tokens.weight"][np.asarray(tokens)].astype(np.float64)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _rmsnorm(x, t[p + "input_layernorm.weight"], eps)
        q = proj(h, p + "self_attn.q_proj", H)
        k = proj(h, p + "self_attn.k_proj", K)
        v = proj(h, p + "self_attn.v_proj", K)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = np.repeat(k, H // K, axis=0), np.repeat(v, H // K, axis=0)
        x = x + _causal_attention(q, k, v) @ t[p + "self_attn.o_proj.weight"].T
        h = _rmsnorm(x, t[p + "post_attention_layernorm.weight"], eps)
        g, u = h @ t[p + "mlp.gate_proj.weight"].T, h @ t[p + "mlp.up_proj.weight"].T
        x = x + (g / (1.0 + np.exp(-g)) * u) @ t[p + "mlp.down_proj.weight"].T
    x = _rmsnorm(x, t["model.norm.weight"], eps)
    head = t["model.embed_tokens.weight"] if c.get("tie_word_embeddings") else t["lm_head.weight"]
    return x @ head.T


@eqx.filter_jit
def _forward(policy, tokens):
    return policy(tokens, jnp.ones(tokens.shape, jnp.bool_))


def _logits(policy, tokens):
    return np.asarray(_forward(policy, jnp.asarray(tokens, jnp.int32)))


# --------------------------------------------------------------------------------------
# llama2.c
# --------------------------------------------------------------------------------------

_NAMES = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")


def _parse_legacy(path):
    """Independent reader of a legacy llama2.c file (run.c's `memory_map_weights`)."""
    with open(path, "rb") as f:
        raw = f.read()
    header = struct.unpack_from("<7i", raw, 0)
    sizes = dict(zip(_NAMES, header))
    shared = sizes["vocab_size"] > 0
    sizes["vocab_size"] = abs(sizes["vocab_size"])
    D, F, L, H, K, V, S = (sizes[n] for n in _NAMES)
    hd = D // H
    data = np.frombuffer(raw, dtype="<f4", offset=28)
    w, pos = {}, 0
    for name, shape in [
        ("token_embedding", (V, D)),
        ("rms_att", (L, D)),
        ("wq", (L, H * hd, D)),
        ("wk", (L, K * hd, D)),
        ("wv", (L, K * hd, D)),
        ("wo", (L, D, H * hd)),
        ("rms_ffn", (L, D)),
        ("w1", (L, F, D)),
        ("w2", (L, D, F)),
        ("w3", (L, F, D)),
        ("rms_final", (D,)),
        ("freq", (2, S, hd // 2)),
    ] + ([] if shared else [("wcls", (V, D))]):
        n = int(np.prod(shape))
        w[name] = data[pos : pos + n].reshape(shape).astype(np.float64)
        pos += n
    assert pos == data.size
    return sizes, shared, w


def _random_llama2c(rng, sizes):
    D, F, L, H, K, V = (sizes[n] for n in _NAMES[:6])
    hd = D // H
    n = lambda *s: (0.3 * rng.standard_normal(s)).astype(np.float32)
    return {
        "token_embedding": n(V, D),
        "rms_att": 1 + n(L, D),
        "wq": n(L, H * hd, D),
        "wk": n(L, K * hd, D),
        "wv": n(L, K * hd, D),
        "wo": n(L, D, H * hd),
        "rms_ffn": 1 + n(L, D),
        "w1": n(L, F, D),
        "w2": n(L, D, F),
        "w3": n(L, F, D),
        "rms_final": 1 + n(D),
        "wcls": n(V, D),
    }


def _write_llama2c(path, sizes, w, *, shared, version):
    D, F, L, H, K, V, S = (sizes[n] for n in _NAMES)
    with open(path, "wb") as f:
        if version == 0:
            f.write(struct.pack("<7i", D, F, L, H, K, V if shared else -V, S))
            order = [
                "token_embedding",
                "rms_att",
                "wq",
                "wk",
                "wv",
                "wo",
                "rms_ffn",
                "w1",
                "w2",
                "w3",
                "rms_final",
            ]
            tail = [np.full((2, S, D // H // 2), 7.0, np.float32)]  # rotary tables, ignored
        else:
            f.write(struct.pack("<Ii", 0x616B3432, 1))
            f.write(struct.pack("<7i", D, F, L, H, K, V, S))
            f.write(struct.pack("B", int(shared)))
            f.write(b"\0" * (256 - f.tell()))
            order = [
                "rms_att",
                "rms_ffn",
                "rms_final",
                "token_embedding",
                "wq",
                "wk",
                "wv",
                "wo",
                "w1",
                "w2",
                "w3",
            ]
            tail = []
        for name in order:
            f.write(np.ascontiguousarray(w[name], "<f4").tobytes())
        for arr in tail:
            f.write(arr.astype("<f4").tobytes())
        if not shared:
            f.write(np.ascontiguousarray(w["wcls"], "<f4").tobytes())


STORIES = ("models", "stories260K", "stories260K.bin")
TOKENS = [1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421]


def test_permute_rotary_rows_closed_form():
    # one head of size 8: rows (0..7) -> [0, 2, 4, 6, 1, 3, 5, 7]; two heads independently.
    w = np.arange(16, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
    out = rx.models.permute_rotary_rows(w, 2)
    np.testing.assert_array_equal(out[:, 0], [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15])
    stacked = rx.models.permute_rotary_rows(np.stack([w, 2 * w]), 2)
    np.testing.assert_array_equal(stacked[1], 2 * out)


def test_stories260k_matches_run_c_reference(shared_dir):
    path = os.path.join(shared_dir, *STORIES)
    policy, tok = load_llama2c(path)
    assert tok is None
    cfg = policy.cfg
    assert (cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads) == (64, 172, 5, 8, 4)
    assert (cfg.vocab_size, cfg.max_seq_len, cfg.tie_embeddings) == (512, 512, True)
    assert policy.lm_head is None
    sizes, shared, w = _parse_legacy(path)
    ref = llama2c_reference(w, sizes, shared, TOKENS)
    got = _logits(policy, TOKENS)
    assert got.shape == (len(TOKENS), 512)
    np.testing.assert_allclose(got, ref, atol=2e-4, rtol=1e-4)
    # Without the rotary permutation the logits differ after position 0.
    wrong = eqx.tree_at(
        lambda p: p.transformer.layers.wqkv,
        policy,
        jnp.concatenate(
            [
                jnp.asarray(np.swapaxes(w["wq"], -1, -2), jnp.float32),
                policy.transformer.layers.wqkv[..., cfg.q_size :],
            ],
            axis=-1,
        ),
    )
    assert np.max(np.abs(_logits(wrong, TOKENS)[1:] - ref[1:])) > 1e-2


def test_stories260k_greedy_story(shared_dir):
    base = os.path.join(shared_dir, "models", "stories260K")
    policy, tok = load_llama2c(
        os.path.join(base, "stories260K.bin"), os.path.join(base, "tok512.bin")
    )
    assert tok is not None and tok.vocab_size == 512 and tok.bos_id == 1
    prompt = jnp.asarray([tok.bos_id], jnp.int32)
    out = rx.generate(
        policy,
        prompt,
        jnp.ones((1,), jnp.bool_),
        jax.random.key(0),
        max_new_tokens=48,
        temperature=0.0,
    )
    text = tok.decode([int(t) for t in out.tokens])
    assert text.startswith("Once upon a time, there was a little girl named Lily."), text
    # The continuation is a sentence of plain words, as run.c prints for this model.
    rest = text[len("Once upon a time, there was a little girl named Lily.") :]
    assert rest.startswith(" She "), text
    words = rest.split()
    assert len(words) >= 10 and all(word.strip(".,!?'\"").isalpha() for word in words[:-1]), text


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("version", [0, 1])
def test_llama2c_formats_match_reference(tmp_path, shared, version):
    sizes = dict(
        dim=16, hidden_dim=24, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=40, seq_len=32
    )
    w = _random_llama2c(np.random.default_rng(version + 2 * shared), sizes)
    path = tmp_path / "model.bin"
    _write_llama2c(path, sizes, w, shared=shared, version=version)
    read_sizes, read_shared, arrays = read_llama2c(path)
    assert read_sizes == sizes and read_shared == shared
    policy, _ = load_llama2c(path)
    assert (policy.lm_head is None) == shared
    tokens = [1, 5, 39, 0, 7, 7, 21, 3]
    ref = llama2c_reference({k: v.astype(np.float64) for k, v in w.items()}, sizes, shared, tokens)
    np.testing.assert_allclose(_logits(policy, tokens), ref, atol=1e-4, rtol=1e-4)


def test_llama2c_bfloat16(tmp_path):
    sizes = dict(
        dim=16, hidden_dim=24, n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=40, seq_len=32
    )
    w = _random_llama2c(np.random.default_rng(0), sizes)
    _write_llama2c(tmp_path / "m.bin", sizes, w, shared=True, version=0)
    policy, _ = load_llama2c(tmp_path / "m.bin", dtype="bfloat16")
    assert policy.transformer.embed.dtype == jnp.bfloat16
    ref = llama2c_reference({k: v.astype(np.float64) for k, v in w.items()}, sizes, True, [1, 2, 3])
    np.testing.assert_allclose(_logits(policy, [1, 2, 3]), ref, atol=0.15, rtol=0.05)


def test_llama2c_size_mismatch_names_file(shared_dir, tmp_path):
    src = os.path.join(shared_dir, *STORIES)
    bad = tmp_path / "truncated.bin"
    with open(src, "rb") as f:
        bad.write_bytes(f.read()[:-4])
    with pytest.raises(ValueError, match="truncated.bin.*size mismatch"):
        load_llama2c(bad)
    junk = tmp_path / "junk.bin"
    junk.write_bytes(struct.pack("<7i", -5, 3, 2, 1, 1, 9, 4) + b"\0" * 64)
    with pytest.raises(ValueError, match="junk.bin.*not a llama2.c checkpoint"):
        load_llama2c(junk)
    small = tmp_path / "small.bin"
    sizes = dict(dim=8, hidden_dim=8, n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=40, seq_len=8)
    _write_llama2c(
        small, sizes, _random_llama2c(np.random.default_rng(0), sizes), shared=True, version=1
    )
    tok512 = os.path.join(shared_dir, "models", "stories260K", "tok512.bin")
    with pytest.raises(ValueError, match="tok512.bin.*512 pieces.*small.bin.*40"):
        load_llama2c(small, tok512)
    v2 = tmp_path / "q80.bin"
    v2.write_bytes(struct.pack("<Ii", 0x616B3432, 2) + b"\0" * 300)
    with pytest.raises(ValueError, match="q80.bin.*version 2"):
        load_llama2c(v2)


# --------------------------------------------------------------------------------------
# Hugging Face
# --------------------------------------------------------------------------------------


def _randomise(model, key, scale=0.1):
    leaves, treedef = jax.tree_util.tree_flatten(model)
    keys = jax.random.split(key, len(leaves))
    leaves = [
        x + (scale * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype)
        for x, k in zip(leaves, keys)
    ]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _small_cfg(**kw):
    base = dict(
        vocab_size=48, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24, max_seq_len=64
    )
    base.update(kw)
    return rx.TransformerConfig(**base)


@pytest.mark.parametrize(
    "kw, shard",
    [
        (dict(), None),
        (dict(tie_embeddings=True), None),
        (dict(attn_bias=True, head_dim=6, rope_theta=5e5, norm_eps=1e-6), None),
        (dict(), 4096),
        (dict(tie_embeddings=True, attn_bias=True), 2000),
    ],
)
def test_hf_round_trip(tmp_path, getkey, kw, shard):
    policy = _randomise(rx.Policy(_small_cfg(**kw), key=getkey()), getkey())
    kwargs = {} if shard is None else {"max_shard_bytes": shard}
    save_hf(policy, tmp_path, **kwargs)
    files = sorted(os.listdir(tmp_path))
    if shard is None:
        assert files == ["config.json", "model.safetensors"]
    else:
        shards = [f for f in files if f.startswith("model-")]
        assert len(shards) >= 2 and "model.safetensors.index.json" in files
        for f in shards:
            assert os.path.getsize(tmp_path / f) <= shard + 4096  # + safetensors header
    loaded = load_hf(tmp_path)
    assert loaded.cfg == policy.cfg
    assert (loaded.lm_head is None) == policy.cfg.tie_embeddings
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    np.testing.assert_array_equal(_logits(loaded, tokens), _logits(policy, tokens))
    assert jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(policy)
    for a, b in zip(jax.tree_util.tree_leaves(loaded), jax.tree_util.tree_leaves(policy)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_hf_round_trip_replaces_stale_files(tmp_path, getkey):
    small = _randomise(rx.Policy(_small_cfg(), key=getkey()), getkey())
    save_hf(small, tmp_path, max_shard_bytes=2000)
    other = _randomise(rx.Policy(_small_cfg(), key=getkey()), getkey())
    save_hf(other, tmp_path)  # single file now: the old index and shards must go
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    np.testing.assert_array_equal(_logits(load_hf(tmp_path), [1, 2]), _logits(other, [1, 2]))


def test_hf_bfloat16_round_trip(tmp_path, getkey):
    policy = _randomise(rx.Policy(_small_cfg(dtype="bfloat16"), key=getkey()), getkey())
    save_hf(policy, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = load_hf(tmp_path)
    assert loaded.transformer.embed.dtype == jnp.bfloat16
    for a, b in zip(jax.tree_util.tree_leaves(loaded), jax.tree_util.tree_leaves(policy)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    as32 = load_hf(tmp_path, dtype="float32")
    assert as32.cfg.dtype == "float32" and as32.transformer.layers.wqkv.dtype == jnp.float32
    # float32 export of a bfloat16 model
    save_hf(policy, tmp_path / "f32", dtype="float32")
    assert load_hf(tmp_path / "f32").transformer.embed.dtype == jnp.float32


def _hf_config(arch, **kw):
    c = dict(
        architectures=[arch],
        hidden_size=24,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=50,
        rms_norm_eps=1e-6,
        rope_theta=1000.0,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        torch_dtype="float32",
        hidden_act="silu",
        rope_scaling=None,
    )
    c.update(kw)
    return c


def _hf_tensors(rng, c):
    D, F, V = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    H, K, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    n = lambda *s: (0.3 * rng.standard_normal(s)).astype(np.float32)
    t = {"model.embed_tokens.weight": n(V, D), "model.norm.weight": 1 + n(D)}
    if not c["tie_word_embeddings"]:
        t["lm_head.weight"] = n(V, D)
    bias = c["architectures"][0] == "Qwen2ForCausalLM"
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = 1 + n(D)
        t[p + "post_attention_layernorm.weight"] = 1 + n(D)
        for name, out in (("q", H * hd), ("k", K * hd), ("v", K * hd)):
            t[p + f"self_attn.{name}_proj.weight"] = n(out, D)
            if bias:
                t[p + f"self_attn.{name}_proj.bias"] = n(out)
        t[p + "self_attn.o_proj.weight"] = n(D, H * hd)
        t[p + "mlp.gate_proj.weight"] = n(F, D)
        t[p + "mlp.up_proj.weight"] = n(F, D)
        t[p + "mlp.down_proj.weight"] = n(D, F)
    return t


@pytest.mark.parametrize(
    "arch, kw, sharded",
    [
        ("LlamaForCausalLM", dict(), False),
        (
            "LlamaForCausalLM",
            dict(tie_word_embeddings=True, head_dim=6, num_key_value_heads=4),
            True,
        ),
        ("Qwen2ForCausalLM", dict(use_sliding_window=False, sliding_window=4096), True),
        ("MistralForCausalLM", dict(sliding_window=None), False),
    ],
)
def test_hf_load_hand_built_checkpoint(tmp_path, arch, kw, sharded):
    from safetensors.numpy import save_file

    c = _hf_config(arch, **kw)
    t = _hf_tensors(np.random.default_rng(0), c)
    (tmp_path / "config.json").write_text(json.dumps(c))
    if sharded:
        names = sorted(t)
        half = {
            n: ("model-00001-of-00002.safetensors" if i % 2 else "model-00002-of-00002.safetensors")
            for i, n in enumerate(names)
        }
        for fname in set(half.values()):
            save_file({n: t[n] for n in names if half[n] == fname}, tmp_path / fname)
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": half}))
    else:
        save_file(t, tmp_path / "model.safetensors")
    policy = load_hf(tmp_path)
    assert policy.cfg.attn_bias == (arch == "Qwen2ForCausalLM")
    assert policy.cfg.head_dim == c["head_dim"] and policy.cfg.rope_theta == c["rope_theta"]
    tokens = [0, 7, 49, 3, 3, 12, 30, 1, 2]
    ref = hf_reference({k: v.astype(np.float64) for k, v in t.items()}, c, tokens)
    np.testing.assert_allclose(_logits(policy, tokens), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "field, kw",
    [
        ("rope_scaling.rope_type", dict(rope_scaling={"rope_type": "dynamic", "factor": 8.0})),
        ("rope_scaling.rope_type", dict(rope_scaling={"type": "longrope", "factor": 2.0})),
        ("attention_bias", dict(attention_bias=True)),
        ("mlp_bias", dict(mlp_bias=True)),
        ("partial_rotary_factor", dict(partial_rotary_factor=0.5)),
        ("qk_layernorm", dict(qk_layernorm=True)),
        ("attn_logit_softcapping", dict(attn_logit_softcapping=50.0)),
        ("final_logit_softcapping", dict(final_logit_softcapping=30.0)),
        (
            "use_bidirectional_attention",
            dict(architectures=["Gemma3ForCausalLM"], use_bidirectional_attention=True),
        ),
        ("hidden_act", dict(hidden_act="gelu")),
        ("hidden_act", dict(architectures=["GemmaForCausalLM"], hidden_act="relu")),
        ("architectures", dict(architectures=["GPT2LMHeadModel"])),
        (
            "layer_types",
            dict(
                architectures=["Gemma2ForCausalLM"],
                hidden_act="gelu_pytorch_tanh",
                sliding_window=4,
                layer_types=["full_attention"],
            ),
        ),
        (
            "rope_parameters.rope_type",
            dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}),
        ),
    ],
)
def test_hf_unsupported_config_fields(tmp_path, field, kw):
    c = _hf_config("LlamaForCausalLM")
    c.update(kw)
    (tmp_path / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match=f"`{field}`.*not supported"):
        load_hf(tmp_path)


def test_hf_config_defaults_and_new_style_rope():
    c = _hf_config("MistralForCausalLM", sliding_window=4096, max_position_embeddings=4096)
    c.pop("head_dim")
    cfg = config_from_hf(c)  # window as long as the context: plain causal attention
    assert cfg.head_dim == 6 and cfg.tie_embeddings is False and cfg.dtype == "float32"
    c = _hf_config("LlamaForCausalLM", torch_dtype="bfloat16")
    c.pop("rope_theta")
    c["rope_parameters"] = {"rope_type": "default", "rope_theta": 123.0}
    cfg = config_from_hf(c)
    assert cfg.rope_theta == 123.0 and cfg.dtype == "bfloat16"
    assert config_from_hf(c, dtype="float32").dtype == "float32"


def test_hf_missing_and_misshaped_tensors(tmp_path):
    from safetensors.numpy import save_file

    c = _hf_config("LlamaForCausalLM")
    t = _hf_tensors(np.random.default_rng(1), c)
    (tmp_path / "config.json").write_text(json.dumps(c))
    missing = dict(t)
    del missing["model.layers.1.mlp.up_proj.weight"]
    save_file(missing, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        load_hf(tmp_path)
    bad = dict(t)
    bad["model.norm.weight"] = np.ones((7,), np.float32)
    save_file(bad, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="model.norm.weight.*shape"):
        load_hf(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError):
        load_hf(tmp_path)


def test_save_hf_refuses_lora_and_accepts_int8(tmp_path, getkey):
    from rlhf_eqx.models import LoRAConfig, apply_lora, dequantize, quantize_int8

    policy = _randomise(rx.Policy(_small_cfg(), key=getkey()), getkey())
    with pytest.raises(ValueError, match="merge_lora"):
        save_hf(apply_lora(policy, LoRAConfig(rank=2), key=getkey()), tmp_path)
    q = quantize_int8(policy)
    save_hf(q, tmp_path)
    tokens = [4, 8, 15, 16, 23, 42]
    np.testing.assert_allclose(
        _logits(load_hf(tmp_path), tokens), _logits(dequantize(q), tokens), atol=1e-5
    )


def test_stories260k_exported_to_hf_matches_run_c(shared_dir, tmp_path):
    """save_hf's layout, checked by the HF-convention reference on the written tensors."""
    from safetensors.numpy import load_file

    path = os.path.join(shared_dir, *STORIES)
    policy, _ = load_llama2c(path)
    save_hf(policy, tmp_path)
    c = json.loads((tmp_path / "config.json").read_text())
    assert c["architectures"] == ["LlamaForCausalLM"] and c["tie_word_embeddings"] is True
    t = {k: v.astype(np.float64) for k, v in load_file(tmp_path / "model.safetensors").items()}
    assert "lm_head.weight" not in t
    sizes, shared, w = _parse_legacy(path)
    tokens = TOKENS[:6]
    np.testing.assert_allclose(
        hf_reference(t, c, tokens),
        llama2c_reference(w, sizes, shared, tokens),
        atol=1e-4,
        rtol=1e-4,
    )
    np.testing.assert_array_equal(_logits(load_hf(tmp_path), tokens), _logits(policy, tokens))


def _write_hf(directory, c, t):
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(c))
    save_file(t, directory / "model.safetensors")


def test_save_hf_failure_keeps_the_old_checkpoint(tmp_path, getkey, monkeypatch):
    import safetensors.numpy as stnp

    target = tmp_path / "ckpt"
    old = _randomise(rx.Policy(_small_cfg(), key=getkey()), getkey())
    save_hf(old, target)
    (target / "tokenizer.json").write_text("{}")
    new = _randomise(rx.Policy(_small_cfg(), key=getkey()), getkey())

    def broken(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"\x00" * 100)  # half-written, then the disk fills up
        raise OSError("No space left on device")

    monkeypatch.setattr(stnp, "save_file", broken)
    with pytest.raises(OSError, match="No space"):
        save_hf(new, target)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no staging directory left behind
    assert sorted(os.listdir(target)) == ["config.json", "model.safetensors", "tokenizer.json"]
    np.testing.assert_array_equal(_logits(load_hf(target), [1, 2, 3]), _logits(old, [1, 2, 3]))
    save_hf(new, target)  # a later save replaces it and keeps the other files
    assert sorted(os.listdir(target)) == ["config.json", "model.safetensors", "tokenizer.json"]
    np.testing.assert_array_equal(_logits(load_hf(target), [1, 2, 3]), _logits(new, [1, 2, 3]))


def test_save_hf_cleans_stale_staging_and_keeps_permissions(tmp_path, getkey):
    target = tmp_path / "ckpt"
    stale = tmp_path / ".ckpt.tmp-deadbeef0000"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    unrelated = tmp_path / "other"
    unrelated.mkdir()
    policy = _randomise(rx.Policy(_small_cfg(), key=getkey()), getkey())
    save_hf(policy, target, max_shard_bytes=2000)
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "other"]
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(target).st_mode & 0o777 == 0o777 & ~umask
    config_mode = os.stat(target / "config.json").st_mode & 0o777
    for name in os.listdir(target):
        assert os.stat(target / name).st_mode & 0o777 == config_mode, name


def test_save_hf_into_the_working_directory_leaves_it_and_its_open_files(
    tmp_path, getkey, monkeypatch
):
    """Saving into the directory a process works in, with a file of it open: the
    directory stays the same one (the working directory and the open file stay valid),
    its other files are not copied, and the new checkpoint replaces the old one."""
    target = tmp_path / "run"
    target.mkdir()
    (target / "data.bin").write_bytes(b"x" * 4096)
    inode = os.stat(target / "data.bin").st_ino
    monkeypatch.chdir(target)
    first = _randomise(rx.Policy(_small_cfg(), key=getkey()), getkey())
    second = _randomise(rx.Policy(_small_cfg(), key=getkey()), getkey())
    with open("log.txt", "w") as log:
        save_hf(first, ".", max_shard_bytes=2000)
        log.write("after the first save\n")
        log.flush()
        save_hf(second, ".")
        log.write("after the second\n")
    assert os.getcwd() == str(target)
    assert (target / "log.txt").read_text() == "after the first save\nafter the second\n"
    assert os.stat(target / "data.bin").st_ino == inode
    names = ["config.json", "data.bin", "log.txt", "model.safetensors"]
    assert sorted(os.listdir(target)) == names and sorted(os.listdir(tmp_path)) == ["run"]
    np.testing.assert_array_equal(_logits(load_hf(target), [1, 2, 3]), _logits(second, [1, 2, 3]))


def test_save_hf_through_a_symbolic_link_writes_where_it_points(tmp_path, getkey):
    """A checkpoint directory reached through a link (`current -> v1`) is updated in
    place: the link stays a link and no renamed copy of it is left beside it."""
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "tokenizer.json").write_text("{}")
    (tmp_path / "current").symlink_to("v1")
    policy = _randomise(rx.Policy(_small_cfg(), key=getkey()), getkey())
    for _ in range(2):
        save_hf(policy, tmp_path / "current")
    assert (tmp_path / "current").is_symlink()
    assert sorted(os.listdir(tmp_path)) == ["current", "v1"]
    names = ["config.json", "model.safetensors", "tokenizer.json"]
    assert sorted(os.listdir(tmp_path / "v1")) == names
    np.testing.assert_array_equal(
        _logits(load_hf(tmp_path / "current"), [1, 2, 3]), _logits(policy, [1, 2, 3])
    )


def test_hf_config_layer_count_must_match_and_be_an_integer(tmp_path):
    c = _hf_config("LlamaForCausalLM")
    t = _hf_tensors(np.random.default_rng(2), c)
    _write_hf(tmp_path / "fewer", dict(c, num_hidden_layers=1), t)
    with pytest.raises(ValueError, match=r"model\.layers\.1\..*num_hidden_layers=1"):
        load_hf(tmp_path / "fewer")
    _write_hf(tmp_path / "frac", dict(c, num_hidden_layers=2.9), t)
    with pytest.raises(
        ValueError, match=r"config\.json: `num_hidden_layers` must be an integer, got 2\.9"
    ):
        load_hf(tmp_path / "frac")
    # a field read inside the config's own checks: the path named once; eps must be > 0
    for name, field, value, why in (
        ("vocab", "vocab_size", "32", "must be an integer, got '32'"),
        ("eps", "rms_norm_eps", -1e-6, "must be > 0, got -1e-06"),
    ):
        _write_hf(tmp_path / name, dict(c, **{field: value}), t)
        with pytest.raises(ValueError) as e:
            load_hf(tmp_path / name)
        path = str(tmp_path / name / "config.json")
        assert str(e.value) == f"{path}: `{field}` {why}", str(e.value)


def test_hf_misshaped_tensor_in_one_layer_is_named(tmp_path):
    c = _hf_config("LlamaForCausalLM")
    t = _hf_tensors(np.random.default_rng(3), c)
    t["model.layers.1.self_attn.k_proj.weight"] = t["model.layers.1.self_attn.k_proj.weight"][:8]
    _write_hf(tmp_path, c, t)
    with pytest.raises(
        ValueError,
        match=(
            r"'model\.layers\.1\.self_attn\.k_proj\.weight' has shape \(8, 24\), "
            r"expected \(16, 24\)"
        ),
    ):
        load_hf(tmp_path)


def test_hf_unexpected_tensor_is_named(tmp_path):
    c = _hf_config("LlamaForCausalLM")
    t = _hf_tensors(np.random.default_rng(4), c)
    t["model.layers.0.self_attn.o_proj.bias"] = np.zeros((24,), np.float32)
    _write_hf(tmp_path, c, t)
    with pytest.raises(
        ValueError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.o_proj\.bias'"
    ):
        load_hf(tmp_path)


def test_hf_bad_files_are_named(tmp_path):
    c = _hf_config("LlamaForCausalLM")
    t = _hf_tensors(np.random.default_rng(5), c)
    missing = dict(c)
    del missing["hidden_size"]
    _write_hf(tmp_path / "a", missing, t)
    with pytest.raises(
        ValueError, match=r"a/config\.json: required field `hidden_size` is missing"
    ):
        load_hf(tmp_path / "a")
    _write_hf(tmp_path / "b", c, t)
    (tmp_path / "b" / "config.json").write_text('{"hidden_size": 24,')
    with pytest.raises(ValueError, match=r"b/config\.json: not valid JSON"):
        load_hf(tmp_path / "b")
    _write_hf(tmp_path / "c", c, t)
    weights = tmp_path / "c" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated
    with pytest.raises(ValueError, match=r"c/model\.safetensors: not a readable safetensors file"):
        load_hf(tmp_path / "c")
    weights.write_bytes(np.random.default_rng(0).bytes(5000))  # random bytes
    with pytest.raises(ValueError, match=r"c/model\.safetensors: not a readable safetensors file"):
        load_hf(tmp_path / "c")
    (tmp_path / "d").mkdir()
    with pytest.raises(FileNotFoundError, match=r"d/config\.json"):
        load_hf(tmp_path / "d")


def test_hf_bad_tensor_names_the_shard_that_holds_it(tmp_path, getkey):
    """In a sharded checkpoint a tensor of the wrong dtype or shape is named with the
    shard file it is in."""
    from safetensors.numpy import load_file, save_file

    save_hf(rx.Policy(_small_cfg(), key=getkey()), tmp_path, max_shard_bytes=2000)
    with open(tmp_path / "model.safetensors.index.json") as f:
        weight_map = json.load(f)["weight_map"]
    name = "model.layers.1.self_attn.k_proj.weight"
    shard = tmp_path / weight_map[name]
    tensors = load_file(shard)
    save_file({**tensors, name: tensors[name].astype(np.int32)}, shard)
    with pytest.raises(ValueError, match=rf"{shard}: tensor '{name}' has non-float dtype int32"):
        load_hf(tmp_path)
    save_file({**tensors, name: tensors[name][:-1]}, shard)
    with pytest.raises(ValueError, match=rf"{shard}: tensor '{name}' has shape \(7, 16\)"):
        load_hf(tmp_path)


def _llama_safetensors(tmp_path):
    """A small Llama checkpoint written to `tmp_path`: `(its weights file, the file's
    bytes, the header's length, the header)`."""
    c = _hf_config("LlamaForCausalLM")
    _write_hf(tmp_path, c, _hf_tensors(np.random.default_rng(5), c))
    weights = tmp_path / "model.safetensors"
    whole = weights.read_bytes()
    n = int.from_bytes(whole[:8], "little")
    return weights, whole, n, json.loads(whole[8 : 8 + n])


def test_hf_truncated_file_names_the_tensor_it_ends_in(tmp_path):
    """A safetensors file cut short: one line naming the file and the first tensor whose
    data runs past its end (or the header, when that is cut)."""
    weights, whole, n, header = _llama_safetensors(tmp_path)
    ends = {k: 8 + n + v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"}
    weights.write_bytes(whole[:-100])
    cut = min((e, k) for k, e in ends.items() if e > len(whole) - 100)[1]  # the file ends in it
    with pytest.raises(ValueError) as excinfo:
        load_hf(tmp_path)
    message = str(excinfo.value)
    assert "\n" not in message and message.startswith(f"{weights}: not a readable safetensors")
    assert f"the data of tensor {cut!r} ends at byte {ends[cut]}" in message
    assert f"the file has {len(whole) - 100} bytes" in message
    weights.write_bytes(whole[: 8 + n // 2])
    with pytest.raises(ValueError, match=rf"the header ends at byte {8 + n}, the file has"):
        load_hf(tmp_path)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(dtype="F33"), "has dtype 'F33', which safetensors does not know"),
        (dict(dtype="F16"), "of shape [16, 24] and dtype F16 takes 768 bytes, but its "
                            "data_offsets span 1536"),
        (dict(shape=[16, 25]), "of shape [16, 25] and dtype F32 takes 1600 bytes, but its "
                               "data_offsets span 1536"),
    ],
)  # fmt: skip
def test_hf_header_that_disagrees_with_a_tensor_names_it(tmp_path, change, message):
    """A safetensors header whose entry for a tensor has an unknown dtype, or a shape and
    dtype that do not fill its bytes: one line naming the file and the tensor."""
    weights, whole, n, header = _llama_safetensors(tmp_path)
    name = "model.layers.1.self_attn.k_proj.weight"
    assert header[name]["shape"] == [16, 24] and header[name]["dtype"] == "F32"
    header[name].update(change)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    weights.write_bytes(len(text).to_bytes(8, "little") + text + whole[8 + n :])
    with pytest.raises(ValueError) as excinfo:
        load_hf(tmp_path)
    assert str(excinfo.value) == (
        f"{weights}: not a readable safetensors file (tensor {name!r} {message})"
    )


def test_config_to_hf_refuses_what_no_architecture_expresses():
    cfg = _small_cfg(attn_bias=True, sliding_window=8, window_layers=(True, False))
    with pytest.raises(ValueError, match="window_layers"):
        rx.models.config_to_hf(cfg)


def test_models_layer_loads_llama2c_without_the_tokenizer(shared_dir):
    from rlhf_eqx.models import load_llama2c_policy

    path = os.path.join(shared_dir, *STORIES)
    policy = load_llama2c_policy(path)
    paired, tok = load_llama2c(
        path, os.path.join(shared_dir, "models", "stories260K", "tok512.bin")
    )
    assert tok.vocab_size == policy.cfg.vocab_size == 512
    for a, b in zip(jax.tree_util.tree_leaves(policy), jax.tree_util.tree_leaves(paired)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_reward_and_value_models_export_as_sequence_classifiers(tmp_path, getkey):
    policy = _randomise(rx.Policy(_small_cfg(), key=getkey()), getkey())
    reward = rx.RewardModel.from_policy(policy, key=getkey())
    value = rx.ValueModel.from_policy(policy, key=getkey())
    tokens = jnp.array([[5, 6, 7, 8, 9, 0], [0, 0, 3, 4, 5, 6]], jnp.int32)
    mask = jnp.array([[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]], bool)
    save_hf(reward, tmp_path / "rm", pad_token_id=0)
    config = json.loads((tmp_path / "rm" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]
    assert config["id2label"] == {"0": "LABEL_0"} and config["pad_token_id"] == 0
    from safetensors.numpy import load_file

    stored = load_file(tmp_path / "rm" / "model.safetensors")
    assert stored["score.weight"].shape == (1, 16) and "lm_head.weight" not in stored
    loaded = load_hf(tmp_path / "rm")
    assert isinstance(loaded, rx.RewardModel)
    np.testing.assert_allclose(
        eqx.filter_jit(loaded)(tokens, mask), eqx.filter_jit(reward)(tokens, mask), atol=1e-6
    )
    save_hf(value, tmp_path / "vm")
    as_reward = load_hf(tmp_path / "vm")
    per_token = eqx.filter_jit(value)(tokens, mask)
    np.testing.assert_allclose(
        eqx.filter_jit(as_reward)(tokens, mask),
        per_token[jnp.arange(2), jnp.array([4, 5])],
        atol=1e-6,
    )
    biased = eqx.tree_at(lambda m: m.bias, reward, jnp.ones((), jnp.float32))
    with pytest.raises(ValueError, match="`bias` is 1.0"):
        save_hf(biased, tmp_path / "bad")
    config["id2label"] = {"0": "A", "1": "B"}
    (tmp_path / "rm" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="`id2label`.*exactly one label"):
        load_hf(tmp_path / "rm")


def test_hf_window_fields_per_family():
    qwen = _hf_config(
        "Qwen2ForCausalLM", use_sliding_window=True, sliding_window=16, max_window_layers=1
    )
    cfg = config_from_hf(qwen)
    assert cfg.sliding_window == 16 and cfg.local_layers == (False, True)
    assert config_from_hf(dict(qwen, use_sliding_window=False)).sliding_window is None
    assert (
        config_from_hf(_hf_config("MistralForCausalLM", sliding_window=None)).sliding_window is None
    )
    gemma3 = _hf_config(
        "Gemma3ForCausalLM",
        hidden_activation="gelu_pytorch_tanh",
        sliding_window=8,
        layer_types=["full_attention", "sliding_attention"],
    )
    assert config_from_hf(gemma3).local_layers == (False, True)
    assert rx.models.config_to_hf(cfg)["max_window_layers"] == 1


def test_hf_inconsistent_sizes_name_the_file():
    c = _hf_config("LlamaForCausalLM", num_key_value_heads=3)
    with pytest.raises(
        ValueError,
        match=r"config\.json: TransformerConfig\.n_kv_heads=3 must divide n_heads=4 "
        r"\(`num_key_value_heads` = 3, `num_attention_heads` = 4\)$",
    ):
        config_from_hf(c)


def test_hf_absent_fields_read_as_transformers_reads_them():
    """A field left out of `config.json` takes the default of transformers' config class
    (`Gemma2Config`: head_dim 256, sliding_window 4096, soft-caps 50 / 30,
    query_pre_attn_scalar 256; `Gemma3TextConfig`: the same without soft-caps;
    `GemmaConfig` head_dim 256; `Qwen3Config` head_dim 128; `MistralConfig` sliding_window
    4096; `Qwen2Config` / `Qwen3Config` sliding_window 4096 and max_window_layers 28, used
    with `use_sliding_window`); a field written as `null` stays unset."""
    gelu = dict(hidden_act="gelu_pytorch_tanh")

    def bare(arch, **kw):
        c = _hf_config(arch, num_attention_heads=2, num_key_value_heads=1, **kw)
        del c["head_dim"]
        return c

    g2 = config_from_hf(bare("Gemma2ForCausalLM", **gelu))
    assert (g2.head_dim, g2.sliding_window, g2.local_layers) == (256, 4096, (True, False))
    assert (g2.attn_softcap, g2.final_softcap, g2.query_scale) == (50.0, 30.0, 256**-0.5)
    g3 = config_from_hf(bare("Gemma3ForCausalLM", **gelu))
    assert (g3.head_dim, g3.sliding_window, g3.query_scale) == (256, 4096, 256**-0.5)
    assert g3.attn_softcap is None and g3.final_softcap is None
    assert config_from_hf(bare("GemmaForCausalLM", **gelu)).head_dim == 256
    assert config_from_hf(bare("Qwen3ForCausalLM")).head_dim == 128
    assert config_from_hf(bare("MistralForCausalLM")).sliding_window == 4096
    for arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):  # windows from layer 28 on
        qwen = config_from_hf(bare(arch, use_sliding_window=True, num_hidden_layers=30))
        assert qwen.sliding_window == 4096 and qwen.local_layers == (False,) * 28 + (True,) * 2
        assert config_from_hf(bare(arch, num_hidden_layers=30)).sliding_window is None
    assert config_from_hf(bare("LlamaForCausalLM")).head_dim == 12  # hidden / heads
    nulls = bare("Gemma2ForCausalLM", attn_logit_softcapping=None, sliding_window=None, **gelu)
    cfg = config_from_hf(dict(nulls, head_dim=12))
    assert cfg.attn_softcap is None and cfg.sliding_window is None and cfg.head_dim == 12
    assert config_from_hf(bare("MistralForCausalLM", sliding_window=None)).sliding_window is None


def test_hf_quantized_checkpoint_and_mistral_layer_types_are_refused():
    c = _hf_config("LlamaForCausalLM", quantization_config={"quant_method": "gptq", "bits": 4})
    with pytest.raises(ValueError, match="`quantization_config` = 'gptq' is not supported"):
        config_from_hf(c)
    c = _hf_config("MistralForCausalLM", sliding_window=8)
    mixed = dict(c, layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(ValueError, match="`layer_types`.*windows every layer"):
        config_from_hf(mixed)
    every = config_from_hf(dict(c, layer_types=["sliding_attention"] * 2))
    assert every.local_layers == (True, True)


def test_save_hf_refuses_weights_that_would_not_load(tmp_path, getkey):
    """A weight beyond float16's range becomes inf when written as float16, which
    `load_hf` refuses: `save_hf` refuses first and writes nothing."""
    policy = _randomise(rx.Policy(_small_cfg(), key=getkey()), getkey())
    big = eqx.tree_at(
        lambda m: m.transformer.final_norm, policy, policy.transformer.final_norm.at[1].set(1e5)
    )
    with pytest.raises(
        ValueError, match=r"'model.norm.weight' .*\(float16 holds magnitudes up to 65504"
    ):
        save_hf(big, tmp_path / "f16", dtype="float16")
    assert not (tmp_path / "f16").exists()
    save_hf(big, tmp_path / "bf16", dtype="bfloat16")  # in range there
    nan = eqx.tree_at(
        lambda m: m.transformer.embed, policy, policy.transformer.embed.at[2, 3].set(jnp.nan)
    )
    with pytest.raises(ValueError, match=r"'model.embed_tokens.weight' .* \(2, 3\) in float32"):
        save_hf(nan, tmp_path / "nan")
    # bfloat16 holds it; loading that as float16 would make it inf
    with pytest.raises(ValueError, match=r"'model.norm.weight' holds a magnitude of 99840, past"):
        load_hf(tmp_path / "bf16", dtype="float16")
    assert load_hf(tmp_path / "bf16").cfg.dtype == "bfloat16"


@pytest.mark.parametrize(
    "field, rope",
    [
        (
            "rope_parameters.partial_rotary_factor",
            dict(
                rope_parameters={"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}
            ),
        ),
        (
            "rope_parameters.sliding_attention.partial_rotary_factor",
            dict(
                rope_parameters={
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "default", "partial_rotary_factor": 0.25},
                }
            ),
        ),
        ("rope_scaling", dict(rope_scaling="linear")),
    ],
)
def test_hf_rope_fields_transformers_would_read_differently(field, rope):
    """transformers rotates only `partial_rotary_factor` of each head where the rotary
    parameters name it; refused rather than read as a full rotation."""
    c = _hf_config("Gemma3ForCausalLM", hidden_act="gelu_pytorch_tanh", **rope)
    with pytest.raises(ValueError, match=rf"`{field}` = .* is not supported"):
        config_from_hf(c)
    c["rope_parameters" if "rope_parameters" in rope else "rope_scaling"] = None
    assert config_from_hf(c).rope_scaling is None


def test_hf_single_file_is_read_before_a_stale_index(tmp_path, getkey):
    """transformers' unsharded re-save into a sharded checkpoint deletes the shards but
    not `model.safetensors.index.json`; transformers then reads `model.safetensors`, and
    so does `load_hf`."""
    policy = _randomise(rx.Policy(_small_cfg(), key=getkey()), getkey())
    save_hf(policy, tmp_path, max_shard_bytes=2000)
    for name in os.listdir(tmp_path):
        if name.startswith("model-"):
            os.remove(tmp_path / name)
    with pytest.raises(FileNotFoundError, match="model-00001-of"):
        load_hf(tmp_path)
    save_hf(policy, tmp_path / "single")
    os.rename(tmp_path / "single" / "model.safetensors", tmp_path / "model.safetensors")
    np.testing.assert_array_equal(_logits(load_hf(tmp_path), [1, 2]), _logits(policy, [1, 2]))
