r"""Plots of a side-by-side run (matplotlib; run it in the TRL venv, which has it).

    "$TRL_VENV"/bin/python benchmarks/side_by_side/plot.py \
        benchmarks/results-amd3-final.jsonl [MORE.jsonl ...] --out benchmarks

Writes `speedups<suffix>.png` (median time of each workload per library, relative to
rlhf_eqx; real tokens per second over the pass on the HH-RLHF mix) and, when the rows
include the `curve_T` workloads, `dpo_curve<suffix>.png` (DPO-step tokens/s at a fixed
4,096 tokens per step against the row length T, per library). The suffix defaults to
the first results file's name after `results` (`results-amd3-final.jsonl` gives
`speedups-amd3-final.png`), so the plots of different runs do not overwrite each other.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("results", nargs="+", help="one or more results JSONL files (rows pooled)")
    p.add_argument("--out", default="benchmarks")
    p.add_argument("--suffix", help="file name suffix (default: from the first results file)")
    args = p.parse_args()
    suffix = args.suffix
    if suffix is None:
        stem = os.path.splitext(os.path.basename(args.results[0]))[0]
        suffix = stem.removeprefix("results") if stem.startswith("results") else f"-{stem}"
    written = []
    rows = [json.loads(x) for path in args.results for x in open(path) if x.strip()]
    rows = [r for r in rows if "error" not in r]
    med = {}
    for r in rows:
        med.setdefault((r["workload"], r["library"]), []).append(r)

    if any(w.startswith("curve_") for w, _ in med):
        fig, ax = plt.subplots(figsize=(6, 4))
        for lib, style in (("rlhf_eqx", "o-"), ("trl", "s--"), ("tunix", "^:")):
            xs, ys = [], []
            for t in common.CURVE_T:
                rs = med.get((f"curve_{t}", lib))
                if rs:
                    xs.append(t)
                    ys.append(common.median([r["tokens"] / r["median_s"] for r in rs]))
            if xs:
                ax.plot(xs, ys, style, label=lib)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("row length T (4,096 tokens per DPO step)")
        ax.set_ylabel("tokens / s (policy + reference)")
        ax.set_title("DPO step cost as sequences grow")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        written.append(os.path.join(args.out, f"dpo_curve{suffix}.png"))
        fig.savefig(written[-1], dpi=120)

    fig, ax = plt.subplots(figsize=(7, 4))
    workloads = [
        w for w in common.ALL_WORKLOADS if not w.startswith("curve_") and (w, "rlhf_eqx") in med
    ]
    libs = [lib for lib in ("trl", "tunix", "floor") if any((w, lib) in med for w in workloads)]
    width = 0.8 / max(1, len(libs))
    for i, lib in enumerate(libs):
        xs, ys = [], []
        for j, w in enumerate(workloads):
            if (w, lib) in med:
                a, b = med[(w, "rlhf_eqx")], med[(w, lib)]
                if "real_tokens_per_s" in a[0] and "real_tokens_per_s" in b[0]:
                    # a length mix: real tokens per second over the pass
                    ratio = common.median([r["real_tokens_per_s"] for r in a]) / common.median(
                        [r["real_tokens_per_s"] for r in b]
                    )
                else:
                    ratio = common.median([r["median_s"] for r in b]) / common.median(
                        [r["median_s"] for r in a]
                    )
                xs.append(j + i * width)
                ys.append(ratio)
        ax.bar(xs, ys, width, label=f"{lib} time / rlhf_eqx time")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(
        [j + width * (len(libs) - 1) / 2 for j in range(len(workloads))], workloads, rotation=30
    )
    ax.set_ylabel("speed-up of rlhf_eqx (×)")
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, fontsize=8, frameon=False)
    fig.tight_layout()
    written.append(os.path.join(args.out, f"speedups{suffix}.png"))
    fig.savefig(written[-1], dpi=120)
    print("wrote", *written)


if __name__ == "__main__":
    main()
