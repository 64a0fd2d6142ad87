"""Import of llama2.c `.bin` checkpoints (Karpathy's llama2.c, e.g. the TinyStories models).

Two float32 layouts are read, both written by llama2.c's `export.py`:

- **legacy (version 0)**: a header of 7 little-endian int32 — `dim, hidden_dim,
  n_layers, n_heads, n_kv_heads, vocab_size, seq_len` — where a negative `vocab_size`
  means the classifier is stored separately (unshared) and a positive one means it is
  tied to the token embedding. Then, in `run.c` order:
  `token_embedding [V, D]`, `rms_att [L, D]`, `wq [L, Q, D]`, `wk [L, KV, D]`,
  `wv [L, KV, D]`, `wo [L, D, Q]`, `rms_ffn [L, D]`, `w1 [L, F, D]`, `w2 [L, D, F]`,
  `w3 [L, F, D]`, `rms_final [D]`, the precomputed rotary tables `freq_cis_real`,
  `freq_cis_imag` (`seq_len * head_size / 2` floats each, skipped), and `wcls [V, D]`
  when unshared.
- **version 1**: uint32 magic `0x616b3432` ("ak42"), int32 version `1`, the same 7
  int32, a `uint8` shared-classifier flag, zero padding to 256 bytes; then
  `rms_att`, `rms_ffn`, `rms_final`, `token_embedding`, `wq`, `wk`, `wv`, `wo`, `w1`,
  `w2`, `w3` and `wcls` when unshared (no rotary tables). Version 2 (Q8_0 groups) is
  not supported.

llama2.c stores linear weights as `[out, in]`; rlhf_eqx stores `[in, out]`, with q/k/v
fused into `wqkv` and `w1` (gate) / `w3` (up) fused into `w_gate_up`.

**Rotary convention.** llama2.c rotates interleaved pairs of each head (dims `2i`,
`2i+1`); rlhf_eqx (like Hugging Face Llama) rotates dims `i` and `i + head_dim/2`. The
two are the same model up to a permutation of the q and k output rows within each
head, which is applied here exactly as in Hugging Face's `convert_llama_weights_to_hf.py`
(`permute`): row `2i` of a head moves to row `i`, row `2i+1` to row `i + head_dim/2`.
Attention scores `q·k` are invariant under a permutation applied to both, and `v`/`wo`
are untouched.

The file is read with `np.fromfile` as raw little-endian float32: loading never
executes code from the file (no pickle).
"""

import os

import numpy as np
from jaxtyping import Float32, Shaped

from ._build import check_finite, policy_from_arrays
from ._config import TransformerConfig
from ._heads import Policy

_MAGIC = 0x616B3432
_V1_HEADER_BYTES = 256
_LEGACY_HEADER_BYTES = 7 * 4


