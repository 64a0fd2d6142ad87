"""Generalized knowledge distillation (GKD, Agarwal et al. 2024), the `distill` stage: its
settings (`DistillConfig`), its run (a student trained toward a teacher's token
distributions with the generalized JSD, on fixed completions and, for a fraction `lmbda`
of the steps, on the student's own samples), the stage on the built-in task (a stage of
the run as teacher) and on a preference file's chosen responses (a checkpoint as
teacher), and its registration."""

import dataclasses
import os
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp

import rlhf_eqx as rx
from rlhf_eqx import data

from ..train import DistillSettings
from ._config import BatchStageConfig, LoRASettings, _optim
from ._data_prep import (
    DATA_EOS,
    data_ctx,
    demonstrations,
    located_demonstration_split,
    located_preference_split,
    log_left_out,
    prompt_tokens,
    report_cuts,
    trained_policy,
)
from ._field_checks import _above, _fail, _positive, _within
from ._model_checks import check_context, check_teacher_vocabulary, is_gguf_file
from ._registry import Outcome, Stage, StageEnv, find_stage, register_stage, stages
from ._rollout import SAMPLING_FIELDS, sample_rollout, sampling_options
from ._runs import RunContext, RunResult, final_policy, rows_at, run_loop, take_rows, train_setup
from ._task import TRAIN_PROMPTS
from ._validation import validate_stage


@dataclasses.dataclass(frozen=True)
class DistillConfig(BatchStageConfig):
    """Generalized knowledge distillation (GKD, Agarwal et al. 2024; TRL `GKDTrainer`
    defaults): the student (SFT on the built-in task, `model.source` on a data file)
    moves toward `teacher`'s token distributions by the generalized JSD with
    interpolation `beta` (0: forward KL, 1: reverse KL), computed at temperature 1 as
    TRL computes it (`temperature`, TRL's `GKDConfig.temperature`, is the temperature
    the sampled completions are drawn at); a fraction
    `lmbda` of the steps trains on the student's own samples (on-policy), the rest on
    fixed completions (the data file's chosen responses, or `samples` samples per prompt
    of the teacher on the built-in task) or, with `seq_kd` (TRL's `GKDConfig.seq_kd`,
    sequence-level KD, Kim & Rush 2016), on the teacher's samples for the rows' prompts,
    drawn afresh each step with the run's sampling settings at `temperature`. `teacher`:
    a stage of the same run that trains a policy (`grpo`, `dpo`, `ppo`, `online-dpo`,
    `kto`, ...: `teacher_stages()`), a short model name, a Hugging Face checkpoint or run
    directory or a `.gguf` file; it must share the student's vocabulary (a directory's or a GGUF
    file's `vocab_size` is checked against the student's before anything is loaded) and
    may differ in size.
    `beta` and `lmbda` in [0, 1], `temperature` > 0."""

    steps: int = 40
    beta: float = DistillSettings.beta
    temperature: float = 0.9
    lmbda: float = 0.5
    seq_kd: bool = False
    teacher: str = "grpo"
    samples: int = 2
    lora: LoRASettings = LoRASettings()

    def check(self, name: str, *, device_count: int = 1) -> None:
        """Distillation's own rules: β and λ in [0, 1], a temperature > 0 (and its default
        with `lmbda=0` and no `seq_kd`, which sample nothing at it), samples >= 1 (and
        their default with `lmbda=1` or `seq_kd`, which never train on them), and a
        teacher that is a teacher stage, a short model name (`MODEL_NAMES`, as `--model`
        takes), a checkpoint or run directory or a `.gguf` file."""
        from ._pipeline import MODEL_NAMES, closest_name

        del device_count
        _within(f"{name}.beta", self.beta, 0, 1, " (0: forward KL, 1: reverse KL)")
        _within(f"{name}.lmbda", self.lmbda, 0, 1)
        _above(f"{name}.temperature", self.temperature, 0)
        if not self.samples_completions and self.temperature != DistillConfig.temperature:
            _fail(
                f"{name}.temperature",
                self.temperature,
                f"samples the on-policy completions only (and the teacher's with "
                f"{name}.seq_kd), and {name}.lmbda=0 without {name}.seq_kd samples none "
                "(the loss is at temperature 1)",
            )
        _positive(f"{name}.samples", self.samples)
        if not self.trains_fixed_completions and self.samples != DistillConfig.samples:
            why = "lmbda=1" if self.lmbda == 1 else "seq_kd"
            _fail(
                f"{name}.samples",
                self.samples,
                f"with {name}.{why} no step trains on the fixed teacher samples (every step "
                "samples its completions afresh), so nothing reads it",
            )
        t = self.teacher
        gguf = is_gguf_file(t) and os.path.isfile(t)
        named = t in teacher_stages() or t in MODEL_NAMES
        if not named and not os.path.isdir(t) and not gguf:
            _fail(
                f"{name}.teacher",
                t,
                f"must be one of {', '.join(teacher_stages())}, a short model name "
                f"({', '.join(MODEL_NAMES)}), a checkpoint directory or a .gguf file"
                f"{closest_name(t, (*teacher_stages(), *MODEL_NAMES))}",
            )

    @property
    def trains_fixed_completions(self) -> bool:
        """Whether some steps train on the fixed completions (neither on-policy, `lmbda <
        1`, nor the teacher's fresh samples, no `seq_kd`)."""
        return self.lmbda < 1 and not self.seq_kd

    @property
    def samples_completions(self) -> bool:
        """Whether the run samples completions for its steps: on-policy steps
        (`lmbda > 0`) or the teacher's (`seq_kd`)."""
        return self.lmbda > 0 or self.seq_kd


