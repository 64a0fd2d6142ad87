"""Command line: `python -m rlhf_eqx [COMMAND] [options]` (console script `rlhf_eqx`).

With no command, runs the built-in pipeline on the shipped stories260K model: SFT, then
reward model -> PPO, DPO and GRPO from SFT, teaching the model to write stories in which
an animal appears; prints a table of held-out gains and writes a run directory.

Commands:

- `pipeline` (the default): the whole pipeline (`--set stages=sft,dpo` to choose).
- `sft`, `reward`, `dpo`, `grpo`, `ppo`, `kto`: one stage; on the built-in task (after
  SFT; `ppo` after SFT and the reward model), or on a data file with `--data FILE`
  (preferences for reward/dpo, e.g. HH-RLHF; for sft TRL's `text`,
  `prompt`/`completion` or `messages` layouts, or preferences' chosen responses;
  prompts for grpo and ppo, with answers for the exact-match reward (e.g. GSM8K) or
  without, scored by your functions `--set grpo.reward_functions=MODULE:NAME` with
  `--set grpo.reward_source=task`, a reward model `--set ppo.reward_model=DIR` or a
  judge; unpaired `prompt`/`completion`/`label` JSONL or preferences for kto; for
  distill, prompts of `prompt`/`completion` or `messages` records or of preferences,
  and `--set distill.teacher=DIR`, a checkpoint directory).
- `online-dpo`: SFT, the reward model, then this stage on the built-in task.
- `prm`: a process reward model on a stepwise file (`--data FILE`, records
  `{"prompt", "completions": [steps], "labels": [bools]}`); PPO and GRPO use it with
  `--set grpo.reward_source=prm --set grpo.reward_model=RUN/prm/hf`.
- `sweep STAGE --seeds N --grid dpo.beta=0.05,0.1`: every member of grid x seeds of a
  stage trained in one compiled program per step (`rlhf_eqx sweep --help`).
- `serve --model NAME`: an OpenAI-compatible endpoint on 127.0.0.1 (`rlhf_eqx serve
  --help`).
- `sample`: print completions of a model; `eval`: score a model on the built-in task's
  held-out prompts as a run evaluates its stages (a run's exported policy gets the
  numbers of its summary.json: `eval --model RUN` or `--model RUN/<stage>/hf` reads
  that run's `eval_samples`, `sampling.*` and `ops.seed`, which flags still override);
  `plot RUN_DIR`: redraw a run's PNG plots. `--model`
  also takes a run directory, which stands for the one policy it exported.

Configuration: built-in defaults, then `--config FILE` (JSON or YAML), then `--set
field.sub=value` overrides. `rlhf_eqx STAGE --help` lists the fields that stage reads
(its own section, the shared `model`, `data`, `sampling`, `ops`, and on the built-in task
the stages it starts from), `rlhf_eqx pipeline --help` every field; `--show-config`
prints the whole resolved configuration. A run prints the settings it reads and saves
the whole configuration as `OUT/config.json`. Invalid values stop the run before
anything is compiled, with one line naming the field; so does a `--set` of a stage's
section that the command does not run (`dpo --data FILE --set ppo.kl_coef=0.1`: `ppo`
reads it), or `--set stages=...` on a stage command (a config file may set every
section).

Run directories (`--out`, default `runs/<command>`): a run holds a lock in its
directory; a new run into a directory that holds one is refused (`--resume` continues
it after checking that the configuration is the same, `--overwrite` moves it aside).
Ctrl-C (or SIGTERM) checkpoints and prints the command that resumes. `--callback MODULE:NAME`
(repeatable) hooks a `rlhf_eqx.pipelines.Callback` (a class, instantiated, or an
object; the module imported from the current directory) into every stage's loop.
`--seeds N`: seeds `ops.seed`,
... into `OUT/seed-<seed>/`, their spread in `OUT/seeds_summary.json`. Exit status: 0
done, 1 a run error, 2 invalid configuration or run directory, 3 diverged, 130 interrupted.

Multi-process runs: with `RLHF_EQX_COORDINATOR=host:port`, `RLHF_EQX_NUM_PROCESSES` and
`RLHF_EQX_PROCESS_ID` set, each process joins the run before anything else
(`rlhf_eqx.distributed.initialize_distributed`); give each its own `--out`. GRPO's
`grpo.placement=split` spans the processes' devices (docs/scaling.md).

Plugins: `--import MODULE` (repeatable; from the current directory) imports a module
before the commands are built, and every installed package's entry points of the group
`rlhf_eqx.plugins` are imported first (`[project.entry-points."rlhf_eqx.plugins"]
my_stage = "my_package.stage"` in its pyproject.toml): a module that registers stages
(`pipelines.register_stage`) or losses makes them commands and settings of every command.
"""

