"""The same run over several seeds: `run_seeds` runs seeds `s, s + 1, ...` (`s` =
`ops.seed`) each into its own run directory `<out>/seed-<seed>/`, and
`<out>/seeds_summary.json` holds every numeric entry of their summaries with its mean,
sample standard deviation, minimum and maximum over the seeds.

What a seed fixes: on one machine with one jax/jaxlib build, a seed's run is
bit-identical every time. On another CPU or XLA build the floating-point reduction
order changes, a sampled token can flip, and a run's held-out rates move within their
uncertainty; the spread over seeds shows how much."""

import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable, Mapping

from ._config import ConfigError
from ._metrics import from_json
from ._pipeline import run_pipeline
from ._pipeline_config import PipelineConfig
from ._resume_rules import RunDirError, check_resumable, moved_inputs, resumable_fields
from ._rundir import (
    RunLock,
    holds_run,
    holds_runs,
    removed_if_nothing_ran,
    resume_notes,
    write_json_atomic,
)
from ._validation import validate_config

SEEDS_SUMMARY = "seeds_summary.json"


def _keeps_summary() -> tuple[str, ...]:
    """Changes after which a finished seed's summary still stands (how the run was operated
    and logged); any other change resumes the seed's run (with `open_run_dir`'s checks)."""
    return tuple(f for f in resumable_fields() if f not in ("stages", "eval_samples"))


def check_seeds(seeds: object) -> int:
    """`seeds` if it is an int ≥ 1, else a `ConfigError` naming `seeds` and the value."""
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise ConfigError(f"seeds={seeds!r}: must be an int >= 1 (the number of seeds to run)")
    return seeds


def seed_dir(out: str, seed: int) -> str:
    """The run directory of `seed` in the multi-seed run directory `out`."""
    return os.path.join(out, f"seed-{seed}")


def _finished(cfg: PipelineConfig, run_dir: str) -> dict | None:
    """The summary of a finished run of `cfg` in `run_dir`, when nothing that changes
    it differs from the stored configuration (`RunDirError` for a change a resume
    refuses); `None` when the run has to run (or resume)."""
    from ._config_io import config_to_dict

    summary_path = os.path.join(run_dir, "summary.json")
    config_path = os.path.join(run_dir, "config.json")
    if not (os.path.isfile(summary_path) and os.path.isfile(config_path)):
        return None
    try:
        with open(config_path) as f:
            old = json.load(f)
        with open(summary_path) as f:
            summary = from_json(json.load(f))
    except ValueError as e:
        raise RunDirError(f"{run_dir}: a stored file is not JSON ({e})") from None
    new = config_to_dict(cfg)
    changes = check_resumable(old, new, where=run_dir)
    # a data file or model that moved with the same contents leaves the summary as it is
    moved = {field for field, _, _ in moved_inputs(run_dir, new, changes)}
    if any(field not in _keeps_summary() and field not in moved for field, _, _ in changes):
        return None
    for note in resume_notes(run_dir, old, new, changes):
        print(f"note: {note}", file=sys.stderr)
    return summary


