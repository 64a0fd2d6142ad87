"""Each algorithm's run and the pieces the stages are built of, for code that drives them
itself (a stage of its own, a script, a test): the runs (`run_sft`, `run_dpo`, ...,
each `(model, tok, data, *, cfg, ctx) -> RunResult`), their helpers, the rollouts, the
reward sources PPO and GRPO score with (the user's reward functions among them:
`BatchFunctionReward`, `load_reward_functions`, `check_reward_functions`), the
held-out evaluation, the data-file preparation and the exports of a trained model.
`rlhf_eqx.pipelines` itself keeps what a run is configured and started with."""

from ._data_prep import (
    ChatRendering as ChatRendering,
    chat_rendering as chat_rendering,
    hh_messages as hh_messages,
    preference_split as preference_split,
    prompt_tokens as prompt_tokens,
    quality_report as quality_report,
    split_records as split_records,
    trained_policy as trained_policy,
)
from ._distill_stage import (
    check_same_vocabulary as check_same_vocabulary,
    distill_divergence as distill_divergence,
    load_teacher as load_teacher,
    run_distill as run_distill,
    teacher_stages as teacher_stages,
)
from ._dpo_stage import (
    best_worst_pairs as best_worst_pairs,
    dpo_heldout_metrics as dpo_heldout_metrics,
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
    OffPolicyState as OffPolicyState,
    run_grpo as run_grpo,
)
from ._kto_stage import (
    kto_heldout_metrics as kto_heldout_metrics,
    run_kto as run_kto,
    sampled_unpaired as sampled_unpaired,
)
from ._lr_scale import build_optimizer as build_optimizer
from ._multiturn_dpo_stage import (
    episode_pairs as episode_pairs,
    run_multiturn_dpo as run_multiturn_dpo,
)
from ._multiturn_stage import run_multiturn as run_multiturn, turn_stop_ids as turn_stop_ids
from ._partial_rollouts import (
    continue_rollout as continue_rollout,
    partial_segments as partial_segments,
)
from ._ppo_stage import run_ppo as run_ppo
from ._prm_stage import run_prm as run_prm, step_accuracy as step_accuracy
from ._reward_sources import (
    BatchFunctionReward as BatchFunctionReward,
    EnsembleReward as EnsembleReward,
    FunctionReward as FunctionReward,
    JudgeSource as JudgeSource,
    ModelReward as ModelReward,
    ProcessReward as ProcessReward,
    RewardSource as RewardSource,
    Scored as Scored,
    check_reward_functions as check_reward_functions,
    export_prm as export_prm,
    export_reward_ensemble as export_reward_ensemble,
    load_reward_functions as load_reward_functions,
    load_reward_source as load_reward_source,
    stage_reward_source as stage_reward_source,
)
from ._reward_stage import run_reward as run_reward
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
from ._runs import (
    RunResult as RunResult,
    check_finite_weights as check_finite_weights,
    copy_tokenizer as copy_tokenizer,
    export_policy as export_policy,
    export_reward_model as export_reward_model,
    final_policy as final_policy,
    has_lora as has_lora,
    with_lora as with_lora,
)
from ._sft_stage import run_sft as run_sft
