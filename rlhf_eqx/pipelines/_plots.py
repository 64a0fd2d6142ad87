"""PNG plots of a run directory (needs matplotlib: `pip install 'rlhf_eqx[plot]'`)."""

import json
import math
import os
import sys
from collections import defaultdict
from typing import NamedTuple

from ._metrics import from_json, read_json, step_ranges
from ._rundir import holds_runs

# What each panel shows: the first metric name a stage logged wins; the panel is titled
# with that metric's name.
_PANELS = {
    "loss": ("loss",),
    "reward / score": ("rollout/score", "reward", "rewards/margins", "margin"),
    "KL to reference": ("rollout/kl", "kl", "policy/approxkl"),
    "entropy": ("policy/entropy", "entropy"),
    "clip fraction": ("policy/clipfrac", "clip_ratio"),
    "training accuracy": ("rewards/accuracies", "accuracy"),
    "held-out accuracy": ("validation/accuracy",),
}
_MAX_BOUNDARIES = 60  # iteration boundaries drawn when a stage has at most this many


def read_records(run_dir: str) -> list[dict]:
    """Every record of `run_dir/metrics.jsonl`, a non-finite number (`"NaN"`, or the bare
    `NaN` of an older file) read as one (`from_json`). A torn last line (a run killed while
    writing it) is skipped with a note; any other line that is not a JSON object is an
    error naming the file and the line."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist: not a run directory")
    with open(path) as f:
        lines = f.read().split("\n")
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = from_json(json.loads(line))
        except json.JSONDecodeError as e:
            if n == len(lines):  # no newline after it: torn by a crash
                print(f"note: {path}:{n}: skipped a torn last line", file=sys.stderr)
                continue
            raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{path}:{n}: not a JSON object ({type(rec).__name__})")
        records.append(rec)
    return records


def read_metrics(run_dir: str) -> dict[str, list[dict]]:
    """The step records of `run_dir/metrics.jsonl`, grouped by stage (events and
    evaluations left out; a torn last line skipped)."""
    return _step_records(read_records(run_dir))


def _step_records(records: list[dict]) -> dict[str, list[dict]]:
    stages: dict[str, list[dict]] = defaultdict(list)
    for rec in records:
        if "event" in rec or rec.get("eval"):
            continue
        stages[rec.get("stage", "run")].append(rec)
    return dict(stages)


def _iteration_starts(recs: list[dict]) -> list[float]:
    """The first step of each iteration, when iterations have several steps (rollouts,
    rounds) and are few enough to draw."""
    first: dict = {}
    for r in recs:
        if "iteration" in r and "step" in r:
            first.setdefault(r["iteration"], r["step"])
    if len(first) < 2 or len(first) == len(recs) or len(first) > _MAX_BOUNDARIES:
        return []
    return [float(x) for x in sorted(first.values())[1:]]


def plot_run(run_dir: str) -> list[str]:
    """Draw one PNG per stage (loss, reward/score, KL, entropy, clip fraction, training
    and held-out accuracy against the step; each panel titled with the metric it shows;
    dotted lines where an iteration of several steps begins — a rollout, a round — and
    red lines at rollbacks) and, with a `summary.json`, `summary.png` (held-out score and
    win rate of each stage of the summary that reports a score: `base`, `sft`, `dpo`,
    `kto`, `distill`, ...). A step whose value is NaN or infinite has no point on the
    line: it is marked `×` at the foot of the panel (in red, named in the legend) and a
    note on stderr names the stage, the metric and the steps. A run over several seeds
    (`--seeds`) has each `seed-<s>/` drawn; a sweep has its `plots/` drawn again as the
    sweep drew them (`sweep_summary.json`, each member's `metrics.jsonl` and
    `summary.json`; a sweep that has not finished is refused, a `ValueError`). A run
    without step records yet (an empty `metrics.jsonl`, or events alone) draws no stage,
    with a note. Returns the files written."""
    many = holds_runs(run_dir)
    if many == "a sweep":
        return _plot_sweep(run_dir)
    if many is not None:
        return _plot_seeds(run_dir)
    records = read_records(run_dir)
    stages = _step_records(records)
    if not stages:
        where = os.path.join(run_dir, "metrics.jsonl")
        print(f"note: {where}: no step records yet; no stage to plot", file=sys.stderr)
    rollbacks: dict[str, list[float]] = defaultdict(list)
    for rec in records:
        if rec.get("event") == "rollback" and "step" in rec:
            rollbacks[rec.get("stage", "run")].append(rec["step"])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for stage, recs in stages.items():
        panels = []
        for title, names in _PANELS.items():
            for name in names:
                pts = [(r["step"], r[name]) for r in recs if _number(r.get(name)) and "step" in r]
                if pts:
                    panels.append((title, name, pts))
                    break
        if not panels:
            continue
        fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 2.8), squeeze=False)
        starts = _iteration_starts(recs)
        odd = []
        for ax, (title, name, pts) in zip(axes[0], panels):
            xs, ys = zip(*pts)
            for x in starts:
                ax.axvline(x, color="0.8", lw=0.6, ls=":")
            for x in rollbacks.get(stage, ()):
                ax.axvline(x, color="tab:red", lw=0.8)
            ax.plot(xs, ys, lw=1, marker="o" if len(xs) < 12 else None, ms=3)
            bad = [x for x, y in pts if not math.isfinite(y)]
            if bad:
                where = step_ranges(sorted(set(bad)))
                odd.append(f"{name} (steps {where})")
                ax.plot(
                    bad,
                    [0.03] * len(bad),
                    ls="none",
                    marker="x",
                    color="tab:red",
                    transform=ax.get_xaxis_transform(),
                    clip_on=False,
                    label=f"not finite: steps {where}",
                )
                ax.legend(fontsize=6)
            ax.set_title(f"{name}\n({title})", fontsize=8)
            ax.set_xlabel("step", fontsize=8)
            ax.tick_params(labelsize=7)
        bounds = " (dotted: iteration starts)" if starts else ""
        fig.suptitle(f"{stage}{bounds}", fontsize=9)
        fig.tight_layout()
        path = os.path.join(run_dir, f"{stage}.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
        if odd:
            print(
                f"note: {path}: not finite (NaN or infinite): {', '.join(odd)}; marked x at "
                "the foot of the panel, no point on the line",
                file=sys.stderr,
            )
    summary_path = os.path.join(run_dir, "summary.json")
    if os.path.isfile(summary_path):
        with open(summary_path) as f:
            try:
                summary = from_json(json.load(f))
            except json.JSONDecodeError as e:
                raise ValueError(f"{summary_path}:{e.lineno}: not JSON ({e.msg})") from None
        items = summary.items() if isinstance(summary, dict) else ()
        stages = [s for s, v in items if isinstance(v, dict) and _number(v.get("score"))]
        if stages:
            fig, ax = plt.subplots(figsize=(5, 3))
            scores = [summary[s]["score"] for s in stages]
            ax.bar(stages, scores, color="tab:blue", label="held-out score")
            wins = [summary[s].get("win_rate_vs_sft") for s in stages]
            wins = [w if _number(w) else None for w in wins]
            xs = [i for i, w in enumerate(wins) if w is not None]
            ax.plot(xs, [wins[i] for i in xs], "o", color="tab:red", label="win rate vs SFT")
            if all(0 <= y <= 1 for y in scores):
                ax.set_ylim(0, 1)
            ax.legend(fontsize=7)
            ax.set_title("held-out prompts")
            fig.tight_layout()
            path = os.path.join(run_dir, "summary.png")
            fig.savefig(path, dpi=90)
            plt.close(fig)
            written.append(path)
    return written


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _plot_sweep(run_dir: str) -> list[str]:
    """The plots of a finished sweep in `run_dir`, drawn again into its `plots/`
    (`plot_sweep`: its grid points and members from `sweep_summary.json`, each member's
    records and how it stopped from `members/<name>/`)."""
    from ._sweep_report import plot_sweep

    path = os.path.join(run_dir, "sweep_summary.json")
    try:
        points = read_json(path).get("points")
    except FileNotFoundError:
        raise ValueError(
            f"{run_dir} is a sweep without its {os.path.basename(path)} (not finished: "
            f"resume it to draw {os.path.join(run_dir, 'plots')}/); plot one member with: "
            "rlhf_eqx plot "
            f"{os.path.join(run_dir, 'members', '<name>')}"
        ) from None
    except (json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{path}: not a sweep summary ({e})") from None
    if not isinstance(points, dict):
        raise ValueError(f"{path}: not a sweep summary (no 'points')")
    members, summaries = [], {}
    for point, p in points.items():
        for name in p.get("members") or ():
            members.append(_SweepMember(str(name), str(point)))
            done = os.path.join(run_dir, "members", str(name), "summary.json")
            summary = _json_or_empty(done)
            if name in (p.get("diverged") or ()):
                summary["stopped"] = "diverged"
            summaries[name] = summary
    return plot_sweep(
        run_dir, members, summaries, lambda mem: os.path.join(run_dir, "members", mem.name)
    )


class _SweepMember(NamedTuple):
    """A member of a finished sweep as its plots need it: its name and grid point."""

    name: str
    point_name: str


def _json_or_empty(path: str) -> dict:
    try:
        value = read_json(path)
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _plot_seeds(run_dir: str) -> list[str]:
    """The plots of each `seed-<s>/` run of a run over several seeds (in seed order; a
    seed that has logged nothing yet is noted)."""
    written = []
    for name in seed_runs(run_dir):
        seed_dir = os.path.join(run_dir, name)
        if os.path.isfile(os.path.join(seed_dir, "metrics.jsonl")):
            written += plot_run(seed_dir)
        else:
            print(f"note: {seed_dir}: no metrics.jsonl yet; not plotted", file=sys.stderr)
    return written


def seed_runs(run_dir: str) -> list[str]:
    """The `seed-<s>` entries of the directory `run_dir` (a run over several seeds), in
    seed order."""
    names = [n for n in os.listdir(run_dir) if n[:5] == "seed-" and n[5:].isdigit()]
    return sorted(names, key=lambda n: int(n[5:]))