import argparse
import contextlib
import dataclasses
import difflib
import importlib
import importlib.metadata
import json
import os
import shlex
import signal
import sys
import threading
from collections.abc import Sequence

TOOL_COMMANDS = ("sample", "eval", "plot")
PLUGIN_GROUP = "rlhf_eqx.plugins"
"""The entry-point group whose modules the command line imports before building its
commands."""


def stage_commands() -> tuple[str, ...]:
    """The registered stages (`rlhf_eqx.pipelines.register_stage`), one command each."""
    from rlhf_eqx.pipelines.config import stages

    return tuple(st.name for st in stages())


class PluginError(Exception):
    """A module of `--import` that cannot be imported."""


def load_plugins(argv: Sequence[str]) -> list[str]:
    """Import the installed `PLUGIN_GROUP` entry points (one that fails is one warning
    line on stderr: the other commands still work), then the modules of `--import MODULE`
    / `--import=MODULE` in `argv`, with the current directory first on the path (a
    `PluginError` naming the module and the error). **Returns:** `argv` without them."""
    for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP):
        try:
            ep.load()
        except Exception as e:
            print(
                f"warning: plugin {ep.name} ({ep.value}) not loaded: {type(e).__name__}: {e}",
                file=sys.stderr,
            )
    rest, modules = [], []
    it = iter(argv)
    for a in it:
        if a == "--import":
            modules.append(next(it, ""))
        elif a.startswith("--import="):
            modules.append(a.partition("=")[2])
        else:
            rest.append(a)
    if modules and "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    for module in modules:
        if not module:
            raise PluginError("--import: expected a module name, e.g. --import my_stage")
        try:
            importlib.import_module(module)
        except Exception as e:
            raise PluginError(f"--import {module}: {type(e).__name__}: {e}") from None
    return rest


class _Parser(argparse.ArgumentParser):
    """The command line's parser: an unknown command names the nearest ones."""

    def error(self, message):
        known = ("pipeline", *stage_commands(), *TOOL_COMMANDS, "sweep", "serve")
        if message.startswith("argument command: invalid choice: "):
            given = message.split("'")[1] if message.count("'") >= 2 else ""
            close = difflib.get_close_matches(given, known, n=2)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            message = f"unknown command {given!r}{hint} (commands: {', '.join(known)})"
        super().error(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="rlhf_eqx",
        description=(__doc__ or "").splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
        add_help=False,
    )
    p.add_argument("-h", "--help", action="store_true", help="show this help (or a stage's fields)")
    commands = ("pipeline", *stage_commands(), *TOOL_COMMANDS)
    p.add_argument("command", nargs="?", default="pipeline", choices=commands)
    p.add_argument("run_dir", nargs="?", help="run directory (plot)")
    p.add_argument("--config", help="JSON or YAML config file")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="dotted override, e.g. dpo.beta=0.2 (repeatable)",
    )
    p.add_argument("--out", help="run directory (default: runs/<command> under the cwd)")
    p.add_argument("--data", help="data file (same as --set data.path=FILE)")
    p.add_argument(
        "--model",
        help="builtin, smollm2-135m, a .gguf, a llama2.c .bin, an HF dir or a run dir "
        "(its one exported policy); eval of a run dir or of its RUN/<stage>/hf reads the "
        "run's evaluation settings (eval_samples, sampling, ops.seed; flags still win)",
    )
    p.add_argument("--tokenizer", help="tokenizer file for --model")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoints")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="move a previous run in the run directory aside and start again",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars or step lines")
    p.add_argument("--seeds", type=int, metavar="N", help="N seeds into OUT/seed-<seed>/")
    p.add_argument(
        "--callback",
        dest="callbacks",
        action="append",
        default=[],
        metavar="MODULE:NAME",
        help="a pipelines.Callback class or object, from the current directory (repeatable)",
    )
    p.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="a module that registers stages or losses, from the current directory "
        "(repeatable; before the commands are built)",
    )
    p.add_argument("--show-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--prompt", action="append", default=[], help="prompt (sample; repeatable)")
    p.add_argument("-n", "--num-samples", type=int, default=4, help="samples per prompt (sample)")
    return p


