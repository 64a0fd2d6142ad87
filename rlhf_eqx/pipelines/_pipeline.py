"""The default pipeline on the built-in animal task: SFT, then reward model -> PPO, DPO
and GRPO from SFT, each evaluated on held-out prompts against SFT."""

import os
import sys
import time

import jax
import numpy as np

import rlhf_eqx as rx
from rlhf_eqx import data

from ._config import ConfigError, PipelineConfig
from ._config_io import config_to_dict
from ._distill_runs import completions_batch, run_distill, sampled_completions
from ._dpo_runs import run_online_dpo
from ._evaluate import evaluate_policy, reward_accuracy, win_rate
from ._kto_runs import run_kto, sampled_unpaired
from ._metrics import MetricsLog
from ._monitor import measure_matmul_peak
from ._rl_runs import run_grpo, run_ppo
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
from ._task import HELDOUT_PROMPTS, TRAIN_PROMPTS, animal_score, noisy_scores
from ._validate import validate_config


def load_model(source: str = "builtin", tokenizer: str | None = None):
    """`(policy, tokenizer)` from `"builtin"` (the shipped stories260K), a llama2.c `.bin`
    file (with `tokenizer`) or a Hugging Face checkpoint directory.

    A checkpoint directory without `tokenizer` uses the tokenizer file found in it
    (`tokenizer.json`, `tokenizer.model` or `tokenizer.bin`: the run exports put one
    there). The tokenizer is checked against the model (`data.check_vocab`) before
    anything is compiled: a `ConfigError` naming `model.tokenizer` and both vocabulary
    sizes."""
    from rlhf_eqx.assets import asset_path

    if source == "builtin":
        return rx.load_llama2c(asset_path("stories260K.bin"), tokenizer or asset_path("tok512.bin"))
    if os.path.isdir(source):
        policy = rx.load_hf(source)
        tok = data.load_tokenizer(tokenizer or source)
    else:
        policy, tok = rx.load_llama2c(source, tokenizer)
    try:
        data.check_vocab(tok, policy.cfg.vocab_size)
    except data.DataError as e:
        raise ConfigError(f"model.tokenizer={tokenizer!r}: {e}") from None
    return policy, tok


def tokenizer_file(source: str = "builtin", tokenizer: str | None = None) -> str | None:
    """The tokenizer file `load_model(source, tokenizer)` reads (exports copy it)."""
    from rlhf_eqx.assets import asset_path

    if tokenizer is not None:
        return tokenizer
    if source == "builtin":
        return asset_path("tok512.bin")
    if os.path.isdir(source):
        for name in ("tokenizer.json", "tokenizer.model", "tokenizer.bin"):
            if os.path.isfile(os.path.join(source, name)):
                return os.path.join(source, name)
    return None


def _labels(noise: float, seed: int):
    """Noisy scorer labels (deterministic per call site `salt`)."""

    def label(prompts, texts, salt):
        del prompts
        return noisy_scores([animal_score(t) for t in texts], noise=noise, seed=seed * 7919 + salt)

    return label


def _rm_label(rm, tok, cfg: PipelineConfig):
    """Labels from a reward model's scores of `prompt + completion` (RLAIF)."""
    from ._rollout import reward_model_scores

    def label(prompts, texts, salt):
        del salt
        seqs, _ = data.tokenize_sft(
            list(zip(prompts, texts)),
            tok,
            max_length=cfg.dpo.max_length,
            max_prompt_length=cfg.sampling.prompt_length,
            add_eos=False,
        )
        batch = data.collate_sft(seqs, max_length=cfg.dpo.max_length, pad_id=tok.pad_id)
        return np.asarray(reward_model_scores(rm, batch.tokens, batch.mask)).tolist()

    return label


def _ctx(
    cfg: PipelineConfig,
    run_dir: str,
    stage: str,
    key,
    resume: bool,
    evaluate=None,
    *,
    peak_flops: float | None = None,
) -> RunContext:
    s = cfg.sampling
    return RunContext(
        ops=cfg.ops,
        log=MetricsLog(run_dir, stage, quiet=cfg.ops.quiet, tensorboard=cfg.ops.tensorboard),
        key=key,
        checkpoint_dir=os.path.join(run_dir, stage, "checkpoints"),
        resume=resume,
        **sampling_options(s),
        meta={"stage": stage, "config": config_to_dict(cfg)},
        evaluate=evaluate,
        peak_flops=peak_flops,
    )


