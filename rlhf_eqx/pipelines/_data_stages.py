"""The stages on a data file (`rlhf_eqx STAGE --data FILE`), each `(env, cfg) -> Outcome`
(registered in `_stages.py`): SFT, reward model and DPO on preference data (e.g.
HH-RLHF), GRPO on prompts with reference answers (e.g. GSM8K), KTO on unpaired or
preference data, distillation from a checkpoint, a process reward model on stepwise
solutions."""

import jax
import numpy as np

import rlhf_eqx as rx
from rlhf_eqx import data

from ._config import (
    DataConfig,
)
from ._data_prep import (
    chat_rendering,
    implicit_accuracy,
    is_preference_file,
    log_filter,
    nll,
    prompt_tokens,
    quality_report,
    split_records,
)
from ._distill_runs import completions_batch, distill_divergence, load_teacher, run_distill
from ._dpo_runs import run_dpo
from ._evaluate import binomial_se, reward_accuracy
from ._grpo_runs import run_grpo
from ._kto_runs import collate_unpaired_records, kto_heldout_metrics, run_kto
from ._metrics import MetricsLog
from ._prm_runs import prm_on_data
from ._registry import Outcome, StageEnv
from ._reward_runs import run_reward
from ._reward_sources import (
    EnsembleReward,
    export_prm,
    export_reward_ensemble,
    stage_reward_source,
)
from ._rollout import RewardFunction
from ._runs import collate_pairs, export_reward_model, final_policy, run_sft
from ._sampled_eval import heldout_samples, sampled_comparison


def _unpack(env: StageEnv):
    return env.cfg, env.base, env.tok, env.ctx(""), env.summary, env.say


def _final(env: StageEnv, model):
    """`final_policy` (adapters merged); on a quantised base (`model.quantized`) the
    packed weights are decoded first, so the merged policy is dense."""
    return final_policy(rx.dequantize(model) if env.cfg.model.quantized else model)


def _chat_split(env: StageEnv, records) -> tuple[list, list]:
    """`split_records`, then both sides through the model's chat template
    (`chat_rendering` of `data.chat_template`; the split is that of the file's text)."""
    train, held = split_records(records, env.cfg.data)
    return _chat(env, train), _chat(env, held)


def _chat(env: StageEnv, records) -> list:
    rendering = chat_rendering(env.tok, env.cfg.data)
    if rendering is None:
        return list(records)
    env.summary["chat_template"] = env.cfg.data.chat_template
    return rendering.records(records)


def _preferences(env: StageEnv, c):
    """The preference file's training and held-out pairs (the quality report logged,
    `data.filter` applied), its truncation and quality in the summary."""
    cfg, _, tok, ctx, summary, say = _unpack(env)
    s = cfg.sampling
    records = data.load_preferences(cfg.data.path, cfg.data.format)
    train, held = _chat_split(env, records)
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
        f"{env.stage}: {len(train)} training / {len(held)} held-out records"
        + (f" ({skipped} dropped by the reader: {records.report})" if skipped else "")
    )
    return train, held


def sft(env: StageEnv, c) -> Outcome:
    cfg, policy, tok, ctx, summary, _ = _unpack(env)
    train, held = _preferences(env, c)
    pl = cfg.sampling.prompt_length
    seqs, _ = data.tokenize_sft(
        held, tok, max_length=c.max_length, max_prompt_length=pl, add_eos=False
    )
    hb = data.collate_sft(seqs, max_length=c.max_length, pad_id=tok.pad_id)
    before = float(nll(policy, hb))
    res = run_sft(policy, tok, [(r.prompt, r.chosen) for r in train], cfg=c, ctx=ctx)
    trained = _final(env, res.state.model)
    after = float(nll(trained, hb))
    summary["sft"] = {
        "heldout_nll_before": before,
        "heldout_nll": after,
        "heldout_perplexity": float(np.exp(after)),
        "sampled": heldout_samples(env, policy, trained, held),
    }
    return Outcome(res, policy=trained)


