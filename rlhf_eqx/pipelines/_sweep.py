"""Whole-run sweeps: every member of `grid × seeds` of one stage trained in one compiled
program per step, with the run layer of a normal run per member (`sweep`, and
`rlhf_eqx sweep STAGE` on the command line, `sweep_command`).

Layout of the sweep directory `out`:

- `sweep.json`: the stage, grid, seeds and configuration (a resume must match them
  in what the sweep reads, `read_fields` of the stages it runs: the sections of other
  stages may differ);
- `members/<name>/metrics.jsonl` and `summary.json` per member (`name` like
  `beta=0.1,seed=2`), `members/<name>/<stage>/hf/` with `export`;
- `seeds/seed-<S>/`: the stages the built-in task runs first (SFT; for PPO the reward
  model too), once per seed;
- on a data file (`data.path`, `_sweep_data`): `data/metrics.jsonl` (what the readers and
  filters dropped) and `data.json` (the file's fingerprint: a resume on a changed file
  is refused);
- `checkpoints/`: the stacked state of every member, every `ops.checkpoint_every`
  iterations and at the end;
- `sweep_summary.json` and `plots/*.png`: per grid point, mean ± standard error over
  its seeds;
- with `ops.trackers` (or `ops.tensorboard`): each member's tracker runs, opened as a
  separate run's are (`run_trackers`) in `members/<name>/` (`trackers.json`,
  `tensorboard/<stage>/`, `mlflow.db`, `wandb/`), named `<sweep dir>/<name>`, in one
  group (`ops.tracker_group`, else the sweep directory's name).

A member equals its separate run (`python -m rlhf_eqx STAGE --set ops.seed=S --set
<grid values>`, with `--data FILE` the stage's run on that file): same data, keys and
updates, parameters and step metrics equal to float rounding. What a sweep does not
do: the loss-spike rollback of a separate run (a member whose update is not finite is
frozen at its last finite state and reported as diverged instead), and the periodic
evaluations (`ops.eval_every`); the held-out evaluation runs once, at the end. Those
settings (`ops.eval_every`, `lr_backoff`, `max_rollbacks`, `loss_spike`, `kl_spike`) set
to other than their defaults are refused, naming them.
"""

import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ._checkpoints import latest_checkpoint, restore_checkpoint, save_checkpoint
from ._config import ConfigError
from ._config_io import config_to_dict, read_fields
from ._loop_state import check_logged_steps
from ._metrics import MetricsLog, drop_records
from ._pipeline import (
    check_model,
    load_configured_model,
    resolve_model_names,
    tokenizer_file,
)
from ._pipeline_config import PipelineConfig, animal_task_config
from ._registry import get_stage
from ._resume_rules import RunDirError, config_changes, resume_changes, shown_changes
from ._run_checks import check_sweep_ops
from ._rundir import (
    RunLock,
    check_data,
    holds_run,
    holds_runs,
    removed_if_nothing_ran,
    resume_notes,
    write_json_atomic,
)
from ._sweep_data import check_data_sweep, data_sweep
from ._sweep_dpo import dpo_sweep
from ._sweep_grid import TRACEABLE, Member, grid_values, make_members, parse_grid
from ._sweep_grpo import check_grpo_sweep, grpo_sweep
from ._sweep_multiturn import multiturn_sweep
from ._sweep_offline import kto_sweep, sft_sweep
from ._sweep_ppo import check_ppo_sweep, ppo_sweep
from ._sweep_report import format_sweep_table, member_records, plot_sweep, summarize_sweep
from ._sweep_reward import check_reward_sweep, reward_sweep
from ._sweep_starts import builtin_start, sweep_trackers
from ._trackers import trying_once
from ._validation import validate_config

SWEEP_SPEC = "sweep.json"
SWEEP_SUMMARY = "sweep_summary.json"
# fields of the configuration a resumed sweep may change: how it is operated and logged
_OPERATIONAL = (
    "quiet",
    "checkpoint_every",
    "keep",
    "log_every",
    "monitor",
    "compilation_cache",
    "tensorboard",
    "trackers",
    "tracker_group",
)


