"""The stage registry: each stage of the pipeline and the command line, registered once.

A `Stage` names its settings (a frozen dataclass, the `--set <section>.FIELD` paths), how
it runs on the built-in task (`builtin`) and on a data file (`data`), which stages must
run before it on the built-in task (`needs`), the config sections its `--help` lists,
the rules it adds across sections (`check_run`), its values on the built-in task
(`task`), what of its section may change on resume (`resumable`) and the plot panels of
its metrics. The pipeline (`run_pipeline`, `run_on_data`), `PipelineConfig` (one section
per stage), the CLI (commands, `--help`, prerequisites, the result line), validation and
resume read the registry, so adding an algorithm is one module: its settings, its run,
its stage functions and one `register_stage` call (each `_*_stage.py` module is one;
docs/pipelines.md, "Adding an algorithm", works one through):

```python
@dataclasses.dataclass(frozen=True)
class ToyConfig(pl.SFTConfig):
    scale: float = 1.0

def toy(env: pl.StageEnv, cfg: ToyConfig) -> pl.Outcome:
    res = pl.runs.run_sft(env.policies["sft"], env.tok, records, cfg=cfg, ctx=env.ctx("toy"))
    return pl.Outcome(res, policy=pl.runs.final_policy(res.state.model))

pl.register_stage(pl.Stage("toy", ToyConfig, builtin=toy, help="SFT, scaled"))
# rlhf_eqx toy --set toy.scale=2
```
"""

import dataclasses
import difflib
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jaxtyping import PRNGKeyArray

from ._config import (
    ConfigError,
)
from ._rollout import sample_rollout, sampling_options


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a stage returns: its `RunResult`; the trained `policy` when it trains one (the
    pipeline then evaluates it on the held-out prompts and exports it); otherwise the
    entries it adds to the run's `summary` (e.g. the reward model's accuracies);
    `reward`: a reward source for the stages after it (the reward model); `adapted`: the
    trained model before LoRA merging, exported beside the policy (default: the run's
    `result.state.model`)."""

    result: Any
    policy: Any = None
    summary: Mapping[str, Any] | None = None
    reward: Any = None
    adapted: Any = None


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage, registered once (see the module docstring).

    - `name`: the command and the entry of `stages` (`"online-dpo"`).
    - `config`: its settings' class (a frozen dataclass); `section` (default: `name`)
      is the `PipelineConfig` section holding them and the `--set` prefix.
    - `builtin(env, cfg) -> Outcome`: the stage on the built-in task (`None`: data files
      only); `data(env, cfg) -> Outcome`: on `data.path` (`None`: built-in task only).
    - `needs(cfg) -> stages`: the stages that run before it on the built-in task, itself
      last (default: `("sft", name)`).
    - `help`: one line for the command list; `sections`: further config sections its
      `--help` lists (default: `sft`, the policy it starts from on the built-in task);
      `panels`: extra plot panels `{title: metric names}`.
    - `summary_key`: where its summary entry goes (default: `name`); `trains_policy`:
      whether it trains a policy (a distillation teacher, evaluated and exported).
    - `check_run(pipeline_cfg, run)`: the rules that combine its settings with other
      sections when it runs (`run`: the stages of the run). The rules of its own
      settings are its config's: `__post_init__` (when built) and a method
      `check(self, name, *, device_count)` that `validate_stage` and `validate_config`
      call with the section name as the field prefix, after the fields every batch or
      rollout stage shares (a subclass inherits them: `MultiturnConfig` is checked as
      a `GRPOConfig` too).
    - `task`: its settings on the built-in task (`animal_task_config()`), over its
      config's defaults and the task's shared settings (`TASK_STAGE_SETTINGS`).
    - `resumable`: fields of its section that may change on resume (how the stage is
      run, not what it computes); its iteration counts (`steps`, `rollouts`, `rounds`)
      may always change while no later stage has trained on its result.
    - `key_stream`: how its key derives from the run's (`stage_key`): `("split", i)`,
      `jax.random.split(key, 8)[i]`, or `("fold", i)`, `fold_in(key, i)`; `None`: a
      `fold_in` of a number derived from its name.
    """

    name: str
    config: type
    builtin: Callable[..., Outcome] | None = None
    data: Callable[..., Outcome] | None = None
    needs: Callable[[Any], tuple[str, ...]] | None = None
    help: str = ""
    section: str = ""
    sections: tuple[str, ...] = ("sft",)
    panels: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    summary_key: str = ""
    trains_policy: bool = True
    check_run: Callable[..., None] | None = None
    task: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    resumable: tuple[str, ...] = ()
    key_stream: tuple[str, int] | None = None

    def __post_init__(self):
        for what, name in (("name", self.name), ("section", self.section)):
            if name == "" and what == "section":
                continue
            if not name[:1].isalpha() or not all(c.isalnum() or c in "-_" for c in name):
                raise ValueError(
                    f"stage {what} {name!r}: a letter, then letters, digits, - and _ only"
                )
        if not (isinstance(self.config, type) and dataclasses.is_dataclass(self.config)):
            raise TypeError(
                f"stage {self.name!r}: config must be a dataclass class, got {self.config!r}"
            )
        if not self.config.__dataclass_params__.frozen:  # type: ignore[attr-defined]
            raise TypeError(
                f"stage {self.name!r}: config {self.config.__name__} must be a frozen dataclass "
                "(@dataclasses.dataclass(frozen=True))"
            )
        if self.builtin is None and self.data is None:
            raise ValueError(f"stage {self.name!r}: give builtin=, data= or both")
        for what in ("builtin", "data", "needs", "check_run"):
            fn = getattr(self, what)
            if fn is not None and not callable(fn):
                raise TypeError(f"stage {self.name!r}: {what} must be a function, got {fn!r}")
        fields = {f.name for f in dataclasses.fields(self.config)}
        unknown = sorted(set(self.task) - fields)
        if unknown:
            raise ValueError(
                f"stage {self.name!r}: task values {unknown} are not fields of "
                f"{self.config.__name__}"
            )
        kind, i = (*self.key_stream, None)[:2] if self.key_stream is not None else ("fold", 0)
        if not isinstance(i, int) or not (kind == "fold" or (kind == "split" and 0 <= i < 8)):
            raise ValueError(
                f"stage {self.name!r}: key_stream={self.key_stream!r}: expected ('split', i) "
                "with 0 <= i < 8 or ('fold', i)"
            )

    @property
    def key(self) -> str:
        """The config section (and `--set` prefix) of its settings."""
        return self.section or self.name

    def prerequisites(self, cfg) -> tuple[str, ...]:
        """The stages the built-in task runs for this command, itself last (`needs(cfg)`
        that is not a sequence of stage names ending with this stage's is a
        `ConfigError`)."""
        if self.needs is None:
            return ("sft", self.name)
        got = self.needs(cfg)
        run = tuple(got) if isinstance(got, (tuple, list)) else ()
        if not run or run[-1] != self.name or not all(isinstance(s, str) for s in run):
            raise ConfigError(
                f"stage {self.name!r}: needs(cfg) returned {got!r}; expected the stages "
                f"that run on the built-in task, {self.name!r} last"
            )
        return run


