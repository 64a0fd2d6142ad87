"""PNG plots of a run directory (needs matplotlib: `pip install 'rlhf_eqx[plot]'`)."""

import json
import os
import sys
from collections import defaultdict

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
    """Every record of `run_dir/metrics.jsonl`. A torn last line (a run killed while
    writing it) is skipped with a note; any other line that is not JSON is an error
    naming it."""
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
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if n == len(lines):  # no newline after it: torn by a crash
                print(f"note: {path}:{n}: skipped a torn last line", file=sys.stderr)
                continue
            raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
    return records


def read_metrics(run_dir: str) -> dict[str, list[dict]]:
    """The step records of `run_dir/metrics.jsonl`, grouped by stage (events and
    evaluations left out; a torn last line skipped)."""
    stages: dict[str, list[dict]] = defaultdict(list)
    for rec in read_records(run_dir):
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
    win rate per stage). Returns the files written."""
    stages = read_metrics(run_dir)
    rollbacks: dict[str, list[float]] = defaultdict(list)
    for rec in read_records(run_dir):
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
                pts = [
                    (r["step"], r[name])
                    for r in recs
                    if isinstance(r.get(name), (int, float)) and "step" in r
                ]
                if pts:
                    panels.append((title, name, pts))
                    break
        if not panels:
            continue
        fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 2.8), squeeze=False)
        starts = _iteration_starts(recs)
        for ax, (title, name, pts) in zip(axes[0], panels):
            xs, ys = zip(*pts)
            for x in starts:
                ax.axvline(x, color="0.8", lw=0.6, ls=":")
            for x in rollbacks.get(stage, ()):
                ax.axvline(x, color="tab:red", lw=0.8)
            ax.plot(xs, ys, lw=1, marker="o" if len(xs) < 12 else None, ms=3)
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
    summary_path = os.path.join(run_dir, "summary.json")
    if os.path.isfile(summary_path):
        with open(summary_path) as f:
            summary = json.load(f)
        stages = [
            s
            for s in ("base", "sft", "ppo", "dpo", "grpo", "online-dpo")
            if isinstance(summary.get(s), dict) and "score" in summary[s]
        ]
        if stages:
            fig, ax = plt.subplots(figsize=(5, 3))
            scores = [summary[s]["score"] for s in stages]
            ax.bar(stages, scores, color="tab:blue", label="held-out score")
            wins = [summary[s].get("win_rate_vs_sft") for s in stages]
            xs = [i for i, w in enumerate(wins) if w is not None]
            ax.plot(xs, [wins[i] for i in xs], "o", color="tab:red", label="win rate vs SFT")
            ax.set_ylim(0, 1)
            ax.legend(fontsize=7)
            ax.set_title("held-out prompts")
            fig.tight_layout()
            path = os.path.join(run_dir, "summary.png")
            fig.savefig(path, dpi=90)
            plt.close(fig)
            written.append(path)
    return written
