"""Multi-turn rollouts against a jittable environment: policy turn → environment turn →
... in one compiled program (`rollout_multiturn`; the buffer layout, KV cache and keys
are described in `_turns`), and the checks of a multi-turn rollout's arguments, policy
and environment that both rollouts (this one and `rollout_multiturn_host`) run once
before anything is compiled.
"""

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Int, Integer, PRNGKeyArray

from .._sampling import DEFAULT_TEMPERATURE, SamplingOptions, prompt_arrays
from ..models import AbstractDecoder
from ._environment import Environment
from ._trajectory import Trajectory, _Progress, _trajectory
from ._turns import _Episode, _episode_keys, _start_batch, _turn, _TurnOptions


class _Options(eqx.Module):
    """The rollout's static settings (validated once)."""

    turn: _TurnOptions
    num_samples: int
    max_turns: int
    episode_reward: str

    @property
    def total(self) -> int:
        return self.turn.total

    @property
    def sampling(self) -> SamplingOptions:
        return self.turn.sampling


def _options(
    prompts,
    prompt_masks,
    *,
    max_turns,
    max_total_tokens,
    num_samples,
    episode_reward,
    **sampling,
) -> _Options:
    """The rollout's settings checked; `**sampling` are a turn's `SamplingOptions` fields
    (`max_new_tokens`, `temperature`, `top_k`, `top_p`, `min_p`, the three penalties,
    `eos_id`, `pad_id`)."""
    turn_sampling = SamplingOptions(**sampling)
    if not (isinstance(num_samples, int) and not isinstance(num_samples, bool) and num_samples > 0):
        raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
    if prompts.ndim != 2 or prompts.shape != prompt_masks.shape:
        raise ValueError(
            f"prompts {prompts.shape} and prompt_masks {prompt_masks.shape} must be two "
            "[B, P] arrays of the same shape"
        )
    if not (isinstance(max_turns, int) and not isinstance(max_turns, bool) and max_turns > 0):
        raise ValueError(f"max_turns must be a positive int, got {max_turns!r}")
    P = prompts.shape[1]
    if not (isinstance(max_total_tokens, int) and max_total_tokens > P):
        raise ValueError(
            f"max_total_tokens must be an int larger than the prompt length {P} (the buffer "
            f"holds the padded prompt, then every turn), got {max_total_tokens!r}"
        )
    if episode_reward not in ("sum", "last"):
        raise ValueError(f"episode_reward must be 'sum' or 'last', got {episode_reward!r}")
    return _Options(
        turn=_TurnOptions(sampling=turn_sampling, total=max_total_tokens),
        num_samples=num_samples,
        max_turns=max_turns,
        episode_reward=episode_reward,
    )


def _check_policy(
    policy: object, prompts: Any, prompt_masks: Any, opts: _Options
) -> tuple[AbstractDecoder, Any, Any]:
    """The decoder checked, with the prompts and their masks as `prompt_arrays` returns
    them (concrete ids inside its vocabulary, 0 / 1 mask values, a real token in every
    row; JAX arrays, bool masks), its stop ids and its `max_seq_len` against the buffer."""
    if not isinstance(policy, AbstractDecoder):
        raise TypeError(
            "a rollout needs a decoder: a model inheriting rlhf_eqx.models.AbstractDecoder "
            f"(init_cache / prefill / decode_step), such as rlhf_eqx.Policy; got "
            f"{type(policy).__name__}"
        )
    prompts, prompt_masks = prompt_arrays(prompts, prompt_masks, policy.vocab_size, "prompts row")
    stops = [i for i in opts.sampling.eos_id or () if i >= policy.vocab_size]
    if stops:
        raise ValueError(
            f"eos_id {stops[0]} is outside the vocabulary [0, {policy.vocab_size}): no turn "
            "could stop at it (an environment's stop_ids of another tokenizer?)"
        )
    limit = getattr(getattr(policy, "cfg", None), "max_seq_len", None)
    if isinstance(limit, int) and opts.total > limit:
        raise ValueError(
            f"max_total_tokens={opts.total} is longer than the model's max_seq_len={limit}"
        )
    return policy, prompts, prompt_masks


