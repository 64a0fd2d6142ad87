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

`quantize_nf4` stores them instead in 4-bit NormalFloat with blockwise absmax scales,
QLoRA's base (Dettmers et al. 2023): each weight, flattened and cut into blocks of
`block_size` (64) entries, keeps `absmax[b] = max |W| over block b` and per entry the
index of the nearest of the 16 `NF4_LEVELS` to `W / absmax[b]`:

    W ≈ NF4_LEVELS[code] · absmax[b]

4.5 bits per entry at block size 64, 0.14× the float32 memory (QLoRA's double
quantisation of the scales is not applied). The forward pass dequantises in the
activation dtype, as with int8.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PyTree

from ._build import model_config, where_layers
from ._layers import NF4_LEVELS, AbstractQuantizedWeight, Int8Weight, NF4Weight

_FIELDS = ("wqkv", "wo", "w_gate_up", "w_down")


def quantize_weight_int8(w: Float[Array, "i o"]) -> Int8Weight:
    """Per-output-channel absmax int8 quantisation of one `[in, out]` weight:
    `scale[o] = max_i |w[i, o]| / 127`, `q[i, o] = round(w[i, o] / scale[o])`.

    **Arguments:**

    - `w`: the weight, `[in, out]`, any floating dtype.

    **Returns:**

    An `Int8Weight` (`q: int8 [in, out]`, `scale: float32 [out]`). All-zero columns get
    scale 0 and dequantise to exactly zero.
    """
    w32 = w.astype(jnp.float32)
    scale = jnp.max(jnp.abs(w32), axis=0) / 127.0
    safe = jnp.where(scale > 0, scale, jnp.ones_like(scale))
    q = jnp.clip(jnp.round(w32 / safe[None, :]), -127, 127).astype(jnp.int8)
    return Int8Weight(q=q, scale=scale)


_quantize_stacked = jax.jit(jax.vmap(quantize_weight_int8))


def quantize_weight_nf4(w: Float[Array, "i o"], *, block_size: int = 64) -> NF4Weight:
    """Blockwise-absmax NF4 quantisation of one `[in, out]` weight (QLoRA's 4-bit
    NormalFloat, Dettmers et al. 2023; see the module docstring):
    `w ≈ NF4_LEVELS[code] · absmax[block]`.

    **Arguments:**

    - `w`: the weight, `[in, out]`, any floating dtype.
    - `block_size`: entries per absmax block of the flattened weight, a positive even
      int.

    **Returns:**

    An `NF4Weight` (two 4-bit codes per `uint8`, one float32 absmax per block). All-zero
    blocks get absmax 0 and dequantise to exactly zero.

    **Raises:** `ValueError` naming `block_size` when it is not a positive even int.
    """
    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, int)
        or block_size < 2
        or block_size % 2
    ):
        raise ValueError(f"block_size must be a positive even int, got {block_size!r}")
    if w.ndim != 2:
        raise ValueError(f"quantize_weight_nf4 expects an [in, out] weight, got shape {w.shape}")
    n = w.shape[0] * w.shape[1]
    n_blocks = -(-n // block_size)
    flat = jnp.pad(w.astype(jnp.float32).reshape(-1), (0, n_blocks * block_size - n))
    blocks = flat.reshape(n_blocks, block_size)
    absmax = jnp.max(jnp.abs(blocks), axis=-1)
    safe = jnp.where(absmax > 0, absmax, jnp.ones_like(absmax))
    x = blocks / safe[:, None]
    # nearest level: the levels are sorted, so count the midpoints below x
    levels = np.asarray(NF4_LEVELS, np.float32)
    mids = jnp.asarray((levels[1:] + levels[:-1]) / 2)
    idx = jnp.sum(x[..., None] > mids[None, None, :], axis=-1).astype(jnp.uint8).reshape(-1, 2)
    codes = (idx[:, 0] << 4) | idx[:, 1]
    return NF4Weight(
        codes=codes, absmax=absmax, in_out=(w.shape[0], w.shape[1]), block_size=block_size
    )


def _quantize_stacked_nf4(w: Array, block_size: int) -> NF4Weight:
    q = [quantize_weight_nf4(w[i], block_size=block_size) for i in range(w.shape[0])]
    return NF4Weight(
        codes=jnp.stack([x.codes for x in q]),
        absmax=jnp.stack([x.absmax for x in q]),
        in_out=q[0].in_out,
        block_size=block_size,
    )


@eqx.filter_jit
def _dequantize_stacked(w: AbstractQuantizedWeight, dtype) -> Array:
    return jax.vmap(lambda x: x.dequantize(dtype))(w)


def _replace_projections(model: PyTree, quantized: bool, convert) -> PyTree:
    """`model` with `convert(w)` in place of each stacked projection weight `w` that is
    quantised (`quantized=True`) or dense (`False`); the others are kept."""
    where = where_layers(model)
    layers = where(model)
    fields = [
        f for f in _FIELDS if isinstance(getattr(layers, f), AbstractQuantizedWeight) == quantized
    ]
    if not fields:
        return model
    new = [convert(getattr(layers, f)) for f in fields]
    return eqx.tree_at(lambda m: [getattr(where(m), f) for f in fields], model, new)


def quantize_int8(model: PyTree) -> PyTree:
    """Replace the dense projection weights (`wqkv`, `wo`, `w_gate_up`, `w_down`) by `Int8Weight`s.

    Works on a `Policy`, `ValueModel`, `RewardModel` or bare `Transformer` (with or
    without LoRA adapters, which stay float). Already-quantised weights are kept.
    Quantisation is per layer and per output channel (see the module docstring).
    """
    return _replace_projections(model, False, _quantize_stacked)


def quantize_nf4(model: PyTree, *, block_size: int = 64) -> PyTree:
    """Replace the dense projection weights (`wqkv`, `wo`, `w_gate_up`, `w_down`) by `NF4Weight`s.

    QLoRA's 4-bit base (see the module docstring); attach adapters with `apply_lora`
    and train them with `lora_filter`. Works on the same models as `quantize_int8`;
    already-quantised weights (int8 or NF4) are kept.
    """
    return _replace_projections(model, False, lambda w: _quantize_stacked_nf4(w, block_size))


def dequantize(model: PyTree, *, dtype: str | None = None) -> PyTree:
    """Replace every quantised weight (`Int8Weight`, `NF4Weight`, `GGUFWeight`) by its
    dense value: the projections, and a quantised token embedding (`[V, D]` again) or LM
    head.

    `dtype` defaults to the model's parameter dtype (`cfg.dtype`).
    """
    jdt = getattr(jnp, dtype or model_config(model).dtype)
    model = _dequantize_top(model, jdt)
    return _replace_projections(model, True, lambda w: _dequantize_stacked(w, jdt))


def _dequantize_top(model: PyTree, jdt) -> PyTree:
    """The token embedding (and a `Policy`'s LM head) dense, when quantised."""
    get = (lambda m: m) if hasattr(model, "embed") else (lambda m: m.transformer)
    if isinstance(get(model).embed, AbstractQuantizedWeight):
        model = eqx.tree_at(lambda m: get(m).embed, model, get(model).dense_embed(jdt))
    if isinstance(getattr(model, "lm_head", None), AbstractQuantizedWeight):
        model = eqx.tree_at(lambda m: m.lm_head, model, model.lm_head.dequantize(jdt))
    return model
