"""Building blocks: weights that may be quantised, LoRA adapters, RMSNorm, MLP activations,
soft-capping."""

import abc
import functools
import math
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Int8, PRNGKeyArray, PyTree, UInt8

from ._native_rows import dense_product, dense_routed
from ._packed_products import NATIVE_MAX_ROWS


@functools.partial(jax.jit, static_argnames=("shapes", "scales", "dtype"))
def normal_init(
    key: PRNGKeyArray, *, shapes: tuple[tuple[int, ...], ...], scales: tuple[float, ...], dtype
) -> tuple[Array, ...]:
    """Arrays of `N(0, scale²)` entries of the given shapes, cut from one random draw.

    One compiled program per set of shapes instead of one per array: building a model
    from scratch costs a fraction of a second rather than seconds of kernel compiles.
    """
    sizes = [math.prod(shape) for shape in shapes]
    flat = jax.random.normal(key, (sum(sizes),), jnp.float32)
    out, offset = [], 0
    for shape, size, scale in zip(shapes, sizes, scales):
        out.append((scale * flat[offset : offset + size]).reshape(shape).astype(dtype))
        offset += size
    return tuple(out)


class AbstractQuantizedWeight(eqx.Module):
    """A frozen `[in, out]` weight (or a stack of them) kept in a compact form and
    dequantised inside the forward pass (`dequantize(dtype)`)."""

    @property
    @abc.abstractmethod
    def shape(self) -> tuple[int, ...]:
        """The dense weight's shape (leading stack axes included)."""

    @abc.abstractmethod
    def dequantize(self, dtype) -> Float[Array, "*L i o"]:
        """The dense weight in `dtype`."""

    def dequantize_t(self, dtype) -> Float[Array, "*L o i"]:
        """The dense weight transposed, `[..., out, in]` (decoded as such when stored by column)."""
        return jnp.swapaxes(self.dequantize(dtype), -1, -2)

    def columns(self, ids: Int[Array, "*N"], dtype) -> Float[Array, "*N i"]:
        """Output columns `ids`, `[..., in]`: rows of an embedding stored as `(in, out) = (D,
        V)` (formats stored by output column decode only those; this default all)."""
        return jnp.take(self.dequantize_t(dtype), ids, axis=0)

    def product(self, x2: Float[Array, "M i"], dense: Callable, dtypes) -> Float[Array, "M o"]:
        """`x2 @ W` in a frozen product's forward pass: `dense(x2, self, dtypes)` (the weight
        dequantised), unless the format computes few rows from its packed form."""
        return dense(x2, self, dtypes)

    def column_slice(self, start: Int[Array, ""], size: int) -> "AbstractQuantizedWeight | None":
        """Output columns `[start, start + size)` (traced `start`, clamped as `dynamic_slice`)
        as a weight of the same format, or `None` for formats not stored by output column."""
        del start, size
        return None


class Int8Weight(AbstractQuantizedWeight):
    """A frozen weight stored as int8 with one float scale per output channel (absmax).

    `w ≈ q * scale[None, :]`, with `scale = max_i |w[i, o]| / 127`.
    """

    q: Int8[Array, "i out"]
    scale: Float[Array, " out"]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape

    def dequantize(self, dtype) -> Float[Array, "*L i o"]:  # stacked in a layer scan
        return self.q.astype(dtype) * self.scale.astype(dtype)[None, :]


# The 16 NormalFloat-4 levels (Dettmers et al. 2023, QLoRA, appendix E; bitsandbytes'
# NF4 table): quantiles of N(0, 1) scaled to [-1, 1], with an exact zero.
NF4_LEVELS = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip


class NF4Weight(AbstractQuantizedWeight):
    """A frozen weight in 4-bit NormalFloat with one absmax scale per block (QLoRA's base).

    The weight, flattened row-major and zero-padded to whole blocks of `block_size`
    entries, is stored as two 4-bit level indices per byte (`codes`, high nibble first)
    and one float32 `absmax` per block: `w ≈ NF4_LEVELS[code] · absmax[block]`. That is
    4 + 32 / `block_size` bits per entry (0.14× float32 at the default 64).
    """

    codes: UInt8[Array, "*L packed"]  # two 4-bit codes per byte: n_padded // 2
    absmax: Float[Array, "*L blocks"]
    in_out: tuple[int, int] = eqx.field(static=True)
    block_size: int = eqx.field(static=True)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.codes.shape[:-1] + self.in_out

    def dequantize(self, dtype) -> Float[Array, "*L i o"]:
        lead = self.codes.shape[:-1]
        hi = (self.codes >> 4).astype(jnp.int32)
        lo = (self.codes & 15).astype(jnp.int32)
        idx = jnp.stack([hi, lo], axis=-1).reshape(lead + (-1, self.block_size))
        levels = jnp.asarray(NF4_LEVELS, jnp.float32)[idx] * self.absmax[..., None]
        n = self.in_out[0] * self.in_out[1]
        return levels.reshape(lead + (-1,))[..., :n].reshape(lead + self.in_out).astype(dtype)


