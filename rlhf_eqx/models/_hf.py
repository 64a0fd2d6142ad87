"""Hugging Face checkpoints: `config.json` + `*.safetensors`.

Families (see `_hf_config` for the config fields and `_hf_tensors` for the tensor
names): Llama 2/3.x (`llama3` and `linear` rope scaling, tied or untied embeddings),
Mistral (sliding window), Qwen2/2.5 (q/k/v biases), Qwen3 (QK-norm), Gemma, Gemma 2
and Gemma 3 text models. A checkpoint is either one `model.safetensors` or shards
`model-0000i-of-0000n.safetensors` listed in `model.safetensors.index.json`
(`weight_map`); where both are present the single file is read, as transformers does.
Tensors are read one at a time through safetensors' lazy `safe_open` and written into
the model's stacked fields (device arrays, filled in place) as they come, so loading
peaks near one model copy plus one tensor, not at every shard plus a stacked copy plus
the model.

**dtypes.** numpy has no native bfloat16; `ml_dtypes.bfloat16` (installed with jax)
fills the gap and the `safetensors` numpy API reads and writes it, so bfloat16
checkpoints load and save without a float32 detour. `save_hf` writes the model's
parameter dtype unless `dtype` says otherwise.

**Safety.** Tensors are read with `safetensors.numpy` (a JSON header plus raw
buffers) and the config with `json`: loading never executes code from the checkpoint
(no pickle, no `torch.load`). `save_hf` writes the new checkpoint into a fresh
directory beside the target and swaps it into place, so the target never holds a
half-written checkpoint.
"""

import errno
import json
import math
import os
import re
import shutil
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from ._build import check_finite
from ._heads import Policy, RewardModel, ValueModel
from ._hf_config import _family, config_from_hf, hf_head
from ._hf_export import config_to_hf
from ._hf_tensors import (
    arrays_from_tensors,
    check_float16_range,
    fill_model,
    tensors_from_model,
)
from ._layers import AbstractQuantizedWeight

_TORCH_DTYPES = ("float32", "bfloat16", "float16")
_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_CONFIG = "config.json"
_GENERATION = "generation_config.json"


def _safetensors_numpy():
    try:
        import safetensors.numpy as stnp
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "reading/writing Hugging Face checkpoints needs the `safetensors` package "
            "(pip install safetensors, or rlhf_eqx[io])"
        ) from e
    return stnp


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def _load_file(path: str) -> dict[str, np.ndarray]:
    """The tensors of one safetensors file, each checked to be finite (`check_finite`)."""
    reader = _safe_open(path)
    return {name: _checked_tensor(reader, name, path) for name in reader.keys()}


def _checked_tensor(reader, name: str, path: str) -> np.ndarray:
    """Tensor `name` of the file `path` open in `reader`, checked to be finite; a
    `ValueError` naming the file when its data cannot be read."""
    try:
        arr = reader.get_tensor(name)
    except Exception as e:  # safetensors raises its own error types for bad data
        raise ValueError(
            f"{path}: not a readable safetensors file ({type(e).__name__}: {e})"
        ) from None
    check_finite(arr, name=name, source=path)
    return arr


_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")


def _safe_open(path: str):
    """A lazy reader of one safetensors file (`pread` where safetensors has it, so that
    no tensor outlives its use as a mapped page); a `ValueError` naming the file when
    its header is unreadable."""
    from safetensors import safe_open

    _safetensors_numpy()  # the install hint when safetensors is missing
    try:
        try:
            return safe_open(path, framework="np", backend="pread")
        except TypeError:  # pragma: no cover - safetensors before `backend`
            return safe_open(path, framework="np")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: file not found") from None
    except Exception as e:  # safetensors raises its own error types for bad headers/data
        why = _header_problem(path) or f"{type(e).__name__}: {e}"
        raise ValueError(f"{path}: not a readable safetensors file ({why})") from None


# bytes per element of the safetensors dtypes (sub-byte float formats are not checked)
_DTYPE_BYTES = {
    **dict.fromkeys(("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0"), 1),
    **dict.fromkeys(("F8_E4M3FNUZ", "F8_E5M2FNUZ"), 1),
    **dict.fromkeys(("U16", "I16", "F16", "BF16"), 2),
    **dict.fromkeys(("U32", "I32", "F32"), 4),
    **dict.fromkeys(("U64", "I64", "F64", "C64"), 8),
}


