"""LoRA: low-rank adapters on the decoder's projections (Hu et al. 2021, arXiv:2106.09685).

A targeted projection `W` (stored `[in, out]`) computes `x @ W + dropout(x) @ A @ B ·
(alpha / rank)`, with `A [in, r]` and `B [r, out]`. `B` starts at zero, so attaching
adapters does not change the model; only `A` and `B` are trained. As in Hugging Face
PEFT (`LoraLayer.reset_lora_parameters`), `A` is kaiming-uniform with `a = √5`, i.e.
uniform on `±1/√in`.

Adapters live in `transformer.layers.lora` (a dict keyed by projection name, arrays
stacked over layers: `a [L, in, r]`, `b [L, r, out]`), so they are scanned with the
rest of the layer. Freezing is a filter spec, not a flag:

```python
model = apply_lora(policy, LoRAConfig(rank=8), key=key)
trainable, frozen = eqx.partition(model, lora_filter(model))
opt_state = optimiser.init(eqx.filter(trainable, eqx.is_array))   # adapters only
reference = without_lora(model)   # the base model, sharing the same base arrays
```

Inside the differentiated function recombine with `eqx.combine(trainable, frozen)`.
Dropout on the adapter input is active only when the model is called with a `key`.
The frozen base may be int8 (`quantize_int8`, QLoRA-style: Dettmers et al. 2023).

Adapters whose layers differ in rank or scale (PEFT's `rank_pattern` / `alpha_pattern`,
and rank-stabilised LoRA's `alpha / √r`, Kalajdzievski 2023, arXiv:2312.03732), as
`load_lora_adapter` reads them, are `LayerwiseLoRAAdapter`s: the same stacked arrays,
zero-padded to the largest rank, with a frozen per-layer `scale`.

DoRA (Liu et al. 2024, arXiv:2402.09353; PEFT's `use_dora`) splits each adapted weight
into a trainable magnitude and a direction: `LoRAConfig(use_dora=True)` attaches
`DoRAAdapter`s (see there), which PEFT's adapter files read and write
(`lora_magnitude_vector`).
"""

import dataclasses
import functools
import math
import numbers
from collections.abc import Collection
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from ._build import model_config, where_layers
from ._config import TransformerConfig
from ._decoder_layer import LORA_TARGETS, DecoderLayer
from ._layers import AbstractQuantizedWeight, LoRAAdapter, matmul


class LayerwiseLoRAAdapter(eqx.Module):
    """A stack of LoRA adapters whose layers differ in rank or scale.

    Layer `l` computes `Δ(x) = dropout(x) @ a[l] @ b[l] · scale[l]` (Hu et al. 2021), with
    `a [L, in, r]`, `b [L, r, out]` and `r = max(ranks)`: a layer of rank `ranks[l] < r`
    holds zeros in `a[l][:, ranks[l]:]` and `b[l][ranks[l]:]`. Those add nothing, and
    their gradients are zero (`∂/∂a[l][:, k] = x ⊗ (dy·b[l][k])`, `∂/∂b[l][k] = (x·a[l][:,
    k]) ⊗ dy`, both zero while the other factor's `k` is), so training keeps them zero.

    A layer of rank 0 has no adapter (all zeros; scale 0).

    `scale [L]` (float32) is `alpha_l / ranks[l]`, or with `rslora` `alpha_l / √ranks[l]`
    (rank-stabilised LoRA, Kalajdzievski 2023). It is an array so that the scanned layer
    stack slices it with the layer, and frozen: `lora_filter` leaves it out and no
    gradient flows into it.
    """

    a: Float[Array, "*L i r"]
    b: Float[Array, "*L r o"]
    scale: Float[Array, "*L"]
    ranks: tuple[int, ...] = eqx.field(static=True)
    dropout: float = eqx.field(static=True)
    rslora: bool = eqx.field(static=True, default=False)

    def __call__(
        self, x: Float[Array, "*N i"], key: PRNGKeyArray | None = None
    ) -> Float[Array, "*N o"]:
        unscaled = LoRAAdapter(a=self.a, b=self.b, scale=1.0, dropout=self.dropout)(x, key)
        return unscaled * jax.lax.stop_gradient(self.scale).astype(x.dtype)