def matmul(
    x: Float[Array, "*N i"],
    w: Float[Array, "_ _"] | AbstractQuantizedWeight,  # [i, o] ([o, i] when transposed)
    *,
    out_dtype=None,
    transposed: bool = False,
) -> Float[Array, "*N o"]:
    """`x @ w` for a dense or quantised weight, in `x`'s dtype (or `out_dtype`, with the
    products accumulated in it, e.g. float32 logits from bfloat16 activations).

    Leading axes are flattened into one, so that with a batch `[B, T, i]` the forward
    and both backward products are plain 2-D matrix products (the weight gradient
    contracts one axis, not two), which is markedly faster on CPU.

    A quantised weight is frozen and never kept dense: the product is a `custom_vjp`
    whose only residual is the packed weight (not `x`, which a frozen weight's gradient
    does not need, nor the dequantised matrix). The forward pass dequantises the weight
    (per layer inside the scanned stack; a weight of more than `FROZEN_TILE` output
    columns that can be cut by columns, such as a `GGUFWeight` head over the vocabulary,
    one tile of columns at a time in a loop), the backward pass dequantises it again
    and returns `dx = dy · Wᵀ` only; the weight's cotangent is zero (`float0` for its
    integer arrays). A differentiated scan over `L` quantised layers thus keeps `L`
    packed weights instead of `L` dense ones. A format may compute the forward product of
    few rows from its packed form (`AbstractQuantizedWeight.product`; `GGUFWeight` does
    for a decode step's rows).

    `transposed=True` takes a dense `w [o, i]` stored by output row (a tied LM head's
    embedding table) and computes `x @ wᵀ` without a transposed copy; a decode step's
    few rows of float32 multiply a large table in the native CPU kernel where it is built
    (`dense_product`: each row of the table read once for every row of `x`), with the
    values of `x @ wᵀ` up to float32 summation order.
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if transposed:
        if isinstance(w, AbstractQuantizedWeight):
            raise ValueError("matmul: transposed=True takes a dense weight [o, i]")
        if dense_routed(x2, w, out_dtype):
            y = dense_product(x2, w, max_rows=NATIVE_MAX_ROWS)
            return y.reshape(lead + (y.shape[-1],))
        w = w.T
    if isinstance(w, AbstractQuantizedWeight):
        out_dt = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
        y = _frozen_matmul(x2, w, (jnp.dtype(x.dtype), out_dt))
    elif out_dtype is None:
        y = x2 @ w
    else:
        y = jnp.matmul(x2, w.astype(x.dtype), preferred_element_type=out_dtype)
    return y.reshape(lead + (y.shape[-1],))


# output columns per tile of a frozen product over a weight stored by output column
FROZEN_TILE = 8192


def _tile_width(w: AbstractQuantizedWeight) -> int | None:
    """Columns per tile (tiles of near-equal width), or None to decode the weight whole."""
    out = w.shape[-1]
    if len(w.shape) != 2 or out <= FROZEN_TILE or w.column_slice(jnp.int32(0), 1) is None:
        return None
    return -(-out // -(-out // FROZEN_TILE))


def _tile_starts(i, tile: int, out: int):
    """Tile `i`'s first column (the last tile ends at `out`, overlapping), its own columns."""
    start = jnp.minimum(i * tile, out - tile)
    return start, start + jnp.arange(tile) >= i * tile


def _dot_t(x2, wt, out_dt):
    """`x2 @ wtᵀ` contracting both operands' last axes (no transposed copy of `wt`)."""
    return jax.lax.dot_general(x2, wt, (((1,), (1,)), ((), ())), preferred_element_type=out_dt)


def _frozen_matmul_fwd(x2, w, dtypes):
    return w.product(x2, _dense_product, dtypes), w


