"""The first GRPO iteration of the built-in task with a cold and a warm compilation cache.

Runs `python -m rlhf_eqx grpo` (SFT, then GRPO, on the shipped stories260K model) in
fresh interpreters, one after the other, with the same cache directory:

- `cold`: an empty persistent cache (every program is compiled, and written);
- `warm`: the same command again (programs read from the cache);
- `off` (with `--modes cold,warm,off`): the cache switched off
  (`RLHF_EQX_COMPILATION_CACHE=0`), i.e. a run without it.

For each run it prints, side by side: the first GRPO iteration's wall time (from the
creation of the stage's metrics log, the start of the stage, to the record of
iteration 1), the process's CPU time over the same span (all threads; other
processes on a busy machine disturb it less than wall time), the whole command's wall
time, and the compile counts over the whole run and within the first iteration:
programs built (`backend_compile` events, one per jitted program and shape), of which
read from the persistent cache (hits) or compiled by XLA, and the seconds spent in
them; and any program built twice in one run (same name and argument shapes).
`--by-program` also lists the builds per program name.

`cold` compiles everything because its cache directory starts empty (a fresh
`XDG_CACHE_HOME` per round); the persistent cache is still on and written, as in a first
command-line run. `off` switches it off.

`--against REV` measures a before/after pair in one run: the tree of the git revision
`REV` (exported with `git archive` into a temporary directory) against the working tree
(or against the tree of `--after REV2`: a checkout that others edit meanwhile is then
left out), alternating (before, after) for `--rounds` rounds, each run in a fresh process with its
own empty cache; it prints every run, the medians of each side and the load average
(1 minute) before each run: on a shared machine cold compile times are noisy, so
compare the sides only within one such run.

Usage: `python benchmarks/bench_compile.py [--rollouts 2] [--modes cold,warm]
[--by-program] [--json OUT.jsonl] [--against REV [--after REV2] --rounds 3]
[--set key=value ...]`.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DRIVER = r"""
import json, sys, time
import jax.monitoring as mon
from rlhf_eqx import pipelines as pl

builds, hits, seconds = {}, [0], [0.0]
marks = {}