@dataclasses.dataclass(frozen=True)
class SweepResult:
    """What `sweep` returns.

    - `out`: the sweep directory; `stage`: the stage swept.
    - `members`: the members (`name`, `seed`, grid `point`, equivalent `cfg`), in order.
    - `summaries`: each member's summary (`members/<name>/summary.json`): `stopped`
      (`"done"`, `"diverged"`, or `"kl_guard"` for a GRPO member stopped by its KL
      guard as its separate run would be), its last step's metrics and, for a policy stage, the
      held-out evaluation of its separate run (`score`, `win_rate_vs_sft`, `kl`, ...).
    - `summary`: per grid point, mean ± standard error over its seeds of every number of
      the summaries, diverged members left out (`sweep_summary.json`).
    - `diverged`: the names of the members that diverged.
    - `states`: the members' final train states, stacked on a leading member axis.
    """

    out: str
    stage: str
    members: tuple[Member, ...]
    summaries: dict[str, dict]
    summary: dict
    diverged: tuple[str, ...]
    states: Any


def member_dir(out: str, mem: Member) -> str:
    """Where member `mem` of the sweep in `out` writes its metrics and summary."""
    return os.path.join(out, "members", mem.name)


_STAGES = {
    "dpo": dpo_sweep,
    "sft": sft_sweep,
    "reward": reward_sweep,
    "kto": kto_sweep,
    "grpo": grpo_sweep,
    "ppo": ppo_sweep,
    "multiturn": multiturn_sweep,
}


def _spec(stage: str, grid: Mapping, seeds: int, cfg: PipelineConfig) -> dict:
    d = config_to_dict(cfg)
    d["ops"] = {k: v for k, v in d["ops"].items() if k not in _OPERATIONAL}
    d.pop("out", None)
    return {"stage": stage, "grid": {k: list(v) for k, v in grid.items()}, "seeds": seeds, **d}


def _read_names(stage: str, cfg: PipelineConfig) -> tuple[str, ...]:
    """The top-level names of `cfg` the sweep of `stage` reads (`read_fields`): on a data
    file the stage alone (not `stages`), on the built-in task the stages of `cfg.stages`
    (its prerequisites, `Stage.needs`); with the spec's own `stage`, `grid` and `seeds`."""
    on_data = cfg.data.path is not None
    read = read_fields(cfg, (stage,) if on_data else None, data_file=on_data)
    return ("stage", "grid", "seeds", *(k for k in read if not (on_data and k == "stages")))


def _take_dir(out: str, spec: dict, resume: bool, read: Sequence[str]) -> bool:
    """Check `out` for this sweep; write its spec. A resumed sweep's spec must match the
    stored one in the top-level names `read` (`_read_names`).
    **Returns:** whether it resumes."""
    path = os.path.join(out, SWEEP_SPEC)
    if not os.path.isfile(path):
        other = "a run" if holds_run(out) else holds_runs(out)
        if other is not None:  # never mixed with a sweep's files (metrics, data.json, ...)
            raise RunDirError(f"{out} holds {other}, not a sweep; choose another --out")
        if resume:  # as a run's resume says (a mistyped --out would start a sweep silently)
            print(f"note: nothing to resume in {out}: starting a new sweep", file=sys.stderr)
        write_json_atomic(path, spec)
        return False
    if not resume:
        raise RunDirError(
            f"{out} already holds a sweep; pass --resume to continue it (or choose another --out)"
        )
    with open(path) as f:
        old = json.load(f)
    if isinstance(old.get("ops"), dict):  # a spec written when these fields were kept
        old["ops"] = {k: v for k, v in old["ops"].items() if k not in _OPERATIONAL}
    # the sweep's own names compared as they are; the configuration as a run's resume
    # weighs it (fields added or removed since, a data file or model moved)
    own, cfg_old, cfg_new = ("stage", "grid", "seeds"), {}, {}
    for k in read:
        if k not in own:
            cfg_old.update({k: old[k]} if k in old else {})
            cfg_new.update({k: spec[k]} if k in spec else {})
    changes, moved = resume_changes(cfg_old, cfg_new, where=out)
    diff = [c for c in changes if c[0] not in moved]
    diff += config_changes({k: old.get(k) for k in own}, {k: spec.get(k) for k in own})
    if diff:
        named = shown_changes(diff)
        raise RunDirError(
            f"{path}: the resumed sweep differs from the stored one ({named}); only ops "
            "fields of logging and checkpointing, and the sections of stages the sweep does "
            "not run, may change"
        )
    for note in resume_notes(out, cfg_old, cfg_new, changes, stored=SWEEP_SPEC):
        print(f"note: {note}", file=sys.stderr)
    before, now = list(old.get("grid") or {}), list(spec["grid"])
    if before != now:  # the members' names and their order on the stacked axis follow it
        raise RunDirError(
            f"{path}: the resumed sweep gives the grid's fields in another order "
            f"({', '.join(before)} -> {', '.join(now)}); give --grid in the stored order"
        )
    return True


