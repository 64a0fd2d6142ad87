r"""Gradient accumulation over micro-batches, and how steps call a model on a batch.

A step's loss is a sum of per-micro-batch *contributions*: numerators (sums over rows
of per-token or per-pair values) divided by denominators computed once from the masks
of the **full** batch (`rlhf_eqx.losses.aggregate_parts`). Summing the contributions —
and their gradients — over the micro-batches therefore gives exactly the full-batch
loss and gradient, whatever the aggregation mode (Levanter's `grad_accum`; DESIGN
principle 3).
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Bool, Float, Int, Key, PRNGKeyArray, PyTree, Real

from ..models import AbstractBatchedModel
from ..ops import entropy_from_logits, logprobs_from_logits
from ._optim import learning_rate_from_state
from ._validation import check_positive_int

# name -> (sum, count): a masked mean that can be added up over micro-batches and devices.
Sums = dict[str, tuple[Real[Array, ""], Real[Array, ""]]]


def split_micro_batches(batch: PyTree, micro_batches: int) -> PyTree:
    """Reshape every array leaf `[B, ...]` to `[micro_batches, B // micro_batches, ...]`.

    Rows `i * b : (i + 1) * b` form micro-batch `i`. Raises `ValueError` naming the
    field, its shape and `micro_batches` when `B` is not divisible.
    """
    check_positive_int("micro_batches", micro_batches)

    def split(path, x):
        B = x.shape[0]
        if B % micro_batches != 0:
            raise ValueError(
                f"batch field {jax.tree_util.keystr(path) or '<root>'} has {B} rows (shape "
                f"{tuple(x.shape)}), not divisible by micro_batches={micro_batches}"
            )
        return x.reshape((micro_batches, B // micro_batches) + x.shape[1:])

    return jax.tree_util.tree_map_with_path(split, batch)


def _set_fields(batch: PyTree, **values: Any) -> PyTree:
    """`batch` with the named fields (arrays, or `None`) set to `values`, by
    `eqx.tree_at`: a field that was `None` may be filled, and the batch's checks do not
    run again."""
    names = tuple(values)
    return eqx.tree_at(
        lambda b: tuple(getattr(b, n) for n in names),
        batch,
        tuple(values.values()),
        is_leaf=lambda x: x is None,
    )


def _add(a, b):
    return jax.tree.map(jnp.add, a, b)


def _zeros_of(s: jax.ShapeDtypeStruct) -> Array:
    """Zeros of `s`'s shape and dtype that vary over the manual device axes `s` varies
    over (inside `jax.shard_map` with `check_vma=True`: a scan's carry must have the type
    its body returns, and a micro-batch's loss and gradients vary over the data axis)."""
    z = jnp.zeros(s.shape, s.dtype)
    manual = getattr(s, "manual_axis_type", None)
    axes = manual.varying if manual is not None else getattr(s, "vma", None) or ()
    return jax.lax.pcast(z, tuple(sorted(axes, key=str)), to="varying") if axes else z


def accumulate_gradients(
    fn: Callable[..., tuple[Array, PyTree]],
    params: PyTree,
    batch: PyTree,
    *,
    micro_batches: int = 1,
    key: PRNGKeyArray | None = None,
) -> tuple[Float[Array, ""], PyTree, PyTree]:
    r"""Sum of `fn`'s contributions, their gradients and their auxiliary sums over micro-batches.

    `fn(params, micro_batch, key) -> (contribution, aux)`:

    - `contribution`: scalar, this micro-batch's share of the loss (its numerators over
      the full batch's denominators), differentiated with respect to the floating-point
      arrays of `params`;
    - `aux`: a pytree of arrays that are added up over the micro-batches (e.g. masked
      sums and counts for metrics).

    With `micro_batches = k > 1` the batch is split along axis 0 (`split_micro_batches`)
    and `fn` runs under a `jax.lax.scan`, so only one micro-batch's activations are
    alive at a time; `key` (if any) is split into one key per micro-batch.

    **Returns:** `(loss, grads, aux)`, `loss = Σ contributions`, `grads` its gradient
    (same structure as `eqx.filter(params, eqx.is_inexact_array)`) and `aux` the sum.
    """
    grad_fn = eqx.filter_value_and_grad(fn, has_aux=True)
    check_positive_int("micro_batches", micro_batches)
    if micro_batches == 1:
        (loss, aux), grads = grad_fn(params, batch, key)
        return loss, grads, aux

    micro = split_micro_batches(batch, micro_batches)
    keys = None if key is None else jax.random.split(key, micro_batches)
    first = jax.tree.map(lambda x: x[0], micro)
    k0 = None if keys is None else keys[0]
    # Shapes of the carry, without running anything.
    (loss_s, aux_s), grads_s = eqx.filter_eval_shape(grad_fn, params, first, k0)
    zeros = lambda t: jax.tree.map(_zeros_of, t)
    init = (zeros(loss_s), zeros(grads_s), zeros(aux_s))

    def body(carry, xs):
        mb, k = xs
        (loss, aux), grads = grad_fn(params, mb, k)
        return _add(carry, (loss, grads, aux)), None

    (loss, grads, aux), _ = jax.lax.scan(body, init, (micro, keys))
    return loss, grads, aux


def _moment_std(metrics: dict[str, Array], prefix: str) -> Float[Array, ""]:
    r"""$\sqrt{\max(\overline{x^2} - \bar x^2, 0)}$ from the means `{prefix}/mean` and
    `{prefix}/_sq` (of $x$ and $x^2$ over the global batch) in `metrics`, whose
    `{prefix}/_sq` it removes."""
    sq = metrics.pop(f"{prefix}/_sq")
    return jnp.sqrt(jnp.maximum(sq - jnp.square(metrics[f"{prefix}/mean"]), 0.0))


def sums_to_means(sums: Sums) -> dict[str, Float[Array, ""]]:
    """`{name: sum / max(count, 1)}`: masked means (0 where nothing was counted)."""
    return {k: (s / jnp.maximum(c, 1.0)).astype(jnp.float32) for k, (s, c) in sums.items()}


def _apply_update(update: Any, param: Any) -> Any:
    """`param + update` computed in the wider of the two dtypes, returned in the
    parameter's dtype (one rounding)."""
    if update is None:
        return param
    wide = (
        update.dtype if jnp.finfo(update.dtype).bits > jnp.finfo(param.dtype).bits else param.dtype
    )
    return (param.astype(wide) + update.astype(wide)).astype(param.dtype)


def apply_optimizer(
    optimizer: optax.GradientTransformation,
    params: PyTree,
    opt_state: Any,
    grads: PyTree,
) -> tuple[PyTree, Any, dict[str, Float[Array, ""]]]:
    """One optimiser update: `(params, opt_state, {"grad_norm", "learning_rate"?})`.

    `grad_norm` is the global norm of the gradient before clipping (TRL's `grad_norm`);
    `learning_rate` is logged when the optimiser injects it (see `make_optimizer`).
    Each updated parameter keeps its dtype (as `optax.apply_updates` does): a float32
    update of bfloat16 weights would otherwise promote them to float32, doubling their
    memory and recompiling the step on its next call.
    """
    half = [
        (path, g)
        for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]
        if g.dtype == jnp.float16
    ]
    if half:
        path, g = half[0]
        where = f"params{jax.tree_util.keystr(path)} (shape {tuple(g.shape)})"
        more = f" and {len(half) - 1} more" if len(half) > 1 else ""
        raise ValueError(
            f"float16 trainable weights ({where}{more}): Adam's epsilon (1e-8) and small "
            "second moments underflow in float16, so every update would be non-finite and "
            "skipped. Train "
            "bfloat16 or float32 weights (TransformerConfig(dtype=...), load_hf(..., dtype=...)), "
            "or LoRA adapters (float32) on a float16 base; float16 suits frozen weights "
            "such as a reference model."
        )
    trainable = eqx.filter(params, eqx.is_inexact_array)
    # Optax mixes Python floats with int32 step counts (e.g. Adam's bias correction),
    # which strict dtype promotion rejects; its arithmetic is well defined under the
    # standard rules, so use them for the optimiser only.
    with jax.numpy_dtype_promotion("standard"):
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
    params = jax.tree.map(_apply_update, updates, params, is_leaf=lambda x: x is None)
    # float32 per leaf: gradients of mixed dtypes (a bfloat16 backbone, a float32 scalar
    # head) have no implicit promotion under strict dtype rules
    metrics = {"grad_norm": optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads))}
    lr = learning_rate_from_state(opt_state)
    if lr is not None:
        metrics["learning_rate"] = lr
    return params, opt_state, metrics