def _signature(tree: Any) -> tuple[Any, list[str]]:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, [f"{x.dtype}{list(np.shape(x))}" for x in leaves]  # PRNG keys too


def _check_array(name: str, x: Any, shape: tuple[int, ...], kind: str) -> None:
    dtype = getattr(x, "dtype", None)
    ok_kind = dtype is not None and (
        (kind == "int" and jnp.issubdtype(dtype, jnp.integer))
        or (kind == "bool" and dtype == jnp.bool_)
        or (kind == "float" and jnp.issubdtype(dtype, jnp.floating))
    )
    if tuple(getattr(x, "shape", ())) != shape or not ok_kind:
        got = f"{x.shape} {dtype}" if dtype is not None else f"a {type(x).__name__}"
        article = "an" if kind == "int" else "a"
        raise ValueError(f"{name} must be {article} {kind} array of shape {shape}, got {got}")


def check_environment(
    env: Environment,
    *,
    prompt_length: int,
    max_new_tokens: int,
    vocab_size: int | None = None,
) -> Environment:
    """Check a jittable environment as `rollout_multiturn` does before it compiles
    anything, without a policy: `reset` and `step` traced once (no computation) on a
    prompt of `prompt_length` ids and a turn of `max_new_tokens`, their answers'
    structure, shapes and dtypes, the state `step` keeps; and, with `vocab_size`, its
    `stop_ids` (ints inside the vocabulary). For a run to refuse an environment before
    it trains anything (the multi-turn stages do).

    **Raises** a `TypeError` or `ValueError` naming the environment's class and what is
    wrong. **Returns** `env`.
    """
    if not (isinstance(max_new_tokens, int) and max_new_tokens > 0):
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    env = _check_environment(env, prompt_length, max_new_tokens)
    stops = getattr(env, "stop_ids", ()) or ()
    name = type(env).__name__
    if isinstance(stops, int | str | bytes) or not all(
        isinstance(i, int | np.integer) and not isinstance(i, bool) for i in stops
    ):
        raise TypeError(f"{name}.stop_ids must be a tuple of int token ids, got {stops!r}")
    bad = [int(i) for i in stops if vocab_size is not None and not 0 <= i < vocab_size]
    if bad:
        raise ValueError(
            f"{name}.stop_ids holds {bad[0]}, outside the vocabulary [0, {vocab_size}): no "
            "turn could stop at it (stop ids of another tokenizer?)"
        )
    return env


def _traced(method, where: str, *args: Any) -> Any:
    """`jax.eval_shape(method, *args)`; an exception raised while tracing it goes on with
    a note naming `where` (`Guess.step`): `raised by Guess.step while it was traced
    (rlhf_eqx.envs.check_environment)`."""
    try:
        return jax.eval_shape(method, *args)
    except Exception as e:
        e.add_note(f"raised by {where} while it was traced (rlhf_eqx.envs.check_environment)")
        raise


