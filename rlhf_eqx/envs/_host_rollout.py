"""Multi-turn rollouts driven from Python: compiled policy turns, with the environments
(host-side, or jittable ones as compiled calls) run between them.
"""

from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import ArrayLike, Bool, Integer, PRNGKeyArray

from .._sampling import DEFAULT_TEMPERATURE
from ..models import AbstractDecoder
from ._compiled_rollout import (
    _check_environment,
    _check_policy,
    _check_values,
    _env_step,
    _options,
)
from ._environment import Environment, HostEnvironment, _reward_and_done
from ._trajectory import Trajectory, _Progress, _trajectory
from ._turns import _episode_keys, _start_batch, _turn


@eqx.filter_jit
def _host_start(policy, prompts, prompt_masks, key, opts, num_samples):
    eps, prompts, prompt_masks = _start_batch(policy, prompts, prompt_masks, opts, num_samples)
    policy_keys, env_keys = _episode_keys(key, prompts.shape[0])
    return eps, prompts, prompt_masks, policy_keys, env_keys


_host_turn = eqx.filter_jit(_turn)


@eqx.filter_jit
def _env_reset(env, keys, prompts, prompt_masks):
    return jax.vmap(env.reset)(keys, prompts, prompt_masks)


_host_env_step = eqx.filter_jit(_env_step)


_finish = eqx.filter_jit(_trajectory)


def _noted(error: BaseException, where: str) -> None:
    """Name the environment call an exception came from (the exception itself goes on)."""
    error.add_note(f"raised by {where} (rlhf_eqx.envs.rollout_multiturn_host)")


def _host_envs(env: object, n: int) -> list[HostEnvironment]:
    if isinstance(env, Sequence):
        envs = list(env)
        if len(envs) != n:
            raise ValueError(
                f"env is a sequence of {len(envs)} environments; {n} episodes need {n}"
            )
    elif callable(env):
        envs = []
        for i in range(n):
            try:
                envs.append(env())
            except Exception as e:
                name = getattr(env, "__name__", type(env).__name__)
                _noted(e, f"the environment factory {name} (episode {i})")
                raise
    else:
        raise TypeError(
            "env must be an Environment, a factory of HostEnvironments (called once per "
            f"episode) or a sequence of them; got {type(env).__name__}"
        )
    for e in envs:
        if not isinstance(e, HostEnvironment):
            raise TypeError(f"expected HostEnvironment instances, got {type(e).__name__}")
    if len({id(e) for e in envs}) != n:
        raise ValueError(
            "env gives the same environment object to several episodes ([env] * n, or a "
            "factory that returns one object); each episode needs its own: a host "
            "environment keeps its episode's state"
        )
    width = getattr(envs[0], "max_observation_tokens", None)
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(
            f"{type(envs[0]).__name__}.max_observation_tokens must be a positive int (the "
            f"longest observation it returns; 1 for one that returns none), got {width!r}"
        )
    if any(getattr(e, "max_observation_tokens", None) != width for e in envs):
        raise ValueError("every episode's environment must have the same max_observation_tokens")
    return envs


def _padded(
    ids: object, length: int, pad_id: int, vocab_size: int, where: str
) -> tuple[list, list]:
    """An observation padded to `length` and its mask; anything but a sequence of at most
    `length` integer ids in `[0, vocab_size)` is refused, naming `where` it came from."""
    if isinstance(ids, jax.Array):
        ids = np.asarray(ids)
    if isinstance(ids, str | bytes) or not isinstance(ids, Sequence | np.ndarray):
        raise TypeError(
            f"{where} must return the observation as a sequence of token ids, got "
            f"{type(ids).__name__}"
        )
    if isinstance(ids, np.ndarray):  # read as its ids, without building an array of a list
        ok = ids.ndim == 1 and np.issubdtype(ids.dtype, np.integer)
    else:  # a nested or ragged one, e.g. a gym-style (observation, info), is no list of ids
        ok = all(
            isinstance(i, int | np.integer) and not isinstance(i, bool | np.bool_) for i in ids
        )
    if not ok:
        raise TypeError(f"{where} returned an observation that is not a list of int ids: {ids!r}")
    ids = [int(i) for i in ids]
    if len(ids) > length:
        raise ValueError(
            f"{where} returned an observation of {len(ids)} tokens, more than its "
            f"max_observation_tokens={length}"
        )
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(
            f"{where} returned the observation id {bad[0]}, outside the vocabulary "
            f"[0, {vocab_size})"
        )
    return ids + [pad_id] * (length - len(ids)), [True] * len(ids) + [False] * (length - len(ids))


def _call(method, ids: list[int], where: str) -> object:
    """`method(ids)`; an exception inside it goes on with a note naming `where`."""
    try:
        return method(ids)
    except Exception as e:
        _noted(e, where)
        raise


