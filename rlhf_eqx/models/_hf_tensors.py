"""Hugging Face tensor names ⇄ the decoder's stacked, fused arrays, for every family.

`L` layers, `D` hidden, `Q = n_heads·head_dim`, `KV = n_kv_heads·head_dim`, `F`
intermediate, `hd` head_dim; `P` is `model.layers.{i}.` and `layers` is
`transformer.layers` (layer `i` is index `i` of its leading `L` axis); `[:, a:b]` is a
column range. HF linear weights are `[out, in]`, rlhf_eqx stores `[in, out]`: rows
marked ᵀ are transposed.

| Hugging Face name | HF shape | rlhf_eqx field |
| --- | --- | --- |
| `model.embed_tokens.weight` | `[V, D]` | `transformer.embed` |
| `P input_layernorm.weight` | `[D]` | `layers.attn_norm[i]` |
| `P self_attn.q_proj.weight` | `[Q, D]` | `layers.wqkv[i][:, 0:Q]` ᵀ |
| `P self_attn.k_proj.weight` | `[KV, D]` | `layers.wqkv[i][:, Q:Q+KV]` ᵀ |
| `P self_attn.v_proj.weight` | `[KV, D]` | `layers.wqkv[i][:, Q+KV:Q+2KV]` ᵀ |
| `P self_attn.{q,k,v}_proj.bias` | `[Q]`, `[KV]`, `[KV]` | `layers.bqkv[i]`, same ranges (Qwen2) |
| `P self_attn.{q,k}_norm.weight` | `[hd]` | `layers.q_norm[i]`, `layers.k_norm[i]` (Qwen3, Gemma 3) |
| `P self_attn.o_proj.weight` | `[D, Q]` | `layers.wo[i]` ᵀ |
| `P post_attention_layernorm.weight` | `[D]` | `layers.mlp_norm[i]`; Gemma 2/3: `layers.attn_post_norm[i]` |
| `P pre_feedforward_layernorm.weight` | `[D]` | `layers.mlp_norm[i]` (Gemma 2/3) |
| `P post_feedforward_layernorm.weight` | `[D]` | `layers.mlp_post_norm[i]` (Gemma 2/3) |
| `P mlp.gate_proj.weight` | `[F, D]` | `layers.w_gate_up[i][:, 0:F]` ᵀ |
| `P mlp.up_proj.weight` | `[F, D]` | `layers.w_gate_up[i][:, F:2F]` ᵀ |
| `P mlp.down_proj.weight` | `[D, F]` | `layers.w_down[i]` ᵀ |
| `model.norm.weight` | `[D]` | `transformer.final_norm` |
| `lm_head.weight` | `[V, D]` | `lm_head` ᵀ (absent / ignored with `tie_word_embeddings`) |
| `score.weight` | `[1, D]` | `head` of a `RewardModel` / `ValueModel` (`...ForSequenceClassification`) |

Both libraries use the rotate-half rotary convention with heads contiguous in the q/k
columns, so no permutation is needed. Gemma's RMSNorm weights are stored as `w` of the
`(1 + w)` scale on both sides.
"""  # noqa: E501 (markdown table rows cannot be wrapped)

import functools
import re
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Shaped

from ._build import LAYER_FIELDS, _layer_field_used
from ._config import TransformerConfig
from ._heads import Policy, RewardModel, ValueModel
from ._layers import AbstractQuantizedWeight

_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")
_IGNORED = re.compile(r"(model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq)")


