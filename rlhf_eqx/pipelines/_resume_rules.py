"""What may change when a run resumes: operations settings and iteration counts, never what
a stage trains on or how; a count only while no later stage has trained on its result.
The stages' own fields and what trains from what come from the registry
(`Stage.resumable`, the stages' settings classes, `Stage.needs`)."""

import dataclasses
import json
import os


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked (held by another run, holds another
    run, or the resumed run's configuration differs); the message says what to do."""


# Fields that may differ between a run and its resumption: how the run is operated,
# logged and evaluated, never what it trains on or how. A stage adds fields of its own
# section (`Stage.resumable`: `resumable_fields`).
RESUMABLE_FIELDS: tuple[str, ...] = (
    "out",
    "notes",
    "stages",
    "eval_samples",
    "ops.quiet",
    "ops.log_every",
    "ops.eval_every",
    "ops.checkpoint_every",
    "ops.keep",
    "ops.monitor",
    "ops.profile_steps",
    "ops.tensorboard",
    "ops.trackers",
    "ops.tracker_group",
    "ops.max_rollbacks",
    "ops.compilation_cache",  # where compiled programs are kept, not what they compute
    "ops.compilation_cache_max_mb",
    "model.remat",  # what the backward pass keeps or recomputes; the values are the same
)

ITERATION_NAMES: tuple[str, ...] = ("steps", "rollouts", "rounds")
"""The fields of a stage's settings that count its iterations (more steps, more rollouts)
and may change on resume. The learning-rate schedule is rebuilt for the new total, so a
resumed run with another count is not the run it would have been with that count from
the start."""


def resumable_fields() -> tuple[str, ...]:
    """`RESUMABLE_FIELDS` and each registered stage's `Stage.resumable` fields under its
    section (`grpo.overlap`, `grpo.sampler_device`)."""
    from ._registry import stages

    own = (f"{st.key}.{name}" for st in stages() for name in st.resumable)
    return tuple(dict.fromkeys((*RESUMABLE_FIELDS, *own)))


def iteration_fields() -> dict[str, tuple[str, ...]]:
    """`{dotted field: the stages it counts}`: the `ITERATION_NAMES` fields of each
    registered stage's settings (two stages may share a section: `dpo.steps` counts
    `online-dpo` and `dpo`)."""
    from ._registry import stages

    out: dict[str, tuple[str, ...]] = {}
    for st in stages():
        names = {f.name for f in dataclasses.fields(st.config)}
        for name in ITERATION_NAMES:
            if name in names:
                key = f"{st.key}.{name}"
                out[key] = (*out.get(key, ()), st.name)
    return out


def requested_iterations(stage: str, new: dict, saved: dict) -> int | None:
    """The iteration count the configuration `new` (a config dict, `config_to_dict`)
    requests of `stage`, told before its loop starts: the `iteration_fields()` field that
    counts it. `saved` is the `meta.json` of one of its checkpoints: its loop's
    `num_iterations` and its `config` tell apart the fields of a stage that has several
    (`dpo.steps` counts offline DPO, `dpo.rounds` online DPO), and a stage whose count is
    none of them. `None` when it cannot be told (the loop checks it as it starts)."""
    fields = [k for k, names in iteration_fields().items() if stage in names]
    done = saved.get("num_iterations")
    if done is not None:
        stored = _flatten(saved.get("config") or {})
        fields = [k for k in fields if stored.get(k) == done]
    elif len(fields) > 1:
        return None
    wanted = _flatten(new)
    counts = {wanted.get(k) for k in fields}
    if len(counts) != 1:
        return None
    (count,) = counts
    return count if isinstance(count, int) and not isinstance(count, bool) else None


def downstream(stage: str, cfg=None) -> tuple[str, ...]:
    """The stages trained from `stage`'s result under the configuration `cfg` (default:
    `PipelineConfig()`): every registered stage whose prerequisites on the built-in task
    (`Stage.prerequisites`, from its `needs`) include it."""
    from ._pipeline_config import PipelineConfig
    from ._registry import stages

    cfg = PipelineConfig() if cfg is None else cfg
    return tuple(s.name for s in stages() if s.name != stage and stage in s.prerequisites(cfg))


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_changes(old: dict, new: dict) -> list[tuple[str, object, object]]:
    """The `(field, old, new)` of every dotted field that differs between two config
    dicts (`config_to_dict`), sorted by field."""
    a, b = _flatten(old), _flatten(new)
    missing = object()
    changed = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k, missing), b.get(k, missing)
        if va != vb:
            changed.append((k, None if va is missing else va, None if vb is missing else vb))
    return changed


