"""PNG plots of a run directory (needs matplotlib: `pip install 'rlhf_eqx[plot]'`)."""

import json
import os
from collections import defaultdict

# What each panel shows: the first metric name a stage logged wins.
_PANELS = {
    "loss": ("loss",),
    "reward / score": ("rollout/score", "reward", "rewards/margins", "margin", "accuracy"),
    "KL to reference": ("rollout/kl", "kl", "policy/approxkl"),
    "entropy": ("policy/entropy", "entropy"),
    "clip fraction": ("policy/clipfrac", "clip_ratio"),
    "accuracy": ("rewards/accuracies", "accuracy"),
}


def read_metrics(run_dir: str) -> dict[str, list[dict]]:
    """The step records of `run_dir/metrics.jsonl`, grouped by stage (events and
    evaluations left out)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist: not a run directory")
    stages: dict[str, list[dict]] = defaultdict(list)
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
            if "event" in rec or rec.get("eval"):
                continue
            stages[rec.get("stage", "run")].append(rec)
    return dict(stages)


def plot_run(run_dir: str) -> list[str]:
    """Draw one PNG per stage (loss, reward/score, KL, entropy, clip fraction, accuracy
    against the step) and, with a `summary.json`, `summary.png` (held-out score and win
    rate per stage). Returns the files written."""
    stages = read_metrics(run_dir)
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
        for ax, (title, name, pts) in zip(axes[0], panels):
            xs, ys = zip(*pts)
            ax.plot(xs, ys, lw=1)
            ax.set_title(f"{title}\n({name})", fontsize=8)
            ax.set_xlabel("step", fontsize=8)
            ax.tick_params(labelsize=7)
        fig.suptitle(stage)
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
