"""A float32 decoder's tied LM head in the native kernel, end to end: the samplers decode
the tokens they decode without it (`RLHF_EQX_NATIVE=0`, in a subprocess), forward and
reverse derivatives of every order through the head are XLA's, a table placed on a mesh
stays in XLA's dot, and a program holding the kernel is reused from the compilation
cache by another process."""

import json
import os
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlhf_eqx as rx
from rlhf_eqx.distributed import make_mesh, shard_batch, shard_model
from rlhf_eqx.models import matmul, native_rows_available

needs_kernel = pytest.mark.skipif(
    not native_rows_available(), reason="the native kernel is not built here (no compiler)"
)
TARGET = "rlhf_eqx_dense_rows"

# a 4096 × 128 tied table: twice NATIVE_MIN_DENSE, so a decode step's head routes
SAMPLERS = textwrap.dedent(
    """
    import json, jax, jax.numpy as jnp, equinox as eqx
    import rlhf_eqx as rx
    from rlhf_eqx.models import native_rows_available, truncated_draft

    cfg = rx.TransformerConfig(
        vocab_size=4096, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=256,
        max_seq_len=40, tie_embeddings=True,
    )
    policy = rx.Policy(cfg, key=jax.random.key(0))
    prompts = jax.random.randint(jax.random.key(1), (3, 5), 1, 4096)
    masks = jnp.ones((3, 5), bool).at[1, :2].set(False)
    key, keys = jax.random.key(2), jax.random.split(jax.random.key(3), 3)
    runs = {
        "batch": lambda m: rx.generate_batch(
            m, prompts, masks, key, max_new_tokens=6, temperature=0.7, top_k=50, top_p=0.9,
            num_samples=2,
        ),
        "paged": lambda m: rx.generate_continuous(
            m, prompts, masks, keys, slots=2, max_new_tokens=6, temperature=0.8,
            cache="paged", page_size=4, num_pages=24,
        ),
        "speculative": lambda m: rx.generate_speculative(
            m, truncated_draft(m, 1), prompts, masks, key, k=3, max_new_tokens=6,
            temperature=0.0,
        ),
    }
    out = {name: run(policy).tokens.tolist() for name, run in runs.items()}
    text = eqx.filter_jit(lambda m: runs["batch"](m).tokens).lower(policy).as_text()
    out["routed"] = "rlhf_eqx_dense_rows" in text
    print(json.dumps(out))
    """
)


def run_samplers(**env):
    done = subprocess.run(
        [sys.executable, "-c", SAMPLERS],
        env={**os.environ, "JAX_PLATFORMS": "cpu", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@needs_kernel
def test_samplers_decode_the_tokens_they_decode_without_it():
    # sampled, paged continuous and speculative decoding: the same tokens, the head's
    # few rows in the kernel or in XLA's dot
    got, want = run_samplers(), run_samplers(RLHF_EQX_NATIVE="0")
    assert got.pop("routed") and not want.pop("routed")
    assert got == want


def head(xla):
    def f(h, w):
        y = h @ w.T if xla else matmul(h, w, out_dtype=jnp.float32, transposed=True)
        return jnp.sum(jnp.sin(y))

    return f


@needs_kernel
def test_derivatives_of_every_order_through_the_head(getkey):
    w = jax.random.normal(getkey(), (4096, 128)) / 8.0
    ws = jnp.stack([w, -w, 2.0 * w])
    hs = jax.random.normal(getkey(), (3, 2, 128))
    assert TARGET in jax.jit(head(False)).lower(hs[0], w).as_text()
    cases = {
        "hessian": lambda f: jax.vmap(jax.hessian(f), (0, None))(hs, w),
        "grad of a vmap": lambda f: jax.grad(lambda w: jnp.sum(jax.vmap(f, (0, None))(hs, w)))(w),
        "stacked tables": lambda f: jax.vmap(jax.grad(f, (0, 1)))(hs, ws),
        "checkpoint": lambda f: jax.grad(jax.checkpoint(f), (0, 1))(hs[0], w),
        "forward over w": lambda f: jax.jacfwd(lambda s: f(hs[0], w * s[0] + s[1]))(
            jnp.array([1.0, 0.1])
        ),
        "scan": lambda f: jax.grad(
            lambda w: jax.lax.scan(lambda c, h: (c + f(h, w), None), 0.0, hs)[0]
        )(w),
    }
    for name, case in cases.items():
        got, want = jax.jit(lambda: case(head(False)))(), case(head(True))
        for g, h in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            scale = float(np.max(np.abs(h)))
            np.testing.assert_allclose(g, h, atol=2e-5 * scale, rtol=0, err_msg=name)


@needs_kernel
@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")
@pytest.mark.parametrize("data, model, fsdp", [(8, 1, False), (4, 2, True)])
def test_a_table_on_a_mesh_stays_in_xla(data, model, fsdp):
    # replicated, split over the vocabulary or the hidden size: no custom call is left
    # for the partitioner to gather around, and the tokens are the single device's
    cfg = rx.TransformerConfig(
        vocab_size=4096, d_model=128, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=256,
        max_seq_len=24, tie_embeddings=True,
    )  # fmt: skip
    policy = rx.Policy(cfg, key=jax.random.key(0))
    prompts = jax.random.randint(jax.random.key(1), (8, 5), 1, 4096)
    masks = jnp.ones((8, 5), bool)

    @eqx.filter_jit
    def greedy(m, p, k):
        return rx.generate_batch(m, p, k, jax.random.key(2), max_new_tokens=4, temperature=0.0)

    want = greedy(policy, prompts, masks).tokens
    assert TARGET in greedy.lower(policy, prompts, masks).as_text()
    mesh = make_mesh(data, model)
    placed, (p, k) = shard_model(policy, mesh, fsdp=fsdp), shard_batch((prompts, masks), mesh)
    assert TARGET not in greedy.lower(placed, p, k).as_text()
    np.testing.assert_array_equal(greedy(placed, p, k).tokens, want)


CACHED = textwrap.dedent(
    """
    import jax, jax.numpy as jnp
    from rlhf_eqx.models import matmul
    w = jax.random.normal(jax.random.key(0), (4096, 128))
    h = jax.random.normal(jax.random.key(1), (3, 128))
    f = jax.jit(lambda h, w: matmul(h, w, out_dtype=jnp.float32, transposed=True) + 1.0)
    assert "rlhf_eqx_dense_rows" in f.lower(h, w).as_text()
    y = f(h, w)
    print(float(jnp.max(jnp.abs(y - (h @ w.T + 1.0)))))
    """
)


@pytest.mark.slow
@needs_kernel
def test_a_cached_program_with_the_kernel_runs_in_another_process(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(tmp_path)}
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"
    entries = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", CACHED], env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert float(done.stdout.strip()) < 1e-3
        entries.append(sorted(p.name for p in tmp_path.iterdir()))
    assert entries[0] and entries[1] == entries[0]  # the second process compiled nothing