def teacher_stages() -> tuple[str, ...]:
    """The stages `distill.teacher` may name: registered stages that train a policy on the
    built-in task (SFT, the student's start, and distillation itself excepted)."""
    return tuple(
        st.name
        for st in stages()
        if st.trains_policy and st.builtin is not None and st.name not in ("sft", "distill")
    )


ON_POLICY_SAMPLING = tuple(f for f in SAMPLING_FIELDS if f not in ("prompt_length", "temperature"))
"""The `sampling` fields a data-file `distill` run reads for its sampled completions only
(the student's with `distill.lmbda > 0`, the teacher's with `distill.seq_kd`)."""


def check_data_sampling(cfg) -> None:
    """On a data file, refuse the `sampling` settings the `distill` run would not read,
    changed from their defaults: its held-out measure samples nothing and its on-policy
    completions sample at `distill.temperature`, so `sampling.temperature` is never read;
    with `distill.lmbda=0` and no `distill.seq_kd` no completion is sampled at all
    (`ON_POLICY_SAMPLING`)."""
    c, usual = cfg.distill, type(cfg.sampling)()
    if cfg.sampling.temperature != usual.temperature:
        _fail(
            "sampling.temperature",
            cfg.sampling.temperature,
            "a distill run on a data file samples its on-policy completions at "
            "distill.temperature (and its held-out measure samples none): set that",
        )
    if not c.samples_completions:
        for field in ON_POLICY_SAMPLING:
            value = getattr(cfg.sampling, field)
            if value != getattr(usual, field):
                _fail(
                    f"sampling.{field}",
                    value,
                    "distill.lmbda=0 without distill.seq_kd samples no completion (and the "
                    "held-out measure samples none), so nothing reads it",
                )