def resolve_config(args: argparse.Namespace):
    """The resolved `PipelineConfig` of parsed arguments (defaults < file < flags)."""
    from rlhf_eqx import pipelines as pl

    cfg = pl.tools.resolve_model_names(pl.config.command_line_config(args))
    cmd = args.command
    if cmd not in ("pipeline", *TOOL_COMMANDS):
        from rlhf_eqx.pipelines import ConfigError
        from rlhf_eqx.pipelines.config import get_stage

        stage = get_stage(cmd)
        if cfg.data.path is not None:
            cfg = dataclasses.replace(cfg, stages=(cmd,))
        elif stage.builtin is None:
            raise ConfigError(f"{cmd} runs on a data file: --data FILE ({stage.help})")
        else:
            cfg = dataclasses.replace(cfg, stages=stage.prerequisites(cfg))
    check_set_sections(cmd, cfg, args.overrides)
    out = args.out or cfg.out or os.path.join("runs", cmd)
    return dataclasses.replace(cfg, out=out)


def command_stages(command: str, cfg) -> tuple[str, ...]:
    """The stages `command` runs with the resolved configuration `cfg`: none for `sample`,
    `eval` and `plot`; else `cfg.stages` (a stage command's are set by `resolve_config`:
    the stage alone on a data file, its prerequisites on the built-in task), with SFT
    first on the built-in task (the others start from it)."""
    if command in TOOL_COMMANDS:
        return ()
    if cfg.data.path is None:
        return tuple(dict.fromkeys(("sft", *cfg.stages)))
    return tuple(cfg.stages)


def _unread(error: Exception) -> Exception:
    """`error` marked as a refused `--set` (`check_set_sections`), which `--help` reports
    as a run does."""
    error.unread_setting = True  # type: ignore[attr-defined]
    return error


def check_set_sections(
    command: str, cfg, overrides: Sequence[str], flag: str = "--set", *, sweep: bool = False
) -> None:
    """Refuse (`ConfigError`, one line) an explicit `--set` (or a sweep's `--grid`,
    `flag`) that no stage `command` runs would read: a field of another stage's section
    (`dpo --data FILE --set ppo.kl_coef=0.1`), naming the key, the stages the command
    runs and the command that reads it; and `stages` on a stage command, which runs its
    own. A configuration file sets every section and is not checked; nor are the shared
    sections (`model`, `data`, `sampling`, `ops`, ...), which `validate_config` checks.
    A run whose stages are not all registered is left to `validate_config`. `sweep`: the
    command is `rlhf_eqx sweep COMMAND`."""
    from rlhf_eqx.pipelines import ConfigError
    from rlhf_eqx.pipelines.config import find_stage, read_fields, stages

    run = command_stages(command, cfg)
    if any(find_stage(s) is None for s in run):
        return
    read = set(read_fields(cfg)) if run else set()
    keys = {st.key for st in stages()}
    runs = f"runs {', '.join(run)}" if run else "runs no stage"
    shown = f"rlhf_eqx sweep {command}" if sweep else f"rlhf_eqx {command}"
    unread = "does" if len(run) == 1 else "do"
    for item in overrides:
        key = item.partition("=")[0].strip()
        section = key.split(".")[0]
        if section == "stages" and command not in ("pipeline", *TOOL_COMMANDS):
            how = "" if sweep else f"; choose them with rlhf_eqx pipeline {flag} {item}"
            raise _unread(ConfigError(f"{flag} {item}: {shown} {runs} (its own stages){how}"))
        if section not in keys or section in read:
            continue
        readers = [f"rlhf_eqx {st.name}" for st in stages() if st.key == section]
        also = ""
        if command == "pipeline":
            names = [st.name for st in stages() if st.key == section and st.builtin]
            if names:
                also = f", or this pipeline with stages={','.join((*cfg.stages, names[0]))}"
        if run:
            which = f"{runs}, which {unread} not read {section}.*"
        else:
            which = f"{runs} and reads no stage's settings ({section}.*)"
        own = find_stage(command)
        field = key.partition(".")[2]
        if own is not None and own.key != section and _has_setting(getattr(cfg, own.key), field):
            also += f"; for this command set {own.key}.{field}"
        why = f"{flag} {item}: {shown} {which}; {' or '.join(readers)} reads it{also}"
        raise _unread(ConfigError(why))


