"""GRPO on split meshes: synchronous, one-step off-policy, staleness 2 and partial
rollouts side by side in one run, on eight simulated devices.

    python benchmarks/bench_async_grpo.py [--rollouts 8] [--rounds 2] [--max-new-tokens 48]
        [--runs sync,one-step-off,partial-1] [--segment 16] [--sentences]

Four runs of the built-in model (`pipelines.tools.load_model("builtin")`, LoRA rank 8,
one step per rollout) with `rlhf_eqx.pipelines.runs.run_grpo`, 8 prompts x 4 samples
per rollout:

- `colocated`: `placement=colocated, staleness=0` (sampler and trainer on device 0);
- `sync`: `placement=split` (trainer `fsdp:4` on devices 0-3, sampler `data:4` on 4-7),
  `staleness=0`: each rollout waits for the update before it;
- `one-step-off`: split, `staleness=1`: rollout r + 1 samples on the sampler mesh
  while update r runs on the trainer mesh;
- `staleness-2`: split, `staleness=2`: the sampler keeps up to two rollouts queued;
- `partial-1`, `partial-2`: split, `staleness=1` / `2` with partial rollouts
  (`partial_rollouts=--segment`): each queued rollout's unfinished rows continue with
  every newer policy, `--segment` tokens at a time, the last segment by the policy of the
  update that consumes the rollout; a continuation samples those rows only (gathered,
  padded to a power of two that the sampler mesh's `"data"` axis divides).

`--runs` picks some of them (default: all). With `--sentences` the completions stop
after their first sentence (the tokenizer's "." is the stop id), a long-tailed
completion length mix (the built-in model rarely emits its own end of sequence); the
completion lengths (the decoded completions re-encoded) are printed and counted as the
completion tokens/s. The mean version lag is the mean, over completion tokens, of the
updates between the policy that sampled a token and the trained one (the staleness
itself without partial rollouts, once the run is `staleness` rollouts in).

The prompts are a long-tailed length mix (most a few words, a few long ones) and the
completions stop at the model's stop ids or `--max-new-tokens`; the completion lengths
are printed. The time of a run is the sum of its iterations' `iteration_time_s` after the
first `--warmup` (default 2; they compile: a partial run with staleness `k` meets its
last segment in iteration `k`, so give it `k + 1`; its continuations compile a sampler
per bucket of unfinished rows, which a later iteration of the first round may meet
first, and rounds after the first reuse); tokens/s counts completion tokens. Rounds
alternate the order of the runs; medians are printed.

Read the numbers for what they are: the eight "devices" are XLA's simulated CPU
devices, which share this machine's cores (2 on the machine these numbers come from),
so the sampler mesh and the trainer mesh do not add compute. What the measurement
shows is the scheduling (the sampler's queue kept full, updates not waiting for
sampling when the behaviour policy allows it) and the cost of the weight transfer
(`rollout/weight_sync_s`); it cannot show the speed-up of disjoint accelerators.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from rlhf_eqx import pipelines as pl  # noqa: E402

RUNS = {
    "colocated": dict(staleness=0),
    "sync": dict(staleness=0, placement="split"),
    "one-step-off": dict(staleness=1, placement="split"),
    "staleness-2": dict(staleness=2, placement="split"),
    "partial-1": dict(staleness=1, placement="split", partial_rollouts=-1),
    "partial-2": dict(staleness=2, placement="split", partial_rollouts=-1),
}
SPLIT = dict(trainer_devices=4.0, sampler_devices=4.0, trainer_mesh="fsdp:4", sampler_mesh="data:4")


def prompts(n: int = 64, seed: int = 0) -> list[str]:
    """A long-tailed length mix: word counts from a Pareto tail, 2 to 20 words."""
    rng = np.random.default_rng(seed)
    words = "once upon a time there was a little girl who liked to play in the park".split()
    lengths = np.clip((rng.pareto(1.5, n) + 1) * 2, 2, 20).astype(int)
    return [" ".join(rng.choice(words, k)) for k in lengths]


class SentenceStops:
    """The tokenizer `tok` with "." as its end-of-sequence id: completions stop after
    their first sentence."""

    def __init__(self, tok):
        self._tok = tok
        self.eos_id = tok.encode("a.")[-1]

    def __getattr__(self, name):
        return getattr(self._tok, name)


def run(name, policy, tok, texts, args, out):
    cfg = pl.animal_task_config().grpo
    changes = dict(RUNS[name])
    if changes.get("placement") == "split":
        changes.update(SPLIT)
    if changes.get("partial_rollouts"):
        changes["partial_rollouts"] = args.segment
    cfg = dataclasses.replace(
        cfg,
        prompts_per_rollout=8,
        group_size=4,
        rollouts=args.rollouts,
        kl_target=1e9,  # measure every iteration
        optim=dataclasses.replace(cfg.optim, warmup_ratio=0.0),
        **changes,
    )
    log = pl.tools.MetricsLog(out, name, quiet=True)
    ctx = pl.RunContext(
        ops=pl.OpsConfig(monitor=False, quiet=True),
        log=log,
        key=jax.random.key(0),
        checkpoint_dir=None,
        prompt_length=32,
        max_new_tokens=args.max_new_tokens,
    )
    lengths = []  # completion tokens of each row, in rollout order

    def parity(prompt, text):
        lengths.append(len(tok.encode(text)))
        return float(len(text.split()) % 2)

    reward = [pl.runs.RewardFunction("parity", parity)]
    pl.runs.run_grpo(policy, tok, texts, reward=reward, cfg=cfg, ctx=ctx)
    recs = [r for r in pl.tools.read_records(out) if r.get("stage") == name and "step" in r]
    timed = recs[args.warmup :]
    seconds = sum(r["iteration_time_s"] for r in timed)
    sync = [r.get("rollout/weight_sync_s", 0.0) for r in timed]
    lag = [
        r.get("rollout/version_lag", min(i + args.warmup, cfg.staleness))
        for i, r in enumerate(timed)
    ]
    rows = cfg.prompts_per_rollout * cfg.group_size
    return seconds, timed, float(np.mean(sync)), lengths[args.warmup * rows :], float(np.mean(lag))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rollouts", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--warmup", type=int, default=2, help="iterations not timed")
    p.add_argument("--runs", default=",".join(RUNS), help="comma-separated runs")
    p.add_argument("--segment", type=int, default=16, help="partial rollouts' segment")
    p.add_argument("--sentences", action="store_true", help='"." stops a completion')
    args = p.parse_args()
    runs = args.runs.split(",")
    print(
        f"jax {jax.__version__}, {jax.device_count()} devices ({jax.devices()[0].platform}), "
        f"{os.cpu_count()} cores"
    )
    policy, tok = pl.tools.load_model("builtin")
    if args.sentences:
        tok = SentenceStops(tok)
    texts = prompts()
    lengths = [len(tok.encode(t)) for t in texts]
    print(
        f"prompt tokens: median {int(np.median(lengths))}, max {max(lengths)}, "
        f"90th percentile {int(np.percentile(lengths, 90))}"
    )
    times: dict[str, list[float]] = {n: [] for n in runs}
    sync_s: dict[str, list[float]] = {n: [] for n in runs}
    tokens, lags = {}, {}
    for rnd in range(args.rounds):
        order = runs if rnd % 2 == 0 else runs[::-1]
        for name in order:
            with tempfile.TemporaryDirectory() as out:
                seconds, recs, sync, lengths, lag = run(name, policy, tok, texts, args, out)
            times[name].append(seconds)
            sync_s[name].append(sync)
            per_iter = 8 * 4 * args.max_new_tokens
            truncated = [r["rollout/truncated"] for r in recs]
            tokens[name] = (len(recs), per_iter, truncated, sum(lengths))
            lags[name] = lag
            print(f"round {rnd} {name}: {seconds:.2f} s over {len(recs)} iterations")
    print()
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    print(
        f"completion tokens (last run): median {p50:.0f}, 90th percentile {p90:.0f}, "
        f"99th {p99:.0f}, max {max(lengths)}"
    )
    print()
    print(
        "| run | iterations timed | median s | iterations/s "
        "| sampled tok/s (rows × max_new_tokens) | completion tok/s | mean version lag "
        "| weight_sync_s | vs sync |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    base = statistics.median(times[runs[0] if "sync" not in runs else "sync"])
    for name in runs:
        med = statistics.median(times[name])
        n, per_iter, truncated, real = tokens[name]
        print(
            f"| {name} | {n} | {med:.2f} | {n / med:.2f} | {n * per_iter / med:.0f} | "
            f"{real / med:.0f} | {lags[name]:.2f} | "
            f"{statistics.median(sync_s[name]) * 1e3:.1f} ms | {base / med:.2f}x |"
        )
    print()
    print(f"truncated fraction per iteration (last run): {np.round(truncated, 2).tolist()}")


if __name__ == "__main__":
    main()
