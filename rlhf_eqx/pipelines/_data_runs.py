"""Single-stage runs on a data file: SFT, reward model and DPO on preference data (e.g.
HH-RLHF), GRPO on prompts with reference answers (e.g. GSM8K, exact-match reward)."""

import json
import os
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import rlhf_eqx as rx
from rlhf_eqx import data

from ._config import DataConfig, PipelineConfig
from ._config_io import config_to_dict
from ._dpo_runs import run_dpo
from ._evaluate import reward_accuracy
from ._metrics import MetricsLog
from ._monitor import measure_matmul_peak
from ._rl_runs import run_grpo
from ._rollout import RewardFunction, sample_rollout, sampling_options
from ._runs import (
    RunContext,
    collate_pairs,
    export_policy,
    export_reward_model,
    final_policy,
    run_reward,
    run_sft,
)


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


def quality_report(records, tok, lengths: "data.SequenceLengths", dc: DataConfig, log: MetricsLog):
    """`data.preference_quality` of the training `records`, written to the run log and as a
    `data_quality` event in `metrics.jsonl`; with `dc.filter`, `data.filter_preferences`
    drops those problems and a `data_filter` event says how many of each went.

    **Returns:** `(records to train on, report)`.
    """
    report = data.preference_quality(records, tokenizer=tok, lengths=lengths)
    log.write(
        {
            "event": "data_quality",
            "message": report.summary(),
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
    log.info("data quality:\n  " + report.summary().replace("\n", "\n  "))
    if not dc.filter:
        return list(records), report
    kept, dropped = data.filter_preferences(records, drop=dc.filter)
    counts = {k: len(v) for k, v in dropped.items()}
    log.event(
        "data_filter",
        f"dropped {sum(counts.values())} of {len(records)} pairs ("
        + ", ".join(f"{k}: {n}" for k, n in counts.items())
        + ")",
        kept=len(kept),
        **{f"dropped_{k}": n for k, n in counts.items()},
    )
    if not kept:
        raise ValueError(f"data.filter={dc.filter}: every training pair was dropped")
    return list(kept), report


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


def run_on_data(cfg: PipelineConfig, stage: str, *, resume: bool = False) -> dict:
    """Run `stage` (`sft`, `reward`, `dpo`, `grpo`) on `cfg.data.path`; write
    `summary.json`, `metrics.jsonl`, `config.json` and the trained model in `cfg.out`
    (`<stage>/hf/`; a reward model as `...ForSequenceClassification` in `reward/hf/`;
    LoRA adapters alone in the PEFT layout in `<stage>/adapter/`); return the summary."""
    from ._pipeline import load_model

    if cfg.data.path is None:
        raise ValueError("data.path: a data file is needed (--set data.path=FILE)")
    run_dir = cfg.out or os.path.join("runs", stage)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(config_to_dict(cfg), f, indent=1)
    policy, tok = load_model(cfg.model.source, cfg.model.tokenizer)
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
        train, quality = quality_report(train, tok, lengths, cfg.data, ctx.log)
        _, report = data.tokenize_preferences(train, tok, lengths=lengths, add_eos=False)
        summary["truncation"] = {
            "records": report.total,
            "prompt_truncated": report.prompt_truncated,
            "completion_truncated": report.completion_truncated,
            "policy": report.summary(),
        }
        summary["data_quality"] = {
            "identical": len(quality.identical),
            "empty": len(quality.empty),
            "exact_duplicates": len(quality.exact_duplicates),
            "duplicate_prompts": len(quality.duplicate_prompts),
            "distinct_2": quality.distinct_2,
        }
        say(
            f"{stage}: {len(train)} training / {len(held)} held-out records; "
            f"truncation: {report.summary()}"
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
                "heldout_accuracy": reward_accuracy(res.state.model, held_batch)
            }
            export_reward_model(res.state.model, run_dir)
            trained = None
        else:
            res = run_dpo(policy, tok, train, cfg=c, ctx=ctx)
            trained = final_policy(res.state.model)
            summary["dpo"] = {
                "heldout_reward_accuracy": float(
                    _implicit_accuracy(trained, policy, held_batch, c.beta)
                )
            }
    elif stage == "grpo":
        prompts = data.load_prompts(cfg.data.path, cfg.data.format)
        fits = [
            r
            for r in prompts
            if r.answer is not None and len(tok.encode(r.prompt)) + 1 <= s.prompt_length
        ]
        say(
            f"grpo: {len(fits)} of {len(prompts)} prompts have an answer and fit "
            f"sampling.prompt_length={s.prompt_length}"
        )
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
            roll = sample_rollout(
                m,
                tok,
                hp,
                k,
                **sampling_options(s),
            )
            rates.append(float(np.mean([exact(p, t) for p, t in zip(roll.prompts, roll.texts)])))
        summary["grpo"] = {"heldout_exact_match_before": rates[0], "heldout_exact_match": rates[1]}
    else:
        raise ValueError(f"stage {stage!r} does not run on a data file (sft, reward, dpo, grpo)")
    summary["stopped"] = res.loop.stopped
    if trained is not None:
        export_policy(trained, run_dir, stage, adapted=res.state.model)
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    try:
        from ._plots import plot_run

        plot_run(run_dir)
    except ImportError:
        pass
    say(json.dumps(summary, indent=1))
    return summary
