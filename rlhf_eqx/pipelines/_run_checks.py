"""The checks of the stages a run executes (`validate_config`): each stage known and
runnable where it runs, its prerequisites present, its settings valid (the fields every
batch or rollout stage shares, then the settings' own `check`), and the rules across
stages and sections (a batch's length above the prompt's, the reward source and the
judge's verdict tokens, then each running stage's `Stage.check_run`) checked before any
stage runs. A setting that the run would not read, set to another value than its default
(the usual one or the built-in task's), is refused rather than ignored (`check_unread`,
`check_full_finetune`, the stage configs' `unused_fields`)."""

import dataclasses
import difflib
from typing import Any

from ._config import BatchStageConfig, DataConfig, LoRASettings, RolloutStageConfig
from ._field_checks import _fail, check_shared_fields, check_unused
from ._model_checks import check_context, check_judge
from ._pipeline_config import (
    TASK_STAGE_SETTINGS,
    PipelineConfig,
    animal_task_config,
    task_section,
)
from ._registry import find_stage, stage_names, stages
from ._rollout import SAMPLING_FIELDS as ROLLOUT_FIELDS

SAMPLE_DATA_FIELDS: tuple[str, ...] = ("chat_template",)
"""The `data` fields read without a data file: `rlhf_eqx sample` renders its prompts with
`data.chat_template` (its configuration is checked as the built-in pipeline's)."""
UNREAD_DATA_FIELDS: dict[str, tuple[str, ...]] = {
    "eval_prompts": ("grpo", "reward", "prm", "distill"),
    "assistant_turns": ("reward", "dpo", "grpo", "kto", "ppo", "prm"),
}
"""The data-file stages that do not read a `data` field read by others: `eval_prompts`,
the held-out prompts `sft`, `dpo`, `kto` and `ppo` complete before and after training
(`grpo` completes every held-out prompt, the others sample none), and
`assistant_turns`, the assistant messages of a conversation that the demonstration
readers of `sft` and `distill` train on."""
UNSAMPLED_EVAL_STAGES: tuple[str, ...] = ("reward", "prm", "distill")
"""The data-file stages whose held-out evaluation samples no completions (it reads no
`eval_samples`)."""
UNSAMPLING_STAGES: tuple[str, ...] = ("reward", "prm")
"""The data-file stages that sample nothing at all: of `sampling` they read
`prompt_length` alone (`SAMPLING_FIELDS` are unread)."""
SAMPLING_FIELDS: tuple[str, ...] = tuple(f for f in ROLLOUT_FIELDS if f != "prompt_length")
"""The `sampling` fields that only a sampled completion reads (the sampler's keywords
but the prompt length, which the data-file stages also cut prompts at)."""
HELDOUT_SAMPLING_STAGES: tuple[str, ...] = ("sft", "dpo", "kto")
"""The data-file stages whose only samples are the held-out comparison's: they sample
`sampling.max_new_tokens` tokens for `data.eval_prompts` held-out prompts (0: none, and
then they read no `SAMPLING_FIELDS` nor `eval_samples`); `ppo` and `grpo` sample their
rollouts, `distill` its on-policy completions (`distill.lmbda > 0`)."""
TASK_ONLY_FIELDS: dict[str, tuple[str, ...]] = {
    "sft": ("samples",),
    "reward": ("pairs_per_prompt",),
    "dpo": ("rounds", "samples", "missing_eos_penalty"),
    "kto": ("samples",),
    "distill": ("samples",),
}
"""The settings of a stage section that only its run on the built-in task reads: how many
completions of the task's prompts it samples (`samples`, `pairs_per_prompt`) and the
rounds of fresh samples (`dpo.rounds`); on a data file the pairs, examples or prompts are
the file's (`dpo.missing_eos_penalty` lowers the labels of samples, which offline DPO
on a file has none of)."""
SAMPLE_TRAINING_SECTIONS: tuple[str, ...] = ("sft", "reward", "dpo", "kto", "distill")
"""The sections whose stages train, on the built-in task, on sampled sequences of up to
`sampling.prompt_length + sampling.max_new_tokens` tokens, each cut to the section's
`max_length` (`check_sample_room`)."""
UNEVALUATED_STAGES: tuple[str, ...] = ("sft", "reward")
"""The built-in task's stages without a periodic evaluation against SFT
(`ops.eval_every`): SFT is what the others are compared with, and the reward model
trains no policy."""


