"""Whole training runs above `rlhf_eqx.train`: the pipeline (`run_pipeline`, the built-in
task of `python -m rlhf_eqx`; `run_on_data`, one stage on a data file), its
configuration (`PipelineConfig`: the shared sections and one section for each registered
stage; files, overrides, validation), the stages' settings, and the stage registry
(`Stage`, `register_stage`). The pieces live in public submodules: `runs` (each
algorithm's run, rollouts, reward sources, evaluation, exports), `config` (the registry's
queries, `--help`, single-section checks), `tools` (models, sampling and evaluation
commands, seeds, plots, checkpoints, the run directory), `loop` (the iteration loop for
runs of one's own) and `task` (the built-in task). See `docs/pipelines.md`."""

# Each stage registers itself when its module is imported: here, in pipeline order.
# isort: off
from . import _sft_stage, _reward_stage, _ppo_stage, _dpo_stage, _grpo_stage  # noqa: F401
from . import _kto_stage, _distill_stage, _multiturn_stage, _multiturn_dpo_stage  # noqa: F401
from . import _prm_stage  # noqa: F401

# isort: on
from . import (
    config as config,
    loop as loop,
    runs as runs,
    task as task,
    tools as tools,
    trackers as trackers,
)
from ._callbacks import Callback as Callback
from ._config import (
    ConfigError as ConfigError,
    DataConfig as DataConfig,
    LoRASettings as LoRASettings,
    ModelConfig as ModelConfig,
    OpsConfig as OpsConfig,
    SamplingConfig as SamplingConfig,
)
from ._config_io import apply_overrides as apply_overrides, load_config as load_config
from ._data_runs import run_on_data as run_on_data
from ._distill_stage import DistillConfig as DistillConfig
from ._dpo_stage import DPOConfig as DPOConfig
from ._grpo_stage import GRPOConfig as GRPOConfig
from ._kto_stage import KTOConfig as KTOConfig
from ._multiturn_dpo_stage import MultiturnDPOConfig as MultiturnDPOConfig
from ._multiturn_stage import MultiturnConfig as MultiturnConfig
from ._pipeline import model_path as model_path, run_pipeline as run_pipeline
from ._pipeline_config import (
    JudgeConfig as JudgeConfig,
    PipelineConfig as PipelineConfig,
    animal_task_config as animal_task_config,
)
from ._ppo_stage import PPOConfig as PPOConfig
from ._prm_stage import PRMConfig as PRMConfig
from ._registry import (
    Outcome as Outcome,
    Stage as Stage,
    StageEnv as StageEnv,
    register_stage as register_stage,
)
from ._reward_stage import RewardConfig as RewardConfig
from ._runs import RunContext as RunContext
from ._sampled_eval import sampled_comparison as sampled_comparison
from ._sft_stage import SFTConfig as SFTConfig
from ._sweep import SweepResult as SweepResult, sweep as sweep
