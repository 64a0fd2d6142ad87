"""The result of a multi-turn rollout, and building it from the episodes' buffers."""

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
    - `truncated`: `[E]` the environment did not end the episode (the turn limit or the
      token budget did).
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


def _trajectory(eps: _Episode, turn_rewards, num_turns, done, episode_reward: str) -> Trajectory:
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
        truncated=~done,
    )
