"""Where each seed of a sweep on the built-in task starts: what a separate run with that
seed (`python -m rlhf_eqx dpo --set ops.seed=S`) computes before its stage, with the
same keys — the base model's and the SFT policy's held-out evaluations and the SFT
stage itself (`<out>/seeds/seed-<S>/`, its own metrics, checkpoints and resume), and for
PPO the reward stage after it, run once per seed and shared by the grid points."""

import contextlib
import dataclasses
import os
from collections.abc import Callable

import jax

from ._pipeline import _ctx, _stage_env, _task_labels, task_evaluator, with_win_rates
from ._registry import StageEnv, stage_key
from ._reward_stage import reward as reward_stage
from ._sft_stage import sft as sft_stage
from ._trackers import run_trackers


@dataclasses.dataclass
class SeedStart:
    """A seed's start on the built-in task: its run key, its noisy labeller, the SFT
    policy, and `against_sft(policy) -> metrics`, the held-out evaluation the pipeline
    reports for a stage after SFT (`score`, `score_se`, `base_nll`, `kl` to SFT,
    `win_rate_vs_sft` and its standard error, on the seed's evaluation key)."""

    seed: int
    key: jax.Array
    label: Callable
    env: StageEnv
    evaluate: Callable
    sft_policy: object = None
    sft_metrics: dict | None = None
    against_sft: Callable[[object], dict] | None = None


def seed_dir(out: str, seed: int) -> str:
    """The directory of the seed's shared stages (SFT) in the sweep directory `out`."""
    return os.path.join(out, "seeds", f"seed-{seed}")


def sweep_env(cfg, base, tok, run_dir: str, key, *, resume: bool, say, stage: str = "") -> StageEnv:
    """The `StageEnv` of a sweep's shared stages in `run_dir`: a stage's run context
    (`env.ctx(name)`, `name` or else `stage`) logs to `run_dir` with the key
    `stage_key(key, name)`, evaluated once at its end; the labeller is the built-in task's
    noisy one of `cfg.ops.seed`."""

    def make_ctx(name: str, periodic: bool = True):
        del periodic  # a sweep's shared stages are evaluated once, at their end
        name = name or stage
        return _ctx(cfg, run_dir, name, stage_key(key, name), resume)

    label = _task_labels(cfg)
    return _stage_env(
        cfg, base, tok, run_dir, key, make_ctx, resume=resume, say=say, label=label, stage=stage
    )


def builtin_start(
    cfg, base, tok, out: str, *, resume: bool, say, sft: bool = True, reward: bool = False
) -> SeedStart:
    """Run what precedes a stage on the built-in task for `cfg.ops.seed` (see the module
    docstring); `resume` resumes the seed's SFT run from its checkpoints. `sft=False`
    (a sweep of SFT itself): only the seed's keys, labeller, `env` and
    `evaluate(policy, reference) -> (metrics, rollout, scores)`. `reward=True` (a PPO
    sweep scored by the run's own reward model): the reward stage after SFT, its reward
    source in `env.reward`."""
    seed = cfg.ops.seed
    run_dir = seed_dir(out, seed)
    key = jax.random.key(seed)
    evaluate = task_evaluator(cfg, tok, base, key)

    env = sweep_env(cfg, base, tok, run_dir, key, resume=resume, say=say)
    if not sft:  # nothing runs before the members: no directory of the seed's own
        return SeedStart(seed, key, env.label, env, evaluate)
    os.makedirs(run_dir, exist_ok=True)
    shared = ["sft", "reward"] if reward else ["sft"]
    extra = {"seed": seed, "shared": ", ".join(shared)}
    with sweep_trackers(cfg, run_dir, out, f"seed-{seed}", extra, resume=resume):
        env.stage = "sft"
        outcome = sft_stage(env, cfg.sft)
        sft_policy = outcome.policy
        sft_metrics, _, sft_scores = evaluate(sft_policy, base)
        if reward:
            env.policies["sft"] = sft_policy
            env.stage = "reward"
            env.reward = reward_stage(env, cfg.reward).reward

    def against_sft(policy) -> dict:
        m, _, scores = evaluate(policy, sft_policy)
        return with_win_rates(m, scores, sft_scores, cfg.eval_samples)

    sft_metrics["stopped"] = outcome.result.loop.stopped
    return SeedStart(seed, key, env.label, env, evaluate, sft_policy, sft_metrics, against_sft)


def sweep_trackers(cfg, run_dir: str, out: str, run: str, extra: dict, *, resume: bool):
    """The tracker runs of one part of the sweep in `out` (a member, a seed's shared
    stages): `run_trackers` of `cfg` in `run_dir` (its metrics logs feed them, its
    `summary.json` is logged when they finish), named `<sweep dir>/<run>`, in the group
    `ops.tracker_group` or else the sweep directory's name, `extra` added to the recorded
    configuration as `sweep`; a context that does nothing when the sweep logs to no
    tracker."""
    if not cfg.ops.trackers and not cfg.ops.tensorboard:
        return contextlib.nullcontext()
    name = os.path.basename(os.path.abspath(out))
    return run_trackers(
        cfg,
        run_dir,
        resume=resume,
        run_name=f"{name}/{run}",
        group=cfg.ops.tracker_group or name,
        extra={"sweep": extra},
    )