def _dense_columns(weight, lo: int, hi: int) -> Float[Array, "*L i o"]:
    """Output columns `[lo, hi)` of a base weight as float32 (a quantised one dequantised)."""
    if isinstance(weight, AbstractQuantizedWeight):
        return weight.dequantize(jnp.float32)[..., lo:hi]
    return weight[..., lo:hi].astype(jnp.float32)


def _dora_norm(dense, a, b, scale) -> Float[Array, "*L o"]:
    """`‖W + s·A B‖` over the input axis for each output column (float32), per layer:
    PEFT's `get_weight_norm` (its rows `[out, in]` are these columns `[in, out]`).

    Kept apart from the surrounding computation (`optimization_barrier`), so that XLA
    compiles it alike wherever it is called: the magnitudes `apply_lora` computes equal
    the norm of the forward pass bit for bit, and a fresh adapter (`B = 0`) adds exactly
    zero."""
    dense, a, b, scale = jax.lax.optimization_barrier((dense, a, b, scale))
    delta = jnp.einsum("...ir,...ro->...io", a.astype(jnp.float32), b.astype(jnp.float32))
    s = jnp.asarray(scale, jnp.float32)[..., None, None]
    return jax.lax.optimization_barrier(jnp.sqrt(jnp.sum(jnp.square(dense + s * delta), axis=-2)))


class DoRAAdapter(eqx.Module):
    """A stack of DoRA adapters (Liu et al. 2024, "DoRA: Weight-Decomposed Low-Rank
    Adaptation", arXiv:2402.09353), as Hugging Face PEFT computes them (`use_dora`).

    The adapted projection `W [in, o]` (output columns `[lo, hi)` of the base weight)
    becomes `W' = m / ‖W + s·A B‖ ⊙ (W + s·A B)`, the norm taken over the input axis for
    each output column and `m [o]` a trainable magnitude, initialised to `‖W‖` so that a
    fresh adapter (`B = 0`) leaves the model's outputs as they were. As PEFT does (and the
    paper's section 4.3 advises), the norm is a constant of the backward pass
    (`stop_gradient`): gradients reach `m`, `A` and `B` through `g = m / ‖W + s·A B‖` and
    the low-rank product only. The layer's output becomes that of `W'`:

    `y = x W + Δ(x)`, `Δ(x) = (g - 1) ⊙ (x̃ W) + g ⊙ (x̃ A B · s)`

    with `x̃ = dropout(x)` (PEFT's form: with dropout active the base product is taken
    again on the dropped input; without, `x W` is the layer's own product), the bias, if
    any, left unscaled. `s` is `alpha / r` (`alpha / √r` with rsLoRA).

    Fields: `a [L, in, r]`, `b [L, r, o]` and `magnitude [L, o]` (float32, trained);
    `scale [L]` (frozen; 0 marks a layer without an adapter, which then adds nothing);
    `ranks`, `dropout`, `rslora` (static). The adapter holds no base weight: the decoder
    layer passes its own at call time (`weight`, the columns `(lo, hi)` of it that are
    this projection, and `base`, `x W` of those columns without the bias), so the base
    stays one array of the model (one leaf to save, quantise, shard and count). The
    weight is dequantised per layer for the norm (an int8, NF4 or GGUF base works as
    PEFT's DoRA on a quantised base does). Every call computes the norm again, so each
    decode step of a sampler pays for it (on a packed GGUF base many times what a LoRA
    adapter costs; about twice on a float32 base): to sample many tokens, fold the
    adapters first (`merge_lora`, after `dequantize` for a quantised base).
    """

    a: Float[Array, "*L i r"]
    b: Float[Array, "*L r o"]
    magnitude: Float[Array, "*L o"]
    scale: Float[Array, "*L"]
    ranks: tuple[int, ...] = eqx.field(static=True)
    dropout: float = eqx.field(static=True)
    rslora: bool = eqx.field(static=True, default=False)
    reads_base: ClassVar[bool] = True  # the decoder layer passes weight, columns and base

    def __call__(
        self,
        x: Float[Array, "*N i"],
        key: PRNGKeyArray | None = None,
        *,
        weight: PyTree,
        columns: tuple[int, int],
        base: Float[Array, "*N o"] | None = None,
    ) -> Float[Array, "*N o"]:
        """`Δ(x)` of one layer: `weight` is that layer's base weight (dense or quantised),
        `columns` the output columns `(lo, hi)` of it that are this projection, `base`
        the bias-free `x · weight[:, lo:hi]` the layer computed (taken again from `x`
        when `None`, and from the dropped input when dropout is active)."""
        lo, hi = columns
        weight = jax.lax.stop_gradient(weight)
        dropped = key is not None and self.dropout > 0.0
        if dropped:
            keep = jax.random.bernoulli(key, 1.0 - self.dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - self.dropout), jnp.zeros_like(x))
        if dropped or base is None:
            base = _base_product(x, weight, lo, hi)
        scale = jax.lax.stop_gradient(self.scale).astype(jnp.float32)
        norm = jax.lax.stop_gradient(
            _dora_norm(_dense_columns(weight, lo, hi), self.a, self.b, scale)
        )
        g = self.magnitude.astype(jnp.float32) / norm
        low_rank = matmul(matmul(x, self.a.astype(x.dtype)), self.b.astype(x.dtype))
        low_rank = low_rank * scale.astype(x.dtype)
        g = g.reshape((1,) * (base.ndim - 1) + g.shape)
        # `g - 1` in float32: in bfloat16 a magnitude within 0.4% of the norm would round to 0
        delta = (g - 1).astype(x.dtype) * base.astype(x.dtype) + g.astype(x.dtype) * low_rank
        return jnp.where(scale != 0, delta, jnp.zeros_like(delta))


