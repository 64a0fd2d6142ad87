"""Per-device memory of a training step, planned on paper before a pod is booked.

Weights, gradients and optimiser state are counted exactly: the model, its LoRA
adapters or int8 base, and the optimiser state are built as shapes only
(`jax.eval_shape`, nothing allocated, so a 70B model costs nothing), and every leaf is
split by the model family's sharding rules (`rlhf_eqx.models.partition_specs`) on the
given mesh. Activations are an analytic count of what the backward pass keeps per
token, calibrated against XLA's buffer assignment of small CPU steps (within 20% of
`jax.jit(step).lower(...).compile().memory_analysis()`).
"""

import dataclasses
import math
from collections.abc import Mapping, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from ..models import (
    ATTENTION_BLOCK,
    LoRAConfig,
    Policy,
    TransformerConfig,
    apply_lora,
    partition_specs,
    quantize_int8,
)
from ._mesh import fit_spec, opt_state_specs


def _gib(n: int) -> str:
    return f"{n / 2**30:8.2f} GiB"


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device of one training step (see `estimate_memory`).

    - `params`: every weight of the trained model (trainable and frozen parts).
    - `grads`: gradients of the trainable part.
    - `optimizer`: optimiser state (e.g. Adam's two moments and counts).
    - `reference`: a separate frozen reference model (0 with LoRA, whose reference is
      the shared base, or with cached reference log-probabilities).
    - `activations`: what the backward pass keeps, without rematerialisation.
    - `activations_remat`: the same with each layer rematerialised (only layer inputs
      kept, one layer recomputed at a time: `TransformerConfig.remat=True`).
    - `trainable_params`: number of trainable parameters (not bytes).
    - `activations_dots`: the same with the products' outputs kept and the rest of each
      layer recomputed (`TransformerConfig.remat="dots"`).
    """

    params: int
    grads: int
    optimizer: int
    reference: int
    activations: int
    activations_remat: int
    trainable_params: int
    activations_dots: int = 0

    @property
    def state(self) -> int:
        """Weights, gradients, optimiser state and reference: everything but activations."""
        return self.params + self.grads + self.optimizer + self.reference

    @property
    def total(self) -> int:
        """Peak bytes per device without rematerialisation."""
        return self.state + self.activations

    @property
    def total_remat(self) -> int:
        """Peak bytes per device with per-layer rematerialisation."""
        return self.state + self.activations_remat

    @property
    def total_dots(self) -> int:
        """Peak bytes per device with the products' outputs kept (`remat="dots"`)."""
        return self.state + self.activations_dots

    def fits(self, device_bytes: int, *, remat: bool | str = False, headroom: float = 0.9) -> bool:
        """Whether the step fits in `headroom × device_bytes` per device, with the
        `TransformerConfig.remat` mode `remat` (`False`, `True` / `"full"`, `"dots"`)."""
        if remat == "dots":
            total = self.total_dots
        elif remat is True or remat == "full":
            total = self.total_remat
        else:
            total = self.total
        return total <= headroom * device_bytes

    def __str__(self) -> str:
        rows = [
            ("params", self.params),
            ("grads", self.grads),
            ("optimizer", self.optimizer),
            ("reference", self.reference),
            ("activations", self.activations),
            ("activations (remat)", self.activations_remat),
            ("activations (dots)", self.activations_dots),
            ("total", self.total),
            ("total (remat)", self.total_remat),
            ("total (dots)", self.total_dots),
        ]
        lines = [f"per-device memory ({self.trainable_params:,} trainable parameters)"]
        lines += [f"  {name:<20}{_gib(value)}" for name, value in rows]
        return "\n".join(lines)


def _sharded_bytes(tree, specs, sizes: Mapping[str, int]) -> int:
    total = 0
    for x, spec in zip(
        jax.tree.leaves(tree),
        jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, PartitionSpec)),
    ):
        spec = fit_spec(spec, x.shape, sizes)
        n = 1
        for dim, axes in zip(x.shape, tuple(spec) + (None,) * (len(x.shape) - len(spec))):
            names = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
            n *= dim // math.prod(sizes[a] for a in names)
        total += n * jnp.dtype(x.dtype).itemsize
    return total