def run_seeds(
    cfg: PipelineConfig,
    seeds: int,
    *,
    resume: bool = False,
    overwrite: bool = False,
    run: Callable[..., dict] | None = None,
) -> dict:
    """Run `cfg` for `seeds` seeds, `ops.seed`, `ops.seed + 1`, ..., each a normal run in
    `<cfg.out>/seed-<seed>/` (its own lock, checkpoints and resume), then write and
    return the multi-seed summary (`summarize_seeds`) as `<cfg.out>/seeds_summary.json`
    (rewritten after every seed).

    **Arguments:**

    - `cfg`: the configuration; `cfg.out` (default `runs/pipeline`) holds the seeds'
      directories and the summary, and is locked for the whole call.
    - `seeds`: how many seeds (an int ≥ 1; a `ConfigError` otherwise).
    - `resume`: continue an interrupted multi-seed run: a seed whose run finished (it
      has its `summary.json`, with a configuration that differs at most in how it is
      operated or logged) is read back, not rerun; the others resume as `--resume`
      does.
    - `overwrite`: move each seed's previous run aside (as `--overwrite` does).
    - `run`: `run(cfg, resume=..., overwrite=...) -> summary` for one seed; default
      `run_pipeline` (e.g. `lambda c, **kw: run_on_data(c, "dpo", **kw)`).

    **Returns:** the multi-seed summary.
    """
    check_seeds(seeds)
    if resume and overwrite:  # a finished seed would be read back, not moved aside
        raise RunDirError("--resume and --overwrite exclude each other")
    validate_config(cfg)
    run = run_pipeline if run is None else run
    out = cfg.out or os.path.join("runs", "pipeline")
    if holds_run(out):
        raise RunDirError(
            f"{out} holds a single run; choose another --out for a run over several seeds"
        )
    if holds_runs(out) == "a sweep":  # never mixed with a sweep's members and files
        raise RunDirError(f"{out} holds a sweep; choose another --out for a run over several seeds")
    first = cfg.ops.seed
    summaries: dict[int, dict] = {}
    # a first seed that fails before its first metrics (a bad record) leaves no directory
    with removed_if_nothing_ran(out), RunLock(out):
        for seed in range(first, first + seeds):
            one = dataclasses.replace(
                cfg, out=seed_dir(out, seed), ops=dataclasses.replace(cfg.ops, seed=seed)
            )
            done = _finished(one, one.out) if resume else None
            if done is not None:
                print(f"seed {seed}: finished in {one.out}, not rerun", file=sys.stderr)
                summaries[seed] = done
            else:
                summaries[seed] = run(one, resume=resume, overwrite=overwrite)
            result = summarize_seeds(summaries)
            write_json_atomic(os.path.join(out, SEEDS_SUMMARY), result)
    return result


def _numbers(tree: Mapping, prefix: str = "") -> dict[str, float]:
    """Every numeric leaf of a summary (bools excepted) under its dotted path."""
    out: dict[str, float] = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(_numbers(v, f"{prefix}{k}."))
        elif isinstance(v, int | float) and not isinstance(v, bool):
            out[f"{prefix}{k}"] = float(v)
    return out


def spread(values: list[float]) -> dict:
    """`mean`, sample standard deviation `std` (`ddof` 1; `None` for one value), `min`
    and `max` of `values`. A NaN or infinite value makes the mean and std NaN (or
    infinite), never one of the other seeds alone: `min` and `max` are those of the
    values that are not NaN (NaN when every one is), and the summary names the seeds
    (`summarize_seeds`: `nonfinite`)."""
    n = len(values)
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) == n:
        mean = math.fsum(values) / n
        std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else None
    else:
        mean = sum(values) / n  # NaN, or ±inf when the non-finite ones are one infinity
        std = math.nan if n > 1 else None
    ordered = [v for v in values if v == v]
    low, high = (min(ordered), max(ordered)) if ordered else (math.nan, math.nan)
    return {"mean": mean, "std": std, "min": low, "max": high}


def summarize_seeds(summaries: Mapping[int, dict]) -> dict:
    """The multi-seed summary of per-seed run summaries `{seed: summary}`.

    **Returns:** `{"seeds": [...], "stopped": {seed: "done" | ...}, "metrics": {path:
    {"seeds", "values", "mean", "std", "min", "max"}}}`: for every numeric entry of the
    summaries under its dotted path (`ppo.score`, `reward_model.heldout_accuracy`, ...),
    the seeds that report it, their values in that order, and `spread` of the values
    (`std`: the sample standard deviation over seeds, `None` with one seed). An entry
    that is NaN or infinite for some seed also has `nonfinite`, those seeds (its mean
    is then NaN or infinite, not the mean of the others).
    """
    seeds = sorted(summaries)
    per_seed = {s: _numbers(summaries[s]) for s in seeds}
    paths = list(dict.fromkeys(p for s in seeds for p in per_seed[s]))
    metrics = {}
    for p in paths:
        have = [s for s in seeds if p in per_seed[s]]
        values = [per_seed[s][p] for s in have]
        metrics[p] = {"seeds": have, "values": values, **spread(values)}
        bad = [s for s, v in zip(have, values) if not math.isfinite(v)]
        if bad:
            metrics[p]["nonfinite"] = bad
    stopped = {str(s): summaries[s].get("stopped", "done") for s in seeds}
    return {"seeds": seeds, "stopped": stopped, "metrics": metrics}


