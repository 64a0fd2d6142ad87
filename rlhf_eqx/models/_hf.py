"""Hugging Face checkpoints: `config.json` + `*.safetensors` for the Llama architecture family.

Supported architectures: `LlamaForCausalLM` (Llama 2 / Llama 3 without rope scaling),
`MistralForCausalLM` (without an active sliding window) and `Qwen2ForCausalLM` (q/k/v
attention biases), with tied or untied embeddings. A checkpoint is either one
`model.safetensors` or shards `model-0000i-of-0000n.safetensors` listed in
`model.safetensors.index.json` (`weight_map`).

Tensor mapping. `L` layers, `D` hidden, `Q = n_heads·head_dim`, `KV =
n_kv_heads·head_dim`, `F` intermediate; `P` is `model.layers.{i}.` and `layers` is
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
| `P self_attn.o_proj.weight` | `[D, Q]` | `layers.wo[i]` ᵀ |
| `P post_attention_layernorm.weight` | `[D]` | `layers.mlp_norm[i]` |
| `P mlp.gate_proj.weight` | `[F, D]` | `layers.w_gate_up[i][:, 0:F]` ᵀ |
| `P mlp.up_proj.weight` | `[F, D]` | `layers.w_gate_up[i][:, F:2F]` ᵀ |
| `P mlp.down_proj.weight` | `[D, F]` | `layers.w_down[i]` ᵀ |
| `model.norm.weight` | `[D]` | `transformer.final_norm` |
| `lm_head.weight` | `[V, D]` | `lm_head` ᵀ (absent / ignored with `tie_word_embeddings`) |

Both libraries use the rotate-half rotary convention with heads contiguous in the q/k
columns, so no permutation is needed.

Config fields read: `architectures` / `model_type`, `hidden_size`,
`intermediate_size`, `num_hidden_layers`, `num_attention_heads`,
`num_key_value_heads`, `vocab_size`, `rms_norm_eps`, `rope_theta` (or
`rope_parameters.rope_theta`), `max_position_embeddings`, `head_dim`,
`tie_word_embeddings`, `torch_dtype` / `dtype`, `hidden_act` (must be `silu`).
Features the decoder does not implement are rejected with a `ValueError` naming the
field: a non-null `rope_scaling` (llama3, linear, dynamic, yarn, ...), a sliding window
in use, `attention_bias` (Llama: also an `o_proj` bias) and `mlp_bias`.

**dtypes.** numpy has no native bfloat16; `ml_dtypes.bfloat16` (installed with jax)
fills the gap and the `safetensors` numpy API reads and writes it, so bfloat16
checkpoints load and save without a float32 detour. `save_hf` writes the model's
parameter dtype unless `dtype` says otherwise.

**Safety.** Tensors are read with `safetensors.numpy` (a JSON header plus raw
buffers) and the config with `json`: loading never executes code from the checkpoint
(no pickle, no `torch.load`).
"""

import json
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._config import TransformerConfig
from ._heads import Policy
from ._layers import Int8Weight
from ._llama2c import _policy_from_arrays

__all__ = ["load_hf", "save_hf", "config_from_hf", "config_to_hf"]

_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
_TORCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def _safetensors_numpy():
    try:
        import safetensors.numpy as stnp
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "reading/writing Hugging Face checkpoints needs the `safetensors` package "
            "(pip install safetensors, or rlhf_eqx[io])"
        ) from e
    return stnp


def _unsupported(field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"config.json: `{field}` = {value!r} is not supported: {why}")


