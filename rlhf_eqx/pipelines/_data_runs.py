"""Single-stage runs on a data file: SFT, reward model and DPO on preference data (e.g.
HH-RLHF), GRPO on prompts with reference answers (e.g. GSM8K, exact-match reward)."""

import json
import os
import sys
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import rlhf_eqx as rx
from rlhf_eqx import data

from ._config import ConfigError, DataConfig, PipelineConfig
from ._config_io import config_to_dict
from ._dpo_runs import run_dpo
from ._evaluate import reward_accuracy
from ._metrics import MetricsLog
from ._monitor import measure_matmul_peak
from ._rl_runs import run_grpo
from ._rollout import RewardFunction, sample_rollout, sampling_options
from ._rundir import open_run_dir, write_json_atomic
from ._runs import (
    RunContext,
    collate_pairs,
    export_policy,
    export_reward_model,
    final_policy,
    run_reward,
    run_sft,
)
from ._validate import validate_config


def split_records(records: Sequence, dc: DataConfig) -> tuple[list, list]:
    """Split records into training and held-out parts as the data runs do.

    **Arguments:**

    - `records`: preference or prompt records (anything with a `.prompt`).
    - `dc`: the run's `DataConfig`; `limit` (0: all), `heldout_fraction` and `seed`
      are used.

    **Returns:**

    `(train, heldout)`: the first `dc.limit` records split by prompt with
    `data.split_held_out` (seeded by `dc.seed`; no prompt on both sides).

    **Raises:** `ValueError` naming `data.heldout_fraction` when either side is empty.
    """
    records = list(records)[: dc.limit or None]
    train, held = data.split_held_out(records, fraction=dc.heldout_fraction, seed=dc.seed)
    if not train or not held:
        raise ValueError(
            f"data.heldout_fraction={dc.heldout_fraction}: the split of {len(records)} "
            f"records by prompt left {len(train)} for training and {len(held)} held out; "
            "use more records or another fraction"
        )
    return list(train), list(held)


def _prompt_tokens(tok, prompt: str) -> int:
    """The length of `prompt` as the model sees it: its tokens and BOS (what must fit
    `sampling.prompt_length` for the prompt to stay whole)."""
    return len(tok.encode(prompt)) + 1


def quality_report(
    records,
    tok,
    lengths: "data.SequenceLengths",
    dc: DataConfig,
    log: MetricsLog,
    load_report: "data.LoadReport | None" = None,
):
    """`data.preference_quality` of the training `records`, written to the run log and as a
    `data_quality` event in `metrics.jsonl` (with what the reader dropped, from
    `load_report`); with `dc.filter`, `data.filter_preferences` drops those problems
    (`long_prompt`: pairs whose prompt with BOS does not fit the prompt length of
    `lengths`, so that every prompt trained on is whole) and a `data_filter` event says
    how many of each went.

    **Returns:** `(records to train on, report)`.
    """
    report = data.preference_quality(records, tokenizer=tok, lengths=lengths)
    dropped = dict(load_report.skipped) if load_report is not None else {}
    message = report.summary()
    if dropped:
        message += "\nDropped by the reader: " + ", ".join(f"{k}: {v}" for k, v in dropped.items())
    log.write(
        {
            "event": "data_quality",
            "message": message,
            "skipped_by_reader": sum(dropped.values()),
            **{f"skipped/{k}": v for k, v in dropped.items()},
            "pairs": report.total,
            "distinct_prompts": report.distinct_prompts,
            "identical": len(report.identical),
            "empty": len(report.empty),
            "exact_duplicates": len(report.exact_duplicates),
            "duplicate_prompts": len(report.duplicate_prompts),
            "prompt_length_mean": report.prompt_lengths.mean,
            "chosen_length_mean": report.chosen_lengths.mean,
            "rejected_length_mean": report.rejected_lengths.mean,
            "distinct_1": report.distinct_1,
            "distinct_2": report.distinct_2,
            "truncation": report.truncation.summary() if report.truncation else None,
        }
    )
    log.info("data quality:\n  " + message.replace("\n", "\n  "))
    if not dc.filter:
        return list(records), report
    records = list(records)
    kept, dropped = data.filter_preferences(
        records, drop=tuple(f for f in dc.filter if f != "long_prompt")
    )
    counts = {k: len(v) for k, v in dropped.items()}
    if "long_prompt" in dc.filter:
        limit = lengths.max_prompt_length
        fits = [r for r in kept if _prompt_tokens(tok, r.prompt) <= limit]
        counts["long_prompt"] = len(kept) - len(fits)
        kept = fits
    _log_filter(log, dc, counts, len(records), kept, "pairs")
    return list(kept), report


