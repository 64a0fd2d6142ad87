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


def matmul(x: Float[Array, "T i"], w: Array | Int8Weight) -> Float[Array, "T o"]:
    """`x @ w` for a dense or int8-quantised weight, in `x`'s dtype."""
    return x @ dense_weight(w, x.dtype)


class LoRAAdapter(eqx.Module):
    """Low-rank update `Δ(x) = dropout(x) @ a @ b · (alpha / rank)` (Hu et al. 2021).

    `b` starts at zero, so a fresh adapter leaves the model unchanged.
    """

    a: Float[Array, "i r"]
    b: Float[Array, "r o"]
    scale: float = eqx.field(static=True)
    dropout: float = eqx.field(static=True)

    def __call__(self, x: Float[Array, "T i"], key: PRNGKeyArray | None = None) -> Float[Array, "T o"]:
        if key is not None and self.dropout > 0.0:
            keep = jax.random.bernoulli(key, 1.0 - self.dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - self.dropout), jnp.zeros_like(x))
        return ((x @ self.a.astype(x.dtype)) @ self.b.astype(x.dtype)) * self.scale


def rms_norm(x: Float[Array, "T D"], weight: Float[Array, " D"], eps: float) -> Float[Array, "T D"]:
    """RMSNorm (Zhang & Sennrich 2019) accumulated in float32, returned in `x`'s dtype."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * weight.astype(x.dtype)[None, :]


def rope_tables(positions: Int[Array, " T"], head_dim: int, theta: float):
    """cos/sin tables `[T, head_dim]` in float32 (rotate-half layout, as in Hugging Face Llama)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: Float[Array, "T N hd"], cos: Float[Array, "T hd"], sin: Float[Array, "T hd"]) -> Float[Array, "T N hd"]:
    """Rotary position embedding (Su et al. 2021), rotate-half convention, float32 inside."""
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[:, None, :] + rotated * sin[:, None, :]
    return out.astype(x.dtype)


def attention(
    q: Float[Array, "T H hd"],
    k: Float[Array, "K S hd"],
    v: Float[Array, "K S hd"],
    allowed: Bool[Array, "T S"],
) -> Float[Array, "T H hd"]:
    """Grouped-query softmax attention; keys/values are head-major (`[K, S, hd]`).

    Scores and softmax are float32. Rows with no allowed key (padding) get finite values.
    """
    T, H, hd = q.shape
    K = k.shape[0]
    qg = q.reshape(T, K, H // K, hd)
    scores = jnp.einsum("tkgd,ksd->kgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / math.sqrt(hd))
    scores = jnp.where(allowed[None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("kgts,ksd->tkgd", probs, v)
    return out.reshape(T, H, hd)