def _has_setting(section, path: str) -> bool:
    """Whether the dotted `path` names a field of the settings `section` (a dataclass)."""
    obj = section
    for part in path.split(".") if path else ():
        names = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else ()
        if part not in names:
            return False
        obj = getattr(obj, part)
    return bool(path)


class _SweepArgs(argparse.ArgumentParser):
    """The sweep command's options, read to check its `--set` and `--grid` keys; an
    argument it cannot read is left to the sweep command (`ValueError`)."""

    def error(self, message):
        raise ValueError(message)


def check_sweep_sets(argv: Sequence[str]) -> None:
    """Refuse (`ConfigError`) a sweep's `--set` or `--grid` key that the stages it runs
    would not read, as a run's (`check_set_sections`): the swept stage on a data file,
    its prerequisites on the built-in task. A command line that does not read (an
    unknown stage or option, a config file that does not load) is left to the sweep
    command, which names what is wrong."""
    from rlhf_eqx import pipelines as pl
    from rlhf_eqx.pipelines.config import find_stage

    p = _SweepArgs(add_help=False, allow_abbrev=False)
    p.add_argument("stage")
    for flag in ("--grid", "--set", "--callback"):
        p.add_argument(flag, action="append", default=[])
    for flag in ("--seeds", "--config", "--data", "--model", "--out"):
        p.add_argument(flag)
    for flag in ("--resume", "--export", "--quiet", "-h", "--help"):
        p.add_argument(flag, action="store_true")
    try:
        args = p.parse_args(list(argv))
    except ValueError:
        return
    st = find_stage(args.stage)
    if st is None or args.help:
        return
    ns = argparse.Namespace(
        command=args.stage, config=args.config, overrides=args.set, data=args.data,
        model=args.model, tokenizer=None, quiet=False,
    )  # fmt: skip
    try:
        cfg = pl.config.command_line_config(ns)
        run = (args.stage,) if cfg.data.path is not None else st.prerequisites(cfg)
    except pl.ConfigError:
        return
    cfg = dataclasses.replace(cfg, stages=run)
    check_set_sections(args.stage, cfg, args.set, sweep=True)
    check_set_sections(args.stage, cfg, args.grid, flag="--grid", sweep=True)