def _log_filter(log: MetricsLog, dc: DataConfig, counts: dict, total: int, kept, what: str):
    """The `data_filter` event of `data.filter` (how many of each kind went); a
    `ValueError` when nothing is left to train on."""
    log.event(
        "data_filter",
        f"dropped {total - len(kept)} of {total} {what} ("
        + ", ".join(f"{k}: {n}" for k, n in counts.items())
        + ")",
        kept=len(kept),
        **{f"dropped_{k}": n for k, n in counts.items()},
    )
    if not kept:
        raise ValueError(f"data.filter={dc.filter}: every training {what[:-1]} was dropped")


@eqx.filter_jit
def _implicit_accuracy(policy, reference, batch, beta):
    lp = rx.train.sequence_logps
    margin = (
        lp(policy, batch.chosen_tokens, batch.chosen_mask, batch.chosen_completion_mask)
        - lp(reference, batch.chosen_tokens, batch.chosen_mask, batch.chosen_completion_mask)
        - lp(policy, batch.rejected_tokens, batch.rejected_mask, batch.rejected_completion_mask)
        + lp(reference, batch.rejected_tokens, batch.rejected_mask, batch.rejected_completion_mask)
    )
    return jnp.mean((beta * margin > 0).astype(jnp.float32))


@eqx.filter_jit
def _nll(model, batch):
    logps = rx.train.sequence_logps(model, batch.tokens, batch.mask, batch.completion_mask)
    return -jnp.sum(logps) / jnp.sum(batch.completion_mask & batch.mask).astype(jnp.float32)


def run_on_data(
    cfg: PipelineConfig, stage: str, *, resume: bool = False, overwrite: bool = False
) -> dict:
    """Run `stage` (`sft`, `reward`, `dpo`, `grpo`) on `cfg.data.path`; write
    `summary.json`, `metrics.jsonl`, `config.json` and the trained model in `cfg.out`
    (`<stage>/hf/` with its tokenizer; a reward model as `...ForSequenceClassification`
    in `reward/hf/`; LoRA adapters alone in the PEFT layout in `<stage>/adapter/`);
    return the summary.

    The configuration is validated first and the run directory taken as
    `run_pipeline` does (`open_run_dir`). Pairs the reader dropped (identical or empty
    completions, unsplittable transcripts) are counted in the data-quality report and
    `summary["data_quality"]["skipped_by_reader"]`; `summary["stopped"]` is `"done"`,
    `"kl_guard"` or `"diverged"`."""
    if stage not in DATA_STAGES:
        raise ConfigError(
            f"stage {stage!r} does not run on a data file (choices: {', '.join(DATA_STAGES)})"
        )
    if cfg.data.path is None:
        raise ConfigError("data.path=None: a data file is needed (--data FILE)")
    validate_config(cfg)
    run_dir = cfg.out or os.path.join("runs", stage)
    with open_run_dir(cfg, run_dir, resume=resume, overwrite=overwrite) as rd:
        print(f"run directory: {run_dir}")
        for note in rd.notes:
            print(f"note: {note}", file=sys.stderr)
        return _run_on_data(cfg, stage, run_dir, rd.resume)


DATA_STAGES: tuple[str, ...] = ("sft", "reward", "dpo", "grpo", "kto", "distill")


