"""DAPO: soft overlong punishment and the dynamic-sampling filter against references of
the paper's formulas (TRL's / veRL's), and the host-side dynamic-sampling loop with a
deterministic sampler."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st
from hypothesis.extra import numpy as hnp

import rlhf_eqx.testing as rt
from rlhf_eqx.losses import DynamicSample, dynamic_sampling, informative_groups, overlong_penalty

# ------------------------------------------------------------------ overlong punishment


def reference_penalty(length, max_length, buffer):
    """DAPO eq. 13, as TRL's `get_soft_overlong_punishment` writes it, one length at a time."""
    if length <= max_length - buffer:
        return 0.0
    if length <= max_length:
        return (max_length - buffer - length) / buffer
    return -1.0


@pytest.mark.parametrize("max_length,buffer", [(10, 4), (10, 10), (10, 1), (1, 1), (20480, 4096)])
def test_overlong_penalty_matches_reference(max_length, buffer):
    lengths = np.unique(
        np.clip(np.r_[0:12, max_length - buffer - 1 : max_length + 3, 10**6], 0, None)
    )
    got = np.asarray(overlong_penalty(jnp.asarray(lengths), max_length=max_length, buffer=buffer))
    expected = [reference_penalty(int(n), max_length, buffer) for n in lengths]
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    assert got.dtype == np.float32
    # Continuous at the start of the ramp, -1 at the maximum length, -1 beyond it.
    f = lambda n: float(overlong_penalty(jnp.asarray([n]), max_length=max_length, buffer=buffer)[0])
    assert f(max_length - buffer) == 0.0
    np.testing.assert_allclose(f(max_length), -1.0, rtol=1e-6)
    assert f(max_length + 1) == -1.0


@given(
    lengths=hnp.arrays(np.int32, st.integers(1, 6), elements=st.integers(0, 300)),
    max_length=st.integers(1, 256),
    data=st.data(),
    factor=st.sampled_from([1.0, 0.5, 2.0]),
)
def test_overlong_penalty_property(lengths, max_length, data, factor):
    buffer = data.draw(st.integers(1, max_length))
    got = np.asarray(
        overlong_penalty(
            jnp.asarray(lengths), max_length=max_length, buffer=buffer, penalty_factor=factor
        )
    )
    expected = factor * np.asarray([reference_penalty(int(n), max_length, buffer) for n in lengths])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert np.all(got <= 0.0) and np.all(got >= -factor * (1 + 1e-6))
    # Non-increasing in the length.
    order = np.argsort(lengths, kind="stable")
    assert np.all(np.diff(got[order]) <= 1e-6)


