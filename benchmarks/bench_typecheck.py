"""Host-side cost of rlhf_eqx's runtime shape checks, on and off, side by side.

The checks are decided when `rlhf_eqx` is first imported (`RLHF_EQX_TYPECHECK`), so
each mode runs in its own interpreter. The rounds alternate (on, off, on, off, ...)
so that drift in the machine's load hits both modes alike; each round times every
workload a few times (taking turns) after a warm-up (which builds the checkers) and
keeps the least time; the report gives, per workload, the median over rounds of each
mode and the median over rounds of the ratio on/off (with its range). Times are the
process's CPU time (`time.process_time`), which other processes on a busy machine
disturb less than wall time. Workloads, all on the host and through the library's own
functions:

- `read`: `data.load_preferences` of the file (500 HH-style transcripts by default);
- `tokenize`: `data.tokenize_preferences` of those pairs with the shipped llama2.c
  tokenizer (`rlhf_eqx/assets/tok512.bin`);
- `collate`: `data.collate_preferences` of every batch of 8 pairs (bucketed rows);
- `pack`: `data.pack_preferences` of every batch of 8 pairs (4 pairs a row) and
  `data.pack_preference_steps` of all pairs;
- `loader`: one epoch of `data.BatchIterator` (batch 8) with each batch collated.

The pairs are synthetic (seeded), HH-style multi-turn transcripts; `--data PATH`
reads a real file instead (e.g. HH-RLHF's `harmless-base/test.jsonl.gz`), whose first
`--pairs` records the other workloads use.

Usage: `python benchmarks/bench_typecheck.py [--rounds 6] [--repeats 7] [--pairs 500]`.
The `on/off` column is the number to hold to at most 1.2.
"""

import argparse
import gzip
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

WORKLOADS = ("read", "tokenize", "collate", "pack", "loader")
_WORDS = (
    "the a an of to in is it you that he was for on are with as I his they be at one have "
    "this from or had by hot word but what some we can out other were all there when up use "
    "your how said each she which do their time if will way about many then them write would "
    "like so these her long make thing see him two has look more day could go come did number "
    "sound no most people my over know water than call first who may down side been now find "
    "please help recipe story garden river mountain teacher question answer model"
).split()


def synthetic_hh(n: int, seed: int = 0) -> list[dict]:
    """`n` HH-style records: 1-3 turns of shared prompt, two different last replies."""
    rng = random.Random(seed)

    def sentence(lo: int, hi: int) -> str:
        words = [rng.choice(_WORDS) for _ in range(rng.randint(lo, hi))]
        return " ".join(words).capitalize() + rng.choice(".?!")

    records = []
    for _ in range(n):
        turns = [f"\n\nHuman: {sentence(4, 30)}\n\nAssistant:" for _ in range(rng.randint(1, 3))]
        prompt = "".join(f"{t} {sentence(3, 25)}" for t in turns[:-1]) + turns[-1]
        chosen, rejected = sentence(5, 60), sentence(5, 60)
        while rejected == chosen:
            rejected = sentence(5, 60)
        records.append({"chosen": f"{prompt} {chosen}", "rejected": f"{prompt} {rejected}"})
    return records


def _best_times(fns: dict, repeats: int) -> dict[str, float]:
    """Least CPU time of each `fns[name]()` over `repeats` runs, after a warm-up run; the
    workloads take turns, so a burst of load elsewhere spreads over all of them."""
    for fn in fns.values():
        fn()  # warm-up: builds the checkers, fills caches
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.process_time()
            fn()
            best[name] = min(best[name], time.process_time() - start)
    return best


