"""Hypothesis strategies for log-probabilities, masks, preference pairs, reward groups and
hyperparameter scales."""

import math
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from hypothesis import settings, strategies as st
from hypothesis.extra import numpy as hnp
from jaxtyping import Array, Bool, Float, Int

PROFILE = "rlhf_eqx"


def use_no_deadline() -> None:
    """Load a copy of the active Hypothesis profile without a deadline (JAX compiles on
    the first example, which no per-example deadline should count)."""
    current = settings.default
    if current is None or current.deadline is None:
        return
    settings.register_profile(PROFILE, parent=current, deadline=None)
    settings.load_profile(PROFILE)


_MASK_PATTERNS = ("random", "right-padded", "left-padded", "all-real", "all-masked")


def _size(value: int | st.SearchStrategy[int] | None, default: st.SearchStrategy[int]):
    if value is None:
        return default
    if isinstance(value, int):
        return st.just(value)
    return value


@st.composite
def _mask_row(draw, length, allow_all_masked):
    patterns = _MASK_PATTERNS if allow_all_masked else _MASK_PATTERNS[:-1]
    kind = draw(st.sampled_from(patterns))
    if kind == "all-masked":
        return np.zeros(length, bool)
    if kind == "all-real":
        return np.ones(length, bool)
    if kind == "random":
        row = np.array(draw(st.lists(st.booleans(), min_size=length, max_size=length)), bool)
        if not allow_all_masked and not row.any():
            row[draw(st.integers(0, length - 1))] = True
        return row
    n = draw(st.integers(1, length))
    row = np.arange(length) < n
    return row if kind == "right-padded" else row[::-1].copy()


@st.composite
def _masks(draw, shape, allow_all_masked):
    *lead, length = shape
    rows = [draw(_mask_row(length, allow_all_masked)) for _ in range(int(np.prod(lead, dtype=int)))]
    return np.stack(rows).reshape(shape)


def masks(
    shape: tuple[int, ...], *, allow_all_masked: bool = True
) -> st.SearchStrategy[Bool[Array, "*B T"]]:
    """Boolean masks of `shape` (last axis = sequence), one pattern per row.

    Each row is drawn from: random, right-padded, left-padded, all real, and (when
    `allow_all_masked`) all masked.
    """
    return _masks(tuple(shape), allow_all_masked).map(jnp.asarray)


@st.composite
def _logprob_arrays(draw, n, batch, length, min_value, max_value, allow_all_masked):
    T = draw(length)
    shape = (T,) if batch is None else (draw(batch), T)
    elements = st.floats(
        min_value=min_value, max_value=max_value, width=32, allow_nan=False, allow_infinity=False
    )
    arrays = [jnp.asarray(draw(hnp.arrays(np.float32, shape, elements=elements))) for _ in range(n)]
    mask = jnp.asarray(draw(_masks(shape, allow_all_masked)))
    return (*arrays, mask)


def logprob_arrays(
    *,
    n: int = 1,
    batch: int | st.SearchStrategy[int] | None = None,
    length: int | st.SearchStrategy[int] | None = None,
    max_length: int = 8,
    min_value: float | int = -1e4,
    max_value: float | int = 0.0,
    allow_all_masked: bool = True,
) -> st.SearchStrategy[tuple[Float[Array, "*B T"] | Bool[Array, "*B T"], ...]]:
    """`n` float32 log-probability arrays and a boolean mask: `(logp_1, ..., logp_n, mask)`.

    Values lie in `[min_value, max_value]` (default `[-1e4, 0]`, boundaries included, so
    extreme log-probabilities and exact zeros are exercised). The shape is `[T]` when
    `batch` is `None`, else `[B, T]`; `batch` and `length` may be ints or strategies
    (`length` defaults to 1..`max_length`). Masks mix random, right-padded, left-padded,
    all-real and (when `allow_all_masked`) fully-masked rows.
    """
    return _logprob_arrays(
        n,
        None if batch is None else _size(batch, st.integers(1, 4)),
        _size(length, st.integers(1, max_length)),
        float(min_value),
        float(max_value),
        allow_all_masked,
    )


class PreferencePairs(NamedTuple):
    """Sequence log-probabilities of preference pairs (scalars, or `[B]` arrays)."""

    chosen_logp: Float[Array, "*B"]
    rejected_logp: Float[Array, "*B"]
    ref_chosen_logp: Float[Array, "*B"]
    ref_rejected_logp: Float[Array, "*B"]
    chosen_len: Int[Array, "*B"]
    rejected_len: Int[Array, "*B"]


