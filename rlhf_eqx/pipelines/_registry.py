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
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax

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
        if not self.name or not all(c.isalnum() or c in "-_" for c in self.name):
            raise ValueError(f"stage name {self.name!r}: letters, digits, - and _ only")
        if not dataclasses.is_dataclass(self.config):
            raise TypeError(f"stage {self.name!r}: config must be a dataclass, got {self.config}")
        if self.builtin is None and self.data is None:
            raise ValueError(f"stage {self.name!r}: give builtin=, data= or both")

    @property
    def key(self) -> str:
        """The config section (and `--set` prefix) of its settings."""
        return self.section or self.name

    def prerequisites(self, cfg) -> tuple[str, ...]:
        """The stages the built-in task runs for this command, itself last."""
        return tuple(self.needs(cfg)) if self.needs is not None else ("sft", self.name)


_REGISTRY: dict[str, Stage] = {}


def register_stage(stage: Stage, *, replace: bool = False) -> Stage:
    """Add `stage` to the registry (in order: the pipeline runs stages in registration
    order). A name already taken is an error unless `replace`."""
    if stage.name in _REGISTRY and not replace:
        raise ValueError(f"stage {stage.name!r} is already registered (replace=True replaces it)")
    _REGISTRY[stage.name] = stage
    return stage


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
        raise ConfigError(f"unknown stage {name!r} (known: {', '.join(_REGISTRY)})") from None


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
    key: jax.Array
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

    def data_key(self, salt: int) -> jax.Array:
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