_REGISTRY: dict[str, Stage] = {}


# The command line's other commands: a stage of that name could not be run.
_COMMANDS = ("pipeline", "sample", "eval", "plot", "sweep", "serve")


def register_stage(stage: Stage, *, replace: bool = False) -> Stage:
    """Add `stage` to the registry (in order: the pipeline runs stages in registration
    order). Refused (`ValueError`, naming the stage), leaving the registry as it was: a
    name already taken (unless `replace`) or another command's (`pipeline`, `sample`,
    ...); a section that is a field of `PipelineConfig` (`model`, `ops`, ...) or that
    another stage holds with another settings class; `sections` that are neither
    `PipelineConfig`'s nor a stage's registered before it; settings that cannot be built
    at their defaults or at the built-in task's values (`task_section`); `resumable`
    entries that are not fields of the settings; a `needs` whose stages on the built-in
    task do not end with the stage itself."""
    if stage.name in _REGISTRY and not replace:
        raise ValueError(f"stage {stage.name!r} is already registered (replace=True replaces it)")
    if stage.name in _COMMANDS:
        raise ValueError(f"stage {stage.name!r}: the name of another command; choose another")
    from ._pipeline_config import PipelineConfig

    shared = {f.name for f in dataclasses.fields(PipelineConfig)}
    if stage.key in shared:
        raise ValueError(
            f"stage {stage.name!r}: its section {stage.key!r} is a field of PipelineConfig; "
            "choose another name (or section=)"
        )
    for other in _REGISTRY.values():
        if other.name != stage.name and other.key == stage.key and other.config is not stage.config:
            raise ValueError(
                f"stage {stage.name!r}: section {stage.key!r} holds {other.config.__name__} "
                f"(stage {other.name!r}); a stage that shares it takes the same settings class"
            )
    known = shared | {st.key for st in _REGISTRY.values()} | {stage.key}
    unknown = [s for s in stage.sections if s not in known]
    if unknown:
        raise ValueError(
            f"stage {stage.name!r}: sections {unknown} are neither PipelineConfig's nor a "
            "registered stage's"
        )
    previous = _REGISTRY.get(stage.name)
    _REGISTRY[stage.name] = stage
    try:
        _check_settings(stage)
    except BaseException:
        if previous is None:
            del _REGISTRY[stage.name]
        else:
            _REGISTRY[stage.name] = previous
        raise
    return stage


