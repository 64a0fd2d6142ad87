"""Multi-turn rollouts driven from Python: compiled policy turns, with the environments
(host-side, or jittable ones as compiled calls) run between them.
"""

from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int, PRNGKeyArray

from .._sampling import DEFAULT_TEMPERATURE
from ..models import AbstractDecoder
from ._compiled_rollout import _check_environment, _check_policy, _env_step, _options
from ._environment import Environment, HostEnvironment
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


def _host_envs(env: object, n: int) -> list[HostEnvironment]:
    if isinstance(env, Sequence):
        envs = list(env)
        if len(envs) != n:
            raise ValueError(
                f"env is a sequence of {len(envs)} environments; {n} episodes need {n}"
            )
    elif callable(env):
        envs = [env() for _ in range(n)]
    else:
        raise TypeError(
            "env must be an Environment, a factory of HostEnvironments (called once per "
            f"episode) or a sequence of them; got {type(env).__name__}"
        )
    for e in envs:
        if not isinstance(e, HostEnvironment):
            raise TypeError(f"expected HostEnvironment instances, got {type(e).__name__}")
    return envs


def _padded(ids: Sequence[int], length: int, pad_id: int, where: str) -> tuple[list, list]:
    ids = [int(i) for i in ids]
    if len(ids) > length:
        raise ValueError(
            f"{where} returned an observation of {len(ids)} tokens, more than its "
            f"max_observation_tokens={length}"
        )
    return ids + [pad_id] * (length - len(ids)), [True] * len(ids) + [False] * (length - len(ids))


# The keyword-only signature repeats `rollout_multiturn`'s on purpose (the two are
# interchangeable); the checks behind it are one function each (`_options`, `_check_policy`).
def rollout_multiturn_host(
    policy: AbstractDecoder,
    env: Environment | Callable[[], HostEnvironment] | Sequence[HostEnvironment],
    prompts: Int[Array, "B P"],
    prompt_masks: Bool[Array, "B P"],
    key: PRNGKeyArray,
    *,
    max_turns: int,
    max_new_tokens: int,
    max_total_tokens: int,
    temperature: float | int = DEFAULT_TEMPERATURE,
    top_k: int | None = None,
    top_p: float | int | None = None,
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

    **Arguments:** as `rollout_multiturn`, except `env`:

    - a factory `() -> HostEnvironment`, called once per episode (episode `e` gets the
      `e`-th object; episodes are numbered as the output rows);
    - or a sequence of `B · num_samples` `HostEnvironment`s;
    - or a jittable `Environment` (its `reset` / `step` then run as compiled calls
      between the policy turns).

    A host environment's `reset` receives the prompt's real ids (padding removed), its
    `step` the turn's ids; an observation longer than its `max_observation_tokens`
    raises a `ValueError`.

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
        eos_id=eos_id,
        pad_id=pad_id,
        num_samples=num_samples,
        episode_reward=episode_reward,
    )
    policy = _check_policy(policy, prompts, opts)
    prompt_masks = jnp.asarray(prompt_masks, jnp.bool_)
    eps, prompts_e, masks_e, policy_keys, env_keys = _host_start(
        policy, prompts, prompt_masks, key, opts.turn, opts.num_samples
    )
    E, K, T = prompts_e.shape[0], opts.max_turns, opts.total
    jax_env = isinstance(env, Environment)
    if jax_env:
        env = _check_environment(env, prompts.shape[1], opts)
        states, obs, obs_mask = _env_reset(env, env_keys, prompts_e, masks_e)
    else:
        envs = _host_envs(env, E)
        width = envs[0].max_observation_tokens
        if any(e.max_observation_tokens != width for e in envs):
            raise ValueError(
                "every episode's environment must have the same max_observation_tokens"
            )
        host_prompts, host_masks = np.asarray(prompts_e), np.asarray(masks_e)
        rows = [
            _padded(
                e.reset(host_prompts[i][host_masks[i]].tolist()),
                width,
                pad_id,
                f"episode {i}'s reset",
            )
            for i, e in enumerate(envs)
        ]
        obs = jnp.asarray([r[0] for r in rows], jnp.int32).reshape(E, width)
        obs_mask = jnp.asarray([r[1] for r in rows], jnp.bool_).reshape(E, width)
    progress = _Progress.start(E, K)
    for k in range(K):
        active = np.asarray(progress.active)
        if not active.any():
            break
        turn = jnp.asarray(k, jnp.int32)
        eps, comp, cmask, took = _host_turn(
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
                o, r, d = envs[i].step(comp_np[i][cmask_np[i]].tolist())
                reward[i], ended[i] = float(r), bool(d)
                if not ended[i]:
                    obs_np[i], obs_mask_np[i] = _padded(o, width, pad_id, f"episode {i}'s step")
            obs, obs_mask = jnp.asarray(obs_np), jnp.asarray(obs_mask_np)
        progress = progress.after_turn(k, took_np, reward, ended, eps.length, T)
    return _finish(eps, progress, opts.episode_reward)
