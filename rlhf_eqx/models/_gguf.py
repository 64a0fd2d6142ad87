"""llama.cpp GGUF files: metadata → `TransformerConfig`, tensors → the decoder's arrays.

A GGUF file is a header of typed key/value metadata, a table of tensors (name, GGML
type, shape) and the tensor data; it is read with the `gguf` package (llama.cpp's own
reader, a `numpy.memmap`), so loading never executes code from the file. The route is
the Hugging Face one: the metadata become a `config.json`-style dictionary for
`config_from_hf`, the tensors get their Hugging Face names for `arrays_from_tensors`.

| GGUF tensor (`P` = `blk.{i}.`) | Hugging Face (`P` = `model.layers.{i}.`) |
| --- | --- |
| `token_embd`, `output_norm`, `output` | `model.embed_tokens`, `model.norm`, `lm_head` |
| `P attn_norm`, `P attn_q/k/v`, `P attn_output` | `input_layernorm`, `self_attn.{q,k,v,o}_proj` |
| `P attn_q_norm`, `P attn_k_norm` | `self_attn.q_norm`, `self_attn.k_norm` |
| `P ffn_norm` | `post_attention_layernorm`; Gemma 2/3: `pre_feedforward_layernorm` |
| `P post_attention_norm`, `P post_ffw_norm` | Gemma 2/3: `post_attention_layernorm`, `post_feedforward_layernorm` |
| `P ffn_gate`, `P ffn_up`, `P ffn_down` | `mlp.{gate,up,down}_proj` |

llama.cpp's converter (`convert_hf_to_gguf.py`) changes two things on the way, undone
here: for the `llama` architecture (Llama, Mistral) the q/k output rows are permuted
from rotate-half to interleaved rotary pairs (`w.reshape(n_head, 2, hd/2, in)
.swapaxes(1, 2)`; Qwen and Gemma use llama.cpp's NeoX rotary and are stored as is), and
Gemma's RMSNorm weights are stored as `1 + w`. A `llama` file may hold q/k/v biases
(`blk.N.attn_q.bias`, ...: Llama-architecture checkpoints trained with biases, converted as
`llama`); they are read (q/k permuted back like the weights, an absent one of the three
zero, as llama.cpp takes each as optional) and the model gets `attn_bias`. An
`attn_output.bias` is read only when it is zero: the decoder has no output-projection
bias. Llama 3.x rope scaling is stored as the
per-frequency divisors `rope_freqs.weight`, recognised here as Meta's `llama3` rule.
Gemma 2/3's attention scale is not stored: llama.cpp uses `head_dim^-1/2`, and
`(d_model / n_heads)^-1/2` for the 27B models, and so does this reader.
"""  # noqa: E501 (markdown table rows cannot be wrapped)

import dataclasses
import math
import os
import re
import struct
from typing import Any

import numpy as np

from ._build import check_finite, model_from_arrays
from ._config import TransformerConfig
from ._gguf_config import PERMUTED, config_keys, hf_config, llama3_from_factors, llama3_json
from ._heads import Policy
from ._hf_config import GEMMA, config_from_hf
from ._hf_tensors import _layer_names, arrays_from_tensors, check_float16_range
from ._llama2c import permute_rotary_rows

DENSE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
DENSE_TYPES += ("Q4_K", "Q5_K", "Q6_K")
"""The tensor types a GGUF file may hold, each dequantised by the `gguf` package (Q5_0 /
Q5_1: llama.cpp's `Q4_K_M` / `Q5_K_M` files of models whose width is not a multiple of
256, SmolLM2's 576 or Qwen2.5-0.5B's 896, store most matrices in them)."""
_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    **{f"self_attn.{p}_proj.{k}": f"attn_{p}.{k}" for p in "qkv" for k in ("weight", "bias")},
    **{f"mlp.{p}_proj.weight": f"ffn_{p}.weight" for p in ("gate", "up", "down")},
}
_UNSET = object()
_BLOCK = re.compile(r"blk\.(\d+)\.")
_QKV_BIAS = re.compile(r"blk\.\d+\.attn_[qkv]\.bias")
_OUTPUT_BIAS = re.compile(r"blk\.\d+\.attn_output\.bias")
FILE_KEYS = (
    "general.architecture", "general.type", "general.file_type",
    "general.quantization_version", "general.alignment",
)  # fmt: skip
"""The `general.*` keys that describe a file's encoding, not the model: what a writer
computes from the model and the tensor types it writes (`general_metadata` leaves them
out)."""