def worker(path: str, pairs: int, repeats: int) -> dict[str, float]:
    """Time every workload in this interpreter (checks as `RLHF_EQX_TYPECHECK` says)."""
    import importlib.resources

    import rlhf_eqx as rx
    from rlhf_eqx import data

    tok = data.load_tokenizer(str(importlib.resources.files("rlhf_eqx.assets") / "tok512.bin"))
    lengths = data.SequenceLengths(max_length=512, max_prompt_length=256)
    records = data.load_preferences(path)[:pairs]
    tokenized, _ = data.tokenize_preferences(records, tok, lengths=lengths)
    batches = [tokenized[i : i + 8] for i in range(0, len(tokenized) - 7, 8)]
    vocab = tok.vocab_size

    def read():
        data.load_preferences(path)

    def tokenize():
        data.tokenize_preferences(records, tok, lengths=lengths)

    def collate():
        for b in batches:
            data.collate_preferences(
                b, pad_id=tok.pad_id, lengths=lengths, bucket_size=64, vocab_size=vocab
            )

    def pack():
        for b in batches:
            data.pack_preferences(
                b, pad_id=tok.pad_id, pairs_per_row=4, bucket_size=64, vocab_size=vocab
            )
        data.pack_preference_steps(
            tokenized, pad_id=tok.pad_id, row_length=1024, rows_per_step=4, vocab_size=vocab
        )  # rows of 2 x max_length: any pair fits

    def loader():
        for idx in data.BatchIterator(len(tokenized), batch_size=8, seed=0, num_epochs=1):
            batch = data.collate_preferences(
                [tokenized[i] for i in idx],
                pad_id=tok.pad_id,
                lengths=lengths,
                bucket_size=64,
                vocab_size=vocab,
            )
            rx.data.padding_stats([batch])

    fns = {"read": read, "tokenize": tokenize, "collate": collate, "pack": pack, "loader": loader}
    return _best_times({name: fns[name] for name in WORKLOADS}, repeats)


def _run_mode(mode: str, path: str, pairs: int, repeats: int) -> dict[str, float]:
    env = dict(os.environ, RLHF_EQX_TYPECHECK="1" if mode == "on" else "0")
    env.setdefault("JAX_PLATFORMS", "cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    args = [sys.executable, os.path.abspath(__file__), "--worker", "--data", path]
    args += ["--pairs", str(pairs), "--repeats", str(repeats)]
    out = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"the {mode} worker failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6, help="alternating on/off rounds")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per round")
    parser.add_argument("--pairs", type=int, default=500, help="preference pairs")
    parser.add_argument("--data", default=None, help="a preference file to read instead")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.data, args.pairs, args.repeats)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = args.data
        if path is None:
            path = os.path.join(tmp, "pairs.jsonl.gz")
            with gzip.open(path, "wt", encoding="utf-8") as f:
                for record in synthetic_hh(args.pairs):
                    f.write(json.dumps(record) + "\n")
        times: dict[str, dict[str, list[float]]] = {"on": {}, "off": {}}
        for r in range(args.rounds):
            for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
                for name, t in _run_mode(mode, path, args.pairs, args.repeats).items():
                    times[mode].setdefault(name, []).append(t)
    source = args.data or f"{args.pairs} synthetic HH pairs"
    print(f"host workloads, {source}; {args.rounds} rounds of checks on and off, side by side")
    print("times: medians over rounds (ms of CPU); on/off: median of the rounds' ratios [range]")
    print(f"{'workload':<10} {'checks on':>10} {'checks off':>11} {'on/off':>7}   range")
    worst = 0.0
    for name in WORKLOADS:
        on, off = times["on"][name], times["off"][name]
        ratios = sorted(a / b for a, b in zip(on, off, strict=True))
        ratio = statistics.median(ratios)
        worst = max(worst, ratio)
        print(
            f"{name:<10} {statistics.median(on) * 1e3:>10.2f} {statistics.median(off) * 1e3:>11.2f}"
            f" {ratio:>7.2f}   [{ratios[0]:.2f}, {ratios[-1]:.2f}]"
        )
    print(f"worst on/off: {worst:.2f}")


if __name__ == "__main__":
    main()