def _run_on_data(cfg: PipelineConfig, stage: str, run_dir: str, resume: bool) -> dict:
    from ._pipeline import load_model, tokenizer_file

    policy, tok = load_model(cfg.model.source, cfg.model.tokenizer)
    tok_file = tokenizer_file(cfg.model.source, cfg.model.tokenizer)
    s = cfg.sampling
    ctx = RunContext(
        ops=cfg.ops,
        log=MetricsLog(run_dir, stage, quiet=cfg.ops.quiet, tensorboard=cfg.ops.tensorboard),
        key=jax.random.key(cfg.ops.seed),
        checkpoint_dir=os.path.join(run_dir, stage, "checkpoints"),
        resume=resume,
        **sampling_options(s),
        meta={"stage": stage, "config": config_to_dict(cfg)},
        peak_flops=measure_matmul_peak() if cfg.ops.monitor else None,
    )
    say = (lambda *a: None) if cfg.ops.quiet else print
    summary: dict = {"data": cfg.data.path}
    if stage in ("sft", "reward", "dpo"):
        records = data.load_preferences(cfg.data.path, cfg.data.format)
        train, held = split_records(records, cfg.data)
        c = {"sft": cfg.sft, "reward": cfg.reward, "dpo": cfg.dpo}[stage]
        lengths = data.SequenceLengths(max_length=c.max_length, max_prompt_length=s.prompt_length)
        train, quality = quality_report(train, tok, lengths, cfg.data, ctx.log, records.report)
        _, report = data.tokenize_preferences(train, tok, lengths=lengths, add_eos=False)
        summary["truncation"] = {
            "records": report.total,
            "prompt_truncated": report.prompt_truncated,
            "completion_truncated": report.completion_truncated,
            "policy": report.summary(),
        }
        summary["data_quality"] = {
            "skipped_by_reader": dict(records.report.skipped),
            "identical": len(quality.identical),
            "empty": len(quality.empty),
            "exact_duplicates": len(quality.exact_duplicates),
            "duplicate_prompts": len(quality.duplicate_prompts),
            "distinct_2": quality.distinct_2,
        }
        skipped = records.report.num_skipped
        say(
            f"{stage}: {len(train)} training / {len(held)} held-out records"
            + (f" ({skipped} dropped by the reader: {records.report})" if skipped else "")
        )
        held_batch = collate_pairs(
            held, tok, max_length=c.max_length, prompt_length=s.prompt_length
        )
        if stage == "sft":
            seqs, _ = data.tokenize_sft(
                held, tok, max_length=c.max_length, max_prompt_length=s.prompt_length, add_eos=False
            )
            hb = data.collate_sft(seqs, max_length=c.max_length, pad_id=tok.pad_id)
            before = float(_nll(policy, hb))
            res = run_sft(policy, tok, [(r.prompt, r.chosen) for r in train], cfg=c, ctx=ctx)
            trained = final_policy(res.state.model)
            after = float(_nll(trained, hb))
            summary["sft"] = {
                "heldout_nll_before": before,
                "heldout_nll": after,
                "heldout_perplexity": float(np.exp(after)),
            }
        elif stage == "reward":
            res = run_reward(policy, tok, train, cfg=c, ctx=ctx)
            summary["reward_model"] = {
                "heldout_accuracy": reward_accuracy(res.state.model, held_batch),
                **res.info,
            }
            export_reward_model(res.state.model, run_dir, tokenizer_file=tok_file)
            trained = None
        else:
            res = run_dpo(policy, tok, train, cfg=c, ctx=ctx)
            trained = final_policy(res.state.model)
            summary["dpo"] = {
                "heldout_reward_accuracy": float(
                    _implicit_accuracy(trained, policy, held_batch, c.beta)
                )
            }
    elif stage == "kto":
        trained, res = _kto_on_data(cfg, policy, tok, ctx, summary, say)
    elif stage == "distill":
        trained, res = _distill_on_data(cfg, policy, tok, ctx, summary, say)
    else:
        prompts = data.load_prompts(cfg.data.path, cfg.data.format)
        with_answer = [r for r in prompts if r.answer is not None]
        if not with_answer:
            raise ValueError(
                f"data.path={cfg.data.path}: none of its {len(prompts)} prompts has a reference "
                f"answer (format {prompts.report.format!r}); GRPO on a data file needs prompts "
                "with answers for its exact-match reward, e.g. GSM8K's '#### <int>'"
                + (
                    " (this looks like a preference file: run sft, reward or dpo on it)"
                    if _is_preference_file(cfg.data.path)
                    else ""
                )
            )
        fits = [r for r in with_answer if _prompt_tokens(tok, r.prompt) <= s.prompt_length]
        if not fits:
            longest = min(_prompt_tokens(tok, r.prompt) for r in with_answer)
            raise ValueError(
                f"sampling.prompt_length={s.prompt_length}: no prompt fits (the shortest of "
                f"{len(with_answer)} prompts with answers has {longest} tokens with BOS); "
                "raise sampling.prompt_length"
            )
        say(
            f"grpo: {len(fits)} of {len(prompts)} prompts have an answer and fit "
            f"sampling.prompt_length={s.prompt_length}"
        )
        summary["data_quality"] = {
            "skipped_by_reader": dict(prompts.report.skipped),
            "without_answer": len(prompts) - len(with_answer),
            "longer_than_prompt_length": len(with_answer) - len(fits),
        }
        train, held = split_records(fits, cfg.data)
        answers = {r.prompt: r.answer for r in fits}

        def exact(prompt, completion):
            return float(data.exact_match_reward([completion], [answers[prompt]])[0])

        fns = [RewardFunction("exact_match", exact)]
        res = run_grpo(
            policy, tok, [r.prompt for r in train], reward_fns=fns, cfg=cfg.grpo, ctx=ctx
        )
        trained = final_policy(res.state.model)
        hp = [r.prompt for r in held]
        k = jax.random.key(cfg.ops.seed + 1)
        rates = []
        for m in (policy, trained):
            roll = sample_rollout(m, tok, hp, k, **sampling_options(s))
            rates.append(float(np.mean([exact(p, t) for p, t in zip(roll.prompts, roll.texts)])))
        summary["grpo"] = {"heldout_exact_match_before": rates[0], "heldout_exact_match": rates[1]}
    summary["stopped"] = res.loop.stopped
    if trained is not None:
        export_policy(trained, run_dir, stage, adapted=res.state.model, tokenizer_file=tok_file)
    write_json_atomic(os.path.join(run_dir, "summary.json"), summary)
    try:
        from ._plots import plot_run

        plot_run(run_dir)
    except ImportError:
        pass
    say(json.dumps(summary, indent=1))
    return summary


