"""KTO (Ethayarajh et al. 2024), the `kto` stage: its settings (`KTOConfig`), its run on
unpaired examples (a reference computed once, the reference point estimated from
mismatched completions in each batch), the stage on the built-in task (SFT samples
labelled by the noisy scorer) and on an unpaired or preference file, and its
registration."""

import dataclasses
from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import numpy as np
from jaxtyping import PRNGKeyArray

import rlhf_eqx as rx
from rlhf_eqx import data

from ..losses import KTO_LOSS_TYPES
from ..train import KTOSettings
from ._config import BatchStageConfig, DataConfig, LoRASettings, _optim
from ._data_prep import (
    DATA_EOS,
    chat_records,
    data_ctx,
    implicit_accuracy,
    is_preference_file,
    log_filter,
    log_skipped,
    log_truncation,
    prompt_tokens,
    quality_report,
    record_numbers,
    refuse_other_filters,
    split_records,
    trained_policy,
)
from ._field_checks import _above, _at_least, _choice, _fail
from ._metrics import MetricsLog
from ._registry import Outcome, Stage, StageEnv, register_stage
from ._rollout import sample_rollout, sampling_options
from ._runs import (
    RunContext,
    RunResult,
    collate_pairs,
    final_policy,
    run_on_rows,
    train_setup,
)
from ._sampled_eval import heldout_samples
from ._task import TRAIN_PROMPTS
from ._validation import validate_stage


@dataclasses.dataclass(frozen=True)
class KTOConfig(BatchStageConfig):
    """KTO (Ethayarajh et al. 2024; TRL `KTOTrainer` defaults) on unpaired examples, each
    one completion labelled desirable or undesirable: `beta`, the weights of the two
    kinds (`desirable_weight`, `undesirable_weight`; the paper keeps
    `desirable_weight · n_desirable / (undesirable_weight · n_undesirable)` in [1, 4/3]),
    `loss_type` (`kto` or `apo_zero_unpaired`), the reference point estimated from
    mismatched completions in each batch, a cached reference. On the built-in task the
    examples are `samples` completions per prompt of the SFT policy, labelled by the
    noisy scorer; on a data file, unpaired JSONL (`prompt`, `completion`, `label`) or
    preference pairs split into one desirable and one undesirable example each."""

    steps: int = 40
    beta: float = KTOSettings.beta
    desirable_weight: float = KTOSettings.desirable_weight
    undesirable_weight: float = KTOSettings.undesirable_weight
    loss_type: str = KTOSettings.loss_type
    samples: int = 4
    lora: LoRASettings = LoRASettings()

    def check(self, name: str, *, device_count: int = 1) -> None:
        """KTO's own rules: β > 0, weights >= 0, a known loss type, two samples or more."""
        del device_count
        _above(f"{name}.beta", self.beta, 0)
        _at_least(f"{name}.desirable_weight", self.desirable_weight, 0)
        _at_least(f"{name}.undesirable_weight", self.undesirable_weight, 0)
        _choice(f"{name}.loss_type", self.loss_type, KTO_LOSS_TYPES)
        if self.samples < 2:
            _fail(f"{name}.samples", self.samples, "must be >= 2")


def collate_unpaired_records(
    records: Sequence[data.UnpairedRecord],
    tok,
    *,
    max_length: int,
    prompt_length: int,
    kl: bool = True,
    add_eos: bool | str = False,
) -> rx.train.KTOBatch:
    """Tokenise `prompt + completion` right-padded to `max_length`, with (`kl`) the
    mismatched rows KTO's reference point needs (`data.collate_unpaired`;
    `loss_type="apo_zero_unpaired"` reads none); `add_eos` as `RunContext.add_eos`
    (default no EOS: sampled completions hold theirs)."""
    tokenized, _ = data.tokenize_unpaired(
        list(records), tok, max_length=max_length, max_prompt_length=prompt_length, add_eos=add_eos
    )
    return data.collate_unpaired(tokenized, pad_id=tok.pad_id, max_length=max_length, kl=kl)