def check_run(cfg, run) -> None:
    """The teacher of a run: a stage of the run on the built-in task (a checkpoint
    directory, a `.gguf` file or a short model name on a data file), with the student's
    vocabulary when it is a checkpoint directory (a run directory: its exported policy),
    with a context that holds what it scores (`teacher_lengths`); on a data file, no
    `sampling` setting the run would not read (`check_data_sampling`). The vocabulary of a
    directory or a `.gguf` file (a short model name's too) is read from its header,
    before the run directory is taken and the teacher loaded."""
    from ._pipeline import model_path

    if cfg.data.path is not None:
        check_data_sampling(cfg)
    t = cfg.distill.teacher
    if t in teacher_stages():
        if cfg.data.path is not None:
            _fail("distill.teacher", t, "on a data file the teacher is a checkpoint directory")
        if t not in run:
            _fail("distill.teacher", t, f"the teacher stage {t!r} is not among the stages")
        return
    path = model_path(t, "distill.teacher")
    if os.path.isdir(path) or is_gguf_file(path):  # a GGUF file's header: milliseconds
        check_teacher_vocabulary(cfg, t)  # resolved there too; named as the user wrote it
    check_context(cfg, teacher_lengths(cfg), field="distill.teacher", source=t)


def teacher_lengths(cfg) -> list[tuple[str, int]]:
    """What the teacher scores (and samples): sequences of `distill.max_length` tokens
    and, with `distill.lmbda > 0` or `distill.seq_kd`, sampled completions
    (`sampling.prompt_length + sampling.max_new_tokens`)."""
    from ._run_checks import sampled_length

    lengths = [("distill.max_length", cfg.distill.max_length)]
    return lengths + [sampled_length(cfg)] if cfg.distill.samples_completions else lengths


LOSS_TEMPERATURE = rx.train.DistillSettings.temperature
"""The temperature of the distillation stage's divergence: `DistillSettings`' default
(1.0), as TRL's `GKDTrainer` computes its loss (`generalized_jsd_loss` at its default
`temperature=1.0`); the stage's
`distill.temperature` (TRL `GKDConfig.temperature`, 0.9) is the temperature the
on-policy completions are sampled at."""


def check_same_vocabulary(student, teacher) -> None:
    """Refuse (`ValueError`) a teacher whose vocabulary differs from the student's,
    naming both sizes: distillation compares distributions over the same token ids."""
    sv, tv = student.cfg.vocab_size, teacher.cfg.vocab_size
    if sv != tv:
        raise ValueError(
            f"distill.teacher: the teacher's vocab_size={tv} differs from the student's "
            f"vocab_size={sv}; teacher and student must share a tokenizer"
        )


def load_teacher(directory: str, student) -> rx.Policy:
    """The distillation teacher of the checkpoint `directory` (`distill.teacher`,
    resolved as `--model` is, `model_path`: a short model name is its file, a run
    directory its exported policy; a `.gguf` file loads with `rx.load_gguf`): its
    weights only (it reads the student's tokens, so its own tokenizer file is not
    needed), checked to share the student's vocabulary. A `ConfigError` naming
    `distill.teacher` (with both vocabulary sizes when they differ) otherwise."""
    from ._config import ConfigError
    from ._pipeline import model_path

    path = model_path(directory, "distill.teacher")
    try:
        if is_gguf_file(path):
            teacher, _ = rx.load_gguf(path)
        else:
            teacher = rx.load_hf(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"distill.teacher={directory!r}: {str(e).splitlines()[0]}") from None
    if not isinstance(teacher, rx.Policy):
        raise ConfigError(
            f"distill.teacher={directory!r}: holds a {type(teacher).__name__}, not a policy"
        )
    try:
        check_same_vocabulary(student, teacher)
    except ValueError as e:
        raise ConfigError(f"distill.teacher={directory!r}: {str(e).split(': ', 1)[1]}") from None
    return teacher


def completions_batch(
    records: Sequence[tuple[str, str]],
    tok,
    *,
    max_length: int,
    prompt_length: int,
    add_eos: bool | str = False,
) -> rx.train.DistillBatch:
    """`(prompt, completion)` records as a right-padded `DistillBatch`; `add_eos` as
    `RunContext.add_eos` (default no EOS: sampled completions hold theirs)."""
    seqs, _ = data.tokenize_sft(
        list(records), tok, max_length=max_length, max_prompt_length=prompt_length, add_eos=add_eos
    )
    b = data.collate_sft(seqs, max_length=max_length, pad_id=tok.pad_id)
    return rx.train.DistillBatch(b.tokens, b.mask, b.completion_mask)


