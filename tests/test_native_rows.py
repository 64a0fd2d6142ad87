"""The native CPU kernel for products of few rows with llama.cpp blocks: built where a C++
compiler is found, the same values as the `gguf` package's dequantise-then-dot for every
row count it takes (groups of four rows and a remainder, one thread or the pool), the
same input gradient, chosen inside scans and vmaps for up to 64 rows, and switched off
or failing to build without changing any value."""

import os
import shutil
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_gguf_weight

import rlhf_eqx as rx
from rlhf_eqx.models import (
    NATIVE_MIN_DENSE,
    GGUFWeight,
    matmul,
    native_dense_product,
    native_rows_available,
    native_rows_product,
    quantize_gguf,
)

gguf = pytest.importorskip("gguf")

KINDS = ("Q8_0", "Q4_0", "Q4_1")
COMPILER = any(shutil.which(c) for c in (os.environ.get("CXX") or "c++", "g++", "clang++"))
needs_kernel = pytest.mark.skipif(
    not native_rows_available(), reason="the native kernel is not built here (no compiler)"
)


def reference(x, w: GGUFWeight) -> np.ndarray:
    dense = gguf.quants.dequantize(np.asarray(w.raw), gguf.GGMLQuantizationType[w.kind])
    return np.asarray(x, np.float64) @ dense.T.astype(np.float64)


def close(got, want, atol=3e-6):
    scale = float(np.max(np.abs(want))) + 1e-30
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=atol * scale)


def test_built_wherever_a_compiler_is_found():
    # CI has g++: a broken build must fail here, not fall back silently
    if COMPILER and os.environ.get("RLHF_EQX_NATIVE", "1") not in ("0", "false", "off", "no"):
        assert native_rows_available()


_product = jax.jit(native_rows_product, static_argnums=2)


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 64])
@pytest.mark.parametrize("n_out, n_blocks", [(7, 1), (300, 3), (1000, 2)])
def test_equals_dequantise_then_dot(kind, rows, n_out, n_blocks):
    # 300 and 1000 outputs are split between threads; 7 run on the calling thread
    rng = np.random.default_rng([KINDS.index(kind), rows, n_out])
    w = random_gguf_weight(rng, kind, (), n_out, 32 * n_blocks)
    x = jnp.asarray(rng.standard_normal((rows, 32 * n_blocks)), jnp.float32)
    close(_product(x, w.raw, kind), reference(x, w))
    xb = x.astype(jnp.bfloat16)  # multiplied in float32
    close(_product(xb, w.raw, kind), reference(xb.astype(jnp.float32), w))


@needs_kernel
def test_extreme_scales_and_values():
    # the largest float16 scales, subnormal ones and signed zero, with every byte value
    rng = np.random.default_rng(7)
    w = random_gguf_weight(rng, "Q8_0", (), 256, 64)
    raw = np.asarray(w.raw).reshape(256, 2, 34).copy()
    scales = np.array([65504.0, -65504.0, 6e-8, -0.0, 1.0, 2.0**-24], np.float16)
    raw[:, :, 0:2] = np.resize(scales, (256, 2)).view(np.uint8).reshape(256, 2, 2)
    raw[:, 0, 2:] = np.arange(256, dtype=np.uint8).reshape(8, 32).repeat(32, 0)
    w = GGUFWeight.from_numpy(raw.reshape(256, 68), "Q8_0", 64)
    x = jnp.asarray(rng.standard_normal((3, 64)) * 1e-3, jnp.float32)
    close(_product(x, w.raw, "Q8_0"), reference(x, w))


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
def test_input_gradient_is_the_dequantised_weights(kind, getkey):
    w = random_gguf_weight(np.random.default_rng(1), kind, (), 40, 96)
    dense = jnp.asarray(reference(np.eye(96), w), jnp.float32)  # [in, out]
    r = jax.random.normal(getkey(), (40,))
    x = jax.random.normal(getkey(), (3, 96))
    loss = lambda f: lambda x: jnp.sum(jnp.tanh(f(x) / 10.0) @ r)
    got = jax.jit(jax.grad(loss(lambda x: native_rows_product(x, w.raw, kind))))(x)
    close(got, np.asarray(jax.grad(loss(lambda x: x @ dense))(x)))


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
def test_decode_products_take_it_inside_scans_and_vmaps(kind, getkey):
    ws = random_gguf_weight(np.random.default_rng(4), kind, (3,), 64, 64)  # [L, out, bytes]
    dense = ws.dequantize(jnp.float32)
    step = lambda h, w: (jnp.tanh(matmul(h, w) / 64.0), None)
    run = lambda x, ws: jax.lax.scan(step, x, ws)[0]
    for batch in (1, 4, 64, 65):  # one-row steps of `batch` sequences, vmapped
        x = jax.random.normal(getkey(), (batch, 1, 64))
        f = jax.jit(jax.vmap(run, in_axes=(0, None)))
        program = f.lower(x, ws).compile().as_text()
        assert ("rlhf_eqx_packed_rows" in program) == (batch <= 64), batch
        close(f(x, ws), np.asarray(jax.vmap(run, in_axes=(0, None))(x, dense)), atol=3e-5)


