"""Hugging Face `config.json` → `TransformerConfig` for every supported family
(the way back is `_hf_export.config_to_hf`).

| family | `architectures` / `model_type` | switches set |
| --- | --- | --- |
| Llama 2/3.x | `LlamaForCausalLM` / `llama` | `rope_scaling` (`llama3`, `linear`, `yarn`) |
| Mistral | `MistralForCausalLM` / `mistral` | `sliding_window` on every layer |
| Qwen2/2.5 | `Qwen2ForCausalLM` / `qwen2` | `attn_bias`; window on layers ≥ `max_window_layers` with `use_sliding_window` |
| Qwen3 | `Qwen3ForCausalLM` / `qwen3` | `qk_norm` (no q/k/v bias) |
| Gemma | `GemmaForCausalLM` / `gemma` | `norm_plus_one`, `embed_scale`, `gelu_tanh` |
| Gemma 2 | `Gemma2ForCausalLM` / `gemma2` | + `post_norms`, soft-caps, `query_scale`, alternating windows |
| Gemma 3 (text) | `Gemma3ForCausalLM` / `gemma3_text` | + `qk_norm`, `rope_local_theta`, window pattern |

Fields that would change the architecture but are not implemented (other rope types,
`partial_rotary_factor`, `attention_bias` on Llama, `mlp_bias`, bidirectional
attention, a `quantization_config`, ...) are refused with a `ValueError` naming the field
and the file. A field that `config.json` leaves out takes the default of transformers'
config class for the family (e.g. Gemma 2's soft-caps 50 / 30, `head_dim` 256), as
transformers reads it.
"""  # noqa: E501 (markdown table rows cannot be wrapped)

import math
import re
from typing import Any

from ._config import RopeScaling, TransformerConfig

# family -> (architecture, model_type)
FAMILIES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma": ("GemmaForCausalLM", "gemma"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}
# family -> sequence-classification architecture (a backbone plus `score.weight [labels, D]`)
SCORERS = {
    "llama": "LlamaForSequenceClassification",
    "mistral": "MistralForSequenceClassification",
    "qwen2": "Qwen2ForSequenceClassification",
    "qwen3": "Qwen3ForSequenceClassification",
    "gemma": "GemmaForSequenceClassification",
    "gemma2": "Gemma2ForSequenceClassification",
    "gemma3": "Gemma3TextForSequenceClassification",
}
GEMMA = ("gemma", "gemma2", "gemma3")
_TORCH_DTYPES = ("float32", "bfloat16", "float16")
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")
_UNSET = object()

# Fields whose absence from `config.json` transformers fills with its config class's
# default (not with the value derived from the other sizes): a checkpoint that leaves
# them out must read as transformers reads it. A field present as `null` keeps `None`.
_CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": 4096},
    "qwen2": {"sliding_window": 4096, "max_window_layers": 28},
    "qwen3": {"head_dim": 128, "sliding_window": 4096, "max_window_layers": 28},
    "gemma": {"head_dim": 256},
    "gemma2": {
        "head_dim": 256,
        "sliding_window": 4096,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "query_pre_attn_scalar": 256,
    },
    "gemma3": {"head_dim": 256, "sliding_window": 4096, "query_pre_attn_scalar": 256},
}

# Fields that change the architecture when set; each is refused unless the family
# implements it (value considered inactive when None / False / the listed default).
_ARCH_FIELDS: dict[str, tuple[Any, tuple[str, ...]]] = {
    "attention_bias": (False, ("qwen2",)),
    "mlp_bias": (False, ()),
    "partial_rotary_factor": (1.0, ()),
    "qk_layernorm": (False, ()),
    "use_qk_norm": (False, ()),
    "attn_logit_softcapping": (None, ("gemma2", "gemma3")),
    "final_logit_softcapping": (None, ("gemma2", "gemma3")),
    "use_bidirectional_attention": (False, ()),
    "num_experts": (None, ()),
    "num_local_experts": (None, ()),
    "layer_norm_type": (None, ()),
    "position_embedding_type": (None, ()),
    "logits_scaling": (None, ()),
    "embedding_multiplier": (None, ()),
    "residual_multiplier": (None, ()),
    "attention_multiplier": (None, ()),
}