def run_distill(
    student,
    teacher,
    tok,
    prompts: Sequence[str],
    completions: rx.train.DistillBatch,
    *,
    cfg: DistillConfig,
    ctx: RunContext,
) -> RunResult:
    """GKD (Agarwal et al. 2024; TRL `GKDTrainer`): `cfg.steps` steps of
    `make_distill_step` (generalized JSD with interpolation `cfg.beta`, teacher logits
    computed on the fly, LM head on completion positions only) on `cfg.batch_size` rows.
    Step `i` is on-policy with probability `cfg.lmbda` (drawn from `fold_in(key, i)`):
    its completions are sampled from the current student for the rows' prompts with the
    run's sampling settings at temperature `cfg.temperature`; otherwise they are the
    rows of `completions` (dataset completions, or the teacher's own samples) or, with
    `cfg.seq_kd`, the teacher's samples for the rows' prompts, drawn as the on-policy
    ones are (TRL samples the teacher first and lets an on-policy step replace them; an
    on-policy step here samples the student only). The metrics `on_policy` and
    `teacher_sampled` say which kind each step was.
    `prompts[j]` is the prompt of row `j`. As in TRL, `cfg.temperature` (0.9) is the
    sampling temperature only: the divergence is computed at `LOSS_TEMPERATURE` (τ = 1;
    TRL 1.16 `trl/experimental/gkd/gkd_trainer.py`: `compute_loss` calls
    `generalized_jsd_loss` without a temperature, and `GKDConfig.temperature` goes to
    the generation config).
    The student trains LoRA adapters per `cfg.lora`; teacher and student must share a
    vocabulary (`check_same_vocabulary`) and may differ in size."""
    validate_stage("distill", cfg)
    check_same_vocabulary(student, teacher)
    n = completions.tokens.shape[0]
    if len(prompts) != n:
        raise ValueError(f"run_distill: {len(prompts)} prompts for {n} completion rows")
    k_lora, ctx_key = jax.random.split(ctx.key)
    settings = rx.train.DistillSettings(beta=cfg.beta, temperature=LOSS_TEMPERATURE)
    state, _, step = train_setup(
        student, cfg, cfg.steps, k_lora, rx.train.make_distill_step, settings
    )
    sampling = on_policy_sampling(ctx, cfg)

    def iteration(state, key, i):
        rows = rows_at(n, cfg.batch_size, ctx.ops.seed, i)
        k_coin, k_sample, k_step = jax.random.split(key, 3)
        on_policy = float(jax.random.uniform(k_coin)) < cfg.lmbda
        if on_policy or cfg.seq_kd:
            sampler = state.model if on_policy else teacher
            roll = sample_rollout(sampler, tok, [prompts[j] for j in rows], k_sample, **sampling)
            batch = rx.train.DistillBatch(roll.tokens, roll.mask, roll.completion_mask)
        else:
            batch = take_rows(completions, rows)
        state, m = state.apply(step, batch, key=k_step, teacher=teacher)
        kinds = {
            "on_policy": float(on_policy),
            "teacher_sampled": float(cfg.seq_kd and not on_policy),
        }
        return state, [{**m, **kinds}], {}

    tokens = cfg.batch_size * cfg.max_length
    return run_loop(
        state,
        iteration,
        dataclasses.replace(ctx, key=ctx_key),
        cfg.steps,
        policy_of=lambda s: s.model,
        tokens_per_iteration=tokens,
    )


def on_policy_sampling(ctx: RunContext, cfg: DistillConfig) -> dict:
    """The sampling keywords of the on-policy (and `seq_kd`) steps: the run's, at
    `cfg.temperature`."""
    return dict(sampling_options(ctx), temperature=cfg.temperature)