def _check_settings(stage: Stage) -> None:
    """Refuse a registered stage's settings class that cannot be built at its defaults or
    at the built-in task's values, or `resumable` entries that are not its fields."""
    from ._pipeline_config import task_section

    name = stage.config.__name__
    try:
        stage.config()
        cfg = task_section(stage.key)
    except (TypeError, ValueError) as e:
        raise ValueError(f"stage {stage.name!r}: its settings {name} cannot be built: {e}") from e
    if stage.needs is not None and stage.builtin is not None:
        from ._pipeline_config import animal_task_config

        stage.prerequisites(animal_task_config())  # a `ConfigError` (a `ValueError`)
    for path in stage.resumable:
        obj = cfg
        for part in path.split("."):
            if obj is None:  # an optional group of fields, unset by default
                break
            if not dataclasses.is_dataclass(obj) or part not in _field_names(obj):
                raise ValueError(
                    f"stage {stage.name!r}: resumable {path!r} is not a field of {name}"
                )
            obj = getattr(obj, part)
        if dataclasses.is_dataclass(obj):
            each = ", ".join(f"{path}.{f}" for f in _field_names(obj))
            raise ValueError(
                f"stage {stage.name!r}: resumable {path!r} is a group: name its fields ({each})"
            )


def _field_names(obj: Any) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(obj))


def unregister_stage(name: str) -> None:
    """Remove a stage (e.g. one a test registered)."""
    _REGISTRY.pop(name, None)


def stages() -> tuple[Stage, ...]:
    """Every registered stage, in pipeline order."""
    return tuple(_REGISTRY.values())


def stage_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get_stage(name: str) -> Stage:
    """The stage `name`; `ConfigError` listing the registered ones otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        close = difflib.get_close_matches(str(name), list(_REGISTRY), n=2)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        raise ConfigError(f"unknown stage {name!r}{hint} (known: {', '.join(_REGISTRY)})") from None


def find_stage(name: str) -> Stage | None:
    """The stage `name`, or `None` when none is registered under it."""
    return _REGISTRY.get(name)


def stage_config(cfg, stage: Stage):
    """The settings of `stage` in the pipeline configuration `cfg`."""
    return getattr(cfg, stage.key)


def section_types() -> dict[str, type]:
    """`{section: settings class}` of the registered stages, in registration order (two
    stages may share a section: `online-dpo` reads `dpo`)."""
    return {st.key: st.config for st in _REGISTRY.values()}


def section_stages(key: str) -> tuple[Stage, ...]:
    """The registered stages whose settings are the section `key`."""
    return tuple(st for st in _REGISTRY.values() if st.key == key)


# --- what a stage gets -------------------------------------------------------------------


@dataclasses.dataclass
class StageEnv:
    """What a stage function gets: the configuration, the base model and tokenizer, the
    run directory, the policies of the stages already run (`policies["sft"]`), the
    reward source of the reward stage (`reward`), the noisy labeller of the built-in
    task, keys, `ctx(stage)` for its `RunContext` (checkpoints, metrics, periodic
    evaluation), `stage`, the name of the stage running, and `callbacks`, the run's
    `Callback`s (every `ctx(stage)` carries them)."""

    cfg: Any
    base: Any
    tok: Any
    tok_file: str | None
    run_dir: str
    resume: bool
    say: Callable[..., None]
    key: PRNGKeyArray
    make_ctx: Callable[..., Any]
    label: Callable | None = None
    policies: dict = dataclasses.field(default_factory=dict)
    reward: Any = None
    summary: dict = dataclasses.field(default_factory=dict)
    stage: str = ""
    callbacks: tuple = ()

    def ctx(self, stage: str, *, periodic: bool = True):
        """The `RunContext` of `stage` (its key, checkpoint directory, metrics log)."""
        return self.make_ctx(stage, periodic=periodic)

    def data_key(self, salt: int) -> PRNGKeyArray:
        """A key for the stage's own sampling (`fold_in` of the run's data key)."""
        return jax.random.fold_in(_data_key(self.key), salt)

    def checkpoint_dir(self, stage: str) -> str:
        return os.path.join(self.run_dir, stage, "checkpoints")

    def sample(self, policy, prompts, salt: int, group_size: int):
        """`group_size` completions of each of `prompts` from `policy` with the run's
        sampling settings (`sampling.*`) and the stage's key `data_key(salt)`."""
        return sample_rollout(
            policy,
            self.tok,
            prompts,
            self.data_key(salt),
            group_size=group_size,
            **sampling_options(self.cfg.sampling),
        )


def _data_key(key: jax.Array) -> jax.Array:
    return jax.random.split(key, 8)[6]


def stage_key(key: jax.Array, name: str) -> jax.Array:
    """The key of stage `name` under the run's key, from its `Stage.key_stream`, so that
    every stage draws the same numbers whichever stages run (a stage without one, or not
    registered, folds in a number derived from its name)."""
    st = _REGISTRY.get(name)
    if st is not None and st.key_stream is not None:
        kind, i = st.key_stream
        return jax.random.split(key, 8)[i] if kind == "split" else jax.random.fold_in(key, i)
    return jax.random.fold_in(key, 1000 + sum(ord(c) * 31**i for i, c in enumerate(name)) % 10**6)
