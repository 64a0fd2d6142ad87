"""Writing llama.cpp GGUF files: a whole model (`write_gguf`) or its LoRA adapters alone
(`save_gguf_adapter`).

The tensors are the Hugging Face ones (`tensors_from_model`) under llama.cpp's names
(`_gguf.gguf_names`), changed as llama.cpp's converter changes them: q/k output rows
permuted to interleaved rotary pairs for the `llama` architecture (Llama, Mistral) and
Gemma's RMSNorm weights stored as `1 + w`. Norms, biases and other 1-D tensors are
float32 (as llama.cpp writes them); a Llama 3.x `llama3` rope scaling becomes the
tensor `rope_freqs.weight`. q/k/v biases are written under `qwen2`, or under `llama`
(their q/k rows permuted like the weights') with a window or a `llama3` rope scaling,
which llama.cpp's `qwen2` does not hold (`gguf_family`). The model card (`general.name`,
`.license`, `.author`, ...) is written from `general=`, a mapping or the file the model
was loaded from; `general.file_type` and `.quantization_version` are always those of
the file written. Files are written to a temporary file in the target's
directory, flushed to disk and renamed over the target (`os.replace`), so the target is
either the old file or the complete new one.

The adapter layout is that of llama.cpp's `convert_lora_to_gguf.py`: `general.type =
"adapter"`, `adapter.type = "lora"`, `adapter.lora.alpha`, and for each adapted
projection `W` (GGUF name `blk.{i}.attn_q.weight`, ...) the tensors
`blk.{i}.attn_q.weight.lora_a` (`A`, numpy `[r, in]`) and `...lora_b` (`B`, `[out, r]`,
with the q/k row permutation of `W`). llama.cpp adds `alpha / r · B A` to `W`.
"""

import dataclasses
import os
import secrets
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

from ._build import check_finite, model_config, where_layers
from ._config import TransformerConfig
from ._gguf import (
    FILE_KEYS,
    general_metadata,
    gguf_names,
    gguf_package,
    interleave_rotary_rows,
    open_gguf,
)
from ._gguf_config import PERMUTED, gguf_metadata, llama3_rope_factors
from ._heads import Policy
from ._hf import NoSpace, cannot_write, disk_full, prepare_parent, remove_created
from ._hf_tensors import tensors_from_model
from ._lora import DoRAAdapter, layer_ranks_and_scales, merge_lora
from ._peft import _MODULES
from ._quant import dequantize

_DTYPES = ("f32", "f16", "bf16", "q8_0")


def _llama_cpp_rows(name: str, arr: np.ndarray, cfg: TransformerConfig, arch: str) -> np.ndarray:
    """Permute the output rows of a q/k weight or bias (or a LoRA `B`) as llama.cpp stores
    them in a file of architecture `arch`."""
    if arch not in PERMUTED or not (".q_proj." in name or ".k_proj." in name):
        return arr
    return interleave_rotary_rows(arr, cfg.n_heads if ".q_proj." in name else cfg.n_kv_heads)


def _ggml_type(arr: np.ndarray, dtype: str):
    gguf = gguf_package()
    T = gguf.GGMLQuantizationType
    if arr.ndim == 1 or dtype == "f32":
        return T.F32
    if dtype == "bf16":
        return T.BF16
    if dtype == "q8_0" and arr.shape[-1] % 32 == 0:
        return T.Q8_0
    return T.F16  # f16, and q8_0 rows that are not whole blocks (as llama.cpp falls back)


def _temporary_file(path: str) -> str:
    """A new empty file beside `path` (whose directory exists) with the permissions of
    the file it replaces, or those a new file gets (`0o666` less the umask;
    `tempfile.mkstemp`'s are `0o600`)."""
    directory = os.path.dirname(os.path.abspath(path))
    mode = os.stat(path).st_mode & 0o7777 if os.path.isfile(path) else 0o666
    while True:
        tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        except FileExistsError:
            continue
        os.close(fd)
        if mode != 0o666:
            os.chmod(tmp, mode)  # the replaced file's mode, whatever the umask
        return tmp


