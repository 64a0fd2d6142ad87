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
adapted rlhf_eqx model. The adapter goes onto whichever base the caller passes:
`base_model_name_or_path` is only recorded (`null`, as PEFT writes it, when unknown) and
may be missing or `null` when loading.

**Ranks and scales.** PEFT gives the module `model.layers.{i}.{self_attn|mlp}.{proj}`
the rank `rank_pattern[key]` and alpha `alpha_pattern[key]` for the first key of each
dict that matches the end of the name after a dot (`re.match(rf"(.*\\.)?({key})$",
name)`, PEFT's `get_pattern_key`), else `r` and `lora_alpha`; its update is
`B·A·x · alpha / r`, or with `use_rslora` `B·A·x · alpha / √r`. Where the layers of a
projection share one rank and scale it is a `LoRAAdapter`; otherwise (and always with
`use_rslora`) a `LayerwiseLoRAAdapter` (zero-padded to the largest rank, per-layer
scale). Saving writes the most common rank and alpha as `r` / `lora_alpha` and the
others as patterns, keyed by the projection (`"q_proj"`) when all its layers agree, else
by layer (`"layers.3.self_attn.q_proj"`), in both patterns, which PEFT versions before
and after its `(.*\\.)?` prefix match alike.

**Which layers.** PEFT adapts the modules `target_modules` selects (a regex the whole
name matches, or names the module name ends with, then only the layers of
`layers_to_transform`), less `exclude_modules`; the other layers of an adapted
projection get rank 0 (a `LayerwiseLoRAAdapter` holding zeros there). Saving writes
`layers_to_transform` where the adapted projections share their layers, else one
`target_modules` regex. A tensor of a module the config does not adapt is refused
(PEFT would drop it).

**DoRA.** With `use_dora` (PEFT's switch, one for the whole adapter) each adapted
module also has `...{proj}.lora_magnitude_vector` `[out]` (float32 here): the magnitude
`m` of `DoRAAdapter`, one value per output feature (PEFT's DoRA on a `Linear` stores
`‖W + s·B A‖` over the input dimension of `W [out, in]`, the same numbers). Saving a
model whose adapters are all `DoRAAdapter`s writes `use_dora: true` and those tensors;
a mix of DoRA and plain adapters cannot be one PEFT config and is refused.

**Reward and value models.** A `RewardModel` or `ValueModel` is saved as PEFT saves a
sequence classifier's adapter (`task_type` `SEQ_CLS`, `modules_to_save` `["classifier",
"score"]`): its head as `base_model.model.score.weight` `[1, D]` beside the adapters, so
that `PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(base,
num_labels=1), adapter_dir)` scores as the model does (its `bias` must be zero: the
`score` layer has none). Loading such an adapter onto a `RewardModel` / `ValueModel`
sets `head` from that tensor and `bias` to zero; onto a `Policy` it is refused.
"""

import json
import math
import os
import re
from collections import Counter
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

from ._build import check_finite, model_config, where_layers
from ._heads import RewardModel, ValueModel
from ._hf import _load_file, _read_json, _write_atomically
from ._layers import LoRAAdapter
from ._lora import (
    DoRAAdapter,
    LayerwiseLoRAAdapter,
    base_columns,
    dora_magnitude,
    layer_ranks_and_scales,
    lora_shapes,
)

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
_SCORE = "base_model.model.score.weight"  # a sequence classifier's head, `[1, D]`
_SCORE_MODULES = ["classifier", "score"]  # PEFT's `modules_to_save` for `SEQ_CLS`
_NAME = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\."
    r"(?:lora_([AB])\.weight|lora_(magnitude_vector))"
)
_CONFIG, _WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_PICKLED = "adapter_model.bin"  # PEFT before 0.6 and `safe_serialization=False`


def _alpha(scale: float | int, rank: int, rslora: bool, exact: bool) -> float:
    """The `lora_alpha` of `scale` at `rank`: `scale·r` (`scale·√r` with rsLoRA), as the
    shortest decimal that gives `scale` again (`exact`: a float64 scale, else a float32
    one, which `alpha / r` need only round to)."""
    div = math.sqrt(rank) if rslora else rank
    alpha = scale * div
    if exact:
        return float(f"{alpha:.15g}")
    for digits in range(1, 18):
        short = float(f"{alpha:.{digits}g}")
        if np.float32(short / div) == np.float32(scale):
            return short
    return alpha


def _layer_key(target: str, i: int) -> str:
    return f"layers.{i}.{_MODULES[target]}"


def _patterns(lora: dict, n_layers: int) -> tuple[int, float, bool, dict, dict]:
    """`(r, lora_alpha, use_rslora, rank_pattern, alpha_pattern)` of the adapters (see
    the module docstring); layers of rank 0 (not adapted) are left out."""
    rslora = any(getattr(ad, "rslora", False) for ad in lora.values())
    per: dict[str, dict[int, tuple[int, float]]] = {}
    for name, ad in lora.items():
        ranks, scales = layer_ranks_and_scales(ad, n_layers)
        exact = isinstance(ad, LoRAAdapter)  # a float64 scale; the others are float32
        per[name] = {
            i: (r, _alpha(sc, r, rslora, exact))
            for i, (r, sc) in enumerate(zip(ranks, scales))
            if r > 0
        }
    counts = Counter(pair for pairs in per.values() for pair in pairs.values())
    rank = Counter(r for r, _ in counts.elements()).most_common(1)[0][0]
    alpha = Counter(a for _, a in counts.elements()).most_common(1)[0][0]
    rank_pattern, alpha_pattern = {}, {}
    for name, pairs in per.items():
        keys = (
            {_MODULES[name].split(".")[1]: next(iter(pairs.values()))}
            if len(set(pairs.values())) == 1
            else {_layer_key(name, i): pair for i, pair in pairs.items()}
        )
        for key, (r, a) in keys.items():
            if (r, a) != (rank, alpha):
                rank_pattern[key], alpha_pattern[key] = r, a
    return rank, alpha, rslora, rank_pattern, alpha_pattern


def _selection(lora: dict, n_layers: int) -> tuple[list[str] | str, list[int] | None]:
    """`(target_modules, layers_to_transform)` naming the adapted layers (rank > 0): the
    projections' names when every layer is adapted or the same layers of each, else one
    regex that PEFT matches against whole module names."""
    layers = {
        name: [i for i, r in enumerate(layer_ranks_and_scales(ad, n_layers)[0]) if r > 0]
        for name, ad in lora.items()
    }
    names = sorted(_MODULES[n].split(".")[1] for n in lora)
    if all(len(v) == n_layers for v in layers.values()):
        return names, None
    if len({tuple(v) for v in layers.values()}) == 1:
        return names, next(iter(layers.values()))
    return "|".join(
        rf"model\.layers\.({'|'.join(map(str, v))})\.{re.escape(_MODULES[n])}"
        for n, v in layers.items()
    ), None


def save_lora_adapter(
    model: PyTree, directory: str | os.PathLike, *, base_model_name_or_path: str | None = None
) -> None:
    """Write `model`'s LoRA adapters (not the base weights) as a PEFT adapter directory.

    **Arguments:**

    - `model`: a `Policy` (or other decoder model) with adapters from `apply_lora` or
      `load_lora_adapter`; a `RewardModel` / `ValueModel` is written with its head as a
      sequence classifier's (see the module docstring; a nonzero `bias` is a
      `ValueError`). Adapters that differ in rank or scale, by projection or by
      layer, are written with PEFT's `rank_pattern` / `alpha_pattern`, and those loaded
      with `use_rslora` with it again (see the module docstring). `DoRAAdapter`s are
      written with `use_dora` and their magnitudes (`lora_magnitude_vector`).
    - `directory`: created if needed; `adapter_config.json` and
      `adapter_model.safetensors` are written there (float32), through a fresh directory
      swapped into place as `save_hf` does (a full disk raises one `OSError` line naming
      the directory, and an adapter already there is kept). An adapter (or score head)
      holding NaN or ±inf is a `ValueError` naming the tensor, and nothing is written.
    - `base_model_name_or_path`: recorded in the config for PEFT (`null` when not given,
      as PEFT writes it for a base without a name).
    """
    import safetensors.numpy as stnp

    lora = where_layers(model)(model).lora
    if lora is None:
        raise ValueError("save_lora_adapter: the model has no LoRA adapters; call apply_lora first")
    scorer = isinstance(model, (RewardModel, ValueModel))
    if scorer and float(model.bias) != 0.0:
        raise ValueError(
            f"save_lora_adapter: the {type(model).__name__}'s `bias` is {float(model.bias)}, "
            "but PEFT's score head (a ...ForSequenceClassification `score`) has no bias; set "
            "it to zero first (eqx.tree_at(lambda m: m.bias, model, jnp.zeros(()))): a "
            "Bradley-Terry reward does not change"
        )
    n_layers = model_config(model).n_layers
    rank, alpha, rslora, rank_pattern, alpha_pattern = _patterns(lora, n_layers)
    target_modules, layers_to_transform = _selection(lora, n_layers)
    dropout = next(iter(lora.values())).dropout
    dora = {name for name, ad in lora.items() if isinstance(ad, DoRAAdapter)}
    if dora and len(dora) != len(lora):
        raise ValueError(
            f"save_lora_adapter: the adapters of {sorted(dora)} are DoRA and those of "
            f"{sorted(set(lora) - dora)} are not; PEFT's `use_dora` holds for the whole "
            "adapter: attach them all with or all without use_dora"
        )
    tensors = {}
    for name, ad in lora.items():
        a, b = np.asarray(ad.a, np.float32), np.asarray(ad.b, np.float32)
        ranks, _ = layer_ranks_and_scales(ad, n_layers)
        for i in range(a.shape[0]):
            stem = f"{_PREFIX}{i}.{_MODULES[name]}"
            r = ranks[i]
            if r == 0:  # layer not adapted
                continue
            tensors[f"{stem}.lora_A.weight"] = np.ascontiguousarray(a[i][:, :r].T)
            tensors[f"{stem}.lora_B.weight"] = np.ascontiguousarray(b[i][:r].T)
            if name in dora:
                magnitude = np.asarray(ad.magnitude[i], np.float32)
                tensors[f"{stem}.lora_magnitude_vector"] = magnitude
    if scorer:
        tensors[_SCORE] = np.asarray(model.head, np.float32)[None]
    for name, arr in tensors.items():  # what load_lora_adapter would refuse to read back
        try:
            check_finite(arr, name=name, source=f"save_lora_adapter: {os.fspath(directory)}")
        except ValueError as e:
            why = str(e).split(": the checkpoint is corrupt")[0]
            raise ValueError(f"{why} (a diverged model?); nothing written") from None
    config = {
        "peft_type": "LORA",
        "task_type": "SEQ_CLS" if scorer else "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": rank,
        "lora_alpha": alpha,  # alpha again, not 7.000000000000001
        "lora_dropout": dropout,
        "target_modules": target_modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": rslora,
        "use_dora": bool(dora),
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": _SCORE_MODULES if scorer else None,
        "layers_to_transform": layers_to_transform,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
    }

    def write(staging: str) -> None:
        with open(os.path.join(staging, _CONFIG), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
        stnp.save_file(tensors, os.path.join(staging, _WEIGHTS), metadata={"format": "pt"})

    target = os.path.abspath(os.fspath(directory))
    if os.path.exists(target) and not os.path.isdir(target):
        raise ValueError(f"save_lora_adapter: {target} exists and is not a directory")
    _write_atomically(target, write, "adapter")


# PEFT initialisations that replace the base weights by a residual (PiSSA, OLoRA, CorDA,
# LoRA-GA) or by a quantised residual (LoftQ)
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "lora_ga", "loftq")


def _check(config: dict[str, Any], path: str) -> None:
    if config.get("peft_type") != "LORA":
        raise ValueError(
            f"{path}: `peft_type` = {config.get('peft_type')!r} is not supported: only LORA"
        )
    if not isinstance(config.get("use_dora", False), bool):
        value = config["use_dora"]
        raise ValueError(f"{path}: `use_dora` must be true or false, got {value!r}")
    for field, inactive in (
        ("fan_in_fan_out", False),
        ("layer_replication", None),
        ("alora_invocation_tokens", None),
        ("trainable_token_indices", None),
        ("lora_bias", False),
        ("use_qalora", False),
        ("target_parameters", None),
    ):
        value = config.get(field, inactive)
        if value != inactive and not (inactive is None and not value):
            raise ValueError(f"{path}: `{field}` = {value!r} is not supported")
    saved = config.get("modules_to_save") or []
    if not isinstance(saved, list) or not set(saved) <= set(_SCORE_MODULES):
        raise ValueError(f"{path}: `modules_to_save` = {saved!r} is not supported")
    # LoRA variants PEFT switches on by any sub-config, even an empty one
    for field in ("kasa_config", "monteclora_config", "use_bdlora", "arrow_config"):
        if config.get(field) is not None:
            raise ValueError(f"{path}: `{field}` = {config[field]!r} is not supported")
    if config.get("bias", "none") not in ("none", "all", "lora_only"):
        raise ValueError(f"{path}: `bias` = {config['bias']!r} is not one of none, all, lora_only")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise ValueError(
            f"{path}: `init_lora_weights` = {init!r}: PEFT changed the base weights when it "
            "made this adapter (it holds the update from that changed base), so on the original "
            "base it computes something else; convert it with PEFT first "
            "(`save_pretrained(..., path_initial_model_for_weight_conversion=...)`, a plain "
            "LoRA of the original base)"
        )
    for field in ("r", "lora_alpha"):
        _positive(config.get(field), f"`{field}`", path)
    if not isinstance(config.get("use_rslora", False), bool):
        value = config["use_rslora"]
        raise ValueError(f"{path}: `use_rslora` must be true or false, got {value!r}")
    for field in ("rank_pattern", "alpha_pattern"):
        pattern = config.get(field) or {}
        if not isinstance(pattern, dict):
            raise ValueError(f"{path}: `{field}` must be an object, got {pattern!r}")
        for key, value in pattern.items():
            _positive(value, f"`{field}[{key!r}]`", path)
            try:
                re.compile(key)
            except re.error as e:
                raise ValueError(f"{path}: `{field}` key {key!r} is not a regex ({e})") from None
    for field in ("target_modules", "exclude_modules", "layers_pattern"):
        value = config.get(field)
        names = [value] if isinstance(value, str) else value
        if names is not None and not (
            isinstance(names, list) and all(isinstance(n, str) for n in names)
        ):
            raise ValueError(f"{path}: `{field}` must be a string or a list of them, got {value!r}")
        for pattern in names or []:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"{path}: `{field}` {pattern!r} is not a regex ({e})") from None
    layers = config.get("layers_to_transform")
    indices = [layers] if isinstance(layers, int) else layers
    if indices is not None and not (
        isinstance(indices, list)
        and all(isinstance(i, int) and not isinstance(i, bool) for i in indices)
    ):
        raise ValueError(f"{path}: `layers_to_transform` must be layer indices, got {layers!r}")
    for key, value in (config.get("rank_pattern") or {}).items():
        if value != int(value):
            raise ValueError(f"{path}: `rank_pattern[{key!r}]` must be an integer, got {value!r}")


def _positive(value: object, what: str, path: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{path}: {what} must be a positive number, got {value!r}")


def _pattern_value(pattern: dict[str, Any], name: str, default: float | int) -> float | int:
    """PEFT's `get_pattern_key`: the value of the first key matching the end of `name`
    after a dot (or the whole name), else `default`."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def _layer_ranks_and_alphas(
    config: dict[str, Any], target: str, n_layers: int
) -> tuple[list[int], list[float]]:
    """Each layer's rank and alpha of the projection `target`, as PEFT assigns them."""
    ranks, alphas = [], []
    for i in range(n_layers):
        name = f"model.layers.{i}.{_MODULES[target]}"
        ranks.append(int(_pattern_value(config.get("rank_pattern") or {}, name, config["r"])))
        alphas.append(
            float(_pattern_value(config.get("alpha_pattern") or {}, name, config["lora_alpha"]))
        )
    return ranks, alphas


def _matches(patterns: str | list[str], name: str) -> bool:
    """PEFT's module match: a string is a regex the whole name matches, a list names
    modules by their whole name or the end of it after a dot."""
    if isinstance(patterns, str):
        return re.fullmatch(patterns, name) is not None
    return name in patterns or any(name.endswith(f".{p}") for p in patterns)


def _targeted(config: dict[str, Any], name: str) -> bool:
    """Whether PEFT adapts module `name` (its `check_target_module_exists`): not in
    `exclude_modules`, matched by `target_modules` (none: every module with tensors) and,
    for a list of names, in `layers_to_transform` (the index after `layers_pattern`, which
    may begin the name, by default after the first dotted name with a number behind it)."""
    if config.get("exclude_modules") and _matches(config["exclude_modules"], name):
        return False
    targets = config.get("target_modules")
    if isinstance(targets, str) and targets.lower() == "all-linear":
        targets = None  # expanded by PEFT when saving; here every projection
    if targets is None or isinstance(targets, str) or name in targets:
        return targets is None or _matches(targets, name)
    if not _matches(targets, name):
        return False
    layers = config.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    patterns = config.get("layers_pattern")
    patterns = [patterns] if isinstance(patterns, str) else patterns
    regexes = (
        [rf"(?:^|.*?\.){p}\.(\d+)\." for p in patterns] if patterns else [r".*?\.[^.]*\.(\d+)\."]
    )
    for regex in regexes:
        m = re.match(regex, name)
        if m is not None:
            index = int(m.group(1))
            return index == layers if isinstance(layers, int) else index in layers
    return False


def load_lora_adapter(model: PyTree, directory: str | os.PathLike) -> PyTree:
    """Attach the LoRA adapters of a PEFT adapter directory to `model` (a base model
    without adapters), whatever base the config's `base_model_name_or_path` names (it may
    be missing or `null`).

    Per-layer ranks and alphas (`rank_pattern`, `alpha_pattern`) and rank-stabilised
    scaling (`use_rslora`: `alpha / √r`) are read as PEFT reads them (see the module
    docstring). PEFT's `bias` = `"all"` / `"lora_only"` also trains the biases of the base
    model and saves them beside the adapter; with no bias tensor saved (the adapted
    modules have none) the adapter is a plain LoRA and loads, a saved bias is refused.
    Raises `FileNotFoundError` naming a missing file, and `ValueError` naming the file
    (and field or tensor) for unreadable JSON or safetensors, unsupported PEFT options
    (`lora_bias`, `modules_to_save`, ...), unknown modules, mis-shaped tensors and
    tensors holding NaN or ±inf. With `use_dora` the adapters are `DoRAAdapter`s holding
    the `lora_magnitude_vector` tensors, on a dense or quantised base (which they read
    at call time, holding no copy of it)."""
    directory = os.fspath(directory)
    where = where_layers(model)
    if where(model).lora is not None:
        raise ValueError("load_lora_adapter: the model already has LoRA adapters")
    cfg = model_config(model)
    if not os.path.isdir(directory):
        what = "not a directory" if os.path.exists(directory) else "no such directory"
        raise FileNotFoundError(
            f"{directory}: {what} (load_lora_adapter reads a PEFT adapter directory: "
            f"{_CONFIG} and {_WEIGHTS})"
        )
    config_path = os.path.join(directory, _CONFIG)
    if not os.path.exists(config_path) and os.path.exists(os.path.join(directory, "config.json")):
        raise FileNotFoundError(
            f"{config_path}: file not found; {directory} holds a model checkpoint "
            "(config.json), not a PEFT adapter: load it with load_hf"
        )
    config = _read_json(config_path)
    if not isinstance(config, dict):
        raise ValueError(f"{config_path}: expected a JSON object, got {type(config).__name__}")
    _check(config, config_path)
    rslora = bool(config.get("use_rslora", False))
    dora = bool(config.get("use_dora", False))
    dropout = config.get("lora_dropout")
    dropout = 0.0 if dropout is None else dropout
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        raise ValueError(
            f"{config_path}: `lora_dropout` must be a number in [0, 1), got {dropout!r}"
        )
    dropout = float(dropout)
    weights_path = os.path.join(directory, _WEIGHTS)
    if not os.path.exists(weights_path) and os.path.exists(os.path.join(directory, _PICKLED)):
        raise FileNotFoundError(
            f"{weights_path}: file not found; the adapter's tensors are in {_PICKLED} (a "
            "PyTorch pickle, not read here): write them again as safetensors with PEFT "
            "(`PeftModel.from_pretrained(base, dir).save_pretrained(dir)`)"
        )
    tensors = _load_file(weights_path)  # each tensor checked to be finite
    by_module = {v.split(".")[1]: k for k, v in _MODULES.items()}
    found: dict[str, dict[tuple[int, str], np.ndarray]] = {}
    score = tensors.pop(_SCORE, None)
    if score is not None:
        model = _with_score(model, score, weights_path)
    for name, arr in tensors.items():
        if name.endswith(".bias"):
            raise ValueError(
                f"{weights_path}: tensor {name!r} is a bias of the base model that PEFT trained "
                f"(`bias` = {config.get('bias')!r}); an adapter here holds LoRA tensors only: "
                "merge it with PEFT (`merge_and_unload`) and load the merged checkpoint"
            )
        m = _NAME.fullmatch(name)
        if m is None or m.group(3) not in by_module:
            raise ValueError(f"{weights_path}: unexpected tensor {name!r} ({_unexpected(name)})")
        if int(m.group(1)) >= cfg.n_layers:
            raise ValueError(
                f"{weights_path}: tensor {name!r} adapts layer {m.group(1)}, but the base model "
                f"has {cfg.n_layers} layers (an adapter of another base model?)"
            )
        if arr.dtype.kind not in "fV":  # ml_dtypes bfloat16 has kind 'V'
            raise ValueError(f"{weights_path}: tensor {name!r} has non-float dtype {arr.dtype}")
        if m.group(5) and not dora:
            raise ValueError(
                f"{weights_path}: tensor {name!r} is a DoRA magnitude but `use_dora` is "
                f"{config.get('use_dora')!r} in {_CONFIG}"
            )
        found.setdefault(by_module[m.group(3)], {})[(int(m.group(1)), m.group(4) or "M")] = arr
    if not found:
        raise ValueError(
            f"{weights_path}: no LoRA tensor (`target_modules` = "
            f"{config.get('target_modules')!r}): PEFT refuses target modules that name no "
            f"module of the model; rlhf_eqx adapts the decoder layers' "
            f"{', '.join(v.split('.')[1] for v in _MODULES.values())}"
            f"{_string_target_hint(config)}"
        )
    shapes = lora_shapes(cfg)
    adapters = {}
    for target, parts in found.items():
        fan_in, fan_out = shapes[target]
        ranks, alphas = _layer_ranks_and_alphas(config, target, cfg.n_layers)
        adapted = [
            _targeted(config, f"model.layers.{i}.{_MODULES[target]}") for i in range(cfg.n_layers)
        ]
        for i, part in parts:
            if not adapted[i]:
                suffix = "lora_magnitude_vector" if part == "M" else f"lora_{part}.weight"
                raise ValueError(
                    f"{weights_path}: tensor {_PREFIX}{i}.{_MODULES[target]}.{suffix} "
                    "belongs to a module that `target_modules` / `layers_to_transform` / "
                    f"`exclude_modules` do not adapt{_string_target_hint(config)}"
                )
        ranks = [r if on else 0 for r, on in zip(ranks, adapted)]
        width = max(ranks)
        a = np.zeros((cfg.n_layers, fan_in, width), np.float32)
        b = np.zeros((cfg.n_layers, width, fan_out), np.float32)
        for i, r in enumerate(ranks):
            if r == 0:
                continue
            for part, expected, out in (("A", (r, fan_in), a), ("B", (fan_out, r), b)):
                name = f"{_PREFIX}{i}.{_MODULES[target]}.lora_{part}.weight"
                if (i, part) not in parts:
                    covered = 1 + max(layer for layer, _ in parts)
                    hint = (
                        f" (the adapter covers {covered} layers, the base model has "
                        f"{cfg.n_layers}: an adapter of another base model?)"
                        if covered < cfg.n_layers
                        else ""
                    )
                    raise ValueError(f"{weights_path}: tensor {name!r} is missing{hint}")
                got = parts[(i, part)].shape
                if got != expected:
                    fan = 1 if part == "A" else 0  # the axis that is not the rank
                    hint = (
                        f"rank {r}, from `r` / `rank_pattern`"
                        if len(got) == 2 and got[fan] == expected[fan]
                        else f"the base model's {target} projection is {fan_in} → {fan_out}: "
                        "an adapter of another base model?"
                    )
                    raise ValueError(
                        f"{weights_path}: tensor {name!r} has shape {got}, expected {expected} "
                        f"({hint})"
                    )
                if part == "A":
                    out[i, :, :r] = parts[(i, part)].T
                else:
                    out[i, :r] = parts[(i, part)].T
        scales = [
            al / (math.sqrt(r) if rslora else r) if r else 0.0 for r, al in zip(ranks, alphas)
        ]
        if dora:
            adapters[target] = _dora_adapter(
                where(model),
                target,
                cfg,
                parts,
                (a, b),
                ranks,
                scales,
                (dropout, rslora),
                weights_path,
            )
        elif rslora or len(set(zip(ranks, scales))) > 1:
            adapters[target] = LayerwiseLoRAAdapter(
                a=jnp.asarray(a),
                b=jnp.asarray(b),
                scale=jnp.asarray(scales, jnp.float32),
                ranks=tuple(ranks),
                dropout=dropout,
                rslora=rslora,
            )
        else:
            make = lambda a, b: LoRAAdapter(a=a, b=b, scale=scales[0], dropout=dropout)
            adapters[target] = jax.vmap(make)(jnp.asarray(a), jnp.asarray(b))
    return eqx.tree_at(lambda m: where(m).lora, model, adapters, is_leaf=lambda x: x is None)


def _dora_adapter(layers, target, cfg, parts, ab, ranks, scales, flags, path) -> DoRAAdapter:
    """The `DoRAAdapter` of projection `target` from its loaded `a`, `b` and the
    `lora_magnitude_vector` tensors `[out]` of its adapted layers (`parts[(i, "M")]`);
    a layer without an adapter gets its base column norms (it adds nothing)."""
    a, b = ab
    dropout, rslora = flags
    weight, columns = base_columns(layers, target, cfg)
    scale = jnp.asarray(scales, jnp.float32)
    magnitude = np.array(dora_magnitude(weight, columns, jnp.asarray(a), jnp.asarray(b), scale))
    fan_out = columns[1] - columns[0]
    for i, r in enumerate(ranks):
        if r == 0:
            continue
        name = f"{_PREFIX}{i}.{_MODULES[target]}.lora_magnitude_vector"
        if (i, "M") not in parts:
            raise ValueError(f"{path}: tensor {name!r} is missing (`use_dora` is true)")
        got = parts[(i, "M")]
        if got.shape != (fan_out,):
            raise ValueError(
                f"{path}: tensor {name!r} has shape {got.shape}, expected ({fan_out},) (one "
                f"magnitude per output feature of the base model's {target} projection)"
            )
        magnitude[i] = np.asarray(got, np.float32)
    stray = sorted(i for i, part in parts if part == "M" and ranks[i] == 0)
    if stray:
        raise ValueError(
            f"{path}: tensor {_PREFIX}{stray[0]}.{_MODULES[target]}.lora_magnitude_vector "
            "belongs to a module without lora_A / lora_B"
        )
    return DoRAAdapter(
        a=jnp.asarray(a),
        b=jnp.asarray(b),
        magnitude=jnp.asarray(magnitude),
        scale=scale,
        ranks=tuple(ranks),
        dropout=dropout,
        rslora=rslora,
    )


def _string_target_hint(config: dict[str, Any]) -> str:
    """Why a string `target_modules` may select nothing: PEFT reads it as a regex."""
    targets = config.get("target_modules")
    if not isinstance(targets, str) or targets.lower() == "all-linear":
        return ""
    return (
        f" (`target_modules` is the string {targets!r}, which PEFT reads as a regex the "
        "whole module name, such as model.layers.0.self_attn.q_proj, must match; a list "
        'such as ["q_proj"] names modules by the end of their names)'
    )


def _unexpected(name: str) -> str:
    """Why the adapter tensor `name` has no place in rlhf_eqx's LoRA."""
    if not name.startswith(_PREFIX):
        return (
            "a module outside the decoder layers, such as embed_tokens or lm_head; rlhf_eqx "
            "adapts the layers' projections only"
        )
    modules = ", ".join(v.split(".")[1] for v in _MODULES.values())
    return f"rlhf_eqx adapts the layers' {modules} with lora_A / lora_B only"


def _with_score(model: PyTree, score: np.ndarray, path: str) -> PyTree:
    """`model` (a `RewardModel` / `ValueModel`) reading out with the saved score head:
    `head = score[0]`, `bias = 0` (PEFT's `score` is a `Linear` without bias)."""
    if not isinstance(model, (RewardModel, ValueModel)):
        raise ValueError(
            f"{path}: tensor {_SCORE!r} is the score head of a sequence classifier (`task_type` "
            f"SEQ_CLS); load the adapter onto a RewardModel or ValueModel, not a "
            f"{type(model).__name__}"
        )
    d_model = model_config(model).d_model
    if score.dtype.kind not in "fV":  # ml_dtypes bfloat16 has kind 'V'
        raise ValueError(f"{path}: tensor {_SCORE!r} has non-float dtype {score.dtype}")
    if score.shape != (1, d_model):
        raise ValueError(
            f"{path}: tensor {_SCORE!r} has shape {score.shape}, expected (1, {d_model}) (one "
            "label, the base model's width)"
        )
    head = jnp.asarray(score[0], jnp.float32)
    return eqx.tree_at(lambda m: (m.head, m.bias), model, (head, jnp.zeros((), jnp.float32)))