def _cell(m: dict | None, rate: bool) -> str:
    """`90.6% ± 2.1 (88.0–93.2)` for a rate (points), `0.329 ± 0.012 (0.31–0.35)`."""
    if m is None:
        return ""
    if rate:
        std = "" if m["std"] is None else f" ± {100 * m['std']:.1f}"
        return f"{m['mean']:.1%}{std} ({100 * m['min']:.1f}–{100 * m['max']:.1f})"
    std = "" if m["std"] is None else f" ± {m['std']:.3f}"
    return f"{m['mean']:.3f}{std} ({m['min']:.3f}–{m['max']:.3f})"


def format_seeds_table(seeds_summary: dict) -> str:
    """The printed table of a multi-seed summary, in markdown: per stage, each column
    as `mean ± std (min–max)` over the seeds (rates in percent, their std and range in
    percentage points); then every other rate that has a standard error. Runs of a
    stage on a data file (no score) list their stage's own numbers instead
    (`sft.heldout_nll`, `dpo.heldout_reward_accuracy`, ...: those with a standard
    error as rates)."""
    metrics, seeds = seeds_summary["metrics"], seeds_summary["seeds"]
    stages = list(dict.fromkeys(p.split(".")[0] for p in metrics if p.endswith(".score")))
    lines = [f"{len(seeds)} seeds ({', '.join(map(str, seeds))}): mean ± sample std (min–max)"]
    if stages:
        lines += [
            "",
            "| stage | score | win rate vs SFT | KL/token | base NLL/token |",
            "| --- | --- | --- | --- | --- |",
        ]
    shown = set()
    for stage in stages:
        cols = [("score", True), ("win_rate_vs_sft", True), ("kl", False), ("base_nll", False)]
        cells = [_cell(metrics.get(f"{stage}.{k}"), rate) for k, rate in cols]
        shown |= {f"{stage}.{k}" for k, _ in cols}
        lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    rest = [p for p in metrics if p not in shown and f"{p}_se" in metrics]
    if not stages:  # a stage on a data file: no score, its own held-out numbers
        rest = [p for p in metrics if f"{p}_se" in metrics or _stage_number(p)]
    if rest:
        lines.append("")
    lines += [f"{p}: {_cell(metrics[p], f'{p}_se' in metrics)}" for p in rest]
    return "\n".join(lines)


def _stage_number(path: str) -> bool:
    """Whether `path` is a number of a stage's summary entry itself (`sft.heldout_nll`,
    not `sft.sampled.kl_after` nor a standard error)."""
    from ._registry import stages

    stage, _, key = path.partition(".")
    names = {st.summary_key or st.name for st in stages()}
    return stage in names and bool(key) and "." not in key and not key.endswith("_se")


def seeds_command(
    cfg: PipelineConfig, command: str, seeds: int, *, resume: bool = False, overwrite: bool = False
) -> int:
    """`rlhf_eqx COMMAND --seeds N`: `run_seeds` with the command's run (`run_pipeline`,
    or `run_on_data` for a stage on a data file), then the spread table and one result
    line. **Returns:** the exit status, 3 when a seed diverged, else 0."""
    from ._data_runs import run_on_data

    def on_data(c, **kw):
        return run_on_data(c, command, **kw)

    data = command != "pipeline" and cfg.data.path is not None
    result = run_seeds(
        cfg, seeds, resume=resume, overwrite=overwrite, run=on_data if data else None
    )
    bad = {s: how for s, how in result["stopped"].items() if how != "done"}
    stops = ", ".join(f"seed {s} {how}" for s, how in bad.items())
    print("\n" + format_seeds_table(result))
    print(
        f"rlhf_eqx {command}: {seeds} seeds {f'stopped ({stops})' if bad else 'done'} "
        f"({cfg.out}/{SEEDS_SUMMARY})"
    )
    return 3 if "diverged" in bad.values() else 0
