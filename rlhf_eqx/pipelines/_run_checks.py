"""The checks of the stages a run executes (`validate_config`): each stage known and
runnable where it runs, its prerequisites present, its settings valid (the fields every
batch or rollout stage shares, then the settings' own `check`), and the rules across
stages and sections (a batch's length above the prompt's, the reward source and the
judge's verdict tokens, then each running stage's `Stage.check_run`) checked before any
stage runs."""

from typing import Any

from ._config import BatchStageConfig, RolloutStageConfig
from ._field_checks import _fail, check_shared_fields, check_unused
from ._model_checks import check_judge
from ._registry import find_stage, stage_names, stages


def check_section(name: str, c: Any, *, device_count: int = 1) -> None:
    """Check the settings `c` of the stage section `name` (see `validate_stage`): unused
    settings at their defaults, the shared batch / rollout fields, then the settings'
    own rules (their `check(name, device_count=...)` method, where they have one)."""
    check_unused(name, c)
    check_shared_fields(name, c, device_count)
    own = getattr(c, "check", None)
    if callable(own):
        own(name, device_count=device_count)


def run_stages(cfg: Any, stage: str | None = None) -> tuple[str, ...]:
    """The stages a run of `cfg` executes, in order: `stage` alone when given (a
    single-stage run on a data file, `run_on_data`), else `cfg.stages`, with SFT first on
    the built-in task (the other stages start from it)."""
    if stage is not None:
        return (stage,)
    if cfg.data.path is None:
        return tuple(dict.fromkeys(("sft", *cfg.stages)))
    return tuple(cfg.stages)


def _unused(c: Any) -> tuple[str, ...]:
    return getattr(type(c), "unused_fields", ())


def _check_stages(cfg: Any, run: tuple[str, ...]) -> None:
    names = stage_names()
    for st in run:
        if st not in names:
            _fail("stages", cfg.stages, f"unknown stage {st!r} (known: {', '.join(names)})")
        if cfg.data.path is None and find_stage(st).builtin is None:
            _fail("stages", cfg.stages, f"{st} runs on a data file only (data.path)")


def _check_prerequisites(cfg: Any, run: tuple[str, ...]) -> None:
    if cfg.data.path is None:  # the built-in task runs each stage's prerequisites first
        for st in run:
            missing = [p for p in find_stage(st).prerequisites(cfg) if p not in run]
            if missing:
                _fail("stages", cfg.stages, f"{st} needs the {missing[0]} stage")


def _check_rewards(cfg: Any, key: str, c: Any, run: tuple[str, ...]) -> bool:
    """The reward source of a rollout stage; whether it is the judge."""
    if not isinstance(c, RolloutStageConfig) or "reward_source" in _unused(c):
        return False
    if c.reward_source == "judge":
        return True
    if c.reward_model:
        return False
    if c.reward_source == "reward_model" and "reward" not in run and cfg.data.path is None:
        _fail(
            "stages",
            cfg.stages,
            f"{key} with {key}.reward_source=reward_model needs the "
            f"reward stage (or {key}.reward_model=DIR)",
        )
    if c.reward_source == "prm":
        _fail(
            f"{key}.reward_model",
            "",
            "reward_source=prm needs the directory of a "
            "process reward model (rlhf_eqx prm writes <run>/prm/hf)",
        )
    return False


def validate_run(cfg: Any, run: tuple[str, ...], *, device_count: int = 1) -> None:
    """Check the stages `run` of `cfg` (see `run_stages`): each registered stage's own
    fields (`validate_stage`), then what the stages that run combine with other sections
    (a batch above the prompt length, the reward source and the judge, each stage's
    `check_run`: the teacher, a multi-turn episode's length); `ConfigError` naming the
    first bad field."""
    from ._validation import validate_judge

    _check_stages(cfg, run)
    for key in dict.fromkeys(st.key for st in stages()):  # every section's own fields
        check_section(key, getattr(cfg, key), device_count=device_count)
    s = cfg.sampling
    keys = tuple(dict.fromkeys(find_stage(st).key for st in run))
    uses_judge = False
    for key in keys:  # what the stages that run combine with other sections
        c = getattr(cfg, key)
        if isinstance(c, BatchStageConfig) and "max_length" not in _unused(c):
            if c.max_length <= s.prompt_length:
                _fail(
                    f"{key}.max_length",
                    c.max_length,
                    f"must exceed sampling.prompt_length={s.prompt_length}",
                )
        uses_judge |= _check_rewards(cfg, key, c, run)
    _check_prerequisites(cfg, run)
    for name in run:  # each running stage's rules with other sections
        st = find_stage(name)
        if st.check_run is not None:
            st.check_run(cfg, run)
    if uses_judge:
        validate_judge(cfg.judge)
        if cfg.data.path is not None and cfg.judge.model == "sft":
            why = "on a data file the judge is base or a checkpoint directory"
            _fail("judge.model", "sft", why)
        check_judge(cfg, cfg.judge)