def check_section(name: str, c: Any, *, device_count: int = 1) -> None:
    """Check the settings `c` of the stage section `name` (see `validate_stage`): unused
    settings at their defaults, LoRA settings without adapters (`check_full_finetune`),
    the shared batch / rollout fields, then the settings' own rules (their
    `check(name, device_count=...)` method, where they have one)."""
    check_unused(name, c)
    check_full_finetune(name, c)
    check_shared_fields(name, c, device_count)
    own = getattr(c, "check", None)
    if callable(own):
        own(name, device_count=device_count)


def check_full_finetune(name: str, c: Any) -> None:
    """Refuse an adapter setting (`alpha`, `dropout`, `targets`, `use_rslora`, `use_dora`) of the
    section `name` changed while `lora.rank=0` trains every weight without adapters,
    which reads none of them; a value of the usual defaults (`LoRASettings()`), of the
    built-in task's or of the settings class's own is not refused."""
    lora = getattr(c, "lora", None)
    if not isinstance(lora, LoRASettings) or lora.rank != 0:
        return
    own = {f.name: f.default for f in dataclasses.fields(type(c))}.get("lora")
    usual = [LoRASettings(), TASK_STAGE_SETTINGS["lora"], own]
    for field in ("alpha", "dropout", "targets", "use_rslora", "use_dora"):
        value = getattr(lora, field)
        if all(value != getattr(d, field) for d in usual if isinstance(d, LoRASettings)):
            _fail(
                f"{name}.lora.{field}",
                value,
                f"{name}.lora.rank=0 trains every weight without LoRA adapters, which do not "
                f"read it; set {name}.lora.rank > 0 for adapters",
            )


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
            close = difflib.get_close_matches(str(st), list(names), n=2)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            _fail("stages", cfg.stages, f"unknown stage {st!r}{hint} (known: {', '.join(names)})")
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
    if c.reward_model and c.reward_source in ("task", "judge"):
        _fail(
            f"{key}.reward_model",
            c.reward_model,
            f"read only with {key}.reward_source=reward_model or prm (it is "
            f"{c.reward_source}, which scores without it)",
        )
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


def samples_completions(cfg: Any, run: tuple[str, ...]) -> bool:
    """Whether a run of the stages `run` samples completions of `sampling.prompt_length +
    sampling.max_new_tokens` tokens: always on the built-in task (its SFT samples the base
    model); on a data file a stage that samples (not `UNSAMPLING_STAGES`), the
    `HELDOUT_SAMPLING_STAGES` when `data.eval_prompts > 0` (`sft` on language-modelling
    text has no prompt: none), `distill` when `distill.lmbda > 0`."""
    if cfg.data.path is None:
        return True
    for name in run:
        if name in UNSAMPLING_STAGES:
            continue
        if name in HELDOUT_SAMPLING_STAGES:
            text = name == "sft" and cfg.data.format == "text"
            if cfg.data.eval_prompts > 0 and not text:
                return True
        elif name != "distill" or cfg.distill.lmbda > 0:
            return True
    return False


def read_lengths(cfg: Any, run: tuple[str, ...]) -> list[tuple[str, int]]:
    """The lengths of model input a run of the stages `run` reads, `(settings, tokens)`:
    each running section's `max_length` (where it reads one) and, when it samples
    (`samples_completions`), `sampling.prompt_length + sampling.max_new_tokens`; each
    must fit the model's context (`check_context`). A multi-turn episode's length is
    its stage's own check (`check_episode_length`)."""
    lengths = []
    for key in dict.fromkeys(find_stage(st).key for st in run):
        c = getattr(cfg, key)
        if isinstance(c, BatchStageConfig) and "max_length" not in _unused(c):
            lengths.append((f"{key}.max_length", c.max_length))
    if samples_completions(cfg, run):
        lengths.append(sampled_length(cfg))
    return lengths


def sampled_length(cfg: Any) -> tuple[str, int]:
    """`(settings, tokens)` of a sampled sequence: `sampling.prompt_length +
    sampling.max_new_tokens`, what a reward model, a judge or a teacher scoring on-policy
    samples reads."""
    s = cfg.sampling
    what = f"sampling.prompt_length={s.prompt_length} + "
    what += f"sampling.max_new_tokens={s.max_new_tokens}"
    return what, s.prompt_length + s.max_new_tokens