def run_kto(
    model, tok, records: Sequence[data.UnpairedRecord], *, cfg: KTOConfig, ctx: RunContext
) -> RunResult:
    """KTO (Ethayarajh et al. 2024; TRL `KTOTrainer`) on unpaired records: LoRA adapters
    per `cfg.lora` (the reference is the model without them), reference log-probs
    computed once (`compute_kto_reference_logps`), `cfg.steps` steps of `cfg.batch_size`
    examples (`make_kto_step`); the mismatched rows only for `loss_type="kto"`."""
    validate_stage("kto", cfg)
    records = list(records)
    labels = {bool(r.label) for r in records}
    if labels != {True, False}:
        kind = "desirable" if True in labels else "undesirable"
        raise ValueError(
            f"KTO needs desirable and undesirable examples; all {len(records)} are {kind}"
        )
    kl = cfg.loss_type == "kto"  # the other loss has no reference point
    full = collate_unpaired_records(
        records,
        tok,
        max_length=cfg.max_length,
        prompt_length=ctx.prompt_length,
        kl=kl,
        add_eos=ctx.add_eos,
    )
    k_lora, ctx_key = jax.random.split(ctx.key)
    settings = rx.train.KTOSettings(
        beta=cfg.beta,
        desirable_weight=cfg.desirable_weight,
        undesirable_weight=cfg.undesirable_weight,
        loss_type=cfg.loss_type,
        reference="cached",
    )
    state, reference, step = train_setup(
        model, cfg, cfg.steps, k_lora, rx.train.make_kto_step, settings
    )
    full = rx.train.compute_kto_reference_logps(reference, full)
    return run_on_rows(
        state,
        step,
        full,
        cfg,
        ctx,
        ctx_key,
        row_tokens=(2 if kl else 1) * cfg.max_length,
        policy_of=lambda s: s.model,
    )


def sampled_unpaired(
    policy,
    tok,
    prompts: Sequence[str],
    key: PRNGKeyArray,
    label: Callable[[Sequence[str], Sequence[str], int], Sequence[float]],
    *,
    samples: int,
    salt: int,
    sampling,
) -> list[data.UnpairedRecord]:
    """`samples` completions per prompt from `policy`, each labelled desirable when
    `label(prompts, texts, salt)` exceeds 0.5 (the built-in task's noisy scorer)."""
    roll = sample_rollout(
        policy, tok, prompts, key, group_size=samples, **sampling_options(sampling)
    )
    scores = np.asarray(label(roll.prompts, roll.texts, salt), np.float64)
    return [
        data.UnpairedRecord(p, t, bool(s > 0.5))
        for p, t, s in zip(roll.prompts, roll.texts, scores)
    ]


@eqx.filter_jit
def _logratios(policy, reference, batch):
    lp = rx.train.sequence_logps
    cm = batch.completion_mask
    return lp(policy, batch.tokens, batch.mask, cm) - lp(reference, batch.tokens, batch.mask, cm)


def kto_heldout_metrics(policy, reference, batch: rx.train.KTOBatch, beta: float) -> dict:
    """Held-out implicit rewards `β · log(π/π_ref)` of unpaired examples: their mean over
    the desirable and the undesirable ones, the margin between the two, and the
    fraction of (desirable, undesirable) combinations ordered correctly, with the number
    of examples of each kind (`heldout_desirable`, `heldout_undesirable`). With examples
    of one kind only, the mean of that kind alone (no margin, no ordering)."""
    r = beta * np.asarray(_logratios(policy, reference, batch), np.float64)
    y = np.asarray(batch.label, bool)
    good, bad = r[y], r[~y]
    out = {"heldout_desirable": int(len(good)), "heldout_undesirable": int(len(bad))}
    if len(good):
        out["heldout_reward_desirable"] = float(good.mean())
    if len(bad):
        out["heldout_reward_undesirable"] = float(bad.mean())
    if len(good) and len(bad):
        out["heldout_reward_margin"] = float(good.mean() - bad.mean())
        out["heldout_ordering_accuracy"] = float(np.mean(good[:, None] > bad[None, :]))
    return out


