"""Deterministic, resumable, sharded batch iteration."""

import itertools
import json

import jaxtyping
import numpy as np
import pytest
from hypothesis import given, strategies as st

from rlhf_eqx import data


def take(it, n):
    return [b.tolist() for b in itertools.islice(it, n)]


def test_epochs_are_permutations():
    it = data.BatchIterator(12, 4, seed=0)
    assert it.steps_per_epoch == 3
    epochs = [sum(take(it, 3), []) for _ in range(3)]
    for e, order in enumerate(epochs):
        assert sorted(order) == list(range(12))
        assert order == data.epoch_permutation(12, 0, e).tolist()
    assert epochs[0] != epochs[1] != epochs[2]


def test_pinned_order():
    """The order is a documented function of (seed, epoch): pin it."""
    np.testing.assert_array_equal(data.epoch_permutation(10, 0, 0), [4, 6, 2, 7, 3, 5, 9, 0, 8, 1])
    np.testing.assert_array_equal(data.epoch_permutation(10, 0, 1), [9, 1, 3, 8, 7, 6, 0, 4, 2, 5])
    np.testing.assert_array_equal(data.epoch_permutation(10, 1, 0), [8, 4, 7, 0, 1, 2, 5, 9, 6, 3])


def test_seeds_and_no_shuffle():
    assert take(data.BatchIterator(20, 5, seed=3), 4) == take(data.BatchIterator(20, 5, seed=3), 4)
    assert take(data.BatchIterator(20, 5, seed=3), 4) != take(data.BatchIterator(20, 5, seed=4), 4)
    it = data.BatchIterator(5, 2, seed=0, shuffle=False)
    assert take(it, 4) == [[0, 1], [2, 3], [0, 1], [2, 3]]  # drop_last drops index 4


def test_drop_last_false_and_num_epochs():
    it = data.BatchIterator(10, 4, seed=0, drop_last=False, num_epochs=2)
    batches = take(it, 100)
    assert [len(x) for x in batches] == [4, 4, 2, 4, 4, 2]
    assert sorted(sum(batches[:3], [])) == list(range(10))
    assert it.epoch == 2 and next(it, None) is None


@given(
    st.integers(1, 40),
    st.integers(1, 5),
    st.integers(0, 2**31),
    st.integers(0, 25),
    st.booleans(),
    st.integers(1, 3),
)
def test_resume_is_identical(n, batch_size, seed, k, drop_last, shards):
    if batch_size * shards > n:
        with pytest.raises(data.DataError, match="no full batch"):
            data.BatchIterator(n, batch_size, seed, shard_count=shards)
        return
    for shard in range(shards):
        kwargs = dict(drop_last=drop_last, shard_index=shard, shard_count=shards)
        reference = take(data.BatchIterator(n, batch_size, seed, **kwargs), k + 10)
        it = data.BatchIterator(n, batch_size, seed, **kwargs)
        assert take(it, k) == reference[:k]
        state = it.state
        restored = data.IteratorState.from_dict(json.loads(json.dumps(state.to_dict())))
        assert restored == state
        assert take(data.BatchIterator.from_state(restored), 10) == reference[k:]
        assert take(it, 10) == reference[k:]  # the original continues the same way


@given(st.integers(4, 60), st.integers(1, 4), st.integers(1, 4), st.integers(0, 100), st.booleans())
def test_shards_partition_the_global_batch(n, batch_size, shards, seed, drop_last):
    if batch_size * shards > n:
        return
    single = data.BatchIterator(n, batch_size * shards, seed, drop_last=drop_last)
    per_shard = [
        data.BatchIterator(
            n, batch_size, seed, drop_last=drop_last, shard_index=i, shard_count=shards
        )
        for i in range(shards)
    ]
    assert {it.steps_per_epoch for it in per_shard} == {single.steps_per_epoch}
    for _ in range(2 * single.steps_per_epoch):
        parts = [next(it).tolist() for it in per_shard]
        flat = sum(parts, [])
        assert len(set(flat)) == len(flat)  # disjoint
        assert sorted(flat) == sorted(next(single).tolist())  # cover the global batch
        if drop_last:
            assert all(len(p) == batch_size for p in parts)


