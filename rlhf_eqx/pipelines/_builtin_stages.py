"""The stages on the built-in animal task: SFT on the base model's best samples, a reward
model on noisily labelled pairs, then PPO, online DPO, DPO, GRPO, KTO and distillation
from SFT (each `(env, cfg) -> Outcome`, registered in `_stages.py`)."""

import numpy as np

from rlhf_eqx import data

from ._distill_runs import completions_batch, load_teacher, run_distill, sampled_completions
from ._dpo_runs import run_online_dpo
from ._evaluate import binomial_se, reward_accuracy
from ._grpo_runs import run_grpo
from ._kto_runs import run_kto, sampled_unpaired
from ._registry import Outcome, StageEnv, find_stage
from ._reward_runs import run_reward
from ._reward_sources import (
    EnsembleReward,
    ModelReward,
    export_reward_ensemble,
    stage_reward_source,
)
from ._rl_runs import run_ppo
from ._rollout import RewardFunction, sample_rollout, sampling_options
from ._runs import collate_pairs, export_reward_model, final_policy, run_sft
from ._task import HELDOUT_PROMPTS, TRAIN_PROMPTS, animal_score


def _sample(env: StageEnv, policy, prompts, salt: int, group_size: int):
    return sample_rollout(
        policy,
        env.tok,
        prompts,
        env.data_key(salt),
        group_size=group_size,
        **sampling_options(env.cfg.sampling),
    )


def sft(env: StageEnv, c) -> Outcome:
    """SFT on the base model's best-of-`c.samples` completions (by noisy labels)."""
    roll = _sample(env, env.base, TRAIN_PROMPTS, 0, c.samples)
    labels = np.asarray(env.label(roll.prompts, roll.texts, 1)).reshape(-1, c.samples)
    best = labels.argmax(axis=1)
    records = [
        (p, roll.texts[j * c.samples + b]) for j, (p, b) in enumerate(zip(TRAIN_PROMPTS, best))
    ]
    env.say(f"sft: {len(records)} demonstrations (best of {c.samples} by noisy labels)")
    res = run_sft(env.base, env.tok, records, cfg=c, ctx=env.ctx("sft", periodic=False))
    return Outcome(res, policy=final_policy(res.state.model))


def _pairs(roll, scores, noisy=None) -> list:
    """Preference pairs of consecutive samples whose true scores differ, ordered by the
    noisy labels (ties by the true scores) or, without `noisy`, by the true scores."""
    out = []
    for j in range(0, len(roll.texts), 2):
        if scores[j] == scores[j + 1]:
            continue
        if noisy is None:
            first = scores[j] > scores[j + 1]
        else:
            first = noisy[j] > noisy[j + 1] or (
                noisy[j] == noisy[j + 1] and scores[j] > scores[j + 1]
            )
        c, w = (j, j + 1) if first else (j + 1, j)
        out.append(data.PreferenceRecord(roll.prompts[j], roll.texts[c], roll.texts[w]))
    return out


def reward(env: StageEnv, r) -> Outcome:
    """A reward model (or ensemble) on noisily labelled pairs of SFT samples; its clean
    held-out accuracy on pairs of held-out prompts labelled by the true scorer."""
    sft_policy, tok, s = env.policies["sft"], env.tok, env.cfg.sampling
    roll = _sample(env, sft_policy, TRAIN_PROMPTS, 1, 2 * r.pairs_per_prompt)
    true = np.asarray([animal_score(t) for t in roll.texts])
    pairs = _pairs(roll, true, np.asarray(env.label(roll.prompts, roll.texts, 2)))
    held_roll = _sample(env, sft_policy, HELDOUT_PROMPTS, 2, 2 * r.pairs_per_prompt)
    clean = _pairs(held_roll, np.asarray([animal_score(t) for t in held_roll.texts]))
    env.say(f"reward: {len(pairs)} noisily labelled pairs, {len(clean)} clean held-out pairs")
    res = run_reward(sft_policy, tok, pairs, cfg=r, ctx=env.ctx("reward", periodic=False))
    rm = res.state.model
    if r.ensemble > 1:
        kw = dict(penalty=r.ensemble_penalty, mode=r.ensemble_mode)
        export_reward_ensemble(rm, env.run_dir, **kw, tokenizer_file=env.tok_file)
        source = EnsembleReward(rm, r.ensemble_penalty, r.ensemble_mode)
    else:
        export_reward_model(rm, env.run_dir, tokenizer_file=env.tok_file)
        source = ModelReward(rm)
    held = collate_pairs(clean, tok, max_length=r.max_length, prompt_length=s.prompt_length)
    acc = reward_accuracy(source, held)
    info = res.info
    summary = {
        "heldout_accuracy": acc,
        "heldout_accuracy_se": binomial_se(acc, held.chosen_tokens.shape[0]),
        "train_accuracy": info.get("train_accuracy"),
        "validation_accuracy": info.get("validation_accuracy"),
        "selected_step": info.get("selected_step", r.steps),
        "train_pairs": info.get("train_pairs", len(pairs)),
        "validation_pairs": info.get("validation_pairs", 0),
        "heldout_pairs": len(clean),
        "stopped": res.loop.stopped,
    }
    if r.ensemble > 1:
        summary["ensemble"] = r.ensemble
    kept = (
        f" (kept step {info['selected_step']} of {r.steps}: training accuracy "
        f"{info['train_accuracy']:.1%}, noisy validation accuracy "
        f"{info['validation_accuracy']:.1%})"
        if info
        else ""
    )
    env.say(f"reward model: clean held-out accuracy {acc:.1%}" + kept)
    return Outcome(res, summary=summary, reward=source)


