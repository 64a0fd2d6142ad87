"""Recording what the server samples, episode by episode, as training data.

Each completion the server returns is one *turn* of an episode: the prompt ids the model
was given, the completion ids it sampled and their behaviour log-probabilities. An
episode's turns join into one token sequence in the layout of the library's multi-turn
rollouts (`rlhf_eqx.envs.Trajectory`): the first prompt, the first completion, then for
each later turn the tokens its prompt adds (the environment's reply: an observation,
kept out of the loss) and its completion.
"""

import dataclasses
import math
import numbers
import threading
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from jaxtyping import Bool, Float32, Int32

from ..data import GRPOBatch
from ..envs import Trajectory
from ..losses import group_advantages


@dataclasses.dataclass(frozen=True)
class Turn:
    """One completion the server returned.

    - `episode_id`: the episode it belongs to (the request's `episode_id` or `user`;
      else the request's own id; choice `g` of a request with more than one choice is
      episode `"<id>/<g>"`).
    - `prompt_ids`: every token the model was given, in order.
    - `completion_ids`: the tokens it sampled (a stop id that ended it included).
    - `logprobs`: their log-probabilities at `temperature` (1 when greedy), as
      `rlhf_eqx.token_logprobs(policy, tokens, mask, temperature=...)` gives them.
    - `finish_reason`: `"stop"` or `"length"`.
    - `policy_version`: the version of the weights that sampled it (0 for the policy the
      server started with, then one more at each `Server.update_policy`).
    - `temperature`: the sampling temperature (0: greedy).
    - `request_id`: the response's `id`.
    """

    episode_id: str
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    policy_version: int
    temperature: float
    request_id: str


@dataclasses.dataclass(frozen=True)
class Episode:
    """An episode's turns joined into one sequence (`T` tokens).

    - `tokens`: the first prompt, then each turn's new prompt tokens and completion.
    - `loss_mask`: true on the sampled tokens (the `completion_mask` of a step).
    - `logprobs`: behaviour log-probabilities on the sampled tokens, 0 elsewhere.
    - `turn_ids`: the turn (0, 1, ...) that sampled each token, -1 elsewhere.
    - `prompt_length`: the first prompt's length.
    - `turns`: the recorded `Turn`s; `policy_versions`: each turn's weights' version.
    - `reward`: what `Recording.reward` reported, or `None`.
    - `truncated`: the last turn ran out of tokens (`finish_reason == "length"`).
    """

    episode_id: str
    tokens: Int32[np.ndarray, " T"]
    loss_mask: Bool[np.ndarray, " T"]
    logprobs: Float32[np.ndarray, " T"]
    turn_ids: Int32[np.ndarray, " T"]
    prompt_length: int
    turns: tuple[Turn, ...]
    reward: float | None
    truncated: bool

    @property
    def policy_versions(self) -> tuple[int, ...]:
        return tuple(t.policy_version for t in self.turns)


def _join(episode_id: str, turns: Sequence[Turn], reward: float | None) -> Episode:
    tokens: list[int] = list(turns[0].prompt_ids)
    loss: list[bool] = [False] * len(tokens)
    logp: list[float] = [0.0] * len(tokens)
    turn_ids: list[int] = [-1] * len(tokens)
    for k, turn in enumerate(turns):
        prompt = list(turn.prompt_ids)
        if prompt[: len(tokens)] != tokens:
            raise ValueError(
                f"episode {episode_id!r}: turn {k}'s prompt does not continue the tokens of "
                f"turns 0..{k - 1} (the conversation was edited, or it was rendered again "
                "without the episode id); tag every turn of an episode with its id and send "
                "the history back as the server returned it"
            )
        added = prompt[len(tokens) :]
        tokens += added + list(turn.completion_ids)
        loss += [False] * len(added) + [True] * len(turn.completion_ids)
        logp += [0.0] * len(added) + list(turn.logprobs)
        turn_ids += [-1] * len(added) + [k] * len(turn.completion_ids)
    return Episode(
        episode_id=episode_id,
        tokens=np.asarray(tokens, np.int32),
        loss_mask=np.asarray(loss, bool),
        logprobs=np.asarray(logp, np.float32),
        turn_ids=np.asarray(turn_ids, np.int32),
        prompt_length=len(turns[0].prompt_ids),
        turns=tuple(turns),
        reward=reward,
        truncated=turns[-1].finish_reason == "length",
    )


