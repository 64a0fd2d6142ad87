"""A native CPU kernel for products of few rows with llama.cpp blocks, built at first use.

XLA's CPU backend cannot multiply straight from packed bytes at the speed of memory: it
hands the multiply-reduce to a library kernel that converts the bytes one value at a
time and reads the weight once per row (see `_packed_products`). `_packed_rows.cc`
(shipped beside this file) does what llama.cpp's CPU kernels do: each output row's
Q8_0 / Q4_0 / Q4_1 blocks are decoded in vector registers and multiplied with every
row of activations before the next output row is read, split over XLA's intra-op
threads. The same kernel multiplies a float32 table stored by output row, such as a tied
LM head's `[V, D]` embedding (`native_dense_product`), which XLA's dot reads about twice
as slowly for a decode step's few rows. It is an XLA FFI handler (`jax.ffi`), so it
runs inside jitted programs, scans and while loops like any other op.

It is compiled once per machine with the system's C++ compiler (`$CXX`, else `c++` /
`g++` / `clang++`) for the machine's own instruction set (`RLHF_EQX_NATIVE_ARCH`
overrides `-march=native`; AVX-512, AVX2 and plain C++ paths), into the user's cache
directory (`$XDG_CACHE_HOME/rlhf_eqx/native` or `~/.cache/rlhf_eqx/native`; the file
name carries a hash of the source, the compiler, JAX's version and the CPU's flags; a
cached library that no longer loads, cut short or overwritten, is built again once).
Where no compiler is found, the build fails, or `RLHF_EQX_NATIVE=0` is set,
`native_rows_available()` is `False` and the products stay in XLA (`packed_product`,
`x @ wᵀ`), with the same values up to float32 summation order.

The kernel is registered with XLA when a product first asks for it (tracing), so a
program compiled elsewhere and only loaded here (`jax.experimental.serialize_executable`)
needs `native_rows_available()` called first, else XLA finds no handler for the custom
call; the compilation cache needs nothing, since a cached program is traced before it is
looked up. `jax.export` refuses to serialise the kernel's custom calls (they carry no
compatibility guarantee): trace a program to export with `RLHF_EQX_NATIVE=0`.
"""

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, UInt8

ENV_SWITCH = "RLHF_EQX_NATIVE"
"""The environment variable that turns the native kernel off (`0`, `false`, `off`, `no`)."""

ENV_ARCH = "RLHF_EQX_NATIVE_ARCH"
"""The environment variable that names the instruction set the kernel is compiled for
(`-march=...`; default `native`, this machine's: e.g. `x86-64-v3` for AVX2 machines
sharing one cache directory)."""

_SOURCE = os.path.join(os.path.dirname(__file__), "_packed_rows.cc")
_TARGET = "rlhf_eqx_packed_rows"
_TARGETS = {  # FFI target: the library's handler symbol
    _TARGET: "RlhfEqxPackedRows",
    "rlhf_eqx_dense_rows": "RlhfEqxDenseRows",
}
_KINDS = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2}  # the kernel's numbers of the block formats
NATIVE_KINDS = tuple(_KINDS)


def _switched_off() -> bool:
    return os.environ.get(ENV_SWITCH, "").strip().lower() in ("0", "false", "off", "no")


def _compiler() -> str | None:
    """`$CXX` when set (as given, even when it cannot be found: the build then fails
    with one warning naming it), else the first of `c++`, `g++`, `clang++` found."""
    chosen = os.environ.get("CXX", "").strip()
    if chosen:
        return shutil.which(chosen) or chosen
    for name in ("c++", "g++", "clang++"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "rlhf_eqx", "native")


