r"""DAPO's reward-side techniques (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement
Learning System at Scale"): soft overlong punishment and dynamic sampling.

The loss-side techniques of DAPO live in the GRPO step: clip-higher (`clip_eps_high`),
token-level aggregation (`mode="token-mean"`) and overlong filtering
(`mask_truncated_completions`).
"""

import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PyTree


def _check_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def overlong_penalty(
    lengths: Int[ArrayLike, "*batch"],
    *,
    max_length: int,
    buffer: int,
    penalty_factor: float | int = 1.0,
) -> Float[Array, "*batch"]:
    r"""DAPO's soft overlong punishment of completions of `lengths` tokens.

    With $L_{\max}$ = `max_length`, $L_{\rm cache}$ = `buffer` and $|y|$ the length:

    $$R_{\rm length}(y) = \begin{cases}
      0 & |y| \le L_{\max} - L_{\rm cache} \\
      \frac{(L_{\max} - L_{\rm cache}) - |y|}{L_{\rm cache}}
        & L_{\max} - L_{\rm cache} < |y| \le L_{\max} \\
      -1 & |y| > L_{\max}
    \end{cases}$$

    times `penalty_factor`, added to the task reward (Yu et al. 2025, eq. 13; TRL
    `trl.rewards.get_soft_overlong_punishment(max_completion_len, soft_punish_cache)`;
    veRL DAPO `reward_model.overlong_buffer.len` / `penalty_factor`, whose penalty is the
    same up to $L_{\max}$ — beyond it veRL keeps the linear ramp, the paper and TRL use
    $-1$).

    **Arguments:**

    - `lengths`: integer completion lengths, any shape.
    - `max_length`: $L_{\max} \geq 1$, the maximum completion length.
    - `buffer`: $L_{\rm cache}$ in `1..max_length`, the length of the punishment ramp.
    - `penalty_factor`: scale of the penalty (veRL's `penalty_factor`; 1 in the paper).

    **Returns:** the penalties (float32, $\le 0$), same shape as `lengths`.
    """
    _check_int("max_length", max_length, 1)
    _check_int("buffer", buffer, 1)
    if buffer > max_length:
        raise ValueError(f"buffer={buffer} must not exceed max_length={max_length}")
    lengths = jnp.asarray(lengths)
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"lengths must be integers, got dtype {lengths.dtype}")
    start = max_length - buffer
    ramp = (start - lengths).astype(jnp.float32) / float(buffer)
    penalty = jnp.where(lengths <= start, 0.0, jnp.where(lengths <= max_length, ramp, -1.0))
    return (penalty * penalty_factor).astype(jnp.float32)


