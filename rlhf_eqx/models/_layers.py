"""Building blocks: weights that may be quantised, LoRA adapters, RMSNorm, rotary embeddings, attention."""

import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

__all__ = ["normal_init", "Int8Weight", "LoRAAdapter", "matmul", "dense_weight", "rms_norm", "apply_rope", "attention"]


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


class Int8Weight(eqx.Module):
    """A frozen weight stored as int8 with one float scale per output channel (absmax).

    `w ≈ q * scale[None, :]`, with `scale = max_i |w[i, o]| / 127`.
    """

    q: Array  # int8 [in, out]
    scale: Float[Array, " out"]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape

    def dequantize(self, dtype) -> Array:
        return self.q.astype(dtype) * self.scale.astype(dtype)[None, :]


def dense_weight(w: Array | Int8Weight, dtype) -> Array:
    """The weight as a dense array of `dtype` (dequantising an `Int8Weight`)."""
    if isinstance(w, Int8Weight):
        return w.dequantize(dtype)
    return w


def matmul(x: Float[Array, "*N i"], w: Array | Int8Weight) -> Float[Array, "*N o"]:
    """`x @ w` for a dense or int8-quantised weight, in `x`'s dtype.

    Leading axes are flattened into one, so that with a batch `[B, T, i]` the forward
    and both backward products are plain 2-D matrix products (the weight gradient
    contracts one axis, not two), which is markedly faster on CPU.
    """
    wd = dense_weight(w, x.dtype)
    lead = x.shape[:-1]
    return (x.reshape(-1, x.shape[-1]) @ wd).reshape(lead + (wd.shape[-1],))


class LoRAAdapter(eqx.Module):
    """Low-rank update `Δ(x) = dropout(x) @ a @ b · (alpha / rank)` (Hu et al. 2021).

    `b` starts at zero, so a fresh adapter leaves the model unchanged.
    """

    a: Float[Array, "i r"]
    b: Float[Array, "r o"]
    scale: float = eqx.field(static=True)
    dropout: float = eqx.field(static=True)

    def __call__(self, x: Float[Array, "*N i"], key: PRNGKeyArray | None = None) -> Float[Array, "*N o"]:
        if key is not None and self.dropout > 0.0:
            keep = jax.random.bernoulli(key, 1.0 - self.dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - self.dropout), jnp.zeros_like(x))
        return matmul(matmul(x, self.a.astype(x.dtype)), self.b.astype(x.dtype)) * self.scale


def _lift(x: Array, ndim: int) -> Array:
    """Prepend unit axes to `x` up to `ndim` dimensions (explicit broadcasting)."""
    return x.reshape((1,) * (ndim - x.ndim) + x.shape)


def rms_norm(x: Float[Array, "*N D"], weight: Float[Array, " D"], eps: float) -> Float[Array, "*N D"]:
    """RMSNorm (Zhang & Sennrich 2019) accumulated in float32, returned in `x`'s dtype."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * _lift(weight.astype(x.dtype), x.ndim)


def rope_tables(
    positions: Int[Array, "*B T"], head_dim: int, theta: float
) -> tuple[Float[Array, "*B T hd"], Float[Array, "*B T hd"]]:
    """cos/sin tables `[..., T, head_dim]` in float32 (rotate-half layout, as in Hugging Face Llama)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions.astype(jnp.float32)[..., None] * _lift(inv_freq, positions.ndim + 1)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(
    x: Float[Array, "*B T N hd"], cos: Float[Array, "*B T hd"], sin: Float[Array, "*B T hd"]
) -> Float[Array, "*B T N hd"]:
    """Rotary position embedding (Su et al. 2021), rotate-half convention, float32 inside."""
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[..., None, :] + rotated * sin[..., None, :]
    return out.astype(x.dtype)


def attention(
    q: Float[Array, "*B T H hd"],
    k: Float[Array, "*B K S hd"],
    v: Float[Array, "*B K S hd"],
    allowed: Bool[Array, "*B T S"],
) -> Float[Array, "*B T H hd"]:
    """Grouped-query softmax attention; keys/values are head-major (`[..., K, S, hd]`).

    Scores and softmax are float32. Rows with no allowed key (padding) get finite values.
    """
    *lead, T, H, hd = q.shape
    lead = tuple(lead)
    n = len(lead)
    K, S = k.shape[-3], k.shape[-2]
    G = H // K
    # [..., T, K, G, hd] -> [..., K, G·T, hd]: both products become plain batched matrix
    # products over the kv heads (no transposes inside them, forward or backward).
    qg = jnp.moveaxis(q.reshape(lead + (T, K, G, hd)), n, n + 2).reshape(lead + (K, G * T, hd))
    scores = jnp.einsum("...qd,...sd->...qs", qg, k, preferred_element_type=jnp.float32)
    scores = scores.reshape(lead + (K, G, T, S)) * (1.0 / math.sqrt(hd))
    scores = jnp.where(allowed[..., None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(lead + (K, G * T, S))
    out = jnp.einsum("...qs,...sd->...qd", probs, v).reshape(lead + (K, G, T, hd))
    return jnp.moveaxis(out, n + 2, n).reshape(lead + (T, H, hd))
