"""Whole training runs above `rlhf_eqx.train`: typed configs, rollouts, checkpoints with
exact resume, the KL guard, divergence rollback, evaluation, metrics and plots, and the
built-in pipeline (`python -m rlhf_eqx`). See `docs/pipelines.md`."""

from ._config import (
    ConfigError as ConfigError,
)
from ._config import (
    DataConfig as DataConfig,
)
from ._config import (
    DPOConfig as DPOConfig,
)
from ._config import (
    GRPOConfig as GRPOConfig,
)
from ._config import (
    LoRASettings as LoRASettings,
)
from ._config import (
    ModelConfig as ModelConfig,
)
from ._config import (
    OpsConfig as OpsConfig,
)
from ._config import (
    OptimConfig as OptimConfig,
)
from ._config import (
    PipelineConfig as PipelineConfig,
)
from ._config import (
    PPOConfig as PPOConfig,
)
from ._config import (
    RewardConfig as RewardConfig,
)
from ._config import (
    SamplingConfig as SamplingConfig,
)
from ._config import (
    SFTConfig as SFTConfig,
)
from ._config import (
    animal_task_config as animal_task_config,
)
from ._config import (
    apply_overrides as apply_overrides,
)
from ._config import (
    config_from_dict as config_from_dict,
)
from ._config import (
    config_to_dict as config_to_dict,
)
from ._config import (
    load_config as load_config,
)
from ._config import (
    validate_config as validate_config,
)
from ._data_runs import quality_report as quality_report
from ._data_runs import run_on_data as run_on_data
from ._evaluate import (
    completion_nll as completion_nll,
)
from ._evaluate import (
    evaluate_policy as evaluate_policy,
)
from ._evaluate import (
    reward_accuracy as reward_accuracy,
)
from ._evaluate import (
    win_rate as win_rate,
)
from ._ops import (
    LoopResult as LoopResult,
)
from ._ops import (
    MetricsLog as MetricsLog,
)
from ._ops import (
    build_optimizer as build_optimizer,
)
from ._ops import (
    get_lr_scale as get_lr_scale,
)
from ._ops import (
    latest_checkpoint as latest_checkpoint,
)
from ._ops import (
    restore_checkpoint as restore_checkpoint,
)
from ._ops import (
    run_iterations as run_iterations,
)
from ._ops import (
    save_checkpoint as save_checkpoint,
)
from ._ops import (
    scale_by_lr_factor as scale_by_lr_factor,
)
from ._ops import (
    set_lr_scale as set_lr_scale,
)
from ._pipeline import format_table as format_table
from ._pipeline import load_model as load_model
from ._pipeline import run_pipeline as run_pipeline
from ._plots import plot_run as plot_run
from ._plots import read_metrics as read_metrics
from ._rollout import (
    RewardFunction as RewardFunction,
)
from ._rollout import (
    Rollout as Rollout,
)
from ._rollout import (
    group_signal as group_signal,
)
from ._rollout import (
    reward_model_scores as reward_model_scores,
)
from ._rollout import (
    sample_rollout as sample_rollout,
)
from ._rollout import (
    score_rollout as score_rollout,
)
from ._rollout import (
    token_logps as token_logps,
)
from ._runs import (
    RunContext as RunContext,
)
from ._runs import (
    RunResult as RunResult,
)
from ._runs import (
    best_worst_pairs as best_worst_pairs,
)
from ._runs import (
    export_policy as export_policy,
)
from ._runs import (
    final_policy as final_policy,
)
from ._runs import (
    has_lora as has_lora,
)
from ._runs import (
    rows_at as rows_at,
)
from ._runs import (
    run_dpo as run_dpo,
)
from ._runs import (
    run_grpo as run_grpo,
)
from ._runs import (
    run_online_dpo as run_online_dpo,
)
from ._runs import (
    run_ppo as run_ppo,
)
from ._runs import (
    run_reward as run_reward,
)
from ._runs import (
    run_sft as run_sft,
)
from ._runs import (
    with_lora as with_lora,
)
from ._task import (
    ANIMALS as ANIMALS,
)
from ._task import (
    HELDOUT_PROMPTS as HELDOUT_PROMPTS,
)
from ._task import (
    TRAIN_PROMPTS as TRAIN_PROMPTS,
)
from ._task import (
    animal_score as animal_score,
)
from ._task import (
    noisy_scores as noisy_scores,
)
