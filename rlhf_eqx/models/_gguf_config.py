"""GGUF metadata ⇄ `TransformerConfig`, through a Hugging Face `config.json` dictionary.

llama.cpp's keys are `{arch}.block_count`, `.embedding_length`, `.feed_forward_length`,
`.attention.head_count(_kv)`, `.attention.key_length` (head_dim), `.rope.freq_base`,
`.rope.dimension_count`, `.rope.scaling.type/factor` (YaRN: `.original_context_length`,
`.yarn_beta_fast/slow`), `.attention.layer_norm_rms_epsilon`,
`.context_length`, `.attention.sliding_window` and Gemma 2's `.attn_logit_softcapping`
/ `.final_logit_softcapping`; `general.architecture` names `{arch}`. Llama 3.x rope
scaling is the tensor `rope_freqs.weight` (each inverse frequency's divisor), matched
here against Meta's `llama3` rule. What llama.cpp does not store it hard-codes, and so
does this module: Gemma 2/3's attention scale (`head_dim^-1/2`, `(d_model /
n_heads)^-1/2` for the 27B models), Gemma 2's alternate and Gemma 3's every-sixth
global layer, Gemma 3's local rotary base 10,000 (unless `.rope.freq_base_swa` says),
and Gemma 2's defaults for absent keys: a window of 4096 and the soft-caps 50 (attention)
and 30 (final logits), which llama.cpp always applies to Gemma 2 (a Gemma 2 model without
soft-caps cannot be written: llama.cpp would read it with them). Gemma 3 has a final
soft-cap only when `.final_logit_softcapping` is stored, and no attention soft-cap.
Mistral is written with `general.architecture = llama`; a `llama` file with a sliding
window reads as Mistral.
"""

import dataclasses
import math
from typing import Any

import numpy as np

from ._config import RopeScaling, TransformerConfig
from ._hf_config import FAMILIES, config_from_hf
from ._hf_export import hf_family, rope_scaling_json

ARCHS = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3": "gemma3",
}
PERMUTED = ("llama", "mistral")  # llama.cpp's non-NeoX rotary: q/k rows interleaved
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# what llama.cpp's Gemma 2 takes when a key is absent (`llama_hparams`, `load_hparams`)
_GEMMA2_DEFAULTS = {
    "attention.sliding_window": 4096,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
}

_UNSET = object()


def gemma_attention_scalar(family: str, n_layers: int, d_model: int, n_heads: int, hd: int):
    """The `query_pre_attn_scalar` llama.cpp assumes for a Gemma 2/3 file."""
    return d_model // n_heads if _GEMMA_27B_LAYERS.get(family) == n_layers else hd


def llama3_rope_factors(rs: RopeScaling, inv_freq: np.ndarray) -> np.ndarray:
    """`rope_freqs.weight`: the divisor of each inverse frequency (llama.cpp's form of
    the `llama3` rope scaling)."""
    return (inv_freq.astype(np.float32) / rs.apply(inv_freq)).astype(np.float32)


def _rope(get, number, arch: str, path: str, names) -> dict[str, Any] | None:
    """`rope_scaling` of `config.json` from the metadata (`get` reads a key as stored,
    `number` an `{arch}.` key checked by `_typed_getter`)."""
    kind = get(f"{arch}.rope.scaling.type", "none")
    if "rope_freqs.weight" in names:
        if kind != "none":
            raise ValueError(f"{path}: both `{arch}.rope.scaling.type` and rope_freqs.weight")
        return {"rope_type": "rope_freqs"}  # resolved against the tensor in `read_config`
    if kind == "none":
        return None
    if kind == "yarn":
        return _yarn(get, number, arch, path)
    if kind != "linear":
        raise ValueError(
            f"{path}: `{arch}.rope.scaling.type` = {kind!r} is not supported: "
            "implemented rotary scalings are 'linear', 'yarn' and llama3 (rope_freqs.weight)"
        )
    return {"rope_type": "linear", "factor": number("rope.scaling.factor")}


# llama.cpp's YaRN keys that scale the attention beyond transformers' default: their
# value when absent, which is all that reads as a `rope_scaling` here
_YARN_ATTENTION_KEYS = {
    "rope.scaling.yarn_log_multiplier": 0.0,
    "rope.scaling.yarn_attn_factor": 1.0,
    "rope.scaling.yarn_ext_factor": None,
}