def reward(env: StageEnv, c) -> Outcome:
    cfg, policy, tok, ctx, summary, _ = _unpack(env)
    train, held = _preferences(env, c)
    held_batch = collate_pairs(
        held, tok, max_length=c.max_length, prompt_length=cfg.sampling.prompt_length
    )
    res = run_reward(policy, tok, train, cfg=c, ctx=ctx)
    rm = res.state.model
    if c.ensemble > 1:
        scorer = EnsembleReward(rm, c.ensemble_penalty, c.ensemble_mode)
        kw = dict(penalty=c.ensemble_penalty, mode=c.ensemble_mode)
        export_reward_ensemble(rm, env.run_dir, **kw, tokenizer_file=env.tok_file)
    else:
        scorer = rm
        export_reward_model(rm, env.run_dir, tokenizer_file=env.tok_file)
    acc = reward_accuracy(scorer, held_batch)
    se = binomial_se(acc, held_batch.chosen_tokens.shape[0])
    summary["reward_model"] = {"heldout_accuracy": acc, "heldout_accuracy_se": se, **res.info}
    return Outcome(res)


def dpo(env: StageEnv, c) -> Outcome:
    cfg, policy, tok, ctx, summary, _ = _unpack(env)
    train, held = _preferences(env, c)
    held_batch = collate_pairs(
        held, tok, max_length=c.max_length, prompt_length=cfg.sampling.prompt_length
    )
    res = run_dpo(policy, tok, train, cfg=c, ctx=ctx)
    trained = _final(env, res.state.model)
    accuracy = implicit_accuracy(trained, policy, held_batch, c.beta)
    n_held = held_batch.chosen_tokens.shape[0]
    summary["dpo"] = {
        "heldout_reward_accuracy": float(accuracy),
        "heldout_reward_accuracy_se": binomial_se(float(accuracy), n_held),
        "sampled": heldout_samples(env, policy, trained, held),
    }
    return Outcome(res, policy=trained)


def grpo(env: StageEnv, c) -> Outcome:
    """GRPO on prompts with reference answers: the exact-match reward (or `c.reward_source`),
    the held-out exact-match rate before and after."""
    cfg, policy, tok, ctx, summary, say = _unpack(env)
    s = cfg.sampling
    prompts = data.load_prompts(cfg.data.path, cfg.data.format)
    with_answer = [r for r in prompts if r.answer is not None]
    if not with_answer:
        raise ValueError(
            f"data.path={cfg.data.path}: none of its {len(prompts)} prompts has a reference "
            f"answer (format {prompts.report.format!r}); GRPO on a data file needs prompts "
            "with answers for its exact-match reward, e.g. GSM8K's '#### <int>'"
            + (
                " (this looks like a preference file: run sft, reward or dpo on it)"
                if is_preference_file(cfg.data.path)
                else ""
            )
        )
    with_answer = _chat(env, with_answer)
    fits = [r for r in with_answer if prompt_tokens(tok, r.prompt) <= s.prompt_length]
    if not fits:
        longest = min(prompt_tokens(tok, r.prompt) for r in with_answer)
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

    reward = stage_reward_source(
        c,
        task=[RewardFunction("exact_match", exact)],
        tokenizer=tok,
        judge=cfg.judge,
        judges={"base": policy},
    )
    res = run_grpo(policy, tok, [r.prompt for r in train], reward=reward, cfg=c, ctx=ctx)
    trained = _final(env, res.state.model)
    k = jax.random.key(cfg.ops.seed + 1)
    ev = sampled_comparison(
        policy, trained, tok, [r.prompt for r in held], k, cfg, score=exact, max_prompts=0
    )
    summary["grpo"] = {
        "heldout_exact_match_before": ev.pop("score_before"),
        "heldout_exact_match_before_se": ev.pop("score_before_se"),
        "heldout_exact_match": ev.pop("score_after"),
        "heldout_exact_match_se": ev.pop("score_after_se"),
        "sampled": ev,
    }
    return Outcome(res, policy=trained)


