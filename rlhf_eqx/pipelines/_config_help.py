"""The command line's `--help` for a command: the configuration fields it reads, with
their values (the `--set FIELD=VALUE` paths)."""

import dataclasses
from typing import Any

from ._config_io import config_to_dict, read_fields
from ._pipeline_config import animal_task_config
from ._registry import get_stage


def help_sections(command: str, cfg: Any) -> tuple[str, ...]:
    """The config sections `rlhf_eqx COMMAND --help` lists.

    **Arguments:**

    - `command`: `"pipeline"` or a registered stage's name.
    - `cfg`: the `PipelineConfig` of the command line (a `data.path` means a run on a
      data file).

    **Returns:** for a stage, its own section, then those a run of it reads
    (`read_fields`: on a data file, the stage alone; on the built-in task, with the
    stages it starts from) and `data` (the `--data` fields); for `"pipeline"`, every
    section, since `--set stages=...` may run any stage.
    """
    if command == "pipeline":
        return tuple(k for k in config_to_dict(cfg) if dataclasses.is_dataclass(getattr(cfg, k)))
    st = get_stage(command)
    data_file = (cfg.data.path is not None and st.data is not None) or st.builtin is None
    run = (command,) if data_file else st.prerequisites(cfg)
    read = read_fields(cfg, run, data_file=data_file)
    sections = [k for k in read if dataclasses.is_dataclass(getattr(cfg, k))]
    return tuple(dict.fromkeys((st.key, *sections, "data")))


def config_help(command: str, cfg: Any = None) -> str:
    """The text of `rlhf_eqx COMMAND --help`: the fields of `help_sections(command, cfg)`
    with their values in `cfg` (default: `animal_task_config()`), each as
    `  section.field = value` under its section's description (but the fields set from
    another section, as the PPO and GRPO `temperature` from `sampling.temperature`);
    `"pipeline"` also lists the top-level fields (`stages`, `label_noise`, ...)."""
    cfg = animal_task_config() if cfg is None else cfg
    sections = help_sections(command, cfg)
    if command == "pipeline":
        where = ": every section (`--set stages=...` runs any stage)"
    else:
        where = _where(get_stage(command), cfg)
    lines = [
        f"usage: rlhf_eqx {command} [--data FILE] [--model SRC [--tokenizer FILE]] "
        "[--config FILE] [--set FIELD=VALUE ...] [--out DIR] [--resume | --overwrite] [--quiet]",
        "",
        f"Fields of `{command}`{where}",
        "(--set FIELD=VALUE; values: the built-in task's defaults, then --config and --set):",
    ]

    def walk(obj, prefix):
        for f in dataclasses.fields(obj):
            if f.metadata.get("set_by"):  # set from another section (`sampling.temperature`)
                continue
            v = getattr(obj, f.name)
            if dataclasses.is_dataclass(v):
                walk(v, f"{prefix}{f.name}.")
            else:
                shown = ",".join(map(str, v)) if isinstance(v, tuple) else v
                lines.append(f"  {prefix}{f.name} = {shown}")

    if command == "pipeline":
        doc = " ".join((type(cfg).__doc__ or "").split())
        lines += ["", f"top level: {doc}"]
        for name, v in config_to_dict(cfg).items():
            if name not in sections:
                shown = ",".join(map(str, v)) if isinstance(v, list) else v
                lines.append(f"  {name} = {shown}")
    for name in sections:
        section = getattr(cfg, name)
        doc = _own_doc(type(section))
        lines += ["", f"{name}: {doc}" if doc else f"{name}:"]
        walk(section, f"{name}.")
    return "\n".join(lines)


def _where(st: Any, cfg: Any) -> str:
    """The runs of the stage `st` that `config_help` describes: on a data file (`st.name`
    alone), or on the built-in task with the stages it starts from, with or without a
    data-file form (a stage without a `data` function is refused `--data FILE`)."""
    if st.builtin is None or (cfg.data.path is not None and st.data is not None):
        return f" on a data file (--data FILE): {st.name} alone"
    stages = ", ".join(st.prerequisites(cfg))
    if st.data is None:
        return f" on the built-in task (stages {stages}; {st.name} does not run on a data file)"
    return f" on the built-in task (stages {stages}; with --data FILE, {st.name} alone)"


def _own_doc(cls: type) -> str:
    """`cls`'s docstring on one line; `""` for the signature `dataclasses` writes for a
    class without one (a user's stage settings)."""
    doc = " ".join((cls.__doc__ or "").split())
    return "" if doc.startswith(f"{cls.__name__}(") else doc