@needs_kernel
def test_bad_kind_and_row_bytes_are_named():
    with pytest.raises(ValueError, match="kind 'Q6_K' is not one of"):
        native_rows_product(jnp.ones((1, 256)), jnp.zeros((4, 210), jnp.uint8), "Q6_K")
    with pytest.raises(ValueError, match="raw has 34 bytes per row, expected 68"):
        native_rows_product(jnp.ones((1, 64)), jnp.zeros((4, 34), jnp.uint8), "Q8_0")


SCRIPT = textwrap.dedent(
    """
    import warnings, jax, jax.numpy as jnp, numpy as np
    from rlhf_eqx.models import matmul, native_rows_available, quantize_gguf
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = native_rows_available()
    w = quantize_gguf(jnp.linspace(-1.0, 1.0, 64 * 8).reshape(64, 8), "Q8_0")
    x = jnp.linspace(-1.0, 1.0, 64)[None]
    err = float(jnp.max(jnp.abs(jax.jit(matmul)(x, w) - x @ w.dequantize(jnp.float32))))
    print(available, err < 1e-4, [str(c.message) for c in caught])
    """
)


def run_script(tmp_path, **env):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "JAX_PLATFORMS": "cpu", **env}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_switched_off_by_the_environment(tmp_path):
    out = run_script(tmp_path, RLHF_EQX_NATIVE="0")
    assert out == "False True []"
    assert not (tmp_path / "rlhf_eqx" / "native").exists()


@pytest.mark.parametrize("cxx", ["false", "/nonexistent/c++"])
def test_a_failed_build_warns_once_and_keeps_the_values(tmp_path, cxx):
    # a compiler that fails, and a `$CXX` that is not there (named, not replaced)
    out = run_script(tmp_path, CXX=shutil.which(cxx) or cxx)
    assert out.startswith("False True [") and out.count("rlhf_eqx: the native packed-row") == 1
    assert "kernel could not be built" in out
    assert "RLHF_EQX_NATIVE=0" in out
    if cxx.startswith("/nonexistent"):
        assert "/nonexistent/c++" in out