def format_table(summary: dict) -> str:
    """The printed final table of a pipeline summary."""
    lines = [f"{'stage':<8} {'score':>7} {'win vs SFT':>11} {'KL/token':>9} {'base NLL':>9}"]
    for stage in ("base", "sft", "ppo", "dpo", "grpo", "online-dpo", "kto", "distill"):
        if stage not in summary:
            continue
        s = summary[stage]
        win = s.get("win_rate_vs_sft")
        kl = s.get("kl")
        lines.append(
            f"{stage:<8} {s['score']:>7.1%} {'' if win is None else f'{win:.1%}':>11} "
            f"{'' if kl is None else f'{kl:.3f}':>9} {s['base_nll']:>9.2f}"
        )
    if "reward_model" in summary:
        lines.append(
            f"reward model held-out accuracy: {summary['reward_model']['heldout_accuracy']:.1%}"
        )
    return "\n".join(lines)


def run_pipeline(cfg: PipelineConfig, *, resume: bool = False, overwrite: bool = False) -> dict:
    """Run the pipeline of `cfg` in `cfg.out`: `summary.json`, `metrics.jsonl`,
    `config.json`, PNG plots, `<stage>/hf/` checkpoints with their tokenizer; returns the
    summary.

    The configuration is validated first (`validate_config`: a `ConfigError` naming the
    field), then the run directory is taken (`open_run_dir`: one owner, no new run
    into an old one unless `overwrite` moves it aside, `resume` checks the stored
    configuration). `summary["stopped"]` is `"done"`, or `"diverged"` when a stage
    diverged past its rollbacks (the pipeline stops there, and that stage's export is
    its last verified, finite state); each stage's entry says how it stopped.
    """
    validate_config(cfg)
    run_dir = cfg.out or os.path.join("runs", "pipeline")
    with open_run_dir(cfg, run_dir, resume=resume, overwrite=overwrite) as rd:
        say = (lambda *a: None) if cfg.ops.quiet else print
        print(f"run directory: {run_dir}")
        for note in rd.notes:
            print(f"note: {note}", file=sys.stderr)
        return _run_pipeline(cfg, run_dir, rd.resume, say)


