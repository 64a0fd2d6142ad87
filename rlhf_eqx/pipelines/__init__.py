"""Whole training runs above `rlhf_eqx.train`: typed configs, rollouts, checkpoints with
exact resume, the KL guard, divergence rollback, evaluation, metrics, monitoring and
plots, and the built-in pipeline (`python -m rlhf_eqx`). See `docs/pipelines.md`."""

# Each stage registers itself when its module is imported: here, in pipeline order.
# isort: off
from . import _sft_stage, _reward_stage, _ppo_stage, _dpo_stage, _grpo_stage  # noqa: F401
from . import _kto_stage, _distill_stage, _multiturn_stage, _multiturn_dpo_stage  # noqa: F401
from . import _prm_stage  # noqa: F401

# isort: on
from . import loop as loop, task as task
from ._callbacks import (
    Callback as Callback,
    CallbackError as CallbackError,
    RunHandle as RunHandle,
    load_callback as load_callback,
)
from ._checkpoints import (
    latest_checkpoint as latest_checkpoint,
    restore_checkpoint as restore_checkpoint,
    save_checkpoint as save_checkpoint,
)
from ._config import (
    REWARD_SOURCES as REWARD_SOURCES,
    BatchStageConfig as BatchStageConfig,
    ConfigError as ConfigError,
    DataConfig as DataConfig,
    LoRASettings as LoRASettings,
    ModelConfig as ModelConfig,
    OpsConfig as OpsConfig,
    RolloutStageConfig as RolloutStageConfig,
    SamplingConfig as SamplingConfig,
)
from ._config_help import config_help as config_help, help_sections as help_sections
from ._config_io import (
    SHARED_SECTIONS as SHARED_SECTIONS,
    apply_overrides as apply_overrides,
    config_from_dict as config_from_dict,
    config_to_dict as config_to_dict,
    load_config as load_config,
    read_fields as read_fields,
)
from ._data_prep import (
    ChatRendering as ChatRendering,
    chat_rendering as chat_rendering,
    hh_messages as hh_messages,
    prompt_tokens as prompt_tokens,
    quality_report as quality_report,
    split_records as split_records,
)
from ._data_runs import data_stages as data_stages, run_on_data as run_on_data
from ._distill_stage import (
    DistillConfig as DistillConfig,
    check_same_vocabulary as check_same_vocabulary,
    distill_divergence as distill_divergence,
    load_teacher as load_teacher,
    run_distill as run_distill,
    teacher_stages as teacher_stages,
)
from ._dpo_stage import (
    DPOConfig as DPOConfig,
    best_worst_pairs as best_worst_pairs,
    packed_steps as packed_steps,
    run_dpo as run_dpo,
    run_online_dpo as run_online_dpo,
)
from ._evaluate import (
    binomial_se as binomial_se,
    completion_nll as completion_nll,
    evaluate_policy as evaluate_policy,
    prompt_se as prompt_se,
    reward_accuracy as reward_accuracy,
    win_rate as win_rate,
    win_rate_se as win_rate_se,
)
from ._grpo_stage import (
    MAX_STALENESS as MAX_STALENESS,
    GRPOConfig as GRPOConfig,
    OffPolicyState as OffPolicyState,
    run_grpo as run_grpo,
)
from ._kto_stage import (
    KTOConfig as KTOConfig,
    kto_heldout_metrics as kto_heldout_metrics,
    run_kto as run_kto,
    sampled_unpaired as sampled_unpaired,
)
from ._loop_state import (
    RunInterrupted as RunInterrupted,
)
from ._lr_scale import (
    build_optimizer as build_optimizer,
)
from ._metrics import MetricsLog as MetricsLog
from ._model_commands import (
    evaluate_model as evaluate_model,
    load_configured_model as load_configured_model,
    render_prompts as render_prompts,
    sample_model as sample_model,
)
from ._monitor import (
    device_memory as device_memory,
    measure_matmul_peak as measure_matmul_peak,
    model_flops as model_flops,
)
from ._multiturn_dpo_stage import (
    MultiturnDPOConfig as MultiturnDPOConfig,
    episode_pairs as episode_pairs,
    run_multiturn_dpo as run_multiturn_dpo,
)
from ._multiturn_stage import (
    MultiturnConfig as MultiturnConfig,
    run_multiturn as run_multiturn,
    turn_stop_ids as turn_stop_ids,
)
from ._pipeline import (
    MODEL_NAMES as MODEL_NAMES,
    format_table as format_table,
    load_model as load_model,
    model_path as model_path,
    resolve_model_names as resolve_model_names,
    run_pipeline as run_pipeline,
    tokenizer_file as tokenizer_file,
)
from ._pipeline_config import (
    TASK_STAGE_SETTINGS as TASK_STAGE_SETTINGS,
    JudgeConfig as JudgeConfig,
    PipelineConfig as PipelineConfig,
    animal_task_config as animal_task_config,
    task_section as task_section,
)
from ._plots import plot_run as plot_run, read_metrics as read_metrics, read_records as read_records
from ._ppo_stage import PPOConfig as PPOConfig, run_ppo as run_ppo
from ._prm_stage import PRMConfig as PRMConfig, run_prm as run_prm, step_accuracy as step_accuracy
from ._registry import (
    Outcome as Outcome,
    Stage as Stage,
    StageEnv as StageEnv,
    find_stage as find_stage,
    get_stage as get_stage,
    register_stage as register_stage,
    stage_names as stage_names,
    stages as stages,
    unregister_stage as unregister_stage,
)
from ._resume_rules import (
    RunDirError as RunDirError,
)
from ._reward_sources import (
    EnsembleReward as EnsembleReward,
    FunctionReward as FunctionReward,
    JudgeSource as JudgeSource,
    ModelReward as ModelReward,
    ProcessReward as ProcessReward,
    RewardSource as RewardSource,
    Scored as Scored,
    export_prm as export_prm,
    export_reward_ensemble as export_reward_ensemble,
    load_reward_source as load_reward_source,
    stage_reward_source as stage_reward_source,
)
from ._reward_stage import RewardConfig as RewardConfig, run_reward as run_reward
from ._rollout import (
    PendingRollout as PendingRollout,
    RewardFunction as RewardFunction,
    Rollout as Rollout,
    dispatch_rollout as dispatch_rollout,
    encode_prompts as encode_prompts,
    finish_rollout as finish_rollout,
    group_signal as group_signal,
    reward_model_scores as reward_model_scores,
    sample_rollout as sample_rollout,
    score_rollout as score_rollout,
    token_logps as token_logps,
)
from ._rundir import check_data as check_data, open_run_dir as open_run_dir
from ._runs import (
    RunContext as RunContext,
    RunResult as RunResult,
    check_finite_weights as check_finite_weights,
    copy_tokenizer as copy_tokenizer,
    export_policy as export_policy,
    export_reward_model as export_reward_model,
    final_policy as final_policy,
    has_lora as has_lora,
    with_lora as with_lora,
)
from ._sampled_eval import sampled_comparison as sampled_comparison
from ._seeds import (
    check_seeds as check_seeds,
    format_seeds_table as format_seeds_table,
    run_seeds as run_seeds,
    seeds_command as seeds_command,
    summarize_seeds as summarize_seeds,
)
from ._sft_stage import SFTConfig as SFTConfig, run_sft as run_sft
from ._sweep import (
    SweepResult as SweepResult,
    sweep as sweep,
    sweep_command as sweep_command,
)
from ._tracker_backends import (
    MLflowTracker as MLflowTracker,
    TensorBoardTracker as TensorBoardTracker,
    TrackioTracker as TrackioTracker,
    WandbTracker as WandbTracker,
)
from ._trackers import (
    Tracker as Tracker,
    Trackers as Trackers,
    active_trackers as active_trackers,
    open_trackers as open_trackers,
    register_tracker as register_tracker,
    run_trackers as run_trackers,
    tracker_names as tracker_names,
)
from ._validation import (
    DATA_FORMATS as DATA_FORMATS,
    validate_config as validate_config,
    validate_judge as validate_judge,
    validate_ops as validate_ops,
    validate_stage as validate_stage,
)
