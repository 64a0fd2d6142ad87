"""Multi-turn GRPO on the built-in task, the `multiturn` stage (`rlhf_eqx multiturn`): the
policy writes a paragraph, the environment names an animal ("Now tell me about the
cat."), and the second paragraph is rewarded when it is about that animal. Its settings
(`MultiturnConfig`), its run, the episode stage the multi-turn stages share
(`episode_stage`) and its registration.

Each rollout is one compiled program (`rlhf_eqx.envs.rollout_multiturn`: policy turns
with the KV cache, the environment's turns in between, vmapped over the episodes and
the members of each group); the environment's tokens are context but not trained on
(`loss_mask`), and the update is the GRPO step of the single-turn stage.
"""

import dataclasses
import re
from collections.abc import Sequence
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

import rlhf_eqx as rx

from ._callbacks import load_object
from ._config import (
    ConfigError,
    LoRASettings,
)
from ._evaluate import prompt_se, win_rate, win_rate_se
from ._field_checks import _fail
from ._grpo_stage import PLACEMENT_FIELDS, GRPOConfig, grpo_state_and_step
from ._model_checks import check_episode_length, model_sizes, run_tokenizer
from ._monitor import model_flops
from ._registry import Outcome, Stage, StageEnv, register_stage
from ._rl_rollouts import _per_token_kl, _policy_and_reference
from ._rollout import default_stop_ids, encode_prompts, filters_of, group_signal, token_logps
from ._runs import RunContext, RunResult, final_policy, rows_at, run_loop
from ._task import HELDOUT_PROMPTS, TRAIN_PROMPTS
from ._validation import validate_stage

EPISODE_REWARDS = ("sum", "last")
"""How an episode's reward is made of its turns' (`rlhf_eqx.envs.rollout_multiturn`'s
`episode_reward`): their sum, or the last turn's (an environment whose reward is a
running score)."""


class EnvironmentChecked:
    """The `check` of a multi-turn stage's settings: its parent's rules, an
    `episode_reward` of `EPISODE_REWARDS`, and an `environment` (its field) that loads
    (`environment_factory`)."""

    def check(self, name: str, *, device_count: int = 1) -> None:
        super().check(name, device_count=device_count)
        if self.episode_reward not in EPISODE_REWARDS:
            raise ConfigError(
                f"{name}.episode_reward={self.episode_reward!r}: must be one of "
                f"{', '.join(EPISODE_REWARDS)}"
            )
        if self.environment:
            environment_factory(self.environment, f"{name}.environment")


