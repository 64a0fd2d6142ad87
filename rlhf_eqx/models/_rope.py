"""Rotary position embeddings (Su et al. 2021) in the rotate-half layout."""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def rope_tables(
    positions: Int[Array, "*B T"],
    inv_freq: Float[Array, " half"],
    attention_factor: float = 1.0,
) -> tuple[Float[Array, "*B T hd"], Float[Array, "*B T hd"]]:
    """cos/sin tables `[..., T, head_dim]` in float32 (rotate-half layout, as in Hugging Face
    Llama), multiplied by `attention_factor` (YaRN's, `TransformerConfig.rope_attention_factor`:
    transformers scales both tables, so queries and keys, by it; 1 leaves them as is)."""
    freqs = inv_freq.reshape((1,) * positions.ndim + inv_freq.shape)
    angles = positions.astype(jnp.float32)[..., None] * freqs
    angles = jnp.concatenate([angles, angles], axis=-1)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if attention_factor != 1.0:
        factor = jnp.float32(attention_factor)
        cos, sin = cos * factor, sin * factor
    return cos, sin


def apply_rope(
    x: Float[Array, "*B T N hd"], cos: Float[Array, "*B T hd"], sin: Float[Array, "*B T hd"]
) -> Float[Array, "*B T N hd"]:
    """Rotary position embedding (Su et al. 2021), rotate-half convention, float32 inside."""
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[..., None, :] + rotated * sin[..., None, :]
    return out.astype(x.dtype)
