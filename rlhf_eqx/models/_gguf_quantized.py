"""A GGUF file's projections kept in llama.cpp's packed blocks (`load_gguf(quantized=True)`).

Each projection field of the decoder becomes one `GGUFWeight` over the stacked layers:
`raw [L, out, row_bytes]`, one GGUF row of blocks per output column. The fused fields
are concatenations of whole rows along `out`: `wqkv` = q, k, v rows (after undoing
llama.cpp's q/k row permutation, itself a permutation of whole rows), `w_gate_up` =
gate, up rows. Where a file mixes block kinds in a field (llama.cpp's `Q4_K_M` stores
`attn_v` and `ffn_down` as `Q6_K` in some layers and `Q4_K` in the others; other mixes
put `Q5_K` or `Q8_0` beside them), the field is a `GGUFMixedWeight` instead: per part
(q, k, v; gate, up) its rows in each layer's own kind, padded to the part's widest
kind, decoded with the layer's kind inside the product, so it stays packed too. A field
with a tensor stored as F32 / F16 / BF16 is loaded dense (dequantised to the model
dtype): no requantisation, so no further error. The token embedding
(`in_out = (d_model, vocab)`, a row per token) and an untied `output.weight` are kept
packed the same way; norms and biases are always dense.
"""

import jax.numpy as jnp
import numpy as np

from ._config import TransformerConfig
from ._gguf import BLOCK_SCALES, gguf_names, hf_tensors, unpermute
from ._gguf_blocks import GGUF_BLOCKS, GGUFMixedWeight, GGUFWeight
from ._gguf_config import PERMUTED
from ._heads import Policy
from ._hf_tensors import _norm_fields, fill_model

_PACKED = {
    "wqkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "wo": ("self_attn.o_proj.weight",),
    "w_gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "w_down": ("mlp.down_proj.weight",),
}


# The decoded values `d·q (+ m)` of a block are finite exactly when its float16 scales
# (`BLOCK_SCALES`: `d`, and `m` / `dmin`) are.
_SCALES = BLOCK_SCALES


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


def _mixed(
    tensors: dict, per_layer: list[list[str]], rows_of, n_in: int, path: str
) -> GGUFMixedWeight | None:
    """A `GGUFMixedWeight` over the layers' tensors (`per_layer[i]`: layer `i`'s parts in
    order) when every one is in a block kind, else None. `rows_of(i, part, raw)` gives a
    part's rows as the field stores them (q/k unpermuted)."""
    kinds = [[tensors[n].tensor_type.name for n in row] for row in per_layer]
    if any(k not in GGUF_BLOCKS for row in kinds for k in row):
        return None
    raws, codes, run_kinds = [], [], []
    for p in range(len(per_layer[0])):
        used = tuple(sorted({row[p] for row in kinds}))
        width = max(n_in // GGUF_BLOCKS[k][0] * GGUF_BLOCKS[k][1] for k in used)
        layers = []
        for i, row in enumerate(per_layer):
            rows = rows_of(i, p, _checked_rows(tensors[row[p]], path))
            layers.append(np.pad(rows, ((0, 0), (0, width - rows.shape[-1]))))
        raws.append(jnp.asarray(np.stack(layers)))
        codes.append(jnp.asarray([used.index(row[p]) for row in kinds], jnp.int32))
        run_kinds.append(used)
    n_out = sum(int(r.shape[-2]) for r in raws)
    return GGUFMixedWeight(
        raw=tuple(raws), codes=tuple(codes), kinds=tuple(run_kinds), in_out=(n_in, n_out)
    )


def quantized_policy(reader, path: str, family: str, cfg: TransformerConfig) -> Policy:
    """The `Policy` of a GGUF file (its tensors checked by `check_tensors`) with
    projections, token embedding and LM head kept as `GGUFWeight`s wherever the file's
    blocks allow (see the module docstring)."""
    names = gguf_names(cfg.n_layers, cfg.post_norms)
    tensors = {t.name: t for t in reader.tensors}
    values: dict[str, object] = {}
    for field, suffixes in _PACKED.items():
        per_layer = [[f"model.layers.{i}.{s}" for s in suffixes] for i in range(cfg.n_layers)]
        n_in = cfg.q_size if field == "wo" else cfg.d_ff if field == "w_down" else cfg.d_model

        def rows_of(i: int, p: int, raw: np.ndarray) -> np.ndarray:
            h = per_layer[i][p]
            permuted = family in PERMUTED and (".q_proj." in h or ".k_proj." in h)
            return unpermute(h, raw, cfg) if permuted else raw

        got = _packed(tensors, [names[h] for row in per_layer for h in row], path)
        if got is None:
            mixed = _mixed(tensors, [[names[h] for h in row] for row in per_layer], rows_of,
                           n_in, path)  # fmt: skip
            if mixed is not None:
                values[field] = mixed
            continue
        kind, rows = got
        stacked = []
        for i in range(cfg.n_layers):
            parts = rows[i * len(suffixes) : (i + 1) * len(suffixes)]
            stacked.append(np.concatenate([rows_of(i, p, r) for p, r in enumerate(parts)], 0))
        raw = np.stack(stacked)
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
    return fill_model(Policy, cfg, dict(values), source=path, dense_of=lambda n: dense_of[n]())