def _added_since(old: dict, new: dict) -> set[str]:
    """The dotted fields `new` (a whole `PipelineConfig`'s dict) has and `old` lacks that
    hold their class defaults: settings added to the library after `old` was written,
    which the run that wrote it had as those defaults."""
    from ._config_io import config_to_dict
    from ._pipeline_config import PipelineConfig

    stored = _flatten(old)
    lacking = {k: v for k, v in _flatten(new).items() if k not in stored}
    if not lacking:
        return set()
    defaults = _flatten(config_to_dict(PipelineConfig()))
    missing = object()
    return {k for k, v in lacking.items() if defaults.get(k, missing) == v}


def _same_path(a: object, b: object) -> bool:
    """Whether `a` and `b` are two spellings (relative, absolute, through a link) of one
    existing file or directory."""
    if not (isinstance(a, str) and isinstance(b, str) and a and b):
        return False
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


def check_resumable(old: dict, new: dict, *, where: str) -> list[tuple[str, object, object]]:
    """Refuse (`RunDirError`) a resume whose configuration differs from the stored one
    `old` outside `resumable_fields()` and `iteration_fields()`, naming every such field
    with both values; returns all the changes (the allowed ones included). A field the
    stored configuration lacks (one added to the library since) is no change while it
    holds its default, nor is a path written another way that names the same file or
    directory from here (`data.path=pairs.jsonl` then `/home/me/pairs.jsonl`)."""
    added = _added_since(old, new)
    changes = [
        c for c in config_changes(old, new) if c[0] not in added and not _same_path(c[1], c[2])
    ]
    counts = iteration_fields()
    resumable = resumable_fields()
    bad = [c for c in changes if c[0] not in resumable and c[0] not in counts]
    if bad:
        lines = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in bad)
        raise RunDirError(
            f"{where}: cannot resume with a different configuration ({lines}). Only "
            f"iteration counts ({', '.join(_running(counts, new))}) and "
            f"{', '.join(_running(resumable, new))} may change on resume; start a new run "
            "(another --out, or --overwrite) to train with other settings"
        )
    return changes


def _running(fields, new: dict) -> list[str]:
    """`fields` (dotted) but those of the sections of registered stages that the
    configuration `new` does not run (its `stages`, and SFT on the built-in task): what a
    refused resume names as changeable. All of them when a stage is not registered."""
    from ._registry import find_stage, stages

    names = new.get("stages")
    if not isinstance(names, list):
        return list(fields)
    if (new.get("data") or {}).get("path") is None:
        names = ["sft", *names]
    found = [find_stage(n) if isinstance(n, str) else None for n in names]
    if None in found:
        return list(fields)
    keys = {st.key for st in found}
    others = {st.key for st in stages()} - keys
    return [f for f in fields if f.split(".")[0] not in others]


def _stored_config(run_dir: str):
    """The run's stored configuration (`config.json`), or `None` when it cannot be read
    with the stages registered now."""
    from ._config import ConfigError
    from ._config_io import config_from_dict
    from ._pipeline_config import PipelineConfig

    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            return config_from_dict(PipelineConfig, json.load(f))
    except (OSError, ValueError, ConfigError):
        return None


def check_upstream_counts(run_dir: str, changes, stages_with_checkpoints) -> None:
    """Refuse a changed iteration count of a stage whose later stages (`downstream`, under
    the run's stored configuration) already have checkpoints
    (`stages_with_checkpoints(run_dir)`) built on it."""
    have = set(stages_with_checkpoints(run_dir))
    counts = iteration_fields()
    stored = _stored_config(run_dir) if any(k in counts for k, _, _ in changes) else None
    for k, a, b in changes:
        for stage in counts.get(k, ()):
            later = [s for s in downstream(stage, stored) if s in have]
            if later:
                raise RunDirError(
                    f"{run_dir}: {k} changed {a!r} -> {b!r}, but {', '.join(later)} already "
                    f"trained from the {stage} result of the stored configuration; start a "
                    "new run to change it"
                )