def test_state_fields_and_errors():
    it = data.BatchIterator(10, 3, seed=7, shard_index=1, shard_count=2)
    next(it)
    state = it.state
    assert (state.epoch, state.position, state.seed, state.shard_index) == (0, 1, 7, 1)
    assert it.steps_per_epoch == 1  # 10 records, global batch 6
    next(it)
    assert (it.epoch, it.position) == (1, 1)
    with pytest.raises(data.DataError):
        data.BatchIterator(10, 3, seed=0, shard_index=2, shard_count=2)
    with pytest.raises(data.DataError):
        data.BatchIterator(0, 3, seed=0)
    with pytest.raises(data.DataError, match="invalid position"):
        data.BatchIterator(10, 3, seed=0, position=99)


def test_iterator_holds_one_state():
    it = data.BatchIterator(10, 3, seed=7, drop_last=False)
    assert isinstance(it.state, data.IteratorState)
    for name in data.IteratorState.__dataclass_fields__:
        assert getattr(it, name) == getattr(it.state, name)
    before = it.state
    next(it)
    assert before.position == 0 and it.state.position == 1 and it.position == 1  # replaced
    with pytest.raises(AttributeError):
        it.seed = 3


def test_resuming_with_a_changed_configuration_is_refused():
    it = data.BatchIterator(10, 2, seed=7)
    next(it)
    saved = data.IteratorState.from_dict(it.state.to_dict())
    resumed = data.BatchIterator.from_state(saved, dataset_size=10, batch_size=2, seed=7)
    assert next(resumed).tolist() == next(it).tolist()
    with pytest.raises(data.DataError, match="dataset_size=10 but this run has dataset_size=12"):
        data.BatchIterator.from_state(saved, dataset_size=12)
    with pytest.raises(data.DataError, match="batch_size=2 but this run has batch_size=4"):
        data.BatchIterator.from_state(saved, batch_size=4)
    with pytest.raises(data.DataError, match="seed=7 but this run has seed=0"):
        data.BatchIterator.from_state(saved, seed=0)


def test_state_from_dict_names_bad_fields():
    good = data.BatchIterator(10, 2, seed=7).state.to_dict()
    renamed = {k: v for k, v in good.items() if k != "dataset_size"} | {"dataset": 10}
    with pytest.raises(data.DataError, match=r"unknown keys \['dataset'\].*missing"):
        data.IteratorState.from_dict(renamed)
    jaxtyping.config.update("jaxtyping_disable", True)  # as users run it
    try:
        with pytest.raises(data.DataError, match="IteratorState.position must be an int, got .1."):
            data.IteratorState.from_dict({**good, "position": "1"})
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)
    with pytest.raises(data.DataError, match="invalid position: epoch 0, position 9 of 5"):
        data.IteratorState.from_dict({**good, "position": 9})


def test_group_by_length_sorts_windows_and_resumes():
    lengths = [(i * 37) % 23 for i in range(24)]
    it = data.BatchIterator(24, 2, seed=1, group_by_length=3, lengths=lengths)
    batches = take(it, 12)
    perm = data.epoch_permutation(24, 1, 0).tolist()
    for w in range(4):  # windows of 3 batches x 2 rows, each sorted longest first
        window = sum(batches[3 * w : 3 * w + 3], [])
        assert sorted(window) == sorted(perm[6 * w : 6 * w + 6])
        assert [lengths[i] for i in window] == sorted((lengths[i] for i in window), reverse=True)
    it = data.BatchIterator(24, 2, seed=1, group_by_length=3, lengths=lengths)
    take(it, 5)
    resumed = data.BatchIterator.from_state(it.state, lengths=lengths)
    assert take(resumed, 7) == batches[5:12]
    with pytest.raises(data.DataError, match="needs the lengths of all 24 records, got none"):
        data.BatchIterator.from_state(it.state)
    with pytest.raises(data.DataError, match="got 3"):
        data.BatchIterator(24, 2, seed=1, group_by_length=3, lengths=[1, 2, 3])