def kto(env: StageEnv, c) -> Outcome:
    """KTO on an unpaired file (`prompt`, `completion`, `label`) or on preference pairs,
    each split into a desirable and an undesirable example (`unpaired_from_preferences`);
    the held-out part is split by prompt before any splitting of pairs."""
    cfg, policy, tok, ctx, summary, say = _unpack(env)
    s = cfg.sampling
    path = cfg.data.path
    try:
        records = data.load_unpaired(path, cfg.data.format)
        pairs = None
    except data.DataError:
        if not is_preference_file(path):
            raise
        pairs = data.load_preferences(path, cfg.data.format)
        records = None
    source = records if records is not None else pairs
    train, held = _chat_split(env, source)
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
    trained = _final(env, res.state.model)
    held_batch = collate_unpaired_records(
        held, tok, max_length=c.max_length, prompt_length=s.prompt_length
    )
    summary["kto"] = kto_heldout_metrics(trained, policy, held_batch, c.beta)
    if pairs is not None:
        hb = collate_pairs(held_pairs, tok, max_length=c.max_length, prompt_length=s.prompt_length)
        summary["kto"]["heldout_pair_accuracy"] = float(
            implicit_accuracy(trained, policy, hb, c.beta)
        )
    summary["kto"]["sampled"] = heldout_samples(env, policy, trained, held)
    return Outcome(res, policy=trained)


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
        kept = [r for r in kept if prompt_tokens(tok, r.prompt) <= prompt_length]
        counts["long_prompt"] = n - len(kept)
    log_filter(log, dc, counts, len(records), kept, "examples")
    return kept


def distill(env: StageEnv, c) -> Outcome:
    """GKD on the prompts and chosen responses of a preference file, the teacher a
    checkpoint directory (`distill.teacher`); held out: the mean generalized JSD per
    completion token before and after."""
    cfg, policy, tok, ctx, summary, say = _unpack(env)
    s = cfg.sampling
    teacher = load_teacher(c.teacher, policy)
    records = data.load_preferences(cfg.data.path, cfg.data.format)
    train, held = _chat_split(env, records)
    sl = data.SequenceLengths(max_length=c.max_length, max_prompt_length=s.prompt_length)
    train, _ = quality_report(train, tok, sl, cfg.data, ctx.log, records.report)
    summary["data_quality"] = {"skipped_by_reader": dict(records.report.skipped)}
    if c.lmbda > 0:
        # on-policy steps sample from the prompt: it must fit whole
        fits = [r for r in train if prompt_tokens(tok, r.prompt) <= s.prompt_length]
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
    kw = dict(beta=c.beta)  # at the loss's temperature, τ = 1 (as TRL's GKDTrainer)
    before = distill_divergence(policy, teacher, hb, **kw)
    res = run_distill(policy, teacher, tok, [r.prompt for r in train], comps, cfg=c, ctx=ctx)
    trained = _final(env, res.state.model)
    summary["distill"] = {
        "teacher": c.teacher,
        "heldout_jsd_before": before,
        "heldout_jsd": distill_divergence(trained, teacher, hb, **kw),
    }
    return Outcome(res, policy=trained)


def prm(env: StageEnv, c) -> Outcome:
    """A process reward model on a stepwise file, exported to `prm/hf/`."""
    cfg, policy, tok, ctx, summary, say = _unpack(env)
    res = prm_on_data(cfg, policy, tok, ctx, summary, say, lambda r: split_records(r, cfg.data))
    kw = dict(separator=c.separator, aggregation=c.aggregation, score=c.score)
    export_prm(res.state.model, env.run_dir, **kw, tokenizer_file=env.tok_file)
    return Outcome(res)
