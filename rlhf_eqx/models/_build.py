"""Assembling models from host arrays, and reaching the layer stack of any model."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._config import TransformerConfig
from ._heads import Policy, RewardModel, ValueModel
from ._transformer import Transformer

LAYER_FIELDS = (
    "attn_norm",
    "wqkv",
    "bqkv",
    "q_norm",
    "k_norm",
    "wo",
    "attn_post_norm",
    "mlp_norm",
    "w_gate_up",
    "w_down",
    "mlp_post_norm",
)


_FINITE_CHUNK = 1 << 22  # elements per `isfinite` pass: bounds the temporary mask


def check_finite(arr: np.ndarray, *, name: str, source: str) -> None:
    """Refuse a checkpoint tensor holding NaN or ±inf (a corrupt or diverged checkpoint:
    every output of the model would be NaN).

    `np.isfinite` over the tensor as it is read, in chunks; integer tensors pass.

    **Raises:** `ValueError` naming the file (`source`), the tensor (`name`, its name in
    the checkpoint), the first bad value and its index.
    """
    dtype = np.dtype(arr.dtype)
    if dtype.kind not in "fcV":  # ml_dtypes' bfloat16 has kind 'V'
        return
    flat = np.ravel(arr)
    for start in range(0, flat.size, _FINITE_CHUNK):
        ok = np.isfinite(flat[start : start + _FINITE_CHUNK])
        if not ok.all():
            k = start + int(np.argmin(ok))
            index = tuple(int(i) for i in np.unravel_index(k, arr.shape))
            raise ValueError(
                f"{source}: tensor {name!r} holds a non-finite value ({flat[k]}) at index "
                f"{index}: the checkpoint is corrupt (NaN/inf weights make every output NaN)"
            )


def _layer_field_used(name: str, cfg: TransformerConfig) -> bool:
    if name == "bqkv":
        return cfg.attn_bias
    if name in ("q_norm", "k_norm"):
        return cfg.qk_norm
    if name in ("attn_post_norm", "mlp_post_norm"):
        return cfg.post_norms
    return True


def policy_from_arrays(
    cfg: TransformerConfig, arrays: dict[str, np.ndarray | None], *, source: str
) -> Policy:
    """A `Policy` of configuration `cfg` whose parameters are the given host arrays (see
    `model_from_arrays`)."""
    return model_from_arrays(Policy, cfg, arrays, source=source)


def model_from_arrays(
    cls: type, cfg: TransformerConfig, arrays: dict[str, np.ndarray | None], *, source: str
) -> Any:
    """A `Policy`, `RewardModel` or `ValueModel` of configuration `cfg` whose parameters
    are the given host arrays.

    `arrays` holds `embed [V, D]`, `final_norm [D]`, for a `Policy` `lm_head [D, V]`
    (`None` when tied), for a scalar-head model `head [D]` and `bias []`, and the stacked layer
    fields `attn_norm [L, D]`, `wqkv [L, D, Q+2KV]`, `wo [L, Q, D]`, `mlp_norm [L, D]`,
    `w_gate_up [L, D, 2F]`, `w_down [L, F, D]`, and as the configuration requires `bqkv [L, Q+2KV]`,
    `q_norm`/`k_norm [L, hd]`, `attn_post_norm`/`mlp_post_norm [L, D]`. The model is built
    abstractly (`eqx.filter_eval_shape`, no random initialisation) and filled with `eqx.tree_at`;
    every array is checked against the expected shape and cast to `cfg.dtype`.
    """
    if cls not in (Policy, RewardModel, ValueModel):
        raise TypeError(f"expected Policy, RewardModel or ValueModel, got {cls!r}")
    skeleton = eqx.filter_eval_shape(cls, cfg, key=jax.random.key(0))
    fields: list[tuple[str, Any]] = [
        ("embed", lambda p: p.transformer.embed),
        ("final_norm", lambda p: p.transformer.final_norm),
    ]
    if cls is not Policy:
        fields += [("head", lambda p: p.head), ("bias", lambda p: p.bias)]
    elif not cfg.tie_embeddings:
        fields.append(("lm_head", lambda p: p.lm_head))
    for name in LAYER_FIELDS:
        if _layer_field_used(name, cfg):
            fields.append((name, (lambda n: lambda p: getattr(p.transformer.layers, n))(name)))
    values = []
    for name, get in fields:
        spec = get(skeleton)
        arr = arrays.get(name)
        if arr is None:
            raise ValueError(
                f"{source}: missing weight {name!r} (expected shape {tuple(spec.shape)})"
            )
        if tuple(arr.shape) != tuple(spec.shape):
            raise ValueError(
                f"{source}: weight {name!r} has shape {tuple(arr.shape)}, expected "
                f"{tuple(spec.shape)} for {cfg}"
            )
        values.append(jnp.asarray(arr).astype(spec.dtype))
    getters = [get for _, get in fields]
    return eqx.tree_at(lambda p: [g(p) for g in getters], skeleton, values)


def where_layers(model: Any):
    """Accessor of the stacked `DecoderLayer` of a Transformer or of a model holding one."""
    if isinstance(model, Transformer):
        return lambda m: m.layers
    if isinstance(getattr(model, "transformer", None), Transformer):
        return lambda m: m.transformer.layers
    raise TypeError(
        "expected a Transformer or a model with a `transformer` field (Policy, ValueModel, "
        f"RewardModel); got {type(model).__name__}"
    )


def model_config(model: Any) -> TransformerConfig:
    """The `TransformerConfig` of a Transformer or of a model holding one."""
    return model.cfg if isinstance(model, Transformer) else model.transformer.cfg