@needs_kernel
def test_a_packed_decoder_decodes_as_the_dequantised_one(getkey):
    # each projection in another block format: the decode steps' products take the
    # kernel and decode what the dequantised model decodes
    cfg = rx.TransformerConfig(
        vocab_size=96, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=48
    )
    policy = rx.Policy(cfg, key=getkey())
    layers = policy.transformer.layers
    kinds = {"wqkv": "Q8_0", "wo": "Q4_0", "w_gate_up": "Q4_1", "w_down": "Q8_0"}
    packed = eqx.tree_at(
        lambda m: [getattr(m.transformer.layers, f) for f in kinds],
        policy,
        [quantize_gguf(getattr(layers, f) * 4.0, k) for f, k in kinds.items()],
    )
    dense = rx.models.dequantize(packed)
    prompts = jax.random.randint(getkey(), (2, 6), 1, 96)
    masks = jnp.ones((2, 6), bool)

    def greedy(m):
        return rx.generate_batch(
            m, prompts, masks, jax.random.key(0), max_new_tokens=12, temperature=0.0
        )

    program = jax.jit(greedy).lower(packed).compile().as_text()
    assert program.count('custom_call_target="rlhf_eqx_packed_rows"') >= 4
    got, want = jax.jit(greedy)(packed), jax.jit(greedy)(dense)
    np.testing.assert_array_equal(got.tokens, want.tokens)

    @eqx.filter_jit
    def step_logits(m):  # one decode step after the first prompt
        _, cache = m.prefill(prompts[0], masks[0], cache_size=7)
        return m.decode_step(got.tokens[0, 6], cache, index=6, position=jnp.int32(6))[0]

    close(step_logits(packed), np.asarray(step_logits(dense)), atol=1e-5)


ARCH_SCRIPT = textwrap.dedent(
    """
    import gguf, jax, jax.numpy as jnp, numpy as np
    from helpers import random_gguf_weight
    from rlhf_eqx.models import native_rows_available, native_rows_product
    assert native_rows_available()
    rng = np.random.default_rng(0)
    worst = 0.0
    for kind in ("Q8_0", "Q4_0", "Q4_1"):
        ws = random_gguf_weight(rng, kind, (2,), 300, 96)  # two weights
        raw = np.asarray(ws.raw).copy()
        raw[0, :3, 0:2] = np.array([6e-8, -6e-8, 65504.0], np.float16).view(np.uint8).reshape(3, 2)
        dense = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).astype(np.float64)
        for rows in (1, 3, 4, 5):
            x = rng.standard_normal((rows, 96)).astype(np.float32)
            for i in (0, 1):
                f = native_rows_product(jnp.asarray(x), jnp.asarray(raw[i]), kind)
                want = x.astype(np.float64) @ dense[i].T
                # float32 summation's bound: a few ulps of the sum of |terms| per output
                bound = np.abs(x).astype(np.float64) @ np.abs(dense[i]).T + 1e-300
                worst = max(worst, float(np.max(np.abs(np.asarray(f) - want) / bound)))
    print(worst)
    """
)


