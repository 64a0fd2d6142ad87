"""Continuous batching (`generate_continuous`) vs the static batch loop (`generate_batch`),
side by side in one run, on a mix of completion lengths.

The requests: `--requests` prompts (seeded random ids, left-padded, 16 to `--prompt` real
tokens), each with a completion budget drawn from the length mix (seeded):

- `log` (default): 16, 32, 64, 128 or 256 tokens, each equally likely (a long-tailed mix:
  most completions are short, a few are long);
- `uniform`: any length in [16, 256], equally likely;
- `equal`: every request 256 tokens (no length spread: the overhead of continuous
  batching itself).

The lengths are forced by the budgets, not by the model: a randomly initialised model
almost never emits its stop id, so a row ends at its budget. Continuous batching
takes the budgets as `budgets=` (a row stops after its budget, a stop id or a stop
sequence); the static loop runs `generate_batch` on consecutive batches of `--slots`
requests with `max_new_tokens` = the longest budget in the batch (every row of a batch
steps until the longest is done, as a static rollout does) and each row is cut at its
budget afterwards. Both get the same stop id (`eos_id`); continuous batching also
checks a two-token stop sequence inside its loop. Sampling is at temperature 1.

Tokens/s counts completion tokens kept (up to each row's budget or stop). Rounds
alternate between the two (which one goes first alternates too); medians are printed
with their ratio. Models: the benchmark model (`side_by_side/common.py` `CONFIG`: vocab
4096, d_model 256, 4 layers, random weights) and the shipped stories260K checkpoint
(which does emit its stop id, so its lengths are the smaller of the budget and where
the story ends). The float32 matmul peak of this machine is measured in the same run.

Usage: `python benchmarks/bench_sampler.py [--slots 16] [--requests 64] [--rounds 5]
[--mix log] [--models config,stories] [--json FILE]` (`--quick` for a smoke run).
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
MIXES = {
    "log": lambda rng, n, hi: rng.choice([16, 32, 64, 128, 256], size=n),
    "uniform": lambda rng, n, hi: rng.integers(16, 257, size=n),
    "equal": lambda rng, n, hi: np.full((n,), 256),
}


def requests(vocab: int, n: int, prompt: int, mix: str, seed: int = 0):
    """Left-padded prompts `[n, prompt]`, their masks and per-request budgets."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min(16, prompt), prompt + 1, size=n)
    ids = rng.integers(3, vocab, size=(n, prompt))
    masks = np.arange(prompt)[None, :] >= (prompt - lengths)[:, None]
    budgets = MIXES[mix](rng, n, 256).astype(np.int32)
    return jnp.asarray(np.where(masks, ids, 0), jnp.int32), jnp.asarray(masks), budgets


def run_static(policy, prompts, masks, budgets, key, *, slots: int, eos_id: int):
    """Today's rollout loop: batches of `slots` requests, each decoding up to its longest
    budget; rows cut at their own budget afterwards. Returns the tokens kept."""
    kept = 0
    for i, start in enumerate(range(0, prompts.shape[0], slots)):
        sl = slice(start, start + slots)
        b = budgets[sl]
        out = rx.generate_batch(
            policy,
            prompts[sl],
            masks[sl],
            jax.random.fold_in(key, i),
            max_new_tokens=int(b.max()),
            temperature=1.0,
            eos_id=eos_id,
        )
        comp = np.asarray(out.completion_mask[:, prompts.shape[1] :])
        kept += int(np.sum(comp & (np.arange(comp.shape[1])[None, :] < b[:, None])))
    return kept


def run_continuous(policy, prompts, masks, budgets, key, *, slots: int, eos_id: int, stop):
    out = rx.generate_continuous(
        policy,
        prompts,
        masks,
        jax.random.split(key, prompts.shape[0]),
        slots=slots,
        max_new_tokens=int(budgets.max()),
        budgets=budgets,
        temperature=1.0,
        eos_id=eos_id,
        stop_sequences=[stop],
    )
    return int(np.sum(np.asarray(out.completion_mask)))


def bench(name, policy, args, peak):
    prompts, masks, budgets = requests(policy.vocab_size, args.requests, args.prompt, args.mix)
    eos_id = 2  # the llama2.c tokenizer's stop id; an ordinary id for the random model
    stop = [5, 6]
    kw = dict(slots=args.slots, eos_id=eos_id)
    runs = {
        "static": lambda key: run_static(policy, prompts, masks, budgets, key, **kw),
        "continuous": lambda key: run_continuous(
            policy, prompts, masks, budgets, key, stop=stop, **kw
        ),
    }
    first = {}
    for label, fn in runs.items():  # compile (every static batch shape) outside the timing
        t0 = time.perf_counter()
        fn(jax.random.key(0))
        first[label] = time.perf_counter() - t0
    rates = {k: [] for k in runs}
    for r in range(args.rounds):
        order = list(runs) if r % 2 == 0 else list(runs)[::-1]
        for label in order:
            t0 = time.perf_counter()
            kept = runs[label](jax.random.key(r + 1))
            rates[label].append(kept / (time.perf_counter() - t0))
    med = {k: statistics.median(v) for k, v in rates.items()}
    paired = statistics.median(c / s for c, s in zip(rates["continuous"], rates["static"]))
    # the static loop's slot-steps per budgeted token (its waste, if no row stops early)
    ideal = budgets.reshape(-1, args.slots).max(axis=1).sum() * args.slots / budgets.sum()
    row = dict(
        model=name,
        mix=args.mix,
        slots=args.slots,
        requests=args.requests,
        budget_tokens=int(budgets.sum()),
        static_tok_s=med["static"],
        continuous_tok_s=med["continuous"],
        ratio=med["continuous"] / med["static"],
        ratio_per_round_median=paired,
        static_slot_steps_per_budget_token=float(ideal),
        first_call_s=first,
        rounds={k: [round(x, 1) for x in v] for k, v in rates.items()},
        matmul_peak_gflops=peak / 1e9,
    )
    print(
        f"{name:>9} mix={args.mix:<7} slots={args.slots} requests={args.requests}: "
        f"static {med['static']:8.0f} tok/s   continuous {med['continuous']:8.0f} tok/s   "
        f"ratio {row['ratio']:.2f}x (per-round median {paired:.2f}x; static runs "
        f"{ideal:.2f} slot-steps per budgeted token)"
    )
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mix", choices=sorted(MIXES), default="log")
    ap.add_argument("--models", default="config,stories")
    ap.add_argument("--json", default=None, help="append one JSON line per model here")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    args = ap.parse_args()
    if args.quick:
        args.slots, args.requests, args.rounds = 4, 8, 1
    if args.requests % args.slots:
        ap.error("--requests must be a multiple of --slots")
    peak = measure_matmul_peak()
    print(f"float32 matmul peak (1024², same run): {peak / 1e9:.0f} GFLOP/s")
    models = {
        "config": lambda: rx.Policy(rx.TransformerConfig(**CONFIG), key=jax.random.key(0)),
        "stories": lambda: rx.load_llama2c(os.path.join(ASSETS, "stories260K.bin"))[0],
    }
    for name in args.models.split(","):
        row = bench(name, models[name](), args, peak)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