def _err(source: str, field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"{source}: `{field}` = {value!r} is not supported: {why}")


def _family(config: dict[str, Any], source: str) -> str:
    archs = config.get("architectures") or []
    by_arch = {arch: fam for fam, (arch, _) in FAMILIES.items()}
    by_arch.update({arch: fam for fam, arch in SCORERS.items()})
    known = [a for a in archs if a in by_arch]
    if known:
        return by_arch[known[0]]
    by_type = {mt: fam for fam, (_, mt) in FAMILIES.items()}
    if not archs and config.get("model_type") in by_type:
        return by_type[config["model_type"]]
    raise _err(
        source,
        "architectures",
        archs or config.get("model_type"),
        "supported architectures are "
        f"{sorted(a for a, _ in FAMILIES.values()) + sorted(SCORERS.values())}",
    )


def hf_head(config: dict[str, Any], *, source: str = "config.json") -> str:
    """`"lm"` for a causal-LM checkpoint, `"score"` for a one-label sequence classifier."""
    _family(config, source)
    archs = config.get("architectures") or []
    if not any(a in SCORERS.values() for a in archs):
        return "lm"
    labels = config.get("num_labels", len(config.get("id2label") or {"0": "LABEL_0"}))
    if labels != 1:
        raise _err(
            source,
            "id2label",
            config.get("id2label", labels),
            "a reward model has exactly one label",
        )
    return "score"


def _int(config, name: str, source: str, default: Any = _UNSET) -> int | None:
    value = config.get(name)
    if value is None:
        if default is _UNSET:
            raise ValueError(f"{source}: required field `{name}` is missing")
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not float(value).is_integer()
    ):
        raise ValueError(f"{source}: `{name}` must be an integer, got {value!r}")
    return int(value)


def _float(config, name: str, source: str, default: Any = _UNSET) -> float | None:
    value = config.get(name)
    if value is None:
        if default is _UNSET:
            raise ValueError(f"{source}: required field `{name}` is missing")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{source}: `{name}` must be a number, got {value!r}")
    return float(value)


def _positive(config, name: str, source: str, default: Any = _UNSET) -> float | None:
    """`_float`, and positive: a rotary base, a scaling factor, an attention scalar."""
    value = _float(config, name, source, default)
    if value is not None and value is not default and not value > 0:
        raise ValueError(f"{source}: `{name}` must be a positive number, got {value!r}")
    return value


def _flag(config, name: str, source: str, default: bool) -> bool:
    """A `true` / `false` field (absent: `default`; `null` is false, as transformers tests
    it); a string such as `"false"` is refused rather than read as true."""
    if name not in config:
        return default
    value = config[name]
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValueError(f"{source}: `{name}` must be true or false, got {value!r}")
    return value