def help_config(args: argparse.Namespace):
    """The configuration `--help` describes (`pipelines.config.config_help`): the command
    line's (`resolve_config`; for a stage that runs on a data file and has none, its
    defaults with the command line's settings).

    A command line whose settings do not load (`--set bad.field=1`, a value out of range,
    a config file that does not read, a `--set` of a stage the command does not run) is
    refused as a run refuses it: the error line
    `error: invalid configuration: ...` on stderr, above the help of the built-in task's
    defaults; `None` is returned then (exit status 2)."""
    from rlhf_eqx import pipelines as pl

    try:
        given = pl.tools.resolve_model_names(pl.config.command_line_config(args))
    except pl.ConfigError as e:
        print(f"error: invalid configuration: {e}", file=sys.stderr, flush=True)
        print(pl.config.config_help(args.command, pl.animal_task_config()))
        return None
    try:
        return resolve_config(args)
    except pl.ConfigError as e:
        if getattr(e, "unread_setting", False):  # a --set the command would not read
            print(f"error: invalid configuration: {e}", file=sys.stderr, flush=True)
            print(pl.config.config_help(args.command, pl.animal_task_config()))
            return None
        return given  # a data-file stage without --data: what it would read


def result_line(command: str, summary: dict, out: str) -> str:
    """The one line a finished run prints, even with `--quiet`."""
    stopped = summary.get("stopped", "done")
    parts = []
    from rlhf_eqx.pipelines.config import stages

    names = [st.summary_key or st.name for st in stages()]
    for stage in names:
        m = summary.get(stage)
        if isinstance(m, dict) and "score" in m:
            parts.append(f"{stage} {m['score']:.1%}")
    if not parts:
        for stage in names:
            m = summary.get(stage)
            if isinstance(m, dict):
                floats = [(k, v) for k, v in m.items() if isinstance(v, float)]
                parts += [f"{k} {v:.4g}" for k, v in floats if not k.endswith("_se")][:2]
    reason = f": {summary['stop_reason']}" if summary.get("stop_reason") else ""
    what = "done" if stopped == "done" else f"stopped ({stopped}{reason})"
    early = []  # stages of a pipeline that ended before their last iteration
    for stage in names:
        m = summary.get(stage)
        if isinstance(m, dict) and m.get("stopped") not in (None, "done", "diverged"):
            why = f": {m['stop_reason']}" if m.get("stop_reason") else ""
            early.append(f"{stage} stopped ({m['stopped']}{why})")
    if early and stopped == "done":
        what += f" ({'; '.join(early)})"
    numbers = ", ".join(parts) + " " if parts else ""
    return f"rlhf_eqx {command}: {what}: {numbers}({out}/summary.json)"


def _interrupted(e: KeyboardInterrupt, argv: Sequence[str], what: str = "interrupted") -> str:
    """The line for an interrupted command: the command that resumes it, or, when the
    interrupt came before anything ran (`nothing_ran`, set by the run directory: the
    new directory removed, or the previous run that `--overwrite` replaced put back),
    the same command again (a resume would find nothing, or the previous run)."""
    if getattr(e, "nothing_ran", False):
        return (
            "interrupted before anything ran (nothing to resume); to start it again: "
            "rlhf_eqx " + shlex.join(argv)
        )
    return f"{what}; resume with: {resume_command(argv)}"


def resume_command(argv: Sequence[str]) -> str:
    """The command that resumes the run `argv` started."""
    args = [a for a in argv if a != "--overwrite"]
    if "--resume" not in args:
        args.append("--resume")
    return "rlhf_eqx " + shlex.join(args)


