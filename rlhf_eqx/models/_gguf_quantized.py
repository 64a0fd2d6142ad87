"""A GGUF file's projections kept in llama.cpp's packed blocks (`load_gguf(quantized=True)`).

Each projection field of the decoder becomes one `GGUFWeight` over the stacked layers:
`raw [L, out, row_bytes]`, one GGUF row of blocks per output column. The fused fields
are concatenations of whole rows along `out`: `wqkv` = q, k, v rows (after undoing
llama.cpp's q/k row permutation, itself a permutation of whole rows), `w_gate_up` =
gate, up rows. That needs one block kind for all parts and layers of a field; when a
file mixes kinds in a field (llama.cpp's `Q4_K_M` stores some `attn_v` / `ffn_down` as
`Q6_K`), or stores it as F32 / F16 / BF16, that field is loaded dense (dequantised to
the model dtype) instead: no requantisation, so no further error. The token embedding
(`in_out = (d_model, vocab)`, a row per token) and an untied `output.weight` are kept
packed the same way; norms and biases are always dense.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._build import LAYER_FIELDS, _layer_field_used
from ._config import TransformerConfig
from ._gguf import gguf_names, hf_tensors, unpermute
from ._gguf_blocks import GGUF_BLOCKS, GGUFWeight
from ._gguf_config import PERMUTED
from ._heads import Policy
from ._hf_tensors import _norm_fields

_PACKED = {
    "wqkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "wo": ("self_attn.o_proj.weight",),
    "w_gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "w_down": ("mlp.down_proj.weight",),
}


# Byte offsets of each block's float16 scales (`d`, and `m` / `dmin`): the decoded
# values `d·q (+ m)` of a block are finite exactly when these are.
_SCALES = {
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def _checked_rows(t, path: str) -> np.ndarray:
    """The packed rows of a block tensor, `uint8 [out, row_bytes]`, after checking that
    every block's float16 scales are finite (so are then all its values)."""
    raw = np.asarray(t.data)
    kind = t.tensor_type.name
    size = GGUF_BLOCKS[kind][1]
    blocks = raw.reshape(raw.shape[0], -1, size)
    for offset in _SCALES[kind]:
        scale = np.ascontiguousarray(blocks[..., offset : offset + 2]).view("<f2")[..., 0]
        bad = ~np.isfinite(scale)
        if bad.any():
            row, block = (int(k) for k in np.argwhere(bad)[0])
            raise ValueError(
                f"{path}: tensor {t.name!r} holds a non-finite block scale ({scale[row, block]}) "
                f"in row {row}, block {block}: the file is corrupt (NaN/inf weights make every "
                "output NaN)"
            )
    return raw


def _packed(tensors: dict, names: list[str], path: str) -> tuple[str, list[np.ndarray]] | None:
    kinds = {tensors[n].tensor_type.name for n in names}
    if len(kinds) != 1 or next(iter(kinds)) not in GGUF_BLOCKS:
        return None
    return next(iter(kinds)), [_checked_rows(tensors[n], path) for n in names]


def quantized_policy(reader, path: str, family: str, cfg: TransformerConfig) -> Policy:
    """The `Policy` of a GGUF file (its tensors checked by `check_tensors`) with
    projections, token embedding and LM head kept as `GGUFWeight`s wherever the file's
    blocks allow (see the module docstring)."""
    names = gguf_names(cfg.n_layers, cfg.post_norms)
    tensors = {t.name: t for t in reader.tensors}
    values: dict[str, object] = {}
    for field, suffixes in _PACKED.items():
        per_layer = [[f"model.layers.{i}.{s}" for s in suffixes] for i in range(cfg.n_layers)]
        got = _packed(tensors, [names[h] for row in per_layer for h in row], path)
        if got is None:
            continue
        kind, rows = got
        stacked = []
        for i, hf_row in enumerate(per_layer):
            parts = rows[i * len(suffixes) : (i + 1) * len(suffixes)]
            if family in PERMUTED:
                parts = [
                    unpermute(h, p, cfg) if (".q_proj." in h or ".k_proj." in h) else p
                    for h, p in zip(hf_row, parts)
                ]
            stacked.append(np.concatenate(parts, axis=0))
        raw = np.stack(stacked)
        n_in = cfg.q_size if field == "wo" else cfg.d_ff if field == "w_down" else cfg.d_model
        values[field] = GGUFWeight(raw=jnp.asarray(raw), kind=kind, in_out=(n_in, raw.shape[1]))
    top = {"embed": "model.embed_tokens.weight"}
    if not cfg.tie_embeddings:
        top["lm_head"] = "lm_head.weight"
    for field, hf in top.items():
        got = _packed(tensors, [names[hf]], path)
        if got is not None:
            kind, (raw,) = got
            values[field] = GGUFWeight(
                raw=jnp.asarray(raw), kind=kind, in_out=(cfg.d_model, raw.shape[0])
            )
    skip = {names[h] for f in values for h in _field_names(f, cfg)}
    dense_reader = _Subset(reader, skip)
    hf = hf_tensors(dense_reader, path, family, cfg)
    return _assemble(cfg, values, hf, path)


