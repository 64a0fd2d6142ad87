"""Checks of a multi-turn rollout's arguments, policy and jittable environment, run once
before anything is compiled.
"""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._sampling import SamplingOptions
from ..models import AbstractDecoder
from ._environment import Environment
from ._turns import _TurnOptions


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
    max_new_tokens,
    max_total_tokens,
    temperature,
    top_k,
    top_p,
    eos_id,
    pad_id,
    num_samples,
    episode_reward,
) -> _Options:
    sampling = SamplingOptions(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_id=eos_id,
        pad_id=pad_id,
    )
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
    if not isinstance(prompt_masks, jax.core.Tracer):
        empty = ~np.asarray(prompt_masks).any(axis=-1)
        if empty.any():
            raise ValueError(
                f"prompt_masks row {int(np.argmax(empty))} has no real token; every prompt "
                "needs at least one (a BOS will do)"
            )
    return _Options(
        turn=_TurnOptions(sampling=sampling, total=max_total_tokens),
        num_samples=num_samples,
        max_turns=max_turns,
        episode_reward=episode_reward,
    )


def _check_policy(policy: object, prompts, opts: _Options) -> AbstractDecoder:
    if not isinstance(policy, AbstractDecoder):
        raise TypeError(
            "a rollout needs a decoder: a model inheriting rlhf_eqx.models.AbstractDecoder "
            f"(init_cache / prefill / decode_step), such as rlhf_eqx.Policy; got "
            f"{type(policy).__name__}"
        )
    if not isinstance(prompts, jax.core.Tracer):
        ids = np.asarray(prompts)
        bad = (ids < 0) | (ids >= policy.vocab_size)
        if bad.any():
            row, col = (int(x) for x in np.argwhere(bad)[0])
            raise ValueError(
                f"prompts row {row} has id {int(ids[row, col])} at position {col}, outside "
                f"the vocabulary [0, {policy.vocab_size})"
            )
    limit = getattr(getattr(policy, "cfg", None), "max_seq_len", None)
    if isinstance(limit, int) and opts.total > limit:
        raise ValueError(
            f"max_total_tokens={opts.total} is longer than the model's max_seq_len={limit}"
        )
    return policy


def _signature(tree: Any) -> tuple[Any, list[str]]:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, [f"{np.dtype(x.dtype).name}{list(np.shape(x))}" for x in leaves]


def _check_array(name: str, x: Any, shape: tuple[int, ...], kind: str) -> None:
    dtype = getattr(x, "dtype", None)
    ok_kind = dtype is not None and (
        (kind == "int" and jnp.issubdtype(dtype, jnp.integer))
        or (kind == "bool" and dtype == jnp.bool_)
        or (kind == "float" and jnp.issubdtype(dtype, jnp.floating))
    )
    if tuple(getattr(x, "shape", ())) != shape or not ok_kind:
        got = f"{getattr(x, 'shape', None)} {dtype}"
        raise ValueError(f"{name} must be a {kind} array of shape {shape}, got {got}")


def _check_environment(env: object, prompt_length: int, opts: _Options) -> Environment:
    """Trace `reset` and `step` once (no computation) and refuse wrong outputs."""
    if not isinstance(env, Environment):
        raise TypeError(
            "rollout_multiturn needs a jittable rlhf_eqx.envs.Environment (use "
            f"rollout_multiturn_host for a HostEnvironment); got {type(env).__name__}"
        )
    width = env.max_observation_tokens
    if not (isinstance(width, int) and not isinstance(width, bool) and width > 0):
        raise ValueError(f"{type(env).__name__}.max_observation_tokens must be a positive int")
    name = type(env).__name__
    key = jax.random.key(0)
    prompt = jax.ShapeDtypeStruct((prompt_length,), jnp.int32)
    pmask = jax.ShapeDtypeStruct((prompt_length,), jnp.bool_)
    out = jax.eval_shape(env.reset, key, prompt, pmask)
    if not (isinstance(out, tuple) and len(out) == 3):
        raise ValueError(f"{name}.reset must return (state, observation, observation_mask)")
    state, obs, obs_mask = out
    _check_array(f"{name}.reset's observation", obs, (width,), "int")
    _check_array(f"{name}.reset's observation_mask", obs_mask, (width,), "bool")
    N = opts.sampling.max_new_tokens
    comp = jax.ShapeDtypeStruct((N,), jnp.int32)
    cmask = jax.ShapeDtypeStruct((N,), jnp.bool_)
    out = jax.eval_shape(env.step, state, comp, cmask)
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