def _kto_on_data(cfg: PipelineConfig, policy, tok, ctx: RunContext, summary: dict, say):
    """KTO on an unpaired file (`prompt`, `completion`, `label`) or on preference pairs,
    each split into a desirable and an undesirable example (`unpaired_from_preferences`);
    the held-out part is split by prompt before any splitting of pairs."""
    from ._kto_runs import collate_unpaired_records, kto_heldout_metrics, run_kto

    c, s = cfg.kto, cfg.sampling
    path = cfg.data.path
    try:
        records = data.load_unpaired(path, cfg.data.format)
        pairs = None
    except data.DataError:
        if not _is_preference_file(path):
            raise
        pairs = data.load_preferences(path, cfg.data.format)
        records = None
    source = records if records is not None else pairs
    train, held = split_records(source, cfg.data)
    summary["data_quality"] = {"skipped_by_reader": dict(source.report.skipped)}
    if pairs is not None:
        summary["data_quality"]["pairs"] = len(train) + len(held)
        lengths = data.SequenceLengths(max_length=c.max_length, max_prompt_length=s.prompt_length)
        train, _ = quality_report(train, tok, lengths, cfg.data, ctx.log, source.report)
        held_pairs = held
        train = data.unpaired_from_preferences(train)
        held = data.unpaired_from_preferences(held)
    elif cfg.data.filter:
        train = _filter_unpaired(train, tok, cfg.data, s.prompt_length, ctx.log)
    good = sum(r.label for r in train)
    say(
        f"kto: {len(train)} training examples ({good} desirable, {len(train) - good} "
        f"undesirable), {len(held)} held out"
        + (" (from preference pairs)" if pairs is not None else "")
    )
    res = run_kto(policy, tok, train, cfg=c, ctx=ctx)
    trained = final_policy(res.state.model)
    held_batch = collate_unpaired_records(
        held, tok, max_length=c.max_length, prompt_length=s.prompt_length
    )
    summary["kto"] = kto_heldout_metrics(trained, policy, held_batch, c.beta)
    if pairs is not None:
        hb = collate_pairs(held_pairs, tok, max_length=c.max_length, prompt_length=s.prompt_length)
        summary["kto"]["heldout_pair_accuracy"] = float(
            _implicit_accuracy(trained, policy, hb, c.beta)
        )
    return trained, res