def check_sample_room(cfg: Any, run: tuple[str, ...]) -> None:
    """On the built-in task, each running `SAMPLE_TRAINING_SECTIONS` section's
    `max_length` holds a whole sample (`sampled_length`): a shorter one would cut the
    samples it trains on, and train on the cut text with the label of the whole (as
    TRL's `max_length` would, its trainers' default being long enough)."""
    if cfg.data.path is not None:
        return
    what, tokens = sampled_length(cfg)
    for key in dict.fromkeys(find_stage(st).key for st in run):
        c = getattr(cfg, key)
        if key in SAMPLE_TRAINING_SECTIONS and c.max_length < tokens:
            _fail(
                f"{key}.max_length",
                c.max_length,
                f"must hold the samples it trains on, {what} = {tokens} tokens (a sample "
                f"would be cut and trained on with the label of the whole); raise "
                f"{key}.max_length or lower sampling.max_new_tokens",
            )


def check_scorer_context(cfg: Any, run: tuple[str, ...]) -> None:
    """Each reward model a rollout stage of `run` scores its samples with (`<stage>.reward_model`:
    one, an ensemble's members, a PRM) and a judge checkpoint (`judge.model`, not the
    run's own `base` or `sft`) reads the sampled length (`sampled_length`) within its
    context (`check_context`, naming the setting and the model)."""
    from ._reward_sources import reward_model_checkpoints

    sampled = [sampled_length(cfg)]
    for key in dict.fromkeys(find_stage(st).key for st in run):
        c = getattr(cfg, key)
        if not isinstance(c, RolloutStageConfig) or "reward_source" in _unused(c):
            continue
        if c.reward_model and c.reward_source in ("reward_model", "prm"):
            for path in reward_model_checkpoints(c.reward_model):
                check_context(cfg, sampled, field=f"{key}.reward_model", source=path)
        if c.reward_source == "judge" and cfg.judge.model not in ("base", "sft"):
            check_context(cfg, sampled, field="judge.model", source=cfg.judge.model)


def check_loaded_context(cfg: Any, policy: Any, run: tuple[str, ...]) -> None:
    """`check_context` of the lengths `run` reads against the loaded `policy`'s own
    `max_seq_len` (a GGUF file whose header `read_gguf_sizes` could not read is
    compared once it is loaded)."""
    context = getattr(getattr(policy, "cfg", None), "max_seq_len", None)
    if isinstance(context, int):
        check_context(cfg, read_lengths(cfg, run), context)