@eqx.filter_jit
def _jsd(student, teacher, batch, beta, temperature):
    params, frozen = eqx.partition(student, eqx.is_inexact_array)
    loss = rx.train.distill_loss(beta=beta, temperature=temperature)
    _, _, metrics = loss(params, (frozen, teacher), batch, None)
    num, den = metrics["jsd"]
    return num / jnp.maximum(den, 1.0)


def distill_divergence(
    student, teacher, batch, *, beta: float, temperature: float = LOSS_TEMPERATURE
) -> float:
    """Mean generalized JSD per completion token between `student` and `teacher` on a
    `DistillBatch` at `temperature` (the held-out measure of a distillation run, at the
    temperature of its loss)."""
    f32 = jnp.float32  # traced: one compile for every beta and temperature
    return float(
        _jsd(student, teacher, batch, jnp.asarray(beta, f32), jnp.asarray(temperature, f32))
    )


def sampled_completions(
    teacher, tok, prompts: Sequence[str], key, *, samples: int, sampling
) -> tuple[list[str], list[tuple[str, str]]]:
    """`samples` completions per prompt from `teacher` as `(prompt, completion)` records
    (the off-policy half of GKD on a task without reference completions)."""
    roll = sample_rollout(
        teacher, tok, prompts, key, group_size=samples, **sampling_options(sampling)
    )
    return list(roll.prompts), list(zip(roll.prompts, roll.texts))


def distill(env: StageEnv, c: DistillConfig) -> Outcome:
    """Distillation of `c.teacher` (a stage of the run or a checkpoint) into SFT on the
    built-in task, on the teacher's samples."""
    teacher = env.policies.get(c.teacher)
    if teacher is None:  # a checkpoint directory
        teacher = load_teacher(c.teacher, env.policies["sft"])
    s = env.cfg.sampling
    prompts, recs = sampled_completions(
        teacher, env.tok, TRAIN_PROMPTS, env.data_key(5), samples=c.samples, sampling=s
    )
    comps = completions_batch(recs, env.tok, max_length=c.max_length, prompt_length=s.prompt_length)
    env.say(f"distill: the {c.teacher} policy into SFT, {len(recs)} teacher samples")
    res = run_distill(
        env.policies["sft"], teacher, env.tok, prompts, comps, cfg=c, ctx=env.ctx("distill")
    )
    return Outcome(res, policy=final_policy(res.state.model), summary={"teacher": c.teacher})


def _completion_pairs(records) -> list[tuple[str, str]]:
    """`(prompt, completion)` of each record: a preference pair's chosen response, a
    demonstration's last trained turn (a conversation's last assistant message, the
    messages before it the prompt, as TRL's `GKDTrainer` reads its `messages`)."""
    out = []
    for r in records:
        if isinstance(r, tuple):
            out.append(r)
        elif isinstance(r, data.DemonstrationRecord):
            last = r.last_turn()
            out.append((last.prompt, last.completion))
        else:
            out.append((r.prompt, r.chosen))
    return out


