"""PPO (Schulman et al. 2017; Ouyang et al. 2022), the `ppo` stage: its settings
(`PPOConfig`), its run with a value model and KL-shaped rewards (`run_ppo`), the stage on
the built-in task (from SFT, rewards from `ppo.reward_source`), on a prompt file
(`ppo_on_data`) and its registration."""

import dataclasses
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

import rlhf_eqx as rx
from rlhf_eqx import data

from ..train import PPOSettings
from ._config import _SET_BY_SAMPLING, RolloutStageConfig, SamplingConfig, _optim
from ._data_prep import (
    chat_records,
    log_left_out,
    log_skipped,
    prompt_tokens,
    record_numbers,
    split_records,
    trained_policy,
)
from ._field_checks import (
    _at_least,
    _check_options,
    _choice,
    _divides,
    _fail,
    _positive,
    _within,
)
from ._lr_scale import build_optimizer
from ._monitor import model_flops
from ._registry import Outcome, Stage, StageEnv, register_stage
from ._reward_sources import (
    RewardSource,
    as_reward_source,
    check_reward_functions,
    heldout_reward_summary,
    prompt_file_reward,
    scored_needs,
    scored_on_task,
)
from ._rl_rollouts import _policy_and_reference, _sample_and_compare
from ._rollout import RewardFunction, Rollout
from ._runs import RunContext, RunResult, final_policy, rl_step_settings, run_loop, take_rows
from ._sampled_eval import sampled_comparison
from ._validation import validate_stage

KL_ESTIMATORS = ("k1", "k3")
"""The values of `ppo.kl_estimator` (TRL `PPOConfig.kl_estimator`)."""
_PRM_WHITEN = (
    "a process reward model's step rewards join the shaped rewards through GAE's "
    "linearity (add_token_rewards), which whitening the rewards would break"
)