def on_duration(event, duration, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
        name = kw.get("fun_name", "?")
        builds[name] = builds.get(name, 0) + 1
        seconds[0] += duration

def on_event(event, **kw):
    if event == "/jax/compilation_cache/cache_hits":
        hits[0] += 1

mon.register_event_duration_secs_listener(on_duration)
mon.register_event_listener(on_event)

import logging, jax
programs = {}  # "name with shapes" -> times built

class Programs(logging.Handler):
    def emit(self, record):
        msg = record.getMessage()
        if msg.startswith("Compiling "):
            key = msg.split(". Argument mapping")[0][len("Compiling "):]
            programs[key] = programs.get(key, 0) + 1

jax.config.update("jax_log_compiles", True)
for name in ("jax._src.interpreters.pxla", "jax._src.dispatch"):
    logging.getLogger(name).addHandler(Programs())
    logging.getLogger(name).propagate = False

def snapshot():
    return {"t": time.perf_counter(), "cpu": time.process_time(),
            "builds": sum(builds.values()), "hits": hits[0], "seconds": seconds[0]}

init, write = pl.tools.MetricsLog.__init__, pl.tools.MetricsLog.write

def patched_init(self, run_dir, stage, **kw):
    init(self, run_dir, stage, **kw)
    if stage == "grpo" and "start" not in marks:
        marks["start"] = snapshot()

def patched_write(self, record):
    write(self, record)
    first = record.get("iteration") == 0 and "event" not in record and "eval" not in record
    if self.stage == "grpo" and first and "end" not in marks:
        marks["end"] = snapshot()

pl.tools.MetricsLog.__init__, pl.tools.MetricsLog.write = patched_init, patched_write
t0 = time.perf_counter()
from rlhf_eqx.__main__ import main
code = main(sys.argv[1:])
total = time.perf_counter() - t0
twice = {k[:160]: v for k, v in programs.items() if v > 1}
print("BENCH " + json.dumps({"marks": marks, "builds": builds, "hits": hits[0], "twice": twice,
                             "seconds": seconds[0], "total_s": total, "code": code}))
"""


def run(
    mode: str, cache_home: str, out: str, rollouts: int, root: str = ROOT, sets: tuple = ()
) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "RLHF_EQX_"))}
    env.update(XDG_CACHE_HOME=cache_home, PYTHONPATH=root)
    if mode == "off":
        env["RLHF_EQX_COMPILATION_CACHE"] = "0"
    args = ["grpo", "--quiet", "--out", out, "--set", f"grpo.rollouts={rollouts}"]
    for kv in sets:
        args += ["--set", kv]
    load = os.getloadavg()[0]
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, *args], env=env, capture_output=True, text=True, cwd=root
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("BENCH ")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"{mode} run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    r = json.loads(lines[-1][len("BENCH ") :])
    start, end = r["marks"]["start"], r["marks"]["end"]
    return {
        "mode": mode,
        "load_1min": load,
        "first_iteration_s": end["t"] - start["t"],
        "first_iteration_cpu_s": end["cpu"] - start["cpu"],
        "command_s": r["total_s"],
        "builds": sum(r["builds"].values()),
        "hits": r["hits"],
        "compile_s": r["seconds"],
        "iter_builds": end["builds"] - start["builds"],
        "iter_hits": end["hits"] - start["hits"],
        "iter_compile_s": end["seconds"] - start["seconds"],
        "by_program": r["builds"],
        "same_program_twice": r["twice"],
    }


HEADER = (
    f"{'cache':>6} {'iter1 s':>8} {'iter1 cpu':>9} {'run s':>7} {'built':>6} {'hits':>5} "
    f"{'comp s':>7} {'it1 built':>9} {'it1 hits':>8} {'it1 comp s':>10}"
)


def row(r: dict) -> str:
    return (
        f"{r['mode']:>6} {r['first_iteration_s']:8.1f} {r['first_iteration_cpu_s']:9.1f} "
        f"{r['command_s']:7.1f} {r['builds']:6d} {r['hits']:5d} {r['compile_s']:7.1f} "
        f"{r['iter_builds']:9d} {r['iter_hits']:8d} {r['iter_compile_s']:10.1f}"
    )


def export_tree(rev: str, into: str, name: str) -> str:
    """The files of git revision `rev` of this repository, written under `into/name`."""
    tree = os.path.join(into, name)
    os.makedirs(tree)
    archive = subprocess.run(
        ["git", "archive", "--format=tar", rev], cwd=ROOT, capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", tree], input=archive.stdout, check=True)
    return tree


def compare(a, modes: list[str]) -> list[dict]:
    """`--against`: (before, after) pairs, alternating, each with its own empty cache."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        before = export_tree(a.against, tmp, "before")
        after = export_tree(a.after, tmp, "after") if a.after else ROOT
        for rnd in range(a.rounds):
            for side, root in (("before", before), ("after", after)):
                home = os.path.join(tmp, f"cache-{rnd}-{side}")
                for i, mode in enumerate(modes):
                    out = os.path.join(tmp, f"run-{rnd}-{side}-{i}")
                    r = run(mode, home, out, a.rollouts, root, tuple(a.set))
                    rev = a.against if side == "before" else (a.after or "working tree")
                    r.update(side=side, round=rnd, rev=rev)
                    rows.append(r)
                    print(f"round {rnd} {side:>6} load {r['load_1min']:4.1f} {row(r)}", flush=True)
    for mode in modes:
        for side in ("before", "after"):
            mine = [r for r in rows if r["side"] == side and r["mode"] == mode]
            med = {
                k: statistics.median(r[k] for r in mine)
                for k in ("first_iteration_s", "first_iteration_cpu_s", "iter_compile_s")
            }
            print(
                f"{mode} {side:>6} medians over {len(mine)} rounds: iter1 "
                f"{med['first_iteration_s']:.1f} s wall, {med['first_iteration_cpu_s']:.1f} s CPU, "
                f"{med['iter_compile_s']:.1f} s in compile-or-load; iter1 wall per round "
                + ", ".join(f"{r['first_iteration_s']:.1f}" for r in mine)
            )
    loads = [r["load_1min"] for r in rows]
    print(f"load average (1 min) before the runs: {min(loads):.1f}-{max(loads):.1f}")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rollouts", type=int, default=2, help="GRPO iterations per run")
    p.add_argument("--modes", default="cold,warm", help="comma-separated: cold, warm, off")
    p.add_argument("--by-program", action="store_true", help="builds per program")
    p.add_argument("--json", help="append the results to this JSONL file")
    p.add_argument("--against", help="git revision to compare the working tree with")
    p.add_argument("--after", help="with --against: this revision instead of the working tree")
    p.add_argument("--rounds", type=int, default=3, help="(before, after) rounds of --against")
    p.add_argument("--set", action="append", default=[], help="key=value for every run")
    a = p.parse_args()
    modes = a.modes.split(",")
    if a.against:
        print(HEADER)
        rows = compare(a, modes)
    else:
        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            for i, mode in enumerate(modes):
                out = os.path.join(tmp, f"run{i}")
                rows.append(run(mode, tmp, out, a.rollouts, sets=tuple(a.set)))
        print(HEADER)
        for r in rows:
            print(row(r))
    print(
        "iter1: start of the grpo stage to the end of its first iteration (wall, CPU); "
        "built: programs built over the whole run (hits: read from the persistent cache); "
        "comp s: seconds in compile-or-load; it1 *: the same within the first iteration"
    )
    for r in rows:
        twice = r["same_program_twice"]
        name = f"{r.get('side', '')} {r['mode']}".strip()
        print(f"{name}: programs built twice (same name and shapes): {twice or 'none'}")
        if a.by_program:
            print(f"{name}: builds per program name: {dict(sorted(r['by_program'].items()))}")
    if a.json:
        with open(a.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