def _check_environment(env: object, prompt_length: int, max_new_tokens: int) -> Environment:
    """Trace `reset` and `step` once (no computation) and refuse wrong outputs."""
    if not isinstance(env, Environment):
        raise TypeError(
            "rollout_multiturn needs a jittable rlhf_eqx.envs.Environment (use "
            f"rollout_multiturn_host for a HostEnvironment); got {type(env).__name__}"
        )
    width = env.max_observation_tokens
    name = type(env).__name__
    if not (isinstance(width, int) and not isinstance(width, bool) and width > 0):
        raise ValueError(f"{name}.max_observation_tokens must be a positive int, got {width!r}")
    key = jax.random.key(0)
    prompt = jax.ShapeDtypeStruct((prompt_length,), jnp.int32)
    pmask = jax.ShapeDtypeStruct((prompt_length,), jnp.bool_)
    out = _traced(env.reset, f"{name}.reset", key, prompt, pmask)
    if not (isinstance(out, tuple) and len(out) == 3):
        raise ValueError(f"{name}.reset must return (state, observation, observation_mask)")
    state, obs, obs_mask = out
    _check_array(f"{name}.reset's observation", obs, (width,), "int")
    _check_array(f"{name}.reset's observation_mask", obs_mask, (width,), "bool")
    N = max_new_tokens
    comp = jax.ShapeDtypeStruct((N,), jnp.int32)
    cmask = jax.ShapeDtypeStruct((N,), jnp.bool_)
    out = _traced(env.step, f"{name}.step", state, comp, cmask)
    if not (isinstance(out, tuple) and len(out) == 5):
        raise ValueError(
            f"{name}.step must return (state, observation, observation_mask, reward, done)"
        )
    new_state, obs, obs_mask, reward, done = out
    _check_array(f"{name}.step's observation", obs, (width,), "int")
    _check_array(f"{name}.step's observation_mask", obs_mask, (width,), "bool")
    _check_array(f"{name}.step's reward", reward, (), "float")
    _check_array(f"{name}.step's done", done, (), "bool")
    if _signature(new_state) != _signature(state):
        raise ValueError(
            f"{name}.step returned a state with leaves {_signature(new_state)[1]} but "
            f"reset returned {_signature(state)[1]}: the state must keep its structure, "
            "shapes and dtypes"
        )
    return env


def check_trajectory(trajectory: Trajectory, *, environment: str, vocab_size: int) -> Trajectory:
    """Refuse what a rollout inside `jit` / `vmap` could not check: an observation id
    outside the vocabulary of `vocab_size` ids, or a turn reward that is not finite, in
    a concrete `trajectory` (`rollout_multiturn` checks its own when called outside
    them). `environment` names the environment in the error (its class name). One
    rollout's episodes (`tokens` `[E, T]`, `turn_rewards` `[E, K]`): check the members of
    a vmapped rollout one at a time (`jax.tree.map(lambda x: x[m], trajectory)`).

    **Raises** a `ValueError` naming the environment, the episode and the position or
    turn (or the shapes, for a trajectory of another rank). **Returns** `trajectory`.
    """
    shapes = (np.ndim(trajectory.tokens), np.ndim(trajectory.turn_rewards))
    if shapes != (2, 2):
        raise ValueError(
            "check_trajectory checks one rollout's episodes (tokens [E, T], turn_rewards "
            f"[E, K]); got tokens {np.shape(trajectory.tokens)} and turn_rewards "
            f"{np.shape(trajectory.turn_rewards)}: check each member of a vmapped rollout "
            "(jax.tree.map(lambda x: x[m], trajectory))"
        )
    return _check_values(trajectory, environment, vocab_size)


def _check_values(traj: Trajectory, name: str, vocab_size: int) -> Trajectory:
    """Refuse what only the values of a concrete trajectory show a jittable environment
    got wrong (`name` the environment's class): an observation id outside the vocabulary
    (the policy's next logits would be NaN) or a reward that is not finite. Traced
    trajectories (a rollout inside `jit` / `vmap`) pass unchecked."""
    if isinstance(traj.tokens, jax.core.Tracer):
        return traj
    tokens, context = np.asarray(traj.tokens), np.asarray(traj.mask & ~traj.loss_mask)
    bad = context & ((tokens < 0) | (tokens >= vocab_size))
    if bad.any():
        e, t = (int(x) for x in np.argwhere(bad)[0])
        before = np.asarray(traj.turn_ids)[e, :t]  # the policy turns written before it
        method = f"step after turn {int(before.max())}" if (before >= 0).any() else "reset"
        raise ValueError(
            f"{name} returned the observation id {int(tokens[e, t])} (episode {e}, position "
            f"{t}, from {name}.{method}), outside the vocabulary [0, {vocab_size})"
        )
    rewards, turns = np.asarray(traj.turn_rewards), np.asarray(traj.num_turns)
    bad = (np.arange(rewards.shape[1])[None, :] < turns[:, None]) & ~np.isfinite(rewards)
    if bad.any():
        e, k = (int(x) for x in np.argwhere(bad)[0])
        raise ValueError(
            f"{name}.step returned the reward {float(rewards[e, k])} (episode {e}, turn {k}): "
            "rewards must be finite"
        )
    return traj