def _rope(config, source: str) -> tuple[float, RopeScaling | None, float | None]:
    """`(rope_theta, rope_scaling, local_theta)` from old-style or new-style (`rope_parameters`)
    fields."""
    theta = _positive(config, "rope_theta", source, None)
    local_theta = _positive(config, "rope_local_base_freq", source, None)
    scaling = config.get("rope_scaling")
    field = "rope_scaling"
    params = config.get("rope_parameters")
    local_params: dict[str, Any] = {}
    if isinstance(params, dict):
        if "full_attention" in params or "sliding_attention" in params:
            local = local_params = params.get("sliding_attention") or {}
            where = f"{source}: rope_parameters.sliding_attention"
            local_theta = _positive(local, "rope_theta", where, local_theta)
            if local.get("rope_type", "default") != "default":
                raise _err(
                    source,
                    "rope_parameters.sliding_attention.rope_type",
                    local.get("rope_type"),
                    "the local rotary embedding must be 'default'",
                )
            params = params.get("full_attention") or {}
            where = f"{source}: rope_parameters.full_attention"
            theta = _positive(params, "rope_theta", where, theta)
        else:
            theta = _positive(params, "rope_theta", f"{source}: rope_parameters", theta)
        scaling, field = params, "rope_parameters"
    if scaling is None:
        return float(theta if theta is not None else 10000.0), None, local_theta
    if not isinstance(scaling, dict):
        raise _err(source, field, scaling, "expected a JSON object")
    for name, part in ((field, scaling), (f"{field}.sliding_attention", local_params)):
        factor = part.get("partial_rotary_factor")
        if factor is not None and factor != 1:
            raise _err(
                source, f"{name}.partial_rotary_factor", factor, "every head dimension rotates"
            )
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    theta = float(theta if theta is not None else 10000.0)
    if kind == "default":
        return theta, None, local_theta
    get = lambda name, default=_UNSET: _positive(scaling, name, f"{source}: {field}", default)
    if kind == "linear":
        return theta, RopeScaling("linear", get("factor")), local_theta
    if kind == "llama3":
        low, high = get("low_freq_factor", 1.0), get("high_freq_factor", 4.0)
        if not high > low:
            raise _err(
                source,
                f"{field}.high_freq_factor",
                high,
                f"it must exceed `low_freq_factor` = {low!r}",
            )
        original = _int(scaling, "original_max_position_embeddings", f"{source}: {field}", 8192)
        if original <= 0:
            raise _err(
                source,
                f"{field}.original_max_position_embeddings",
                original,
                "a positive integer is expected",
            )
        rs = RopeScaling("llama3", get("factor"), low, high, original)
        return theta, rs, local_theta
    if kind == "yarn":
        return theta, _yarn(config, scaling, f"{source}: {field}", source, field), local_theta
    raise _err(
        source,
        f"{field}.rope_type",
        kind,
        "implemented rotary scalings are 'linear', 'llama3' and 'yarn'",
    )


def _yarn(config, scaling, where: str, source: str, field: str) -> RopeScaling:
    """A `yarn` scaling read as transformers' `_compute_yarn_parameters` reads it:
    `original_max_position_embeddings` falls back to the config's
    `max_position_embeddings`, a missing or zero `beta_fast` / `beta_slow` to 32 / 1,
    `truncate` to true; `mscale`, `mscale_all_dim` and `attention_factor` stay unset
    when absent (`RopeScaling.attention_scale` resolves them)."""
    original = _int(scaling, "original_max_position_embeddings", where, None)
    if original is None:
        original = _int(config, "max_position_embeddings", source, None)
    if original is None:
        raise ValueError(
            f"{where}: a yarn scaling needs `original_max_position_embeddings` (or the "
            "config's `max_position_embeddings`), the pretraining context"
        )
    if original <= 0:
        raise _err(
            source, f"{field}.original_max_position_embeddings", original, "a positive integer"
        )
    betas = {}
    for name, default in (("beta_fast", 32.0), ("beta_slow", 1.0)):
        value = _float(scaling, name, where, 0.0)
        if value < 0:
            raise _err(source, f"{field}.{name}", value, "a positive number is expected")
        betas[name] = value or default  # transformers: `get(name) or default`
    truncate = _flag(scaling, "truncate", where, True)  # null: falsy, no rounding
    return RopeScaling(
        "yarn",
        _positive(scaling, "factor", where),
        original_max_position=original,
        beta_fast=betas["beta_fast"],
        beta_slow=betas["beta_slow"],
        mscale=_float(scaling, "mscale", where, None),
        mscale_all_dim=_float(scaling, "mscale_all_dim", where, None),
        attention_factor=_float(scaling, "attention_factor", where, None),
        truncate=truncate,
    )


