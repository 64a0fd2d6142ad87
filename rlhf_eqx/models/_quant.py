"""Int8 weight-only quantisation of the decoder's projections, for a frozen base under LoRA.

Each projection `W [in, out]` of each layer is stored as int8 `q` with one float32
scale per output channel (symmetric absmax, as LLM.int8()'s vector-wise quantisation,
Dettmers et al. 2022, without the outlier decomposition):

    scale[o] = max_i |W[i, o]| / 127,    q[i, o] = round(W[i, o] / scale[o]) ∈ [-127, 127]

and the forward pass multiplies by the dequantised `q · scale` in the activation dtype.
The round-off per entry is at most `scale[o] / 2`. Quantised are `wqkv`, `wo`,
`w_gate_up` and `w_down`; embeddings, norms, biases and heads stay in floating point.
Int8 arrays are not differentiable, so `eqx.filter_grad` / `lora_filter` leave them
frozen: with adapters attached (`apply_lora`) only the adapters train (QLoRA-style,
Dettmers et al. 2023, with int8 instead of NF4).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PyTree

from ._layers import Int8Weight
from ._build import model_config, where_layers

__all__ = ["quantize_int8", "dequantize", "quantize_weight"]

_FIELDS = ("wqkv", "wo", "w_gate_up", "w_down")


def quantize_weight(w: Float[Array, "i o"]) -> Int8Weight:
    """Per-output-channel absmax int8 quantisation of one `[in, out]` weight.

    All-zero columns get scale 0 and dequantise to exactly zero.
    """
    w32 = w.astype(jnp.float32)
    scale = jnp.max(jnp.abs(w32), axis=0) / 127.0
    safe = jnp.where(scale > 0, scale, jnp.ones_like(scale))
    q = jnp.clip(jnp.round(w32 / safe[None, :]), -127, 127).astype(jnp.int8)
    return Int8Weight(q=q, scale=scale)


_quantize_stacked = jax.jit(jax.vmap(quantize_weight))


@eqx.filter_jit
def _dequantize_stacked(w: Int8Weight, dtype) -> Array:
    return jax.vmap(lambda x: x.dequantize(dtype))(w)


def quantize_int8(model: PyTree) -> PyTree:
    """Replace the dense projection weights (`wqkv`, `wo`, `w_gate_up`, `w_down`) by `Int8Weight`s.

    Works on a `Policy`, `ValueModel`, `RewardModel` or bare `Transformer` (with or
    without LoRA adapters, which stay float). Already-quantised weights are kept.
    Quantisation is per layer and per output channel (see the module docstring).
    """
    where = where_layers(model)
    layers = where(model)
    fields = [f for f in _FIELDS if not isinstance(getattr(layers, f), Int8Weight)]
    if not fields:
        return model
    quantized = [_quantize_stacked(getattr(layers, f)) for f in fields]
    return eqx.tree_at(lambda m: [getattr(where(m), f) for f in fields], model, quantized)


def dequantize(model: PyTree, *, dtype: str | None = None) -> PyTree:
    """Replace every `Int8Weight` projection by its dense value `q · scale`.

    `dtype` defaults to the model's parameter dtype (`cfg.dtype`).
    """
    where = where_layers(model)
    layers = where(model)
    jdt = getattr(jnp, dtype or model_config(model).dtype)
    fields = [f for f in _FIELDS if isinstance(getattr(layers, f), Int8Weight)]
    if not fields:
        return model
    dense = [_dequantize_stacked(getattr(layers, f), jdt) for f in fields]
    return eqx.tree_at(lambda m: [getattr(where(m), f) for f in fields], model, dense)