def gguf_names(n_layers: int, post_norms: bool) -> dict[str, str]:
    """Hugging Face tensor name → llama.cpp tensor name, for every tensor a decoder of
    `n_layers` layers may hold (`post_norms`: Gemma 2/3's norm layout)."""
    layer = dict(_LAYER)
    layer["post_attention_layernorm.weight"] = (
        "post_attention_norm.weight" if post_norms else "ffn_norm.weight"
    )
    names = dict(_TOP)
    for i in range(n_layers):
        names.update({f"model.layers.{i}.{h}": f"blk.{i}.{g}" for h, g in layer.items()})
    return names


def expected_shapes(cfg: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face name → `[out, in]` shape of every tensor a causal LM of `cfg` holds."""
    V, D = cfg.vocab_size, cfg.d_model
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (V, D)
    for i in range(cfg.n_layers):
        shapes.update({f"model.layers.{i}.{s}": v for s, v in _layer_names(cfg).items()})
    return shapes


def interleave_rotary_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (rotate-half → interleaved pairs) of `w [out, ...]`:
    `w.reshape(n_heads, 2, hd/2, ...).swapaxes(1, 2)`; the inverse of
    `permute_rotary_rows`. Whole rows move, so it applies to rows of packed blocks."""
    out, rest = w.shape[0], w.shape[1:]
    w = w.reshape(n_heads, 2, out // n_heads // 2, *rest).swapaxes(1, 2)
    return np.ascontiguousarray(w.reshape(out, *rest))


def gguf_package():
    """The `gguf` package (imported on first use), or an `ImportError` saying how to get it."""
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("GGUF files need the `gguf` package (pip install rlhf_eqx[gguf])") from e
    return gguf


# byte sizes of the GGUF metadata value types (`gguf.GGUFValueType`); 8 is a string, 9 an array
_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
# ggml's GGML_MAX_DIMS, and the smallest tensor table entry (name length, dimension
# count, one dimension, type, offset)
_MAX_DIMS, _MIN_ENTRY = 4, 8 + 4 + 8 + 4 + 8


class _Cut(Exception):
    """The file ends inside the part named by the message."""


class _BadEntry(Exception):
    """A tensor table entry the reader cannot take; the message names the tensor."""


def _truncated(part: str, size: int) -> str:
    return f"truncated GGUF file: {part} runs past the end of the file ({size} bytes)"


def _bad_count(n_tensors: int, left: int) -> str:
    return (
        f"the header's tensor count {n_tensors} cannot be right: that many tensor table "
        f"entries take more than the {left} bytes left after the metadata (the header is "
        "corrupt)"
    )


def layout_problem(path: str) -> str | None:
    """Why the `gguf` reader cannot take a GGUF file (v2/v3, little-endian), as one
    line: where it ends too early (`"truncated GGUF file: the header runs past the end
    ..."`, likewise `metadata key 'k'`, `the tensor table entry of 't'`, `the data of
    tensor 't'`), the tensor table entry of a tensor whose GGML type is unknown, whose
    rows are not whole blocks of its type or with more than 4 dimensions, or a tensor
    count too large for the file (the table would be read from the data); `None` when
    nothing of that kind is wrong (or the file is not one this walk understands: the
    reader's own error stands then).

    The layout walked is llama.cpp's `gguf.h`: magic, version, tensor count and key/value
    count; the key/value pairs (length-prefixed strings, typed scalars and arrays); the
    tensor table (name, dimensions, type, offset); the data, from the first multiple of
    `general.alignment` (32 by default) after the table."""
    gguf = gguf_package()
    size = os.path.getsize(path)
    with open(path, "rb") as f:

        def take(n: int, what: str) -> bytes:
            if f.tell() + n > size:
                raise _Cut(what)
            return f.read(n)

        def number(fmt: str, what: str) -> int:
            return struct.unpack("<" + fmt, take(struct.calcsize(fmt), what))[0]

        def string(what: str) -> bytes:
            return take(number("Q", what), what)

        def skip(kind: int, what: str) -> None:
            if kind == _STRING:
                string(what)
            elif kind == _ARRAY:
                inner, count = number("I", what), number("Q", what)
                if inner in _VALUE_SIZES:
                    take(count * _VALUE_SIZES[inner], what)
                else:
                    for _ in range(count):
                        skip(inner, what)
            else:
                take(_VALUE_SIZES[kind], what)

        table_start = None
        try:
            if take(4, "the header") != b"GGUF" or number("I", "the header") not in (2, 3):
                return None
            n_tensors, n_kv = number("Q", "the header"), number("Q", "the header")
            alignment = 32
            for _ in range(n_kv):
                key = string("the metadata").decode("utf-8", "replace")
                what = f"metadata key {key!r}"
                kind = number("I", what)
                if key == "general.alignment" and kind == _UINT32:
                    alignment = number("I", what)
                else:
                    skip(kind, what)
            table = []
            table_start = f.tell()
            for _ in range(n_tensors):
                name = string("the tensor table").decode("utf-8", "replace")
                what = f"the tensor table entry of {name!r}"
                n_dims = number("I", what)
                if n_dims > _MAX_DIMS:
                    raise _BadEntry(
                        f"tensor {name!r} has {n_dims} dimensions, more than GGUF's {_MAX_DIMS}"
                    )
                dims = [number("Q", what) for _ in range(n_dims)]
                kind, offset = number("I", what), number("Q", what)
                if kind not in gguf.GGMLQuantizationType._value2member_map_:
                    raise _BadEntry(f"tensor {name!r} has GGML type id {kind}, which is unknown")
                kind = gguf.GGMLQuantizationType(kind)
                block = gguf.GGML_QUANT_SIZES[kind][0]
                if dims and dims[0] % block:
                    raise _BadEntry(
                        f"tensor {name!r} has rows of {dims[0]} values, not whole {kind.name} "
                        f"blocks of {block}"
                    )
                table.append((name, dims, kind, offset))
            start = -(-f.tell() // alignment) * alignment
            for name, dims, kind, offset in table:
                block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
                if start + offset + math.prod(dims) // block * block_bytes > size:
                    return _truncated(f"the data of tensor {name!r}", size)
        except _Cut as cut:
            if table_start is not None and n_tensors * _MIN_ENTRY > size:
                return _bad_count(n_tensors, size - table_start)
            return _truncated(str(cut), size)
        except _BadEntry as bad:
            if n_tensors * _MIN_ENTRY > size - table_start:  # entries read from past the table
                return _bad_count(n_tensors, size - table_start)
            return str(bad)
        except (KeyError, ValueError, ZeroDivisionError, MemoryError, OverflowError):
            return None  # not a layout this walk reads
    return None


def open_gguf(path: str):
    """A `gguf.GGUFReader` of `path`; every tensor's data checked to lie inside the file.

    A file cut short is a `ValueError` naming the part it ends in, a tensor of an
    unknown type or with rows that are not whole blocks one naming the tensor
    (`layout_problem`), as is one whose data offset is not a multiple of
    `general.alignment` or lies inside another tensor's data (`_offset_problem`); a
    missing file a `FileNotFoundError`, a directory an
    `IsADirectoryError` naming the `.gguf` files in it; other unreadable bytes a
    `ValueError` with the reader's reason. A file written in the other byte order (a
    big-endian file from an s390x machine, or one `gguf_convert_endian.py` wrote) has its
    tensors brought to this machine's order in memory (`_host_order`)."""
    gguf = gguf_package()
    if os.path.isdir(path):
        inside = sorted(n for n in os.listdir(path) if n.endswith(".gguf"))
        hint = f" (it holds {', '.join(inside[:3])}{', ...' if len(inside) > 3 else ''})"
        raise IsADirectoryError(f"{path}: is a directory, not a GGUF file{hint if inside else ''}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: file not found")
    size = os.path.getsize(path)
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/IndexError/KeyError on bad headers
        problem = layout_problem(path)
        if problem is not None:
            raise ValueError(f"{path}: {problem}") from None
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    for t in reader.tensors:
        if t.data_offset + int(t.n_bytes) > size or t.data.nbytes != int(t.n_bytes):
            raise ValueError(f"{path}: {_truncated(f'the data of tensor {t.name!r}', size)}")
    problem = _offset_problem(reader)
    if problem is not None:
        raise ValueError(f"{path}: {problem}")
    if reader.byte_order == "S":  # written on a machine of the other byte order
        for t in reader.tensors:
            if t.tensor_type.name in _UNSWAPPED:
                raise ValueError(
                    f"{path}: tensor {t.name!r} has GGML type {t.tensor_type.name} in a file "
                    "of the other byte order, which is not supported (convert the file on "
                    "its own machine, or to little-endian first)"
                )
        reader.tensors = [_host_order(t) for t in reader.tensors]
    return reader


def _offset_problem(reader) -> str | None:
    """Why the tensors' data offsets are not a layout llama.cpp writes, as one line
    naming the tensor: an offset that is not a multiple of `general.alignment`, or data
    that overlaps the previous tensor's (in offset order); `None` when they are sound.
    The `gguf` reader takes any offset, so a corrupt one would read another tensor's
    bytes (or padding) as this one's values."""
    align = int(reader.alignment)
    spans = sorted(  # in offset order, a tie in table order (the later entry is named)
        (int(t.data_offset) - int(reader.data_offset), i, int(t.n_bytes), t.name)
        for i, t in enumerate(reader.tensors)
    )
    end, previous = 0, None
    for offset, _, n_bytes, name in spans:
        if offset % align:
            return (
                f"tensor {name!r} has data offset {offset}, not a multiple of the "
                f"alignment {align} (general.alignment): the tensor table is corrupt"
            )
        if offset < end:
            return (
                f"tensor {name!r} has data offset {offset}, inside the data of tensor "
                f"{previous!r} (which ends at {end}): the tensor table is corrupt"
            )
        end, previous = offset + n_bytes, name
    return None


# Byte offsets of the float16 scales in one block of each block type (ggml's `block_*`
# structs: `d` first, and `m` / `dmin` next for Q4_1 / Q4_K / Q5_K; Q6_K's `d` last).
BLOCK_SCALES = {
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}
# The fields a file written in the other byte order holds byte-swapped: the blocks'
# scales, and a BF16 value as one two-byte "block" (llama.cpp's `gguf_convert_endian.py`
# swaps the same ones).
_HALF_FIELDS = {"BF16": (0,), **BLOCK_SCALES}
# Block types whose other fields (Q5_0 / Q5_1's 32-bit high bits) would need swapping too,
# in a layout no tool writes that could be checked against: refused in such a file.
_UNSWAPPED = ("Q5_0", "Q5_1")


def _host_order(t):
    """`t` (a `gguf` reader tensor of a file in the other byte order) with its data in
    this machine's order, in memory: scalar types as native arrays (the reader views
    them in the file's order), block types with their float16 fields swapped back. A
    type not listed here is left as it is (`check_type` names it when it is read)."""
    import gguf

    if t.data.dtype != np.uint8:
        return t._replace(data=np.ascontiguousarray(t.data, t.data.dtype.newbyteorder("=")))
    fields = _HALF_FIELDS.get(t.tensor_type.name)
    if fields is None:
        return t
    raw = np.array(t.data)
    blocks = raw.reshape(-1, gguf.GGML_QUANT_SIZES[t.tensor_type][1])
    for at in fields:
        blocks[:, [at, at + 1]] = blocks[:, [at + 1, at]]
    return t._replace(data=raw)


def field(reader, key: str, path: str, default: Any = _UNSET) -> Any:
    """The value of metadata `key`: a number, bool, string, or list of them."""
    import gguf

    f = reader.fields.get(key)
    if f is None:
        if default is _UNSET:
            raise ValueError(f"{path}: required metadata `{key}` is missing")
        return default

    def scalar(kind, part):
        if kind == gguf.GGUFValueType.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        if kind == gguf.GGUFValueType.FLOAT32:  # the shortest decimal that is this float32
            return float(str(part[0]))  # (1e-05, not 9.99999974e-06: the config's value)
        return part.tolist()[0]

    if f.types[0] == gguf.GGUFValueType.ARRAY:
        return [scalar(f.types[-1], f.parts[i]) for i in f.data]
    return scalar(f.types[0], f.parts[f.data[0]])


def general_metadata(reader, path: str) -> dict[str, Any]:
    """The `general.*` metadata of a GGUF file that describe the model (`general.name`,
    `.basename`, `.finetune`, `.size_label`, `.license`, `.author`, `.organization`,
    `.tags`, `.base_model.*`, ...), as `{key: value}` (a string, number, bool or list
    of them), in the file's order; the keys of the file's encoding (`FILE_KEYS`:
    architecture, type, file type, quantization version, alignment) left out."""
    return {
        key: field(reader, key, path)
        for key in reader.fields
        if key.startswith("general.") and key not in FILE_KEYS
    }


def read_gguf_card(path: str | os.PathLike) -> dict[str, Any]:
    """The model card of the GGUF file `path`: its `general.*` metadata that describe the
    model (`general.name`, `.basename`, `.finetune`, `.size_label`, `.license`,
    `.author`, `.tags`, `.base_model.*`, ...) as `{key: value}`, in the file's order,
    without the keys of the file's encoding (architecture, type, file type, quantization
    version, alignment). Edit it and pass it to `rlhf_eqx.save_gguf(..., general=card)`
    for a fine-tune's file: `{**read_gguf_card(src), "general.finetune": "dpo"}`."""
    path = os.fspath(path)
    return general_metadata(open_gguf(path), path)


def read_config(reader, path: str, *, dtype: str | None = None):
    """`(family, TransformerConfig)` of a GGUF file (`dtype` default float32); a `llama`
    file holding q/k/v biases gives `attn_bias=True`."""
    family, cfg = _read_config(reader, path, dtype)
    if family in PERMUTED and any(_QKV_BIAS.fullmatch(t.name) for t in reader.tensors):
        cfg = dataclasses.replace(cfg, attn_bias=True)
    return family, cfg


def _read_config(reader, path: str, dtype: str | None):
    tensors = {t.name: t for t in reader.tensors}
    meta = lambda key, *d: field(reader, key, path, *d)
    if meta("general.type", None) == "adapter":
        raise ValueError(
            f"{path}: `general.type` = 'adapter': a LoRA adapter file, not a model (load "
            "its base model's file; llama.cpp applies the adapter with --lora)"
        )
    shards = meta("split.count", 0)
    if isinstance(shards, int) and shards > 1:
        raise ValueError(
            f"{path}: `split.count` = {shards}: one shard of a split model (merge the shards "
            "into one file with `llama-gguf-split --merge` and load that)"
        )
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    n_tokens = len(tokens.data) if tokens is not None else None
    if n_tokens is None and "token_embd.weight" in tensors:
        n_tokens = int(tensors["token_embd.weight"].shape[-1])
    family, config = hf_config(meta, path, tensors, n_tokens)
    blocks = {int(m.group(1)) for name in tensors if (m := _BLOCK.match(name))}
    held, layers = max(blocks, default=-1) + 1, config["num_hidden_layers"]
    if layers > held:  # before anything is built per layer (a corrupt count may be huge)
        raise ValueError(
            f"{path}: `{meta('general.architecture')}.block_count` = {layers} but the file "
            f"holds the tensors of {held} layer{'s' if held != 1 else ''} (tensor "
            f"'blk.{held}.attn_norm.weight' is missing)"
        )
    rope = config["rope_scaling"]
    if rope is not None and rope["rope_type"] == "rope_freqs":
        config["rope_scaling"] = None
    keys = config_keys(meta("general.architecture"))
    if meta(keys["vocab_size"], None) is None:  # the vocabulary is the token list's length
        keys["vocab_size"] = "tokenizer.ggml.tokens (its length)"
    cfg = config_from_hf(config, dtype=dtype or "float32", source=path, keys=keys)
    if tokens is not None and len(tokens.data) > cfg.vocab_size:
        raise ValueError(
            f"{path}: tokenizer.ggml.tokens has {len(tokens.data)} tokens but the model's "
            f"vocabulary (token_embd.weight) has {cfg.vocab_size}: ids {cfg.vocab_size}.."
            f"{len(tokens.data) - 1} would be outside the embedding"
        )
    if rope is not None and rope["rope_type"] == "rope_freqs":
        factors = dense(tensors["rope_freqs.weight"], path)
        half = cfg.head_dim // 2
        if factors.shape != (half,):
            raise ValueError(
                f"{path}: tensor 'rope_freqs.weight' has shape {factors.shape}, expected "
                f"({half},): one divisor per rotary frequency (head_dim {cfg.head_dim} / 2)"
            )
        if np.all(factors == 1):  # every divisor 1: the unscaled frequencies
            return family, cfg
        rs = llama3_from_factors(factors, cfg, path)
        cfg = config_from_hf(
            {**config, "rope_scaling": llama3_json(rs)}, dtype=cfg.dtype, source=path, keys=keys
        )
    return family, cfg


def check_type(t, path: str, allowed=DENSE_TYPES) -> None:
    if t.tensor_type.name not in allowed:
        raise ValueError(
            f"{path}: tensor {t.name!r} has GGML type {t.tensor_type.name}, which is not "
            f"supported (supported: {', '.join(allowed)})"
        )


def dense(t, path: str) -> np.ndarray:
    """A tensor dequantised to float32 `[out, in]` (GGML's `ne` reversed), checked finite."""
    import gguf

    check_type(t, path)
    with np.errstate(invalid="ignore", over="ignore"):  # a NaN is named just below
        arr = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
    shape = tuple(int(n) for n in reversed(t.shape.tolist()))
    arr = arr.reshape(shape)
    check_finite(arr, name=t.name, source=path)
    return arr


def unpermute(hf_name: str, rows: np.ndarray, cfg: TransformerConfig) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a q/k weight or bias (rows `[out, ...]`)."""
    heads = cfg.n_heads if ".q_proj." in hf_name else cfg.n_kv_heads
    flat = rows.reshape(rows.shape[0], -1)
    return permute_rotary_rows(flat, heads).reshape(rows.shape)


def _zero_output_bias(t, path: str, cfg: TransformerConfig) -> bool:
    """Whether `t` is an `attn_output.bias` that is all zero (nothing to hold: skipped);
    one that is not is a `ValueError` naming it (the decoder has no such bias)."""
    if not _OUTPUT_BIAS.fullmatch(t.name):
        return False
    shape = tuple(int(n) for n in reversed(t.shape.tolist()))
    if shape == (cfg.d_model,) and not np.any(dense(t, path)):
        return True
    raise ValueError(
        f"{path}: tensor {t.name!r} is not supported: a bias on the attention output "
        "projection, which this decoder does not have (it holds q/k/v biases only; an "
        f"all-zero {t.name!r} of shape ({cfg.d_model},) is read as none)"
    )


def check_tensors(reader, path: str, family: str, cfg: TransformerConfig) -> None:
    """Refuse a tensor of an unsupported type, one that is not part of the architecture,
    or one of the wrong shape (naming it), and name the first missing tensor."""
    names = gguf_names(cfg.n_layers, cfg.post_norms)
    by_gguf = {g: h for h, g in names.items()}
    shapes = expected_shapes(cfg)
    for t in reader.tensors:
        check_type(t, path)
        if t.name == "rope_freqs.weight" or _zero_output_bias(t, path, cfg):
            continue
        name = by_gguf.get(t.name)
        if name not in shapes:
            arch = field(reader, "general.architecture", path)
            raise ValueError(
                f"{path}: unexpected tensor {t.name!r}: not part of a {family} model of "
                f"`{arch}.block_count` = {cfg.n_layers} layers"
            )
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        if shape != shapes[name]:
            raise ValueError(
                f"{path}: tensor {t.name!r} has shape {shape} ([out, in]), expected {shapes[name]}"
            )
    present = {t.name for t in reader.tensors}
    for hf in shapes:
        optional = family in PERMUTED and hf.endswith("_proj.bias")  # zero when absent
        if names[hf] not in present and not optional:
            raise ValueError(f"{path}: tensor {names[hf]!r} is missing from the file")


def hf_tensors(reader, path: str, family: str, cfg: TransformerConfig) -> dict[str, np.ndarray]:
    """The model tensors of the file (checked by `check_tensors`) under their Hugging
    Face names, float32, with the q/k permutation and Gemma's `+1` undone."""
    by_gguf = {g: h for h, g in gguf_names(cfg.n_layers, cfg.post_norms).items()}
    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight" or _OUTPUT_BIAS.fullmatch(t.name):
            continue  # an attention output bias is zero (`check_tensors`)
        name = by_gguf[t.name]
        arr = dense(t, path)
        if family in PERMUTED and (".q_proj." in name or ".k_proj." in name):
            arr = unpermute(name, arr, cfg)
        if family in GEMMA and name.endswith("norm.weight"):
            arr = arr - np.float32(1.0)
        if cfg.dtype == "float16":
            check_float16_range({t.name: arr}, path)
        tensors[name] = arr
    if family in PERMUTED and cfg.attn_bias:  # llama.cpp's `llama` biases are each optional
        shapes = expected_shapes(cfg)
        for i in range(cfg.n_layers):
            for p in "qkv":
                name = f"model.layers.{i}.self_attn.{p}_proj.bias"
                tensors.setdefault(name, np.zeros(shapes[name], np.float32))
    return tensors


def load_gguf_policy(
    path: str | os.PathLike,
    *,
    quantized: bool = False,
    dtype: str | None = None,
    reader: Any = None,
) -> Policy:
    """Load the model of a llama.cpp GGUF file as a `Policy` (its weights only;
    `rlhf_eqx.load_gguf` adds the tokenizer from the same file).

    **Arguments:**

    - `path`: a `.gguf` file whose `general.architecture` is `llama` (Llama 2/3.x,
      Mistral; with q/k/v biases when the file holds them, an `attn_output.bias` only
      when it is zero), `qwen2`, `qwen3`, `gemma`, `gemma2` or `gemma3`, with tensors of type
      F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K or Q6_K (Q5_0 / Q5_1
      always dequantised, also with `quantized=True`).
    - `quantized`: `False` dequantises every tensor (`gguf.quants.dequantize`) to a
      dense model; `True` keeps the q/k/v/o, gate/up/down projections, the token
      embedding and an untied LM head in the file's packed blocks (`GGUFWeight`,
      decoded inside the forward pass). A field whose parts or layers mix block types
      (llama.cpp's `Q4_K_M` stores `attn_v` / `ffn_down` as `Q6_K` in some layers) is a
      `GGUFMixedWeight`, each layer decoded in its own kind; a field with a tensor
      stored as F32 / F16 / BF16 is loaded dense instead (no requantisation).
    - `dtype`: the parameter dtype of the dense weights (`"float32"` default,
      `"bfloat16"`, `"float16"`).
    - `reader`: the file already opened with `open_gguf(path)` (parsing a large
      vocabulary takes seconds; pass it to read the tokenizer from the same reader).

    **Returns:** a `Policy` that computes what llama.cpp computes from the file (on
    SmolLM2-135M-Instruct Q4_1, float32 logits within 4e-5 of transformers' GGUF
    loader). The file's model card (`general.name`, `.license`, ...) is not part of the
    policy (a pytree of arrays): `write_gguf(..., general=path)` carries it from the file
    to a written one.

    Raises `ValueError` naming the file and the metadata key for an unsupported
    architecture or feature, the tensor (and its type) for an unsupported tensor type, a
    missing, unexpected or mis-shaped tensor or one holding NaN or ±inf, and the file
    for a truncated or unreadable file. The file is only read (`numpy.memmap`): nothing
    in it is executed.
    """
    if dtype not in (None, "float32", "bfloat16", "float16"):
        raise ValueError(
            f"load_gguf: dtype must be 'float32', 'bfloat16', 'float16' or None, got {dtype!r}"
        )
    path = os.fspath(path)
    if reader is None:
        reader = open_gguf(path)
    family, cfg = read_config(reader, path, dtype=dtype)
    check_tensors(reader, path, family, cfg)
    if quantized:
        from ._gguf_quantized import quantized_policy

        return quantized_policy(reader, path, family, cfg)
    tensors = hf_tensors(reader, path, family, cfg)
    arrays = arrays_from_tensors(cfg, tensors, source=path)
    return model_from_arrays(Policy, cfg, arrays, source=path)