def sweep(
    stage: str,
    cfg: PipelineConfig | None = None,
    *,
    seeds: int = 4,
    grid: Mapping[str, Iterable[float]] | None = None,
    out: str | None = None,
    resume: bool = False,
    export: bool = False,
) -> SweepResult:
    """Train every member of `grid × seeds` of `stage` in one compiled program per step.

    The members' train states are stacked along a leading axis and each update is
    `jax.vmap`ped over (state, hyperparameters, key, batch), the hyperparameters traced,
    so the grid points share one program. Each member equals its separate run with the
    same seed and values (see the module docstring); the seeds are `cfg.ops.seed`,
    `cfg.ops.seed + 1`, ....

    **Arguments:**

    - `stage`: the stage to sweep (`"dpo"`: the built-in task's DPO stage, after SFT,
      which runs once per seed; `"sft"`, `"reward"`, `"kto"`, `"grpo"`, `"ppo"`: PPO
      after SFT and its reward model, both once per seed; `"multiturn"`: GRPO on
      multi-turn episodes after SFT, against `multiturn.environment`'s environment
      (`MODULE:NAME`, a factory `NAME(tok)`) or the animal follow-up one).
    - `cfg`: the configuration (default `animal_task_config()`); with `cfg.data.path`
      set, `"sft"`, `"dpo"`, `"kto"` or `"reward"` on that file of pairs, or `"grpo"` on
      its prompts with reference answers, the stage alone from the base model, each
      member equal to `run_on_data` of its configuration (the file read once and shared
      by the members).
    - `seeds`: seeds per grid point (an int ≥ 1).
    - `grid`: `{"<section>.<field>": [values]}`, e.g. `{"dpo.beta": [0.05, 0.1, 0.2]}`;
      fields outside the stage's traceable ones (`TRACEABLE`: they would change shapes
      or control flow) are refused with a `ConfigError` naming the field and listing
      them. Empty: the seeds alone.
    - `out`: the sweep directory (default `cfg.out`, else `runs/sweep-<stage>`).
    - `resume`: continue an interrupted sweep from its last checkpoint
      (`ops.checkpoint_every`), bit-identically to an uninterrupted one.
    - `export`: write each member's policy as `members/<name>/<stage>/hf/`.

    With `cfg.ops.trackers` set, each member is a separate run of those trackers, in one
    group (`ops.tracker_group`, else the sweep directory's name), named `<sweep
    dir>/<member name>`, with its files in `members/<name>/`: the member's
    configuration (its seed and grid values in it, and as `sweep.member`, `sweep.seed`,
    `sweep.<field>`), its step records as its `metrics.jsonl` has them, and its
    `summary.json` (`summary/stopped`: `done`, `diverged`, `kl_guard`) at the end. A
    resumed sweep continues each member's tracker runs (its `trackers.json`) as a resumed
    run does.

    **Returns:** a `SweepResult`. Diverged members (a non-finite loss, gradient or
    parameters) are frozen at their last finite state, reported on the console and in
    the summaries, and left out of the means and the plots' bands.
    """
    t0 = time.perf_counter()
    cfg = resolve_model_names(cfg if cfg is not None else animal_task_config())
    st = get_stage(stage)
    if stage not in _STAGES:
        raise ConfigError(f"sweep {stage}: not supported (stages that sweep: {', '.join(_STAGES)})")
    grid = grid_values(grid)
    on_data = cfg.data.path is not None
    if on_data:  # the stage alone, on the file
        check_data_sweep(stage, cfg)
    else:
        cfg = dataclasses.replace(cfg, stages=st.prerequisites(cfg))
    validate_config(cfg, stage=stage if on_data else None)
    check_sweep_ops(cfg.ops)
    # the settings the stage's sweep does not run, before anything is loaded or run
    # (the seeds' SFT) and the directory is taken
    if stage == "ppo":
        check_ppo_sweep(cfg.ppo)
    elif stage == "grpo" and not on_data:  # on a data file: check_data_sweep
        check_grpo_sweep(cfg.grpo)
    elif stage == "reward" and not on_data:
        check_reward_sweep(cfg.reward)
    members = make_members(cfg, stage, st.key, grid, seeds)
    for mem in members[::seeds]:
        validate_config(mem.cfg, stage=stage if on_data else None)
    out = out or cfg.out or os.path.join("runs", f"sweep-{stage}")
    say = (lambda *a: None) if cfg.ops.quiet else print
    # a sweep that stops before its first metrics (a bad record) leaves no directory
    with removed_if_nothing_ran(out), RunLock(out):
        resumed = _take_dir(out, _spec(stage, grid, seeds, cfg), resume, _read_names(stage, cfg))
        with trying_once(), _member_trackers(cfg, members, out, resumed):
            return _sweep(stage, cfg, members, out, resumed, export, say, t0)


