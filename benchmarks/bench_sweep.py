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

    python benchmarks/bench_sweep.py --step [--betas ...] [--seeds 4] [--reps 7]

measures the update alone: the members' DPO steps (the built-in model, LoRA rank 8, 16
pairs x 80 tokens, one base a seed) as separate calls, as the sweep's program with every
member's frozen base stacked, and with each seed's base shared by its grid points
(`make_program(seeds=...)`), in interleaved rounds, with op counts of each program's
optimised HLO (dots, dots with batch dimensions, fusions, transposes, copies,
broadcasts).
"""

import argparse
import dataclasses
import json
import os
import tempfile
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import rlhf_eqx as rx
from rlhf_eqx import pipelines as pl
from rlhf_eqx.pipelines._pipeline import load_model  # the built-in stories260K
from rlhf_eqx.pipelines._sweep_dpo import dpo_step_builder
from rlhf_eqx.pipelines._sweep_program import make_program, shared_frozen_seeds, stack


def dpo_records(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    return [r for r in recs if r.get("stage") == "dpo" and "step" in r and "event" not in r]


def _hlo_counts(program, *args) -> dict:
    """Ops of the optimised HLO of `program(*args)`: dots, batched dots (a member batch
    dimension), fusions, transposes, copies and broadcasts."""
    text = program.lower(*args).compile().compiled.as_text()
    lines = [ln for ln in text.splitlines() if " = " in ln]
    count = lambda op: sum(f" {op}(" in ln for ln in lines)  # noqa: E731
    return {
        "dot": count("dot"),
        "batched dot": sum(" dot(" in ln and "lhs_batch_dims" in ln for ln in lines),
        "fusion": count("fusion"),
        "transpose": count("transpose"),
        "copy": count("copy"),
        "broadcast": count("broadcast"),
    }


def step_bench(betas, seeds: int, reps: int) -> None:
    """8 members' DPO steps (the built-in task's model, LoRA rank 8, 16 pairs x 80
    tokens): 8 separate calls, one program with every member's frozen base stacked, and
    one with each seed's base shared by its grid points (`make_program(seeds=...)`)."""
    cfg = pl.animal_task_config().dpo
    base, _ = load_model("builtin")
    M, T, B = len(betas) * seeds, cfg.max_length, cfg.batch_size
    rng = np.random.default_rng(0)
    bases = [  # one base a seed (each seed's SFT policy differs)
        jax.tree.map(
            lambda x: (
                x + 0.01 * jnp.asarray(rng.standard_normal(x.shape), x.dtype)
                if eqx.is_inexact_array(x)
                else x
            ),
            base,
        )
        for _ in range(seeds)
    ]
    states = []
    for m in range(M):
        model, spec = pl.runs.with_lora(bases[m % seeds], cfg.lora, jax.random.key(m))
        states.append(
            rx.train.init_train_state(
                model,
                pl.runs.build_optimizer(cfg.optim, 100),
                filter_spec=spec,
            )
        )
    V = base.cfg.vocab_size

    def batch(m):
        toks = lambda: jnp.asarray(rng.integers(3, V, (B, T)), jnp.int32)  # noqa: E731
        mask = jnp.ones((B, T), bool)
        comp = mask.at[:, :32].set(False)
        z = jnp.zeros((B,), jnp.float32)
        return rx.PreferenceBatch(toks(), mask, comp, toks(), mask, comp, z, z)

    batches = [batch(m) for m in range(M)]
    hyper = {"beta": jnp.asarray([b for b in betas for _ in range(seeds)], jnp.float32)}
    keys = jnp.stack([jax.random.key_data(jax.random.key(m)) for m in range(M)])

    build = dpo_step_builder(cfg, 100)  # the sweep's own step

    stacked, sb, active = stack(states), stack(batches), jnp.ones((M,), bool)
    S = shared_frozen_seeds(stacked, [m % seeds for m in range(M)])
    assert S == seeds, S
    programs = {
        "vmapped, base stacked": make_program(build),
        "vmapped, base shared": make_program(build, seeds=S),
    }
    steps = [build({"beta": b}) for b in betas for _ in range(seeds)]

    def separate():
        out = [
            st.apply(steps[m], batches[m], key=jax.random.key(m), donate=False)
            for m, st in enumerate(states)
        ]
        jax.block_until_ready(out)

    args = (stacked, hyper, keys, sb, active)
    runs = {f"{M} separate calls": separate}
    for name, prog in programs.items():
        runs[name] = lambda prog=prog: jax.block_until_ready(prog(*args))
    for f in runs.values():
        f()  # compile
    times = {name: [] for name in runs}
    for _ in range(reps):  # interleaved rounds: the machine's load drifts
        for name, f in runs.items():
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    med = {name: float(np.median(ts)) for name, ts in times.items()}
    t_sep = med[f"{M} separate calls"]
    print(
        f"{M} members' DPO steps ({B} pairs x {T} tokens, LoRA rank {cfg.lora.rank}), "
        f"median of {reps} interleaved rounds, load {os.getloadavg()[0]:.2f} after"
    )
    print("| | seconds | speed vs separate calls | HLO ops |")
    print("| --- | --- | --- | --- |")
    one = (stack(states[:1]), {"beta": hyper["beta"][:1]}, keys[:1], stack(batches[:1]))
    counts = _hlo_counts(programs["vmapped, base stacked"], *one, active[:1])
    print(f"| one member's program | | | {counts} |")
    print(f"| {M} separate calls | {t_sep:.2f} s | 1.00x | |")
    for name, prog in programs.items():
        counts = _hlo_counts(prog, *args)
        print(f"| {name} | {med[name]:.2f} s | {t_sep / med[name]:.2f}x | {counts} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--betas", default="0.05,0.2")
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--out", help="directory for the runs (default: a temporary one)")
    p.add_argument("--step", action="store_true", help="only the 8 members' DPO steps")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    betas = [float(b) for b in args.betas.split(",")]
    if args.step:
        print(f"jax {jax.__version__}, cpus {os.cpu_count()}, load {os.getloadavg()[0]:.2f}")
        step_bench(betas, args.seeds, args.reps)
        return
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