@contextlib.contextmanager
def _terminate_as_interrupt():
    """Within: SIGTERM (what `kill`, `timeout`, a batch scheduler or a container stop
    sends) raises `KeyboardInterrupt` as Ctrl-C does, so that a run stopped that way
    checkpoints its last completed iteration and prints the command that resumes it
    (exit status 130) instead of dying with nothing saved. The previous handler is put
    back on leaving; outside the main thread (where handlers cannot be set) nothing
    changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        plain = load_plugins(argv)  # `argv` keeps --import for the parser and resuming
    except PluginError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if plain[:1] == ["sweep"]:  # grid x seeds of one stage in one program (its own options)
        from rlhf_eqx.pipelines import ConfigError
        from rlhf_eqx.pipelines.tools import sweep_command

        try:
            check_sweep_sets(plain[1:])
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        try:
            with _terminate_as_interrupt():
                return sweep_command(plain[1:])
        except KeyboardInterrupt as e:  # the periodic checkpoints (ops.checkpoint_every) stay
            print(_interrupted(e, argv), file=sys.stderr)
            return 130
    if plain[:1] == ["serve"]:  # an OpenAI-compatible endpoint (its own options)
        from rlhf_eqx.serving import serve_command

        return serve_command(plain[1:])
    args = _parser().parse_args(argv)
    if args.help:
        from rlhf_eqx.pipelines.config import config_help, find_stage

        if find_stage(args.command) is not None or (
            args.command == "pipeline" and "pipeline" in argv
        ):
            cfg = help_config(args)
            if cfg is None:
                return 2
            print(config_help(args.command, cfg))
        else:
            _parser().print_help()
        return 0
    from rlhf_eqx.pipelines import ConfigError
    from rlhf_eqx.pipelines.config import config_to_dict, read_fields, validate_config
    from rlhf_eqx.pipelines.loop import RunDirError

    if args.command == "plot":
        from rlhf_eqx.pipelines.tools import plot_run

        if not args.run_dir:
            print("error: plot needs a run directory: rlhf_eqx plot RUN_DIR", file=sys.stderr)
            return 2
        try:
            for path in plot_run(args.run_dir):
                print(path)
        except (FileNotFoundError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except ImportError:
            print("error: plots need matplotlib (pip install 'rlhf_eqx[plot]')", file=sys.stderr)
            return 2
        return 0
    try:
        join_processes()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        cfg = resolve_config(args)
        if args.seeds is not None:
            from rlhf_eqx.pipelines.tools import check_seeds

            if args.command in TOOL_COMMANDS:
                raise ConfigError(f"--seeds: runs only, not {args.command}")
            check_seeds(args.seeds)
        callbacks = _callbacks(args)
        # The runs execute on one device (the default one), whatever else is visible,
        # so batch sizes need only divide by 1 here. sample / eval train nothing: a packed
        # base needs no stage's LoRA (load_model checks its .gguf source).
        tool = args.command in TOOL_COMMANDS and cfg.model.quantized
        model = dataclasses.replace(cfg.model, quantized=False) if tool else cfg.model
        # sample / eval take sampling.temperature=0 as greedy decoding (the sampler's
        # argmax, as serve does); the stages need a positive one for their log-probabilities
        greedy = args.command in TOOL_COMMANDS and cfg.sampling.temperature == 0
        sampling = dataclasses.replace(cfg.sampling, temperature=1.0) if greedy else cfg.sampling
        checked = dataclasses.replace(cfg, model=model, sampling=sampling)
        try:
            validate_config(checked, device_count=1)
        except ConfigError as e:
            if args.command in TOOL_COMMANDS and str(e).startswith("sampling.temperature="):
                raise ConfigError(f"{e}, or 0 for greedy decoding") from None
            raise
    except ConfigError as e:
        print(f"error: invalid configuration: {e}", file=sys.stderr)
        return 2
    if args.show_config:
        print(json.dumps(config_to_dict(cfg), indent=1))
        return 0
    if not cfg.ops.quiet and args.command not in TOOL_COMMANDS:
        # What this run reads; the whole configuration goes to config.json.
        read = json.dumps(config_to_dict(cfg, only=read_fields(cfg)), indent=1)
        print(
            f"rlhf_eqx {args.command}: the settings this run reads (the whole config: "
            f"{cfg.out}/config.json)"
        )
        print(read)
    from rlhf_eqx._compilation_cache import command_line_cache
    from rlhf_eqx.pipelines.loop import CallbackError, RunInterrupted

    command_line_cache(cfg.ops.compilation_cache, cfg.ops.compilation_cache_max_mb)  # on disk
    try:
        with _terminate_as_interrupt():
            return _run(args, cfg, callbacks)
    except ConfigError as e:
        print(f"error: invalid configuration: {e}", file=sys.stderr)
        return 2
    except RunDirError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except CallbackError as e:
        where = f"; checkpoint {e.checkpoint}, resume with: {resume_command(argv)}"
        print(f"error: {e}" + (where if e.checkpoint else ""), file=sys.stderr)
        return 1
    except RunInterrupted as e:
        where = f"; checkpoint {e.checkpoint}" if e.checkpoint else ""
        what = f"interrupted: {e.stage} at iteration {e.iteration}/{e.total}{where}"
        print(_interrupted(e, argv, what), file=sys.stderr)
        return 130
    except KeyboardInterrupt as e:
        print(_interrupted(e, argv), file=sys.stderr)
        return 130
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def join_processes() -> tuple[int, int] | None:
    """Join the multi-process run the environment names, before anything touches a device.

    When any of `RLHF_EQX_COORDINATOR`, `RLHF_EQX_NUM_PROCESSES`, `RLHF_EQX_PROCESS_ID`
    is set, `rlhf_eqx.distributed.initialize_distributed()` joins the run (all three are
    needed) and a line `rlhf_eqx: process P of N (coordinator HOST:PORT)` goes to stderr;
    with none set nothing happens, nor when this process has joined a run already (a
    program that calls `main` after `initialize_distributed`). Configuration checks read
    the devices (which starts JAX's backend, after which no process can join), so this
    runs first.

    **Returns:** `(process_id, num_processes)`, or `None` when no variable is set.

    **Raises:** `ValueError` from `initialize_distributed` naming the variable that is
    missing, not an integer or out of range, or a process count that differs from the
    run's.
    """
    from rlhf_eqx import distributed as dist

    names = (dist.ENV_COORDINATOR, dist.ENV_NUM_PROCESSES, dist.ENV_PROCESS_ID)
    if not any(os.environ.get(name) for name in names):
        return None
    import jax

    if jax.distributed.is_initialized():  # `main` called by a program that joined already
        return jax.process_index(), jax.process_count()
    process_id, num_processes = dist.initialize_distributed()
    print(
        f"rlhf_eqx: process {process_id} of {num_processes} (coordinator "
        f"{os.environ.get(dist.ENV_COORDINATOR)})",
        file=sys.stderr,
        flush=True,
    )
    return process_id, num_processes


def _callbacks(args) -> tuple:
    """The callbacks of `--callback MODULE:NAME` (`pipelines.loop.load_callback`); a
    `ConfigError` with `--seeds` or a command that runs no stage."""
    from rlhf_eqx.pipelines import ConfigError
    from rlhf_eqx.pipelines.loop import load_callback

    if args.callbacks and args.command in TOOL_COMMANDS:
        raise ConfigError(f"--callback: runs only, not {args.command}")
    if args.callbacks and args.seeds is not None:
        raise ConfigError("--callback: not with --seeds (run each seed with its own --out)")
    return tuple(load_callback(spec) for spec in args.callbacks)


def _run(args, cfg, callbacks: tuple = ()) -> int:
    from rlhf_eqx import pipelines as pl

    cmd = args.command
    if cmd in TOOL_COMMANDS:
        return _use_model(args, cfg)
    if args.seeds is not None:
        kw = dict(resume=args.resume, overwrite=args.overwrite)
        return pl.tools.seeds_command(cfg, cmd, args.seeds, **kw)
    if cmd == "pipeline" or cfg.data.path is None:
        kw = dict(resume=args.resume, overwrite=args.overwrite, callbacks=callbacks)
        summary = pl.run_pipeline(cfg, **kw)
    else:
        kw = dict(resume=args.resume, overwrite=args.overwrite, callbacks=callbacks)
        summary = pl.run_on_data(cfg, cmd, **kw)
    print(result_line(cmd, summary, cfg.out))
    return 3 if summary.get("stopped") == "diverged" else 0


def _use_model(args, cfg) -> int:
    from rlhf_eqx import pipelines as pl

    if args.command == "sample":
        for text in pl.tools.sample_model(cfg, args.prompt, num_samples=args.num_samples):
            print(f"{text}\n")
    else:
        print(json.dumps(pl.tools.evaluate_model(cfg), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