def config_from_hf(config: dict[str, Any], *, dtype: str | None = None) -> TransformerConfig:
    """Translate a Hugging Face `config.json` dictionary into a `TransformerConfig`.

    `dtype=None` takes the checkpoint's `torch_dtype` / `dtype` (float32 when absent or
    not one of float32 / bfloat16 / float16). Raises `ValueError` naming the field for
    unsupported architectures and features (see the module docstring).
    """
    archs = config.get("architectures") or []
    model_type = config.get("model_type")
    known = [a for a in archs if a in _ARCHITECTURES]
    if known:
        family = _ARCHITECTURES[known[0]]
    elif not archs and model_type in _ARCHITECTURES.values():
        family = model_type
    else:
        raise _unsupported(
            "architectures",
            archs or model_type,
            f"supported architectures are {sorted(_ARCHITECTURES)}",
        )
    if config.get("rope_scaling") is not None:
        raise _unsupported(
            "rope_scaling",
            config["rope_scaling"],
            "only plain rotary embeddings (rope_scaling null) are implemented",
        )
    rope_theta = config.get("rope_theta")
    params = config.get("rope_parameters")
    if params is not None:
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise _unsupported(
                "rope_parameters.rope_type",
                rope_type,
                "only plain rotary embeddings ('default') are implemented",
            )
        rope_theta = params.get("rope_theta", rope_theta)
    if rope_theta is None:
        rope_theta = 10000.0
    window = config.get("sliding_window")
    if family == "qwen2":
        window_used = bool(config.get("use_sliding_window", False)) and window is not None
    else:
        window_used = (
            window is not None
            and bool(config.get("use_sliding_window", True))
            and window < config.get("max_position_embeddings", 2**62)
        )
    if window_used:
        raise _unsupported(
            "sliding_window",
            window,
            "sliding-window attention is not implemented (full causal attention only)",
        )
    if family != "qwen2" and config.get("attention_bias", False):
        raise _unsupported(
            "attention_bias",
            True,
            "Llama-style attention biases (including o_proj.bias) are not implemented",
        )
    if config.get("mlp_bias", False):
        raise _unsupported("mlp_bias", True, "MLP biases are not implemented")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise _unsupported("hidden_act", act, "only the SwiGLU MLP (silu) is implemented")
    if dtype is None:
        raw = config.get("torch_dtype", config.get("dtype"))
        dtype = _TORCH_DTYPES.get(str(raw), "float32")
    n_heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    head_dim = config.get("head_dim")
    return TransformerConfig(
        vocab_size=int(config["vocab_size"]),
        d_model=hidden,
        n_layers=int(config["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
        d_ff=int(config["intermediate_size"]),
        max_seq_len=int(config.get("max_position_embeddings", 2048)),
        rope_theta=float(rope_theta),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        head_dim=int(head_dim) if head_dim is not None else hidden // n_heads,
        attn_bias=family == "qwen2",
        dtype=dtype,
    )


def config_to_hf(cfg: TransformerConfig, *, dtype: str | None = None) -> dict[str, Any]:
    """A Hugging Face `config.json` dictionary for `cfg`.

    Written as `Qwen2ForCausalLM` when the model has q/k/v biases (`cfg.attn_bias`),
    `LlamaForCausalLM` otherwise.
    """
    qwen = cfg.attn_bias
    out: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen else "llama",
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": dtype or cfg.dtype,
    }
    if qwen:
        out.update(use_sliding_window=False, sliding_window=None)
    else:
        out.update(attention_bias=False, mlp_bias=False)
    return out


def _read_tensors(directory: str) -> dict[str, np.ndarray]:
    stnp = _safetensors_numpy()
    index_path = os.path.join(directory, _INDEX)
    single = os.path.join(directory, _SINGLE)
    if os.path.exists(index_path):
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_path}: no `weight_map` object")
        files = sorted(set(weight_map.values()))
    elif os.path.exists(single):
        files = [_SINGLE]
    else:
        raise FileNotFoundError(f"{directory}: neither {_SINGLE} nor {_INDEX} found")
    tensors: dict[str, np.ndarray] = {}
    for name in files:
        if os.path.basename(name) != name:
            raise ValueError(f"{index_path}: shard name {name!r} is not a plain file name")
        tensors.update(stnp.load_file(os.path.join(directory, name)))
    return tensors


