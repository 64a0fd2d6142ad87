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


_ABSENT = object()  # a field one of two config dicts does not have


def _changes(old: dict, new: dict) -> list[tuple[str, object, object]]:
    """The `(field, old, new)` of every dotted field that differs, `_ABSENT` for a side
    that lacks it."""
    a, b = _flatten(old), _flatten(new)
    changed = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k, _ABSENT), b.get(k, _ABSENT)
        if va != vb:
            changed.append((k, va, vb))
    return changed


def config_changes(old: dict, new: dict) -> list[tuple[str, object, object]]:
    """The `(field, old, new)` of every dotted field that differs between two config
    dicts (`config_to_dict`), sorted by field (`None` for a side that lacks it)."""
    return [(k, _none(a), _none(b)) for k, a, b in _changes(old, new)]


def _none(value: object) -> object:
    return None if value is _ABSENT else value


def _show(value: object, other: object) -> str:
    """A changed value as a refusal names it: its `repr`; a side that lacks the field
    as `None`, or, where the other side is `None` too, as what it is."""
    if value is not _ABSENT:
        return repr(value)
    return "(not in the stored config)" if other is None else "None"


def _dataclass_type(hint: object) -> type | None:
    """The dataclass a field's type hint names (alone or in a union), else `None`."""
    import typing

    for t in (hint, *typing.get_args(hint)):
        if isinstance(t, type) and dataclasses.is_dataclass(t):
            return t
    return None


def _is_setting(dotted: str) -> bool:
    """Whether the dotted name is a setting of this version's `PipelineConfig` (or lies
    within the value of one: a key of `data.columns`)."""
    from ._config_io import _hints, _settings_of
    from ._pipeline_config import PipelineConfig
    from ._registry import section_types

    sections = section_types()
    cls: type = PipelineConfig
    for part in dotted.split("."):
        if cls is PipelineConfig and part in sections:
            cls = sections[part]
            continue
        names = {f.name for f in _settings_of(cls)} - (
            {"sections"} if cls is PipelineConfig else set()
        )
        if part not in names:
            return False
        inner = _dataclass_type(_hints(cls)[part])
        if inner is None:
            return True  # a value (a number, a list, a mapping): what follows is in it
        cls = inner
    return True


def unused_fields(old: dict) -> list[str]:
    """The settings of the stored config dict `old` that this version of the library no
    longer has (removed since the run was written), each named once: a removed section
    as itself, not field by field. A resume does not use them, and they are no change
    (`check_resumable`)."""
    out: dict[str, None] = {}
    for k in _flatten(old):
        parts = k.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if not _is_setting(prefix):
                out[prefix] = None
                break
    return list(out)


def without_unused(d: dict) -> dict:
    """The config dict `d` (a stored `config.json`) without the settings this version no
    longer has (`unused_fields`): what `config_from_dict` reads."""
    unused = unused_fields(d)
    if not unused:
        return d
    out = json.loads(json.dumps(d))
    for dotted in unused:
        *path, last = dotted.split(".")
        node = out
        for part in path:
            node = node[part]
        del node[last]
    return out


def _under(field: str, names) -> bool:
    return any(field == n or field.startswith(n + ".") for n in names)


def _added_since(old: dict, new: dict) -> set[str]:
    """The dotted fields `new` (a whole `PipelineConfig`'s dict) has and `old` lacks that
    hold their class defaults, or that belong to a section `old` lacks altogether:
    settings added to the library after `old` was written, which the run that wrote it
    had as those defaults (a stage registered since it was written never ran in it)."""
    from ._config_io import config_to_dict
    from ._pipeline_config import PipelineConfig

    stored = _flatten(old)
    lacking = {k: v for k, v in _flatten(new).items() if k not in stored}
    if not lacking:
        return set()
    defaults = _flatten(config_to_dict(PipelineConfig()))
    missing = object()
    sections = {k for k, v in new.items() if isinstance(v, dict) and k not in old}
    return {
        k
        for k, v in lacking.items()
        if defaults.get(k, missing) == v or k.split(".")[0] in sections
    }


def _same_path(a: object, b: object) -> bool:
    """Whether `a` and `b` are two spellings (relative, absolute, through a link) of one
    existing file or directory."""
    if not (isinstance(a, str) and isinstance(b, str) and a and b):
        return False
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


# The inputs a run records the fingerprint of (`_rundir.check_data`, `check_model`):
# their config fields and the file that holds the fingerprint.
_INPUT_FIELDS = {
    "data.path": "data.json",
    "model.source": "model.json",
    "model.tokenizer": "model.json",
}


def _input_run_dir(where: str) -> str | None:
    """The run directory of `where` (a run directory, or a checkpoint of one:
    `<run>/<stage>/checkpoints/iter_*`) that records its inputs' fingerprints."""
    path = where
    for _ in range(4):
        if any(os.path.isfile(os.path.join(path, n)) for n in set(_INPUT_FIELDS.values())):
            return path
        path = os.path.dirname(os.path.normpath(path))
        if not path:
            return None
    return None