def kto(env: StageEnv, c: KTOConfig) -> Outcome:
    """KTO from SFT on the built-in task, on SFT samples labelled by the noisy scorer (a
    `kto_weights` event when their weighted balance lies outside [1, 4/3], and the
    number of examples of each kind in the summary, as on a data file)."""
    sft_policy = env.policies["sft"]
    records = sampled_unpaired(
        sft_policy,
        env.tok,
        TRAIN_PROMPTS,
        env.data_key(3),
        env.label,
        samples=c.samples,
        salt=4,
        sampling=env.cfg.sampling,
    )
    good = sum(r.label for r in records)
    env.say(f"kto: {good} desirable / {len(records) - good} undesirable samples (noisy labels)")
    ctx = env.ctx("kto")
    if 0 < good < len(records):  # one label only is refused by `run_kto`
        _check_kto_weights(c, records, ctx.log)
    res = run_kto(sft_policy, env.tok, records, cfg=c, ctx=ctx)
    counts = {"train_desirable": good, "train_undesirable": len(records) - good}
    return Outcome(res, policy=final_policy(res.state.model), summary=counts)


def kto_on_data(env: StageEnv, c: KTOConfig) -> Outcome:
    """KTO on an unpaired file (`prompt`, `completion`, `label`) or on preference pairs,
    each split into a desirable and an undesirable example (`unpaired_from_preferences`);
    the held-out part is split by prompt before any splitting of pairs;
    `summary["kto"]` also counts the training examples of each kind."""
    train, held, held_pairs = kto_examples(env, c)
    res = run_kto(env.base, env.tok, train, cfg=c, ctx=data_ctx(env))
    trained = trained_policy(env, res.state.model)
    good = sum(bool(r.label) for r in train)
    counts = {"train_desirable": good, "train_undesirable": len(train) - good}
    env.summary["kto"] = {**kto_data_metrics(env, c, trained, held, held_pairs), **counts}
    return Outcome(res, policy=trained)


def kto_examples(env: StageEnv, c: KTOConfig) -> tuple[list, list, list | None]:
    """`kto_on_data`'s examples: `(train, held, held_pairs)`, the training and held-out
    examples of the file and, for a preference file, its held-out pairs (else `None`);
    the reader's and the quality report's counts in `env.summary["data_quality"]` (and,
    for an unpaired file, a `skipped_records` event naming the lines the reader left
    out)."""
    cfg, tok, ctx = env.cfg, env.tok, env.ctx("")
    s = cfg.sampling
    path = cfg.data.path
    held_pairs = None
    try:
        records = data.load_unpaired(path, cfg.data.format, **cfg.data.read_options())
        pairs = None
    except data.DataError:
        if not is_preference_file(path, **cfg.data.read_options()):
            raise
        pairs = data.load_preferences(path, cfg.data.format, **cfg.data.read_options())
        records = None
    source = records if records is not None else pairs
    raw, held = split_records(source, cfg.data)
    train, held = chat_records(env, raw, source), chat_records(env, held, source)
    env.summary["data_quality"] = {"skipped_by_reader": dict(source.report.skipped)}
    if pairs is not None:
        env.summary["data_quality"]["pairs"] = len(train) + len(held)
        lengths = data.SequenceLengths(max_length=c.max_length, max_prompt_length=s.prompt_length)
        train, _ = quality_report(train, tok, lengths, cfg.data, ctx.log, source.report)
        held_pairs = held
        train = data.unpaired_from_preferences(train)
        held = data.unpaired_from_preferences(held)
    else:
        log_skipped(ctx.log, source.report)  # a preference file's is in its quality report
        if cfg.data.filter:
            train = _filter_unpaired(train, tok, cfg.data, s.prompt_length, ctx.log)
        numbers = record_numbers(source, raw, train)
        env.summary["truncation"] = _unpaired_truncation(
            train, tok, c.max_length, s.prompt_length, ctx.log, path, numbers
        )
    _check_kto_split(cfg.data, train, held)
    note = _one_kind_held_out(cfg.data, held)
    if note:
        ctx.log.event("heldout_one_label", note)
    _check_kto_weights(c, train, ctx.log)
    good = sum(r.label for r in train)
    env.say(
        f"kto: {len(train)} training examples ({good} desirable, {len(train) - good} "
        f"undesirable), {len(held)} held out"
        + (" (from preference pairs)" if pairs is not None else "")
    )
    return train, held, held_pairs