def _trainable_leaves(shapes, *, lora: bool):
    """Which leaves of a shape-only model the optimiser sees (as `partition_trainable`):
    floating-point leaves, and with LoRA only the adapters, without the frozen per-layer
    `scale` of a `LayerwiseLoRAAdapter` or `DoRAAdapter` (as `lora_filter`)."""

    def trainable(path, x):
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            return False
        if not lora:
            return True
        names = [getattr(k, "name", None) for k in path]
        return "lora" in names and names[-1] != "scale"

    return jax.tree_util.tree_map_with_path(trainable, shapes)


def _split(n: int, k: int) -> float:
    """Per-device share of `n` units split `k` ways (replicated when `k` does not divide `n`)."""
    return n / k if n % k == 0 else float(n)


def _activation_bytes(
    cfg: TransformerConfig, *, sequences: int, seq_len: int, data: int, model: int
) -> tuple[int, int, int]:
    """Activation bytes per device kept for the backward pass: (no remat, per-layer
    remat, the products' outputs kept).

    Per token and layer (b = bytes of the compute dtype), what a layer keeps for its
    backward pass: its input, the residual after the attention and the two RMSNorm
    outputs (`4·D·b`; the norms keep no normalised rows, their backward pass recomputes
    them), the rotated queries, the attention output and its flattened copy for the
    output projection (`3·Q·b`), keys and values (`2·KV·b`), up, the gate's activation
    and slope and their product (`4·F·b`, `gated_activation`), and each
    query's float32 log-normaliser (`4·H`; the attention stores no probabilities, its
    backward pass recomputes them). Per token, outside the layers: the embedding output
    and final norm (`2·D·b`), float32 logits and their log-softmax (`8·V`) and the
    attention mask (`4·T`); once, the float32 scores, probabilities and their gradient
    of one tile of the attention (`ATTENTION_BLOCK` queries × `ATTENTION_BLOCK` keys)
    while its backward pass runs (`12·H·min(T, block)²` per sequence). With remat only each layer's
    input (`D·b` per layer) is kept, plus one layer's activations while it is recomputed; with
    `"dots"` each layer's input, its q/k/v and gate/up products (`(D + Q + 2·KV + 2·F)·b`),
    plus what one layer recomputes (the rest of its activations) while its backward pass
    runs. Sequences
    are split over `data`; heads, MLP units and the vocabulary over `model` (the residual stream is
    replicated over `model`).
    """
    b = jnp.dtype(cfg.param_dtype).itemsize
    D, F, V, T = cfg.d_model, cfg.d_ff, cfg.vocab_size, seq_len
    H, Q, KV = cfg.n_heads, cfg.q_size, cfg.kv_size
    rows = math.ceil(sequences / data)
    tokens = rows * T
    heads = _split(H, model) / H
    per_layer = (
        4 * D * b
        + 3 * _split(Q, model) * b
        + 2 * _split(KV, model) * b
        + 4 * _split(F, model) * b
        + 4 * H * heads
    )
    outside = 2 * D * b + 8 * _split(V, model) + 4 * T
    transient = rows * 12 * H * heads * min(T, ATTENTION_BLOCK) ** 2
    full = tokens * (cfg.n_layers * per_layer + outside) + transient
    remat = tokens * (cfg.n_layers * D * b + per_layer + outside) + transient
    kept = (D + _split(Q, model) + 2 * _split(KV, model) + 2 * _split(F, model)) * b
    dots = tokens * (cfg.n_layers * kept + (per_layer - kept) + outside) + transient
    return int(full), int(remat), int(dots)