def permute_rotary_rows(
    w: Shaped[np.ndarray, "*L out in"], n_heads: int
) -> Shaped[np.ndarray, "*L out in"]:
    """Reorder the output rows of a q or k projection from interleaved to rotate-half rotary.

    Within each head, output row `2i` becomes row `i` and row `2i+1` becomes row
    `i + head_dim / 2` — Hugging Face's `permute` in `convert_llama_weights_to_hf.py`.
    Use it to convert a checkpoint written for interleaved rotary pairs (llama2.c,
    Meta's original Llama release) to the rotate-half layout of rlhf_eqx and Hugging
    Face; attention scores are unchanged when q and k are both permuted.

    **Arguments:**

    - `w`: `[..., n_heads * head_dim, in]`, llama2.c / PyTorch `[out, in]` layout, any
      leading axes (e.g. stacked layers).
    - `n_heads`: the heads of this projection (`n_kv_heads` for k).

    **Returns:**

    `w` with its output rows permuted, same shape and dtype.
    """
    *lead, out, fan_in = w.shape
    hd = out // n_heads
    w = w.reshape(*lead, n_heads, hd // 2, 2, fan_in)
    w = np.swapaxes(w, -3, -2)
    return w.reshape(*lead, out, fan_in)


def _refuse_other_format(path: str) -> None:
    """Refuse, saying what it is and how to load it, a file that the first bytes show to be
    another checkpoint format (its header is never a plausible llama2.c one): a GGUF
    file, a safetensors file, a PyTorch pickle or zip archive."""
    with open(path, "rb") as f:
        head = f.read(9)
    what = None
    if head[:4] == b"GGUF":
        what = (
            "a GGUF file (magic 'GGUF'); load it with rlhf_eqx.load_gguf (on the command "
            "line, name it .gguf)"
        )
    elif len(head) == 9 and head[8:9] == b"{" and 2 <= int.from_bytes(head[:8], "little") < 2**27:
        what = (
            "a safetensors file; load its Hugging Face checkpoint directory (with "
            "config.json) with rlhf_eqx.load_hf"
        )
    elif head[:4] == b"PK\x03\x04" or (
        head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")
    ):
        what = (
            "a PyTorch checkpoint (a pickle or zip archive, not read: loading it would run "
            "its code); convert it to safetensors and load the directory with rlhf_eqx.load_hf"
        )
    if what is not None:
        raise ValueError(f"{path}: not a llama2.c checkpoint but {what}")


def read_llama2c_header(path: str | os.PathLike) -> tuple[dict[str, int], bool, int, int]:
    """Read a llama2.c checkpoint's header only (no weights): its sizes and layout.

    **Arguments:** `path`, a llama2.c `.bin` checkpoint (the float32 legacy format or
    version 1).

    **Returns:** `(sizes, shared_classifier, version, data_offset)`: the 7 header ints
    by name (`dim`, `hidden_dim`, `n_layers`, `n_heads`, `n_kv_heads`, `vocab_size`,
    `seq_len`; `vocab_size` made positive), whether the classifier shares the token
    embedding, the format version (0 for the legacy format) and the byte offset of the
    first weight.

    Raises `ValueError`, naming the file, for a file too small or truncated, an
    unsupported version, or implausible sizes (not positive, heads that do not divide the
    width, an odd head size); one whose first bytes show another format (GGUF,
    safetensors, a PyTorch pickle or zip archive) is named as that, with how to load it.
    """
    path = os.fspath(path)
    size = os.path.getsize(path)
    if size < _LEGACY_HEADER_BYTES:
        _refuse_other_format(path)
        raise ValueError(f"{path}: file of {size} bytes is too small to be a llama2.c checkpoint")
    magic = int(np.fromfile(path, dtype="<u4", count=1)[0])
    if magic == _MAGIC:
        if size < _V1_HEADER_BYTES:
            raise ValueError(f"{path}: truncated llama2.c version-1 header ({size} bytes)")
        raw = np.fromfile(path, dtype=np.uint8, count=_V1_HEADER_BYTES)
        version = int(raw[4:8].view("<i4")[0])
        if version != 1:
            raise ValueError(
                f"{path}: llama2.c format version {version} is not supported (only the float32 "
                "legacy format and version 1 are; version 2 is Q8_0-quantised)"
            )
        ints = raw[8:36].view("<i4").astype(np.int64)
        shared = bool(raw[36])
        offset = _V1_HEADER_BYTES
    else:
        ints = np.fromfile(path, dtype="<i4", count=7).astype(np.int64)
        shared = bool(ints[5] > 0)
        ints[5] = abs(ints[5])
        version = 0
        offset = _LEGACY_HEADER_BYTES
    names = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")
    sizes = {n: int(v) for n, v in zip(names, ints)}
    bad = [n for n, v in sizes.items() if v <= 0 or v > 2**24]
    if bad or sizes["dim"] % sizes["n_heads"] or sizes["n_heads"] % sizes["n_kv_heads"]:
        _refuse_other_format(path)
        raise ValueError(f"{path}: not a llama2.c checkpoint (implausible header {sizes})")
    if (sizes["dim"] // sizes["n_heads"]) % 2:
        raise ValueError(
            f"{path}: head size {sizes['dim'] // sizes['n_heads']} is odd (header {sizes})"
        )
    return sizes, shared, version, offset


def read_llama2c(
    path: str | os.PathLike,
) -> tuple[dict[str, int], bool, dict[str, Float32[np.ndarray, "..."]]]:
    """Read a llama2.c checkpoint into numpy arrays in llama2.c's own layout.

    **Returns:** `(sizes, shared_classifier, arrays)` where `sizes` holds the 7 header
    ints (`vocab_size` made positive) and `arrays` maps the llama2.c names
    (`token_embedding`, `rms_att`, `wq`, ..., `rms_final`, and `wcls` when unshared) to
    float32 arrays shaped as listed in the module docstring (`[out, in]`, interleaved
    rotary rows, as in the file).

    Raises `ValueError`, naming the file, when its size disagrees with the header, and
    naming the file and the array (its index's first axis is the layer) when a weight
    holds NaN or ±inf.
    """
    path = os.fspath(path)
    sizes, shared, version, offset = read_llama2c_header(path)
    D, F, L = sizes["dim"], sizes["hidden_dim"], sizes["n_layers"]
    H, K, V, S = sizes["n_heads"], sizes["n_kv_heads"], sizes["vocab_size"], sizes["seq_len"]
    hd = D // H
    Q, KV = H * hd, K * hd
    shapes = {
        "token_embedding": (V, D),
        "rms_att": (L, D),
        "wq": (L, Q, D),
        "wk": (L, KV, D),
        "wv": (L, KV, D),
        "wo": (L, D, Q),
        "rms_ffn": (L, D),
        "w1": (L, F, D),
        "w2": (L, D, F),
        "w3": (L, F, D),
        "rms_final": (D,),
        "wcls": (V, D),
    }
    if version == 0:
        order = [
            "token_embedding",
            "rms_att",
            "wq",
            "wk",
            "wv",
            "wo",
            "rms_ffn",
            "w1",
            "w2",
            "w3",
            "rms_final",
            "freq_cis_real",
            "freq_cis_imag",
        ]
        shapes["freq_cis_real"] = shapes["freq_cis_imag"] = (S, hd // 2)
    else:
        order = [
            "rms_att",
            "rms_ffn",
            "rms_final",
            "token_embedding",
            "wq",
            "wk",
            "wv",
            "wo",
            "w1",
            "w2",
            "w3",
        ]
    if not shared:
        order.append("wcls")
    expected = sum(int(np.prod(shapes[n])) for n in order)
    actual_bytes = os.path.getsize(path) - offset
    if actual_bytes != 4 * expected:
        raise ValueError(
            f"{path}: size mismatch — the header {sizes} (shared classifier: {shared}, format "
            f"version {version}) implies {4 * expected} bytes of float32 weights after the "
            f"{offset}-byte header, but the file has {actual_bytes}"
        )
    flat = np.fromfile(path, dtype="<f4", offset=offset)
    arrays: dict[str, np.ndarray] = {}
    pos = 0
    for name in order:
        n = int(np.prod(shapes[name]))
        arrays[name] = flat[pos : pos + n].reshape(shapes[name])
        if not name.startswith("freq_cis"):
            check_finite(arrays[name], name=name, source=path)
        pos += n
    arrays.pop("freq_cis_real", None)
    arrays.pop("freq_cis_imag", None)
    return sizes, shared, arrays


def llama2c_config(
    sizes: dict[str, int],
    shared_classifier: bool,
    *,
    dtype: str = "float32",
    norm_eps: float = 1e-5,
    rope_theta: float = 10000.0,
) -> TransformerConfig:
    """The `TransformerConfig` of a llama2.c checkpoint with header `sizes`."""
    return TransformerConfig(
        vocab_size=sizes["vocab_size"],
        d_model=sizes["dim"],
        n_layers=sizes["n_layers"],
        n_heads=sizes["n_heads"],
        n_kv_heads=sizes["n_kv_heads"],
        d_ff=sizes["hidden_dim"],
        max_seq_len=sizes["seq_len"],
        rope_theta=rope_theta,
        norm_eps=norm_eps,
        tie_embeddings=shared_classifier,
        dtype=dtype,
    )


def load_llama2c_policy(
    model_path: str | os.PathLike,
    *,
    dtype: str = "float32",
    norm_eps: float = 1e-5,
    rope_theta: float = 10000.0,
) -> Policy:
    """Load a llama2.c `.bin` checkpoint as a `Policy`.

    **Arguments:**

    - `model_path`: a float32 llama2.c checkpoint (legacy or version-1 format; see the
      module docstring).
    - `dtype`: parameter dtype of the returned model (`"float32"`, `"bfloat16"`, ...).
    - `norm_eps`, `rope_theta`: not stored in the file; llama2.c's `run.c` uses `1e-5`
      and `10000`.

    **Returns:** the policy. The q/k rows are permuted from llama2.c's interleaved
    rotary layout to rotate-half, so it computes exactly llama2.c's logits. The
    tokenizer is read by `rlhf_eqx.load_llama2c`, which pairs the two.

    The file is read as raw float32 with numpy; no code from it is executed.
    """
    sizes, shared, w = read_llama2c(model_path)
    cfg = llama2c_config(sizes, shared, dtype=dtype, norm_eps=norm_eps, rope_theta=rope_theta)
    H, K = cfg.n_heads, cfg.n_kv_heads
    wq = permute_rotary_rows(w["wq"], H)
    wk = permute_rotary_rows(w["wk"], K)
    t = lambda x: np.swapaxes(x, -1, -2)  # [L, out, in] -> [L, in, out]
    wqkv = np.concatenate([t(wq), t(wk), t(w["wv"])], axis=-1)
    w_gate_up = np.concatenate([t(w["w1"]), t(w["w3"])], axis=-1)
    arrays = {
        "embed": w["token_embedding"],
        "attn_norm": w["rms_att"],
        "wqkv": wqkv,
        "wo": t(w["wo"]),
        "mlp_norm": w["rms_ffn"],
        "w_gate_up": w_gate_up,
        "w_down": t(w["w2"]),
        "final_norm": w["rms_final"],
        "lm_head": None if shared else w["wcls"].T,
    }
    return policy_from_arrays(cfg, arrays, source=os.fspath(model_path))