def _stored(name: str, arr: np.ndarray, dtype: str, path: str):
    """`(data, kind)`: `arr` in the GGML type that `dtype` gives it. A value that type
    cannot hold (beyond float16's 65504 for F16; a Q8_0 block scale `max|w| / 127` beyond
    it) is a `ValueError` naming the tensor, instead of an inf in the file."""
    gguf = gguf_package()
    T = gguf.GGMLQuantizationType
    kind = _ggml_type(arr, dtype)
    if kind in (T.F32, T.BF16):  # bfloat16 has float32's range: nothing to overflow
        return (arr if kind == T.F32 else gguf.quants.quantize(arr, kind)), kind
    with np.errstate(over="ignore", invalid="ignore"):
        data = gguf.quants.quantize(arr, kind)
    half = data if kind == T.F16 else data.reshape(-1, 34)[:, :2].copy().view("<f2")
    if not np.isfinite(half).all():
        what = "float16 values" if kind == T.F16 else "float16 block scales (max |w| / 127)"
        raise ValueError(
            f"{path}: tensor {name!r} holds values up to {float(np.abs(arr).max()):.6g}, "
            f"beyond what {kind.name} stores ({what} up to 65504); write it with "
            "dtype='bf16' or 'f32'"
        )
    return data, kind


def _write_atomic(path: str, arch: str, fill) -> None:
    """`fill(writer)` adds metadata and tensors to a `GGUFWriter` on a temporary file in
    `path`'s directory; the file is then flushed, synced and renamed to `path`. When
    anything fails, the temporary file and the directories made for it are removed; a
    directory that cannot be written or a full disk is one `OSError` line naming `path`.
    A `path` that is a symbolic link is written where it points (the link stays), as
    `save_hf` does."""
    gguf = gguf_package()
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path}: is a directory; a GGUF file is one file (name it)")
    created = prepare_parent(path, "GGUF file")
    target = os.path.realpath(path)
    try:
        tmp = _temporary_file(target)
    except OSError as e:
        remove_created(os.path.dirname(os.path.abspath(path)), created)
        raise cannot_write(e, path, "GGUF file") from None
    writer = None
    try:
        writer = gguf.GGUFWriter(tmp, arch)  # writes `general.architecture`
        fill(writer)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as e:
        if writer is not None:
            try:  # the file the writer holds open (a failed write leaves it open)
                writer.close()
            except OSError:
                pass
        if os.path.exists(tmp):
            os.remove(tmp)
        remove_created(os.path.dirname(os.path.abspath(path)), created)
        if isinstance(e, Exception) and disk_full(e, os.path.dirname(tmp)):
            raise NoSpace(path, "GGUF file") from None
        raise


def _add_metadata(writer, meta: dict) -> None:
    for key, value in meta.items():
        if key == "general.architecture":
            continue
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, int(value))


def _general_entries(general: Mapping[str, Any] | str | os.PathLike) -> list:
    """`[(key, value, GGUFValueType, item type)]` of the `general=` of `write_gguf`:
    a mapping checked key by key, or a GGUF file's `general_metadata`."""
    gguf = gguf_package()
    V = gguf.GGUFValueType
    if isinstance(general, str | os.PathLike):
        source = os.fspath(general)
        general = general_metadata(open_gguf(source), source)
    if not isinstance(general, Mapping):
        raise TypeError(
            "save_gguf: general must be a mapping of `general.*` keys or a GGUF file's path, "
            f"got {type(general).__name__}"
        )

    def kind(key: str, value: Any):
        if isinstance(value, bool):
            return V.BOOL
        if isinstance(value, str):
            return V.STRING
        if isinstance(value, float):
            return V.FLOAT32
        if isinstance(value, int) and -(2**63) <= value < 2**64:
            if 0 <= value < 2**32:
                return V.UINT32
            return V.INT32 if -(2**31) <= value < 0 else V.INT64 if value < 0 else V.UINT64
        raise ValueError(
            f"save_gguf: general[{key!r}] = {value!r} is not supported: a string, number, "
            "bool, or a non-empty list of one of them is expected"
        )

    entries = []
    for key, value in general.items():
        if not isinstance(key, str) or not key.startswith("general."):
            raise ValueError(f"save_gguf: general key {key!r} is not a `general.*` key")
        if key in FILE_KEYS:
            raise ValueError(
                f"save_gguf: `{key}` is not taken from general=: it describes the file "
                "written and is computed from the model and dtype"
            )
        if isinstance(value, list | tuple):
            if not value:
                raise ValueError(f"save_gguf: general[{key!r}] is an empty list")
            kinds = {kind(key, v) for v in value}
            if len(kinds) != 1:
                raise ValueError(f"save_gguf: general[{key!r}] mixes value types")
            entries.append((key, list(value), V.ARRAY, kinds.pop()))
        else:
            entries.append((key, value, kind(key, value), None))
    return entries