def estimate_memory(
    config: TransformerConfig,
    mesh_shape: tuple[int, ...] | Mapping[str, int] = (1, 1),
    batch: tuple[int, ...] = (1, 1),
    *,
    lora: LoRAConfig | None = None,
    int8_base: bool = False,
    fsdp: bool = True,
    tensor_parallel: bool = True,
    optimizer: optax.GradientTransformation | None = None,
    reference: str = "model",
) -> MemoryEstimate:
    """Estimate the per-device memory of one training step of a Llama-family policy.

    **Arguments:**

    - `config`: the model (`config.dtype` sets the parameter and compute dtype, e.g.
      `"bfloat16"`).
    - `mesh_shape`: `(data, model)` sizes of the mesh, or a mapping
      `{"data": ..., "model": ...}`.
    - `batch`: `(sequences, seq_len)` per step, all devices together; a DPO step
      with `n` pairs runs `2n` sequences.
    - `lora`: train LoRA adapters only (the base is frozen and doubles as the reference).
    - `int8_base`: store the frozen base projections in int8 (`quantize_int8`; with
      `lora` — QLoRA-style).
    - `fsdp`, `tensor_parallel`: the sharding of weights and optimiser state (see
      `rlhf_eqx.distributed.shard_model`).
    - `optimizer`: the optax optimiser (default AdamW: two moments like the params).
    - `reference`: `"model"` — a separate frozen reference model of the same size is
      held (full fine-tuning DPO / PPO / GRPO); `"cached"` / `"none"` — no reference
      weights. With `lora` the reference is the shared base and costs nothing.

    **Returns:** a `MemoryEstimate` (bytes per device; `print` it for a table).
    """
    if isinstance(mesh_shape, Mapping):
        sizes = {"data": int(mesh_shape.get("data", 1)), "model": int(mesh_shape.get("model", 1))}
    else:
        if len(mesh_shape) != 2:
            raise ValueError(
                f"estimate_memory: mesh_shape must be (data, model), got {mesh_shape!r}"
            )
        sizes = {"data": int(mesh_shape[0]), "model": int(mesh_shape[1])}
    if min(sizes.values()) < 1:
        raise ValueError(f"estimate_memory: mesh sizes must be positive, got {sizes}")
    if not (isinstance(batch, Sequence) and len(batch) == 2 and min(batch) >= 1):
        raise ValueError(f"estimate_memory: batch must be (sequences, seq_len) >= 1, got {batch!r}")
    if reference not in ("model", "cached", "none"):
        raise ValueError(
            f"estimate_memory: reference must be 'model', 'cached' or 'none', got {reference!r}"
        )
    optimizer = optax.adamw(1e-4) if optimizer is None else optimizer

    def build():
        model = Policy(config, key=jax.random.key(0))
        if lora is not None:
            model = apply_lora(model, lora, key=jax.random.key(1))
        if int8_base:
            model = quantize_int8(model)
        return model

    model = jax.eval_shape(build)
    spec_kw = dict(fsdp=fsdp, tensor_parallel=tensor_parallel)
    params, _ = eqx.partition(model, _trainable_leaves(model, lora=lora is not None))
    with jax.numpy_dtype_promotion("standard"):
        opt_state = jax.eval_shape(optimizer.init, params)
    model_bytes = _sharded_bytes(model, partition_specs(model, **spec_kw), sizes)
    param_specs = partition_specs(params, **spec_kw)
    grad_bytes = _sharded_bytes(params, param_specs, sizes)
    opt_specs = opt_state_specs(opt_state, params, param_specs)
    opt_bytes = _sharded_bytes(opt_state, opt_specs, sizes)
    ref_bytes = model_bytes if (reference == "model" and lora is None) else 0
    act, act_remat, act_dots = _activation_bytes(
        config, sequences=batch[0], seq_len=batch[1], data=sizes["data"], model=sizes["model"]
    )
    n_trainable = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    return MemoryEstimate(
        params=model_bytes,
        grads=grad_bytes,
        optimizer=opt_bytes,
        reference=ref_bytes,
        activations=act,
        activations_remat=act_remat,
        trainable_params=n_trainable,
        activations_dots=act_dots,
    )
