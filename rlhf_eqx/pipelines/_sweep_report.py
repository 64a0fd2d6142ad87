"""A sweep's report: per grid point, the mean ± standard error over its seeds of each
member's final metrics (diverged members left out and counted), as a table and JSON;
and one PNG per step metric with, per grid point, the mean over seeds and a band of ±
one standard error (matplotlib optional)."""

import json
import math
import os
import sys
from collections.abc import Mapping, Sequence

import numpy as np

from ._metrics import from_json
from ._sweep_grid import Member


def mean_se(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and standard error of the mean, `std(ddof=1) / sqrt(n)` (`None` for one
    value)."""
    x = np.asarray(values, np.float64)
    with np.errstate(invalid="ignore"):  # an infinite value: NaN standard error
        se = float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else None
        return float(x.mean()), se


def _numbers(summary: Mapping) -> dict[str, float]:
    """The numbers of a member's summary, a NaN or infinite one (a held-out KL of a
    policy far from its reference) included."""
    return {
        k: float(v)
        for k, v in summary.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }


def summarize_sweep(members: Sequence[Member], summaries: Mapping[str, dict]) -> dict:
    """The sweep summary: `{"points": {point: {"members", "diverged", "metrics": {name:
    {"mean", "se", "n"}}}}}`, over the members of each grid point that did not diverge
    (`summaries[name]["stopped"] != "diverged"`). A number that is NaN or infinite for
    one of them makes its point's mean and standard error so (NaN, ±inf): a mean of
    the other seeds alone would pass for the mean over all of them."""
    points: dict[str, dict] = {}
    for mem in members:
        p = points.setdefault(mem.point_name, {"members": [], "diverged": [], "values": {}})
        p["members"].append(mem.name)
        s = summaries.get(mem.name, {})
        if s.get("stopped", "done") == "diverged":
            p["diverged"].append(mem.name)
            continue
        for k, v in _numbers(s).items():
            if not k.endswith("_se") and k != "seed":  # the seeds are what it averages over
                p["values"].setdefault(k, []).append(v)
    for p in points.values():
        values = p.pop("values")
        p["metrics"] = {}
        for k, vs in values.items():
            mean, se = mean_se(vs)
            p["metrics"][k] = {"mean": mean, "se": se, "n": len(vs)}
    return {"points": points}


def _cell(m: dict | None) -> str:
    if m is None:
        return ""
    se = "" if m["se"] is None else f" ± {m['se']:.3g}"
    return f"{m['mean']:.4g}{se}"


TABLE_METRICS = (
    "loss",
    "rewards/accuracies",
    "rewards/margins",
    "score",
    "win_rate_vs_sft",
    "kl",
    "base_nll",
)


def format_sweep_table(result: dict, columns: Sequence[str] = TABLE_METRICS) -> str:
    """The sweep summary as a markdown table: one row per grid point, each column
    `mean ± standard error` over the seeds that did not diverge: `columns`, then the
    held-out numbers a stage on a data file reports (`heldout_*`)."""
    points = result["points"]
    held = [k for p in points.values() for k in p["metrics"] if k.startswith("heldout_")]
    columns = [*columns, *dict.fromkeys(k for k in held if not k.endswith("_se"))]
    present = [c for c in columns if any(c in p["metrics"] for p in points.values())]

    def row(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cells) + " |"

    lines = [row(["grid point", "seeds", *present]), row(["---"] * (2 + len(present)))]
    for name, p in points.items():
        n = len(p["members"]) - len(p["diverged"])
        seeds = f"{n}" + (f" ({len(p['diverged'])} diverged)" if p["diverged"] else "")
        lines.append(row([name, seeds, *(_cell(p["metrics"].get(c)) for c in present)]))
    return "\n".join(lines)


def member_records(member_dir: str) -> list[dict]:
    """The step records of a member's `metrics.jsonl` (no events, no evaluations),
    non-finite numbers read back (`from_json`)."""
    path = os.path.join(member_dir, "metrics.jsonl")
    out = []
    if not os.path.isfile(path):
        return out
    with open(path) as f:
        for line in f:
            if line.strip():
                rec = from_json(json.loads(line))
                if "event" not in rec and not rec.get("eval") and "step" in rec:
                    out.append(rec)
    return out


def plot_sweep(
    out: str,
    members: Sequence,
    summaries: Mapping[str, dict],
    member_dir,
    *,
    metrics: Sequence[str] | None = None,
) -> list[str]:
    """One PNG per step metric in `<out>/plots/`: x the step, per grid point the mean over
    its seeds (members that did not diverge) and a band of ± one standard error of that
    mean. A metric a member logs on some steps only (`rollout/*`: an iteration's last
    step) is drawn through the steps that have it; after a member stopped (its KL guard)
    a point's mean and band are over the seeds still running. The legend names a point's
    diverged members (`beta=0.5 (1 of 2 diverged, left out)`), and a point whose every
    member diverged, which has no line. A value that is NaN or infinite (a member that
    did not stop, but whose metric is not finite at some steps) is left out of its
    point's mean at those steps and never silently: each such step is marked `×` at the
    foot of the plot in the point's colour, the legend names the member and the steps,
    and one line on stderr per member names its metrics and steps. `members`: the
    sweep's `Member`s (or anything with their `name` and `point_name`);
    `member_dir(member) -> directory`. Needs matplotlib (`ImportError` otherwise).
    **Returns:** the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_point: dict[str, list[dict[str, dict[int, float]]]] = {}
    counts: dict[str, list[int]] = {}  # per grid point: [members, diverged]
    # per metric, per grid point: {member: the steps where its value is not finite}
    nonfinite: dict[str, dict[str, dict[str, list[int]]]] = {}
    names: list[str] = []
    for mem in members:
        count = counts.setdefault(mem.point_name, [0, 0])
        count[0] += 1
        if summaries.get(mem.name, {}).get("stopped", "done") == "diverged":
            count[1] += 1
            continue
        series: dict[str, dict[int, float]] = {}
        for r in member_records(member_dir(mem)):
            for k, v in r.items():
                if isinstance(v, int | float) and not isinstance(v, bool):
                    if k not in ("step", "iteration"):
                        if k not in names:
                            names.append(k)
                        if not math.isfinite(v):
                            point = nonfinite.setdefault(k, {}).setdefault(mem.point_name, {})
                            point.setdefault(mem.name, []).append(int(r["step"]))
                            continue
                        series.setdefault(k, {})[int(r["step"])] = float(v)
        by_point.setdefault(mem.point_name, []).append(series)
    wanted = [k for k in names if metrics is None or k in metrics]
    wanted = [k for k in wanted if k not in ("nonfinite", "empty_batch", "lr_scale")]
    _say_nonfinite(out, {k: nonfinite[k] for k in wanted if k in nonfinite})
    os.makedirs(os.path.join(out, "plots"), exist_ok=True)
    files = []
    for k in wanted:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        foot = ax.get_xaxis_transform()  # x in steps, y in axes units: the plot's foot
        for point, (n, bad) in counts.items():
            runs = [r[k] for r in by_point.get(point, []) if k in r]
            x, mean, se = _mean_band(runs) if runs else (np.zeros(0), None, None)
            label = point if not bad else f"{point} ({bad} of {n} diverged, left out)"
            odd = nonfinite.get(k, {}).get(point, {})
            color = None
            if not x.size:
                if bad == n:  # every seed diverged: named in the legend, no line
                    ax.plot([], [], ls="none", marker="x", color="k", label=label)
            else:
                (line,) = ax.plot(
                    x, mean, label=label, lw=1.2, marker="o" if x.size < 12 else None, ms=3
                )
                color = line.get_color()
                band = ~np.isnan(se)
                if band.any():
                    lo, hi = mean - se, mean + se
                    ax.fill_between(x, lo, hi, where=band, alpha=0.25, color=color)
            for name, steps in odd.items():
                (mark,) = ax.plot(
                    steps,
                    [0.03] * len(steps),
                    ls="none",
                    marker="x",
                    ms=6,
                    color=color,
                    transform=foot,
                    label=f"{name}: not finite at steps {_ranges(steps)}, left out",
                    clip_on=False,
                )
                color = mark.get_color()
        ax.set_xlabel("step")
        ax.set_ylabel(k)
        seeds = max((len(r) for r in by_point.values()), default=0)
        ax.set_title(f"{k}: mean ± 1 s.e. over {seeds} seeds", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out, "plots", k.replace("/", "_") + ".png")
        fig.savefig(path, dpi=80)
        plt.close(fig)
        files.append(path)
    return files