def _windows(
    config, family: str, n_layers: int, source: str
) -> tuple[int | None, tuple[bool, ...] | None]:
    if family in ("llama", "gemma"):
        return None, None
    window = config.get("sliding_window")
    if family in ("qwen2", "qwen3") and not _flag(config, "use_sliding_window", source, False):
        window = None
    if window is None:
        return None, None
    window = _int(config, "sliding_window", source)
    types = config.get("layer_types")
    if types is not None:
        if (
            not isinstance(types, list)
            or len(types) != n_layers
            or any(t not in ("sliding_attention", "full_attention") for t in types)
        ):
            raise _err(
                source,
                "layer_types",
                types,
                f"expected {n_layers} entries of 'sliding_attention' / 'full_attention'",
            )
        local = tuple(t == "sliding_attention" for t in types)
        if family == "mistral" and not all(local):
            raise _err(
                source,
                "layer_types",
                types,
                "MistralForCausalLM windows every layer (transformers ignores `layer_types` "
                "for it); layers without a window are a different architecture",
            )
    elif family == "mistral":
        local = (True,) * n_layers
    elif family in ("qwen2", "qwen3"):
        first = _int(config, "max_window_layers", source, n_layers)
        local = tuple(i >= first for i in range(n_layers))
    else:
        pattern = 2 if family == "gemma2" else _int(config, "sliding_window_pattern", source, 6)
        if pattern < 1:
            raise _err(
                source,
                "sliding_window_pattern",
                pattern,
                "a positive integer is expected (every pattern-th layer is global)",
            )
        local = tuple(bool((i + 1) % pattern) for i in range(n_layers))
    return (window, local) if any(local) else (None, None)


def _activation(config, family: str, source: str) -> str:
    field = "hidden_activation" if config.get("hidden_activation") is not None else "hidden_act"
    act = config.get(field, "gelu_pytorch_tanh" if family in GEMMA else "silu")
    if family in GEMMA and (act in _GELU_TANH or (family == "gemma" and act == "gelu")):
        return "gelu_tanh"  # Gemma 1's legacy `gelu` means the tanh approximation
    if family not in GEMMA and act == "silu":
        return "silu"
    raise _err(
        source,
        field,
        act,
        f"the {family} MLP is implemented with "
        + ("gelu_pytorch_tanh" if family in GEMMA else "silu"),
    )


# the `TransformerConfig` field each `config.json` field sets (what a refusal of the
# config names), for naming the file's fields when the sizes do not fit together
_CONFIG_FIELDS = {
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "d_ff": "intermediate_size",
    "max_seq_len": "max_position_embeddings",
    "head_dim": "head_dim",
    "sliding_window": "sliding_window",
    "attn_softcap": "attn_logit_softcapping",
    "final_softcap": "final_logit_softcapping",
    "query_scale": "query_pre_attn_scalar",
    "rope_local_theta": "rope_local_base_freq",
    "rope_theta": "rope_theta",
}


def _source_fields(why: str, config: dict[str, Any], keys: dict[str, str]) -> str:
    """` (`key` = value, ...)`: the fields of the source file behind the
    `TransformerConfig` fields that the refusal `why` names (`keys` maps a `config.json`
    field to the source's own name, e.g. a GGUF key; a head size the file leaves out
    is named by the sizes it comes from)."""
    named = re.findall(r"\b(" + "|".join(_CONFIG_FIELDS) + r")\b", why)
    if "head_dim" in named and config.get("head_dim") is None:
        named += ["d_model", "n_heads"]
    shown = []
    for field in dict.fromkeys(named):
        hf = _CONFIG_FIELDS[field]
        if config.get(hf) is not None:
            shown.append(f"`{keys.get(hf, hf)}` = {config[hf]!r}")
    return f" ({', '.join(shown)})" if shown else ""