def validate_run(cfg: Any, run: tuple[str, ...], *, device_count: int = 1) -> None:
    """Check the stages `run` of `cfg` (see `run_stages`): each registered stage's own
    fields (`validate_stage`), then what the stages that run combine with other sections
    (a batch above the prompt length, the reward source and the judge, each stage's
    `check_run`: the teacher, a multi-turn episode's length; every length the run reads
    within the model's context, `read_lengths`; on the built-in task a whole sample within
    each batch stage's `max_length`, `check_sample_room`; and the sampled length within
    each reward model's and judge's, `check_scorer_context`); `ConfigError` naming the
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
    check_context(cfg, read_lengths(cfg, run))
    check_sample_room(cfg, run)
    check_scorer_context(cfg, run)
    check_unread(cfg, run, uses_judge)
    if uses_judge:
        validate_judge(cfg.judge)
        if cfg.data.path is not None and cfg.judge.model == "sft":
            why = "on a data file the judge is base or a checkpoint directory"
            _fail("judge.model", "sft", why)
        check_judge(cfg, cfg.judge)


def _changed(value: Any, *defaults: Any) -> bool:
    """Whether `value` differs from every one of `defaults` (the usual default and the
    built-in task's): a value a user set, not one a configuration was built with."""
    return all(value != d for d in defaults)


def _check_task_only(cfg: Any, run: tuple[str, ...]) -> None:
    """On a data file, a running stage's `TASK_ONLY_FIELDS` changed from their defaults
    (the settings class's and the built-in task's) are refused."""
    for key in dict.fromkeys(find_stage(st).key for st in run):
        if key not in TASK_ONLY_FIELDS:
            continue
        c = getattr(cfg, key)
        defaults = (type(c)(), task_section(key))
        for field in TASK_ONLY_FIELDS[key]:
            value = getattr(c, field)
            if _changed(value, *(getattr(d, field) for d in defaults)):
                _fail(
                    f"{key}.{field}",
                    value,
                    "applies to the built-in task's sampled training data only; on a data "
                    "file the stage trains on the file's records",
                )


SWEEP_UNREAD_OPS: dict[str, str] = {
    "eval_every": "a sweep has no periodic evaluation; the held-out evaluation runs at the end",
    "lr_backoff": "a sweep does not roll back; a member whose update is not finite is frozen",
    "max_rollbacks": "a sweep does not roll back; a member whose update is not finite is frozen",
    "loss_spike": "a sweep does not roll back on a loss spike",
    "kl_spike": "a sweep does not roll back on a KL spike (a GRPO or PPO member past its KL "
    "target stops: kl_guard)",
}
"""The `ops` fields a separate run reads and a sweep does not, with why."""


def check_sweep_ops(ops: Any) -> None:
    """Refuse the `SWEEP_UNREAD_OPS` of `ops` changed from their defaults (the usual one
    or the built-in task's), as `check_unread` refuses a run's unread settings."""
    usual, task = PipelineConfig().ops, animal_task_config().ops
    for field, why in SWEEP_UNREAD_OPS.items():
        value = getattr(ops, field)
        if _changed(value, getattr(usual, field), getattr(task, field)):
            _fail(f"ops.{field}", value, why)


def check_unread(cfg: Any, run: tuple[str, ...], uses_judge: bool) -> None:
    """Refuse a shared setting that the stages `run` would not read, changed from its
    default (the usual one or the built-in task's): one line naming the field and what
    applies instead. `data.*` on the built-in task (no `data.path`; but
    `SAMPLE_DATA_FIELDS`); on a data file the
    running stages' `TASK_ONLY_FIELDS`, and `label_noise`, `data.eval_prompts`,
    `data.assistant_turns`, `eval_samples` and the `sampling` of completions where no
    running stage reads them (`UNREAD_DATA_FIELDS`, `UNSAMPLED_EVAL_STAGES`,
    `UNSAMPLING_STAGES`, and `HELDOUT_SAMPLING_STAGES` with `data.eval_prompts=0`); the
    `judge` section when no running
    stage scores with the judge (`uses_judge`); and `ops.eval_every` where no stage
    evaluates periodically (a data file, or SFT and the reward model alone)."""
    base, dc, usual = PipelineConfig(), cfg.data, DataConfig()
    if dc.path is None:
        for f in dataclasses.fields(dc):
            if f.name in SAMPLE_DATA_FIELDS:
                continue
            value = getattr(dc, f.name)
            if _changed(value, getattr(usual, f.name)):
                _fail(
                    f"data.{f.name}",
                    value,
                    "applies to a data file (data.path, --data FILE); the built-in task reads "
                    "no data settings",
                )
    else:
        _check_task_only(cfg, run)
        if _changed(cfg.label_noise, base.label_noise):
            _fail(
                "label_noise",
                cfg.label_noise,
                "applies to the built-in task's noisy labels; a data file's labels are its own",
            )
        for field, readers_not in UNREAD_DATA_FIELDS.items():
            value = getattr(dc, field)
            if _changed(value, getattr(usual, field)) and set(run) <= set(readers_not):
                _fail(f"data.{field}", value, f"the {run[0]} stage does not read it")
        none = HELDOUT_SAMPLING_STAGES if dc.eval_prompts == 0 else ()
        why = " with data.eval_prompts=0" if set(run) & set(none) else ""
        if _changed(cfg.eval_samples, base.eval_samples) and set(run) <= {
            *UNSAMPLED_EVAL_STAGES,
            *none,
        }:
            _fail(
                "eval_samples",
                cfg.eval_samples,
                f"the {run[0]} stage's held-out evaluation samples no completions{why}",
            )
        if set(run) <= {*UNSAMPLING_STAGES, *none}:
            usual = type(cfg.sampling)()
            for field in SAMPLING_FIELDS:
                value = getattr(cfg.sampling, field)
                if _changed(value, getattr(usual, field)):
                    _fail(
                        f"sampling.{field}",
                        value,
                        f"the {run[0]} stage samples no completions on a data file{why} "
                        "(of sampling it reads prompt_length alone)",
                    )
    if cfg.ops.eval_every and (dc.path is not None or set(run) <= set(UNEVALUATED_STAGES)):
        where = "a data-file run" if dc.path is not None else "a run of sft and reward alone"
        _fail(
            "ops.eval_every",
            cfg.ops.eval_every,
            f"{where} has no periodic evaluation (the built-in task's PPO, DPO, GRPO, ... "
            "are evaluated against SFT every ops.eval_every iterations); the held-out "
            "evaluation runs at the end",
        )
    if not uses_judge:
        task_judge = animal_task_config().judge
        for f in dataclasses.fields(cfg.judge):
            value = getattr(cfg.judge, f.name)
            if _changed(value, getattr(base.judge, f.name), getattr(task_judge, f.name)):
                _fail(
                    f"judge.{f.name}",
                    value,
                    "no stage of this run scores with the judge (a stage's "
                    "reward_source=judge reads it)",
                )