def _member_trackers(cfg, members, out: str, resume: bool) -> contextlib.ExitStack:
    """Each member's tracker runs (`run_trackers` in its directory: its metrics logs feed
    them, and its `summary.json` is logged when they finish), in one group; an exit
    stack that finishes them."""
    stack = contextlib.ExitStack()
    with stack:  # those already open are finished when one cannot be opened
        for mem in members:
            extra = {"member": mem.name, "seed": mem.seed, **dict(mem.point)}
            run_dir = member_dir(out, mem)
            stack.enter_context(
                sweep_trackers(mem.cfg, run_dir, out, mem.name, extra, resume=resume)
            )
        return stack.pop_all()


def _sweep(stage, cfg, members, out, resume, export, say, t0) -> SweepResult:
    check_model(out, cfg.model.source, cfg.model.tokenizer, resume=resume)
    base, tok = load_configured_model(cfg)
    tok_file = tokenizer_file(cfg.model.source, cfg.model.tokenizer)
    say(f"sweep {stage}: {len(members)} members in {out}")
    if cfg.data.path is not None:
        check_data(out, cfg.data.path, resume=resume)
        run = data_sweep(stage, members, base, tok, out, say=say, tokenizer_file=tok_file)
    else:
        run = _STAGES[stage](
            members,
            _starts(stage, cfg, members, base, tok, out, resume, say),
            tok,
            tokenizer_file=tok_file,
        )
    t_loop = time.perf_counter()
    M = len(members)
    logs = [MetricsLog(member_dir(out, m), stage, quiet=True) for m in members]
    ckpt_dir = os.path.join(out, "checkpoints")
    states, stopped = run.states, ["done"] * M  # "done" (running), "diverged", "kl_guard"
    steps, diverged_at, start = [0] * M, {}, 0
    if resume:
        path = latest_checkpoint(ckpt_dir, set_aside=True)  # a damaged one not kept
        if path is not None:
            tree, meta = restore_checkpoint(path, {"states": states})
            states, stopped = tree["states"], meta["stopped"]
            start, steps, diverged_at = meta["iteration"], meta["steps"], meta["diverged"]
            for log, n in zip(logs, steps):
                check_logged_steps(log.path, stage, n, path)
            say(f"sweep {stage}: resuming from {path} (iteration {start})")
        for log in logs:
            drop_records(log.path, lambda r, s=start: r.get("iteration", -1) >= s)
    ops = cfg.ops

    def save(done, states, steps, stopped, diverged_at) -> None:
        meta = {"steps": steps, "stopped": stopped, "diverged": diverged_at, "stage": stage}
        for log in logs:  # their lines reach the device before the checkpoint does
            log.sync()
        save_checkpoint(ckpt_dir, done, {"states": states}, meta, keep=ops.keep)

    saved = completed = start  # the last checkpoint's iteration, the last one completed
    last = (states, list(steps), list(stopped), dict(diverged_at))
    try:
        for i in range(start, run.num_iterations):
            alive = np.asarray([s == "done" for s in stopped])
            it = run.iteration(states, alive, i)
            states = it.states
            for m, log in enumerate(logs):
                for kind, msg in ((k, g) for mm, k, g in it.events if mm == m):
                    log.write({"event": kind, "message": msg, "iteration": i, "step": steps[m]})
                recs = it.records[m]
                for j, rec in enumerate(recs):
                    rec = {"iteration": i, "step": steps[m] + j, **rec}
                    if j == len(recs) - 1:
                        rec.update({f"rollout/{k}": v for k, v in it.info[m].items()})
                    log.write({**rec, "lr_scale": 1.0})
                steps[m] += len(recs)
                if alive[m] and it.stopped is not None and it.stopped[m]:
                    stopped[m] = "kl_guard"
                    why = next((g for mm, k, g in it.events if mm == m and k == "kl_guard"), "")
                    print(f"[sweep {stage}] {members[m].name} stopped: {why}", file=sys.stderr)
                if alive[m] and not it.finite[m]:
                    stopped[m] = "diverged"
                    diverged_at[members[m].name] = {"iteration": i, "step": steps[m] - 1}
                    msg = (
                        f"iteration {i}, step {steps[m] - 1}: non-finite loss, gradient or "
                        "parameters; frozen at its last finite state, left out of the means"
                    )
                    log.write(
                        {"event": "diverged", "message": msg, "iteration": i, "step": steps[m]}
                    )
                    print(f"[sweep {stage}] {members[m].name} diverged: {msg}", file=sys.stderr)
            completed = done = i + 1
            last = (states, list(steps), list(stopped), dict(diverged_at))
            if (ops.checkpoint_every and done % ops.checkpoint_every == 0) or (
                done == run.num_iterations
            ):
                save(done, *last)
                saved = done
            say(_progress_line(stage, done, run.num_iterations, members, it, stopped))
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: keep the iterations completed
        if completed > saved:
            save(completed, *last)
            print(f"sweep {stage}: checkpointed iteration {completed}", file=sys.stderr)
        raise
    t_eval = time.perf_counter()
    summaries = {}
    for m, mem in enumerate(members):
        last = next(iter(reversed(member_records(logs[m].run_dir))), {})
        s = {"name": mem.name, "seed": mem.seed, "point": dict(mem.point), "steps": steps[m]}
        s["stopped"] = stopped[m]
        if stopped[m] == "diverged":
            s["diverged_at"] = diverged_at.get(mem.name)
        s.update({k: v for k, v in last.items() if k not in ("stage", "iteration", "step")})
        if stopped[m] != "diverged":
            s.update(run.evaluate(states, m))
            if export:
                run.export(states, m, member_dir(out, mem))
        summaries[mem.name] = s
        write_json_atomic(os.path.join(member_dir(out, mem), "summary.json"), s)
    diverged = tuple(mem.name for m, mem in enumerate(members) if stopped[m] == "diverged")
    summary = summarize_sweep(members, summaries)
    t_end = time.perf_counter()
    summary.update(stage=stage, diverged=list(diverged), seconds=t_end - t0)
    summary["phase_seconds"] = {
        "before": t_loop - t0,  # loading, the seeds' shared stages (SFT), the setup
        "iterations": t_eval - t_loop,  # the stage's iterations, every member
        "evaluation": t_end - t_eval,  # held-out evaluations, exports
    }
    write_json_atomic(os.path.join(out, SWEEP_SUMMARY), summary)
    try:
        plot_sweep(out, members, summaries, lambda mem: member_dir(out, mem))
    except ImportError:
        say("note: install matplotlib (pip install 'rlhf_eqx[plot]') for PNG plots")
    say("\n" + format_sweep_table(summary))
    if diverged:
        print(f"diverged (left out of the means): {', '.join(diverged)}", file=sys.stderr)
    return SweepResult(out, stage, tuple(members), summaries, summary, diverged, states)