@dataclasses.dataclass(frozen=True)
class MultiturnConfig(EnvironmentChecked, GRPOConfig):
    """GRPO (the `grpo` settings) on episodes of `max_turns` policy turns of at most
    `turn_tokens` tokens each against the animal follow-up environment
    (`rlhf_eqx.envs.AnimalFollowUpEnv`); the reward is the episode's (the second turn
    names the animal asked for). Held-out evaluation: `eval_samples` episodes per
    held-out opening, the success rate and the base model's NLL per token of the
    policy's own tokens (fluency). The stage runs on the built-in task only, so its
    defaults are the task's (as `animal_task_config()` sets for `grpo`: LoRA rank 8 on
    every projection, learning rate 2e-3, β 0.02, KL target 1.0).

    An episode, `sampling.prompt_length + max_turns · turn_tokens` tokens and the
    environment's questions between the turns, must fit the model's `max_seq_len`
    (checked before any stage runs). The rewards are the environment's and the rollouts
    synchronous: the GRPO settings of the reward source and of off-policy rollouts
    (`unused_fields`: `staleness`, `overlap`, `sampler_device`, the split placement's
    settings, `dynamic_sampling`, `overlong_buffer`, `partial_rollouts`,
    `rollout_correction`, `reward_source`, `reward_model`, `reward_functions`,
    `reward_weights`) must keep their defaults.

    `environment`: the user's own environment instead, `MODULE:NAME` of a factory
    `NAME(tok) -> rlhf_eqx.envs.Environment` (or an `Environment` instance), the module
    imported with the current directory first on the path; its held-out `success` is
    the mean episode reward (the animal environment's is its host-side check).
    `episode_reward`: an episode's reward is the sum of its turns' rewards (`sum`) or the
    last turn's (`last`: an environment whose reward is a running score). The
    factory is called, and the episode (`reset`'s first observation included, up to
    `max_observation_tokens`) checked against `max_seq_len`, before any stage runs; the
    animal environment needs `max_turns >= 2` (it rewards the second turn)."""

    unused_fields: ClassVar[tuple[str, ...]] = (
        "staleness",
        *PLACEMENT_FIELDS,
        "dynamic_sampling",
        "overlong_buffer",
        "partial_rollouts",
        "rollout_correction",
        "reward_source",
        "reward_model",
        "reward_functions",
        "reward_weights",
    )
    rollouts: int = 40
    prompts_per_rollout: int = 8
    group_size: int = 8
    beta: float = 0.02
    kl_target: float = 1.0
    optim: rx.train.OptimizerSettings = rx.train.OptimizerSettings(
        learning_rate=2e-3, warmup_ratio=0.1
    )
    lora: LoRASettings = LoRASettings(
        rank=8, alpha=16.0, dropout=0.0, targets=("q", "k", "v", "o", "gate", "up", "down")
    )
    max_turns: int = 2
    turn_tokens: int = 40
    environment: str = ""
    episode_reward: str = "sum"

    def __post_init__(self):
        for name in ("max_turns", "turn_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"multiturn.{name}={v!r}: must be an integer >= 1")
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()


def _prompts(tok, prompts: Sequence[str], length: int):
    rows = encode_prompts(tok, prompts, prompt_length=length)
    ids = np.full((len(rows), length), tok.pad_id, np.int32)
    mask = np.zeros((len(rows), length), bool)
    for i, r in enumerate(rows):  # left padded: every completion starts at `length`
        ids[i, length - len(r) :] = r
        mask[i, length - len(r) :] = True
    return jnp.asarray(ids), jnp.asarray(mask)


def _rollout(policy, env, tok, prompts, key, cfg, ctx: RunContext, samples):
    # `cfg`: any stage settings with `max_turns` and `turn_tokens`
    ids, mask = _prompts(tok, prompts, ctx.prompt_length)
    return rx.envs.rollout_multiturn(
        policy,
        env,
        ids,
        mask,
        key,
        max_turns=cfg.max_turns,
        max_new_tokens=cfg.turn_tokens,
        max_total_tokens=_length(env, cfg, ctx.prompt_length),
        temperature=ctx.temperature,
        **filters_of(ctx),
        eos_id=turn_stop_ids(env, tok),
        pad_id=tok.pad_id,
        num_samples=samples,
        episode_reward=cfg.episode_reward,
    )


def environment_factory(spec: str, field: str = "multiturn.environment"):
    """The environment factory `spec` (`MODULE:NAME`) names: `tok -> Environment` (an
    `Environment` instance is returned as it is). A `ConfigError` naming `field` and what
    is wrong otherwise (an exception raised while its module is imported included)."""
    obj = load_object(spec, f"{field}={spec!r}", "my_env:make_env")
    if isinstance(obj, rx.envs.Environment):
        return lambda tok: obj
    if not callable(obj):
        raise ConfigError(f"{field}={spec!r}: expected an Environment or a factory NAME(tok)")
    return obj


def load_environment(spec: str, tok, field: str = "multiturn.environment"):
    """The `rlhf_eqx.envs.Environment` that `spec`'s factory (`environment_factory`)
    builds for `tok`; a `ConfigError` naming `field` when the factory raises or returns
    anything else."""
    factory = environment_factory(spec, field)
    try:
        env = factory(tok)
    except Exception as e:
        raise ConfigError(f"{field}={spec!r}: the factory raised {type(e).__name__}: {e}") from e
    if not isinstance(env, rx.envs.Environment):
        host = isinstance(env, rx.envs.HostEnvironment)
        why = " (the stages roll out jittable environments only)" if host else ""
        what = type(env).__name__
        if isinstance(env, type):  # the class, not an instance of it
            what, why = f"the class {env.__name__}", " (return an instance of it)"
        raise ConfigError(
            f"{field}={spec!r}: the factory returned {what}, not an rlhf_eqx.envs.Environment{why}"
        )
    return env


def stage_environment(c, tok, name: str = "multiturn"):
    """The environment of a multi-turn stage's settings `c` (the stage `name`):
    `c.environment`'s (`load_environment`) when set, else the animal follow-up
    environment."""
    spec = getattr(c, "environment", "")
    if spec:
        return load_environment(spec, tok, f"{name}.environment")
    return rx.envs.AnimalFollowUpEnv(tok)


def turn_stop_ids(env, tok) -> tuple[int, ...]:
    """The ids that end a policy turn: the environment's `stop_ids`
    (`rlhf_eqx.envs.Environment`), else those a single-turn completion stops at
    (`default_stop_ids`: EOS, its model's end-of-turn ids and BOS)."""
    own = tuple(getattr(env, "stop_ids", ()) or ())
    return own or default_stop_ids(tok)


def _length(env, cfg, prompt_length: int) -> int:
    """The static episode length: the prompt, every turn, the observations between and
    `reset`'s before the first turn (but the animal environment's, which is empty)."""
    turns = cfg.max_turns * cfg.turn_tokens
    first = 0 if isinstance(env, rx.envs.AnimalFollowUpEnv) else 1
    return prompt_length + turns + (cfg.max_turns - 1 + first) * env.max_observation_tokens


def multiturn_metrics(policy, base, env, tok, key, cfg, ctx, samples: int):
    """Held-out multi-turn metrics of `policy`: `success` (with the animal environment the
    fraction of episodes whose second turn names the animal asked for, scored on the
    decoded text; with a user's environment the mean episode reward), `base_nll` (the
    base model's NLL per token of the policy's own tokens) and the per-episode successes
    (for win rates)."""
    traj = _rollout(policy, env, tok, list(HELDOUT_PROMPTS), key, cfg, ctx, samples)
    has_check = hasattr(env, "host_rewards")  # else the episode reward
    success = env.host_rewards(traj, tok) if has_check else np.asarray(traj.reward, np.float32)
    lp = np.asarray(token_logps(base, traj.tokens, traj.mask))
    own = np.asarray(traj.loss_mask)
    nll = float(-(lp * own).sum() / max(own.sum(), 1))
    return {"success": float(success.mean()), "base_nll": nll}, success


def run_multiturn(policy, tok, prompts: Sequence[str], env, *, cfg, ctx: RunContext) -> RunResult:
    """GRPO on multi-turn episodes against the jittable environment `env` (an
    `rlhf_eqx.envs.Environment`; each policy turn ends at one of its `stop_ids`, or at
    the ids a completion stops at when it declares none: `turn_stop_ids`): per rollout,
    `cfg.group_size` episodes for each of `cfg.prompts_per_rollout` prompts, rewarded
    per episode; the environment's tokens are masked out of the loss; reference
    log-probs on the policy's tokens once per rollout; `cfg.epochs` steps on it."""
    validate_stage("multiturn", cfg)
    k_lora, ctx_key = jax.random.split(ctx.key)
    pol, spec, reference = _policy_and_reference(policy, cfg.lora, k_lora)
    # Dr.GRPO's normaliser: the most policy tokens an episode holds
    state, step = grpo_state_and_step(pol, spec, cfg, ctx, cfg.max_turns * cfg.turn_tokens)
    G, n, P = cfg.group_size, cfg.prompts_per_rollout, ctx.prompt_length
    length = _length(env, cfg, P)

    def iteration(state, key, r):
        k_sample, k_steps = jax.random.split(key)
        traj = round_episodes(state.model, env, tok, prompts, k_sample, r, cfg, ctx, n, G)
        batch, info = episode_batch(traj, reference, G, P, ctx.temperature)
        for kind, note in episode_notes(r, info, cfg, "multiturn"):
            ctx.log.event(kind, note, iteration=r)
        metrics = []
        for e in range(cfg.epochs):
            state, met = state.apply(step, batch, key=jax.random.fold_in(k_steps, e))
            metrics.append(met)
        return state, metrics, info

    rows = n * G * length
    flops = model_flops(
        rx.count_params(pol), forward_tokens=2 * rows, train_tokens=cfg.epochs * rows
    )
    return run_episodes(state, iteration, ctx, ctx_key, cfg, cfg.rollouts, n * G, flops)


def round_episodes(model, env, tok, prompts, key, r: int, cfg, ctx: RunContext, n: int, k: int):
    """Iteration `r`'s episodes: `k` episodes of each of `n` prompts (the rows
    `rows_at(len(prompts), n, ctx.ops.seed, r)`) played by `model` against `env`."""
    rows = rows_at(len(prompts), n, ctx.ops.seed, r)
    return _rollout(model, env, tok, [prompts[j] for j in rows], key, cfg, ctx, k)


def episode_scores(traj, reference, temperature: float = rx.DEFAULT_TEMPERATURE):
    """`(own, ref_logp, rewards, info)` of trajectories: the policy's own tokens
    (`loss_mask & mask`), the reference's log-probabilities (at the episodes' sampling
    `temperature`, that of `traj.logprobs` and of the policy's in the steps), the
    episode rewards, and
    `kl` (per token of the policy's own, to the reference), `score` (the mean episode
    reward), `turns` (the mean number of policy turns), `truncated` (the fraction of
    episodes the token budget cut: `Trajectory.truncated`, what
    `mask_truncated_completions` masks) and `turn_limit` (the fraction the turn limit
    ended, whole turns: `Trajectory.turn_limit`)."""
    own = traj.loss_mask & traj.mask
    rewards = np.asarray(traj.reward, np.float32)
    if not np.all(np.isfinite(rewards)):
        bad = np.flatnonzero(~np.isfinite(rewards))
        raise ValueError(
            f"the environment's episode rewards must be finite; episodes {bad[:4].tolist()} "
            f"got {rewards[bad[:4]].tolist()}"
        )
    ref = token_logps(reference, traj.tokens, traj.mask, temperature)
    info = {
        "kl": _per_token_kl(traj.logprobs, ref, own),
        "score": float(rewards.mean()),
        "turns": float(jnp.mean(traj.num_turns.astype(jnp.float32))),
        "truncated": float(jnp.mean(traj.truncated.astype(jnp.float32))),
    }
    if traj.turn_limit is not None:  # None in a Trajectory built without it
        info["turn_limit"] = float(jnp.mean(traj.turn_limit.astype(jnp.float32)))
    return own, ref, rewards, info


def run_episodes(state, iteration, ctx, ctx_key, cfg, iterations: int, episodes: int, flops):
    """A multi-turn run's loop (`run_loop`): `iterations` iterations of `episodes`
    episodes each (counted by their policy turns' tokens), `flops` each, stopped when
    the KL to the reference exceeds `cfg.kl_target`."""
    return run_loop(
        state,
        iteration,
        dataclasses.replace(ctx, key=ctx_key),
        iterations,
        kl_target=cfg.kl_target,
        policy_of=lambda s: s.model,
        tokens_per_iteration=episodes * cfg.max_turns * cfg.turn_tokens,
        flops_per_iteration=flops,
    )


def episode_notes(r: int, info: dict, cfg, name: str) -> list[tuple[str, str]]:
    """The events `(kind, message)` of iteration `r` of a multi-turn GRPO run (`info`,
    `episode_batch`'s): `no_signal` when every group's episodes got the same reward (no
    advantage: only the KL term moves the policy), and `all_truncated` when
    `cfg.mask_truncated_completions` masks every episode (`info["truncated"] == 1`: the
    update has no token to learn from), saying why and which settings give the turns
    room."""
    notes = []
    if info.get("frac_reward_zero_std") == 1.0:
        notes.append(
            (
                "no_signal",
                f"iteration {r}: every group's episodes got the same reward; no advantage "
                "to learn from",
            )
        )
    if cfg.mask_truncated_completions and info.get("truncated") == 1.0:
        notes.append(
            (
                "all_truncated",
                f"iteration {r}: every episode was cut by the token budget (its last turn "
                f"reached {name}.turn_tokens={cfg.turn_tokens} tokens without a stop id, or "
                f"the episode filled its buffer before it ended) and "
                f"{name}.mask_truncated_completions=true masks them all: the update has no "
                f"token to learn from; raise {name}.turn_tokens, or let the environment's "
                "stop_ids end the turns",
            )
        )
    return notes


def episode_batch(traj, reference, G: int, P: int, temperature: float = rx.DEFAULT_TEMPERATURE):
    """`(GRPOBatch, info)` of a rollout's trajectories (groups of `G` episodes, prompts of
    `P` tokens): the episode rewards, old and reference log-probabilities on the policy's
    own tokens (the environment's are masked out), and the rollout's `kl`, `score`,
    `turns`, `truncated`, `turn_limit` (`episode_scores`) and `frac_reward_zero_std`."""
    own, ref, rewards, info = episode_scores(traj, reference, temperature)
    info["frac_reward_zero_std"] = group_signal(rewards, G)
    batch = rx.train.GRPOBatch(
        tokens=traj.tokens,
        mask=traj.mask,
        completion_mask=traj.loss_mask,
        rewards=jnp.asarray(rewards),
        old_logp=jnp.where(own, traj.logprobs, 0.0),
        ref_logp=jnp.where(own, ref, 0.0),
        truncated=traj.truncated,
        prompt_length=P,  # each group's prompt runs once in the update
        samples_per_prompt=G,
    )
    return batch, info


def episode_stage(env: StageEnv, c, name: str, run) -> Outcome:
    """A multi-turn stage on the built-in task: `run(sft, tok, prompts, game, cfg=c,
    ctx=...)` from SFT against the animal follow-up environment; the summary holds the
    held-out success rate and fluency (the base model's NLL per token of the policy's
    own tokens) of the base model, SFT and the trained policy, under keys prefixed with
    `name` (`-` as `_`)."""
    game = stage_environment(c, env.tok, name)
    sft = env.policies["sft"]
    ctx = env.ctx(name)
    key = jax.random.fold_in(env.key, 11)
    samples = env.cfg.eval_samples
    if c.environment and ctx.evaluate is not None:
        # the built-in periodic evaluation scores single-turn animal stories; a user's
        # environment is scored on its own held-out episodes (as at the end)
        def episodes(policy):
            m, _ = multiturn_metrics(policy, env.base, game, env.tok, key, c, ctx, samples)
            return {"mean_episode_reward": m["success"], "base_nll": m["base_nll"]}

        ctx = dataclasses.replace(ctx, evaluate=episodes)
    before, sft_success = multiturn_metrics(sft, env.base, game, env.tok, key, c, ctx, samples)
    base, base_success = multiturn_metrics(env.base, env.base, game, env.tok, key, c, ctx, samples)
    res = run(sft, env.tok, TRAIN_PROMPTS, game, cfg=c, ctx=ctx)
    policy = final_policy(res.state.model)
    after, success = multiturn_metrics(policy, env.base, game, env.tok, key, c, ctx, samples)
    rate = hasattr(game, "host_rewards")  # else the mean episode reward, any scale
    what = "success" if rate else "mean episode reward"
    show = (lambda x: f"{x:.1%}") if rate else (lambda x: f"{x:.4g}")
    env.say(
        f"{name}: held-out {what} {show(before['success'])} (SFT) -> "
        f"{show(after['success'])}; "
        f"base-model NLL of the policy's tokens {after['base_nll']:.2f} (base model's own "
        f"{base['base_nll']:.2f})"
    )
    k = name.replace("-", "_")
    summary = {
        f"{k}_success": after["success"],
        f"{k}_success_se": prompt_se(success, samples),
        f"{k}_success_sft": before["success"],
        f"{k}_success_sft_se": prompt_se(sft_success, samples),
        f"{k}_success_base": base["success"],
        f"{k}_success_base_se": prompt_se(base_success, samples),
        f"{k}_win_rate_vs_sft": win_rate(success, sft_success),
        f"{k}_win_rate_vs_sft_se": win_rate_se(success, sft_success, samples),
        f"{k}_base_nll": after["base_nll"],
        f"{k}_base_nll_sft": before["base_nll"],
        f"{k}_base_nll_base": base["base_nll"],
    }
    return Outcome(res, policy=policy, summary=summary)


def multiturn(env: StageEnv, c: MultiturnConfig) -> Outcome:
    """The `multiturn` stage on the built-in task: GRPO from SFT against the animal
    follow-up environment (`episode_stage`)."""
    return episode_stage(env, c, "multiturn", run_multiturn)


MULTITURN_STAGES = ("multiturn", "multiturn-dpo")

_EPISODE_SAMPLING = {
    "max_new_tokens": "a policy turn's length is {key}.turn_tokens: set that",
    "stop_strings": "a policy turn ends at one of the environment's stop_ids, or EOS",
    "slots": "the episodes roll out in one compiled program, rlhf_eqx.envs.rollout_multiturn, "
    "without continuous batching",
}
"""The single-turn sampling settings a multi-turn episode does not read, and what does
instead; `sampling.temperature`, `top_k`, `top_p`, `min_p`, the penalties (and
`prompt_length`) are the episodes' too."""


def check_episode_sampling(cfg, key: str, run) -> None:
    """Refuse a `sampling` setting of `_EPISODE_SAMPLING` changed from its default for a
    run whose stages (SFT aside) are multi-turn only: the episodes never read it, and
    only the single-turn held-out samples of the evaluation would; one line naming the
    field and the setting that applies."""
    if not set(run) <= {"sft", *MULTITURN_STAGES}:
        return  # a single-turn stage of the run samples with it
    default = type(cfg.sampling)()
    for field, instead in _EPISODE_SAMPLING.items():
        value = getattr(cfg.sampling, field)
        if value != getattr(default, field):
            _fail(
                f"sampling.{field}",
                value,
                f"the {key} stage's episodes do not read it ({instead.format(key=key)}); "
                "it would only change the single-turn held-out samples of the evaluation: "
                "keep its default for a multi-turn run",
            )


_RAISED_BY = re.compile(r"raised by (\S+) while it was traced")
"""The note `rlhf_eqx.envs.check_environment` adds to an exception raised inside an
environment's `reset` or `step`, naming the method."""


def _traced_failure(error: Exception) -> str:
    """One line on why `rlhf_eqx.envs.check_environment` refused an environment: its own
    message, or the exception tracing `reset` / `step` raised (its first line, and the
    method its note names: a `ValueError` of the environment's own is not the check's),
    with a hint when they branch in Python on a traced value."""
    first = str(error).splitlines()[0] if str(error) else ""
    notes = [_RAISED_BY.match(n) for n in getattr(error, "__notes__", ())]
    where = next((m.group(1) for m in notes if m), None)  # the method that raised it
    if where is None and type(error) in (TypeError, ValueError):  # the check's own message
        return first
    why = f"tracing its reset and step raised {type(error).__name__}: {first}"
    if where is not None:
        why += f" (in {where})"
    if isinstance(error, jax.errors.ConcretizationTypeError):
        why += (
            " (they run traced, inside the compiled rollout: no Python branching on "
            "array values; use jnp.where or jax.lax.cond)"
        )
    return why


def check_episode(key: str):
    """A multi-turn stage's rules with the model: its `environment` (when set) builds an
    `Environment` for the run's tokenizer that passes `rlhf_eqx.envs.check_environment`
    (its `reset` and `step` answers, its `stop_ids` inside the model's vocabulary), and
    an episode fits the model's `max_seq_len`
    (`check_episode_length` for the animal environment; with the stage's own, its
    episode length `_length`). The other multi-turn stage's `environment`, set while that
    stage does not run, is refused (this stage would not read it), and so is
    `max_turns=1` with the animal environment (it rewards the second turn only), and a
    single-turn sampling setting the episodes do not read (`check_episode_sampling`)."""

    def check_run(cfg, run) -> None:
        check_episode_sampling(cfg, key, run)
        c = getattr(cfg, key)
        other = "multiturn-dpo" if key == "multiturn" else "multiturn"
        spec = getattr(getattr(cfg, other, None), "environment", "")
        if spec and not c.environment and other not in run:
            _fail(
                f"{other}.environment",
                spec,
                f"the {other} stage does not run and {key} does not read it; set "
                f"{key}.environment for the {key} stage's own environment",
            )
        if not c.environment:
            if c.max_turns < 2:
                _fail(
                    f"{key}.max_turns",
                    c.max_turns,
                    "must be >= 2 with the animal follow-up environment (it rewards the "
                    f"second turn only; set {key}.environment for a one-turn game)",
                )
            check_episode_length(cfg, key, c)
            return
        sizes, found = model_sizes("model.source", cfg.model.source), run_tokenizer(cfg)
        if found is None:
            return
        game = load_environment(c.environment, found[0], f"{key}.environment")
        P = cfg.sampling.prompt_length
        vocab = sizes[0] if sizes is not None else found[0].vocab_size
        try:
            rx.envs.check_environment(
                game, prompt_length=P, max_new_tokens=c.turn_tokens, vocab_size=vocab
            )
        except Exception as e:
            _fail(f"{key}.environment", c.environment, _traced_failure(e))
        total = _length(game, c, P)
        if sizes is not None and total > sizes[1]:
            _fail(
                f"{key}.turn_tokens",
                c.turn_tokens,
                f"an episode of sampling.prompt_length={P} + {key}.max_turns={c.max_turns} "
                f"turns of {c.turn_tokens} tokens + {c.max_turns} observations of up to "
                f"{game.max_observation_tokens} tokens ({key}.environment's) is {total} "
                f"tokens, longer than the model's max_seq_len={sizes[1]}",
            )

    return check_run


register_stage(
    Stage(
        "multiturn",
        MultiturnConfig,
        multiturn,
        help="GRPO on two-turn episodes: a paragraph, then one about the animal asked for",
        check_run=check_episode("multiturn"),
    )
)