def _yarn(get, number, arch: str, path: str) -> dict[str, Any]:
    """`rope_scaling` of a `yarn` file, as llama.cpp's converter writes transformers'
    fields: `.rope.scaling.factor`, `.original_context_length` (absent:
    `.context_length`), `.yarn_beta_fast` / `.yarn_beta_slow` (absent: 32 / 1). The
    attention factor is transformers' default `0.1·ln(factor) + 1`; a file that sets
    `.yarn_log_multiplier`, `.yarn_attn_factor` or `.yarn_ext_factor` otherwise is
    refused (llama.cpp folds them into its rotation differently per architecture)."""
    for key, inactive in _YARN_ATTENTION_KEYS.items():
        value = get(f"{arch}.{key}", inactive)
        if value != inactive and not (key.endswith("ext_factor") and value in (-1.0, 1.0)):
            raise ValueError(
                f"{path}: `{arch}.{key}` = {value!r} is not supported: a yarn scaling is read "
                "with transformers' default attention factor only"
            )
    config: dict[str, Any] = {"rope_type": "yarn", "factor": number("rope.scaling.factor")}
    original = number("rope.scaling.original_context_length", None)
    if original is not None:  # else `max_position_embeddings`, i.e. `.context_length`
        config["original_max_position_embeddings"] = original
    for key, field in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        value = number(f"rope.scaling.{key}", None)
        if value is not None:
            config[field] = value
    return config


def llama3_from_factors(factors: np.ndarray, cfg: TransformerConfig, path: str) -> RopeScaling:
    """The `llama3` rope scaling whose divisors are `factors` (`rope_freqs.weight`).

    `factor` is the largest divisor. Only ratios of the other three parameters show in
    the divisors, so `low_freq_factor` is taken as 1 (Llama 3.x's value); with two or
    more smoothly interpolated frequencies `high_freq_factor` and
    `original_max_position` follow from a line fit, with fewer `high_freq_factor` is 4
    (Llama 3.x's) and `original_max_position` the one that gives the divisors (8192
    when it does). Raises `ValueError` naming the tensor when no such scaling gives
    `factors`.
    """
    inv = cfg.inv_freq()
    if factors.shape != inv.shape or not factors.max() >= 1:
        raise ValueError(f"{path}: tensor 'rope_freqs.weight' has shape {factors.shape}")
    f = float(factors.max())
    wavelen = 2 * np.pi / inv
    band = (factors > 1 + 1e-6) & (factors < f * (1 - 1e-6))
    s = (1 / factors - 1 / f) / (1 - 1 / f) if f > 1 else np.zeros_like(factors)
    candidates = [RopeScaling("llama3", f)]  # (orig / wavelen - low) / (high - low) = s
    if band.sum() >= 2:
        slope, offset = np.polyfit(1 / wavelen[band], s[band], 1)
        high = 1 - 1 / offset
        if high > 1 and slope > 0:
            orig = int(round(slope * (high - 1)))
            candidates.insert(0, RopeScaling("llama3", f, 1.0, round(float(high), 4), orig))
    elif band.sum() == 1:
        orig = int(round(float(wavelen[band][0] * (3 * s[band][0] + 1))))
        candidates.insert(0, RopeScaling("llama3", f, 1.0, 4.0, max(orig, 1)))
    else:
        lo = 4 * float(wavelen[factors <= 1 + 1e-6].max(initial=0.0))
        hi = float(wavelen[factors >= f * (1 - 1e-6)].min(initial=np.inf))
        if not lo < 8192 < hi and lo < hi:
            mid = np.sqrt(lo * hi) if np.isfinite(hi) else 2 * lo
            candidates.insert(0, RopeScaling("llama3", f, 1.0, 4.0, max(int(mid), 1)))
    for rs in candidates:
        if f > 1 and np.allclose(llama3_rope_factors(rs, inv), factors, rtol=1e-4):
            return rs
    raise ValueError(
        f"{path}: tensor 'rope_freqs.weight' is not the divisors of a Llama 3 rope scaling"
    )


_INT_KEYS = (
    "vocab_size", "context_length", "embedding_length", "block_count", "feed_forward_length",
    "attention.head_count", "attention.head_count_kv", "attention.key_length",
    "rope.dimension_count", "attention.sliding_window", "expert_count",
    "rope.scaling.original_context_length",
)  # fmt: skip
_POSITIVE_KEYS = (
    "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.freq_base_swa",
    "rope.scaling.factor", "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
)  # fmt: skip
_COUNTS = ("sliding_window", "expert_count")  # the integers that may be 0 (none)