@dataclasses.dataclass(frozen=True)
class PPOConfig(RolloutStageConfig, PPOSettings):
    r"""PPO (Schulman et al. 2017; Ouyang et al. 2022) with a value model and KL-shaped
    rewards; `epochs` x `minibatches` updates per rollout of `prompts_per_rollout`
    completions. The step's settings are `rlhf_eqx.train.PPOSettings` (`clip_eps`,
    `vf_coef`, `ent_coef`, ...; its `temperature` is `sampling.temperature`, and with
    `mode="seq-mean-token-sum-norm"` its `constant` is by default
    `sampling.max_new_tokens`). The
    user's `reward_functions` (with `reward_weights`) are `RolloutStageConfig`'s.

    TRL `PPOConfig`'s rollout settings, with its defaults: `kl_estimator` (`"k1"`
    $-\log r$ or `"k3"` $e^{\log r} - 1 - \log r$, $\log r = \log\pi_{\rm ref} -
    \log\pi_\theta$: the per-token KL of the shaped rewards, of `objective/kl` (summed per
    completion) and of `rollout/kl` (its mean per completion token), the measure
    `kl_target` guards), `whiten_rewards` (scale the shaped rewards to unit variance over
    the rollout's completion tokens before GAE, their mean kept, as TRL; the advantages
    are whitened after GAE either way) and `missing_eos_penalty` (`None`: off; a
    number >= 0 subtracted from the score of every completion cut at
    `sampling.max_new_tokens` without a stop id or stop string). Other TRL names:
    `num_ppo_epochs` is `epochs`, `num_mini_batches` `minibatches`, `cliprange` /
    `cliprange_value` `clip_eps` / `vf_clip_eps`, `response_length`
    `sampling.max_new_tokens`; `kl_coef`, `vf_coef`, `gamma` and `lam` keep their names
    (`rlhf_eqx.train.PPOSettings` says where its defaults differ from TRL's)."""

    temperature: float = dataclasses.field(
        default=SamplingConfig.temperature, metadata=_SET_BY_SAMPLING
    )
    epochs: int = 2
    minibatches: int = 2
    gamma: float = 1.0
    lam: float = 0.95
    kl_coef: float = 0.05
    reward_source: str = "reward_model"
    kl_estimator: str = "k1"
    whiten_rewards: bool = False
    missing_eos_penalty: float | None = None

    def check(self, name: str, *, device_count: int = 1) -> None:
        """PPO's own rules: minibatches divide the rollout (and its rows the devices), a
        KL coefficient >= 0, γ and λ in [0, 1], reward functions that import, one finite
        weight each, scored with `reward_source=task`; a `kl_estimator` of TRL's (k1,
        k3), a `missing_eos_penalty` of None or >= 0, and no `whiten_rewards` with a
        process reward model (its step rewards join the shaped rewards after GAE)."""
        check_reward_functions(name, self)
        _choice(f"{name}.kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        if not isinstance(self.whiten_rewards, bool):
            _fail(f"{name}.whiten_rewards", self.whiten_rewards, "must be true or false")
        if self.whiten_rewards and self.reward_source == "prm":
            why = f"not with {name}.reward_source=prm: {_PRM_WHITEN}"
            _fail(f"{name}.whiten_rewards", True, why)
        if self.missing_eos_penalty is not None:
            _at_least(f"{name}.missing_eos_penalty", self.missing_eos_penalty, 0)
        _positive(f"{name}.minibatches", self.minibatches)
        if self.prompts_per_rollout % self.minibatches:
            _fail(
                f"{name}.minibatches",
                self.minibatches,
                f"must divide {name}.prompts_per_rollout={self.prompts_per_rollout}",
            )
        _divides(
            f"{name}.prompts_per_rollout",
            self.prompts_per_rollout // self.minibatches,
            device_count,
        )
        _at_least(f"{name}.kl_coef", self.kl_coef, 0)
        _check_options(name, self, self.prompts_per_rollout // self.minibatches)
        _within(f"{name}.gamma", self.gamma, 0, 1)
        _within(f"{name}.lam", self.lam, 0, 1)


def ppo_rollout_batch(
    model,
    reference,
    roll: Rollout,
    scores: Float[Array, " B"],
    cfg: PPOConfig,
    *,
    temperature: float,
    whiten: bool = True,
) -> tuple[data.PPOBatch, dict[str, Float[Array, ""]]]:
    r"""The `PPOBatch` of a rollout and its statistics, as TRL's `PPOTrainer` makes them:
    the score of every completion cut at `max_new_tokens` (`roll.truncated`) lowered by
    `cfg.missing_eos_penalty` when set ($s_i \leftarrow s_i - p\,\mathbb 1[\text{no
    EOS}_i]$), then `prepare_ppo_batch` (KL-shaped rewards with `cfg.kl_estimator`,
    `cfg.whiten_rewards`, GAE with `cfg.gamma`, `cfg.lam`, the advantages whitened when
    `whiten`) at the sampling `temperature`, `old_logp` the sampler's log-probabilities.
    `stats` has `missing_eos`, the fraction of penalised completions, when the penalty is
    on; `objective/scores` is the mean of the penalised scores, as in TRL; `kl` is the
    per-token mean of the `cfg.kl_estimator` estimate over the completion tokens
    (`objective/kl` × rows / tokens), the measure `cfg.kl_target` guards."""
    if cfg.missing_eos_penalty is not None:
        cut = jnp.asarray(roll.truncated, jnp.float32)
        scores = scores - jnp.float32(cfg.missing_eos_penalty) * cut
    batch, stats = rx.train.prepare_ppo_batch(
        model,
        reference,
        roll.tokens,
        roll.mask,
        roll.completion_mask,
        scores,
        kl_coef=cfg.kl_coef,
        gamma=cfg.gamma,
        lam=cfg.lam,
        kl_kind=cfg.kl_estimator,
        whiten=whiten,
        whiten_rewards=cfg.whiten_rewards,
        temperature=temperature,
    )
    if cfg.missing_eos_penalty is not None:
        stats = {**stats, "missing_eos": jnp.mean(cut)}
    m = roll.completion_mask & roll.mask
    # The KL guard's measure in the estimator of the shaped rewards: objective/kl, TRL's
    # mean over completions of their summed estimates, per completion token instead.
    rows, tokens = jnp.float32(roll.tokens.shape[0]), jnp.sum(m, dtype=jnp.float32)
    stats = {**stats, "kl": stats["objective/kl"] * rows / jnp.maximum(tokens, 1.0)}
    batch = eqx.tree_at(lambda b: b.old_logp, batch, jnp.where(m, roll.logprobs, 0.0))
    return batch, stats


def run_ppo(
    policy,
    tok,
    prompts: Sequence[str],
    *,
    reward: "RewardSource | rx.RewardModel | Sequence[RewardFunction]",
    cfg: PPOConfig,
    ctx: RunContext,
) -> RunResult:
    """PPO with a value model (RLHF, Ouyang et al. 2022): per rollout, sample one
    completion for each of `cfg.prompts_per_rollout` prompts, score it with `reward` (a
    `RewardSource`: a reward model or ensemble, jitted; a judge; reward functions on the
    decoded text; a process reward model, whose step scores are per-token rewards,
    `add_token_rewards`), compute the reference log-probs, values and GAE advantages
    once (`ppo_rollout_batch`: `cfg.missing_eos_penalty`, `cfg.kl_estimator`,
    `cfg.whiten_rewards` as TRL reads them; `old_logp` from the sampler), then `cfg.epochs` x
    `cfg.minibatches` PPO steps. The policy trains
    LoRA adapters (`cfg.lora`; the reference is the policy without them); the value
    model (`ValueModel.from_policy`) trains every weight. Stops early when the per-token
    KL to the reference (`rollout/kl`, in `cfg.kl_estimator`'s estimate) exceeds
    `cfg.kl_target`.
    """
    validate_stage("ppo", cfg)
    source = as_reward_source(reward)
    k_lora, k_value, ctx_key = jax.random.split(ctx.key, 3)
    pol, spec, reference = _policy_and_reference(policy, cfg.lora, k_lora)
    value = rx.ValueModel.from_policy(policy, key=k_value)
    total = cfg.rollouts * cfg.epochs * cfg.minibatches
    opt = build_optimizer(cfg.optim, total)
    filter_spec = (spec if spec is not None else eqx.is_inexact_array, eqx.is_inexact_array)
    state = rx.train.init_train_state((pol, value), opt, filter_spec=filter_spec)
    # the sampling temperature has one owner, `sampling.temperature` (the run's context)
    cfg = rl_step_settings(cfg, ctx.temperature, ctx.max_new_tokens)
    step = rx.train.make_ppo_step(opt, cfg, options=cfg.options)
    n = cfg.prompts_per_rollout
    mb = n // cfg.minibatches
    rows = cfg.prompts_per_rollout * (ctx.prompt_length + ctx.max_new_tokens)
    n_policy, n_value = rx.count_params(pol), rx.count_params(value)

    def iteration(state, key, r):
        k_sample, k_steps = jax.random.split(key)
        pol_now, val_now = state.model
        roll, _, info = _sample_and_compare(
            pol_now, reference, tok, prompts, k_sample, r, ctx=ctx, per_rollout=n
        )
        scored = source.score(roll)
        per_token = scored.token_rewards is not None  # a PRM: its step scores, per token
        scores = jnp.asarray(0.0 * scored.scores if per_token else scored.scores, jnp.float32)
        info.update(scored.metrics, score=float(np.mean(scored.scores)))
        if per_token and cfg.whiten_rewards:
            raise ValueError(f"ppo.whiten_rewards=True: {_PRM_WHITEN}")
        batch, stats = ppo_rollout_batch(
            (pol_now, val_now),
            reference,
            roll,
            scores,
            cfg,
            temperature=ctx.temperature,
            whiten=not per_token,
        )
        if per_token:
            batch, more = rx.train.add_token_rewards(
                batch, scored.token_rewards, gamma=cfg.gamma, lam=cfg.lam
            )
            stats = {**stats, **more}
        info.update({k: float(v) for k, v in stats.items()})
        metrics = []
        for e in range(cfg.epochs):
            perm = np.asarray(jax.random.permutation(jax.random.fold_in(k_steps, e), n))
            for j in range(cfg.minibatches):
                idx = perm[j * mb : (j + 1) * mb]
                state, met = state.apply(
                    step, take_rows(batch, idx), key=jax.random.fold_in(k_steps, 1000 + e * 100 + j)
                )
                metrics.append(met)
        return state, metrics, info

    ctx = dataclasses.replace(ctx, key=ctx_key)
    return run_loop(
        state,
        iteration,
        ctx,
        cfg.rollouts,
        kl_target=cfg.kl_target,
        policy_of=lambda s: s.model[0],
        tokens_per_iteration=cfg.prompts_per_rollout * ctx.max_new_tokens,
        # Sampling, old policy, reference (twice: shaping and the KL guard) and value
        # forward passes; epochs of training steps on policy and value.
        flops_per_iteration=model_flops(n_policy, forward_tokens=4 * rows)
        + model_flops(n_value, forward_tokens=rows, train_tokens=cfg.epochs * rows)
        + model_flops(n_policy, train_tokens=cfg.epochs * rows),
    )


def ppo(env: StageEnv, c: PPOConfig) -> Outcome:
    """PPO from SFT on the built-in task, rewards from `c.reward_source`."""
    res = scored_on_task(env, c, run_ppo, "ppo")
    policy, value = res.state.model
    return Outcome(res, policy=final_policy(policy), adapted=policy)


def scored_prompts(env: StageEnv, c: PPOConfig) -> tuple[list[str], list[str], RewardSource]:
    """The training and held-out prompts of `env.cfg.data` (`data.load_prompts`: TRL's
    prompt-only `prompt`, a string or messages, GSM8K, MT-Bench; an answer is not
    needed), split by `data.seed` (`split_records`: the file's text), each side through
    the model's chat template and cut to the prompts that fit `sampling.prompt_length`,
    and the reward source of `c` (`stage_reward_source`; `reward_source=task` is the
    user's `reward_functions`, given each prompt's other columns, or else the exact
    match of the reference answers, which every prompt must then have).
    `env.summary["data_quality"]` counts what the reader skipped, the repeated prompts
    and those too long (always left out); `data.filter=duplicate_prompt` (or
    `exact_duplicate`) trains on each prompt once. A `skipped_records` event names the
    lines the reader left out (`log_skipped`), a `prompts_left_out` event the prompts
    too long (`log_left_out`). A `ValueError` names the file when no prompt is left."""
    cfg, tok = env.cfg, env.tok
    log = env.ctx("").log
    records = data.load_prompts(cfg.data.path, cfg.data.format, **cfg.data.read_options())
    log_skipped(log, records.report)
    raw = split_records(records, cfg.data)
    train, held = (chat_records(env, side, records) for side in raw)
    limit = cfg.sampling.prompt_length
    train_fits, held_fits = (
        [r for r in side if prompt_tokens(tok, r.prompt) <= limit] for side in (train, held)
    )
    at = {**record_numbers(records, raw[0], train), **record_numbers(records, raw[1], held)}
    fits = {id(r) for r in train_fits + held_fits}
    log_left_out(
        log,
        cfg.data.path,
        len(train) + len(held),
        [
            (
                "long_prompt",
                f"longer than sampling.prompt_length={limit} with BOS",
                [at.get(id(r)) for r in train + held if id(r) not in fits],
            )
        ],
        "raise sampling.prompt_length to keep them",
    )
    if not train_fits or not held_fits:
        raise ValueError(
            f"sampling.prompt_length={limit}: {len(train_fits)} training and "
            f"{len(held_fits)} held-out prompts of {cfg.data.path} fit; raise "
            "sampling.prompt_length or shorten the prompts"
        )
    kept = train_fits + held_fits
    env.summary["data_quality"] = {
        "skipped_by_reader": dict(records.report.skipped),
        "duplicate_prompts": len(kept) - len({r.prompt for r in kept}),
        "longer_than_prompt_length": len(train) + len(held) - len(kept),
    }
    if {"duplicate_prompt", "exact_duplicate"} & set(cfg.data.filter):  # each prompt once
        first = {}
        for r in train_fits:
            first.setdefault(r.prompt, r)
        env.summary["data_quality"]["dropped_duplicate_prompts"] = len(train_fits) - len(first)
        train_fits = list(first.values())
    env.say(f"ppo: {len(train_fits)} training / {len(held_fits)} held-out prompts")
    reward, _ = prompt_file_reward(
        "ppo", c, kept, cfg.data.path, tokenizer=tok, judge=cfg.judge, judges={"base": env.base}
    )
    return [r.prompt for r in train_fits], [r.prompt for r in held_fits], reward


def ppo_on_data(env: StageEnv, c: PPOConfig) -> Outcome:
    """PPO from the loaded model on a prompt file (`scored_prompts`), rewards from
    `c.reward_source` (on a data file a reward model, ensemble or PRM is a directory,
    `ppo.reward_model`); `summary["ppo"]`: the reward of the base model's and the trained
    policy's held-out samples (`heldout_reward_before`, `heldout_reward`, with their
    standard errors over the prompts), paired (`sampled_comparison` with the key
    `ops.seed + 1`, `data.eval_prompts` prompts), and the rest of the comparison as
    `sampled`."""
    train, held, reward = scored_prompts(env, c)
    res = run_ppo(env.base, env.tok, train, reward=reward, cfg=c, ctx=env.ctx(""))
    policy, _ = res.state.model
    trained = trained_policy(env, policy)
    key = jax.random.key(env.cfg.ops.seed + 1)
    ev = sampled_comparison(env.base, trained, env.tok, held, key, env.cfg, reward=reward)
    env.summary["ppo"] = heldout_reward_summary(ev)
    return Outcome(res, policy=trained, adapted=policy)


register_stage(
    Stage(
        "ppo",
        PPOConfig,
        ppo,
        ppo_on_data,
        needs=lambda cfg: scored_needs(cfg, "ppo"),
        sections=("reward", "sft", "judge"),
        help="PPO with a value model, rewards from ppo.reward_source",
        task=dict(
            rollouts=16,
            prompts_per_rollout=64,
            epochs=2,
            minibatches=2,
            kl_coef=0.02,
            kl_target=1.0,
            optim=_optim(1e-3),
        ),
        key_stream=("split", 3),
    )
)
