"""Online DPO on multi-turn episodes, the `multiturn-dpo` stage (`rlhf_eqx
multiturn-dpo`; its settings `MultiturnDPOConfig`, its run and its registration): each
round the policy plays episodes against a jittable environment (on the built-in task, a
paragraph, then one about the animal the environment asks for), the best and the worst
episode of each prompt form a preference pair, and DPO trains on the pairs.

The pair is two whole trajectories. The environment's tokens (the question between the
turns) are context but not trained: the sequence log-probabilities of DPO sum over the
policy's own tokens only (`Trajectory.loss_mask`), as multi-turn DPO does with tool or
environment outputs (Xiong et al. 2024, "Building Math Agents with Multi-Turn Iterative
Preference Learning"; Shi et al. 2024, "Direct Multi-Turn Preference Optimization for
Language Agents").
"""

import dataclasses
import math
from collections.abc import Sequence
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

import rlhf_eqx as rx

from ..envs import Trajectory
from ._config import ConfigError, LoRASettings, _optim
from ._dpo_stage import DPOConfig, _round_steps
from ._monitor import model_flops
from ._multiturn_stage import (
    EnvironmentChecked,
    _length,
    check_episode,
    episode_scores,
    episode_stage,
    round_episodes,
    run_episodes,
)
from ._registry import Outcome, Stage, StageEnv, register_stage
from ._runs import RunContext, RunResult, take_rows, train_setup
from ._validation import validate_stage


@dataclasses.dataclass(frozen=True)
class MultiturnDPOConfig(EnvironmentChecked, DPOConfig):
    """Online DPO (the `dpo` settings: `beta`, `loss_type`, ...) on episodes of
    `max_turns` policy turns of at most `turn_tokens` tokens each against the animal
    follow-up environment (`rlhf_eqx.envs.AnimalFollowUpEnv`). Each of `rounds` rounds
    samples `prompts_per_round` training prompts, plays `samples` episodes per prompt
    with the current policy, pairs the best and the worst episode of each prompt by
    episode reward (prompts whose episodes all tie give no pair) and takes `steps` DPO
    steps of `batch_size` pairs. The run stops early when the per-token KL of the
    sampled policy tokens to the reference exceeds `kl_target`. `max_length` is unused
    (an episode's length is the prompt, every turn and the questions between them; it
    must fit the model's `max_seq_len`, checked before any stage runs) and `packing`
    must stay off (`unused_fields`: both keep their defaults).

    The stage runs on the built-in task only, so its defaults are the task's: LoRA rank
    8 on every projection, as the `multiturn` stage; β 0.1, learning rate 1e-3, 24
    rounds of 16 prompts × 8 episodes, 4 steps of 8 pairs a round, and the chosen
    episodes' NLL with weight `rpo_alpha` 0.5 (RPO, Pang et al. 2024), measured to
    raise the held-out success rate well over SFT's while the base model's NLL of the
    policy's tokens stays within 0.3 nat per token of its own.

    `environment`: the user's own environment instead, as the `multiturn` stage's
    (`MODULE:NAME` of a factory `NAME(tok) -> rlhf_eqx.envs.Environment`, or an
    `Environment` instance; its held-out `success` is the mean episode reward), and
    `episode_reward` (`sum` or `last` of the turns' rewards) as that stage's."""

    unused_fields: ClassVar[tuple[str, ...]] = ("max_length", "packing")
    rounds: int = 24
    samples: int = 8
    steps: int = 4
    batch_size: int = 8
    rpo_alpha: float | None = 0.5
    optim: rx.train.OptimizerSettings = _optim(1e-3)
    lora: LoRASettings = LoRASettings(
        rank=8, alpha=16.0, dropout=0.0, targets=("q", "k", "v", "o", "gate", "up", "down")
    )
    max_turns: int = 2
    turn_tokens: int = 40
    prompts_per_round: int = 16
    kl_target: float = 1.0
    environment: str = ""
    episode_reward: str = "sum"

    def __post_init__(self):
        for name in ("max_turns", "turn_tokens", "prompts_per_round"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"multiturn-dpo.{name}={v!r}: must be an integer >= 1")
        v = self.kl_target
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < math.inf:
            raise ConfigError(f"multiturn-dpo.kl_target={v!r}: must be a finite number > 0")
        if self.packing:
            raise ConfigError("multiturn-dpo.packing=True: must be false (episodes train unpacked)")
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()


def episode_pairs(
    traj: Trajectory,
    rewards: Float[np.ndarray, " E"] | Float[Array, " E"],
    *,
    samples: int,
) -> tuple[rx.PreferenceBatch | None, int]:
    """Preference pairs of multi-turn episodes: for each prompt's `samples` episodes
    (rows `j · samples ...` of `traj`, as `rollout_multiturn` writes them), the episode
    with the highest reward is chosen and the one with the lowest rejected (the first
    of each on ties within the top or the bottom); a prompt whose episodes all have the
    same reward gives no pair. Both rows keep their whole context (prompt and the
    environment's observations) in `mask`, and their completion masks are
    `loss_mask & mask`: the policy's own tokens, the only ones DPO's sequence
    log-probabilities sum over.

    **Arguments:**

    - `traj`: `E = B · samples` episodes.
    - `rewards`: `[E]` episode rewards (e.g. `traj.reward`), finite.
    - `samples`: episodes per prompt; must divide `E`.

    **Returns:** `(pairs, count)`: a `PreferenceBatch` of the `count` pairs, in prompt
    order, or `(None, 0)` when every prompt's episodes tie.
    """
    E = traj.tokens.shape[0]
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1 or E % samples:
        raise ValueError(f"samples={samples!r}: must be an integer >= 1 dividing the {E} episodes")
    r = np.asarray(rewards, np.float64)
    if r.shape != (E,):
        raise ValueError(f"rewards: expected shape ({E},) (one per episode), got {r.shape}")
    if not np.all(np.isfinite(r)):
        raise ValueError(f"rewards: must be finite, got {r[~np.isfinite(r)][:4].tolist()}")
    groups = r.reshape(-1, samples)
    best, worst = groups.argmax(axis=1), groups.argmin(axis=1)
    rows = np.arange(groups.shape[0])
    keep = np.flatnonzero(groups[rows, best] > groups[rows, worst])
    if keep.size == 0:
        return None, 0
    chosen = jnp.asarray(keep * samples + best[keep])
    rejected = jnp.asarray(keep * samples + worst[keep])
    own = traj.loss_mask & traj.mask
    pairs = rx.PreferenceBatch(
        chosen_tokens=traj.tokens[chosen],
        chosen_mask=traj.mask[chosen],
        chosen_completion_mask=own[chosen],
        rejected_tokens=traj.tokens[rejected],
        rejected_mask=traj.mask[rejected],
        rejected_completion_mask=own[rejected],
    )
    return pairs, int(keep.size)


