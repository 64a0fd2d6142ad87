"""A sweep of the built-in DPO stage in one program against the same members as separate
runs, in one process, wall time side by side.

    python benchmarks/bench_sweep.py [--betas 0.05,0.2] [--seeds 4] [--set dpo.rounds=2 ...]

The sweep (`pipelines.sweep("dpo", ...)`, 2 β × 4 seeds = 8 members by default) runs
first, then each member as a separate run (`pipelines.run_pipeline` of `sft,dpo` with
its seed and β), one after the other in the same process; the separate runs therefore
reuse every program the sweep compiled for SFT and the evaluations, so the comparison
favours them. Printed:

- `total`: the whole call (loading, SFT, the DPO stage, held-out evaluations, exports);
  the sweep runs SFT once per seed, the separate runs once per member;
- `DPO iterations`: the DPO stage's rounds alone (sampling, labels, pairs, reference
  log-probabilities and updates of every member): the sweep's `iterations` phase
  against the sum of the separate runs' `iteration_time_s` of their DPO records;
- the largest difference between a member's final DPO loss and its separate run's.
"""

import argparse
import dataclasses
import json
import os
import tempfile
import time

import jax

from rlhf_eqx import pipelines as pl


def dpo_records(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    return [r for r in recs if r.get("stage") == "dpo" and "step" in r and "event" not in r]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--betas", default="0.05,0.2")
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--out", help="directory for the runs (default: a temporary one)")
    args = p.parse_args()
    betas = [float(b) for b in args.betas.split(",")]
    cfg = pl.apply_overrides(
        pl.animal_task_config(), ["ops.quiet=true", "ops.monitor=false", *args.overrides]
    )
    root = args.out or tempfile.mkdtemp(prefix="bench_sweep-")
    members = len(betas) * args.seeds
    print(f"{members} members ({len(betas)} beta x {args.seeds} seeds), built-in DPO stage")
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, cpus {os.cpu_count()}")
    print(f"load average before: {os.getloadavg()[0]:.2f}")

    t0 = time.perf_counter()
    res = pl.sweep(
        "dpo",
        cfg,
        seeds=args.seeds,
        grid={"dpo.beta": betas},
        out=os.path.join(root, "sweep"),
        export=True,
    )
    t_sweep = time.perf_counter() - t0
    sweep_iters = res.summary["phase_seconds"]["iterations"]

    t0 = time.perf_counter()
    sep_iters, worst = 0.0, 0.0
    for mem in res.members:
        run_dir = os.path.join(root, "separate", mem.name)
        pl.run_pipeline(dataclasses.replace(mem.cfg, out=run_dir))
        recs = dpo_records(run_dir)
        sep_iters += sum(r.get("iteration_time_s", 0.0) for r in recs)
        worst = max(worst, abs(recs[-1]["loss"] - res.summaries[mem.name]["loss"]))
    t_sep = time.perf_counter() - t0
    print(f"load average after: {os.getloadavg()[0]:.2f}")

    print()
    print("| | sweep (one program) | separate runs | ratio |")
    print("| --- | --- | --- | --- |")
    print(f"| total | {t_sweep:.1f} s | {t_sep:.1f} s | {t_sep / t_sweep:.2f}x |")
    print(
        f"| DPO iterations | {sweep_iters:.1f} s | {sep_iters:.1f} s | "
        f"{sep_iters / sweep_iters:.2f}x |"
    )
    print(f"\nlargest |final loss, sweep - separate| over the members: {worst:.2e}")


if __name__ == "__main__":
    main()