def _dense_product(x2, w, dtypes):
    in_dt, out_dt = dtypes
    tile, out = _tile_width(w), w.shape[-1]
    if tile is None:
        return _dot_t(x2, w.dequantize_t(in_dt), out_dt).astype(out_dt)

    def body(i, y):
        start, _ = _tile_starts(i, tile, out)
        yi = _dot_t(x2, w.column_slice(start, tile).dequantize_t(in_dt), out_dt).astype(out_dt)
        return jax.lax.dynamic_update_slice_in_dim(y, yi, start, axis=1)

    return jax.lax.fori_loop(0, -(-out // tile), body, jnp.zeros((x2.shape[0], out), out_dt))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _frozen_matmul(x2, w, dtypes):
    return _frozen_matmul_fwd(x2, w, dtypes)[0]


def _frozen_matmul_bwd(dtypes, w, dy):
    in_dt, _ = dtypes
    dy = dy.astype(in_dt)
    tile, out = _tile_width(w), w.shape[-1]
    if tile is None:
        return jnp.matmul(dy, w.dequantize_t(in_dt), preferred_element_type=in_dt), None

    def body(i, dx):
        start, own = _tile_starts(i, tile, out)
        dyi = jnp.where(own[None, :], jax.lax.dynamic_slice_in_dim(dy, start, tile, axis=1), 0)
        wi = w.column_slice(start, tile).dequantize_t(in_dt)
        return dx + jnp.matmul(dyi, wi, preferred_element_type=in_dt)

    dx = jax.lax.fori_loop(0, -(-out // tile), body, jnp.zeros((dy.shape[0], w.shape[0]), in_dt))
    return dx, None


_frozen_matmul.defvjp(_frozen_matmul_fwd, _frozen_matmul_bwd)


class LoRAAdapter(eqx.Module):
    """Low-rank update `Δ(x) = dropout(x) @ a @ b · (alpha / rank)` (Hu et al. 2021).

    `b` starts at zero, so a fresh adapter leaves the model unchanged.
    """

    a: Float[Array, "i r"]
    b: Float[Array, "r o"]
    scale: float = eqx.field(static=True)
    dropout: float = eqx.field(static=True)

    def __call__(
        self, x: Float[Array, "*N i"], key: PRNGKeyArray | None = None
    ) -> Float[Array, "*N o"]:
        if key is not None and self.dropout > 0.0:
            keep = jax.random.bernoulli(key, 1.0 - self.dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - self.dropout), jnp.zeros_like(x))
        return matmul(matmul(x, self.a.astype(x.dtype)), self.b.astype(x.dtype)) * self.scale


def _lift(x: Array, ndim: int) -> Array:
    """Prepend unit axes to `x` up to `ndim` dimensions (explicit broadcasting)."""
    return x.reshape((1,) * (ndim - x.ndim) + x.shape)


def rms_norm(
    x: Float[Array, "*N D"], weight: Float[Array, " D"], eps: float, *, plus_one: bool = False
) -> Float[Array, "*N D"]:
    """RMSNorm (Zhang & Sennrich 2019) accumulated in float32, returned in `x`'s dtype.

    `x / √(mean(x²) + eps) · w`; with `plus_one` (Gemma) the scale is `1 + w`, applied
    in float32 before the cast back, as Gemma's reference does.

    The backward pass is written out (`n = x·r`, `g = dy·w`: `dx = r·(g − n·mean(g·n))`,
    `dw = Σ dy·n`) and keeps only `x` and the per-row `r = 1/√(mean(x²) + eps)`, where
    autodiff kept the normalised rows as well (less memory, no slower).

    Under `jax.shard_map` (with its default `check_vma=True`) a replicated weight is
    first cast to vary over the device axes `x` varies over (`vary_like`), so that its
    per-device cotangent `dw` has the weight's type; the cast's transpose sums `dw` over
    those axes, as autodiff of the written-out product does.
    """
    return _rms_norm(x, vary_like(x, weight), float(eps), bool(plus_one))


def vary_like(x: Array, y: PyTree) -> PyTree:
    """`y`'s arrays cast to vary over the manual device axes (`jax.shard_map`'s) that `x`
    varies over and they do not; `y` itself outside `shard_map` or with `check_vma=False`.

    A `custom_vjp` whose backward pass computes a replicated input's cotangent from
    varying values (the weight of a norm applied to a shard of the batch) must receive
    that input as varying: the cotangent then matches its type, and the transpose of the
    cast (`psum` over those axes) gives the replicated input the summed cotangent that
    autodiff would give it. Cast before a conditional whose branch differs across
    devices, that `psum` stays out of the branch. Values are unchanged.
    """
    vx = _varying_axes(x)

    def cast(leaf):
        if not isinstance(leaf, jax.Array):
            return leaf
        axes = tuple(sorted(vx - _varying_axes(leaf), key=str))
        if not axes:
            return leaf
        if hasattr(jax.lax, "pcast"):
            return jax.lax.pcast(leaf, axes, to="varying")
        return jax.lax.pvary(leaf, axes)  # JAX before `pcast`

    return jax.tree.map(cast, y) if vx else y


def vary_together(*arrays: Array) -> tuple[Array, ...]:
    """`arrays` each cast to vary over every manual device axis that any of them varies
    over (`vary_like`): the inputs of a `custom_vjp` whose backward pass mixes them (a
    cotangent then has its input's type), and the references for a loop's initial
    carries built from them. Values are unchanged."""
    axes = frozenset().union(*(_varying_axes(a) for a in arrays))
    if not axes:
        return arrays
    ref = max(arrays, key=lambda a: len(_varying_axes(a)))
    if _varying_axes(ref) != axes:  # no one array varies over all of them
        ref = functools.reduce(lambda r, a: vary_like(a, r), arrays, ref)
    return tuple(vary_like(ref, a) for a in arrays)


def _varying_axes(x: Array) -> frozenset:
    """The manual axes `x`'s type varies over (its `vma`; empty outside `shard_map`)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def _rms_scale(x32, eps):
    return jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def _rms_apply(n, x, weight, plus_one):
    if plus_one:
        return (n * _lift(1.0 + weight.astype(jnp.float32), x.ndim)).astype(x.dtype)
    return n.astype(x.dtype) * _lift(weight.astype(x.dtype), x.ndim)


def _rms_norm_fwd(x, weight, eps, plus_one):
    x32 = x.astype(jnp.float32)
    r = _rms_scale(x32, eps)
    return _rms_apply(x32 * r, x, weight, plus_one), (x, weight, r)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _rms_norm(x, weight, eps: float, plus_one: bool):
    return _rms_norm_fwd(x, weight, eps, plus_one)[0]


def _rms_norm_bwd(eps, plus_one, res, dy):
    x, weight, r = res
    n = x.astype(jnp.float32) * r
    dy32 = dy.astype(jnp.float32)
    w32 = _lift(weight.astype(jnp.float32), x.ndim)
    g = dy32 * (1.0 + w32 if plus_one else w32)
    dx = r * (g - n * jnp.mean(g * n, axis=-1, keepdims=True))
    dw = jnp.sum((dy32 * n).reshape(-1, x.shape[-1]), axis=0)
    return dx.astype(x.dtype), dw.astype(weight.dtype)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def activation(x: Float[Array, "*N F"], kind: str) -> Float[Array, "*N F"]:
    """The MLP gate activation: `silu` (SwiGLU), `gelu_tanh` (GeGLU, Gemma) or exact `gelu`."""
    if kind == "silu":
        return jax.nn.silu(x)
    if kind == "gelu_tanh":
        return jax.nn.gelu(x, approximate=True)
    if kind == "gelu":
        return jax.nn.gelu(x, approximate=False)
    raise ValueError(f"unknown MLP activation {kind!r}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gated(gate, up, kind: str):
    return activation(gate, kind) * up


def _gated_fwd(gate, up, kind):
    # the activation and its elementwise derivative in one pass (a JVP with unit tangents)
    act, slope = jax.jvp(lambda g: activation(g, kind), (gate,), (jnp.ones_like(gate),))
    return act * up, (up, act, slope)


def _gated_bwd(kind, res, d_out):
    up, act, slope = res
    return d_out * up * slope, d_out * act


_gated.defvjp(_gated_fwd, _gated_bwd)


def gated_activation(
    gate: Float[Array, "*N F"], up: Float[Array, "*N F"], kind: str
) -> Float[Array, "*N F"]:
    """The gated MLP's inner product `act(gate) · up` (SwiGLU / GeGLU, Shazeer 2020).

    Same values as writing it out, and the same gradients up to float rounding, but the
    backward pass keeps `up`, `act(gate)` and the activation's slope `act'(gate)` and
    needs nothing else: `d gate = d · up · act'(gate)`, `d up = d · act(gate)`.
    Differentiated as written, the product keeps gate, up and the activation's
    intermediates (five `[..., F]` arrays for SiLU) and its backward pass recomputes
    the slope from them: keeping three arrays instead saves memory and time.
    """
    if gate.shape != up.shape:
        raise ValueError(f"gate {gate.shape} and up {up.shape} must have the same shape")
    return _gated(vary_like(up, gate), vary_like(gate, up), kind)


def softcap(x: Array, cap: float | None) -> Array:
    """`cap · tanh(x / cap)` (Gemma 2's logit soft-capping); identity when `cap` is None."""
    if cap is None:
        return x
    return jnp.tanh(x / cap) * cap