def _run_pipeline(cfg: PipelineConfig, run_dir: str, resume: bool, say) -> dict:
    t0 = time.perf_counter()
    s = cfg.sampling
    base, tok = load_model(cfg.model.source, cfg.model.tokenizer)
    tok_file = tokenizer_file(cfg.model.source, cfg.model.tokenizer)
    key = jax.random.key(cfg.ops.seed)
    k_eval, k_sft, k_rm, k_ppo, k_dpo, k_grpo, k_data, k_online = jax.random.split(key, 8)
    k_kto, k_distill = jax.random.fold_in(key, 9), jax.random.fold_in(key, 10)
    teacher = None  # the policy of the stage `distill.teacher` names, once it has run
    label = _labels(cfg.label_noise, cfg.ops.seed)
    log = MetricsLog(run_dir, "pipeline", quiet=cfg.ops.quiet)
    peak = measure_matmul_peak() if cfg.ops.monitor else None

    def evaluate(policy, reference):
        return evaluate_policy(
            policy,
            tok,
            HELDOUT_PROMPTS,
            k_eval,
            scorer=animal_score,
            base=base,
            reference=reference,
            samples=cfg.eval_samples,
            **sampling_options(s),
        )

    summary: dict = {"stopped": "done"}
    base_metrics, _, _ = evaluate(base, None)
    summary["base"] = base_metrics
    say(f"base model: {base_metrics['score']:.1%} of held-out stories mention an animal")

    # SFT on the base model's best-of-n samples (by noisy labels).
    roll = sample_rollout(
        base,
        tok,
        TRAIN_PROMPTS,
        jax.random.fold_in(k_data, 0),
        group_size=cfg.sft.samples,
        **sampling_options(s),
    )
    labels = np.asarray(label(roll.prompts, roll.texts, 1)).reshape(-1, cfg.sft.samples)
    best = labels.argmax(axis=1)
    records = [
        (p, roll.texts[j * cfg.sft.samples + b])
        for j, (p, b) in enumerate(zip(TRAIN_PROMPTS, best))
    ]
    say(f"sft: {len(records)} demonstrations (best of {cfg.sft.samples} by noisy labels)")
    res = run_sft(
        base,
        tok,
        records,
        cfg=cfg.sft,
        ctx=_ctx(cfg, run_dir, "sft", k_sft, resume, peak_flops=peak),
    )
    sft = final_policy(res.state.model)
    sft_metrics, _, sft_scores = evaluate(sft, base)
    sft_metrics["stopped"] = res.loop.stopped
    summary["sft"] = sft_metrics
    export_policy(sft, run_dir, "sft", adapted=res.state.model, tokenizer_file=tok_file)
    say(f"sft: {sft_metrics['score']:.1%}")

    def periodic(policy):
        m, _, scores = evaluate(policy, sft)
        m["win_rate_vs_sft"] = win_rate(scores, sft_scores)
        return m

    def finish(stage, res) -> bool:
        """Evaluate and export a stage; False when it diverged (the pipeline stops)."""
        model = res.state.model
        if stage == "ppo":
            model = model[0]
        policy = final_policy(model)
        m, _, scores = evaluate(policy, sft)
        m["win_rate_vs_sft"] = win_rate(scores, sft_scores)
        m["stopped"] = res.loop.stopped
        summary[stage] = m
        if stage == cfg.distill.teacher:
            nonlocal teacher
            teacher = policy
        export_policy(policy, run_dir, stage, adapted=model, tokenizer_file=tok_file)
        say(
            f"{stage}: {m['score']:.1%} (win rate vs SFT {m['win_rate_vs_sft']:.1%}, "
            f"KL {m['kl']:.3f})" + ("" if m["stopped"] == "done" else f"; stopped: {m['stopped']}")
        )
        return _continue(stage, res)

    def _continue(stage, res) -> bool:
        if res.loop.stopped == "diverged":
            summary["stopped"] = "diverged"
            summary["diverged_stage"] = stage
            return False
        return True

    go = _continue("sft", res)
    if go and "reward" in cfg.stages:
        r = cfg.reward
        n = r.pairs_per_prompt
        roll = sample_rollout(
            sft,
            tok,
            TRAIN_PROMPTS,
            jax.random.fold_in(k_data, 1),
            group_size=2 * n,
            **sampling_options(s),
        )
        true = np.asarray([animal_score(t) for t in roll.texts])
        noisy = np.asarray(label(roll.prompts, roll.texts, 2))
        pairs, clean = [], []
        for j in range(0, len(roll.texts), 2):
            if true[j] != true[j + 1]:
                c, w = (
                    (j, j + 1)
                    if noisy[j] > noisy[j + 1]
                    or (noisy[j] == noisy[j + 1] and true[j] > true[j + 1])
                    else (j + 1, j)
                )
                pairs.append(data.PreferenceRecord(roll.prompts[j], roll.texts[c], roll.texts[w]))
        heldout_roll = sample_rollout(
            sft,
            tok,
            HELDOUT_PROMPTS,
            jax.random.fold_in(k_data, 2),
            group_size=2 * n,
            **sampling_options(s),
        )
        ht = np.asarray([animal_score(t) for t in heldout_roll.texts])
        for j in range(0, len(heldout_roll.texts), 2):
            if ht[j] != ht[j + 1]:
                c, w = (j, j + 1) if ht[j] > ht[j + 1] else (j + 1, j)
                clean.append(
                    data.PreferenceRecord(
                        heldout_roll.prompts[j], heldout_roll.texts[c], heldout_roll.texts[w]
                    )
                )
        say(f"reward: {len(pairs)} noisily labelled pairs, {len(clean)} clean held-out pairs")
        res = run_reward(
            sft, tok, pairs, cfg=r, ctx=_ctx(cfg, run_dir, "reward", k_rm, resume, peak_flops=peak)
        )
        rm = res.state.model
        export_reward_model(rm, run_dir, tokenizer_file=tok_file)
        held = collate_pairs(clean, tok, max_length=r.max_length, prompt_length=s.prompt_length)
        acc = reward_accuracy(rm, held)
        summary["reward_model"] = {
            "heldout_accuracy": acc,
            "train_accuracy": res.info.get("train_accuracy"),
            "validation_accuracy": res.info.get("validation_accuracy"),
            "selected_step": res.info.get("selected_step", r.steps),
            "train_pairs": res.info.get("train_pairs", len(pairs)),
            "validation_pairs": res.info.get("validation_pairs", 0),
            "heldout_pairs": len(clean),
            "stopped": res.loop.stopped,
        }
        say(
            f"reward model: clean held-out accuracy {acc:.1%}"
            + (
                f" (kept step {res.info['selected_step']} of {r.steps}: training accuracy "
                f"{res.info['train_accuracy']:.1%}, noisy validation accuracy "
                f"{res.info['validation_accuracy']:.1%})"
                if res.info
                else ""
            )
        )
        go = _continue("reward", res)
        if go and "ppo" in cfg.stages:
            res = run_ppo(
                sft,
                tok,
                TRAIN_PROMPTS,
                reward=rm,
                cfg=cfg.ppo,
                ctx=_ctx(cfg, run_dir, "ppo", k_ppo, resume, periodic, peak_flops=peak),
            )
            go = finish("ppo", res)
        if go and "online-dpo" in cfg.stages:
            res = run_online_dpo(
                sft,
                tok,
                TRAIN_PROMPTS,
                _rm_label(rm, tok, cfg),
                cfg=cfg.dpo,
                ctx=_ctx(cfg, run_dir, "online-dpo", k_online, resume, periodic, peak_flops=peak),
            )
            go = finish("online-dpo", res)
    if go and "dpo" in cfg.stages:
        res = run_online_dpo(
            sft,
            tok,
            TRAIN_PROMPTS,
            label,
            cfg=cfg.dpo,
            ctx=_ctx(cfg, run_dir, "dpo", k_dpo, resume, periodic, peak_flops=peak),
        )
        go = finish("dpo", res)
    if go and "grpo" in cfg.stages:
        fns = [RewardFunction("animal", lambda p, t: animal_score(t))]
        res = run_grpo(
            sft,
            tok,
            TRAIN_PROMPTS,
            reward_fns=fns,
            cfg=cfg.grpo,
            ctx=_ctx(cfg, run_dir, "grpo", k_grpo, resume, periodic, peak_flops=peak),
        )
        go = finish("grpo", res)

    if go and "kto" in cfg.stages:
        records = sampled_unpaired(
            sft,
            tok,
            TRAIN_PROMPTS,
            jax.random.fold_in(k_data, 3),
            label,
            samples=cfg.kto.samples,
            salt=4,
            sampling=s,
        )
        good = sum(r.label for r in records)
        say(f"kto: {good} desirable / {len(records) - good} undesirable samples (noisy labels)")
        res = run_kto(
            sft,
            tok,
            records,
            cfg=cfg.kto,
            ctx=_ctx(cfg, run_dir, "kto", k_kto, resume, periodic, peak_flops=peak),
        )
        go = finish("kto", res)

    if go and "distill" in cfg.stages:
        dc = cfg.distill
        if teacher is None:  # a checkpoint directory
            teacher, _ = load_model(dc.teacher)
        prompts, recs = sampled_completions(
            teacher,
            tok,
            TRAIN_PROMPTS,
            jax.random.fold_in(k_data, 5),
            samples=dc.samples,
            sampling=s,
        )
        comps = completions_batch(
            recs, tok, max_length=dc.max_length, prompt_length=s.prompt_length
        )
        say(f"distill: the {dc.teacher} policy into SFT, {len(recs)} teacher samples")
        res = run_distill(
            sft,
            teacher,
            tok,
            prompts,
            comps,
            cfg=dc,
            ctx=_ctx(cfg, run_dir, "distill", k_distill, resume, periodic, peak_flops=peak),
        )
        go = finish("distill", res)
        summary["distill"]["teacher"] = dc.teacher

    summary["seconds"] = time.perf_counter() - t0
    write_json_atomic(os.path.join(run_dir, "summary.json"), summary)
    log.write({"event": "summary", "seconds": summary["seconds"], "stopped": summary["stopped"]})
    try:
        from ._plots import plot_run

        plot_run(run_dir)
    except ImportError:
        print("note: install matplotlib (pip install 'rlhf_eqx[plot]') for PNG plots")
    say("\n" + format_table(summary))
    if summary["stopped"] != "done":
        print(
            f"stopped: {summary['diverged_stage']} diverged (see the diverged event in "
            f"{run_dir}/metrics.jsonl); later stages were not run",
            file=sys.stderr,
        )
    say(f"\nrun directory: {run_dir} ({summary['seconds']:.0f} s)")
    return summary
