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

The SmolLM2-135M-Instruct workloads (`common.WORKLOADS_135`; inputs from
`make_inputs.py --smollm2`) are not in the default list; name them:

    python benchmarks/side_by_side/driver.py --rounds 3 --steps 3 --libs rlhf_eqx,trl,floor \
        --workloads dpo135,dpo135_saving,dpo135_lora,gen135,gen135_q8,gen135_q4,grpo135 \
        --profile

(also `dpo135_lora_saving`, and rlhf_eqx's rematerialised steps `dpo135_dots`,
`dpo135_remat` and `dpo135_saving_dots`, compared with TRL's step of the same round).

Their rows get a table of their own, with the compile share of the first step, the
copy bandwidth measured in each process and, for generation, the bandwidth bound
(weights read once per decode step) and the fraction of it reached. `--profile` has
rlhf_eqx's `dpo135` time the pieces of its step after the timed steps.
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
    "rlhf_eqx": set(common.ALL_WORKLOADS),
    "trl": {"dpo", "dpo_cached", "gen_sample", "gen_greedy", "rm", "hh_dpo", "grpo", "grpo_mix"}
    | {f"curve_{t}" for t in common.CURVE_T}
    | {"dpo135", "dpo135_saving", "dpo135_lora", "dpo135_lora_saving", "gen135", "grpo135"},
    "floor": {"gen_sample", "gen_greedy", "gen135"},
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
    if args.profile and lib == "rlhf_eqx" and workload == "dpo135":
        cmd.append("--profile")
    timeout = max(args.timeout, args.timeout_135) if workload in common.WORKLOADS_135 else None
    env = dict(os.environ, PYTHONPATH=ROOT)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout or args.timeout, env=env, cwd=ROOT
        )
    except subprocess.TimeoutExpired:
        return {
            "library": lib,
            "workload": workload,
            "error": f"timeout after {timeout or args.timeout} s",
        }
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
    if not any(w in common.WORKLOADS for w, _ in by):
        lines = []  # only 135M rows: no empty table
    if any(w in common.WORKLOADS_135 for w, _ in by):
        lines.extend([""] if lines else [])
        lines.extend(report_135(by))
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


def profile_text(prof):
    """`profile` of rlhf_eqx's `dpo135 --profile` as shares of its step."""
    names = (
        ("reference_forward", "reference fwd"),
        ("policy_forward", "policy fwd"),
        ("policy_backward", "policy bwd"),
        ("optimizer_update", "optimiser"),
        ("rest_of_step", "rest"),
    )
    step = prof["step"]
    parts = ", ".join(f"{label} {prof[k]:.2f} s ({prof[k] / step:.0%})" for k, label in names)
    return f"profile of the {step:.2f} s step: {parts}"


def report_135(by):
    """The table of the SmolLM2-135M-Instruct rows (see the module docstring)."""
    med = lambda rs, k: common.median([r[k] for r in rs]) if rs and k in rs[0] else None
    lines = [
        "SmolLM2-135M-Instruct (float32 weights unless the extra says otherwise):",
        "",
        "| workload | library | median step s | rlhf_eqx speed-up per round | first step s "
        "| compile share | peak RSS MB | matmul GFLOP/s | copy GB/s | MFU "
        "| bandwidth bound s (reached) | extra |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for w in common.WORKLOADS_135:
        mine = by.get((w, "rlhf_eqx"), [])
        base = common.BASELINE.get(w)
        for lib in ("rlhf_eqx", "floor", "trl"):
            rs = by.get((w, lib), [])
            if not rs:
                continue
            ratios = []
            if lib != "rlhf_eqx":
                pairs = [(a, b) for a in mine for b in rs if a.get("round") == b.get("round")]
                ratios = [f"{b['median_s'] / a['median_s']:.2f}×" for a, b in pairs]
            elif base is not None:  # against HF float32 generate of the same round
                peers = by.get((base, "trl"), [])
                pairs = [(a, b) for a in rs for b in peers if a.get("round") == b.get("round")]
                ratios = [f"{b['median_s'] / a['median_s']:.2f}× vs trl {base}" for a, b in pairs]
            mfu = None
            if "flops" in rs[0]:
                mfu = common.median(
                    [r["flops"] / r["median_s"] / (r["matmul_gflops"] * 1e9) for r in rs]
                )
            bound = med(rs, "bandwidth_bound_s")
            bound_text = "—"
            if bound is not None:
                bound_text = f"{bound:.3f} ({med(rs, 'bandwidth_fraction'):.0%})"
            extra = []
            if "weights" in rs[0]:
                extra.append(f"{rs[0]['weights']} weights, {rs[0]['weight_bytes'] / 1e6:,.0f} MB")
            if "layout" in rs[0]:
                extra.append(f"{rs[0]['layout']} layout")
            if "remat" in rs[0]:
                extra.append(f"remat {rs[0]['remat']}")
            if "new_tokens" in rs[0]:
                tps = common.median([r["new_tokens"] / r["median_s"] for r in rs])
                extra.append(f"{tps:,.0f} new tok/s")
            if "tokens" in rs[0]:
                extra.append(
                    f"{common.median([r['tokens'] / r['median_s'] for r in rs]):,.0f} tok/s"
                )
            if "gen_s" in rs[0] and "update_s" in rs[0]:
                extra.append(
                    f"generation {med(rs, 'gen_s'):.2f} s + update {med(rs, 'update_s'):.2f} s"
                )
            if "fine_tune" in rs[0]:
                extra.append(f"{rs[0]['fine_tune']} fine-tune")
            if "trainable_params" in rs[0]:
                extra.append(f"{rs[0]['trainable_params']:,} trainable parameters")
            if "padding_free_note" in rs[0]:
                extra.append(rs[0]["padding_free_note"])
            if "prompt_ids_match" in rs[0]:
                extra.append(f"prompt ids match: {all(r['prompt_ids_match'] for r in rs)}")
            if "load_peak_rss_mb" in rs[0]:
                extra.append(f"peak RSS after loading {med(rs, 'load_peak_rss_mb'):,.0f} MB")
            if "logits_max_abs_diff" in rs[0]:
                diff = max(r["logits_max_abs_diff"] for r in rs)
                extra.append(f"logits vs rlhf_eqx float32: max |Δ| {diff:.1e}")
            profiled = [r for r in rs if "profile" in r]
            if profiled:
                extra.append(profile_text(profiled[0]["profile"]))
            lines.append(
                f"| {w} | {lib} | {common.median([r['median_s'] for r in rs]):.3f} | "
                f"{', '.join(ratios) or '—'} | {med(rs, 'first_s'):.2f} | "
                f"{fmt(med(rs, 'compile_share'), '.0%')} | {med(rs, 'peak_rss_mb'):,.0f} | "
                f"{med(rs, 'matmul_gflops'):.0f} | {fmt(med(rs, 'copy_gbs'), '.1f')} | "
                f"{fmt(mfu, '.0%')} | {bound_text} | {'; '.join(extra)} |"
            )
    return lines


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
    p.add_argument(
        "--timeout-135",
        type=float,
        default=1800,
        help="per-process timeout of the 135M workloads (seconds)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="rlhf_eqx's dpo135 also times the pieces of its step (written into its row)",
    )
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