def _ranges(steps: Sequence[int]) -> str:
    from ._metrics import step_ranges

    return step_ranges(sorted(set(steps)))


def _say_nonfinite(out: str, nonfinite: Mapping[str, Mapping[str, Mapping[str, list]]]) -> None:
    """One line on stderr per member with metrics that are NaN or infinite at some steps:
    which, at which steps, and that the plots mark them."""
    per_member: dict[str, list[str]] = {}
    for k, points in nonfinite.items():
        for steps_of in points.values():
            for name, steps in steps_of.items():
                per_member.setdefault(name, []).append(f"{k} (steps {_ranges(steps)})")
    for name, what in per_member.items():
        print(
            f"note: {os.path.join(out, 'plots')}: {name}: not finite: {', '.join(what)}; "
            "marked x at the foot of those plots and left out of its point's mean there",
            file=sys.stderr,
        )


def _mean_band(runs: Sequence[Mapping[int, float]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(steps, mean, se)` over the seeds' `{step: value}`: each step any seed logged, the
    mean of the seeds that logged it (a finite value), and the standard error of that
    mean (`std(ddof=1) / sqrt(n)`, NaN where fewer than two seeds logged it)."""
    steps = np.asarray(sorted({s for r in runs for s in r}), np.int64)
    y = np.asarray([[r.get(int(s), np.nan) for s in steps] for r in runs], np.float64)
    n = np.sum(~np.isnan(y), axis=0)
    mean = np.nansum(y, axis=0) / np.maximum(n, 1)
    dev = np.where(np.isnan(y), 0.0, y - mean) ** 2
    se = np.where(n > 1, np.sqrt(dev.sum(0) / np.maximum(n - 1, 1) / np.maximum(n, 1)), np.nan)
    some = n > 0  # a step where every seed's value is NaN is left out
    return steps[some], mean[some], se[some]