def _unpaired_truncation(
    records: list,
    tok,
    max_length: int,
    prompt_length: int,
    log: MetricsLog,
    path,
    numbers: dict[int, int],
) -> dict:
    """`summary["truncation"]` of an unpaired file's training examples, as a preference
    file's: how many prompts (cut to `prompt_length`, their end kept) and completions
    (cut to `max_length`) the tokeniser cut, as `collate_unpaired_records` cuts them; a
    `truncation` event when any was (`log_truncation`), naming the first cut examples by
    their number in the file (`numbers`: `record_numbers` of the examples;
    `truncated_records`)."""
    _, report = data.tokenize_unpaired(
        records, tok, max_length=max_length, max_prompt_length=prompt_length, add_eos=DATA_EOS
    )
    named = log_truncation(
        log,
        path,
        report,
        f"completions cut (their end lost, to fit kto.max_length={max_length})",
        f"raise sampling.prompt_length={prompt_length} or kto.max_length, or leave the long "
        "prompts out with data.filter=long_prompt",
        [numbers.get(id(r)) for r in records],
    )
    return {
        "records": report.total,
        "prompt_truncated": report.prompt_truncated,
        "completion_truncated": report.completion_truncated,
        "truncated_records": named,
        "policy": report.summary(),
    }


def _check_kto_split(dc: DataConfig, train: list, held: list) -> None:
    """Refuse, before anything is trained, a split KTO cannot train or evaluate on: training
    examples of one label only, or fewer than two held-out examples (the held-out
    reference point needs a mismatched row from another example)."""
    where = f"data.path={dc.path}"
    if {bool(r.label) for r in train} != {True, False}:
        kind = "desirable" if train and train[0].label else "undesirable"
        column = dc.columns.get("label", "label")
        raise data.DataError(
            f"{where}: KTO needs desirable and undesirable examples; the {len(train)} training "
            f"examples (of {len(train) + len(held)}) are all {kind} (column '{column}')"
        )
    if len(held) < 2:
        raise data.DataError(
            f"{where}: {len(held)} example held out (data.heldout_fraction="
            f"{dc.heldout_fraction}); KTO's held-out metrics need at least two: raise "
            "data.heldout_fraction or try another data.seed"
        )


def _one_kind_held_out(dc: DataConfig, held: list) -> str | None:
    """What the held-out metrics lack when the `held` examples are of one label only
    (their margin and ordering accuracy compare the two kinds); `None` otherwise."""
    labels = {bool(r.label) for r in held}
    if len(labels) != 1:
        return None
    kind = "undesirable" if True in labels else "desirable"
    return (
        f"no {kind} example among the {len(held)} held out (data.heldout_fraction="
        f"{dc.heldout_fraction}, data.seed={dc.seed}): no held-out margin or ordering "
        "accuracy; raise data.heldout_fraction or try another data.seed"
    )


