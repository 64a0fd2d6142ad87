"""GRPO on split meshes: synchronous, one-step off-policy and staleness 2 side by side in
one run, on eight simulated devices.

    python benchmarks/bench_async_grpo.py [--rollouts 8] [--rounds 2] [--max-new-tokens 48]

Four runs of the built-in model (`pipelines.tools.load_model("builtin")`, LoRA rank 8,
one step per rollout) with `rlhf_eqx.pipelines.runs.run_grpo`, 8 prompts x 4 samples
per rollout:

- `colocated`: `placement=colocated, staleness=0` (sampler and trainer on device 0);
- `sync`: `placement=split` (trainer `fsdp:4` on devices 0-3, sampler `data:4` on 4-7),
  `staleness=0`: each rollout waits for the update before it;
- `one-step-off`: split, `staleness=1`: rollout r + 1 samples on the sampler mesh
  while update r runs on the trainer mesh;
- `staleness-2`: split, `staleness=2`: the sampler keeps up to two rollouts queued.

The prompts are a long-tailed length mix (most a few words, a few long ones) and the
completions stop at the model's stop ids or `--max-new-tokens`; the completion lengths
are printed. The time of a run is the sum of its iterations' `iteration_time_s` after the
first two (which compile); tokens/s counts completion tokens. Rounds alternate the
order of the runs; medians are printed.

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
}
SPLIT = dict(trainer_devices=4.0, sampler_devices=4.0, trainer_mesh="fsdp:4", sampler_mesh="data:4")


def prompts(n: int = 64, seed: int = 0) -> list[str]:
    """A long-tailed length mix: word counts from a Pareto tail, 2 to 20 words."""
    rng = np.random.default_rng(seed)
    words = "once upon a time there was a little girl who liked to play in the park".split()
    lengths = np.clip((rng.pareto(1.5, n) + 1) * 2, 2, 20).astype(int)
    return [" ".join(rng.choice(words, k)) for k in lengths]


def run(name, policy, tok, texts, args, out):
    cfg = pl.animal_task_config().grpo
    changes = dict(RUNS[name])
    if changes.get("placement") == "split":
        changes.update(SPLIT)
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
    reward = [pl.runs.RewardFunction("parity", lambda p, t: float(len(t.split()) % 2))]
    pl.runs.run_grpo(policy, tok, texts, reward=reward, cfg=cfg, ctx=ctx)
    recs = [r for r in pl.tools.read_records(out) if r.get("stage") == name and "step" in r]
    timed = recs[2:]
    seconds = sum(r["iteration_time_s"] for r in timed)
    sync = [r.get("rollout/weight_sync_s", 0.0) for r in timed]
    return seconds, timed, float(np.mean(sync))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rollouts", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=48)
    args = p.parse_args()
    print(
        f"jax {jax.__version__}, {jax.device_count()} devices ({jax.devices()[0].platform}), "
        f"{os.cpu_count()} cores"
    )
    policy, tok = pl.tools.load_model("builtin")
    texts = prompts()
    lengths = [len(tok.encode(t)) for t in texts]
    print(
        f"prompt tokens: median {int(np.median(lengths))}, max {max(lengths)}, "
        f"90th percentile {int(np.percentile(lengths, 90))}"
    )
    times: dict[str, list[float]] = {n: [] for n in RUNS}
    sync_s: dict[str, list[float]] = {n: [] for n in RUNS}
    tokens = {}
    for rnd in range(args.rounds):
        order = list(RUNS) if rnd % 2 == 0 else list(reversed(RUNS))
        for name in order:
            with tempfile.TemporaryDirectory() as out:
                seconds, recs, sync = run(name, policy, tok, texts, args, out)
            times[name].append(seconds)
            sync_s[name].append(sync)
            per_iter = 8 * 4 * args.max_new_tokens
            tokens[name] = (len(recs), per_iter, [r["rollout/truncated"] for r in recs])
            print(f"round {rnd} {name}: {seconds:.2f} s over {len(recs)} iterations")
    print()
    print(
        "| run | iterations timed | median s | s / iteration "
        "| sampled tok/s (rows × max_new_tokens) | weight_sync_s | vs sync |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    base = statistics.median(times["sync"])
    for name in RUNS:
        med = statistics.median(times[name])
        n, per_iter, truncated = tokens[name]
        print(
            f"| {name} | {n} | {med:.2f} | {med / n:.3f} | {n * per_iter / med:.0f} | "
            f"{statistics.median(sync_s[name]) * 1e3:.1f} ms | {base / med:.2f}x |"
        )
    print()
    print(f"truncated fraction per iteration (last run): {np.round(truncated, 2).tolist()}")


if __name__ == "__main__":
    main()