def _starts(stage, cfg, members, base, tok, out, resume, say) -> dict:
    """`builtin_start` of each seed of `members`, once per seed."""
    starts = {}
    for mem in members:
        if mem.seed not in starts:
            starts[mem.seed] = builtin_start(
                mem.cfg,
                base,
                tok,
                out,
                resume=resume,
                say=say,
                sft=stage != "sft",
                reward=stage != "reward" and "reward" in cfg.stages,
            )
    return starts


def _progress_line(stage, done, total, members, it, stopped) -> str:
    losses = [r[-1]["loss"] for r, s in zip(it.records, stopped) if r and s == "done"]
    mean = f", mean loss {np.mean(losses):.4f}" if losses else ""
    n = f"{stopped.count('done')}/{len(members)}"
    return f"[sweep {stage}] iteration {done}/{total}: {n} members alive{mean}"


def _named(text: str) -> dict:
    """`add_argument`'s `metavar` and `help` of `--set`."""
    return {"metavar": "FIELD=VALUE", "help": text}


def sweep_command(argv: Sequence[str]) -> int:
    """`rlhf_eqx sweep STAGE --seeds N --grid FIELD=V1,V2 [--grid ...] [--set ...]
    [--config FILE] [--data FILE] [--model M] [--out DIR] [--resume] [--export]
    [--quiet]`: `sweep`, then the summary table and one result line. Stages: sft,
    reward, dpo, kto, grpo, ppo, multiturn on the built-in task; sft, reward, dpo, kto on a
    data file of pairs (`--data pairs.jsonl`, e.g. `rlhf_eqx sweep dpo --data pairs.jsonl
    --seeds 2 --grid dpo.beta=0.05,0.2`) and grpo on prompts with answers (`rlhf_eqx sweep
    grpo --data gsm8k.jsonl --seeds 2 --grid grpo.beta=0.0,0.04`); multiturn with your own
    environment (`--set
    multiturn.environment=my_env:make`, a factory `make(tok)` in `my_env.py`).
    **Returns:** the exit status: 0 done (diverged members are part of the result), 2 an
    invalid configuration or sweep directory, 1 a run error."""
    import argparse

    from ._config_io import apply_overrides, load_config

    p = argparse.ArgumentParser(prog="rlhf_eqx sweep", description=sweep_command.__doc__)
    p.add_argument("stage", help=f"the stage to sweep: {', '.join(_STAGES)}")
    p.add_argument(
        "--seeds", type=int, default=4, help="seeds per grid point: ops.seed, +1, ... (default 4)"
    )
    p.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="FIELD=V1,V2,...",
        help="a traced field and its values, e.g. dpo.beta=0.05,0.1 (repeat for several "
        "fields: every combination); the traceable fields of each stage's section: "
        + "; ".join(f"{k}: {', '.join(v)}" for k, v in TRACEABLE.items()),
    )
    each = "a setting of every member, e.g. sft.steps=2 (the sections the sweep's stages read)"
    p.add_argument("--set", dest="overrides", action="append", default=[], **_named(each))
    p.add_argument("--config", help="a configuration file the --set values apply over")
    p.add_argument("--data", help="a data file: the stage alone on it (data.path)")
    p.add_argument("--model", help="the base model (model.source)")
    p.add_argument("--out", help="the sweep directory (default runs/sweep-STAGE)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the sweep in --out from its last checkpoint (ops.checkpoint_every)",
    )
    p.add_argument(
        "--export", action="store_true", help="write each member's model to members/NAME/STAGE/hf/"
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines (ops.quiet)")
    p.add_argument("--callback", action="append", default=[], help=argparse.SUPPRESS)
    args = p.parse_args(list(argv))
    try:
        if args.callback:  # the members' loop is one program: no per-member hooks
            raise ConfigError(
                "--callback: not in a sweep (callbacks hook into a separate run's loop; "
                "run the member as its own run: rlhf_eqx STAGE --set ops.seed=S --callback ...)"
            )
        cfg = animal_task_config()
        if args.config:
            cfg = load_config(args.config, base=cfg)
        overrides = list(args.overrides)
        if args.data:
            overrides.append(f"data.path={args.data}")
        if args.model:
            overrides.append(f"model.source={args.model}")
        if args.quiet:
            overrides.append("ops.quiet=true")
        cfg = apply_overrides(cfg, overrides)
        out = args.out or os.path.join("runs", f"sweep-{args.stage}")
        res = sweep(
            args.stage,
            cfg,
            seeds=args.seeds,
            grid=parse_grid(args.grid),
            out=out,
            resume=args.resume,
            export=args.export,
        )
    except (ConfigError, RunDirError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    n = len(res.members)
    bad = f", {len(res.diverged)} diverged" if res.diverged else ""
    members = "member" if n == 1 else "members"
    print(f"rlhf_eqx sweep {args.stage}: {n} {members} done{bad} ({out}/{SWEEP_SUMMARY})")
    return 0