def _header_problem(path: str) -> str | None:
    """What is wrong in a safetensors file (an 8-byte little-endian header length, the
    JSON header, then the data at the header's `data_offsets`) that names the tensor: the
    first tensor, in the order of the data, of an unknown dtype, whose bytes disagree
    with its shape and dtype, or whose data runs past the end of the file; or a header
    that does. `None` when none of these is, or when the header is not one this reads."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return None
            n = int.from_bytes(head, "little")
            if 8 + n > size:
                return f"truncated: the header ends at byte {8 + n}, the file has {size} bytes"
            header = json.loads(f.read(n))
        entries = sorted(
            (int(e["data_offsets"][0]), int(e["data_offsets"][1]), name, e["dtype"], e["shape"])
            for name, e in header.items()
            if name != "__metadata__"
        )
        for begin, end, name, dtype, shape in entries:
            if not isinstance(dtype, str) or dtype.startswith(("F4", "F6")):
                continue
            width = _DTYPE_BYTES.get(dtype)
            if width is None:
                return f"tensor {name!r} has dtype {dtype!r}, which safetensors does not know"
            need = width * math.prod(int(d) for d in shape)
            if end - begin != need:
                return (
                    f"tensor {name!r} of shape {list(shape)} and dtype {dtype} takes {need} "
                    f"bytes, but its data_offsets span {end - begin}"
                )
            if 8 + n + end > size:
                return (
                    f"truncated: the data of tensor {name!r} ends at byte {8 + n + end}, the "
                    f"file has {size} bytes"
                )
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, OSError):
        return None
    return None


class _CheckpointTensors(Mapping):
    """The tensors of a checkpoint's safetensors files, read one at a time when asked
    for, each checked to be finite (`check_finite`) and, when loading as float16, within
    float16's range (`check_float16_range`). Shapes and dtypes come from the headers
    (`shape_and_float`), so names and shapes are checked before any tensor is read."""

    def __init__(self, directory: str, files: list[str], float16: bool):
        self._directory, self.float16 = directory, float16
        self._where: dict[str, tuple[str, Any]] = {}
        for name in files:
            path = os.path.join(directory, name)
            reader = _safe_open(path)
            for k in reader.keys():
                if k in self._where:  # which copy a reader takes is its own choice
                    raise ValueError(
                        f"{path}: tensor {k!r} is also in {self._where[k][0]} (two shards "
                        "hold it; which copy is meant is not known)"
                    )
                self._where[k] = (path, reader)

    def __getitem__(self, name: str) -> np.ndarray:
        path, reader = self._where[name]
        arr = _checked_tensor(reader, name, path)
        if self.float16:
            check_float16_range({name: arr}, path)
        return arr

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def file_of(self, name: str) -> str:
        """The path of the file holding tensor `name`."""
        return self._where[name][0]

    def shape_and_float(self, name: str) -> tuple[tuple[int, ...], bool]:
        view = self._where[name][1].get_slice(name)
        return tuple(int(n) for n in view.get_shape()), view.get_dtype() in _FLOAT_DTYPES


def _read_tensors(directory: str, *, float16: bool = False) -> _CheckpointTensors:
    """The checkpoint's tensors, read lazily (`_CheckpointTensors`): one file or the
    shards of the index."""
    _has = lambda name: os.path.isfile(os.path.join(directory, name))
    index_path = os.path.join(directory, _INDEX)
    single = os.path.join(directory, _SINGLE)
    # the single file before the index, as transformers reads them: its re-save without
    # shards removes the old shards but leaves their index behind
    if os.path.exists(single):
        files = [_SINGLE]
    elif os.path.exists(index_path):
        index = _read_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_path}: no `weight_map` object")
        files = sorted(set(weight_map.values()))
    else:
        pickled = [n for n in ("pytorch_model.bin", "pytorch_model.bin.index.json") if _has(n)]
        hint = (
            f" ({pickled[0]} holds pickled PyTorch weights, which are not read: convert the "
            "checkpoint to safetensors, e.g. save_pretrained(..., safe_serialization=True))"
            if pickled
            else ""
        )
        raise FileNotFoundError(f"{directory}: neither {_SINGLE} nor {_INDEX} found{hint}")
    for name in files:
        if not isinstance(name, str) or os.path.basename(name) != name:
            raise ValueError(f"{index_path}: shard name {name!r} is not a plain file name")
        if files != [_SINGLE] and not _has(name):
            listed = sum(1 for f in weight_map.values() if f == name)
            raise FileNotFoundError(
                f"{os.path.join(directory, name)}: file not found ({_INDEX} maps {listed} "
                f"tensor{'s' if listed != 1 else ''} to it: a shard missing from the checkpoint)"
            )
    return _CheckpointTensors(directory, files, float16)


def load_hf(directory: str | os.PathLike, *, dtype: str | None = None) -> Policy | RewardModel:
    """Load a Hugging Face checkpoint (Llama, Mistral, Qwen2/3, Gemma 1/2/3): a causal LM
    as a `Policy`, a one-label `...ForSequenceClassification` as a `RewardModel`.

    **Arguments:**

    - `directory`: holds `config.json` and `model.safetensors` or sharded
      `model-*.safetensors` with `model.safetensors.index.json`.
    - `dtype`: parameter dtype (`"float32"`, `"bfloat16"`, `"float16"`); `None` keeps
      the checkpoint's `torch_dtype`.

    **Returns:** a `Policy` whose logits equal the Hugging Face model's, or a
    `RewardModel` whose reward is the classifier's score at the last real token.

    Raises `ValueError` naming the file and field for invalid or unsupported config
    fields, the file for unreadable JSON or safetensors, the tensor for missing,
    extra or mis-shaped weights, and the file and tensor for a weight holding NaN or
    ±inf, or (with `dtype="float16"`) a magnitude past float16's range. No code from
    the checkpoint is executed.
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        what = "no such directory" if not os.path.exists(directory) else "not a directory"
        raise FileNotFoundError(
            f"{directory}: {what} (load_hf reads a Hugging Face checkpoint directory)"
        )
    config_path = os.path.join(directory, _CONFIG)
    if not os.path.exists(config_path) and os.path.exists(
        os.path.join(directory, "adapter_config.json")
    ):
        raise FileNotFoundError(
            f"{directory}: a PEFT adapter directory (adapter_config.json, no config.json); "
            "load its base model with load_hf and attach the adapter with load_lora_adapter"
        )
    config = _read_json(config_path)
    tensors = None
    if isinstance(config, dict):
        _family(config, config_path)  # an unsupported architecture is named first
        try:  # the headers only (names and shapes), for the layer count
            tensors = _read_tensors(directory)
        except (OSError, ValueError):  # named below, after what is wrong with the config
            tensors = None
        else:
            _check_layer_count(config, tensors, config_path)
    cfg = config_from_hf(config, dtype=dtype, source=config_path)
    head = hf_head(config, source=config_path)
    tensors = _read_tensors(directory) if tensors is None else tensors
    tensors.float16 = cfg.dtype == "float16"
    try:
        arrays = arrays_from_tensors(
            cfg, tensors, source=directory, head=head, dtype=cfg.param_dtype
        )
    except ValueError as e:
        derived = cfg.d_model // cfg.n_heads
        if "has shape" not in str(e) or "head_dim" in config or cfg.head_dim == derived:
            raise
        raise ValueError(
            f"{e} ({config_path} has no `head_dim`: transformers takes its config class's "
            f"default {cfg.head_dim}, not hidden_size / num_attention_heads = {derived}; "
            "write the checkpoint's head_dim there)"
        ) from None
    return fill_model(Policy if head == "lm" else RewardModel, cfg, arrays, source=directory)


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _check_layer_count(config: Any, tensors: Mapping[str, Any], config_path: str) -> None:
    """Refuse a `num_hidden_layers` past the layers whose tensors the checkpoint holds,
    before anything is built per layer (a mistyped count may be huge)."""
    layers = config.get("num_hidden_layers") if isinstance(config, dict) else None
    if isinstance(layers, bool) or not isinstance(layers, int):
        return  # config_from_hf names what is wrong with it
    found = {int(m.group(1)) for name in tensors if (m := _LAYER_INDEX.search(name))}
    held = max(found, default=-1) + 1
    if layers > held:
        raise ValueError(
            f"{config_path}: `num_hidden_layers` = {layers} but the checkpoint holds the "
            f"tensors of {held} layer{'s' if held != 1 else ''} (layer {held}'s are missing)"
        )


