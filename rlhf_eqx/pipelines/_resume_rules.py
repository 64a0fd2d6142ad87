"""What may change when a run resumes: operations settings and iteration counts, never what
a stage trains on or how; a count only while no later stage has trained on its result."""


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked (held by another run, holds another
    run, or the resumed run's configuration differs); the message says what to do."""


# Fields that may differ between a run and its resumption: how the run is operated,
# logged and evaluated, never what it trains on or how.
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
    "ops.max_rollbacks",
    "ops.compilation_cache",  # where compiled programs are kept, not what they compute
    "ops.compilation_cache_max_mb",
    "grpo.overlap",  # when and where the next rollout is sampled, not what it is
    "grpo.sampler_device",
)

# A stage's iteration count (more steps, more rollouts) may change on resume. The
# learning-rate schedule is rebuilt for the new total, so a resumed run with another
# count is not the run it would have been with that count from the start.
ITERATION_FIELDS: dict[str, str] = {
    "sft.steps": "sft",
    "reward.steps": "reward",
    "dpo.steps": "dpo",
    "dpo.rounds": "dpo",
    "ppo.rollouts": "ppo",
    "grpo.rollouts": "grpo",
    "kto.steps": "kto",
    "distill.steps": "distill",
}

# Stages trained from another stage's result (every stage starts from SFT; PPO and
# online DPO use the reward model).
_DOWNSTREAM: dict[str, tuple[str, ...]] = {
    "sft": ("reward", "ppo", "dpo", "grpo", "online-dpo", "kto", "distill"),
    "reward": ("ppo", "online-dpo"),
    "dpo": ("online-dpo", "distill"),
    "grpo": ("distill",),
    "ppo": ("distill",),
    "kto": ("distill",),
}


def iteration_fields() -> dict[str, str]:
    """`ITERATION_FIELDS` and, for a stage registered outside them, the `steps`,
    `rollouts` and `rounds` fields of its settings: `{dotted field: stage}`."""
    from ._registry import stages

    out = dict(ITERATION_FIELDS)
    known = set(ITERATION_FIELDS.values())
    for st in stages():
        if st.key in known:
            continue
        for name in ("steps", "rollouts", "rounds"):
            if hasattr(st.config, name):
                out[f"{st.key}.{name}"] = st.name
    return out


def downstream(stage: str) -> tuple[str, ...]:
    """The stages trained from `stage`'s result: `_DOWNSTREAM`, and every registered stage
    whose prerequisites include it."""
    from ._pipeline_config import (
        PipelineConfig,
    )
    from ._registry import stages

    cfg = PipelineConfig()
    later = [s.name for s in stages() if s.name != stage and stage in s.prerequisites(cfg)]
    return tuple(dict.fromkeys((*_DOWNSTREAM.get(stage, ()), *later)))


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


def check_resumable(old: dict, new: dict, *, where: str) -> list[tuple[str, object, object]]:
    """Refuse (`RunDirError`) a resume whose configuration differs from the stored one
    `old` outside `RESUMABLE_FIELDS` and `ITERATION_FIELDS`, naming every such field
    with both values; returns all the changes (the allowed ones included)."""
    changes = config_changes(old, new)
    counts = iteration_fields()
    bad = [c for c in changes if c[0] not in RESUMABLE_FIELDS and c[0] not in counts]
    if bad:
        lines = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in bad)
        raise RunDirError(
            f"{where}: cannot resume with a different configuration ({lines}). Only "
            f"iteration counts ({', '.join(counts)}) and "
            f"{', '.join(RESUMABLE_FIELDS)} may change on resume; start a new run "
            "(another --out, or --overwrite) to train with other settings"
        )
    return changes


def check_upstream_counts(run_dir: str, changes, stages_with_checkpoints) -> None:
    """Refuse a changed iteration count of a stage whose later stages (`downstream`)
    already have checkpoints (`stages_with_checkpoints(run_dir)`) built on it."""
    have = set(stages_with_checkpoints(run_dir))
    for k, a, b in changes:
        stage = iteration_fields().get(k)
        if stage is None:
            continue
        later = [s for s in downstream(stage) if s in have]
        if later:
            raise RunDirError(
                f"{run_dir}: {k} changed {a!r} -> {b!r}, but {', '.join(later)} already "
                f"trained from the {stage} result of the stored configuration; start a new "
                "run to change it"
            )
