"""A sweep's report: per grid point, the mean ± standard error over its seeds of each
member's final metrics (diverged members left out and counted), as a table and JSON;
and one PNG per step metric with, per grid point, the mean over seeds and a band of ±
one standard error (matplotlib optional)."""

import json
import math
import os
from collections.abc import Mapping, Sequence

import numpy as np

from ._sweep_grid import Member


def mean_se(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and standard error of the mean, `std(ddof=1) / sqrt(n)` (`None` for one
    value)."""
    x = np.asarray(values, np.float64)
    se = float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else None
    return float(x.mean()), se


def _numbers(summary: Mapping) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in summary.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(float(v))
    }


def summarize_sweep(members: Sequence[Member], summaries: Mapping[str, dict]) -> dict:
    """The sweep summary: `{"points": {point: {"members", "diverged", "metrics": {name:
    {"mean", "se", "n"}}}}}`, over the members of each grid point that did not diverge
    (`summaries[name]["stopped"] != "diverged"`)."""
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
    `mean ± standard error` over the seeds that did not diverge."""
    points = result["points"]
    present = [c for c in columns if any(c in p["metrics"] for p in points.values())]
    lines = [
        "| grid point | seeds | " + " | ".join(present) + " |",
        "| --- | --- | " + " | ".join("---" for _ in present) + " |",
    ]
    for name, p in points.items():
        n = len(p["members"]) - len(p["diverged"])
        seeds = f"{n}" + (f" ({len(p['diverged'])} diverged)" if p["diverged"] else "")
        cells = [_cell(p["metrics"].get(c)) for c in present]
        lines.append(f"| {name} | {seeds} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def member_records(member_dir: str) -> list[dict]:
    """The step records of a member's `metrics.jsonl` (no events, no evaluations)."""
    path = os.path.join(member_dir, "metrics.jsonl")
    out = []
    if not os.path.isfile(path):
        return out
    with open(path) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                if "event" not in rec and not rec.get("eval") and "step" in rec:
                    out.append(rec)
    return out


def plot_sweep(
    out: str,
    members: Sequence[Member],
    summaries: Mapping[str, dict],
    member_dir,
    *,
    metrics: Sequence[str] | None = None,
) -> list[str]:
    """One PNG per step metric in `<out>/plots/`: x the step, per grid point the mean over
    its seeds (members that did not diverge) and a band of ± one standard error of that
    mean. `member_dir(member) -> directory`. Needs matplotlib (`ImportError`
    otherwise). **Returns:** the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_point: dict[str, list[dict[str, np.ndarray]]] = {}
    names: list[str] = []
    for mem in members:
        if summaries.get(mem.name, {}).get("stopped", "done") == "diverged":
            continue
        recs = member_records(member_dir(mem))
        series = {}
        for k in recs[0] if recs else {}:
            if isinstance(recs[0][k], int | float) and k not in ("step", "iteration"):
                series[k] = np.asarray([r.get(k, np.nan) for r in recs], np.float64)
                if k not in names:
                    names.append(k)
        by_point.setdefault(mem.point_name, []).append(series)
    wanted = [k for k in names if metrics is None or k in metrics]
    wanted = [k for k in wanted if k not in ("nonfinite", "empty_batch", "lr_scale")]
    os.makedirs(os.path.join(out, "plots"), exist_ok=True)
    files = []
    for k in wanted:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        for point, runs in by_point.items():
            ys = [r[k] for r in runs if k in r]
            if not ys:
                continue
            n = min(len(y) for y in ys)
            y = np.stack([y[:n] for y in ys])
            mean = y.mean(0)
            x = np.arange(n)
            ax.plot(x, mean, label=point, lw=1.2)
            if y.shape[0] > 1:
                se = y.std(0, ddof=1) / math.sqrt(y.shape[0])
                ax.fill_between(x, mean - se, mean + se, alpha=0.25)
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