def _right_padded(rows: Sequence, length: int, fill, dtype) -> jnp.ndarray:
    """`rows` (sequences of at most `length` values) as a `[len(rows), length]` array,
    each right-padded with `fill`."""
    out = np.full((len(rows), length), fill, dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return jnp.asarray(out)


class Recording:
    """The turns a `Server` samples while the recording is open
    (`with server.recording() as rec:`), and the rewards reported for their episodes.

    Safe to use from any thread. `episodes()` joins the turns; `trajectory()` pads the
    episodes into an `rlhf_eqx.envs.Trajectory` and `grpo_batch()` into a
    `rlhf_eqx.data.GRPOBatch`.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._turns: dict[str, list[Turn]] = {}
        self._rewards: dict[str, float] = {}

    def add(self, turn: Turn) -> None:
        """Record a turn (the server calls this for every completion it returns). A
        turn with the same prompt as the episode's last one replaces it: the client
        asked again (a retry after a timeout), and its history holds the new answer."""
        with self._lock:
            turns = self._turns.setdefault(turn.episode_id, [])
            if turns and turns[-1].prompt_ids == turn.prompt_ids:
                turns[-1] = turn
            else:
                turns.append(turn)

    def reward(self, episode_id: str, reward: float) -> None:
        """Report an episode's reward (a finite number; a later report replaces it)."""
        if not (isinstance(reward, numbers.Real) and math.isfinite(float(reward))):
            raise ValueError(f"reward for episode {episode_id!r} must be a finite number")
        with self._lock:
            if episode_id not in self._turns:
                raise KeyError(f"no episode {episode_id!r} was recorded")
            self._rewards[episode_id] = float(reward)

    def episode_ids(self) -> list[str]:
        """The recorded episodes, in the order of their first turn."""
        with self._lock:
            return list(self._turns)

    def turns(self, episode_id: str) -> list[Turn]:
        """An episode's turns, in order."""
        with self._lock:
            if episode_id not in self._turns:
                raise KeyError(f"no episode {episode_id!r} was recorded")
            return list(self._turns[episode_id])

    def episodes(self, episode_ids: Sequence[str] | None = None) -> list[Episode]:
        """The episodes `episode_ids` (default: all, in the order of their first turn),
        each turn's prompt continuing the tokens before it.

        Raises `ValueError` naming the episode and turn where a prompt does not continue
        the episode's tokens, `KeyError` for an unknown episode."""
        with self._lock:
            ids = list(self._turns) if episode_ids is None else list(episode_ids)
            missing = [e for e in ids if e not in self._turns]
            if missing:
                raise KeyError(f"no episode {missing[0]!r} was recorded")
            picked = [(e, list(self._turns[e]), self._rewards.get(e)) for e in ids]
        return [_join(e, turns, r) for e, turns, r in picked]

    def trajectory(
        self,
        episode_ids: Sequence[str] | None = None,
        *,
        length: int | None = None,
        pad_id: int = 0,
    ) -> Trajectory:
        """The episodes as an `rlhf_eqx.envs.Trajectory` (`E` rows, right-padded to
        `length`, default the longest episode): `loss_mask` on the sampled tokens,
        `logprobs` their behaviour log-probabilities, the reward in `turn_rewards` at
        the last turn and in `reward`.

        Raises `ValueError` naming an episode without a reward (`reward(id, r)`), one
        longer than `length`, or episodes sampled at different temperatures."""
        episodes = self.episodes(episode_ids)
        if not episodes:
            raise ValueError("the recording holds no episodes")
        temps = {t.temperature for ep in episodes for t in ep.turns}
        if len(temps) > 1:
            raise ValueError(
                f"the episodes were sampled at different temperatures {sorted(temps)}; a step "
                "takes one"
            )
        for ep in episodes:
            if ep.reward is None:
                raise ValueError(
                    f"episode {ep.episode_id!r} has no reward: call reward({ep.episode_id!r}, r)"
                )
        T = max(len(ep.tokens) for ep in episodes) if length is None else int(length)
        for ep in episodes:
            if len(ep.tokens) > T:
                raise ValueError(
                    f"episode {ep.episode_id!r} has {len(ep.tokens)} tokens, above length={T}"
                )
        turns = max(len(ep.turns) for ep in episodes)
        # the reward at the episode's last turn, 0 at the others
        last_turn = [[0.0] * (len(ep.turns) - 1) + [ep.reward] for ep in episodes]
        return Trajectory(
            tokens=_right_padded([ep.tokens for ep in episodes], T, pad_id, np.int32),
            mask=_right_padded([[True] * len(ep.tokens) for ep in episodes], T, False, bool),
            loss_mask=_right_padded([ep.loss_mask for ep in episodes], T, False, bool),
            logprobs=_right_padded([ep.logprobs for ep in episodes], T, 0.0, np.float32),
            turn_ids=_right_padded([ep.turn_ids for ep in episodes], T, -1, np.int32),
            turn_rewards=_right_padded(last_turn, turns, 0.0, np.float32),
            reward=jnp.asarray([ep.reward for ep in episodes], jnp.float32),
            num_turns=jnp.asarray([len(ep.turns) for ep in episodes], jnp.int32),
            truncated=jnp.asarray([ep.truncated for ep in episodes]),
        )

    def grpo_batch(
        self,
        episode_ids: Sequence[str] | None = None,
        *,
        groups: Sequence[Sequence[str]] | None = None,
        scale: str = "group",
        length: int | None = None,
        pad_id: int = 0,
    ) -> GRPOBatch:
        """The episodes as a `rlhf_eqx.data.GRPOBatch` (`trajectory()`'s rows: the
        `completion_mask` is `loss_mask`, `old_logp` the behaviour log-probabilities,
        `rewards` the reported rewards). Groups are consecutive rows: list each group's
        episodes together in `episode_ids`, for a step whose `group_size` is every
        group's size. Train it at the temperature it was sampled at (`Turn.temperature`;
        1 for greedy).

        Groups of different sizes (tasks that ended with different numbers of
        episodes): give `groups`, each a list of episode ids, instead of `episode_ids`.
        The rows are the groups' episodes in order, and `advantages` each group's own
        group-relative advantages, $A_i = (r_i - \\bar r_g) / (\\sigma_g + \\epsilon)$
        (`rlhf_eqx.losses.group_advantages` with `scale="group"`, or `"none"`: no
        division; a group of one episode gets 0); train it with `group_size=1` (the step
        takes the advantages as given).

        For PPO, `tr = trajectory(...)` then `rlhf_eqx.train.prepare_ppo_batch(model,
        reference, tr.tokens, tr.mask, tr.loss_mask, tr.reward, ...)` gives the
        `PPOBatch` (values, KL-shaped rewards and advantages on the sampled tokens)."""
        advantages = None
        if groups is not None:
            if episode_ids is not None:
                raise ValueError("give episode_ids or groups, not both")
            if isinstance(groups, str) or not all(
                len(g) > 0 and not isinstance(g, str) for g in groups
            ):
                raise ValueError("groups must be non-empty lists of episode ids")
            if scale not in ("group", "none"):
                raise ValueError(f"scale must be 'group' or 'none', got {scale!r}")
            episode_ids = [e for g in groups for e in g]
        tr = self.trajectory(episode_ids, length=length, pad_id=pad_id)
        if groups is not None:
            rewards, start, parts = np.asarray(tr.reward), 0, []
            for g in groups:
                r = jnp.asarray(rewards[start : start + len(g)])[None]
                parts.append(group_advantages(r, scale=scale)[0] if len(g) > 1 else r[0] * 0)
                start += len(g)
            advantages = jnp.concatenate(parts)
        return GRPOBatch(
            tokens=tr.tokens,
            mask=tr.mask,
            completion_mask=tr.loss_mask,
            rewards=tr.reward,
            advantages=advantages,
            old_logp=tr.logprobs,
            truncated=tr.truncated,
        )