def _env_step(env: Environment, states, comp, cmask, took):
    """Every episode's `env.step` (vmapped); the state moves on where `took` only."""
    new, obs, obs_mask, reward, done = jax.vmap(env.step)(states, comp, cmask)
    expand = lambda x: jnp.reshape(took, took.shape + (1,) * (x.ndim - 1))
    states = jax.tree.map(lambda a, b: jnp.where(expand(a), a, b), new, states)
    reward = jnp.where(took, reward.astype(jnp.float32), 0.0)
    return states, obs.astype(jnp.int32), obs_mask, reward, took & done


class _Loop(eqx.Module):
    episodes: _Episode
    states: Any
    obs: Int[Array, "E O"]
    obs_mask: Bool[Array, "E O"]
    turn: Int[Array, ""]
    progress: _Progress


def _rollout(policy, env, prompts, prompt_masks, key, opts: _Options) -> Trajectory:
    eps, prompts, prompt_masks = _start_batch(
        policy, prompts, prompt_masks, opts.turn, opts.num_samples
    )
    E, T, K = prompts.shape[0], opts.total, opts.max_turns
    policy_keys, env_keys = _episode_keys(key, E)
    states, obs, obs_mask = jax.vmap(env.reset)(env_keys, prompts, prompt_masks)
    init = _Loop(
        episodes=eps,
        states=states,
        obs=obs.astype(jnp.int32),
        obs_mask=obs_mask,
        turn=jnp.zeros((), jnp.int32),
        progress=_Progress.start(E, K),
    )

    def cond(c: _Loop):
        return (c.turn < K) & jnp.any(c.progress.active)

    def body(c: _Loop) -> _Loop:
        active = c.progress.active
        eps, comp, cmask, took, cut = _turn(
            policy, c.episodes, c.obs, c.obs_mask, policy_keys, c.turn, active, opts.turn
        )
        states, obs, obs_mask, reward, ended = _env_step(env, c.states, comp, cmask, took)
        return _Loop(
            episodes=eps,
            states=states,
            obs=obs,
            obs_mask=obs_mask,
            turn=c.turn + 1,
            progress=c.progress.after_turn(c.turn, took, cut, reward, ended, eps.length, T),
        )

    c = jax.lax.while_loop(cond, body, init)
    return _trajectory(c.episodes, c.progress, opts.episode_reward)


_rollout_jit = eqx.filter_jit(_rollout)