def _typed_getter(meta, arch: str, path: str):
    """`get(key[, default])`: metadata `{arch}.{key}`, refused naming the key when it is
    not what llama.cpp reads there: an integer for the sizes (`_INT_KEYS`; a list is a
    per-layer value, which this decoder does not have), positive but for the window
    and the expert count, a finite number for the others, positive for the norm epsilon
    and the rotary bases."""

    def get(key: str, *default):
        value = meta(f"{arch}.{key}", *default)
        if value is None or (default and value is default[0]):
            return value
        why = None
        if isinstance(value, list):
            why = "per-layer values"
        elif key in _INT_KEYS:
            if isinstance(value, bool) or not isinstance(value, int):
                why = "an integer is expected"
            elif value < 0 or (value == 0 and not key.endswith(_COUNTS)):
                why = "a positive integer is expected"
        elif isinstance(value, bool) or not isinstance(value, int | float):
            why = "a number is expected"
        elif not math.isfinite(value) or (key in _POSITIVE_KEYS and value <= 0):
            why = "a positive number is expected" if key in _POSITIVE_KEYS else "not finite"
        if why is not None:
            raise ValueError(f"{path}: `{arch}.{key}` = {value!r} is not supported: {why}")
        return value

    return get


def hf_config(meta, path: str, names, n_tokens: int | None) -> tuple[str, dict[str, Any]]:
    """`(family, config.json dictionary)` from a file's metadata: `meta(key[, default])`
    reads a key, `names` holds the file's tensor names, `n_tokens` is the length of
    `tokenizer.ggml.tokens` (the vocabulary when `{arch}.vocab_size` is absent)."""
    arch = meta("general.architecture")
    if arch not in ARCHS:
        raise ValueError(
            f"{path}: `general.architecture` = {arch!r} is not supported: supported "
            f"architectures are {sorted(ARCHS)}"
        )
    family = ARCHS[arch]
    if family == "llama" and meta("llama.attention.sliding_window", None) is not None:
        family = "mistral"  # llama.cpp writes Mistral as `llama`
    get = _typed_getter(meta, arch, path)
    experts = get("expert_count", 0)
    if experts:
        raise ValueError(
            f"{path}: `{arch}.expert_count` = {experts} is not supported: mixture-of-experts "
            "layers (a dense decoder is read)"
        )
    vocab = get("vocab_size", n_tokens)
    hidden, layers, heads = get("embedding_length"), get("block_count"), get("attention.head_count")
    kv = get("attention.head_count_kv", heads)
    head_dim = get("attention.key_length", None)
    hd = head_dim if head_dim is not None else hidden // heads
    rot = get("rope.dimension_count", hd)
    if rot != hd:
        raise ValueError(
            f"{path}: `{arch}.rope.dimension_count` = {rot!r} is not supported: partial "
            f"rotary embeddings (head_dim {hd})"
        )
    config: dict[str, Any] = {
        "architectures": [FAMILIES[family][0]],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "intermediate_size": get("feed_forward_length"),
        "max_position_embeddings": get("context_length", 2048),
        "rope_theta": get("rope.freq_base", 1_000_000.0 if family == "gemma3" else 10_000.0),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "head_dim": head_dim,
        "tie_word_embeddings": "output.weight" not in names,
        "rope_scaling": _rope(meta, get, arch, path, names),
        "torch_dtype": "float32",
    }
    no_window = _GEMMA2_DEFAULTS["attention.sliding_window"] if family == "gemma2" else None
    window = get("attention.sliding_window", no_window)
    if family in ("mistral", "gemma2", "gemma3"):
        config["sliding_window"] = window
    if family in ("gemma2", "gemma3"):
        config["query_pre_attn_scalar"] = gemma_attention_scalar(family, layers, hidden, heads, hd)
    if family == "gemma2":  # llama.cpp always soft-caps Gemma 2, at 50 / 30 without the keys
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            config[key] = get(key, _GEMMA2_DEFAULTS[key])
    if family == "gemma3":  # llama.cpp reads Gemma 3's final soft-cap (no attention soft-cap)
        config["final_logit_softcapping"] = get("final_logit_softcapping", None)
        config["rope_local_base_freq"] = get("rope.freq_base_swa", 10_000.0)
    return family, config