def _check_kto_weights(c: KTOConfig, train: list, log: MetricsLog) -> None:
    """A `kto_weights` event when the training examples' weighted balance
    `λ_D · n_D / (λ_U · n_U)` lies outside [1, 4/3], the range Ethayarajh et al. (2024)
    recommend (TRL's `KTOTrainer` warns likewise), with the `desirable_weight` range that
    would bring it back for the current `undesirable_weight`. A weight of 0 (one kind
    switched off on purpose) and a split of one label (refused before) say nothing."""
    n_good = sum(bool(r.label) for r in train)
    n_bad = len(train) - n_good
    num, den = c.desirable_weight * n_good, c.undesirable_weight * n_bad
    if num <= 0 or den <= 0 or 1 <= num / den <= 4 / 3:
        return
    ratio, low = num / den, den / n_good
    log.event(
        "kto_weights",
        f"kto.desirable_weight·n_desirable / (kto.undesirable_weight·n_undesirable) = "
        f"{c.desirable_weight:g}·{n_good} / ({c.undesirable_weight:g}·{n_bad}) = {ratio:.3g}, "
        "outside the recommended [1, 4/3]; for these examples kto.desirable_weight in "
        f"[{low:.3g}, {4 / 3 * low:.3g}] (with kto.undesirable_weight="
        f"{c.undesirable_weight:g}) brings it back",
        ratio=ratio,
    )


def kto_data_metrics(
    env: StageEnv, c: KTOConfig, trained, held: list, held_pairs, reuse: dict | None = None
) -> dict:
    """`summary["kto"]` of a run on a data file: `kto_heldout_metrics` of the `trained`
    policy against the base on the `held` examples, the implicit reward accuracy on the
    `held_pairs` (a preference file's), and held-out samples (`reuse`: as in
    `sampled_comparison`)."""
    policy, tok, pl = env.base, env.tok, env.cfg.sampling.prompt_length
    lengths = dict(max_length=c.max_length, prompt_length=pl, add_eos=DATA_EOS)
    held_batch = collate_unpaired_records(held, tok, **lengths)
    out = kto_heldout_metrics(trained, policy, held_batch, c.beta)
    note = _one_kind_held_out(env.cfg.data, held)
    if note:
        out["note"] = note
    if held_pairs is not None:
        hb = collate_pairs(held_pairs, tok, **lengths)
        out["heldout_pair_accuracy"] = float(implicit_accuracy(trained, policy, hb, c.beta))
    out["sampled"] = heldout_samples(env, policy, trained, held, reuse)
    return out


UNPAIRED_FILTERS: tuple[str, ...] = ("empty", "long_prompt")
"""The `data.filter` problems that apply to an unpaired KTO file's examples."""


def _filter_unpaired(records, tok, dc: DataConfig, prompt_length: int, log: MetricsLog):
    """`data.filter` on unpaired examples: `empty` (an empty completion) and `long_prompt`
    (a prompt with BOS longer than `prompt_length`) apply; a `data_filter` event counts
    what went. The others (`identical`, `exact_duplicate`, `duplicate_prompt`: a
    pair's or a demonstration's problems) are refused naming the field, rather than
    ignored."""
    refuse_other_filters(
        dc,
        UNPAIRED_FILTERS,
        f"not a problem of unpaired KTO examples (on an unpaired file only "
        f"{' and '.join(UNPAIRED_FILTERS)} apply; the others are problems of preference "
        "pairs or demonstrations)",
    )
    counts: dict[str, int] = {}
    kept = list(records)
    if "empty" in dc.filter:
        n = len(kept)
        kept = [r for r in kept if r.completion.strip()]
        counts["empty"] = n - len(kept)
    if "long_prompt" in dc.filter:
        n = len(kept)
        kept = [r for r in kept if prompt_tokens(tok, r.prompt) <= prompt_length]
        counts["long_prompt"] = n - len(kept)
    log_filter(log, dc, counts, len(records), kept, "examples")
    return kept


register_stage(
    Stage(
        "kto",
        KTOConfig,
        kto,
        kto_on_data,
        help="KTO on unpaired examples",
        task=dict(steps=40, batch_size=16, samples=4, optim=_optim(5e-4)),
        key_stream=("fold", 9),
    )
)
