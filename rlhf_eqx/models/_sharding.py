"""Sharding rules of the Llama-family models, declared once, by parameter name.

`partition_specs(model)` maps every array leaf of a `Policy`, `ValueModel`,
`RewardModel` or `Transformer` (with or without LoRA adapters or int8 weights, whole or
as a trainable/frozen partition) to a `jax.sharding.PartitionSpec` over a
`("data", "model")` mesh:

- **tensor parallel** (the `"model"` axis, Megatron-LM layout, Shoeybi et al. 2019):
  the projections into the heads and the MLP hidden units (`wqkv`, `w_gate_up`, and
  the q/k/v biases) are split over their output columns, the projections out of them
  (`wo`, `w_down`) over their input rows, and the vocabulary axis of the embedding and
  the LM head over `"model"`;
- **FSDP** (`fsdp=True`, ZeRO-3, Rajbhandari et al. 2020): the other matrix axis (the
  `d_model` side) is split over `"data"`, so that every parameter and its optimiser
  state is stored once across the mesh; `jit` gathers them where they are used;
- norms, scalar heads and the stacked layer axis are replicated.

The fused projections store several logical matrices side by side (`wqkv` is
`[q | k | v]`, `w_gate_up` is `[gate | up]`). Their column axis is split into
contiguous blocks, which do not coincide with whole heads or with matching gate/up
units, so XLA re-lays out the slices `q`, `k`, `v`, `gate`, `up` after the product
(an all-to-all of activations per layer). The results are exact for any mesh; only the
communication differs from an interleaved (head-major) layout.

A LoRA adapter follows the weight it updates: `a` is split like the weight's input
axis and `b` (and a DoRA adapter's `magnitude`) like its output axis. An `Int8Weight`
splits `q` like the dense weight and its per-column `scale` like the columns; a
`GGUFWeight`'s packed rows (its output columns) are split like the columns, never inside
a row. Leaves the rules do not name are replicated.
"""

from collections.abc import Hashable

import jax
from jax.sharding import PartitionSpec
from jaxtyping import PyTree

# Trailing-axis roles of each named weight: "in" / "out" of a matrix, "vocab", None.
# "col": split the output over the model axis and the input over the data axis (FSDP);
# "row": the reverse.
_COLUMN = ("wqkv", "w_gate_up", "lm_head")
_ROW = ("wo", "w_down")
_COLUMN_TARGETS = ("q", "k", "v", "gate", "up")
_ROW_TARGETS = ("o", "down")


def _names(path) -> list[tuple[str, Hashable]]:
    out = []
    for entry in path:
        if isinstance(entry, jax.tree_util.GetAttrKey):
            out.append(("attr", entry.name))
        elif isinstance(entry, jax.tree_util.DictKey):
            out.append(("dict", entry.key))
        elif isinstance(entry, jax.tree_util.SequenceKey):
            out.append(("seq", entry.idx))
        else:
            out.append(("other", str(entry)))
    return out


def _trailing_rule(names, fsdp_axis, model_axis) -> tuple | None:
    """The specs of the trailing (per-layer) axes of the leaf at `names`, or None."""
    attrs = [n for kind, n in names if kind == "attr"]
    if "lora" in attrs:
        i = attrs.index("lora")
        targets = [n for kind, n in names if kind == "dict"]
        leaf = attrs[-1] if len(attrs) > i + 1 else None
        if not targets or leaf not in ("a", "b", "magnitude"):
            return None
        target = targets[-1]
        if target in _COLUMN_TARGETS:
            in_axis, out_axis = fsdp_axis, model_axis
        elif target in _ROW_TARGETS:
            in_axis, out_axis = model_axis, fsdp_axis
        else:
            return None
        if leaf == "magnitude":  # DoRA's, one per output column
            return (out_axis,)
        return (in_axis, None) if leaf == "a" else (None, out_axis)
    for j in range(len(attrs) - 1, -1, -1):
        name = attrs[j]
        sub = attrs[j + 1] if j + 1 < len(attrs) else None  # Int8Weight fields q / scale
        if sub == "raw" and (name == "embed" or name in _COLUMN + _ROW):
            # GGUFWeight rows are output columns, packed along the input axis (kept whole)
            return (model_axis if name == "embed" or name in _COLUMN else fsdp_axis, None)
        if name == "embed":
            return (model_axis, fsdp_axis)
        if name in _COLUMN:
            return (model_axis,) if sub == "scale" else (fsdp_axis, model_axis)
        if name in _ROW:
            return (None,) if sub == "scale" else (model_axis, fsdp_axis)
        if name == "bqkv":
            return (model_axis,)
    return None


def partition_specs(
    model: PyTree,
    *,
    fsdp: bool = False,
    tensor_parallel: bool = True,
    data_axis: str = "data",
    model_axis: str = "model",
) -> PyTree:
    """The `PartitionSpec` of every array leaf of a Llama-family model (or part of one).

    **Arguments:**

    - `model`: a `Policy`, `ValueModel`, `RewardModel`, `Transformer`, a partition of
      one (`None` where a leaf belongs to the other part), or a pytree holding several
      of them (e.g. a `(policy, value_model)` pair).
    - `fsdp`: also split the `d_model` side of every matrix over `data_axis`.
    - `tensor_parallel`: split heads, MLP units and the vocabulary over `model_axis`.
    - `data_axis`, `model_axis`: the mesh axis names.

    **Returns:** a pytree of the same structure with a `PartitionSpec` at every array
    leaf (axes not named by the rules, and unknown leaves, are replicated: `None`).
    The specs name mesh axes regardless of their size; `rlhf_eqx.distributed` drops an
    axis where the dimension does not divide by it.
    """
    fsdp_axis = data_axis if fsdp else None
    m_axis = model_axis if tensor_parallel else None

    def spec(path, leaf):
        ndim = getattr(leaf, "ndim", None)
        if ndim is None:
            return leaf
        rule = _trailing_rule(_names(path), fsdp_axis, m_axis)
        if rule is None or len(rule) > ndim:
            return PartitionSpec(*([None] * ndim))
        return PartitionSpec(*([None] * (ndim - len(rule)) + list(rule)))

    return jax.tree_util.tree_map_with_path(spec, model)