def load_hf(directory: str | os.PathLike, *, dtype: str | None = None) -> Policy:
    """Load a Hugging Face Llama / Mistral / Qwen2 causal-LM checkpoint as a `Policy`.

    **Arguments:**

    - `directory`: holds `config.json` and `model.safetensors` or sharded
      `model-*.safetensors` with `model.safetensors.index.json`.
    - `dtype`: parameter dtype (`"float32"`, `"bfloat16"`, `"float16"`); `None` keeps
      the checkpoint's `torch_dtype`.

    **Returns:** a `Policy` whose logits equal the Hugging Face model's (tensor
    mapping in the module docstring).

    Raises `ValueError` naming the config field for unsupported features, and naming
    the tensor for missing or mis-shaped weights. No code from the checkpoint is
    executed (safetensors + JSON only).
    """
    directory = os.fspath(directory)
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    cfg = config_from_hf(config, dtype=dtype)
    tensors = _read_tensors(directory)
    source = directory

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"{source}: tensor {name!r} is missing from the checkpoint")
        return tensors[name]

    def stack(fmt: str) -> np.ndarray:
        return np.stack([get(fmt.format(i)) for i in range(cfg.n_layers)])

    def stack_t(fmt: str) -> np.ndarray:
        return np.swapaxes(stack(fmt), -1, -2)

    attn = "model.layers.{}.self_attn."
    mlp = "model.layers.{}.mlp."
    wqkv = np.concatenate([stack_t(attn + f"{p}_proj.weight") for p in "qkv"], axis=-1)
    arrays: dict[str, np.ndarray | None] = {
        "embed": get("model.embed_tokens.weight"),
        "final_norm": get("model.norm.weight"),
        "lm_head": None if cfg.tie_embeddings else get("lm_head.weight").T,
        "attn_norm": stack("model.layers.{}.input_layernorm.weight"),
        "wqkv": wqkv,
        "wo": stack_t(attn + "o_proj.weight"),
        "mlp_norm": stack("model.layers.{}.post_attention_layernorm.weight"),
        "w_gate_up": np.concatenate(
            [stack_t(mlp + "gate_proj.weight"), stack_t(mlp + "up_proj.weight")], axis=-1
        ),
        "w_down": stack_t(mlp + "down_proj.weight"),
    }
    if cfg.attn_bias:
        arrays["bqkv"] = np.concatenate([stack(attn + f"{p}_proj.bias") for p in "qkv"], axis=-1)
    for name, arr in list(arrays.items()):
        if arr is not None and arr.dtype.kind not in "fV":
            # ml_dtypes bfloat16 has kind 'V'; anything else non-float is an error.
            raise ValueError(f"{source}: weight for {name!r} has non-float dtype {arr.dtype}")
    return _policy_from_arrays(cfg, arrays, source=source)


