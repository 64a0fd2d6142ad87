"""Shared settings and helpers of the side-by-side benchmarks (numpy and the standard
library only, so that every library's virtual environment can import it).

Every run is one process: `run_<library>.py WORKLOAD --inputs DIR` prints one JSON
line (`RESULT {...}`) with the step times, the first-step time (compile included),
the peak resident memory and a float32 matmul peak measured in the same process.
"""

import json
import os
import resource
import sys
import time

# The model every library runs: Llama architecture, float32.
CONFIG = dict(
    vocab_size=4096,
    d_model=256,
    n_layers=4,
    n_heads=8,
    n_kv_heads=4,
    d_ff=688,
    max_seq_len=4096,
    rope_theta=10000.0,
    norm_eps=1e-5,
)
HH_VOCAB = 512  # the HH-RLHF workload uses the stories260K tokenizer's vocabulary
HH_MAX_LEN = 512

DPO = dict(pairs=8, prompt=64, completion=192)
GEN = dict(batch=8, prompt=64, new=128)
RM = dict(
    pairs=8, prompt=64, completion=192, length=256
)  # a shared prompt per pair, as in real data
GRPO = dict(prompts=8, group=4, prompt=64, new=128)
# GRPO on a length mix: each completion's budget drawn (seeded) from GRPO_MIX_LENGTHS, as
# `benchmarks/bench_sampler.py`'s `log` mix; rlhf_eqx samples with `slots` rows in flight.
GRPO_MIX = dict(prompts=16, group=4, prompt=64, slots=32)
GRPO_MIX_LENGTHS = (16, 32, 64, 128, 256)
CURVE_TOKENS = 4096
CURVE_T = (128, 256, 512, 1024, 2048)
HH = dict(pairs=8, steps=12)

WORKLOADS = (
    "dpo",
    "dpo_cached",
    "gen_sample",
    "gen_greedy",
    "rm",
    "grpo",
    "grpo_mix",
    "hh_dpo",
) + tuple(f"curve_{t}" for t in CURVE_T)


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MiB (Linux `ru_maxrss` is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def time_steps(step, n: int):
    """Run `step()` once (the first step, compile included), then `n` more times.

    `step` must block until its result is ready. Returns `(first_s, [times])`.
    """
    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return first, times


def time_keyed_steps(step, n: int, seed: int = 0):
    """`time_steps` for a `step(key)` that needs a fresh JAX PRNG key each call (split
    from `jax.random.key(seed)`; JAX is imported here, not at the top of this file)."""
    import jax

    state = {"key": jax.random.key(seed)}

    def run():
        state["key"], sub = jax.random.split(state["key"])
        step(sub)

    return time_steps(run, n)


def matmul_gflops(matmul, n: int = 1024, repeats: int = 5) -> float:
    """A float32 matmul peak in GFLOP/s: `matmul()` multiplies two `n x n` matrices and
    blocks until done; run once to warm up, then the best of `repeats` runs."""
    matmul()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        matmul()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def jax_matmul_peak(n: int = 1024, repeats: int = 5) -> float:
    """`matmul_gflops` of a jitted `jnp.dot` on the default JAX device."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    f = jax.jit(jnp.dot)
    return matmul_gflops(lambda: f(a, b).block_until_ready(), n, repeats)


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def emit(library: str, workload: str, first_s: float, times, *, peak_gflops: float, **extra):
    """Print the `RESULT` line the driver collects."""
    out = dict(
        library=library,
        workload=workload,
        first_s=first_s,
        times=list(times),
        median_s=median(times),
        peak_rss_mb=peak_rss_mb(),
        matmul_gflops=peak_gflops,
        loadavg_1min=os.getloadavg()[0],  # how busy the machine was (2 cores)
        **extra,
    )
    print("RESULT " + json.dumps(out), flush=True)


def load_inputs(directory: str):
    """The `.npz` of token batches written by `make_inputs.py` (a dict of numpy arrays)."""
    import numpy as np

    with np.load(os.path.join(directory, "batches.npz")) as f:
        return {k: f[k] for k in f.files}


def to_ragged(seqs):
    """Rows of different lengths as `(flat int32 ids, int64 offsets)` (`ragged_rows`
    reads them back)."""
    import numpy as np

    flat = np.concatenate([np.asarray(s, np.int32) for s in seqs] or [np.zeros(0, np.int32)])
    offsets = np.cumsum([0] + [len(s) for s in seqs]).astype(np.int64)
    return flat, offsets


def ragged_rows(inputs, name: str) -> list[list[int]]:
    """The rows stored by `to_ragged` as `inputs[name]` and `inputs[name + "_offsets"]`."""
    flat, off = inputs[name], inputs[name + "_offsets"]
    return [flat[off[i] : off[i + 1]].tolist() for i in range(len(off) - 1)]


def ids_as_text(row) -> str:
    """Token ids as the text of `word_tokenizer` (`t5 t17 ...`), for libraries that
    take prompts as text."""
    return " ".join(f"t{int(i)}" for i in row)


def dpo_flops(pairs: int, T: int, *, with_reference: bool, cfg=CONFIG) -> float:
    """Standard FLOPs of one DPO step on `2·pairs` full rows of length `T` (every
    position through the whole model and head, as if nothing were skipped):
    6·N·tokens for the trained forward+backward, 2·N·tokens for the reference forward,
    plus attention `12·L·T²·D` per row for training (4 forward) and 4·L·T²·D for the
    reference. N counts the matmul parameters including the LM head."""
    D, F, L, V = cfg["d_model"], cfg["d_ff"], cfg["n_layers"], cfg["vocab_size"]
    kv = D // cfg["n_heads"] * cfg["n_kv_heads"]
    n_params = L * (D * (D + 2 * kv) + D * D + 3 * D * F) + D * V
    rows = 2 * pairs
    tokens = rows * T
    attn_fwd = rows * L * 2 * 2 * T * T * D  # q·k and p·v, full T² (no causal saving counted)
    train = 6 * n_params * tokens + 3 * attn_fwd
    ref = (2 * n_params * tokens + attn_fwd) if with_reference else 0.0
    return float(train + ref)


def workload_arg():
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("workload", choices=WORKLOADS)
    p.add_argument("--inputs", default=os.environ.get("BENCH_INPUTS", "/tmp/rlhf_bench_inputs"))
    p.add_argument("--steps", type=int, default=5)
    return p.parse_args()


def start(library: str, supported=None):
    """A runner's common start: parse `WORKLOAD --inputs DIR --steps N`, refuse a workload
    outside `supported` (None: all), load the inputs. Returns `(args, inputs)`."""
    args = workload_arg()
    if supported is not None and args.workload not in supported:
        raise SystemExit(f"workload {args.workload} is not run for {library}")
    return args, load_inputs(args.inputs)


def log(*args):
    print(*args, file=sys.stderr, flush=True)


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer `t0 … t{V-1}` (ids = the numbers): TRL needs a tokenizer
    object; the benchmark feeds token ids directly."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="t0", bos_token="t1", eos_token="t2", unk_token="t3"
    )