@st.composite
def _preference_pairs(draw, batch, min_value, max_length, allow_ties):
    shape = () if batch is None else (draw(batch),)
    elements = st.floats(
        min_value=min_value, max_value=0.0, width=32, allow_nan=False, allow_infinity=False
    )

    def arr():
        return np.asarray(draw(hnp.arrays(np.float32, shape, elements=elements)), np.float32)

    c, r = arr(), arr()
    if allow_ties and draw(st.booleans()):
        # Policy equal to the reference (the start of DPO training), or chosen == rejected.
        if draw(st.booleans()):
            rc, rr = c.copy(), r.copy()
        else:
            rc, rr = arr(), arr()
            r = c.copy()
            rr = rc.copy()
    else:
        rc, rr = arr(), arr()
    lens = hnp.arrays(np.int32, shape, elements=st.integers(1, max_length))
    cl, rl = draw(lens), draw(lens)
    return PreferencePairs(*(jnp.asarray(x) for x in (c, r, rc, rr, cl, rl)))


def preference_pairs(
    *,
    batch: int | st.SearchStrategy[int] | None = None,
    min_value: float | int = -1e4,
    max_length: int = 64,
    allow_ties: bool = True,
) -> st.SearchStrategy[PreferencePairs]:
    """Preference pairs of sequence log-probabilities in `[min_value, 0]` and lengths.

    Fields (see `PreferencePairs`) are float32 scalars when `batch` is `None`, else `[B]`
    arrays; lengths are int32 in `1..max_length`. With `allow_ties`, some examples have
    the policy equal to the reference or the chosen equal to the rejected completion.
    """
    return _preference_pairs(
        None if batch is None else _size(batch, st.integers(1, 6)),
        float(min_value),
        max_length,
        allow_ties,
    )


@st.composite
def _reward_groups(draw, n_groups, group_size, min_value, max_value):
    G = draw(group_size)
    shape = (G,) if n_groups is None else (draw(n_groups), G)
    elements = st.floats(
        min_value=min_value, max_value=max_value, width=32, allow_nan=False, allow_infinity=False
    )
    rewards = np.asarray(draw(hnp.arrays(np.float32, shape, elements=elements)), np.float32)
    if draw(st.booleans()):
        # Some groups where every completion got the same reward (zero advantage).
        flat = rewards.reshape(-1, G)
        row = draw(st.integers(0, flat.shape[0] - 1))
        flat[row] = flat[row, 0]
        rewards = flat.reshape(shape)
    return jnp.asarray(rewards)


def reward_groups(
    *,
    n_groups: int | st.SearchStrategy[int] | None = None,
    group_size: int | st.SearchStrategy[int] | None = None,
    max_group_size: int = 8,
    min_value: float | int = -1e6,
    max_value: float | int = 1e6,
) -> st.SearchStrategy[Float[Array, "*N G"]]:
    """Float32 rewards of groups of completions: `[G]`, or `[N, G]` when `n_groups` is given.

    Values in `[min_value, max_value]` (default ±1e6); group sizes default to
    2..`max_group_size`; some examples contain a group of identical rewards.
    """
    return _reward_groups(
        None if n_groups is None else _size(n_groups, st.integers(1, 4)),
        _size(group_size, st.integers(2, max_group_size)),
        float(min_value),
        float(max_value),
    )


def scales(*, min_value: float = 1e-8, max_value: float = 1e8) -> st.SearchStrategy[float]:
    """Positive hyperparameters spread over orders of magnitude: β, temperatures, τ.

    Python floats `10**e` for a uniform exponent `e` in `[log10(min_value),
    log10(max_value)]`, with both ends and 1.0 (when in range) among the examples, so
    that a loss is tried with tiny and huge temperatures as well as ordinary ones.
    """
    if not 0.0 < min_value <= max_value:
        raise ValueError(f"need 0 < min_value <= max_value, got {min_value}, {max_value}")
    lo, hi = math.log10(min_value), math.log10(max_value)
    spread = st.floats(lo, hi, allow_nan=False).map(
        lambda e: min(max(10.0**e, min_value), max_value)
    )
    ends = [min_value, max_value] + ([1.0] if min_value <= 1.0 <= max_value else [])
    return st.one_of(st.sampled_from(ends), spread)