def save_hf(
    policy: Policy,
    directory: str | os.PathLike,
    *,
    max_shard_bytes: int = 5 * 2**30,
    dtype: str | None = None,
) -> None:
    """Write `policy` as a Hugging Face checkpoint (`config.json` + safetensors).

    **Arguments:**

    - `policy`: a `Policy` without LoRA adapters (merge them first with `merge_lora`,
      or drop them with `without_lora`). Int8-quantised projections are written
      dequantised.
    - `directory`: created if needed; an existing `config.json` and safetensors
      checkpoint there (single file, index and shards) are replaced.
    - `max_shard_bytes`: shard size limit; when the weights exceed it they are split
      into `model-0000i-of-0000n.safetensors` (a tensor larger than the limit gets a
      shard of its own) with `model.safetensors.index.json`, else one
      `model.safetensors`.
    - `dtype`: dtype written (`"float32"`, `"bfloat16"`, `"float16"`); default the
      model's parameter dtype.

    Architecture written: `Qwen2ForCausalLM` with q/k/v biases, else
    `LlamaForCausalLM`. `ValueModel` / `RewardModel` heads are not exported.
    """
    if not isinstance(policy, Policy):
        raise TypeError(f"save_hf exports a Policy, got {type(policy).__name__}")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    layers = policy.transformer.layers
    if layers.lora is not None:
        raise ValueError(
            "save_hf: the policy has LoRA adapters; fold them in with merge_lora(policy) "
            "(or drop them with without_lora(policy)) before exporting"
        )
    cfg = policy.cfg
    dtype = dtype or cfg.dtype
    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"save_hf: dtype must be one of {sorted(_TORCH_DTYPES)}, got {dtype!r}")
    jdt = getattr(jnp, dtype)
    Q, KV, F = cfg.q_size, cfg.kv_size, cfg.d_ff

    def host(w) -> np.ndarray:
        """The whole (stacked) array on the host in the written dtype."""
        if isinstance(w, Int8Weight):
            w = jax.vmap(lambda x: x.dequantize(jnp.float32))(w)
        return np.asarray(jnp.asarray(w).astype(jdt))

    c = np.ascontiguousarray
    T = lambda x: c(np.swapaxes(x, -1, -2))
    wqkv, wo = host(layers.wqkv), host(layers.wo)
    wgu, wdown = host(layers.w_gate_up), host(layers.w_down)
    attn_norm, mlp_norm = host(layers.attn_norm), host(layers.mlp_norm)
    bqkv = None if layers.bqkv is None else host(layers.bqkv)
    tensors: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": c(host(policy.transformer.embed))
    }
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = c(attn_norm[i])
        tensors[p + "self_attn.q_proj.weight"] = T(wqkv[i][:, :Q])
        tensors[p + "self_attn.k_proj.weight"] = T(wqkv[i][:, Q : Q + KV])
        tensors[p + "self_attn.v_proj.weight"] = T(wqkv[i][:, Q + KV :])
        if bqkv is not None:
            tensors[p + "self_attn.q_proj.bias"] = c(bqkv[i][:Q])
            tensors[p + "self_attn.k_proj.bias"] = c(bqkv[i][Q : Q + KV])
            tensors[p + "self_attn.v_proj.bias"] = c(bqkv[i][Q + KV :])
        tensors[p + "self_attn.o_proj.weight"] = T(wo[i])
        tensors[p + "post_attention_layernorm.weight"] = c(mlp_norm[i])
        tensors[p + "mlp.gate_proj.weight"] = T(wgu[i][:, :F])
        tensors[p + "mlp.up_proj.weight"] = T(wgu[i][:, F:])
        tensors[p + "mlp.down_proj.weight"] = T(wdown[i])
    tensors["model.norm.weight"] = c(host(policy.transformer.final_norm))
    if policy.lm_head is not None:
        tensors["lm_head.weight"] = T(host(policy.lm_head))

    shards: list[list[str]] = [[]]
    used = 0
    for name, arr in tensors.items():
        if shards[-1] and used + arr.nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += arr.nbytes

    stnp = _safetensors_numpy()
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    for stale in os.listdir(directory):
        if stale in (_SINGLE, _INDEX) or _SHARD_NAME.fullmatch(stale):
            os.remove(os.path.join(directory, stale))
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config_to_hf(cfg, dtype=dtype), f, indent=2)
    metadata = {"format": "pt"}
    if len(shards) == 1:
        stnp.save_file(tensors, os.path.join(directory, _SINGLE), metadata=metadata)
        return
    n = len(shards)
    weight_map = {}
    for k, names in enumerate(shards, start=1):
        fname = f"model-{k:05d}-of-{n:05d}.safetensors"
        stnp.save_file(
            {name: tensors[name] for name in names},
            os.path.join(directory, fname),
            metadata=metadata,
        )
        weight_map.update({name: fname for name in names})
    index = {
        "metadata": {"total_size": int(sum(a.nbytes for a in tensors.values()))},
        "weight_map": weight_map,
    }
    with open(os.path.join(directory, _INDEX), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
