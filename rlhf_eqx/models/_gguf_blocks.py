"""llama.cpp's quantised block formats, decoded in JAX, and a frozen weight kept in them.

A GGUF tensor of `n` values per row is stored row by row, each row as `n / QK` blocks of
`QK` values (`GGUF_BLOCKS[kind] = (QK, bytes per block)`). Scales `d`, `dmin`, `m` are
IEEE float16, little-endian; the layouts follow ggml's `block_q*` structs
(`ggml/src/ggml-common.h`) and their reference dequantisers (`dequantize_row_q*` in
`ggml/src/ggml-quants.c`), which the `gguf` Python package mirrors in numpy
(`gguf/quants.py`, `Q8_0.dequantize_blocks` and siblings). `dequantize_rows` reproduces
the latter bit for bit in float32 (the same products in the same order).

- **Q8_0** (32 values, 34 bytes): `d` (f16), 32 int8 `q`; `w = d·q`.
- **Q4_0** (32, 18): `d`, 16 bytes of 4-bit `q` — the low nibbles are elements 0..15,
  the high nibbles 16..31; `w = d·(q − 8)`.
- **Q4_1** (32, 20): `d`, `m` (f16), 16 bytes of nibbles as Q4_0; `w = d·q + m`.
- **Q4_K** (256, 144): super-block `d`, `dmin` (f16); 12 bytes of eight 6-bit scales
  `sc[j]` and mins `mn[j]` (bytes `b0..b11`: for `j < 4`, `sc = b[j] & 63`,
  `mn = b[j+4] & 63`; for `j ≥ 4`, `sc = (b[j+4] & 15) | ((b[j-4] >> 6) << 4)`,
  `mn = (b[j+4] >> 4) | ((b[j] >> 6) << 4)`); 128 bytes of nibbles, four chunks of 32
  bytes, chunk `c` holding sub-block `2c` in its low and `2c+1` in its high nibbles;
  `w = (d·sc[j])·q − dmin·mn[j]` for the 32 values of sub-block `j`.
- **Q5_K** (256, 176): as Q4_K, plus 32 bytes `qh` before the nibbles: bit `j` of
  `qh[i]` is the fifth bit of value `i` of sub-block `j`; `q = nibble | (bit << 4)`.
- **Q6_K** (256, 210): 128 bytes `ql` (low 4 bits), 64 bytes `qh` (high 2 bits), 16
  int8 scales, `d` (f16) last. Value `128h + 32s + i` (half `h`, quarter `s`, `i <
  32`) takes the nibble of `ql[64h + 32(s mod 2) + i]` (low for `s < 2`, high after)
  and bits `2s, 2s+1` of `qh[32h + i]`; `w = (d·scale[k])·(q − 32)` with `k` the value's
  group of 16.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, Shaped, UInt8

from ._layers import AbstractQuantizedWeight
from ._packed_products import PACKED_KINDS, few_rows_product

GGUF_BLOCKS: dict[str, tuple[int, int]] = {
    "Q8_0": (32, 34),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}


def _f16(b: Array) -> Array:
    """Little-endian float16 bytes `[..., 2]` as float32 `[...]` (assembled as a uint16
    and bit-cast: on CPU faster than bit-casting byte pairs)."""
    u = b[..., 0].astype(jnp.uint16) | (b[..., 1].astype(jnp.uint16) << 8)
    return jax.lax.bitcast_convert_type(u, jnp.float16).astype(jnp.float32)


def _i8(b: Array) -> Array:
    """Bytes as two's-complement int8, as float32: `(b xor 128) − 128`, exact. Not the
    `uint8 → int8 → float32` conversion chain: XLA's CPU backend (jax 0.10) miscomputes
    it once the decode is fused into a product of more than 4096 rows (a dense product
    of a packed Q8_0 / Q6_K weight: a batch of more than 4096 tokens)."""
    return (b ^ jnp.uint8(128)).astype(jnp.float32) - 128.0


def _nibbles(qs: Array) -> Array:
    """`[..., k]` bytes → `[..., 2, k]`: low nibbles, then high nibbles."""
    return jnp.stack([qs & 15, qs >> 4], axis=-2)


def _bits(b: Array, shifts: tuple[int, ...], mask: int) -> Array:
    """`[..., k]` bytes → `[..., len(shifts), k]`: `(b >> s) & mask` for each shift (one
    broadcast shift: XLA's CPU code is faster than for a stack of many shifted copies)."""
    s = jnp.asarray(shifts, jnp.uint8).reshape((1,) * (b.ndim - 1) + (len(shifts), 1))
    return (b[..., None, :] >> s) & jnp.uint8(mask)


def _k_scales(s: Array) -> tuple[Array, Array]:
    """Q4_K / Q5_K: the 12 scale bytes `[..., 12]` → 6-bit scales and mins, float32 `[..., 8]`."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = jnp.concatenate([d & 63, (md & 15) | ((d >> 2) & 48)], axis=-1)
    mn = jnp.concatenate([m & 63, (md >> 4) | ((m >> 2) & 48)], axis=-1)
    return sc.astype(jnp.float32), mn.astype(jnp.float32)


def _q8_0(b):
    return _i8(b[..., 2:34]) * _f16(b[..., 0:2])[..., None]


def _q4_0(b):
    q = _nibbles(b[..., 2:18]).reshape(b.shape[:-1] + (32,)).astype(jnp.int8) - jnp.int8(8)
    return _f16(b[..., 0:2])[..., None] * q.astype(jnp.float32)


def _q4_1(b):
    q = _nibbles(b[..., 4:20]).reshape(b.shape[:-1] + (32,)).astype(jnp.float32)
    return _f16(b[..., 0:2])[..., None] * q + _f16(b[..., 2:4])[..., None]


def _k_quant(b, q):
    """`(d·sc[j])·q − dmin·mn[j]` for Q4_K / Q5_K, with `q` float32 `[..., 8, 32]`."""
    sc, mn = _k_scales(b[..., 4:16])
    d = (_f16(b[..., 0:2])[..., None] * sc)[..., None]
    dm = (_f16(b[..., 2:4])[..., None] * mn)[..., None]
    return (d * q - dm).reshape(b.shape[:-1] + (256,))


def _q4_k(b):
    q = _nibbles(b[..., 16:144].reshape(b.shape[:-1] + (4, 32)))
    return _k_quant(b, q.reshape(b.shape[:-1] + (8, 32)).astype(jnp.float32))


def _q5_k(b):
    lead = b.shape[:-1]
    ql = _nibbles(b[..., 48:176].reshape(lead + (4, 32))).reshape(lead + (8, 32))
    qh = b[..., 16:48]
    hi = _bits(qh, tuple(range(8)), 1)
    return _k_quant(b, (ql | (hi << 4)).astype(jnp.float32))


def _q6_k(b):
    lead = b.shape[:-1]
    ql = _nibbles(b[..., 0:128].reshape(lead + (2, 64))).reshape(lead + (8, 32))
    hi = _bits(b[..., 128:192].reshape(lead + (2, 32)), (0, 2, 4, 6), 3).reshape(lead + (8, 32))
    q = (ql | (hi << 4)).astype(jnp.int8) - jnp.int8(32)
    q = q.reshape(lead + (16, 16)).astype(jnp.float32)
    d = (_f16(b[..., 208:210])[..., None] * _i8(b[..., 192:208]))[..., None]
    return (d * q).reshape(lead + (256,))


_DECODERS = {
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}


def _check_kind(kind: str, n: int, nbytes: int | None, where: str) -> None:
    if kind not in GGUF_BLOCKS:
        raise ValueError(f"{where}: unsupported kind {kind!r}; expected one of {list(GGUF_BLOCKS)}")
    qk, size = GGUF_BLOCKS[kind]
    if n < 1 or n % qk:
        raise ValueError(f"{where}: n={n} is not a positive multiple of {kind}'s {qk} values")
    if nbytes is not None and nbytes != n // qk * size:
        raise ValueError(
            f"{where}: rows have {nbytes} bytes, expected {n // qk * size} for {n} values of {kind}"
        )


def dequantize_rows(
    raw: UInt8[Array, "*L rows nbytes"], kind: str, n: int, dtype=jnp.float32
) -> Float[Array, "*L rows n"]:
    """Decode rows of llama.cpp quantised blocks (the layouts in the module docstring).

    **Arguments:**

    - `raw`: the packed rows, `uint8`, `n / QK · bytes` per row (`GGUF_BLOCKS[kind]`).
    - `kind`: `"Q8_0"`, `"Q4_0"`, `"Q4_1"`, `"Q4_K"`, `"Q5_K"` or `"Q6_K"`.
    - `n`: values per row.
    - `dtype`: of the result; the values are computed in float32 (equal bit for bit to
      `gguf.quants.dequantize`) and then cast.

    **Returns:** the values, `[..., rows, n]`.
    """
    _check_kind(kind, n, raw.shape[-1], "dequantize_rows")
    if raw.dtype != jnp.uint8:
        raise ValueError(f"dequantize_rows: raw must be uint8, got {raw.dtype}")
    qk, size = GGUF_BLOCKS[kind]
    blocks = raw.reshape(raw.shape[:-1] + (n // qk, size))
    return _DECODERS[kind](blocks).reshape(raw.shape[:-1] + (n,)).astype(dtype)


class GGUFWeight(AbstractQuantizedWeight):
    """A frozen `[in, out]` weight (or a stack `[*L, in, out]`) kept in llama.cpp's blocks.

    `raw[..., o, :]` is output column `o` packed as a GGUF row of `in` values (ggml's
    `[out, in]` layout: blocks run along the input axis), so `dequantize` decodes the rows
    and transposes them. As the token embedding (`in_out = (d_model, vocab)`) the rows
    are the vocabulary: `columns(ids)` decodes only the gathered rows. In a frozen
    product of one row (a decode step), Q8_0, Q4_0 and Q4_1 rows are multiplied without
    a dense copy (`product`, `rlhf_eqx.models.few_rows_product`); K-quants dequantise.
    """

    raw: UInt8[Array, "*L out row_bytes"]
    kind: str = eqx.field(static=True)
    in_out: tuple[int, int] = eqx.field(static=True)

    def __check_init__(self):
        n_in, n_out = self.in_out
        shape = getattr(self.raw, "shape", None)
        _check_kind(self.kind, n_in, None if shape is None else shape[-1], "GGUFWeight")
        if shape is not None and (len(shape) < 2 or shape[-2] != n_out):
            raise ValueError(f"GGUFWeight: raw has shape {shape}, expected [..., {n_out}, bytes]")
        if getattr(self.raw, "dtype", jnp.uint8) != jnp.uint8:
            raise ValueError(f"GGUFWeight: raw must be uint8, got {self.raw.dtype}")

    @property
    def shape(self) -> tuple[int, ...]:
        return self.raw.shape[:-2] + self.in_out

    def dequantize(self, dtype) -> Float[Array, "*L i o"]:
        return jnp.swapaxes(self.rows(self.raw, dtype), -1, -2)

    def dequantize_t(self, dtype) -> Float[Array, "*L o i"]:
        return self.rows(self.raw, dtype)

    def rows(self, raw: UInt8[Array, "*K row_bytes"], dtype) -> Float[Array, "*K i"]:
        """Decode packed output rows `raw [..., k, row_bytes]` (slices of `self.raw`) to
        `[..., k, in]`."""
        return dequantize_rows(raw, self.kind, self.in_out[0], dtype)

    def columns(self, ids: Int[Array, "*N"], dtype) -> Float[Array, "*N i"]:
        return self.rows(jnp.take(self.raw, ids, axis=-2), dtype)

    def product(self, x2: Float[Array, "M i"], dense, dtypes) -> Float[Array, "M o"]:
        """Q8_0, Q4_0 and Q4_1 multiply few rows straight from the blocks
        (`few_rows_product`, for decode steps); other kinds and more rows dequantise."""
        if self.kind not in PACKED_KINDS or self.raw.ndim != 2:
            return dense(x2, self, dtypes)

        def dense_raw(x2, raw):
            return dense(x2, GGUFWeight(raw=raw, kind=self.kind, in_out=self.in_out), dtypes)

        return few_rows_product(x2, self.raw, self.kind, dense_raw, dtypes[1])

    def column_slice(self, start: Int[Array, ""], size: int) -> "GGUFWeight":
        raw = jax.lax.dynamic_slice_in_dim(self.raw, start, size, axis=-2)
        return GGUFWeight(raw=raw, kind=self.kind, in_out=(self.in_out[0], size))

    @classmethod
    def from_numpy(
        cls, data: Shaped[np.ndarray, "*L out row_bytes"], kind: str, n_in: int
    ) -> "GGUFWeight":
        """A weight from a GGUF tensor's bytes, `uint8 [out, row_bytes]` (or `[*L, out,
        row_bytes]`), with `n_in` values per row (another dtype raises `ValueError`)."""
        data = np.asarray(data)
        if data.dtype != np.uint8 or data.ndim < 2:
            raise ValueError(
                f"GGUFWeight.from_numpy: data must be uint8 [out, row_bytes], "
                f"got {data.dtype} {data.shape}"
            )
        return cls(raw=jnp.asarray(data), kind=kind, in_out=(int(n_in), int(data.shape[-2])))


class GGUFMixedWeight(AbstractQuantizedWeight):
    """A frozen `[in, out]` weight (or a stack `[*L, in, out]`) whose output columns are
    runs of llama.cpp rows in different block kinds, the kind of a run possibly changing
    from layer to layer (llama.cpp's `Q4_K_M` stores `attn_v` and `ffn_down` as `Q6_K` in
    some layers and `Q4_K` in the others, so the fused `wqkv` of such a layer has `Q4_K`
    q/k rows and `Q6_K` v rows).

    Run `p` holds `raw[p] [*L, out_p, bytes_p]`, each row the GGUF row of one output
    column, `bytes_p` the longest row among its kinds `kinds[p]` (shorter rows are
    zero-padded at the end), and `codes[p] [*L]` the index into `kinds[p]` of each layer's
    kind. Decoding a layer decodes each run in its kind (`jax.lax.switch` on the code, so
    a scanned layer decodes only its own kind) and concatenates the runs: the weight
    stays packed, at the bytes of its widest kind, and decodes to exactly the values of
    the file's tensors. The runs are the field `raw` (as a `GGUFWeight`'s rows are), so
    `partition_specs` splits them by output row the same way.
    """

    raw: tuple[UInt8[Array, "*L _out_p _bytes_p"], ...]  # the runs' rows and bytes differ
    codes: tuple[Int[Array, "*L"], ...]
    kinds: tuple[tuple[str, ...], ...] = eqx.field(static=True)
    in_out: tuple[int, int] = eqx.field(static=True)

    def __check_init__(self):
        if not (len(self.raw) == len(self.codes) == len(self.kinds)) or not self.raw:
            raise ValueError("GGUFMixedWeight: one code array and kind list per run of rows")
        n_in, n_out = self.in_out
        for raw, kinds in zip(self.raw, self.kinds):
            for kind in kinds:
                _check_kind(kind, n_in, None, "GGUFMixedWeight")
            widest = max(n_in // GGUF_BLOCKS[k][0] * GGUF_BLOCKS[k][1] for k in kinds)
            shape = getattr(raw, "shape", None)
            if shape is not None and shape[-1] != widest:
                raise ValueError(f"GGUFMixedWeight: rows of {shape[-1]} bytes, expected {widest}")
        total = sum(getattr(r, "shape", (0, 0))[-2] for r in self.raw)
        if all(hasattr(r, "shape") for r in self.raw) and total != n_out:
            raise ValueError(f"GGUFMixedWeight: runs of {total} rows, expected {n_out}")

    @property
    def shape(self) -> tuple[int, ...]:
        return self.raw[0].shape[:-2] + self.in_out

    def dequantize(self, dtype) -> Float[Array, "*L i o"]:
        return jnp.swapaxes(self.dequantize_t(dtype), -1, -2)

    def dequantize_t(self, dtype) -> Float[Array, "*L o i"]:
        if self.raw[0].ndim > 2:  # a stack: layer by layer
            return jax.vmap(lambda w: w.dequantize_t(dtype))(self)
        n_in, runs = self.in_out[0], []
        for raw, code, kinds in zip(self.raw, self.codes, self.kinds):
            decoders = [
                (lambda k: lambda r: dequantize_rows(r[:, : _row_bytes(k, n_in)], k, n_in, dtype))(
                    k
                )
                for k in kinds
            ]
            runs.append(
                decoders[0](raw) if len(kinds) == 1 else jax.lax.switch(code, decoders, raw)
            )
        return jnp.concatenate(runs, axis=0)


def _row_bytes(kind: str, n: int) -> int:
    qk, size = GGUF_BLOCKS[kind]
    return n // qk * size


def quantize_gguf(w: Float[Array, "*L i o"], kind: str) -> GGUFWeight:
    """Quantise an `[in, out]` weight (or a stack) into llama.cpp blocks with the `gguf`
    package's reference quantiser (`gguf.quants.quantize`, the same bytes as
    llama-quantize without an importance matrix), one GGUF row per output column.

    **Arguments:**

    - `w`: the weight; `in` must be a multiple of the kind's block size.
    - `kind`: a kind the `gguf` package can quantise (`"Q8_0"`, `"Q4_0"`, `"Q4_1"`; its
      numpy quantiser has no K-quants).

    **Returns:** a `GGUFWeight` with `in_out = w.shape[-2:]`.
    """
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - the test environment has gguf
        raise ImportError("quantize_gguf needs the `gguf` package (pip install gguf)") from e
    _check_kind(kind, w.shape[-2], None, "quantize_gguf")
    rows = np.ascontiguousarray(np.swapaxes(np.asarray(w, np.float32), -1, -2))
    try:
        data = gguf.quants.quantize(rows, gguf.GGMLQuantizationType[kind])
    except NotImplementedError as e:
        raise ValueError(f"quantize_gguf: the gguf package cannot quantise kind {kind!r}") from e
    return GGUFWeight.from_numpy(data, kind, w.shape[-2])
