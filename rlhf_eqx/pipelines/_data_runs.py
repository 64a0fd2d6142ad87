"""Single-stage runs on a data file: SFT, reward model and DPO on preference data (e.g.
HH-RLHF), GRPO on prompts with reference answers (e.g. GSM8K, exact-match reward)."""

import json
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import rlhf_eqx as rx
from rlhf_eqx import data

from ._config import PipelineConfig, config_to_dict
from ._evaluate import reward_accuracy
from ._ops import MetricsLog
from ._rollout import RewardFunction, sample_rollout
from ._runs import RunContext, collate_pairs, final_policy, run_dpo, run_grpo, run_reward, run_sft

__all__ = ["run_on_data", "split_records"]


def split_records(records, *, heldout_fraction: float, seed: int, limit: int = 0):
    """`(train, heldout)`: the first `limit` records (0: all), split at random (seeded)."""
    records = list(records)[: limit or None]
    if len(records) < 2:
        raise ValueError(f"need at least 2 records, got {len(records)}")
    perm = np.random.default_rng(seed).permutation(len(records))
    n_held = max(1, int(round(heldout_fraction * len(records))))
    return [records[i] for i in perm[n_held:]], [records[i] for i in perm[:n_held]]


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
    `summary.json`, `metrics.jsonl`, `config.json` and the trained model (`<stage>/hf/`,
    for policies) in `cfg.out`; return the summary."""
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
        log=MetricsLog(run_dir, stage, quiet=cfg.ops.quiet),
        key=jax.random.key(cfg.ops.seed),
        checkpoint_dir=os.path.join(run_dir, stage, "checkpoints"),
        resume=resume,
        prompt_length=s.prompt_length,
        max_new_tokens=s.max_new_tokens,
        temperature=s.temperature,
        meta={"stage": stage, "config": config_to_dict(cfg)},
    )
    say = (lambda *a: None) if cfg.ops.quiet else print
    split = dict(
        heldout_fraction=cfg.data.heldout_fraction, seed=cfg.data.seed, limit=cfg.data.limit
    )
    summary: dict = {"data": cfg.data.path}
    if stage in ("sft", "reward", "dpo"):
        records = data.load_preferences(cfg.data.path, cfg.data.format)
        train, held = split_records(records, **split)
        c = {"sft": cfg.sft, "reward": cfg.reward, "dpo": cfg.dpo}[stage]
        _, report = data.tokenize_preferences(
            train, tok, max_length=c.max_length, max_prompt_length=s.prompt_length, add_eos=False
        )
        summary["truncation"] = {
            "records": report.total,
            "prompt_truncated": report.prompt_truncated,
            "completion_truncated": report.completion_truncated,
        }
        say(
            f"{stage}: {len(train)} training / {len(held)} held-out records; "
            f"{report.prompt_truncated} prompts and {report.completion_truncated} "
            f"completions truncated (sampling.prompt_length={s.prompt_length}, "
            f"{stage}.max_length={c.max_length})"
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
        train, held = split_records(fits, **split)
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
                prompt_length=s.prompt_length,
                max_new_tokens=s.max_new_tokens,
                temperature=s.temperature,
            )
            rates.append(float(np.mean([exact(p, t) for p, t in zip(roll.prompts, roll.texts)])))
        summary["grpo"] = {"heldout_exact_match_before": rates[0], "heldout_exact_match": rates[1]}
    else:
        raise ValueError(f"stage {stage!r} does not run on a data file (sft, reward, dpo, grpo)")
    summary["stopped"] = res.loop.stopped
    if trained is not None:
        rx.save_hf(trained, os.path.join(run_dir, stage, "hf"))
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    try:
        from ._plots import plot_run

        plot_run(run_dir)
    except ImportError:
        pass
    say(json.dumps(summary, indent=1))
    return summary