def config_from_hf(
    config: dict[str, Any],
    *,
    dtype: str | None = None,
    source: str = "config.json",
    keys: dict[str, str] | None = None,
) -> TransformerConfig:
    """Translate a Hugging Face `config.json` dictionary into a `TransformerConfig`.

    `dtype=None` takes the checkpoint's `torch_dtype` / `dtype` (float32 when absent or
    not one of float32 / bfloat16 / float16). `source` names the file in errors.
    Raises `ValueError` naming the field for missing or non-integer sizes and for
    unsupported architectures and features (see the module docstring); sizes that do
    not fit together (`TransformerConfig`'s refusal, e.g. a KV head count that does not
    divide the head count) are named by the file's fields too, as `keys` spells them
    (a `config.json` field to the source's name: a GGUF file's metadata keys; default:
    the `config.json` names).
    """
    if not isinstance(config, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(config).__name__}")
    family = _family(config, source)
    config = {**_CLASS_DEFAULTS.get(family, {}), **config}
    quant = config.get("quantization_config")
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise _err(
            source,
            "quantization_config",
            method,
            "quantized Hugging Face checkpoints are not read; load the unquantized weights "
            "(int8 / NF4 bases: rx.quantize_int8 / rx.quantize_nf4 after loading)",
        )
    for field, (inactive, families) in _ARCH_FIELDS.items():
        value = config.get(field)
        if (
            value is not None
            and value != inactive
            and value is not False
            and family not in families
        ):
            raise _err(source, field, value, f"not implemented for {FAMILIES[family][0]}")
    act = _activation(config, family, source)
    theta, scaling, local_theta = _rope(config, source)
    if family == "gemma3":  # Gemma3TextConfig's defaults
        theta = theta if "rope_theta" in config or "rope_parameters" in config else 1_000_000.0
        local_theta = 10_000.0 if local_theta is None else local_theta
    if dtype is None:
        raw = str(config.get("torch_dtype", config.get("dtype")))
        dtype = raw if raw in _TORCH_DTYPES else "float32"
    n_layers = _int(config, "num_hidden_layers", source)
    n_heads = _int(config, "num_attention_heads", source)
    hidden = _int(config, "hidden_size", source)
    window, local = _windows(config, family, n_layers, source)
    gemma = family in GEMMA
    later_gemma = family in ("gemma2", "gemma3")
    qpas = _positive(config, "query_pre_attn_scalar", source, None) if later_gemma else None
    head_dim = config.get("head_dim")
    sizes = dict(  # read before the config: their errors name the source once
        vocab_size=_int(config, "vocab_size", source),
        n_kv_heads=_int(config, "num_key_value_heads", source, n_heads),
        d_ff=_int(config, "intermediate_size", source),
        max_seq_len=_int(config, "max_position_embeddings", source, 2048),
        norm_eps=_float(config, "rms_norm_eps", source, 1e-6),
        head_dim=_int(config, "head_dim", source, None) if head_dim is not None else None,
        attn_softcap=_float(config, "attn_logit_softcapping", source, None)
        if later_gemma
        else None,
        final_softcap=_float(config, "final_logit_softcapping", source, None)
        if later_gemma
        else None,
    )
    if not sizes["norm_eps"] > 0:
        raise ValueError(f"{source}: `rms_norm_eps` must be > 0, got {sizes['norm_eps']!r}")
    try:
        return TransformerConfig(
            **sizes,
            d_model=hidden,
            n_layers=n_layers,
            n_heads=n_heads,
            rope_theta=theta,
            tie_embeddings=_flag(config, "tie_word_embeddings", source, gemma),
            attn_bias=family == "qwen2" and _flag(config, "attention_bias", source, True),
            dtype=dtype,
            norm_plus_one=gemma,
            mlp_activation=act,
            embed_scale=gemma,
            post_norms=later_gemma,
            qk_norm=family in ("qwen3", "gemma3"),
            query_scale=qpas**-0.5 if qpas is not None else None,
            sliding_window=window,
            window_layers=local,
            rope_scaling=scaling,
            rope_local_theta=float(local_theta)
            if family == "gemma3" and local_theta is not None
            else None,
        )
    except ValueError as e:  # sizes that do not fit together, e.g. heads
        raise ValueError(f"{source}: {e}{_source_fields(str(e), config, keys or {})}") from None
