"""`TransformerConfig` → Hugging Face `config.json`, in each family's published field layout."""

import math
from typing import Any

from ._config import RopeScaling, TransformerConfig
from ._hf_config import FAMILIES, GEMMA, SCORERS, config_from_hf


def hf_family(cfg: TransformerConfig) -> str:
    """The Hugging Face family whose architecture has exactly `cfg`'s switches."""
    if cfg.norm_plus_one:
        if cfg.qk_norm:
            return "gemma3"
        return "gemma2" if cfg.post_norms else "gemma"
    if cfg.qk_norm:
        return "qwen3"
    if cfg.attn_bias:
        return "qwen2"
    return "mistral" if cfg.sliding_window is not None else "llama"


def rope_scaling_json(rs: RopeScaling | None) -> dict[str, Any] | None:
    if rs is None:
        return None
    if rs.kind == "linear":
        return {"rope_type": "linear", "factor": rs.factor}
    if rs.kind == "yarn":
        out = {
            "rope_type": "yarn",
            "factor": rs.factor,
            "original_max_position_embeddings": rs.original_max_position,
            "beta_fast": rs.beta_fast,
            "beta_slow": rs.beta_slow,
        }
        for name in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(rs, name) is not None:
                out[name] = getattr(rs, name)
        if not rs.truncate:
            out["truncate"] = False
        return out
    return {
        "rope_type": "llama3",
        "factor": rs.factor,
        "low_freq_factor": rs.low_freq_factor,
        "high_freq_factor": rs.high_freq_factor,
        "original_max_position_embeddings": rs.original_max_position,
    }


def config_to_hf(
    cfg: TransformerConfig,
    *,
    dtype: str | None = None,
    head: str = "lm",
    pad_token_id: int | None = None,
) -> dict[str, Any]:
    """A Hugging Face `config.json` dictionary for `cfg`, in the field layout of the
    family's published checkpoints (see the module docstring for the families).

    `head="score"` writes the family's one-label `...ForSequenceClassification`
    architecture (a reward model); `pad_token_id`, when given, is written (the
    classifier reads the score at the last token that is not padding).

    Raises `ValueError` naming the field when no supported architecture expresses
    `cfg` (e.g. a window pattern the family cannot write).
    """
    if head not in ("lm", "score"):
        raise ValueError(f"config_to_hf: head must be 'lm' or 'score', got {head!r}")
    family = hf_family(cfg)
    arch, model_type = FAMILIES[family]
    if head == "score":
        arch = SCORERS[family]
    out: dict[str, Any] = {
        "architectures": [arch],
        "model_type": model_type,
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
        "rope_scaling": rope_scaling_json(cfg.rope_scaling),
        "hidden_act": "gelu_pytorch_tanh"
        if cfg.mlp_activation == "gelu_tanh"
        else cfg.mlp_activation,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": dtype or cfg.dtype,
    }
    layer_types = ["sliding_attention" if x else "full_attention" for x in cfg.local_layers]
    if family in ("llama", "mistral"):
        out.update(attention_bias=False, mlp_bias=False)
    if family == "mistral":
        out["sliding_window"] = cfg.sliding_window
    if family in ("qwen2", "qwen3"):
        first = next((i for i, x in enumerate(cfg.local_layers) if x), cfg.n_layers)
        out.update(
            use_sliding_window=cfg.sliding_window is not None,
            sliding_window=cfg.sliding_window,
            max_window_layers=first,
        )
        if family == "qwen3":
            out["attention_bias"] = False
    if family in GEMMA:
        out["hidden_activation"] = out["hidden_act"]
    if family in ("gemma2", "gemma3"):
        scale = cfg.query_scale if cfg.query_scale is not None else cfg.head_dim**-0.5
        qpas = scale**-2.0
        out.update(
            query_pre_attn_scalar=int(round(qpas)) if abs(qpas - round(qpas)) < 1e-6 else qpas,
            attn_logit_softcapping=cfg.attn_softcap,
            final_logit_softcapping=cfg.final_softcap,
            sliding_window=cfg.sliding_window,
            layer_types=layer_types,
        )
    if head == "score":
        out.update(id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    if pad_token_id is not None:
        out["pad_token_id"] = int(pad_token_id)
    if family == "gemma3":
        out["rope_local_base_freq"] = (
            cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta
        )
    back = config_from_hf(out, dtype=cfg.dtype)
    for field in back.__dataclass_fields__:
        mine, theirs = getattr(cfg, field), getattr(back, field)
        if field in ("remat", "dtype"):
            continue
        if (
            isinstance(mine, float)
            and isinstance(theirs, float)
            and math.isclose(mine, theirs, rel_tol=1e-9)
        ):
            continue
        if mine != theirs:
            raise ValueError(
                f"TransformerConfig.{field}={mine!r} cannot be written as a {arch} config.json "
                f"(it would read back as {theirs!r})"
            )
    return out