def _step(env: HostEnvironment, completion: list[int], where: str) -> tuple[object, float, bool]:
    """`env.step(completion)`, its answer checked: `(observation, reward, done)` with a
    finite real reward and a bool `done`; an exception inside it names `where`."""
    out = _call(env.step, completion, where)
    if not (isinstance(out, tuple | list) and len(out) == 3):
        raise TypeError(f"{where} must return (observation, reward, done), got {out!r}")
    obs, reward, done = out
    value, done = _reward_and_done(reward, done, where)
    if not np.isfinite(value):
        raise ValueError(f"{where} returned the reward {value}: rewards must be finite")
    return obs, value, done


# The keyword-only signature repeats `rollout_multiturn`'s on purpose (the two are
# interchangeable); the checks behind it are one function each (`_options`, `_check_policy`).
def rollout_multiturn_host(
    policy: AbstractDecoder,
    env: Environment | Callable[[], HostEnvironment] | Sequence[HostEnvironment],
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
    """`rollout_multiturn` driven from Python, for environments that run on the host.

    Each policy turn is one compiled call over the whole batch (the same per-episode
    turn function as the jitted rollout: append the pending observation, sample the
    turn); between turns the environments run in Python on the episodes that are still
    going. With the same `key` and options it returns the same `Trajectory` as
    `rollout_multiturn` does for the same environment.

    **Arguments:** as `rollout_multiturn` (`prompts`, `prompt_masks`: JAX or NumPy
    arrays, integer ids, bool or 0 / 1 integer masks), except `env`:

    - a factory `() -> HostEnvironment`, called once per episode (episode `e` gets the
      `e`-th object; episodes are numbered as the output rows);
    - or a sequence of `B · num_samples` `HostEnvironment`s (distinct objects: each
      keeps its episode's state; one object for several episodes is refused);
    - or a jittable `Environment` (its `reset` / `step` then run as compiled calls
      between the policy turns).

    A host environment's `reset` receives the prompt's real ids (padding removed), its
    `step` the turn's ids. What they return is checked as it comes, naming the class,
    the method, the episode and the turn: an observation that is not a sequence of int
    ids, is longer than `max_observation_tokens` or holds an id outside the policy's
    vocabulary, a `step` answer that is not `(observation, reward, done)`, a reward that
    is not a finite real number, a `done` that is not a bool (a `TypeError` or
    `ValueError`). An exception raised inside `reset`, `step` or the factory stops the
    rollout as it is, with a note naming the call (`raised by HostCount.step of episode
    3 at turn 1`). A jittable `env` is checked as `rollout_multiturn` checks it.

    **Returns:** a `Trajectory`.
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
    eps, prompts_e, masks_e, policy_keys, env_keys = _host_start(
        policy, prompts, prompt_masks, key, opts.turn, opts.num_samples
    )
    E, K, T = prompts_e.shape[0], opts.max_turns, opts.total
    jax_env = isinstance(env, Environment)
    if jax_env:
        env = _check_environment(env, prompts.shape[1], opts.sampling.max_new_tokens)
        states, obs, obs_mask = _env_reset(env, env_keys, prompts_e, masks_e)
    else:
        envs = _host_envs(env, E)
        width, V = envs[0].max_observation_tokens, policy.vocab_size
        host_prompts, host_masks = np.asarray(prompts_e), np.asarray(masks_e)
        rows = []
        for i, e in enumerate(envs):
            where = f"{type(e).__name__}.reset of episode {i}"
            obs_i = _call(e.reset, host_prompts[i][host_masks[i]].tolist(), where)
            rows.append(_padded(obs_i, width, pad_id, V, where))
        obs = jnp.asarray([r[0] for r in rows], jnp.int32).reshape(E, width)
        obs_mask = jnp.asarray([r[1] for r in rows], jnp.bool_).reshape(E, width)
    progress = _Progress.start(E, K)
    for k in range(K):
        active = np.asarray(progress.active)
        if not active.any():
            break
        turn = jnp.asarray(k, jnp.int32)
        eps, comp, cmask, took, cut = _host_turn(
            policy, eps, obs, obs_mask, policy_keys, turn, jnp.asarray(active), opts.turn
        )
        took_np = np.asarray(took)
        if jax_env:
            states, obs, obs_mask, reward, ended = _host_env_step(env, states, comp, cmask, took)
        else:
            comp_np, cmask_np = np.asarray(comp), np.asarray(cmask)
            reward = np.zeros(E, np.float32)
            ended = np.zeros(E, bool)
            obs_np, obs_mask_np = np.array(obs), np.array(obs_mask)
            for i in np.flatnonzero(took_np):
                where = f"{type(envs[i]).__name__}.step of episode {i} at turn {k}"
                o, reward[i], ended[i] = _step(envs[i], comp_np[i][cmask_np[i]].tolist(), where)
                if not ended[i]:
                    obs_np[i], obs_mask_np[i] = _padded(o, width, pad_id, V, where)
            obs, obs_mask = jnp.asarray(obs_np), jnp.asarray(obs_mask_np)
        progress = progress.after_turn(k, took_np, cut, reward, ended, eps.length, T)
    traj = _finish(eps, progress, opts.episode_reward)
    return _check_values(traj, type(env).__name__, policy.vocab_size) if jax_env else traj