def _field_names(field: str, cfg: TransformerConfig) -> list[str]:
    if field == "embed":
        return ["model.embed_tokens.weight"]
    if field == "lm_head":
        return ["lm_head.weight"]
    return [f"model.layers.{i}.{s}" for i in range(cfg.n_layers) for s in _PACKED[field]]


class _Subset:
    """A reader that lists only the tensors not in `skip` (already packed)."""

    def __init__(self, reader, skip: set[str]):
        self.fields = reader.fields
        self.tensors = [t for t in reader.tensors if t.name not in skip]


def _assemble(cfg: TransformerConfig, values: dict, hf: dict[str, np.ndarray], path: str):
    """Fill an abstract `Policy` with the packed `values` and the dense Hugging Face
    tensors `hf` for every other field."""
    dt = cfg.param_dtype

    def get(name: str) -> np.ndarray:
        if name not in hf:
            gg = gguf_names(cfg.n_layers, cfg.post_norms)[name]
            raise ValueError(f"{path}: tensor {gg!r} is missing from the file")
        return hf[name]

    stack = lambda s: np.stack([get(f"model.layers.{i}.{s}") for i in range(cfg.n_layers)])
    stack_t = lambda s: np.swapaxes(stack(s), -1, -2)
    attn = "self_attn."
    dense_of = {
        "embed": lambda: get("model.embed_tokens.weight"),
        "lm_head": lambda: get("lm_head.weight").T,
        "final_norm": lambda: get("model.norm.weight"),
        "wqkv": lambda: np.concatenate([stack_t(f"{attn}{p}_proj.weight") for p in "qkv"], -1),
        "wo": lambda: stack_t(attn + "o_proj.weight"),
        "w_gate_up": lambda: np.concatenate(
            [stack_t("mlp.gate_proj.weight"), stack_t("mlp.up_proj.weight")], -1
        ),
        "w_down": lambda: stack_t("mlp.down_proj.weight"),
        "bqkv": lambda: np.concatenate([stack(f"{attn}{p}_proj.bias") for p in "qkv"], -1),
        "q_norm": lambda: stack(attn + "q_norm.weight"),
        "k_norm": lambda: stack(attn + "k_norm.weight"),
        **{f: (lambda s: lambda: stack(s))(s) for f, s in _norm_fields(cfg).items()},
    }
    skeleton = eqx.filter_eval_shape(Policy, cfg, key=jax.random.key(0))
    getters = {
        "embed": lambda p: p.transformer.embed,
        "final_norm": lambda p: p.transformer.final_norm,
    }
    if not cfg.tie_embeddings:
        getters["lm_head"] = lambda p: p.lm_head
    for name in LAYER_FIELDS:
        if _layer_field_used(name, cfg):
            getters[name] = (lambda n: lambda p: getattr(p.transformer.layers, n))(name)
    out = []
    for name, g in getters.items():
        if name in values:
            out.append(values[name])
            continue
        arr = dense_of[name]()
        want = tuple(g(skeleton).shape)
        if arr.shape != want:
            raise ValueError(f"{path}: weight {name!r} has shape {arr.shape}, expected {want}")
        out.append(jnp.asarray(arr).astype(dt))
    fns = list(getters.values())
    return eqx.tree_at(lambda p: [g(p) for g in fns], skeleton, out)