def _layer_names(cfg: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """Per-layer tensor suffix -> HF shape, for the tensors `cfg` has."""
    D, Q, KV, F, hd = cfg.d_model, cfg.q_size, cfg.kv_size, cfg.d_ff, cfg.head_dim
    names = {
        "input_layernorm.weight": (D,),
        "self_attn.q_proj.weight": (Q, D),
        "self_attn.k_proj.weight": (KV, D),
        "self_attn.v_proj.weight": (KV, D),
        "self_attn.o_proj.weight": (D, Q),
        "post_attention_layernorm.weight": (D,),
        "mlp.gate_proj.weight": (F, D),
        "mlp.up_proj.weight": (F, D),
        "mlp.down_proj.weight": (D, F),
    }
    if cfg.attn_bias:
        names.update(
            {
                "self_attn.q_proj.bias": (Q,),
                "self_attn.k_proj.bias": (KV,),
                "self_attn.v_proj.bias": (KV,),
            }
        )
    if cfg.qk_norm:
        names.update({"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
    if cfg.post_norms:
        names.update(
            {"pre_feedforward_layernorm.weight": (D,), "post_feedforward_layernorm.weight": (D,)}
        )
    return names


def _norm_fields(cfg: TransformerConfig) -> dict[str, str]:
    """rlhf_eqx norm field -> HF per-layer tensor suffix."""
    if cfg.post_norms:
        return {
            "attn_norm": "input_layernorm.weight",
            "attn_post_norm": "post_attention_layernorm.weight",
            "mlp_norm": "pre_feedforward_layernorm.weight",
            "mlp_post_norm": "post_feedforward_layernorm.weight",
        }
    return {"attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight"}


_FLOAT16_MAX = float(np.finfo(np.float16).max)  # 65504
_RANGE_CHUNK = 1 << 22


def check_float16_range(tensors: dict[str, Shaped[np.ndarray, "..."]], source: str) -> None:
    """Refuse to load a wider-typed tensor as float16 when it holds a magnitude past
    float16's range (it would become ±inf, and every output NaN): a `ValueError` naming
    `source` and the tensor."""
    for name, arr in tensors.items():
        if arr.dtype == np.float16 or arr.dtype.kind not in "fV":
            continue
        flat = np.ravel(arr)
        for start in range(0, flat.size, _RANGE_CHUNK):
            peak = float(np.abs(flat[start : start + _RANGE_CHUNK].astype(np.float32)).max())
            if peak > _FLOAT16_MAX:
                raise ValueError(
                    f"{source}: tensor {name!r} holds a magnitude of {peak:g}, past float16's "
                    f"range (±{_FLOAT16_MAX:g}); load it with dtype='bfloat16' or 'float32'"
                )


def _meta(tensors, name: str) -> tuple[tuple[int, ...], bool]:
    """A tensor's shape and whether it is floating point, without reading it when
    `tensors` reads lazily (it then has `shape_and_float`)."""
    if hasattr(tensors, "shape_and_float"):
        return tensors.shape_and_float(name)
    arr = tensors[name]
    return tuple(arr.shape), arr.dtype.kind in "fV"  # ml_dtypes bfloat16 has kind 'V'


@functools.partial(jax.jit, static_argnums=4, donate_argnums=0)
def _put(buf, i, x, lo, transpose: bool):
    """`buf` with `x` (`xᵀ`) written at layer `i`, last-axis offset `lo` (`buf` donated:
    filled in place)."""
    x = x.T if transpose else x
    start = (i,) + (0,) * (x.ndim - 1) + (lo,)
    return jax.lax.dynamic_update_slice(buf, x[None].astype(buf.dtype), start)


def arrays_from_tensors(
    cfg: TransformerConfig,
    tensors: Mapping[str, Any],  # numpy arrays; `Any`: a lazy mapping reads one when asked
    *,
    source: str,
    head: str = "lm",
    dtype=None,
) -> dict[str, np.ndarray | jax.Array | None]:
    """The host arrays of `model_from_arrays` from a checkpoint's tensors (`head="score"`:
    a sequence classifier's backbone and `score.weight`).

    `tensors` maps names to arrays, or reads them lazily (a mapping with
    `shape_and_float(name)` and `file_of(name)`, the file a tensor is in, which the
    errors below name; as `load_hf` passes): names and shapes are checked first,
    then each tensor is read once. With `dtype` the arrays are device arrays of that
    dtype, each stacked field filled one layer at a time in place, so that no more than
    the fields built so far and one tensor are held (a sharded checkpoint is never
    whole in memory); without it they are numpy arrays.

    Raises `ValueError` naming the tensor when one is missing, has the wrong shape or
    a non-float dtype, belongs to a layer beyond `num_hidden_layers`, or is not part of
    the architecture (e.g. an `o_proj.bias`).
    """
    D, V, L = cfg.d_model, cfg.vocab_size, cfg.n_layers
    per_layer = _layer_names(cfg)
    top = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    top.update({"score.weight": (1, D)} if head == "score" else {"lm_head.weight": (V, D)})
    file_of = getattr(tensors, "file_of", lambda name: source)
    for name in tensors:
        m = _LAYER_NAME.fullmatch(name)
        if _IGNORED.fullmatch(name):
            continue
        if m is not None and int(m.group(1)) >= L:
            raise ValueError(
                f"{file_of(name)}: tensor {name!r} belongs to layer {m.group(1)} but "
                f"config.json has num_hidden_layers={L}"
            )
        expected = per_layer.get(m.group(2)) if m is not None else top.get(name)
        if expected is None:
            raise ValueError(
                f"{file_of(name)}: unexpected tensor {name!r}: not part of this architecture "
                f"({cfg})"
            )
        shape, is_float = _meta(tensors, name)
        if shape != expected:
            raise ValueError(
                f"{file_of(name)}: tensor {name!r} has shape {shape}, expected {expected}"
            )
        if not is_float:
            raise ValueError(
                f"{file_of(name)}: tensor {name!r} has non-float dtype {tensors[name].dtype}"
            )

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"{source}: tensor {name!r} is missing from the checkpoint")
        return tensors[name]

    def field(suffixes: tuple[str, ...], transpose: bool = True):
        """`[L, ...]`: per layer the named tensors (transposed), side by side."""
        names = [[f"model.layers.{i}.{s}" for s in suffixes] for i in range(L)]
        for name in (n for row in names for n in row if n not in tensors):
            get(name)  # the first missing one, before anything is read
        if dtype is None:
            per = lambda i: [get(n).T if transpose else get(n) for n in names[i]]
            return np.stack([np.concatenate(per(i), axis=-1) for i in range(L)])
        shapes = [per_layer[s][::-1] if transpose else per_layer[s] for s in suffixes]
        buf = jnp.zeros((L,) + shapes[0][:-1] + (sum(sh[-1] for sh in shapes),), dtype)
        for i in range(L):
            lo = 0
            for name, sh in zip(names[i], shapes):
                buf = _put(buf, jnp.int32(i), get(name), jnp.int32(lo), transpose)
                lo += sh[-1]
        return buf

    def one(name: str, transpose: bool = False):
        arr = get(name)
        if dtype is None:
            return arr.T if transpose else arr
        arr = jnp.asarray(arr)
        return (arr.T if transpose else arr).astype(dtype)

    attn, mlp = "self_attn.", "mlp."
    arrays: dict[str, np.ndarray | jax.Array | None] = {
        "embed": one("model.embed_tokens.weight"),
        "final_norm": one("model.norm.weight"),
        "lm_head": None
        if cfg.tie_embeddings or head == "score"
        else one("lm_head.weight", transpose=True),
        "wqkv": field(tuple(attn + f"{p}_proj.weight" for p in "qkv")),
        "wo": field((attn + "o_proj.weight",)),
        "w_gate_up": field((mlp + "gate_proj.weight", mlp + "up_proj.weight")),
        "w_down": field((mlp + "down_proj.weight",)),
    }
    for name, suffix in _norm_fields(cfg).items():
        arrays[name] = field((suffix,), transpose=False)
    if cfg.attn_bias:
        arrays["bqkv"] = field(tuple(attn + f"{p}_proj.bias" for p in "qkv"), transpose=False)
    if cfg.qk_norm:
        arrays["q_norm"] = field((attn + "q_norm.weight",), transpose=False)
        arrays["k_norm"] = field((attn + "k_norm.weight",), transpose=False)
    if head == "score":
        arrays["head"] = one("score.weight")[0]
        arrays["bias"] = np.zeros((), np.float32)
    return arrays


def fill_model(
    cls: type, cfg: TransformerConfig, values: dict, *, source: str, dense_of=None
) -> Policy | RewardModel:
    """An abstractly built `cls` (`Policy` or `RewardModel`, no random initialisation)
    holding `values[field]`, or `dense_of(field)` for a field not in `values`, for each of
    its weights (`embed`, `final_norm`, `lm_head` untied, `head` / `bias`, the stacked
    layer fields the configuration uses).

    Dense arrays are checked against the expected shape and cast to `cfg.param_dtype`
    (no copy when they are device arrays of that dtype already: what `load_hf` passes,
    so the model is the only copy); quantised weights are kept as they are. A missing
    weight is a `ValueError` naming it and `source`.
    """
    skeleton = eqx.filter_eval_shape(cls, cfg, key=jax.random.key(0))
    getters = {
        "embed": lambda p: p.transformer.embed,
        "final_norm": lambda p: p.transformer.final_norm,
    }
    if cls is not Policy:
        getters |= {"head": lambda p: p.head, "bias": lambda p: p.bias}
    elif not cfg.tie_embeddings:
        getters["lm_head"] = lambda p: p.lm_head
    for name in LAYER_FIELDS:
        if _layer_field_used(name, cfg):
            getters[name] = (lambda n: lambda p: getattr(p.transformer.layers, n))(name)
    leaves = []
    for name, get in getters.items():
        value = values.pop(name) if name in values else None
        if value is None and dense_of is not None:
            value = dense_of(name)
        spec = get(skeleton)
        if value is None:
            raise ValueError(f"{source}: missing weight {name!r} (expected shape {spec.shape})")
        if not isinstance(value, AbstractQuantizedWeight):
            if tuple(value.shape) != tuple(spec.shape):
                raise ValueError(
                    f"{source}: weight {name!r} has shape {tuple(value.shape)}, expected "
                    f"{tuple(spec.shape)} for {cfg}"
                )
            value = jnp.asarray(value).astype(spec.dtype)
        leaves.append(value)
    fns = list(getters.values())
    return eqx.tree_at(lambda p: [g(p) for g in fns], skeleton, leaves)


def tensors_from_model(
    policy: Policy | RewardModel | ValueModel, dtype: str
) -> dict[str, np.ndarray]:
    """The Hugging Face tensors of a model (int8 projections dequantised), in `dtype`:
    a `Policy` as a causal LM, a scalar-head model as a one-label sequence classifier
    (`score.weight`; its `bias` must be zero, which the classifier cannot express)."""
    cfg, layers = policy.cfg, policy.transformer.layers
    jdt = getattr(jnp, dtype)
    Q, KV, F = cfg.q_size, cfg.kv_size, cfg.d_ff

    def host(w) -> np.ndarray:
        """The whole (stacked) array on the host in the written dtype."""
        if isinstance(w, AbstractQuantizedWeight):  # stacked per layer, or one head matrix
            dq = lambda x: x.dequantize(jnp.float32)
            w = jax.vmap(dq)(w) if len(w.shape) > 2 else dq(w)
        return np.asarray(jnp.asarray(w).astype(jdt))

    c = np.ascontiguousarray
    T = lambda x: c(np.swapaxes(x, -1, -2))
    wqkv, wo = host(layers.wqkv), host(layers.wo)
    wgu, wdown = host(layers.w_gate_up), host(layers.w_down)
    norms = {suffix: host(getattr(layers, field)) for field, suffix in _norm_fields(cfg).items()}
    bqkv = None if layers.bqkv is None else host(layers.bqkv)
    qk = (
        {}
        if layers.q_norm is None
        else {"q_norm": host(layers.q_norm), "k_norm": host(layers.k_norm)}
    )
    tensors: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": c(host(policy.transformer.dense_embed(jnp.float32)))
    }
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = c(norms["input_layernorm.weight"][i])
        tensors[p + "self_attn.q_proj.weight"] = T(wqkv[i][:, :Q])
        tensors[p + "self_attn.k_proj.weight"] = T(wqkv[i][:, Q : Q + KV])
        tensors[p + "self_attn.v_proj.weight"] = T(wqkv[i][:, Q + KV :])
        if bqkv is not None:
            tensors[p + "self_attn.q_proj.bias"] = c(bqkv[i][:Q])
            tensors[p + "self_attn.k_proj.bias"] = c(bqkv[i][Q : Q + KV])
            tensors[p + "self_attn.v_proj.bias"] = c(bqkv[i][Q + KV :])
        for name, arr in qk.items():
            tensors[p + f"self_attn.{name}.weight"] = c(arr[i])
        tensors[p + "self_attn.o_proj.weight"] = T(wo[i])
        for suffix, arr in norms.items():
            if suffix != "input_layernorm.weight":
                tensors[p + suffix] = c(arr[i])
        tensors[p + "mlp.gate_proj.weight"] = T(wgu[i][:, :F])
        tensors[p + "mlp.up_proj.weight"] = T(wgu[i][:, F:])
        tensors[p + "mlp.down_proj.weight"] = T(wdown[i])
    tensors["model.norm.weight"] = c(host(policy.transformer.final_norm))
    if isinstance(policy, (RewardModel, ValueModel)):
        if float(policy.bias) != 0.0:
            raise ValueError(
                f"save_hf: the {type(policy).__name__}'s `bias` is {float(policy.bias)}, but a "
                "...ForSequenceClassification score has no bias; a Bradley-Terry reward is "
                "shift-invariant, so zero it first "
                "(eqx.tree_at(lambda m: m.bias, model, jnp.zeros(())))"
            )
        tensors["score.weight"] = c(host(policy.head)[None, :])
    elif policy.lm_head is not None:
        tensors["lm_head.weight"] = T(host(policy.lm_head))
    return tensors
