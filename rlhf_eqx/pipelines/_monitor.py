"""Monitoring of a run: model FLOPs and MFU against a measured matmul peak, device
memory, reward improvement and `jax.profiler` traces (TensorBoard scalars are a tracker,
`_tracker_backends.py`).

**Model FLOPs** follow the usual count (Kaplan et al. 2020; Chowdhury et al. 2022, PaLM
appendix B): a forward pass costs `2 N` FLOPs per token for `N` parameters (one multiply
and one add per weight), a training step `6 N` (forward, and twice that backward).
Attention's own `O(T^2)` term, normalisation and the sampler's bookkeeping are left out,
so MFU is slightly understated for long sequences. **MFU** is model FLOPs per second
divided by the peak float32 FLOP/s of a large matmul measured on the run's device at the
start of the run (`measure_matmul_peak`) — a peak this machine actually reaches, not a
datasheet number.
"""

import os
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp


def measure_matmul_peak(*, size: int = 1024, repeats: int = 5) -> float:
    """The float32 FLOP/s of a `size x size` matmul on the default device: the best of
    `repeats` timed runs after a warm-up (`2 size^3` FLOPs each)."""
    a = jnp.ones((size, size), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * size**3 / max(best, 1e-9)


def model_flops(
    n_params: int | Sequence[int], *, train_tokens: int = 0, forward_tokens: int = 0
) -> float:
    """`6 N` FLOPs per trained token plus `2 N` per token of forward-only passes
    (sampling, reference and value passes), `N = sum(n_params)`."""
    n = n_params if isinstance(n_params, int) else sum(n_params)
    return 6.0 * n * train_tokens + 2.0 * n * forward_tokens


def device_memory() -> dict[str, float]:
    """`{"memory_in_use_bytes", "memory_peak_bytes"}` of the first local device, where
    the backend reports them (`device.memory_stats()`); `{}` on CPU, where it does not."""
    stats = jax.local_devices()[0].memory_stats()
    if not stats:
        return {}
    out = {}
    if "bytes_in_use" in stats:
        out["memory_in_use_bytes"] = float(stats["bytes_in_use"])
    if "peak_bytes_in_use" in stats:
        out["memory_peak_bytes"] = float(stats["peak_bytes_in_use"])
    return out


class Profiler:
    """Writes a `jax.profiler` trace of iterations `start <= i < stop` to `directory`
    (open it with TensorBoard's profile plugin or Perfetto)."""

    def __init__(self, steps: Sequence[int], directory: str):
        self.start, self.stop = (int(steps[0]), int(steps[1])) if steps else (-1, -1)
        self.directory = directory
        self.active = False

    def before(self, i: int) -> None:
        if i == self.start and not self.active:
            os.makedirs(self.directory, exist_ok=True)
            jax.profiler.start_trace(self.directory)
            self.active = True

    def after(self, i: int) -> None:
        if self.active and i + 1 >= self.stop:
            self.close()

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
