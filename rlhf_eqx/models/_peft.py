"""LoRA adapters alone, in Hugging Face PEFT's layout (`adapter_config.json` +
`adapter_model.safetensors`).

PEFT names the adapter of projection `proj` of layer `i`
`base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_A.weight` `[r, in]` and
`...lora_B.weight` `[out, r]`, and scales the update by `lora_alpha / r`. rlhf_eqx
stores `a [L, in, r]` and `b [L, r, out]` per target, so `lora_A = a[i]ᵀ` and
`lora_B = b[i]ᵀ`:

| rlhf_eqx target | PEFT module |
| --- | --- |
| `q`, `k`, `v`, `o` | `self_attn.q_proj`, `k_proj`, `v_proj`, `o_proj` |
| `gate`, `up`, `down` | `mlp.gate_proj`, `up_proj`, `down_proj` |

The base model is saved separately (`save_hf(without_lora(model), ...)`); PEFT's
`PeftModel.from_pretrained(base, adapter_dir)` then computes the same logits as the
adapted rlhf_eqx model.
"""

import json
import os
import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

from ._build import model_config, where_layers
from ._hf import _load_file, _read_json, _write_atomically
from ._layers import LoRAAdapter
from ._lora import lora_shapes

_MODULES = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
_PREFIX = "base_model.model.model.layers."
_NAME = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight"
)
_CONFIG, _WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def save_lora_adapter(
    model: PyTree, directory: str | os.PathLike, *, base_model_name_or_path: str | None = None
) -> None:
    """Write `model`'s LoRA adapters (not the base weights) as a PEFT adapter directory.

    **Arguments:**

    - `model`: a `Policy` (or other decoder model) with adapters from `apply_lora`; all
      adapters must share one rank and one scale (as `apply_lora` makes them).
    - `directory`: created if needed; `adapter_config.json` and
      `adapter_model.safetensors` are written there (float32), through a fresh directory
      swapped into place as `save_hf` does (a full disk raises one `OSError` line naming
      the directory, and an adapter already there is kept).
    - `base_model_name_or_path`: recorded in the config for PEFT.
    """
    import safetensors.numpy as stnp

    lora = where_layers(model)(model).lora
    if lora is None:
        raise ValueError("save_lora_adapter: the model has no LoRA adapters; call apply_lora first")
    ranks = {name: int(ad.a.shape[-1]) for name, ad in lora.items()}
    scales = {name: ad.scale for name, ad in lora.items()}
    if len(set(ranks.values())) != 1 or len(set(scales.values())) != 1:
        raise ValueError(
            f"save_lora_adapter: adapters differ in rank {ranks} or scale {scales}; PEFT needs one"
        )
    rank, scale = next(iter(ranks.values())), next(iter(scales.values()))
    dropout = next(iter(lora.values())).dropout
    tensors = {}
    for name, ad in lora.items():
        a, b = np.asarray(ad.a, np.float32), np.asarray(ad.b, np.float32)
        for i in range(a.shape[0]):
            stem = f"{_PREFIX}{i}.{_MODULES[name]}"
            tensors[f"{stem}.lora_A.weight"] = np.ascontiguousarray(a[i].T)
            tensors[f"{stem}.lora_B.weight"] = np.ascontiguousarray(b[i].T)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": rank,
        "lora_alpha": float(f"{scale * rank:.15g}"),  # alpha again, not 7.000000000000001
        "lora_dropout": dropout,
        "target_modules": sorted(_MODULES[n].split(".")[1] for n in lora),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }

    def write(staging: str) -> None:
        with open(os.path.join(staging, _CONFIG), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
        stnp.save_file(tensors, os.path.join(staging, _WEIGHTS), metadata={"format": "pt"})

    _write_atomically(os.path.abspath(os.fspath(directory)), write, "adapter")


def _check(config: dict[str, Any], path: str) -> None:
    if config.get("peft_type") != "LORA":
        raise ValueError(
            f"{path}: `peft_type` = {config.get('peft_type')!r} is not supported: only LORA"
        )
    for field, inactive in (
        ("use_rslora", False),
        ("use_dora", False),
        ("bias", "none"),
        ("fan_in_fan_out", False),
        ("modules_to_save", None),
        ("layers_to_transform", None),
        ("layer_replication", None),
        ("alora_invocation_tokens", None),
        ("trainable_token_indices", None),
    ):
        value = config.get(field, inactive)
        if value != inactive and not (inactive is None and not value):
            raise ValueError(f"{path}: `{field}` = {value!r} is not supported")
    for field in ("rank_pattern", "alpha_pattern"):
        if config.get(field):
            raise ValueError(
                f"{path}: `{field}` = {config[field]!r} is not supported (one rank and alpha)"
            )


def load_lora_adapter(model: PyTree, directory: str | os.PathLike) -> PyTree:
    """Attach the LoRA adapters of a PEFT adapter directory to `model` (a base model
    without adapters). Raises `FileNotFoundError` naming a missing file, and
    `ValueError` naming the file (and field or tensor) for unreadable JSON or
    safetensors, unsupported PEFT options, unknown modules, mis-shaped tensors and
    tensors holding NaN or ±inf."""
    directory = os.fspath(directory)
    where = where_layers(model)
    if where(model).lora is not None:
        raise ValueError("load_lora_adapter: the model already has LoRA adapters")
    cfg = model_config(model)
    config_path = os.path.join(directory, _CONFIG)
    config = _read_json(config_path)
    if not isinstance(config, dict):
        raise ValueError(f"{config_path}: expected a JSON object, got {type(config).__name__}")
    _check(config, config_path)
    for field in ("r", "lora_alpha"):
        value = config.get(field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{config_path}: `{field}` must be a positive number, got {value!r}")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    weights_path = os.path.join(directory, _WEIGHTS)
    tensors = _load_file(weights_path)  # each tensor checked to be finite
    by_module = {v.split(".")[1]: k for k, v in _MODULES.items()}
    found: dict[str, dict[tuple[int, str], np.ndarray]] = {}
    for name, arr in tensors.items():
        m = _NAME.fullmatch(name)
        if m is None or m.group(3) not in by_module or int(m.group(1)) >= cfg.n_layers:
            raise ValueError(f"{weights_path}: unexpected tensor {name!r}")
        found.setdefault(by_module[m.group(3)], {})[(int(m.group(1)), m.group(4))] = arr
    shapes = lora_shapes(cfg)
    adapters = {}
    for target, parts in found.items():
        fan_in, fan_out = shapes[target]
        a, b = [], []
        for i in range(cfg.n_layers):
            for part, expected, out in (("A", (rank, fan_in), a), ("B", (fan_out, rank), b)):
                name = f"{_PREFIX}{i}.{_MODULES[target]}.lora_{part}.weight"
                if (i, part) not in parts:
                    raise ValueError(f"{weights_path}: tensor {name!r} is missing")
                if parts[(i, part)].shape != expected:
                    raise ValueError(
                        f"{weights_path}: tensor {name!r} has shape {parts[(i, part)].shape}, "
                        f"expected {expected}"
                    )
                out.append(parts[(i, part)].T)
        make = lambda a, b: LoRAAdapter(
            a=a, b=b, scale=alpha / rank, dropout=float(config.get("lora_dropout", 0.0))
        )
        adapters[target] = jax.vmap(make)(
            jnp.asarray(np.stack(a), jnp.float32), jnp.asarray(np.stack(b), jnp.float32)
        )
    return eqx.tree_at(lambda m: where(m).lora, model, adapters, is_leaf=lambda x: x is None)