def _filter_unpaired(records, tok, dc: DataConfig, prompt_length: int, log: MetricsLog):
    """`data.filter` on unpaired examples: `empty` (an empty completion) and `long_prompt`
    (a prompt with BOS longer than `prompt_length`) apply; a `data_filter` event counts
    what went. The pair filters (`identical`, `exact_duplicate`) do not apply."""
    counts: dict[str, int] = {}
    kept = list(records)
    if "empty" in dc.filter:
        n = len(kept)
        kept = [r for r in kept if r.completion.strip()]
        counts["empty"] = n - len(kept)
    if "long_prompt" in dc.filter:
        n = len(kept)
        kept = [r for r in kept if _prompt_tokens(tok, r.prompt) <= prompt_length]
        counts["long_prompt"] = n - len(kept)
    _log_filter(log, dc, counts, len(records), kept, "examples")
    return kept


def _distill_on_data(cfg: PipelineConfig, policy, tok, ctx: RunContext, summary: dict, say):
    """GKD on the prompts and chosen responses of a preference file, the teacher a
    checkpoint directory (`distill.teacher`); held out: the mean generalized JSD per
    completion token before and after."""
    from ._distill_runs import completions_batch, distill_divergence, run_distill
    from ._pipeline import load_model

    c, s = cfg.distill, cfg.sampling
    teacher, _ = load_model(c.teacher)
    records = data.load_preferences(cfg.data.path, cfg.data.format)
    train, held = split_records(records, cfg.data)
    sl = data.SequenceLengths(max_length=c.max_length, max_prompt_length=s.prompt_length)
    train, _ = quality_report(train, tok, sl, cfg.data, ctx.log, records.report)
    summary["data_quality"] = {"skipped_by_reader": dict(records.report.skipped)}
    if c.lmbda > 0:
        # on-policy steps sample from the prompt: it must fit whole
        fits = [r for r in train if _prompt_tokens(tok, r.prompt) <= s.prompt_length]
        if not fits:
            raise ValueError(
                f"sampling.prompt_length={s.prompt_length}: no training prompt fits, and the "
                f"on-policy steps (distill.lmbda={c.lmbda}) sample from whole prompts; raise "
                "sampling.prompt_length or set distill.lmbda=0"
            )
        summary["data_quality"]["longer_than_prompt_length"] = len(train) - len(fits)
        if len(fits) < len(train):
            say(
                f"distill: {len(train) - len(fits)} training prompts longer than "
                f"sampling.prompt_length={s.prompt_length} left out (on-policy steps sample "
                "from whole prompts; data.filter=long_prompt drops them from the start)"
            )
        train = fits
    lengths = dict(max_length=c.max_length, prompt_length=s.prompt_length)
    comps = completions_batch([(r.prompt, r.chosen) for r in train], tok, **lengths)
    hb = completions_batch([(r.prompt, r.chosen) for r in held], tok, **lengths)
    say(f"distill: {len(train)} training / {len(held)} held-out prompts, teacher {c.teacher}")
    kw = dict(beta=c.beta, temperature=c.temperature)
    before = distill_divergence(policy, teacher, hb, **kw)
    res = run_distill(policy, teacher, tok, [r.prompt for r in train], comps, cfg=c, ctx=ctx)
    trained = final_policy(res.state.model)
    summary["distill"] = {
        "teacher": c.teacher,
        "heldout_jsd_before": before,
        "heldout_jsd": distill_divergence(trained, teacher, hb, **kw),
    }
    return trained, res


def _is_preference_file(path: str) -> bool:
    try:
        data.load_preferences(path)
        return True
    except (ValueError, OSError):
        return False
