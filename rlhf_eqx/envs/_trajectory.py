"""The result of a multi-turn rollout, the episodes' standing between turns, and building
the result from the episodes' buffers."""

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ._turns import _Episode


class Trajectory(eqx.Module):
    """A batch of multi-turn episodes, `E = B · num_samples` rows (the `num_samples`
    episodes of prompt `i` in rows `i · num_samples ...`), `T = max_total_tokens`.

    - `tokens`: the prompt (as given, with its padding) then every observation and policy
      turn, written contiguously; `pad_id` after the end.
    - `mask`: real tokens (the attention mask of a training step).
    - `loss_mask`: the policy's own sampled tokens (stop tokens included) — the
      `completion_mask` of a GRPO / PPO step; prompts and observations are excluded.
    - `logprobs`: behaviour log-probabilities of the policy's tokens at the sampling
      temperature (as `rlhf_eqx.generate`), 0 elsewhere: the `old_logp` of a step.
    - `turn_ids`: the policy turn (0, 1, ...) that sampled each token, -1 for prompt,
      observation and padding tokens.
    - `turn_rewards`: `[E, max_turns]` each turn's reward from the environment, 0 for
      turns not taken.
    - `reward`: `[E]` the episode reward: the sum of `turn_rewards`, or the last turn's
      (`episode_reward="last"`).
    - `num_turns`: `[E]` policy turns taken.
    - `truncated`: `[E]` the token budget cut the episode: its last turn was cut at
      `max_new_tokens` (or at the end of the buffer) without a stop id — even when the
      environment then ended the episode, as a final answer cut short — or its buffer of
      `max_total_tokens` filled up before the environment or the turn limit ended it.
      Its output is cut short: what DAPO's overlong filtering
      (`mask_truncated_completions`) drops.
    - `turn_limit`: `[E]` the turn limit ended the episode: `max_turns` turns played,
      the last one ended at a stop id, and the environment did not end it. Not
      truncated: every turn is whole. Each episode ends one way: by the environment
      with a whole last turn (neither flag), by the turn limit, or by the token budget.
      `None` in a `Trajectory` built without it.
    """

    tokens: Int[Array, "E T"]
    mask: Bool[Array, "E T"]
    loss_mask: Bool[Array, "E T"]
    logprobs: Float[Array, "E T"]
    turn_ids: Int[Array, "E T"]
    turn_rewards: Float[Array, "E turns"]
    reward: Float[Array, " E"]
    num_turns: Int[Array, " E"]
    truncated: Bool[Array, " E"]
    turn_limit: Bool[Array, " E"] | None = None


class _Progress(eqx.Module):
    """Where the `E` episodes of a rollout stand between turns (both rollouts keep it):
    `done` once the environment ended an episode, `stopped` once it can play no more
    (its policy had no room, or its buffer is full), `cut` when its last turn ended
    without a stop id, each turn's reward (`[E, K]`, 0 for turns not taken) and the
    number of turns taken."""

    done: Bool[Array, " E"]
    stopped: Bool[Array, " E"]
    cut: Bool[Array, " E"]
    turn_rewards: Float[Array, "E K"]
    num_turns: Int[Array, " E"]

    @classmethod
    def start(cls, episodes: int, max_turns: int) -> "_Progress":
        return cls(
            done=jnp.zeros((episodes,), jnp.bool_),
            stopped=jnp.zeros((episodes,), jnp.bool_),
            cut=jnp.zeros((episodes,), jnp.bool_),
            turn_rewards=jnp.zeros((episodes, max_turns), jnp.float32),
            num_turns=jnp.zeros((episodes,), jnp.int32),
        )

    @property
    def active(self) -> Bool[Array, " E"]:
        """The episodes that play the next turn."""
        return ~self.done & ~self.stopped

    def after_turn(self, turn, took, cut, reward, ended, length, total: int) -> "_Progress":
        """The standing after turn `turn`: `took` marks the episodes whose policy played
        it, `cut` those whose turn ended without a stop id, `reward` and `ended` their
        environment's answer (ignored elsewhere), `length` the episodes' buffer lengths
        out of `total`."""
        took = jnp.asarray(took)
        return _Progress(
            done=self.done | (took & jnp.asarray(ended)),
            stopped=self.stopped | (self.active & (~took | (length >= total))),
            cut=jnp.where(took, jnp.asarray(cut), self.cut),
            turn_rewards=self.turn_rewards.at[:, turn].set(jnp.where(took, reward, 0.0)),
            num_turns=self.num_turns + took.astype(jnp.int32),
        )


def _trajectory(eps: _Episode, progress: _Progress, episode_reward: str) -> Trajectory:
    turn_rewards, num_turns = progress.turn_rewards, progress.num_turns
    open_ended = ~progress.done  # the environment did not end it
    all_turns = num_turns >= turn_rewards.shape[1]
    truncated = progress.cut | (open_ended & ~all_turns)
    if episode_reward == "sum":
        reward = jnp.sum(turn_rewards, axis=-1)
    else:
        last = jnp.maximum(num_turns - 1, 0)
        picked = jnp.take_along_axis(turn_rewards, last[:, None], axis=-1)[:, 0]
        reward = jnp.where(num_turns > 0, picked, jnp.zeros_like(picked))
    return Trajectory(
        tokens=eps.tokens,
        mask=eps.mask,
        loss_mask=eps.loss_mask,
        logprobs=eps.logprobs,
        turn_ids=eps.turn_ids,
        turn_rewards=turn_rewards,
        reward=reward,
        num_turns=num_turns,
        truncated=truncated,
        turn_limit=open_ended & ~truncated,
    )