def reward_source(env: StageEnv, c):
    """The reward source of a PPO / GRPO stage on the built-in task (`c.reward_source`)."""
    task = [RewardFunction("animal", lambda p, t: animal_score(t))]
    judges = {"base": env.base, "sft": env.policies.get("sft")}
    return stage_reward_source(
        c, task=task, tokenizer=env.tok, judge=env.cfg.judge, judges=judges, run_reward=env.reward
    )


def _scored(env: StageEnv, c, run, name: str):
    """PPO or GRPO from SFT on the training prompts, rewards from `c.reward_source`."""
    source = reward_source(env, c)
    return run(env.policies["sft"], env.tok, TRAIN_PROMPTS, reward=source, cfg=c, ctx=env.ctx(name))


def ppo(env: StageEnv, c) -> Outcome:
    res = _scored(env, c, run_ppo, "ppo")
    policy, value = res.state.model
    return Outcome(res, policy=final_policy(policy), adapted=policy)


def _rm_label(rm, tok, cfg):
    """Labels from a reward model's (or ensemble's) scores of `prompt + completion`
    (RLAIF)."""

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
        return np.asarray(rm.scores(batch.tokens, batch.mask)[0]).tolist()

    return label


def online_dpo(env: StageEnv, c) -> Outcome:
    label = _rm_label(env.reward, env.tok, env.cfg)
    ctx = env.ctx("online-dpo")
    res = run_online_dpo(env.policies["sft"], env.tok, TRAIN_PROMPTS, label, cfg=c, ctx=ctx)
    return Outcome(res, policy=final_policy(res.state.model))


def dpo(env: StageEnv, c) -> Outcome:
    ctx = env.ctx("dpo")
    res = run_online_dpo(env.policies["sft"], env.tok, TRAIN_PROMPTS, env.label, cfg=c, ctx=ctx)
    return Outcome(res, policy=final_policy(res.state.model))


def grpo(env: StageEnv, c) -> Outcome:
    res = _scored(env, c, run_grpo, "grpo")
    return Outcome(res, policy=final_policy(res.state.model))


def kto(env: StageEnv, c) -> Outcome:
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
    res = run_kto(sft_policy, env.tok, records, cfg=c, ctx=env.ctx("kto"))
    return Outcome(res, policy=final_policy(res.state.model))


def distill(env: StageEnv, c) -> Outcome:
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


def ppo_needs(cfg) -> tuple[str, ...]:
    """PPO (and GRPO) run after the reward stage when they score with its model."""
    return _scored_needs(cfg, "ppo")


def grpo_needs(cfg) -> tuple[str, ...]:
    return _scored_needs(cfg, "grpo")


def _scored_needs(cfg, name: str) -> tuple[str, ...]:
    c = getattr(cfg, name)
    own = c.reward_source == "reward_model" and not c.reward_model
    return ("sft", "reward", name) if own else ("sft", name)


def distill_needs(cfg) -> tuple[str, ...]:
    """The teacher stage first, unless `distill.teacher` is a checkpoint directory."""
    teacher = find_stage(cfg.distill.teacher)
    before = teacher.prerequisites(cfg) if teacher is not None else ("sft",)
    return (*before, "distill")