@pytest.mark.slow
@pytest.mark.skipif(
    not COMPILER or os.uname().machine != "x86_64", reason="needs a compiler on x86-64"
)
@pytest.mark.parametrize("arch", ["x86-64-v3", "x86-64"])
def test_the_avx2_and_plain_builds_compute_the_same(tmp_path, arch):
    # this machine's build takes the widest vectors it has; a build for AVX2 (8 lanes)
    # and one for plain x86-64 (scalar loops, float16 scales decoded in software,
    # subnormal and largest scales included) give the same products
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    env["RLHF_EQX_NATIVE_ARCH"] = arch
    env["PYTHONPATH"] = os.path.dirname(__file__) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(
        [sys.executable, "-c", ARCH_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.strip()) < 96 * 2**-23  # n · ε of float32
    assert len(list((tmp_path / "rlhf_eqx" / "native").glob("packed_rows-*.so"))) == 1


@pytest.mark.slow
@pytest.mark.skipif(not COMPILER, reason="needs a C++ compiler")
def test_a_damaged_cached_library_is_built_again(tmp_path):
    # a library cut short in the cache (a full disk, a killed copy) under the expected
    # name is compiled again, not kept as a failure in every later process
    assert run_script(tmp_path) == "True True []"
    (library,) = (tmp_path / "rlhf_eqx" / "native").glob("packed_rows-*.so")
    size = library.stat().st_size
    with open(library, "r+b") as f:
        f.truncate(100)
    assert run_script(tmp_path) == "True True []"
    assert [p.stat().st_size for p in library.parent.iterdir()] == [size]


@pytest.mark.slow
def test_an_unusable_cache_directory_is_one_line_each_not_a_crash(tmp_path):
    # XDG_CACHE_HOME naming a file (as a read-only directory does for other users): the
    # kernel stays in XLA with one warning, and a command-line run goes on without the
    # compilation cache after one note
    cache = tmp_path / "cache"
    cache.write_text("not a directory")
    out = run_script(tmp_path, XDG_CACHE_HOME=str(cache))
    assert out.startswith("False True [")
    assert "the native packed-row kernel could not be built ([Errno 20] Not a directory" in out
    env = {**os.environ, "XDG_CACHE_HOME": str(cache), "JAX_PLATFORMS": "cpu"}
    for name in ("RLHF_EQX_COMPILATION_CACHE", "JAX_COMPILATION_CACHE_DIR"):  # the suite's
        env.pop(name, None)
    command = ["sample", "--prompt", "Once upon", "-n", "1", "--set", "sampling.max_new_tokens=2"]
    done = subprocess.run(
        [sys.executable, "-m", "rlhf_eqx", *command, "--out", str(tmp_path / "run")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("note: no compilation cache") == 1, done.stderr[-3000:]
    assert done.stdout.startswith("Once upon")


# float32 tables stored by output row (a tied LM head's embedding): `x @ wᵀ`

_dense = jax.jit(native_dense_product)


def dense_reference(x, w):
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64).T


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 64])
@pytest.mark.parametrize("n, out", [(576, 960), (96, 37), (64, 1040)])
def test_dense_product_equals_the_float64_product(rows, n, out):
    # 960 and 1040 output rows are split between threads, 37 run on the calling thread
    rng = np.random.default_rng([rows, n, out])
    x = rng.standard_normal((rows, n)).astype(np.float32)
    w = rng.standard_normal((out, n)).astype(np.float32)
    got = np.asarray(_dense(jnp.asarray(x), jnp.asarray(w)))
    want = dense_reference(x, w)
    # no worse than a float32 dot of the same inputs
    f32 = (x @ w.T).astype(np.float32)
    bound = max(2.0 * float(np.max(np.abs(f32 - want))), 1e-6 * float(np.max(np.abs(want))))
    assert float(np.max(np.abs(got - want))) <= bound


@needs_kernel
def test_dense_product_derivatives_and_vmaps(getkey):
    w = jax.random.normal(getkey(), (64, 96)) / 8.0
    x = jax.random.normal(getkey(), (4, 96))
    xla = lambda x, w: x @ w.T
    loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w)))
    for got, want in [
        (
            jax.jit(jax.grad(loss(native_dense_product), (0, 1)))(x, w),
            jax.grad(loss(xla), (0, 1))(x, w),
        ),
        (  # per-example gradients: the vmapped rows are folded into one call
            jax.jit(jax.vmap(jax.grad(loss(native_dense_product), (0, 1)), (0, None)))(
                x[:, None], w
            ),
            jax.vmap(jax.grad(loss(xla), (0, 1)), (0, None))(x[:, None], w),
        ),
        (jax.jvp(native_dense_product, (x, w), (x, w)), jax.jvp(xla, (x, w), (x, w))),
        (  # a vmapped table (one per member) takes XLA's product
            jax.jit(jax.vmap(native_dense_product))(jnp.stack([x, 2 * x]), jnp.stack([w, -w])),
            jax.vmap(xla)(jnp.stack([x, 2 * x]), jnp.stack([w, -w])),
        ),
    ]:
        for g, h in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            close(g, np.asarray(h), atol=1e-5)


