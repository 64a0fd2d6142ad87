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

import re

import jax
import jax.numpy as jnp
import numpy as np

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


def arrays_from_tensors(
    cfg: TransformerConfig, tensors: dict[str, np.ndarray], *, source: str, head: str = "lm"
) -> dict[str, np.ndarray | None]:
    """The host arrays of `model_from_arrays` from a checkpoint's tensors (`head="score"`:
    a sequence classifier's backbone and `score.weight`).

    Raises `ValueError` naming the tensor when one is missing, has the wrong shape or
    a non-float dtype, belongs to a layer beyond `num_hidden_layers`, or is not part of
    the architecture (e.g. an `o_proj.bias`).
    """
    D, V = cfg.d_model, cfg.vocab_size
    per_layer = _layer_names(cfg)
    top = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    top.update({"score.weight": (1, D)} if head == "score" else {"lm_head.weight": (V, D)})
    for name, arr in tensors.items():
        m = _LAYER_NAME.fullmatch(name)
        if _IGNORED.fullmatch(name):
            continue
        if m is not None and int(m.group(1)) >= cfg.n_layers:
            raise ValueError(
                f"{source}: tensor {name!r} belongs to layer {m.group(1)} but config.json has "
                f"num_hidden_layers={cfg.n_layers}"
            )
        expected = per_layer.get(m.group(2)) if m is not None else top.get(name)
        if expected is None:
            raise ValueError(
                f"{source}: unexpected tensor {name!r}: not part of this architecture ({cfg})"
            )
        if tuple(arr.shape) != expected:
            raise ValueError(
                f"{source}: tensor {name!r} has shape {tuple(arr.shape)}, expected {expected}"
            )
        if arr.dtype.kind not in "fV":  # ml_dtypes bfloat16 has kind 'V'
            raise ValueError(f"{source}: tensor {name!r} has non-float dtype {arr.dtype}")

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"{source}: tensor {name!r} is missing from the checkpoint")
        return tensors[name]

    def stack(suffix: str) -> np.ndarray:
        return np.stack([get(f"model.layers.{i}.{suffix}") for i in range(cfg.n_layers)])

    def stack_t(suffix: str) -> np.ndarray:
        return np.swapaxes(stack(suffix), -1, -2)

    attn, mlp = "self_attn.", "mlp."
    arrays: dict[str, np.ndarray | None] = {
        "embed": get("model.embed_tokens.weight"),
        "final_norm": get("model.norm.weight"),
        "lm_head": None if cfg.tie_embeddings or head == "score" else get("lm_head.weight").T,
        "wqkv": np.concatenate([stack_t(attn + f"{p}_proj.weight") for p in "qkv"], axis=-1),
        "wo": stack_t(attn + "o_proj.weight"),
        "w_gate_up": np.concatenate(
            [stack_t(mlp + "gate_proj.weight"), stack_t(mlp + "up_proj.weight")], axis=-1
        ),
        "w_down": stack_t(mlp + "down_proj.weight"),
    }
    for field, suffix in _norm_fields(cfg).items():
        arrays[field] = stack(suffix)
    if cfg.attn_bias:
        arrays["bqkv"] = np.concatenate([stack(attn + f"{p}_proj.bias") for p in "qkv"], axis=-1)
    if cfg.qk_norm:
        arrays["q_norm"] = stack(attn + "q_norm.weight")
        arrays["k_norm"] = stack(attn + "k_norm.weight")
    if head == "score":
        arrays["head"] = get("score.weight")[0]
        arrays["bias"] = np.zeros((), np.float32)
    return arrays


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