def informative_groups(
    rewards: Float[Array, " N"],
    *,
    group_size: int,
    tol: float | int = 0.0,
) -> Bool[Array, " groups"]:
    r"""The groups whose rewards are not all equal: DAPO's dynamic-sampling filter.

    A group of $G$ = `group_size` consecutive rewards is informative when its rewards
    are not all equal and their (population) standard deviation exceeds `tol`
    (Yu et al. 2025, eq. 11: $0 < |\{o_i : \text{correct}\}| < G$ for 0/1 rewards; veRL
    DAPO keeps a prompt when `np.std` of its metric is > 0). Its group-relative
    advantages are then not all 0. Non-finite rewards make a group uninformative.

    **Arguments:**

    - `rewards`: `[N]` rewards, `N = n_groups * G`, groups contiguous (as in `GRPOBatch`).
    - `group_size`: $G \geq 2$.
    - `tol`: standard-deviation threshold, $\geq 0$.

    **Returns:** `[N / G]` booleans, one per group.
    """
    _check_int("group_size", group_size, 2)
    if not (isinstance(tol, numbers.Real) and not isinstance(tol, bool) and tol >= 0.0):
        raise ValueError(f"tol must be a number >= 0, got {tol!r}")
    (N,) = rewards.shape
    if N % group_size != 0:
        raise ValueError(f"rewards of shape ({N},) do not split into groups of {group_size}")
    grouped = rewards.reshape(N // group_size, group_size)
    informative = ~jnp.all(grouped == grouped[:, :1], axis=-1)
    informative = informative & jnp.all(jnp.isfinite(grouped), axis=-1)
    if tol == 0:  # any difference (a standard deviation of tiny rewards could underflow)
        return informative
    return informative & (jnp.std(grouped, axis=-1) > tol)


class DynamicSample(NamedTuple):
    """What `dynamic_sampling` collected.

    - `data`: the caller's sample data, informative groups only, in the order drawn: a
      pytree whose array leaves lead with the rows (`groups * G`, groups contiguous) or
      with the groups, as `sample_fn` returned them (non-array leaves, e.g. static
      settings, are those of the first draw; `None` if no draw returned a group).
    - `rewards`: `[groups, G]` rewards of the kept groups (numpy).
    - `tries`: how many times `sample_fn` was called.
    - `sampled_groups`: groups drawn in total (kept or not).
    - `filled`: whether `batch_groups` groups were kept (else `data` holds fewer).
    """

    data: PyTree
    rewards: np.ndarray
    tries: int
    sampled_groups: int
    filled: bool


def _take_groups(data: PyTree, index: np.ndarray, n: int, group_size: int) -> PyTree:
    """Select groups `index` of every array leaf, leading with `n` groups or `n * G` rows."""

    def take(path, x):
        shape = getattr(x, "shape", None)
        if shape is None or not hasattr(x, "dtype"):
            return x
        if len(shape) >= 1 and shape[0] == n * group_size:
            rows = x.reshape(n, group_size, *shape[1:])[index]
            return rows.reshape(len(index) * group_size, *shape[1:])
        if len(shape) >= 1 and shape[0] == n:
            return x[index]
        raise ValueError(
            f"sample data leaf {jax.tree_util.keystr(path)} has shape {tuple(shape)}: it must "
            f"lead with the {n} groups or their {n * group_size} rows"
        )

    return jax.tree_util.tree_map_with_path(take, data)


def _concat(parts: list[PyTree]) -> PyTree:
    def cat(*xs):
        if not hasattr(xs[0], "shape"):
            return xs[0]
        if isinstance(xs[0], jax.Array):
            return jnp.concatenate(xs, axis=0)
        return np.concatenate(xs, axis=0)

    return jax.tree.map(cat, *parts)


def dynamic_sampling(
    sample_fn: Callable[[int, int], tuple[PyTree, Any]],
    batch_groups: int,
    *,
    max_tries: int,
    groups_per_try: int | None = None,
    tol: float | int = 0.0,
) -> DynamicSample:
    r"""DAPO's dynamic sampling (Yu et al. 2025): draw groups until `batch_groups`
    informative ones (`informative_groups`) are collected, or `max_tries` draws are spent.

    A host-side loop (not jittable): call `sample_fn(num_groups, attempt)` for
    `attempt = 0, 1, ...`; it returns `(data, rewards)`, `rewards` of shape
    `[num_groups, G]` and `data` a pytree whose array leaves lead with the groups or with
    their `num_groups * G` rows (groups contiguous, as a `GRPOBatch`). The informative
    groups of each draw are kept in order; the first `batch_groups` are returned. After
    `max_tries` draws it returns what it has (`filled` false; fewer groups, possibly
    none), never looping on. veRL's DAPO recipe does the same with
    `algorithm.filter_groups` (`max_num_gen_batches`).

    **Arguments:**

    - `sample_fn`: the caller's generator, `(num_groups, attempt) -> (data, rewards)`
      (e.g. sample `G` completions for the next `num_groups` prompts and score them).
    - `batch_groups`: groups wanted, $\geq 1$.
    - `max_tries`: the most calls of `sample_fn`, $\geq 1$.
    - `groups_per_try`: `num_groups` asked of each call (default `batch_groups`; a fixed
      number keeps the sampler's shapes, and so its compilation, the same).
    - `tol`: see `informative_groups`.

    **Returns:** a `DynamicSample`.
    """
    _check_int("batch_groups", batch_groups, 1)
    _check_int("max_tries", max_tries, 1)
    per_try = batch_groups if groups_per_try is None else groups_per_try
    _check_int("groups_per_try", per_try, 1)
    kept_data: list[PyTree] = []
    kept_rewards: list[np.ndarray] = []
    have = sampled = tries = 0
    group_size = None
    while tries < max_tries and have < batch_groups:
        data, rewards = sample_fn(per_try, tries)
        tries += 1
        rewards = np.asarray(rewards, np.float32)
        if rewards.ndim != 2:
            raise ValueError(
                f"sample_fn returned rewards of shape {rewards.shape}; expected [groups, G]"
            )
        n, G = rewards.shape
        if group_size is not None and G != group_size:
            raise ValueError(f"sample_fn returned groups of {G}, earlier of {group_size}")
        group_size = G
        sampled += n
        if n == 0:
            continue
        info = np.asarray(
            informative_groups(jnp.asarray(rewards.reshape(-1)), group_size=G, tol=tol)
        )
        index = np.flatnonzero(info)[: batch_groups - have]
        kept_data.append(_take_groups(data, index, n, G))
        kept_rewards.append(rewards[index])
        have += len(index)
    return DynamicSample(
        data=_concat(kept_data) if kept_data else None,
        rewards=(
            np.concatenate(kept_rewards, axis=0)
            if kept_rewards
            else np.zeros((0, group_size or 0), np.float32)
        ),
        tries=tries,
        sampled_groups=sampled,
        filled=have == batch_groups,
    )
