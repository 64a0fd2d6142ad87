"""The paged, prefix-shared KV cache (`generate_paged`) against the dense continuous
sampler (`generate_continuous`), side by side in one run: cache memory held and tokens/s.

The requests (seeded): `--prompts` prompts, each a common `--prefix`-token system prompt
followed by 8 to 24 prompt-specific tokens (left-padded), sampled `--group` times each
(`num_samples`, a GRPO group), with completion budgets drawn long-tailed per row: 16,
32, 64, 128 or 256 tokens with probabilities 0.4, 0.25, 0.15, 0.12, 0.08 (most short, a
few long). Both samplers get the same keys, budgets, stop id and `--slots`, and produce
the same rows (checked every round).

Memory is the KV cache the decode loop holds: the dense layout keeps `slots · (P +
max_new_tokens)` token entries whatever the rows hold; the paged one
`peak pages in use · page bytes` (`PagedCacheStats.peak_bytes`). The paged runs use the
default pool (the dense layout's room: nothing waits for pages) and a pool of
`--small-pool` times the peak the default run used (requests wait to be admitted and
rows wait for pages when it is full: `PagedCacheStats.stalls`). Both layouts hold the
same staged prefills besides.

Tokens/s counts completion tokens kept. Rounds alternate the order of the runs;
medians and their ratios are printed. Models: the shipped stories260K checkpoint and the
benchmark model (`side_by_side/common.py` `CONFIG`: vocab 4096, d_model 256, 4 layers,
random weights).

Usage: `python benchmarks/bench_paged_cache.py [--slots 16] [--rounds 3]
[--models stories,config] [--page-size 16] [--json FILE]` (`--quick` for a smoke run).
"""

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import rlhf_eqx as rx
from rlhf_eqx.pipelines.tools import measure_matmul_peak

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "side_by_side"))
from common import CONFIG  # noqa: E402

ASSETS = os.path.join(os.path.dirname(rx.__file__), "assets")
LENGTHS = np.array([16, 32, 64, 128, 256])
WEIGHTS = np.array([0.4, 0.25, 0.15, 0.12, 0.08])


def requests(vocab: int, prompts: int, group: int, prefix: int, seed: int = 0):
    """Left-padded prompts sharing a `prefix`-token system prompt, and row budgets."""
    rng = np.random.default_rng(seed)
    system = rng.integers(3, vocab, size=prefix)
    tails = rng.integers(8, 25, size=prompts)
    P = prefix + 24
    toks = np.zeros((prompts, P), np.int32)
    masks = np.zeros((prompts, P), bool)
    for r, n in enumerate(tails):
        ids = np.concatenate([system, rng.integers(3, vocab, size=n)])
        toks[r, P - len(ids) :] = ids
        masks[r, P - len(ids) :] = True
    budgets = rng.choice(LENGTHS, size=prompts * group, p=WEIGHTS).astype(np.int32)
    return jnp.asarray(toks), jnp.asarray(masks), budgets


