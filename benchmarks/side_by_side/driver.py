"""Run the side-by-side benchmark: every (library, workload) in its own process,
libraries alternating within each round, several rounds; then the table.

    python benchmarks/side_by_side/driver.py --rounds 3            # a new results file
    python benchmarks/side_by_side/driver.py --report RESULTS.jsonl   # table only

Each run writes a new file: `--out` defaults to
`benchmarks/results-<machine>-<UTC time>.jsonl` (`<machine>`: `--machine`,
`$BENCH_MACHINE`, or the CPU vendor and its widest vector extension, e.g.
`amd-avx512`), and an existing file is refused unless `--append` is given (to extend or
resume that run).

Each library runs in its own virtual environment (see `benchmarks/peers/setup.sh`):
rlhf_eqx and the hand-written JAX floor in `$RLHF_VENV` (default `.venv` at the
repository root; or `--venv-rlhf`), TRL in `$TRL_VENV` and Tunix in `$TUNIX_VENV`
(defaults `.venv-peers/venv-trl` and `.venv-peers/venv-tunix`, where `setup.sh` puts
them; or `--venv-trl`, `--venv-tunix`). Speed ratios are
`peer time / rlhf_eqx time` per round (> 1: rlhf_eqx faster; on the HH-RLHF length mix
the ratio of real tokens per second over the whole pass); the table gives medians
over rounds, the first step (compile included), peak RSS, the float32 matmul peak
measured in each process and the model FLOP utilisation where FLOPs are defined.
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
import common  # noqa: E402

RUNNERS = {
    "rlhf_eqx": ("venv_rlhf", "run_rlhf_eqx.py"),
    "floor": ("venv_rlhf", "run_floor.py"),
    "trl": ("venv_trl", "run_trl.py"),
    "tunix": ("venv_tunix", "run_tunix.py"),
}
# which libraries run which workload
SUPPORTED = {
    "rlhf_eqx": set(common.WORKLOADS),
    "trl": {"dpo", "dpo_cached", "gen_sample", "gen_greedy", "rm", "hh_dpo", "grpo", "grpo_mix"}
    | {f"curve_{t}" for t in common.CURVE_T},
    "floor": {"gen_sample", "gen_greedy"},
    "tunix": {"gen_sample", "gen_greedy", "dpo"} | {f"curve_{t}" for t in common.CURVE_T},
}


def machine_tag():
    """A short name for this kind of machine: the CPU vendor and its widest vector
    extension (`amd-avx512`, `intel-avx2`, ...), from `/proc/cpuinfo` where there is one."""
    vendor, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "vendor_id" and not vendor:
                    vendor = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    name = {"AuthenticAMD": "amd", "GenuineIntel": "intel"}.get(vendor)
    name = name or platform.machine().lower() or "cpu"
    if "avx512f" in flags:
        name += "-avx512"
    elif "avx2" in flags:
        name += "-avx2"
    return name


def default_out(machine, now=None):
    """`benchmarks/results-<machine>-<UTC time>.jsonl`: a new file for every run."""
    now = now or datetime.datetime.now(datetime.UTC)
    return os.path.join(ROOT, "benchmarks", f"results-{machine}-{now:%Y-%m-%dT%H%MZ}.jsonl")


def run_one(args, lib, workload, steps):
    venv_attr, script = RUNNERS[lib]
    python = os.path.join(getattr(args, venv_attr), "bin", "python")
    cmd = [
        python,
        os.path.join(HERE, script),
        workload,
        "--inputs",
        args.inputs,
        "--steps",
        str(steps),
    ]
    env = dict(os.environ, PYTHONPATH=ROOT)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=args.timeout, env=env, cwd=ROOT
        )
    except subprocess.TimeoutExpired:
        return {"library": lib, "workload": workload, "error": f"timeout after {args.timeout} s"}
    wall = time.perf_counter() - t0
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            out = json.loads(line[len("RESULT ") :])
            out["process_s"] = wall
            return out
    tail = (proc.stderr or proc.stdout)[-600:]
    return {"library": lib, "workload": workload, "error": f"exit {proc.returncode}: {tail}"}


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def fmt(x, spec=".3f"):
    return "—" if x is None else format(x, spec)


def report(rows):
    """Markdown tables: per workload and library the medians over rounds, and per-round ratios."""
    by = {}
    for r in rows:
        if "error" in r:
            continue
        by.setdefault((r["workload"], r["library"]), []).append(r)
    lines = []
    lines.append(
        "| workload | library | median step s | rlhf_eqx speed-up per round | first step s "
        "| peak RSS MB | matmul GFLOP/s | MFU | extra |"
    )
    lines.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for w in common.WORKLOADS:
        mine = by.get((w, "rlhf_eqx"), [])
        for lib in ("rlhf_eqx", "floor", "trl", "tunix"):
            rs = by.get((w, lib), [])
            if not rs:
                continue
            med = common.median([r["median_s"] for r in rs])
            ratios = []
            if lib != "rlhf_eqx":
                for a, b in zip(mine, rs):
                    if a.get("round") != b.get("round"):
                        continue
                    if "real_tokens_per_s" in a and "real_tokens_per_s" in b:
                        # a length mix: real tokens per second over the whole pass,
                        # compiles included (the libraries may take different steps)
                        ratios.append(a["real_tokens_per_s"] / b["real_tokens_per_s"])
                    else:
                        ratios.append(b["median_s"] / a["median_s"])
            mfu = None
            if "flops" in rs[0]:
                mfu = common.median(
                    [r["flops"] / r["median_s"] / (r["matmul_gflops"] * 1e9) for r in rs]
                )
            extra = []
            if "layout" in rs[0]:
                extra.append(f"{rs[0]['layout']} layout")
            if "new_tokens" in rs[0]:
                extra.append(
                    f"{common.median([r['new_tokens'] / r['median_s'] for r in rs]):,.0f} new tok/s"
                )
            if "tokens" in rs[0]:
                extra.append(
                    f"{common.median([r['tokens'] / r['median_s'] for r in rs]):,.0f} tok/s"
                )
            if "real_tokens_per_s" in rs[0]:
                extra.append(
                    f"{common.median([r['real_tokens_per_s'] for r in rs]):,.0f} real tok/s "
                    "over the pass ("
                    f"{common.median([r.get('steady_real_tokens_per_s', 0) for r in rs]):,.0f} "
                    "once compiled), "
                    f"padding {rs[0]['padding_fraction']:.0%}, {rs[0]['compiled_shapes']} shapes"
                )
            if "completion_tokens" in rs[0]:
                tps = [r["completion_tokens"] / r["median_s"] for r in rs]
                extra.append(
                    f"{common.median(tps):,.0f} real completion tok/s "
                    f"({rs[0]['completion_tokens']:,} tokens, rows up to "
                    f"{rs[0]['generated_width']})"
                )
            split = [r for r in rs if "gen_s" in r and "update_s" in r]
            if split:
                extra.append(
                    f"generation {common.median([r['gen_s'] for r in split]):.2f} s + update "
                    f"{common.median([r['update_s'] for r in split]):.2f} s"
                )
            lines.append(
                f"| {w} | {lib} | {med:.3f} | {', '.join(f'{x:.2f}×' for x in ratios) or '—'} | "
                f"{common.median([r['first_s'] for r in rs]):.2f} | "
                f"{common.median([r['peak_rss_mb'] for r in rs]):,.0f} | "
                f"{common.median([r['matmul_gflops'] for r in rs]):.0f} | {fmt(mfu, '.0%')} | "
                f"{'; '.join(extra)} |"
            )
    loads = [r["loadavg_1min"] for r in rows if "loadavg_1min" in r]
    if loads:
        lines.append(
            f"\nLoad average (1 min) at the end of each run: median {common.median(loads):.1f}, "
            f"min {min(loads):.1f}, max {max(loads):.1f} (2 cores)."
        )
    errors = [r for r in rows if "error" in r]
    for e in errors:
        lines.append(f"\nerror: {e['library']} {e['workload']}: {e['error'][:300]}")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workloads", default=",".join(common.WORKLOADS))
    p.add_argument("--libs", default="rlhf_eqx,trl,tunix,floor")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument(
        "--first-round",
        type=int,
        default=0,
        help="number of the first round (to continue an earlier run with --append)",
    )
    p.add_argument("--inputs", default=os.environ.get("BENCH_INPUTS", "/tmp/rlhf_bench_inputs"))
    p.add_argument(
        "--out",
        help="results JSONL (default: benchmarks/results-<machine>-<UTC time>.jsonl, a new file)",
    )
    p.add_argument(
        "--append", action="store_true", help="add rows to an existing --out (extend a run)"
    )
    p.add_argument(
        "--machine",
        default=os.environ.get("BENCH_MACHINE") or machine_tag(),
        help="machine name in the default --out (default: $BENCH_MACHINE or from the CPU)",
    )
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--venv-rlhf", default=os.environ.get("RLHF_VENV", os.path.join(ROOT, ".venv")))
    p.add_argument(
        "--venv-trl",
        default=os.environ.get("TRL_VENV", os.path.join(ROOT, ".venv-peers", "venv-trl")),
    )
    p.add_argument(
        "--venv-tunix",
        default=os.environ.get("TUNIX_VENV", os.path.join(ROOT, ".venv-peers", "venv-tunix")),
    )
    p.add_argument("--report", metavar="JSONL", help="print the table of an earlier run and exit")
    args = p.parse_args()
    if args.report:
        print(report(load(args.report)))
        return
    for name in ("inputs", "venv_rlhf", "venv_trl", "venv_tunix"):  # relative to the caller
        setattr(args, name, os.path.abspath(getattr(args, name)))
    out = args.out or default_out(args.machine)
    if os.path.exists(out) and not args.append:
        p.error(f"{out} exists: pass --append to add this run's rows to it, or another --out")
    libs = args.libs.split(",")
    workloads = args.workloads.split(",")
    print(f"writing {out}", flush=True)
    with open(out, "a" if args.append else "x") as f:
        for rnd in range(args.first_round, args.first_round + args.rounds):
            for w in workloads:
                order = [lib for lib in libs if w in SUPPORTED[lib]]
                k = rnd % max(1, len(order))
                order = order[k:] + order[:k]  # alternate who goes first
                for lib in order:
                    r = run_one(args, lib, w, args.steps)
                    r["round"] = rnd
                    f.write(json.dumps(r) + "\n")
                    f.flush()
                    msg = (
                        r.get("error")
                        or f"{r['median_s']:.3f} s (first {r['first_s']:.2f} s, "
                        f"peak {r['matmul_gflops']:.0f} GFLOP/s)"
                    )
                    print(f"round {rnd} {w:12s} {lib:9s} {msg}", flush=True)
    print(report(load(out)))


if __name__ == "__main__":
    main()