def distill_on_data(env: StageEnv, c: DistillConfig) -> Outcome:
    """GKD on the prompts and completions of a data file, the teacher a checkpoint
    directory (`distill.teacher`): a preference file's chosen responses, or
    demonstrations in TRL's prompt-completion or conversational `messages` layouts
    (read as `sft` reads them; a conversation's last assistant message is
    the completion). Language-modelling text, which has no prompt to sample from, is
    refused. With `lmbda > 0` or `seq_kd` the training prompts longer than
    `sampling.prompt_length` are left out (sampled steps sample from whole prompts), named
    by their lines in a `prompts_left_out` event (`log_left_out`). Held out: the mean
    generalized JSD per completion token before and after."""
    cfg, policy, tok = env.cfg, env.base, env.tok
    s = cfg.sampling
    teacher = load_teacher(c.teacher, policy)
    records, rendered = demonstrations(env)
    if records is None:
        train, held, numbers = located_preference_split(env, c, log_cuts=False)
        what = "pairs"
    elif records.report.format == "text":
        raise ValueError(
            f"data.path={cfg.data.path}: language-modelling text has no prompt; distill "
            "needs prompts with completions (preference pairs, prompt/completion or "
            "messages records)"
        )
    else:
        train, held, numbers = located_demonstration_split(
            env, c, records, rendered, log_cuts=False
        )
        what = "demonstrations"
    train, held = _completion_pairs(train), _completion_pairs(held)
    if c.samples_completions:
        # sampled steps (on-policy, seq_kd) sample from the prompt: it must fit whole
        why = f"distill.lmbda={c.lmbda}" if c.lmbda > 0 else "distill.seq_kd"
        whole = [prompt_tokens(tok, r[0]) <= s.prompt_length for r in train]
        fits = [r for r, ok in zip(train, whole) if ok]
        log_left_out(
            env.ctx("").log,
            cfg.data.path,
            len(train),
            [
                (
                    "long_prompt",
                    f"longer than sampling.prompt_length={s.prompt_length} with BOS",
                    [n for n, ok in zip(numbers, whole) if not ok],
                )
            ],
            f"the sampled steps ({why}) sample from whole prompts: raise "
            "sampling.prompt_length to keep them, or set distill.lmbda=0 without "
            "distill.seq_kd (a long prompt is then cut, its end kept)",
        )
        if not fits:
            raise ValueError(
                f"sampling.prompt_length={s.prompt_length}: no training prompt fits, and the "
                f"sampled steps ({why}) sample from whole prompts; raise "
                "sampling.prompt_length or set distill.lmbda=0 without distill.seq_kd"
            )
        env.summary["data_quality"]["longer_than_prompt_length"] = len(train) - len(fits)
        if len(fits) < len(train):
            env.say(
                f"distill: {len(train) - len(fits)} training prompts longer than "
                f"sampling.prompt_length={s.prompt_length} left out (sampled steps sample "
                "from whole prompts; data.filter=long_prompt drops them from the start)"
            )
        train = fits
        numbers = [n for n, ok in zip(numbers, whole) if ok]
    # the cuts of the records trained on, after the prompts left out (if any)
    report_cuts(env, c, train, numbers, what)
    lengths = dict(max_length=c.max_length, prompt_length=s.prompt_length, add_eos=DATA_EOS)
    comps = completions_batch(train, tok, **lengths)
    hb = completions_batch(held, tok, **lengths)
    env.say(f"distill: {len(train)} training / {len(held)} held-out prompts, teacher {c.teacher}")
    kw = dict(beta=c.beta)  # at the loss's temperature, τ = 1 (as TRL's GKDTrainer)
    before = distill_divergence(policy, teacher, hb, **kw)
    ctx = data_ctx(env)
    res = run_distill(policy, teacher, tok, [r[0] for r in train], comps, cfg=c, ctx=ctx)
    trained = trained_policy(env, res.state.model)
    env.summary["distill"] = {
        "teacher": c.teacher,
        "heldout_jsd_before": before,
        "heldout_jsd": distill_divergence(trained, teacher, hb, **kw),
    }
    return Outcome(res, policy=trained)


def distill_needs(cfg) -> tuple[str, ...]:
    """The teacher stage first, unless `distill.teacher` is a checkpoint directory."""
    teacher = find_stage(cfg.distill.teacher)
    before = teacher.prerequisites(cfg) if teacher is not None else ("sft",)
    return (*before, "distill")


register_stage(
    Stage(
        "distill",
        DistillConfig,
        distill,
        distill_on_data,
        needs=distill_needs,
        help="generalized knowledge distillation from distill.teacher",
        check_run=check_run,
        task=dict(steps=40, batch_size=16, samples=2, optim=_optim(1e-3)),
        key_stream=("fold", 10),
    )
)