def test_overlong_penalty_jit_and_shapes():
    lengths = jnp.asarray([[3, 9], [11, 7]])
    f = jax.jit(lambda n: overlong_penalty(n, max_length=10, buffer=4))
    np.testing.assert_array_equal(
        np.asarray(f(lengths)), np.asarray(overlong_penalty(lengths, max_length=10, buffer=4))
    )
    np.testing.assert_allclose(np.asarray(f(lengths)), [[0.0, -0.75], [-1.0, -0.25]])


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(max_length=0, buffer=1), "max_length must be an integer >= 1"),
        (dict(max_length=10, buffer=0), "buffer must be an integer >= 1"),
        (dict(max_length=10, buffer=11), "buffer=11 must not exceed max_length=10"),
        (dict(max_length=10.0, buffer=2), "max_length"),
    ],
)
def test_overlong_penalty_rejects_bad_settings(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        overlong_penalty(jnp.asarray([1, 2]), **kw)


def test_overlong_penalty_rejects_float_lengths():
    with pytest.raises((ValueError, TypeError)):
        overlong_penalty(jnp.asarray([1.5]), max_length=4, buffer=2)  # pyright: ignore


# ------------------------------------------------------------------ informative groups


def reference_informative(rewards, group_size, tol=0.0):
    g = np.asarray(rewards, np.float64).reshape(-1, group_size)
    # XLA on CPU flushes float32 subnormals to zero.
    g = np.where(np.abs(g) < np.finfo(np.float32).tiny, 0.0, g)
    return np.asarray(
        [not np.all(row == row[0]) and np.all(np.isfinite(row)) and np.std(row) > tol for row in g]
    )


@given(rewards=rt.reward_groups(n_groups=3, group_size=st.sampled_from([2, 5])))
def test_informative_groups_match_reference(rewards):
    n, G = rewards.shape
    got = np.asarray(informative_groups(rewards.reshape(-1), group_size=G))
    expected = reference_informative(rewards, G)
    np.testing.assert_array_equal(got, expected)
    assert got.shape == (n,)


def test_informative_groups_closed_forms():
    r = jnp.asarray(
        [1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.0, 0.0, 0.1, 0.1 + 1e-7, 2.0, jnp.nan, 1.0, jnp.inf]
    )
    np.testing.assert_array_equal(
        np.asarray(informative_groups(r, group_size=2)),
        [False, True, False, False, True, False, False],
    )
    # A tolerance drops groups whose spread is below it.
    np.testing.assert_array_equal(
        np.asarray(informative_groups(r, group_size=2, tol=1e-3)),
        [False, True, False, False, False, False, False],
    )
    np.testing.assert_array_equal(
        np.asarray(informative_groups(r[:6], group_size=2)),
        reference_informative(np.asarray(r[:6]), 2),
    )
    np.testing.assert_array_equal(np.asarray(informative_groups(r[:6], group_size=3)), [True, True])
    jitted = jax.jit(lambda x: informative_groups(x, group_size=2))(r)
    np.testing.assert_array_equal(
        np.asarray(jitted), np.asarray(informative_groups(r, group_size=2))
    )


def test_informative_groups_rejects_bad_input():
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        informative_groups(jnp.zeros(6), group_size=4)
    with pytest.raises(ValueError, match="group_size must be an integer >= 2"):
        informative_groups(jnp.zeros(6), group_size=1)
    with pytest.raises(ValueError, match="tol must be a number >= 0"):
        informative_groups(jnp.zeros(6), group_size=2, tol=-1.0)


# --------------------------------------------------------------------- dynamic sampling


class FakeSampler:
    """A deterministic generator: group `g` of attempt `a` has id `100 * a + g`; its
    rewards are informative when `informative(a, g)`. Rows carry their group id and
    their index in the group, so the kept rows can be traced back."""

    def __init__(self, informative, G=3, T=4):
        self.informative, self.G, self.T, self.calls = informative, G, T, []

    def __call__(self, num_groups, attempt):
        self.calls.append((num_groups, attempt))
        G, T = self.G, self.T
        ids = 100 * attempt + np.arange(num_groups)
        rewards = np.zeros((num_groups, G), np.float32)
        for g in range(num_groups):
            if self.informative(attempt, g):
                rewards[g, g % G] = 1.0
        row_ids = np.repeat(ids, G)
        data = {
            "tokens": jnp.asarray(row_ids[:, None] * 10 + np.arange(T)[None, :], jnp.int32),
            "member": np.tile(np.arange(G), num_groups),
            "group_id": jnp.asarray(ids, jnp.int32),
            "settings": "kept as is",
        }
        return data, rewards


def _check_alignment(out: DynamicSample, G, T):
    ids = np.asarray(out.data["group_id"])
    tokens = np.asarray(out.data["tokens"])
    assert tokens.shape == (len(ids) * G, T)
    np.testing.assert_array_equal(tokens[:, 0] // 10, np.repeat(ids, G))
    np.testing.assert_array_equal(out.data["member"], np.tile(np.arange(G), len(ids)))
    assert out.data["settings"] == "kept as is"
    assert out.rewards.shape == (len(ids), G)
    assert np.all(
        np.asarray(informative_groups(jnp.asarray(out.rewards.reshape(-1)), group_size=G))
    )
    return ids


def test_dynamic_sampling_fills_the_batch_in_order():
    # Attempt 0: groups 1 and 3 informative; attempt 1: every even group; attempt 2: all.
    sampler = FakeSampler(
        lambda a, g: (a == 0 and g in (1, 3)) or (a == 1 and g % 2 == 0) or a == 2
    )
    out = dynamic_sampling(sampler, 5, max_tries=10)
    ids = _check_alignment(out, 3, 4)
    np.testing.assert_array_equal(ids, [1, 3, 100, 102, 104])
    assert out.filled and out.tries == 2 and out.sampled_groups == 10
    assert sampler.calls == [(5, 0), (5, 1)]


def test_dynamic_sampling_stops_after_max_tries():
    sampler = FakeSampler(lambda a, g: g == 0)
    out = dynamic_sampling(sampler, 4, max_tries=3, groups_per_try=2)
    ids = _check_alignment(out, 3, 4)
    np.testing.assert_array_equal(ids, [0, 100, 200])
    assert not out.filled and out.tries == 3 and out.sampled_groups == 6
    assert sampler.calls == [(2, 0), (2, 1), (2, 2)]
    # Nothing informative at all: no groups, the structure kept, max_tries calls.
    sampler = FakeSampler(lambda a, g: False)
    out = dynamic_sampling(sampler, 2, max_tries=4)
    assert out.data["tokens"].shape == (0, 4) and out.rewards.shape == (0, 3)
    assert not out.filled and out.tries == 4 and len(sampler.calls) == 4


def test_dynamic_sampling_truncates_to_batch_groups():
    sampler = FakeSampler(lambda a, g: True)
    out = dynamic_sampling(sampler, 3, max_tries=5, groups_per_try=8)
    np.testing.assert_array_equal(_check_alignment(out, 3, 4), [0, 1, 2])
    assert out.filled and out.tries == 1 and out.sampled_groups == 8


def test_dynamic_sampling_rejects_bad_input():
    sampler = FakeSampler(lambda a, g: True)
    with pytest.raises(ValueError, match="max_tries must be an integer >= 1"):
        dynamic_sampling(sampler, 2, max_tries=0)
    with pytest.raises(ValueError, match="batch_groups must be an integer >= 1"):
        dynamic_sampling(sampler, 0, max_tries=1)
    with pytest.raises(ValueError, match=r"expected \[groups, G\]"):
        dynamic_sampling(lambda n, a: ({}, np.zeros(n * 2)), 2, max_tries=1)
    bad = lambda n, a: ({"x": np.zeros((n + 1, 2))}, np.eye(n, 2))
    with pytest.raises(ValueError, match=r"\['x'\] has shape \(3, 2\)"):
        dynamic_sampling(bad, 2, max_tries=1)