def call_model(
    model: Callable[..., Any], tokens: Array, mask: Array, key: PRNGKeyArray | None
) -> Any:
    """`model(tokens, mask)`, with `key=` only when a key is given (custom models need not take
    one)."""
    if key is None:
        return model(tokens, mask)
    return model(tokens, mask, key=key)


def row_keys(key: PRNGKeyArray | None, n: int) -> Key[Array, " n"] | None:
    """One key per row, `[n]` (or `None`)."""
    return None if key is None else jax.random.split(key, n)


def vmap_model(
    model: Callable[..., Any], tokens: Array, mask: Array, key: PRNGKeyArray | None
) -> Any:
    """`model` over the rows of `tokens` / `mask` (`[B, T]`), with per-row keys if `key` is given.

    Models that meet the batched-call protocol (`rlhf_eqx.models.AbstractBatchedModel`,
    e.g. rlhf_eqx's own: same values as `jax.vmap`, flat 2-D matrix products, faster on
    CPU) get the batch whole; any other per-sample model is vmapped.
    """
    if isinstance(model, AbstractBatchedModel):
        return call_model(model, tokens, mask, key)
    keys = row_keys(key, tokens.shape[0])
    if keys is None:
        return jax.vmap(lambda t, m: model(t, m))(tokens, mask)
    return jax.vmap(lambda t, m, k: model(t, m, key=k))(tokens, mask, keys)