# the metadata key (after `{arch}.`) that `hf_config` reads each `config.json` field from
_GGUF_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "embedding_length",
    "num_hidden_layers": "block_count",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "intermediate_size": "feed_forward_length",
    "max_position_embeddings": "context_length",
    "rope_theta": "rope.freq_base",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "head_dim": "attention.key_length",
    "sliding_window": "attention.sliding_window",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
    "rope_local_base_freq": "rope.freq_base_swa",
}


def config_keys(arch: str) -> dict[str, str]:
    """The GGUF metadata key (`{arch}.attention.head_count_kv`, ...) of each `config.json`
    field `hf_config` fills from one: what a refusal of the configuration names."""
    return {hf: f"{arch}.{key}" for hf, key in _GGUF_KEYS.items()}


def llama3_json(rs: RopeScaling) -> dict[str, Any]:
    """A `llama3` rope scaling as Hugging Face's `rope_scaling` object."""
    return rope_scaling_json(rs)


def _same(cfg: TransformerConfig, back: TransformerConfig, field: str) -> bool:
    mine, theirs = getattr(cfg, field), getattr(back, field)
    if field == "query_scale":
        mine = cfg.head_dim**-0.5 if mine is None else mine
        theirs = back.head_dim**-0.5 if theirs is None else theirs
    if field == "window_layers":
        mine, theirs = cfg.local_layers, back.local_layers
    if isinstance(mine, float) and isinstance(theirs, float):
        return math.isclose(mine, theirs, rel_tol=1e-6)  # GGUF stores float32
    return mine == theirs


def gguf_family(cfg: TransformerConfig) -> str:
    """The family `cfg` is written as: `hf_family`'s, but q/k/v biases with a sliding
    window on every layer or a `llama3` rope scaling are written as `llama` (Mistral /
    Llama with biases, which llama.cpp's `llama` architecture holds and its `qwen2` does
    not: no window, no `rope_freqs.weight`)."""
    family = hf_family(cfg)
    if family != "qwen2":
        return family
    if cfg.sliding_window is not None:
        return "mistral"
    rs = cfg.rope_scaling
    return "llama" if rs is not None and rs.kind == "llama3" else family


def gguf_metadata(cfg: TransformerConfig) -> tuple[str, dict[str, Any]]:
    """`(architecture, {key: value})`: llama.cpp's metadata for `cfg` (ints are written as
    uint32, floats as float32, strings as strings).

    Raises `ValueError` naming the `TransformerConfig` field when llama.cpp cannot
    express it (it would read back differently, e.g. a Gemma 2 attention scale other
    than the one llama.cpp assumes, or a window on Qwen).
    """
    family = gguf_family(cfg)
    arch = "llama" if family == "mistral" else family
    hd = cfg.head_dim
    meta: dict[str, Any] = {
        "general.architecture": arch,
        f"{arch}.vocab_size": cfg.vocab_size,
        f"{arch}.context_length": cfg.max_seq_len,
        f"{arch}.embedding_length": cfg.d_model,
        f"{arch}.block_count": cfg.n_layers,
        f"{arch}.feed_forward_length": cfg.d_ff,
        f"{arch}.attention.head_count": cfg.n_heads,
        f"{arch}.attention.head_count_kv": cfg.n_kv_heads,
        f"{arch}.attention.key_length": hd,
        f"{arch}.attention.value_length": hd,
        f"{arch}.rope.dimension_count": hd,
        f"{arch}.rope.freq_base": float(cfg.rope_theta),
        f"{arch}.attention.layer_norm_rms_epsilon": float(cfg.norm_eps),
    }
    rs = cfg.rope_scaling
    if rs is not None and rs.kind == "linear":
        meta[f"{arch}.rope.scaling.type"] = "linear"
        meta[f"{arch}.rope.scaling.factor"] = float(rs.factor)
    if rs is not None and rs.kind == "yarn":
        meta[f"{arch}.rope.scaling.type"] = "yarn"
        meta[f"{arch}.rope.scaling.factor"] = float(rs.factor)
        meta[f"{arch}.rope.scaling.original_context_length"] = rs.original_max_position
        meta[f"{arch}.rope.scaling.yarn_beta_fast"] = float(rs.beta_fast)
        meta[f"{arch}.rope.scaling.yarn_beta_slow"] = float(rs.beta_slow)
    if cfg.sliding_window is not None:
        meta[f"{arch}.attention.sliding_window"] = cfg.sliding_window
    for name, value in (
        ("attn_logit_softcapping", cfg.attn_softcap),
        ("final_logit_softcapping", cfg.final_softcap),
    ):
        if value is not None:
            meta[f"{arch}.{name}"] = float(value)
    if family == "gemma3" and cfg.rope_local_theta is not None:
        meta[f"{arch}.rope.freq_base_swa"] = float(cfg.rope_local_theta)
    names = set() if cfg.tie_embeddings else {"output.weight"}
    if rs is not None and rs.kind == "llama3":
        names.add("rope_freqs.weight")
    get = lambda key, *d: meta[key] if key in meta or not d else d[0]
    _, config = hf_config(get, "GGUF metadata", names, None)
    if config["rope_scaling"] is not None and config["rope_scaling"]["rope_type"] == "rope_freqs":
        config["rope_scaling"] = llama3_json(rs)  # checked against the tensor on reading
    try:
        back = config_from_hf(config, dtype=cfg.dtype)
    except ValueError as e:
        raise ValueError(f"this configuration cannot be written as GGUF: {e}") from None
    if arch == "llama" and cfg.attn_bias:  # read back from the bias tensors written
        back = dataclasses.replace(back, attn_bias=True)
    for field in cfg.__dataclass_fields__:
        if field not in ("remat", "dtype") and not _same(cfg, back, field):
            raise ValueError(
                f"TransformerConfig.{field}={getattr(cfg, field)!r} cannot be written as a "
                f"llama.cpp `{arch}` GGUF file (llama.cpp would read it as "
                f"{getattr(back, field)!r})"
            )
    return arch, meta