def write_gguf(
    model: Policy,
    path: str | os.PathLike,
    *,
    dtype: str = "f16",
    metadata: Callable[[Any], None] | None = None,
    general: Mapping[str, Any] | str | os.PathLike | None = None,
) -> None:
    """Write a `Policy` as a llama.cpp GGUF file (the weights and the architecture's
    metadata; `rlhf_eqx.save_gguf` adds the tokenizer and chat template).

    **Arguments:**

    - `model`: a `Policy`; LoRA adapters are folded in (`merge_lora`) and quantised
      weights (int8, NF4, GGUF blocks) dequantised first. A `RewardModel` /
      `ValueModel` is refused (llama.cpp has no scalar head).
    - `path`: the file; written atomically (a temporary file beside it, synced, then
      renamed over it).
    - `dtype`: the matrices' type: `"f16"` (llama.cpp's default), `"bf16"` (a bfloat16
      model's weights bit for bit, float32's range), `"q8_0"` (8-bit blocks of 32 with
      a float16 scale, `gguf.quants.quantize`; a matrix whose rows are not whole blocks
      falls back to f16) or `"f32"`. 1-D tensors are always f32.
    - `metadata`: called with the `gguf.GGUFWriter` before the tensors are added, to
      write further key/value metadata (the tokenizer's `tokenizer.ggml.*`).
    - `general`: the model card written as `general.*` metadata: a mapping
      `{"general.name": ..., "general.license": ...}` (strings, numbers, bools or lists
      of one of them), or the path of a GGUF file whose `general.*` keys are carried
      (the model a policy was loaded from: its name, basename, finetune, size label,
      license, author, tags, base models, ...). The keys of the file's encoding
      (`general.architecture`, `.type`, `.file_type`, `.quantization_version`,
      `.alignment`) are always the ones of the file written, from the model and
      `dtype`: a mapping naming one is refused, a source file's are left out. To change
      what no longer holds (a fine-tune's name), pass a mapping: `{**carried,
      "general.finetune": "dpo"}`.

    A Mistral sliding window is written (`llama.attention.sliding_window`, read back by
    `load_gguf`), but llama.cpp's `llama` architecture attends to the whole context:
    the same outputs for sequences within the window. Gemma 2/3 are written only with
    the attention scale and window pattern llama.cpp assumes (see `load_gguf_policy`).

    Raises `ValueError` naming the tensor when a weight holds NaN or ±inf, or values
    beyond what `dtype` stores (float16's 65504 for f16, for a q8_0 block's scale
    `max |w| / 127`), and naming the `TransformerConfig` field when llama.cpp cannot
    express the configuration; nothing is written then.
    """
    if not isinstance(model, Policy):
        raise TypeError(
            f"save_gguf writes a Policy (a causal LM), got {type(model).__name__}: llama.cpp "
            "has no scalar reward/value head"
        )
    if dtype not in _DTYPES:
        raise ValueError(f"save_gguf: dtype must be one of {list(_DTYPES)}, got {dtype!r}")
    path = os.fspath(path)
    gguf = gguf_package()
    cfg = model.cfg
    arch, meta = gguf_metadata(cfg)
    card = _general_entries(general) if general is not None else []
    if where_layers(model)(model).lora is not None:
        model = merge_lora(dequantize(model, dtype="float32"))
    hf = tensors_from_model(dequantize(model, dtype="float32"), "float32")
    names = gguf_names(cfg.n_layers, cfg.post_norms)
    tensors = []
    for hf_name, arr in hf.items():
        arr = _llama_cpp_rows(hf_name, np.asarray(arr, np.float32), cfg, arch)
        if cfg.norm_plus_one and hf_name.endswith("norm.weight"):
            arr = arr + np.float32(1.0)
        check_finite(arr, name=names[hf_name], source=path)
        tensors.append((names[hf_name], *_stored(names[hf_name], arr, dtype, path)))
    if cfg.rope_scaling is not None and cfg.rope_scaling.kind == "llama3":
        unscaled = dataclasses.replace(cfg, rope_scaling=None).inv_freq()
        factors = llama3_rope_factors(cfg.rope_scaling, unscaled)
        tensors.append(("rope_freqs.weight", factors, gguf.GGMLQuantizationType.F32))
    file_types = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16"}
    file_type = file_types.get(dtype, "MOSTLY_Q8_0")

    def fill(writer):
        _add_metadata(writer, meta)
        writer.add_type(gguf.GGUFType.MODEL)
        writer.add_file_type(int(gguf.LlamaFileType[file_type]))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for key, value, kind, item in card:
            writer.add_key_value(key, value, kind, sub_type=item)
        if metadata is not None:
            metadata(writer)
        for name, data, kind in tensors:
            writer.add_tensor(name, data, raw_dtype=kind)

    _write_atomic(path, arch, fill)


