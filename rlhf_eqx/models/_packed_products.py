"""Products `x @ W` with few rows of `x`, computed from llama.cpp blocks without a dense `W`.

Decoding multiplies one row of activations per sequence by every weight, so it is bound
by reading the weights. Dequantising first reads the packed bytes, writes a float32 copy
and reads it again; here the block values are decoded inside the reduction instead,

    y[m, o] = Σ_b Σ_j w(o, b, j) · x[m, b·QK + j],

one XLA fusion over the packed bytes per weight (checked with
`jax.jit(f).lower(...).compile().as_text()`: no float32 `[out, in]` buffer). `w(o, b, j)`
is decoded as `dequantize_rows` decodes it (ggml's `dequantize_row_q8_0`, `_q4_0`,
`_q4_1`), so the product equals the dequantise-then-dot product up to float32 summation
order. Q8_0, Q4_0 and Q4_1 are decoded this way; the K-quants keep the dequantise path.

Which rows take it is decided when the product is traced, from the rows of all vmapped
calls together (`jax.custom_batching.custom_vmap` folds vmapped axes into the rows): at
most `NATIVE_MAX_ROWS` (64) rows take the native CPU kernel where it is built
(`_native_rows`: each block decoded once in registers for every row, several times
faster than XLA's fusion), else at most `PACKED_MAX_ROWS` rows the XLA product below,
more the dense one. On XLA's CPU backend (jax 0.10) the XLA multiply-reduce beats
dequantise-then-dot for one row only: with more rows the reduction is offloaded to a
library kernel (YNNPACK) that reads the weight once per row and is then slower than the
dense product.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, UInt8

from ._native_rows import NATIVE_KINDS, native_rows_available, native_rows_product, rows_folded

# rows of activations (all vmapped calls together) up to which the packed product is used
PACKED_MAX_ROWS = 1
# ... and up to which the native kernel is, where it is built (on 2 cores it beats
# dequantise-then-dot up to ~64 rows: SmolLM2's layers took 95 against 150 ms at 64,
# `benchmarks/bench_packed_decode.py --layers 64`)
NATIVE_MAX_ROWS = 64


def _f16(b: Array) -> Array:
    """Little-endian float16 bytes `[..., 2]` as float32 `[...]`."""
    u = b[..., 0].astype(jnp.uint16) | (b[..., 1].astype(jnp.uint16) << 8)
    return jax.lax.bitcast_convert_type(u, jnp.float16).astype(jnp.float32)


def _signed(q: Array) -> Array:
    """Two's-complement bytes as float32, via `(q xor 128) − 128`: XLA CPU's YNNPACK
    reduction fusion miscomputes a `uint8 → int8 → float32` conversion chain (jax 0.10.2)."""
    return (q ^ jnp.uint8(128)).astype(jnp.float32) - 128.0


def _nibbles(qs: Array) -> tuple[Array, Array]:
    """Bytes as float32 low nibbles (values 0..15 of a block) and high nibbles (16..31),
    split in float arithmetic (`hi = ⌊b/16⌋`, `lo = b − 16·hi`, exact): on XLA's CPU
    backend twice as fast inside the reduction as integer shifts and masks."""
    f = qs.astype(jnp.float32)
    hi = jnp.floor(f * 0.0625)
    return f - 16.0 * hi, hi


def _q8_0(b):
    return (_signed(b[..., 2:34]) * _f16(b[..., 0:2])[..., None],)


def _q4_0(b):
    d = _f16(b[..., 0:2])[..., None]
    return tuple((q - 8.0) * d for q in _nibbles(b[..., 2:18]))


def _q4_1(b):
    d, m = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    return tuple(d * q + m for q in _nibbles(b[..., 4:20]))


# kind: (values per block, bytes per block, decoder of blocks [..., bytes] to the
# block's values, float32, in `k` parts [..., QK / k] of consecutive values)
_PACKED: dict[str, tuple[int, int, Callable[[Array], tuple[Array, ...]]]] = {
    "Q8_0": (32, 34, _q8_0),
    "Q4_0": (32, 18, _q4_0),
    "Q4_1": (32, 20, _q4_1),
}

PACKED_KINDS = tuple(_PACKED)


def packed_product(
    x: Float[Array, "M n"], raw: UInt8[Array, "out nbytes"], kind: str
) -> Float[Array, "M out"]:
    """`x @ Wᵀ` for `W` the rows `raw` of llama.cpp blocks, decoded inside the reduction.

    **Arguments:**

    - `x`: the activations (any float dtype; the products are float32).
    - `raw`: `uint8`, one packed row of `n` values per output (`GGUFWeight.raw`).
    - `kind`: one of `PACKED_KINDS` (`"Q8_0"`, `"Q4_0"`, `"Q4_1"`).

    **Returns:** `y[m, o] = Σ_b Σ_j w(o, b, j) · x[m, b·QK + j]`, float32.
    """
    if kind not in _PACKED:
        raise ValueError(f"packed_product: kind {kind!r} is not one of {list(PACKED_KINDS)}")
    qk, size, decode = _PACKED[kind]
    n, (out, nbytes) = x.shape[-1], raw.shape
    if n % qk or nbytes != n // qk * size:
        raise ValueError(
            f"packed_product: raw has {nbytes} bytes per row, expected {n // qk * size} "
            f"for x's {n} values of {kind}"
        )
    parts = decode(raw.reshape(out, n // qk, size))  # k × [out, nb, QK / k]
    xb = x.astype(jnp.float32).reshape((x.shape[0], 1, n // qk, len(parts), -1))
    terms = [w[None] * xb[:, :, :, k] for k, w in enumerate(parts)]
    return jnp.sum(sum(terms[1:], terms[0]), axis=(2, 3))


def few_rows_product(
    x2: Float[Array, "M n"],
    raw: UInt8[Array, "out nbytes"],
    kind: str,
    dense: Callable[[Array, Array], Array],
    out_dtype: Any,
    *,
    max_rows: int | None = None,
) -> Float[Array, "M out"]:
    """`x2 @ Wᵀ` from the packed rows when few rows of activations (vmapped calls
    included) are multiplied, else `dense(x2, raw)`: up to `NATIVE_MAX_ROWS` (64) rows by the
    native kernel where it is built (`native_rows_available()`), else up to `max_rows`
    by `packed_product`.

    Under `jax.vmap` the batched rows are folded into `x2`'s rows before the choice (and
    a vmapped weight takes the dense product), so a batch of `B` one-row decode steps
    counts `B` rows.

    **Arguments:**

    - `x2`: the activations.
    - `raw`: the packed rows of `kind` (`GGUFWeight.raw`, one weight).
    - `kind`: one of `PACKED_KINDS`.
    - `dense`: the product of more rows, `dense(x2, raw) -> [M, out]` in `out_dtype`.
    - `out_dtype`: of the packed product's result.
    - `max_rows`: the most rows that take the packed product (default `PACKED_MAX_ROWS`,
      read when the product is traced).

    **Returns:** `[M, out]`, `packed_product(x2, raw, kind)` or `dense(x2, raw)`.
    """
    limit = PACKED_MAX_ROWS if max_rows is None else max_rows

    def route(x2, raw):
        rows = x2.shape[0]
        if rows <= NATIVE_MAX_ROWS and kind in NATIVE_KINDS and native_rows_available():
            return native_rows_product(x2, raw, kind).astype(out_dtype)
        if rows <= limit:
            return packed_product(x2, raw, kind).astype(out_dtype)
        return dense(x2, raw)

    return rows_folded(route, dense)(x2, raw)