def policy_logits(
    model: Callable[..., Any], tokens: Array, mask: Array, key: PRNGKeyArray | None
) -> Array:
    """`vmap_model` of a language model: its logits `[B, T, V]`, or a `ValueError` naming
    the model and what it returned (e.g. a reward model's one score per sequence)."""
    out = vmap_model(model, tokens, mask, key)
    shape = getattr(out, "shape", None)
    if shape is None or len(shape) != 3 or tuple(shape[:2]) != tuple(tokens.shape):
        got = f"shape {tuple(shape)}" if shape is not None else type(out).__name__
        raise ValueError(
            "the policy must return next-token logits [T, V] for each sequence: "
            f"{type(model).__name__} returned {got} for tokens of shape {tuple(tokens.shape)} "
            "(expected (B, T, vocab)); use a language model such as rlhf_eqx.Policy"
        )
    return out


def tempered_logprobs(
    logits: Float[Array, "B T V"],
    tokens: Int[Array, "B T"],
    mask: Bool[Array, "B T"],
    temperature: float,
) -> Float[Array, "B T"]:
    """`rlhf_eqx.ops.logprobs_from_logits` of every row, at `temperature`."""
    return jax.vmap(lambda lg, t, m: logprobs_from_logits(lg, t, m, temperature=temperature))(
        logits, tokens, mask
    )


def tempered_entropies(
    logits: Float[Array, "B T V"], mask: Bool[Array, "B T"], temperature: float
) -> Float[Array, "B T"]:
    """`rlhf_eqx.ops.entropy_from_logits` of every row, at `temperature`."""
    return jax.vmap(lambda lg, m: entropy_from_logits(lg, m, temperature=temperature))(logits, mask)