def _base_product(x, weight, lo: int, hi: int):
    """`x · weight[:, lo:hi]` (the frozen base's columns; a quantised weight stays packed)."""
    if isinstance(weight, AbstractQuantizedWeight):
        return matmul(x, weight)[..., lo:hi]
    # recomputed in the backward pass: no copy of the columns is kept
    product = lambda x, w: matmul(x, w[..., lo:hi].astype(x.dtype))
    return jax.checkpoint(product)(x, weight)


def layer_ranks_and_scales(adapter: PyTree, n_layers: int) -> tuple[list[int], list[float]]:
    """Each layer's rank and scale of a stacked `LoRAAdapter`, `LayerwiseLoRAAdapter` or
    `DoRAAdapter`."""
    if isinstance(adapter, (LayerwiseLoRAAdapter, DoRAAdapter)):
        scales = np.asarray(adapter.scale, np.float32).reshape(-1)
        return list(adapter.ranks), [float(s) for s in scales]
    return [int(adapter.a.shape[-1])] * n_layers, [adapter.scale] * n_layers


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Hyperparameters of LoRA adapters.

    **Arguments:**

    - `rank`: inner dimension `r` of each adapter (any integer type, numpy's included;
      stored as an `int`).
    - `alpha`: the update is scaled by `alpha / rank` (`scale`); positive and finite
      (numpy scalars are stored as Python numbers).
    - `dropout`: dropout probability on the adapter's input (training calls with a
      `key` only), in `[0, 1)`.
    - `targets`: projections to adapt, a subset of `("q", "k", "v", "o", "gate",
      "up", "down")` (a sequence of names, kept in its order, which is the order the
      adapters' keys are drawn in; a set, whose order would change from one interpreter
      to the next, is put in that order; stored as a tuple).
    - `use_rslora`: scale by `alpha / √rank` instead (rank-stabilised LoRA, Kalajdzievski
      2023: the update's size no longer shrinks as the rank grows). The adapters are
      then `LayerwiseLoRAAdapter`s, which `save_lora_adapter` writes with PEFT's
      `use_rslora`.
    - `use_dora`: weight-decomposed adapters (DoRA, Liu et al. 2024; PEFT's
      `use_dora`): each adapted projection also trains a magnitude per output feature,
      initialised to the base weight's column norm (`DoRAAdapter`). The base may be
      dense or quantised.
    """

    rank: int | numbers.Integral = 16
    alpha: float | numbers.Real = 32.0
    dropout: float | numbers.Real = 0.05
    targets: Collection[str] = ("q", "v")
    use_rslora: bool = False
    use_dora: bool = False

    def __post_init__(self):
        if not isinstance(self.use_dora, bool):
            raise ValueError(f"LoRAConfig.use_dora must be True or False, got {self.use_dora!r}")
        targets = self.targets
        if targets is None:
            raise ValueError(f"LoRAConfig.targets is None; choose from {list(LORA_TARGETS)}")
        if isinstance(targets, str):
            targets = (targets,)
        elif isinstance(targets, (set, frozenset)):
            rank = {t: i for i, t in enumerate(LORA_TARGETS)}
            targets = sorted(targets, key=lambda t: (rank.get(t, len(rank)), str(t)))
        object.__setattr__(self, "targets", tuple(targets))
        rank = self.rank
        if not isinstance(rank, numbers.Integral) or isinstance(rank, bool) or rank <= 0:
            raise ValueError(f"LoRAConfig.rank must be a positive int, got {rank!r}")
        object.__setattr__(self, "rank", int(rank))
        alpha = self.alpha
        if (
            isinstance(alpha, bool)
            or not isinstance(alpha, numbers.Real)
            or not 0 < alpha < math.inf
        ):
            raise ValueError(
                f"LoRAConfig.alpha must be a positive finite number, got {alpha!r} (the "
                "update's scale is alpha / rank; PEFT's lora_alpha must be positive too)"
            )
        if not isinstance(alpha, (int, float)):  # a numpy scalar
            object.__setattr__(
                self, "alpha", int(alpha) if isinstance(alpha, numbers.Integral) else float(alpha)
            )
        dropout = self.dropout
        if (
            isinstance(dropout, bool)
            or not isinstance(dropout, numbers.Real)
            or not 0 <= dropout < 1
        ):
            raise ValueError(f"LoRAConfig.dropout must be a number in [0, 1), got {dropout!r}")
        object.__setattr__(self, "dropout", float(dropout))
        if not self.targets:
            raise ValueError(f"LoRAConfig.targets is empty; choose from {list(LORA_TARGETS)}")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown:
            raise ValueError(
                f"LoRAConfig.targets has unknown projection(s) {unknown}; "
                f"allowed: {list(LORA_TARGETS)}{_peft_names_hint(unknown)}"
            )
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"LoRAConfig.targets has duplicates: {list(self.targets)}")

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def _peft_names_hint(unknown: list) -> str:
    """The rlhf_eqx names of PEFT's `target_modules` names (`"q_proj"`, `"all-linear"`)
    among `unknown`, as a hint."""
    names = {f"{t}_proj": t for t in LORA_TARGETS}
    if any(str(t).lower() == "all-linear" for t in unknown):
        return f" (PEFT's all-linear is targets={LORA_TARGETS!r})"
    mapped = [names[t] for t in unknown if t in names]
    if not mapped:
        return ""
    return f" (PEFT's module names; here {', '.join(repr(t) for t in mapped)})"


def lora_shapes(cfg: TransformerConfig) -> dict[str, tuple[int, int]]:
    """`(in, out)` of each adaptable projection."""
    D, Q, KV, F = cfg.d_model, cfg.q_size, cfg.kv_size, cfg.d_ff
    return {
        "q": (D, Q),
        "k": (D, KV),
        "v": (D, KV),
        "o": (Q, D),
        "gate": (D, F),
        "up": (D, F),
        "down": (F, D),
    }


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _init_adapters(key, n_layers: int, shapes: tuple[tuple[int, int], ...], rank: int):
    """Per target: `a [L, in, r]` uniform on `±1/√in` (PEFT's kaiming-uniform with
    `a = √5`) and `b [L, r, out]` zero. One compiled call for all targets."""
    out = []
    for k, (fan_in, fan_out) in zip(jax.random.split(key, len(shapes)), shapes):
        bound = 1.0 / math.sqrt(fan_in)
        a = jax.random.uniform(k, (n_layers, fan_in, rank), jnp.float32, -bound, bound)
        out.append((a, jnp.zeros((n_layers, rank, fan_out), jnp.float32)))
    return tuple(out)


def apply_lora(model: PyTree, config: LoRAConfig, *, key: PRNGKeyArray) -> PyTree:
    """Attach fresh LoRA adapters to every layer of `model`'s decoder.

    **Arguments:**

    - `model`: a `Policy`, `ValueModel`, `RewardModel` or bare `Transformer` without
      adapters (dense or int8 base).
    - `config`: a `LoRAConfig`.
    - `key`: initialises the `A` matrices.

    **Returns:** the same model with `layers.lora = {target: LoRAAdapter}`, `a [L, in,
    r]` uniform on `±1/√in` and `b [L, r, out]` zero (float32), so its outputs are
    unchanged. The base arrays are shared with the input model, not copied. With
    `config.use_dora` the adapters are `DoRAAdapter`s whose magnitudes are the base
    weight's column norms (dequantised for an int8 / NF4 / GGUF base), so the outputs are
    unchanged too. DoRA adapters hold no base weight (the layer passes its own at call
    time): quantising the base afterwards keeps one copy of it, and the magnitudes then
    stay those of the weight they were taken from, as when PEFT loads a DoRA adapter onto
    a quantised base.
    """
    where = where_layers(model)
    if where(model).lora is not None:
        raise ValueError("the model already has LoRA adapters; merge_lora or without_lora it first")
    cfg = model_config(model)
    shapes = lora_shapes(cfg)
    arrays = _init_adapters(
        key, cfg.n_layers, tuple(shapes[t] for t in config.targets), config.rank
    )
    if config.use_dora:
        layers = where(model)
        adapters = {}
        for name, (a, b) in zip(config.targets, arrays):
            weight, columns = base_columns(layers, name, cfg)
            scale = jnp.full((cfg.n_layers,), config.scale, jnp.float32)
            adapters[name] = DoRAAdapter(
                a=a,
                b=b,
                magnitude=dora_magnitude(weight, columns, a, b, scale),
                scale=scale,
                ranks=(config.rank,) * cfg.n_layers,
                dropout=config.dropout,
                rslora=config.use_rslora,
            )
    elif config.use_rslora:
        make = lambda a, b: LayerwiseLoRAAdapter(
            a=a,
            b=b,
            scale=jnp.full((cfg.n_layers,), config.scale, jnp.float32),
            ranks=(config.rank,) * cfg.n_layers,
            dropout=config.dropout,
            rslora=True,
        )
        adapters = {name: make(a, b) for name, (a, b) in zip(config.targets, arrays)}
    else:
        make = lambda a, b: LoRAAdapter(a=a, b=b, scale=config.scale, dropout=config.dropout)
        adapters = {name: jax.vmap(make)(a, b) for name, (a, b) in zip(config.targets, arrays)}
    return eqx.tree_at(lambda m: where(m).lora, model, adapters, is_leaf=lambda x: x is None)


def lora_filter(model: PyTree, *, head: bool | None = None) -> PyTree:
    """Filter spec for `eqx.partition`: `True` on the adapter arrays (DoRA's magnitudes
    included) and, on a
    `RewardModel` or `ValueModel`, on its scalar read-out (`head`, `bias`).

    A reward or value model trained with LoRA trains its scalar head beside the
    adapters, as PEFT's sequence classifiers do (`task_type="SEQ_CLS"` puts the `score`
    head in `modules_to_save`, and TRL's `RewardTrainer` with a `peft_config` trains it):
    a fresh head (`RewardModel.from_policy`) would otherwise stay at its random
    initialisation, and `save_lora_adapter` writes the head as trained.

    **Arguments:**

    - `model`: a model with adapters (`apply_lora`, `load_lora_adapter`).
    - `head`: whether the scalar read-out trains; `None` (default): yes for a model that
      has one, `False`: adapters only (e.g. adapters on a reward model whose head is
      already trained, the members of a LoRA ensemble). `True` on a model without a
      scalar read-out is an error.

    Raises `ValueError` when the model has no adapters.
    """
    where = where_layers(model)
    lora = where(model).lora
    if lora is None:
        raise ValueError("the model has no LoRA adapters; call apply_lora first")
    scalar = hasattr(model, "head") and hasattr(model, "bias")
    if head and not scalar:
        raise ValueError(
            f"lora_filter(head=True): a {type(model).__name__} has no scalar read-out "
            "(`head`, `bias`: RewardModel and ValueModel have one)"
        )
    spec = jax.tree_util.tree_map(lambda _: False, model)
    adapters = {}
    for name, adapter in lora.items():
        adapters[name] = jax.tree_util.tree_map(eqx.is_array, adapter)
        if isinstance(adapter, (LayerwiseLoRAAdapter, DoRAAdapter)):  # frozen per-layer scale
            adapters[name] = eqx.tree_at(lambda ad: ad.scale, adapters[name], False)
    spec = eqx.tree_at(lambda m: where(m).lora, spec, adapters)
    if scalar and head is not False:
        spec = eqx.tree_at(lambda m: (m.head, m.bias), spec, (True, True))
    return spec


def without_lora(model: PyTree) -> PyTree:
    """The model with its adapters removed (`lora = None`): the frozen base.

    No array is copied: the result's base weights are the very same array objects as
    `model`'s, so using it as the reference model of DPO / PPO costs no memory.
    """
    where = where_layers(model)
    if where(model).lora is None:
        return model
    return eqx.tree_at(lambda m: where(m).lora, model, None)


_COLUMNS = {
    "q": "wqkv",
    "k": "wqkv",
    "v": "wqkv",
    "o": "wo",
    "gate": "w_gate_up",
    "up": "w_gate_up",
    "down": "w_down",
}


def _column_range(name: str, cfg: TransformerConfig) -> tuple[int, int]:
    Q, KV, F = cfg.q_size, cfg.kv_size, cfg.d_ff
    return {
        "q": (0, Q),
        "k": (Q, Q + KV),
        "v": (Q + KV, Q + 2 * KV),
        "gate": (0, F),
        "up": (F, 2 * F),
    }.get(name, (0, -1))


def base_columns(layers: DecoderLayer, name: str, cfg: TransformerConfig) -> tuple[PyTree, tuple]:
    """`(weight, (lo, hi))`: the stacked base weight of projection `name` (the fused
    `wqkv` / `w_gate_up` for q, k, v / gate, up) and the output columns that are it."""
    field = _COLUMNS[name]
    weight = getattr(layers, field)
    lo, hi = _column_range(name, cfg)
    return weight, (lo, weight.shape[-1] if hi < 0 else hi)


def dora_magnitude(weight, columns: tuple[int, int], a, b, scale) -> Float[Array, "L o"]:
    """`‖W + s·A B‖` of each layer's output columns (float32, `[L, o]`): DoRA's initial
    magnitude (`B = 0`: the base weight's column norms), one layer at a time."""
    lo, hi = columns
    return jax.lax.map(
        lambda args: _dora_norm(_dense_columns(args[0], lo, hi), *args[1:]),
        (weight, a, b, jnp.asarray(scale, jnp.float32)),
    )


@functools.partial(jax.jit, static_argnums=(5, 6))
def _fold_dora(w, a, b, magnitude, scale, lo: int, hi: int):
    """`w[..., lo:hi] = m / ‖W + s·A B‖ · (W + s·A B)` per layer where `scale ≠ 0`
    (PEFT's DoRA merge), in float32, cast back to `w.dtype`."""
    dense = w[..., lo:hi].astype(jnp.float32)
    delta = jnp.einsum("lir,lro->lio", a.astype(jnp.float32), b.astype(jnp.float32))
    updated = dense + jnp.asarray(scale, jnp.float32)[:, None, None] * delta
    g = magnitude.astype(jnp.float32) / _dora_norm(dense, a, b, scale)  # the forward's norm
    folded = jnp.where((scale != 0)[:, None, None], g[:, None, :] * updated, dense)
    return w.at[..., lo:hi].set(folded.astype(w.dtype))


@functools.partial(jax.jit, static_argnums=(4, 5))
def _add_low_rank(w, a, b, scale, lo: int, hi: int):
    """`w[..., lo:hi] += a @ b · scale` per layer (`scale` one value or `[L]`), in
    float32, cast back to `w.dtype`."""
    delta = jnp.einsum("lir,lro->lio", a.astype(jnp.float32), b.astype(jnp.float32))
    delta = delta * jnp.asarray(scale, jnp.float32).reshape(-1, 1, 1)
    updated = w[..., lo:hi].astype(jnp.float32) + delta
    return w.at[..., lo:hi].set(updated.astype(w.dtype))


def merge_lora(model: PyTree) -> PyTree:
    """Fold the adapters into the base weights: `W[:, cols] += A @ B · (alpha / rank)`
    (per layer `A[l] @ B[l] · scale[l]` for a `LayerwiseLoRAAdapter`; for a `DoRAAdapter`
    `W[:, cols] = m / ‖W + s·A B‖ · (W + s·A B)`, the norm over the input axis of each
    column, as PEFT merges DoRA).

    q/k/v update their column ranges of the fused `wqkv`, gate/up those of
    `w_gate_up`. The sum is computed in float32 and cast back to the base dtype.
    Returns the model with `lora = None`; a model without adapters is returned as is.
    Raises `TypeError` for an int8 base (`dequantize` it first; re-quantising would
    lose the update's precision).
    """
    where = where_layers(model)
    layers: DecoderLayer = where(model)
    if layers.lora is None:
        return model
    cfg = model_config(model)
    new = {f: getattr(layers, f) for f in set(_COLUMNS.values())}
    for name, adapter in layers.lora.items():
        field = _COLUMNS[name]
        w = new[field]
        if isinstance(w, AbstractQuantizedWeight):
            raise TypeError(
                f"merge_lora: the base `{field}` is quantised ({type(w).__name__}); "
                "merging into a quantised base is not supported — call dequantize(model) first"
            )
        lo, hi = _column_range(name, cfg)
        hi = w.shape[-1] if hi < 0 else hi
        if isinstance(adapter, DoRAAdapter):
            new[field] = _fold_dora(
                w, adapter.a, adapter.b, adapter.magnitude, adapter.scale, lo, hi
            )
        else:
            new[field] = _add_low_rank(w, adapter.a, adapter.b, adapter.scale, lo, hi)
    fields = sorted(new)
    model = eqx.tree_at(
        lambda m: [getattr(where(m), f) for f in fields], model, [new[f] for f in fields]
    )
    return without_lora(model)


def count_params(model: PyTree, filter_spec: PyTree | None = None) -> int:
    """Number of array elements in `model`, or in its part selected by `filter_spec`.

    `count_params(model, lora_filter(model))` counts the trainable adapter parameters.
    Int8 weights count their int8 entries and their scales. A `LayerwiseLoRAAdapter`
    counts each layer's own rank, `ranks[l] · (in + out)`, not the zero padding up to the
    largest rank (the figure PEFT's `print_trainable_parameters` gives); a `DoRAAdapter`
    adds its magnitudes (`out` per adapted layer).
    """
    if filter_spec is not None:
        model = eqx.filter(model, filter_spec)
    is_layerwise = lambda x: isinstance(x, (LayerwiseLoRAAdapter, DoRAAdapter))
    total = 0
    for leaf in jax.tree_util.tree_leaves(model, is_leaf=is_layerwise):
        if is_layerwise(leaf):
            total += _layerwise_size(leaf)
        elif eqx.is_array(leaf):
            total += leaf.size
    return int(total)


def _layerwise_size(adapter: "LayerwiseLoRAAdapter | DoRAAdapter") -> int:
    """Elements of `adapter` without the zero padding beyond each layer's rank (a
    `DoRAAdapter`'s magnitudes count for the adapted layers)."""
    total = sum(x.size for x in (adapter.scale,) if eqx.is_array(x))
    if isinstance(adapter, DoRAAdapter) and eqx.is_array(adapter.magnitude):
        width = adapter.magnitude.shape[-1]
        total += width * sum(1 for r in adapter.ranks if r > 0)
    rank_sum, r = sum(adapter.ranks), max(adapter.ranks, default=0)
    for x in (adapter.a, adapter.b):
        if eqx.is_array(x) and r > 0:
            total += x.size // (r * len(adapter.ranks)) * rank_sum
    return total