def run_multiturn_dpo(
    policy, tok, prompts: Sequence[str], env, *, cfg: MultiturnDPOConfig, ctx: RunContext
) -> RunResult:
    r"""Online DPO on multi-turn episodes against the jittable environment `env` (one with
    `stop_ids` and `max_observation_tokens`, as `rlhf_eqx.envs.AnimalFollowUpEnv`).

    Online / iterative DPO (Xu et al. 2023; Guo et al. 2024) with trajectories as the
    responses: for each of `cfg.rounds` rounds, `cfg.prompts_per_round` prompts (rows
    `rows_at(len(prompts), ...)`), `cfg.samples` episodes each from the current policy
    in one compiled rollout (`rlhf_eqx.envs.rollout_multiturn`); the best and the worst
    episode of each prompt form a pair (`episode_pairs`); the reference (the policy
    without its LoRA adapters) scores the pairs once (`compute_reference_logps`); then
    `cfg.steps` DPO steps of `cfg.batch_size` pairs,

    $$\mathcal{L} = -\log\sigma\Big(\beta \sum_{t \in a^w}
    \log\frac{\pi_\theta(y^w_t \mid y^w_{<t})}{\pi_{ref}(y^w_t \mid y^w_{<t})}
    - \beta \sum_{t \in a^l}
    \log\frac{\pi_\theta(y^l_t \mid y^l_{<t})}{\pi_{ref}(y^l_t \mid y^l_{<t})}\Big)$$

    where $a^w$, $a^l$ are the policy's own tokens of the chosen and rejected episodes:
    the environment's observations sit in the context $y_{<t}$ and are not scored
    (Xiong et al. 2024, multi-turn DPO with external messages masked; Shi et al. 2024
    on DPO for multi-turn agents). Each round logs `pairs`, `score` (mean episode
    reward), `turns`, `truncated` and `turn_limit` (the fractions of episodes the token
    budget cut and the turn limit ended) and `kl` (per-token KL of the sampled policy
    tokens to the reference; the KL guard stops the run above `cfg.kl_target`); a round without a
    pair logs a `no_signal` event and takes no step. Checkpoints, exact resume and
    rollback are `run_loop`'s.

    **Returns:** the `RunResult` (its `state.model` has the LoRA adapters unmerged).
    """
    validate_stage("multiturn-dpo", cfg)
    k_lora, ctx_key = jax.random.split(ctx.key)
    total = cfg.rounds * cfg.steps
    state, reference, step = train_setup(policy, cfg, total, k_lora, rx.train.make_dpo_step)
    n, S, P = cfg.prompts_per_round, cfg.samples, ctx.prompt_length
    length = _length(env, cfg, P)

    def iteration(state, key, r):
        k_sample, k_steps = jax.random.split(key)
        traj = round_episodes(state.model, env, tok, prompts, k_sample, r, cfg, ctx, n, S)
        _, _, rewards, scores = episode_scores(traj, reference, ctx.temperature)
        pairs, count = episode_pairs(traj, rewards, samples=S)
        info = {"pairs": float(count), **scores}
        if pairs is None:
            ctx.log.event(
                "no_signal",
                f"round {r}: every prompt's episodes got the same reward; no pairs",
                iteration=r,
            )
            return state, [], info
        # one shape for the reference pass whatever the count: the pairs, cycled to `n`
        full = rx.train.compute_reference_logps(reference, take_rows(pairs, np.arange(n) % count))
        state, metrics = _round_steps(state, step, full, count, cfg, ctx.ops.seed + r, k_steps)
        return state, metrics, info

    sampled = n * S * length
    flops = model_flops(
        rx.count_params(state.model),
        forward_tokens=2 * sampled + 2 * n * length,  # rollout, reference KL, reference pairs
        train_tokens=cfg.steps * 2 * cfg.batch_size * length,
    )
    return run_episodes(state, iteration, ctx, ctx_key, cfg, cfg.rounds, n * S, flops)


def multiturn_dpo(env: StageEnv, c: MultiturnDPOConfig) -> Outcome:
    """The `multiturn-dpo` stage on the built-in task: online DPO from SFT on episodes of
    the animal follow-up environment, evaluated as the `multiturn` stage is
    (`episode_stage`: held-out success and fluency of base, SFT and the trained policy)."""
    return episode_stage(env, c, "multiturn-dpo", run_multiturn_dpo)


register_stage(
    Stage(
        "multiturn-dpo",
        MultiturnDPOConfig,
        multiturn_dpo,
        help="online DPO on two-turn episodes (best vs worst episode per prompt)",
        check_run=check_episode("multiturn-dpo"),
    )
)