def save_gguf_adapter(
    model: PyTree, path: str | os.PathLike, *, alpha: float | None = None
) -> None:
    """Write `model`'s LoRA adapters alone as a llama.cpp LoRA-adapter GGUF file (the
    layout of `convert_lora_to_gguf.py`, see the module docstring), float32.

    **Arguments:**

    - `model`: a `Policy` (or other decoder model) with adapters from `apply_lora` /
      `load_lora_adapter`.
    - `path`: the file, written atomically.
    - `alpha`: the `adapter.lora.alpha` written; default `scale · rank` of the first
      adapter's first adapted layer. llama.cpp scales each tensor pair by `alpha / r` (`r` its
      rank), so each `B` is written multiplied by `scale · r / alpha`: the update
      `alpha / r · B A` is the model's (a `LayerwiseLoRAAdapter` layer by layer, at its
      own rank and scale).

    With the base model written by `save_gguf(without_lora(model), ...)`, llama.cpp
    (`--lora`) computes the adapted model. Raises `ValueError` when the model has no
    adapters, has DoRA adapters (`DoRAAdapter`: the format has no magnitudes; write
    `save_gguf(merge_lora(model), ...)` instead) or an adapter holds NaN or ±inf (naming
    the tensor; nothing is written).
    """
    path = os.fspath(path)
    gguf = gguf_package()
    lora = where_layers(model)(model).lora
    if lora is None:
        raise ValueError("save_gguf_adapter: the model has no LoRA adapters; call apply_lora first")
    dora = sorted(name for name, ad in lora.items() if isinstance(ad, DoRAAdapter))
    if dora:
        raise ValueError(
            f"save_gguf_adapter: the adapters of {dora} are DoRA, whose magnitudes llama.cpp's "
            "LoRA adapter format cannot hold; fold them in with merge_lora and write the "
            "model with save_gguf"
        )
    cfg = model_config(model)
    arch, _ = gguf_metadata(cfg)
    ranks, scales = layer_ranks_and_scales(next(iter(lora.values())), cfg.n_layers)
    first = next(i for i, r in enumerate(ranks) if r > 0)
    alpha = float(scales[first] * ranks[first]) if alpha is None else float(alpha)
    if not alpha > 0:
        raise ValueError(f"save_gguf_adapter: alpha must be positive, got {alpha!r}")
    names = gguf_names(cfg.n_layers, cfg.post_norms)
    tensors = []
    for target, ad in lora.items():
        a = np.asarray(jnp.asarray(ad.a, jnp.float32))
        b = np.asarray(jnp.asarray(ad.b, jnp.float32))
        ranks, scales = layer_ranks_and_scales(ad, cfg.n_layers)
        for i in range(cfg.n_layers):
            hf_name = f"model.layers.{i}.{_MODULES[target]}.weight"
            base = names[hf_name]
            r, factor = ranks[i], np.float32(scales[i] * ranks[i] / alpha)
            if r == 0:  # a layer without an adapter
                continue
            lora_a = np.ascontiguousarray(a[i][:, :r].T)
            lora_b = np.ascontiguousarray(b[i][:r].T) * factor
            lora_b = _llama_cpp_rows(hf_name, lora_b, cfg, arch)
            for suffix, arr in (("lora_a", lora_a), ("lora_b", lora_b)):
                check_finite(arr, name=f"{base}.{suffix}", source=path)
                tensors.append((f"{base}.{suffix}", arr))

    def fill(writer):
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
        for name, arr in tensors:
            writer.add_tensor(name, arr, raw_dtype=gguf.GGMLQuantizationType.F32)

    _write_atomic(path, arch, fill)