def _build(compiler: str, *, again: bool = False) -> str:
    """Compile the kernel (or find it compiled, unless `again`) and return the shared
    library's path."""
    with open(_SOURCE, "rb") as f:
        source = f.read()
    include = jax.ffi.include_dir()
    arch = os.environ.get(ENV_ARCH, "").strip() or "native"
    flags = ["-O3", f"-march={arch}", "-std=c++17", "-shared", "-fPIC", "-w"]
    key = hashlib.sha256(
        b"\0".join(
            [source, compiler.encode(), " ".join(flags).encode(), jax.__version__.encode()]
            + [platform.machine().encode(), _cpu_flags().encode()]
        )
    ).hexdigest()[:20]
    directory = _cache_dir()
    path = os.path.join(directory, f"packed_rows-{key}.so")
    if os.path.exists(path) and not again:
        return path
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        cmd = [compiler, *flags, "-I", include, _SOURCE, "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode:
            errors = [line for line in done.stderr.splitlines() if "error" in line]
            raise RuntimeError((errors or [f"{compiler} exited {done.returncode}"])[0].strip())
        os.replace(tmp, path)  # atomic: a concurrent build writes the same file
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


@functools.cache
def _load() -> bool:
    if _switched_off() or jax.default_backend() != "cpu" or sys.platform == "win32":
        return False
    compiler = _compiler()
    if compiler is None:
        return False
    try:
        path = _build(compiler)
        try:
            lib = ctypes.cdll.LoadLibrary(path)
        except OSError:  # a damaged file in the cache (cut short, overwritten): built again
            lib = ctypes.cdll.LoadLibrary(_build(compiler, again=True))
        for target, symbol in _TARGETS.items():
            jax.ffi.register_ffi_target(
                target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu"
            )
    except Exception as e:  # a failed build leaves the XLA products, with one line
        warnings.warn(
            f"rlhf_eqx: the native packed-row kernel could not be built ({e}); "
            f"products on packed weights stay in XLA (set {ENV_SWITCH}=0 to skip the attempt)",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True


def native_rows_available() -> bool:
    """Whether the native kernel is built and registered (building it on the first call).

    `False` off the CPU backend, with `RLHF_EQX_NATIVE=0`, without a C++ compiler, or
    when the build fails (with a `RuntimeWarning` naming the error)."""
    return _load()


def _call(x: Array, raw: Array, kind: str) -> Array:
    out = jax.ShapeDtypeStruct((x.shape[0], raw.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(_TARGET, out)(x, raw, kind=np.int64(_KINDS[kind]))


def native_rows_product(
    x: Float[Array, "M n"], raw: UInt8[Array, "out nbytes"], kind: str
) -> Float[Array, "M out"]:
    """`x @ Wᵀ` for `W` the rows `raw` of llama.cpp blocks, by the native kernel.

    The same contract as `packed_product` (`y[m, o] = Σ_b Σ_j w(o, b, j) · x[m, b·QK +
    j]`, float32), differentiable in `x` (the gradient multiplies by the dequantised
    weight). Call `native_rows_available()` first; here it must be `True`.
    """
    # the block formats live with their decoders (which import this module's caller)
    from ._gguf_blocks import GGUF_BLOCKS

    if kind not in _KINDS:
        raise ValueError(f"native_rows_product: kind {kind!r} is not one of {list(NATIVE_KINDS)}")
    n, nbytes = x.shape[-1], raw.shape[-1]
    qk, size = GGUF_BLOCKS[kind]
    if n % qk or nbytes != n // qk * size:
        raise ValueError(
            f"native_rows_product: raw has {nbytes} bytes per row, expected {n // qk * size} "
            f"for x's {n} values of {kind}"
        )
    if not native_rows_available():
        raise RuntimeError("native_rows_product: the native kernel is not available here")
    return _product(x.astype(jnp.float32), raw, kind)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _product(x, raw, kind):
    return _call(x, raw, kind)


def _product_fwd(x, raw, kind):
    return _call(x, raw, kind), raw


def _product_bwd(kind, raw, g):
    from ._gguf_blocks import GGUF_BLOCKS, dequantize_rows

    qk, size = GGUF_BLOCKS[kind]
    w = dequantize_rows(raw, kind, raw.shape[-1] // size * qk)
    return g @ w, None


_product.defvjp(_product_fwd, _product_bwd)


NATIVE_MIN_DENSE = 1 << 18
"""Elements of a float32 table (1 MiB) from which `dense_product` takes the native
kernel: smaller ones stay in cache across decode steps, where XLA's dot is as fast."""


def _dense_call(x: Array, w: Array) -> Array:
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
    return jax.ffi.ffi_call("rlhf_eqx_dense_rows", out)(x, w)


def native_dense_product(x: Float[Array, "M n"], w: Float[Array, "out n"]) -> Float[Array, "M out"]:
    """`x @ wᵀ` for float32 `x` and a float32 table `w [out, n]` stored by output row (`n` a
    multiple of 32), as a tied LM head's embedding table, by the native kernel: each row
    of `w` is read once and multiplied with every row of `x` (see `_packed_rows.cc`).
    For a few rows of `x` XLA's dot reads such a table slower (SmolLM2's 49,152 × 576
    table and four rows: 7.6 against 3.9 ms on 2 idle cores,
    `benchmarks/bench_packed_decode.py --head 4`).
    Differentiable in both and vmappable as `dense_product` (with no bound on the rows).
    Call `native_rows_available()` first; here it must be `True`.
    """
    n = x.shape[-1]
    if x.dtype != jnp.float32 or w.dtype != jnp.float32:
        raise ValueError(
            f"native_dense_product: x and w must be float32, got {x.dtype} and {w.dtype}"
        )
    if w.ndim != 2 or w.shape[-1] != n or n % 32:
        raise ValueError(
            f"native_dense_product: w {w.shape} must be [out, n] with x's n = {n} columns, "
            "a multiple of 32"
        )
    if not native_rows_available():
        raise RuntimeError("native_dense_product: the native kernel is not available here")
    return dense_product(x, w, max_rows=sys.maxsize)


def dense_routed(x2: Array, w: Array, out_dtype=None) -> bool:
    """Whether `dense_product` takes `x2 @ wᵀ` (`w [out, n]`) to the native kernel when few
    rows multiply it: the kernel is built (`native_rows_available()`), `x2`, `w` and the
    result are float32, `w` is a matrix of at least `NATIVE_MIN_DENSE` elements with no
    sharding over devices, and `n` (the columns of both) is a multiple of 32. Decided
    when the product is traced; other shapes take XLA's dot, which names a mismatch."""
    f32 = jnp.dtype(jnp.float32)
    return (
        x2.dtype == f32
        and w.dtype == f32
        and (out_dtype is None or jnp.dtype(out_dtype) == f32)
        and x2.ndim == w.ndim == 2
        and w.size >= NATIVE_MIN_DENSE
        and x2.shape[-1] == w.shape[-1]
        and x2.shape[-1] % 32 == 0
        and _unsharded(w)
        and native_rows_available()
    )


def dense_product(
    x2: Float[Array, "M n"], w: Float[Array, "out n"], *, max_rows: int = 64
) -> Float[Array, "M out"]:
    """`x2 @ wᵀ` for a table that `dense_routed` admits: by the native kernel when at most
    `max_rows` rows of all vmapped calls together multiply it (a decode step's rows;
    `rows_folded`), else by XLA's dot. Only the float32 summation order differs.
    Differentiable in both arguments (the derivatives are XLA's products).
    """

    def dot(a, b):
        return a @ b.T

    def route(x2, w):
        return _dense_call(x2, w) if x2.shape[0] <= max_rows else dot(x2, w)

    product = rows_folded(route, dot)

    # the kernel computes values only; the tangent `dx·wᵀ + x·dwᵀ` is linear, so reverse
    # mode transposes it
    @jax.custom_jvp
    def differentiable(x2, w):
        return product(x2, w)

    @functools.partial(differentiable.defjvp, symbolic_zeros=True)
    def _jvp(primals, tangents):
        (x2, w), (dx, dw) = primals, tangents
        y = differentiable(x2, w)
        dy = jnp.zeros_like(y)
        if not isinstance(dx, jax.custom_derivatives.SymbolicZero):
            dy = dy + dot(dx, w)
        if not isinstance(dw, jax.custom_derivatives.SymbolicZero):
            dy = dy + dot(x2, dw)
        return y, dy

    return differentiable(x2, w)


def rows_folded(
    route: Callable[[Array, Array], Array], dense: Callable[[Array, Array], Array]
) -> Callable[[Array, Array], Array]:
    """`route(x2, w)` (a product of `x2 [M, n]` with one weight, which may choose its
    method from `M`) as a function whose vmapped calls fold their batched axes into the
    rows of one call (`jax.custom_batching.custom_vmap`), so that `B` vmapped one-row
    decode steps count `B` rows; a vmapped weight takes `dense` for each member."""

    @jax.custom_batching.custom_vmap
    def product(x2, w):
        return route(x2, w)

    @product.def_vmap
    def _batched(axis_size, in_batched, x2, w):
        x_batched, w_batched = in_batched
        if w_batched:
            return jax.vmap(dense, in_axes=(0 if x_batched else None, 0))(x2, w), True
        if not x_batched:
            return product(x2, w), False
        y = product(x2.reshape((-1, x2.shape[-1])), w)
        return y.reshape(x2.shape[:-1] + y.shape[-1:]), True

    return product


def _unsharded(w) -> bool:
    """Whether `w` is on one device as far as tracing tells (no mesh axes in its type)."""
    try:
        mesh = jax.typeof(w).sharding.mesh
    except Exception:
        return True
    return getattr(mesh, "empty", False) or getattr(mesh, "size", 1) <= 1