def test_dense_product_refuses_what_it_cannot_take():
    with pytest.raises(ValueError, match="must be float32"):
        native_dense_product(jnp.ones((1, 64)), jnp.ones((4, 64), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"must be \[out, n\] with x's n = 48 columns"):
        native_dense_product(jnp.ones((1, 48)), jnp.ones((4, 48)))
    with pytest.raises(ValueError, match="transposed=True takes a dense weight"):
        matmul(jnp.ones((1, 64)), quantize_gguf(jnp.ones((64, 8)), "Q8_0"), transposed=True)


def test_a_table_of_other_width_is_named_when_traced():
    # a tied head whose width is not the hidden size fails as XLA's dot does, at trace
    # time (also in `jax.eval_shape`), not when the compiled program runs
    side = int(NATIVE_MIN_DENSE**0.5)
    table = jax.ShapeDtypeStruct((side, side), jnp.float32)
    for width in (side - 32, side + 32):
        x = jax.ShapeDtypeStruct((2, width), jnp.float32)
        with pytest.raises(TypeError, match="dot_general requires contracting dimensions"):
            jax.eval_shape(lambda x, w: matmul(x, w, transposed=True), x, table)


@needs_kernel
def test_matmul_takes_it_for_few_rows_of_large_float32_tables(getkey):
    side = int(NATIVE_MIN_DENSE**0.5)  # a table of exactly NATIVE_MIN_DENSE elements
    big, small = jax.random.normal(getkey(), (side, side)), jax.random.normal(getkey(), (64, 64))

    def routed(x, w, **kw):
        text = jax.jit(lambda x: matmul(x, w, transposed=True, **kw)).lower(x).as_text()
        return "rlhf_eqx_dense_rows" in text

    x = jax.random.normal(getkey(), (2, 2, side))  # 4 rows
    assert routed(x, big) and routed(x, big, out_dtype=jnp.float32)
    assert "rlhf_eqx_dense" not in jax.jit(lambda x: matmul(x, big)).lower(x).as_text()
    assert not routed(jax.random.normal(getkey(), (65, side)), big)  # too many rows
    assert not routed(x.astype(jnp.bfloat16), big.astype(jnp.bfloat16))
    assert not routed(x[..., :64], small)  # stays in cache: XLA's dot, bit for bit
    xs = x[..., :64]
    np.testing.assert_array_equal(matmul(xs, small, transposed=True), xs @ small.T)
    f = jax.jit(lambda x: matmul(x, big, transposed=True))
    close(f(x), dense_reference(x, big), atol=1e-5)


@needs_kernel
def test_a_float32_decoder_with_a_tied_head_decodes_with_it(getkey):
    # a table of NATIVE_MIN_DENSE elements: the decode steps' heads take the kernel, and
    # their logits are the full forward pass's
    cfg = rx.TransformerConfig(
        vocab_size=2048, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=256,
        max_seq_len=32, tie_embeddings=True,
    )  # fmt: skip
    policy = rx.Policy(cfg, key=getkey())
    prompt = jax.random.randint(getkey(), (6,), 1, 2048)
    mask = jnp.ones((6,), bool)

    @eqx.filter_jit
    def decoded(m):  # logits of the next token after each of three greedy steps
        logits, cache = m.prefill(prompt, mask, cache_size=9)
        tokens, out = prompt, []
        for i in range(3):
            nxt = jnp.argmax(logits[-1] if i == 0 else logits)
            tokens = jnp.append(tokens, nxt)
            logits, cache = m.decode_step(nxt, cache, index=6 + i, position=jnp.int32(6 + i))
            out.append(logits)
        return tokens, jnp.stack(out)

    assert "rlhf_eqx_dense_rows" in jax.jit(lambda m: decoded(m)).lower(policy).as_text()
    tokens, got = decoded(policy)
    full = policy(tokens[None], jnp.ones((1, 9), bool))[0]  # 9 rows: XLA's products too
    close(got, np.asarray(full[6:9]), atol=2e-5)