# GGUF value types: their fixed sizes (struct formats); 8 is a string, 9 an array
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}


def read_gguf_sizes(path: str) -> tuple[int, int] | None:
    """`(vocab_size, max_seq_len)` of the GGUF file `path`, read from its metadata header
    alone: `{arch}.vocab_size` (else the length of `tokenizer.ggml.tokens`) and
    `{arch}.context_length` (2048 when absent, as `load_gguf` reads it), `{arch}` being
    `general.architecture`. The walk stops once it has both, skipping the tokenizer's
    arrays without decoding them: milliseconds where `gguf.GGUFReader` takes seconds.

    `None` for what this walk does not read (not a little-endian GGUF file of version
    2 or 3, a cut or damaged header, an unsupported architecture): loading the file
    names what is wrong. A missing or unreadable file is an `OSError`."""
    import mmap
    import struct

    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            return None
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            try:
                return _walk_sizes(m, struct)
            except (struct.error, ValueError, UnicodeDecodeError, IndexError):
                return None


def _walk_sizes(m, struct) -> tuple[int, int] | None:
    version, _, n_kv = struct.unpack_from("<IQQ", m, 4)
    if version not in (2, 3):
        return None
    pos = 24

    def string() -> str:
        nonlocal pos
        (n,) = struct.unpack_from("<Q", m, pos)
        if pos + 8 + n > len(m):
            raise ValueError("cut")
        pos += 8 + n
        return bytes(m[pos - n : pos]).decode("utf-8")

    def skip(kind: int) -> None:
        nonlocal pos
        if kind == 8:
            (n,) = struct.unpack_from("<Q", m, pos)
            pos += 8 + n
        elif kind in _SCALARS:
            pos += struct.calcsize("<" + _SCALARS[kind])
        else:
            raise ValueError(f"value type {kind}")

    arch = None
    found: dict[str, Any] = {}
    for _ in range(n_kv):
        key = string()
        (kind,) = struct.unpack_from("<I", m, pos)
        pos += 4
        if kind == 9:
            sub, count = struct.unpack_from("<IQ", m, pos)
            pos += 12
            if key == "tokenizer.ggml.tokens":
                found["tokens"] = count
            if sub in _SCALARS:
                pos += count * struct.calcsize("<" + _SCALARS[sub])
            else:
                for _ in range(count):
                    skip(sub)
        elif kind == 8:
            value = string()
            if key == "general.architecture":
                arch = value
        elif kind in _SCALARS:
            (value,) = struct.unpack_from("<" + _SCALARS[kind], m, pos)
            skip(kind)
            if key.endswith((".context_length", ".vocab_size")):
                found[key] = value  # `{arch}.` is checked once the architecture is known
        else:
            return None
        if pos > len(m):
            return None
        if arch is not None and {f"{arch}.context_length", f"{arch}.vocab_size"} <= set(found):
            break
    if arch not in ARCHS:
        return None
    vocab = found.get(f"{arch}.vocab_size", found.get("tokens"))
    context = found.get(f"{arch}.context_length", 2048)
    ints = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (vocab, context))
    return (vocab, context) if ints else None