def bench(name, policy, args, peak):
    toks, masks, budgets = requests(policy.vocab_size, args.prompts, args.group, args.prefix)
    N = int(LENGTHS.max())
    kw = dict(
        slots=args.slots, max_new_tokens=N, budgets=budgets, num_samples=args.group,
        temperature=1.0, eos_id=2,
    )  # fmt: skip
    keys = lambda r: jax.random.split(jax.random.key(r), args.prompts)
    stats = {}

    def dense(r):
        return rx.generate_continuous(policy, toks, masks, keys(r), **kw)

    def paged(label, num_pages):
        def run(r):
            out, st = rx.generate_paged(
                policy, toks, masks, keys(r), page_size=args.page_size, num_pages=num_pages, **kw
            )
            stats[label] = st
            return out

        return run

    runs = {"dense": dense, "paged": paged("paged", None)}
    t0 = time.perf_counter()
    runs["paged"](0).tokens.block_until_ready()  # compile, and size the small pool
    # at least the largest request's own worst case (a smaller pool is refused)
    worst = -(-(toks.shape[1] + N - 1) // args.page_size)
    small = max(int(args.small_pool * int(stats["paged"].peak_pages)), worst)
    first = {"paged": time.perf_counter() - t0}
    runs["paged_small"] = paged("paged_small", small)
    for label in ("dense", "paged_small"):
        t0 = time.perf_counter()
        runs[label](0).tokens.block_until_ready()
        first[label] = time.perf_counter() - t0
    rates = {k: [] for k in runs}
    differ = 0  # rows whose tokens differ from the dense sampler's (float rounding only)
    for r in range(args.rounds):
        order = list(runs) if r % 2 == 0 else list(runs)[::-1]
        outs = {}
        for label in order:
            t0 = time.perf_counter()
            out = runs[label](r + 1)
            kept = int(np.sum(np.asarray(out.completion_mask)))
            rates[label].append(kept / (time.perf_counter() - t0))
            outs[label] = out
        for label in ("paged", "paged_small"):  # the same rows
            same = np.all(np.asarray(outs[label].tokens == outs["dense"].tokens), axis=1)
            differ += int(np.sum(~same))
    med = {k: statistics.median(v) for k, v in rates.items()}
    st, st_small = stats["paged"], stats["paged_small"]
    row = dict(
        model=name,
        slots=args.slots,
        prompts=args.prompts,
        group=args.group,
        prefix=args.prefix,
        page_size=args.page_size,
        budget_tokens=int(budgets.sum()),
        dense_cache_bytes=st.dense_bytes,
        paged_peak_bytes=int(st.peak_bytes),
        paged_peak_pages=int(st.peak_pages),
        paged_num_pages=st.num_pages,
        pages_shared=int(st.pages_shared),
        small_pool_stalls=int(st_small.stalls),
        small_pool_pages=st_small.num_pages,
        small_pool_peak_bytes=int(st_small.peak_bytes),
        memory_ratio=st.dense_bytes / int(st.peak_bytes),
        small_memory_ratio=st.dense_bytes / int(st_small.peak_bytes),
        dense_tok_s=med["dense"],
        paged_tok_s=med["paged"],
        paged_small_tok_s=med["paged_small"],
        speed_ratio=med["paged"] / med["dense"],
        small_speed_ratio=med["paged_small"] / med["dense"],
        rows_differing=differ,
        first_call_s=first,
        rounds={k: [round(x, 1) for x in v] for k, v in rates.items()},
        matmul_peak_gflops=peak / 1e9,
    )
    kib = lambda b: f"{b / 1024:.0f} KiB"
    print(
        f"{name}: {args.prompts} prompts x {args.group}, {args.prefix}-token shared prefix, "
        f"slots={args.slots}, page_size={args.page_size}, {row['budget_tokens']} budgeted "
        f"tokens\n"
        f"  cache held: dense {kib(st.dense_bytes)}; paged peak {kib(row['paged_peak_bytes'])}"
        f" ({st.peak_pages} of {st.num_pages} pages, {st.pages_shared} page references "
        f"shared) = {row['memory_ratio']:.2f}x less; small pool of {st_small.num_pages} "
        f"pages: peak {kib(row['small_pool_peak_bytes'])} = {row['small_memory_ratio']:.2f}x "
        f"less ({st_small.stalls} row-steps waited for a page)\n"
        f"  tokens/s: dense {med['dense']:.0f}, paged {med['paged']:.0f} "
        f"({row['speed_ratio']:.2f}x), paged small pool {med['paged_small']:.0f} "
        f"({row['small_speed_ratio']:.2f}x); rounds {row['rounds']}; rows differing from "
        f"dense: {differ}"
    )
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prefix", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--small-pool", type=float, default=0.5, help="x the default run's peak")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", default="stories,config")
    ap.add_argument("--json", default=None, help="append one JSON line per model here")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    args = ap.parse_args()
    if args.quick:
        args.slots, args.prompts, args.group, args.rounds = 4, 2, 2, 1
    peak = measure_matmul_peak()
    print(f"float32 matmul peak (1024², same run): {peak / 1e9:.0f} GFLOP/s")
    models = {
        "stories": lambda: rx.load_llama2c(os.path.join(ASSETS, "stories260K.bin"))[0],
        "config": lambda: rx.Policy(rx.TransformerConfig(**CONFIG), key=jax.random.key(0)),
    }
    for name in args.models.split(","):
        row = bench(name, models[name](), args, peak)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