def _plan_shards(tensors: dict[str, np.ndarray], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names per shard, in order, each shard at most `max_shard_bytes` (a larger
    tensor gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, arr in tensors.items():
        if shards[-1] and used + arr.nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += arr.nbytes
    return shards


def _write_files(
    directory: str,
    config: dict[str, Any],
    tensors: dict[str, np.ndarray],
    shards,
    *,
    generation: dict[str, Any] | None = None,
) -> None:
    """Write `config.json` (and `generation_config.json` when `generation` is given),
    the safetensors file(s) and the index into `directory`; weight files get the
    config's permissions."""
    stnp = _safetensors_numpy()
    config_path = os.path.join(directory, _CONFIG)
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    written = []
    if generation is not None:
        with open(os.path.join(directory, _GENERATION), "w", encoding="utf-8") as f:
            json.dump(generation, f, indent=2)
        written.append(_GENERATION)
    metadata = {"format": "pt"}
    if len(shards) == 1:
        written.append(_SINGLE)
        stnp.save_file(tensors, os.path.join(directory, _SINGLE), metadata=metadata)
    else:
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
            written.append(fname)
        index = {
            "metadata": {"total_size": int(sum(a.nbytes for a in tensors.values()))},
            "weight_map": weight_map,
        }
        with open(os.path.join(directory, _INDEX), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
        written.append(_INDEX)
    mode = os.stat(config_path).st_mode & 0o777
    for fname in written:
        os.chmod(os.path.join(directory, fname), mode)


class NoSpace(OSError):
    """A full disk while exporting; the message names the directory."""

    def __init__(self, directory: str, what: str):
        super().__init__(
            errno.ENOSPC,
            f"no space left on the device of {directory} ({what} not written; what was "
            "there before is unchanged)",
        )

    def __str__(self) -> str:
        return str(self.strerror)


def disk_full(e: BaseException, directory: str) -> bool:
    """Whether `e` (or an error it wraps) comes from a full disk: an `OSError` with
    `ENOSPC`/`EDQUOT`, safetensors' error carrying that OS error, or (a short write
    carries no errno) a device with less than 1 MiB free."""
    seen, io = set(), False
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if f"(os error {errno.ENOSPC})" in str(e) or f"(os error {errno.EDQUOT})" in str(e):
            return True
        # an OSError with another errno (no permission, a read-only or virtual file
        # system) is not a full disk, however little the device reports free
        io = io or (isinstance(e, OSError) and e.errno is None)
        io = io or type(e).__name__ == "SafetensorError"
        e = e.__cause__ or e.__context__
    if not io:
        return False
    try:
        st = os.statvfs(directory)
        return st.f_bavail * st.f_frsize < (1 << 20)
    except OSError:
        return False


def cannot_write(e: OSError, target: str, what: str) -> OSError:
    """`e` (a file or directory that could not be made for `target`) as one `OSError`
    line (of `e`'s errno, hence subclass) naming `target` and the directory."""
    where = os.path.dirname(os.path.abspath(target))
    reason = e.strerror or str(e)
    return OSError(
        e.errno,
        f"cannot write {target}: {reason} in {where} ({what} not written; what was there "
        "before is unchanged)",
    )


def prepare_parent(target: str, what: str) -> str | None:
    """Make the directory that is to hold `target`, with any missing parents; returns
    the outermost directory made (`None` when it existed), for `remove_created`. A path
    that runs through a file, or a directory that cannot be made, is one `OSError`
    line naming `target`."""
    directory = os.path.dirname(os.path.abspath(target))
    created, existing = None, directory
    while not os.path.exists(existing):
        created, existing = existing, os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise NotADirectoryError(
            errno.ENOTDIR,
            f"cannot write {target}: {existing} is a file, not a directory ({what} not written)",
        )
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        remove_created(directory, created)
        raise OSError(
            e.errno,
            f"cannot write {target}: the directory {e.filename or directory} cannot be made: "
            f"{e.strerror or e} ({what} not written)",
        ) from None
    return created


def remove_created(directory: str, created: str | None) -> None:
    """Remove `directory` and its parents up to `created`, the first one made for an
    export (`prepare_parent`), where each is empty: a failed export leaves none behind."""
    while created is not None:
        try:
            os.rmdir(directory)
        except OSError:
            return
        if directory == created:
            return
        directory = os.path.dirname(directory)


def _write_atomically(target: str, write, what: str) -> None:
    """`write(staging)` into a fresh directory beside `target`, then moved into place
    (`_swap_into_place`); on any error the staging directory (and the parent
    directories made for it) are removed, and a full disk or a directory that cannot be
    written raises one `OSError` line naming `target` (what was there stays as it was).
    A `target` that is a symbolic link is written where it points (the link stays)."""
    target = os.path.realpath(target)
    created = prepare_parent(target, what)
    _remove_stale(target)
    staging = _sibling(target, "tmp")
    try:
        try:
            os.mkdir(staging)
        except OSError as e:
            raise cannot_write(e, target, what) from None
        write(staging)
        _swap_into_place(staging, target)
    except BaseException as e:
        shutil.rmtree(staging, ignore_errors=True)
        remove_created(os.path.dirname(target), created)
        if isinstance(e, Exception) and disk_full(e, os.path.dirname(target)):
            raise NoSpace(target, what) from None
        raise


def _is_checkpoint_file(name: str) -> bool:
    return name in (_CONFIG, _SINGLE, _INDEX) or bool(_SHARD_NAME.fullmatch(name))


def _swap_into_place(staging: str, target: str) -> None:
    """Make the files written in `staging` those of `target`. A new `target` is
    `staging` renamed. An existing directory stays the same directory, with its other
    files (tokenizer, generation config, ...) untouched and whatever holds it open (a
    process's working directory, open files) still valid: each new file is renamed over
    its old one (`os.replace`, atomic per file; the JSON files, which name the others,
    last), then the old checkpoint files the new checkpoint does not have are removed."""
    if not os.path.isdir(target):
        os.rename(staging, target)
        return
    names = sorted(os.listdir(staging), key=lambda n: (n.endswith(".json"), n))
    for name in names:
        _replace(os.path.join(staging, name), os.path.join(target, name))
    for name in os.listdir(target):
        if _is_checkpoint_file(name) and name not in names:
            os.remove(os.path.join(target, name))
    os.rmdir(staging)


def _replace(src: str, dst: str) -> None:
    """`os.replace(src, dst)`; across file systems (a `dst` directory that is a mount
    point) a copy beside `dst`, then renamed over it."""
    try:
        os.replace(src, dst)
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        part = f"{dst}.part-{uuid.uuid4().hex[:12]}"
        try:
            shutil.copy2(src, part)
            os.replace(part, dst)
        finally:
            if os.path.exists(part):
                os.remove(part)


def _sibling(target: str, kind: str) -> str:
    parent, name = os.path.split(target)
    return os.path.join(parent, f".{name}.{kind}-{uuid.uuid4().hex[:12]}")


def _remove_stale(target: str) -> None:
    """Delete staging directories a crashed `save_hf` left beside `target`."""
    parent, name = os.path.split(target)
    if not os.path.isdir(parent or "."):
        return
    for entry in os.listdir(parent or "."):
        stale = entry.startswith(f".{name}.tmp-") or (
            entry.startswith(f".{name}.old-") and os.path.isdir(target)
        )
        if stale:
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def _check_written_finite(tensors: dict[str, np.ndarray], dtype: str) -> None:
    """Refuse to write a tensor holding NaN or ±inf (which `load_hf` would refuse to
    read): a diverged model, or a weight beyond float16's range (±65504)."""
    for name, arr in tensors.items():
        try:
            check_finite(arr, name=name, source="save_hf")
        except ValueError as e:
            why = str(e).split(": the checkpoint is corrupt")[0]
            hint = (
                " (float16 holds magnitudes up to 65504 only: export as bfloat16 or float32)"
                if dtype == "float16"
                else " (a diverged model?)"
            )
            raise ValueError(f"{why} in {dtype}{hint}; nothing written") from None


def save_hf(
    policy: Policy | RewardModel | ValueModel,
    directory: str | os.PathLike,
    *,
    max_shard_bytes: int = 5 * 2**30,
    dtype: str | None = None,
    pad_token_id: int | None = None,
    bos_token_id: int | None = None,
    eos_token_id: int | Sequence[int] | None = None,
) -> None:
    """Write a model as a Hugging Face checkpoint (`config.json` + safetensors).

    **Arguments:**

    - `policy`: a `Policy` (written as the family's causal LM), or a `RewardModel` /
      `ValueModel` (written as the family's one-label `...ForSequenceClassification`:
      `score.weight [1, D]`; its scalar `bias` must be zero), without LoRA adapters
      (merge them first with `merge_lora`, or drop them with `without_lora`).
      Int8-quantised projections are written dequantised.
    - `directory`: the checkpoint directory. The checkpoint is written into a fresh
      directory beside it and then moved into place: an existing checkpoint there is
      replaced only once the new one is complete (file by file, each an atomic rename),
      the directory itself and the other files in it are kept as they are (a process
      working in it, or holding a file of it open, is not disturbed), and staging
      directories left by an interrupted save are removed. A full disk raises one
      `OSError` line naming the directory (the previous checkpoint is kept).
    - `max_shard_bytes`: shard size limit; when the weights exceed it they are split
      into `model-0000i-of-0000n.safetensors` (a tensor larger than the limit gets a
      shard of its own) with `model.safetensors.index.json`, else one
      `model.safetensors`.
    - `dtype`: dtype written (`"float32"`, `"bfloat16"`, `"float16"`); default the
      model's parameter dtype.
    - `pad_token_id`: written to `config.json` when given (a sequence classifier reads
      its score at the last token that is not `pad_token_id`).
    - `bos_token_id`, `eos_token_id` (an id or several: EOS and the end-of-turn ids, a
      tokenizer's `stop_ids`): written to `config.json` when given, and for a `Policy`
      to `generation_config.json` too; transformers' `generate` stops at every id of
      `eos_token_id` only when the checkpoint names them (and `rlhf_eqx`'s tokenizers
      read the list back as their `stop_ids`).

    The architecture written is the family the configuration's switches describe
    (`config_to_hf`). A weight that is NaN or ±inf in the written dtype (a diverged
    model, or beyond float16's range) is a `ValueError` naming the tensor, and nothing
    is written.
    """
    if not isinstance(policy, (Policy, RewardModel, ValueModel)):
        raise TypeError(
            f"save_hf exports a Policy, RewardModel or ValueModel, got {type(policy).__name__}"
        )
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    if policy.transformer.layers.lora is not None:
        quantized = any(
            isinstance(leaf, AbstractQuantizedWeight)
            for leaf in jax.tree.leaves(
                policy, is_leaf=lambda x: isinstance(x, AbstractQuantizedWeight)
            )
        )
        merge = "merge_lora(dequantize(policy))" if quantized else "merge_lora(policy)"
        raise ValueError(
            f"save_hf: the model has LoRA adapters; fold them in with {merge} "
            "(or drop them with without_lora(policy)) before exporting"
        )
    dtype = dtype or policy.cfg.dtype
    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"save_hf: dtype must be one of {list(_TORCH_DTYPES)}, got {dtype!r}")
    head = "lm" if isinstance(policy, Policy) else "score"
    config = config_to_hf(policy.cfg, dtype=dtype, head=head, pad_token_id=pad_token_id)
    generation: dict[str, Any] | None = {}
    for name, ids in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)):
        if ids is not None:
            config[name] = generation[name] = _token_ids(name, ids, policy.cfg.vocab_size)
    if head != "lm" or eos_token_id is None:
        generation = None  # a scorer does not generate
    tensors = tensors_from_model(policy, dtype)
    _check_written_finite(tensors, dtype)
    target = os.path.abspath(os.fspath(directory))
    if os.path.exists(target) and not os.path.isdir(target):
        raise ValueError(f"save_hf: {target} exists and is not a directory")
    shards = _plan_shards(tensors, max_shard_bytes)
    write = lambda d: _write_files(d, config, tensors, shards, generation=generation)
    _write_atomically(target, write, "export")


def _token_ids(name: str, ids: object, vocab_size: int) -> int | list[int]:
    """`ids` (an id or a sequence of them) as `config.json` holds it; a `ValueError`
    naming `name` for a value that is not an id of the vocabulary."""
    many = isinstance(ids, (list, tuple))
    values = list(ids) if many else [ids]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v < vocab_size:
            raise ValueError(f"save_hf: {name}={ids!r}: must be ids in [0, {vocab_size})")
    values = [int(v) for v in values]
    return values if many else values[0]