def moved_inputs(where: str, new: dict, changes) -> list[tuple[str, object, object]]:
    """The `changes` of `data.path`, `model.source` or `model.tokenizer` (one file or
    directory for another) whose contents are those the run recorded (`data.json`,
    `model.json` in the run directory of `where`: the same size and SHA-256): a data
    file or model moved or renamed, which a resume accepts. A changed path whose
    contents differ from the recorded ones is refused (`RunDirError`) naming both paths.
    A run that recorded no fingerprint, or a path that cannot be read, moves nothing
    (the change is a change of configuration)."""
    fields = {k: (a, b) for k, a, b in changes if k in _INPUT_FIELDS}
    run_dir = _input_run_dir(where) if fields else None
    if run_dir is None:
        return []
    out = []
    for name in dict.fromkeys(_INPUT_FIELDS[k] for k in fields):
        keys = [k for k in fields if _INPUT_FIELDS[k] == name]
        recorded = _json_or_none(os.path.join(run_dir, name))
        if not isinstance(recorded, dict):
            continue
        now = _fingerprint(name, new)
        if now is None:
            continue
        if (recorded.get("size"), recorded.get("sha256")) != now:
            moves = "; ".join(f"{k}: {fields[k][0]!r} -> {fields[k][1]!r}" for k in keys)
            what = "data file" if name == "data.json" else "model's files"
            raise RunDirError(
                f"{run_dir}: cannot resume: the {what} at the new path differs from the one "
                f"the run started on ({moves}; size {recorded.get('size')} -> {now[0]} "
                f"bytes, sha256 {str(recorded.get('sha256'))[:12]}... -> {now[1][:12]}..., "
                f"recorded in {name}); resume with the file the run started on, or start "
                "a new run on it (another --out, or --overwrite)"
            )
        out += [(k, *fields[k]) for k in keys]
    return out


def _json_or_none(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _fingerprint(name: str, new: dict) -> tuple[int, str] | None:
    """`(size, sha256)` of the data file (`data.json`) or the model's files
    (`model.json`) the config dict `new` names, as the run records them; `None` when
    they cannot be read."""
    from ._config import ConfigError
    from ._rundir import data_fingerprint, files_fingerprint

    try:
        if name == "data.json":
            path = (new.get("data") or {}).get("path")
            if not isinstance(path, str):
                return None
            fp = data_fingerprint(path)
            return fp["size"], fp["sha256"]
        from ._pipeline import model_files

        model = new.get("model") or {}
        files = model_files(model.get("source", "builtin"), model.get("tokenizer"))
        return files_fingerprint(files) if files else None
    except (OSError, ValueError, ConfigError):
        return None


def check_resumable(old: dict, new: dict, *, where: str) -> list[tuple[str, object, object]]:
    """Refuse (`RunDirError`) a resume whose configuration differs from the stored one
    `old` outside `resumable_fields()` and `iteration_fields()`, naming every such field
    with both values; returns all the changes (the allowed ones included). A field the
    stored configuration lacks (one added to the library since) is no change while it
    holds its default, nor is a field this version no longer has (`unused_fields`: a
    resume names them once), nor a path written another way that names the same file or
    directory from here (`data.path=pairs.jsonl` then `/home/me/pairs.jsonl`), nor a data
    file or model moved or renamed with the contents the run recorded (`moved_inputs`:
    its contents differing is refused, naming both paths)."""
    changes, moved = resume_changes(old, new, where=where)
    counts = iteration_fields()
    resumable = resumable_fields()
    bad = [c for c in changes if c[0] not in resumable and c[0] not in counts and c[0] not in moved]
    if bad:
        lines = shown_changes(bad)
        renamed = _renamed(old, new) & {k for k, _, _ in bad}
        hint = (
            f" ({', '.join(sorted(renamed))}: no longer a setting, beside one added since: "
            "renamed? resume with the version that wrote the run)"
            if renamed
            else ""
        )
        raise RunDirError(
            f"{where}: cannot resume with a different configuration ({lines}){hint}. Only "
            f"iteration counts ({', '.join(_running(counts, new))}) and "
            f"{', '.join(_running(resumable, new))} may change on resume; start a new run "
            "(another --out, or --overwrite) to train with other settings"
        )
    return [(k, _none(a), _none(b)) for k, a, b in changes]


def resume_changes(old: dict, new: dict, *, where: str) -> tuple[list, set[str]]:
    """`(changes, moved)`: the `(field, old, new)` changes (`_ABSENT` for a side that
    lacks the field) of the stored config dict `old` to `new` that a resume must weigh,
    and the fields among them that name a data file or model moved with its recorded
    contents (`moved_inputs`, which refuses one whose contents differ). Not changes: a
    field added to the library since `old` was written that holds its default, a field
    this version no longer has (`unused_fields`), a path written another way."""
    added = _added_since(old, new)
    renamed = _renamed(old, new)
    unused = [u for u in unused_fields(old) if u not in renamed]
    changes = [
        (k, a, b)
        for k, a, b in _changes(old, new)
        if k not in added and not _under(k, unused) and not _same_path(a, b)
    ]
    return changes, {k for k, _, _ in moved_inputs(where, new, changes)}


def _renamed(old: dict, new: dict) -> set[str]:
    """The settings of `old` this version no longer has (`unused_fields`) in a section
    where `new` has a setting `old` lacks: perhaps one setting under a new name
    (`optim.lr` -> `optim.learning_rate`), whose stored value the new name would not
    carry over. A resume weighs them as changes, not as settings no longer used."""
    leaves = _flatten(old)
    sections = {k.rsplit(".", 1)[0] for k in _flatten(new) if k not in leaves and "." in k}
    return {
        u
        for u in unused_fields(old)
        if u in leaves and "." in u and u.rsplit(".", 1)[0] in sections
    }


def shown_changes(changes) -> str:
    """`changes` (`resume_changes`) as a refusal names them: `field: old -> new; ...`."""
    return "; ".join(f"{k}: {_show(a, b)} -> {_show(b, a)}" for k, a, b in changes)


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
            return config_from_dict(PipelineConfig, without_unused(json.load(f)))
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