def rollout_multiturn(
    policy: AbstractDecoder,
    env: Environment,
    prompts: Integer[ArrayLike, "B P"],
    prompt_masks: Bool[ArrayLike, "B P"] | Integer[ArrayLike, "B P"],
    key: PRNGKeyArray,
    *,
    max_turns: int,
    max_new_tokens: int,
    max_total_tokens: int,
    temperature: float | int = DEFAULT_TEMPERATURE,
    top_k: int | None = None,
    top_p: float | int | None = None,
    min_p: float | int | None = None,
    repetition_penalty: float | int = 1.0,
    presence_penalty: float | int = 0.0,
    frequency_penalty: float | int = 0.0,
    eos_id: int | Sequence[int] | None = None,
    pad_id: int = 0,
    num_samples: int = 1,
    episode_reward: str = "sum",
) -> Trajectory:
    """Roll out multi-turn episodes against a jittable environment, in one compiled program.

    Each episode alternates policy turns (sampled with the KV cache, until a stop id in
    `eos_id`, `max_new_tokens` tokens or a full buffer) and environment turns
    (`env.step`), until the environment says done, `max_turns` policy turns were
    played, or the `max_total_tokens` buffer is full. The turns run in a
    `lax.while_loop`, the tokens of a turn in an inner one; each token's work (sampling,
    `decode_step`, `env.step` after a turn) is written for one episode and `jax.vmap`-ed
    over the batch: no Python work per turn or token. Episodes that have finished wait
    without changing. One compile per (policy structure, environment, shapes, options).

    **Arguments:**

    - `policy`: a decoder (`rlhf_eqx.models.AbstractDecoder`, e.g. `rlhf_eqx.Policy`).
    - `env`: an `Environment`.
    - `prompts`, `prompt_masks`: `[B, P]` ids and real-token masks, left- or right-padded
      (each row needs a real token; concrete ids outside the vocabulary raise). JAX or
      NumPy arrays, as for `rlhf_eqx.generate_batch`: ids of any integer dtype, masks of
      bools or the integers 0 and 1 (another value is a `ValueError` naming
      `prompt_masks`); nested Python lists are refused.
    - `key`: PRNG key. Episode `e` uses `split(key, E)[e]`, split again into a policy
      key and an environment key (`env.reset`'s); token `t` of policy turn `k` is drawn
      with `fold_in(fold_in(policy_key, k), t)`, so a draw depends only on its episode,
      turn and index.
    - `max_turns`: most policy turns per episode.
    - `max_new_tokens`: most tokens per policy turn.
    - `max_total_tokens`: the static length `T` of each episode's buffer (prompt
      included; at most the model's `cfg.max_seq_len`).
    - `temperature`, `top_k`, `top_p`, `min_p`, `repetition_penalty`,
      `presence_penalty`, `frequency_penalty`, `eos_id` (one stop id or several, inside
      the vocabulary), `pad_id`: as for `rlhf_eqx.generate`. A penalty's context is the
      episode's whole buffer so far (prompt, earlier turns, observations); its generated
      counts cover the policy's tokens of every turn (the log-probabilities stay the
      policy's own, before the penalties). With `eos_id=None` (the default) or `()` no
      id ends a turn, as no id ends a completion of `rlhf_eqx.generate`: every turn runs
      to `max_new_tokens` (or the buffer's end) and counts as cut, so every episode that
      plays a turn is `truncated` (what `mask_truncated_completions` would drop whole); pass the
      tokenizer's stop ids, or the environment's `stop_ids`, as the pipelines do.
    - `num_samples`: episodes per prompt (a GRPO group), each prompt prefilled once.
    - `episode_reward`: `"sum"` of the turn rewards, or `"last"` (the final turn's).

    **Returns:** a `Trajectory` of `B · num_samples` episodes: per row, the prompt as
    given, then the first observation, turn 1, the next observation, ... written
    contiguously. Its `logprobs` equal
    `rlhf_eqx.token_logprobs(policy, tokens, mask, temperature=temperature)` at
    `loss_mask` (the sampling ratio is 1 on-policy). The prompt is prefilled once and
    every later token, sampled or observed, goes through `decode_step` into the same KV
    cache: no turn recomputes the context before it.

    **Raises** a `ValueError` (outside `jit` / `vmap`, once the rollout is done) when the
    environment returned an observation id outside the policy's vocabulary or a reward
    that is not finite, naming the episode and the position or turn.
    """
    opts = _options(
        prompts,
        prompt_masks,
        max_turns=max_turns,
        max_new_tokens=max_new_tokens,
        max_total_tokens=max_total_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        eos_id=eos_id,
        pad_id=pad_id,
        num_samples=num_samples,
        episode_reward=episode_reward,
    )
    policy, prompts, prompt_masks = _check_policy(policy, prompts, prompt_masks, opts)
    env = _check_environment(env, prompts.shape[1], opts.sampling.max_new_tokens)
    traj = _rollout_jit(policy, env, prompts, prompt_masks, key, opts)
    return _check_values(traj, type(env).__name__, policy.vocab_size)
