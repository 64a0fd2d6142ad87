"""JAX's persistent compilation cache for command-line runs: compiled programs kept on disk.

A run's time to its first iterations is mostly XLA compilation (the steps, the sampler,
the log-prob passes). With the cache, a second run of the same programs (same shapes,
settings, JAX and XLA versions and flags) loads them from disk instead of compiling.

The command line turns it on (`ops.compilation_cache`, default on) in the user's cache
directory, `$XDG_CACHE_HOME/rlhf_eqx/jax` or `~/.cache/rlhf_eqx/jax`, bounded at
`ops.compilation_cache_max_mb` (least recently used entries are evicted). Importing
`rlhf_eqx` never turns it on; a script calls `enable_compilation_cache`. A directory
already given to JAX (`JAX_COMPILATION_CACHE_DIR`, `jax.config`) is kept as it is;
`RLHF_EQX_COMPILATION_CACHE=0` switches the command line's cache off.

JAX trusts what it reads from the cache: keep the directory private to the user.
"""

import importlib.util
import os
import sys

import jax

ENV_SWITCH = "RLHF_EQX_COMPILATION_CACHE"
"""The environment variable that switches the command line's cache off (`0`, `false`,
`off`, `no`)."""

DEFAULT_MAX_MB = 2048
"""The default size bound of the cache directory, in MiB."""

MIN_COMPILE_TIME_S = 0.2
"""Programs that compile faster than this are not written (JAX's default is 1 s; the
sampler and log-prob programs of small models compile in 0.2-1 s and add up)."""


def default_cache_dir() -> str:
    """`$XDG_CACHE_HOME/rlhf_eqx/jax`, or `~/.cache/rlhf_eqx/jax` without it."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "rlhf_eqx", "jax")


def compilation_cache_dir() -> str | None:
    """The directory of JAX's persistent compilation cache, or `None` when it is off."""
    if not jax.config.jax_enable_compilation_cache:
        return None
    return jax.config.jax_compilation_cache_dir or None


def enable_compilation_cache(
    directory: str | None = None,
    *,
    max_mb: int | None = DEFAULT_MAX_MB,
    min_compile_time_s: float = MIN_COMPILE_TIME_S,
) -> str:
    """Keep this process's compiled programs on disk, in `directory`, and reuse them.

    Sets JAX's persistent compilation cache (`jax_compilation_cache_dir`,
    `jax_compilation_cache_max_size`, `jax_persistent_cache_min_compile_time_secs`).
    Call it before the programs are compiled: a program compiled earlier in the process
    is neither read nor written. A second call with another directory moves the cache
    there.

    **Arguments:**

    - `directory`: where the programs go (created if needed); default
      `default_cache_dir()`, `$XDG_CACHE_HOME/rlhf_eqx/jax` or `~/.cache/rlhf_eqx/jax`.
    - `max_mb`: the size bound in MiB: past it, the least recently used programs are
      evicted (needs the `filelock` package); `None`: no bound.
    - `min_compile_time_s`: programs that compile faster are not written.

    **Returns:** the directory, as an absolute path.
    """
    from jax._src import compilation_cache as cc  # reset_cache: a new directory applies

    if max_mb is not None and (isinstance(max_mb, bool) or not isinstance(max_mb, int)):
        raise ValueError(f"max_mb={max_mb!r}: must be a positive integer or None")
    if max_mb is not None and max_mb <= 0:
        raise ValueError(f"max_mb={max_mb!r}: must be a positive integer or None")
    if max_mb is not None and importlib.util.find_spec("filelock") is None:
        raise ValueError(f"max_mb={max_mb}: bounding the cache needs `pip install filelock`")
    if min_compile_time_s < 0:
        raise ValueError(f"min_compile_time_s={min_compile_time_s!r}: must be >= 0")
    path = os.path.abspath(os.path.expanduser(directory or default_cache_dir()))
    os.makedirs(path, exist_ok=True)
    if jax.config.jax_compilation_cache_dir not in (None, path) and cc.is_initialized():
        cc.reset_cache()
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_compilation_cache_max_size", -1 if max_mb is None else max_mb << 20)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
    return path


def cache_switched_off() -> bool:
    """Whether `RLHF_EQX_COMPILATION_CACHE` says off (`0`, `false`, `off`, `no`)."""
    return os.environ.get(ENV_SWITCH, "").strip().lower() in ("0", "false", "off", "no")


def command_line_cache(enabled: bool, max_mb: int) -> str | None:
    """The command line's cache: `enable_compilation_cache(max_mb=max_mb)` unless
    `enabled` is false, `RLHF_EQX_COMPILATION_CACHE` is off, or JAX already has a
    directory (the user's own, kept); without one, with a note, where the directory
    cannot be made. Returns the directory in use, or `None`."""
    if not enabled or cache_switched_off():
        return None
    if jax.config.jax_compilation_cache_dir:
        return compilation_cache_dir()
    if importlib.util.find_spec("filelock") is None:
        print(
            "note: no compilation cache (bounding it needs `pip install filelock`)",
            file=sys.stderr,
        )
        return None
    try:
        return enable_compilation_cache(max_mb=max_mb)
    except OSError as e:  # an unwritable or misplaced cache directory: run without one
        print(f"note: no compilation cache ({e})", file=sys.stderr)
        return None
