"""Deterministic, resumable, shardable iteration over a dataset's indices.

`BatchIterator` yields arrays of record indices. Epoch `e` visits the records in the
order of a permutation drawn from `(seed, e)` alone (numpy's PCG64 seeded with
`SeedSequence([seed, e])`), so any step of any epoch can be recomputed without
replaying the ones before it. The iterator's whole state is `(epoch, position)` plus
its configuration: `state()` returns it, `BatchIterator.from_state(state)` continues
with exactly the batches the original would have produced.

**Sharding.** With `shard_count` processes (or data-parallel groups), step `t` of an
epoch takes the global batch `perm[t*G:(t+1)*G]`, `G = batch_size * shard_count`, and
shard `i` gets its `i`-th slice of `batch_size` indices. Every shard therefore makes
the same number of steps (collective ops stay in lock-step), shards of one step are
disjoint, and together they cover the global batch — the same batches a single
process with batch size `G` would see. With `drop_last=False` the last, shorter
global batch is split as evenly as possible across the shards.

**Why not Grain.** Grain (the loader Tunix uses) offers the same guarantees —
deterministic, checkpointable, sharded index sampling — along with multi-process
prefetching. rlhf_eqx's records are small text pairs that are tokenised once and held
in memory, so the sampler is all that is needed; writing it here (a permutation per
epoch and two integers of state) keeps the core dependent on numpy only and makes the
order a documented function of `(seed, epoch, step)` that tests pin down. A Grain
pipeline can wrap the same tokenised records if asynchronous loading is ever needed.
"""

import dataclasses

import numpy as np
from jaxtyping import Int

from ._errors import DataError

__all__ = ["IteratorState", "BatchIterator", "epoch_permutation"]


def epoch_permutation(dataset_size: int, seed: int, epoch: int) -> Int[np.ndarray, " N"]:
    """The order of epoch `epoch`: a permutation of `range(dataset_size)` from `(seed, epoch)`."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch])))
    return rng.permutation(dataset_size)


@dataclasses.dataclass(frozen=True)
class IteratorState:
    """Everything that determines a `BatchIterator`'s future batches.

    `epoch` and `position` (batches already taken in that epoch) move; the rest is the
    configuration. `to_dict` / `from_dict` give a JSON-friendly form for checkpoints.
    """

    dataset_size: int
    batch_size: int
    seed: int
    drop_last: bool = True
    shuffle: bool = True
    shard_index: int = 0
    shard_count: int = 1
    num_epochs: int | None = None
    epoch: int = 0
    position: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "IteratorState":
        return cls(**d)


class BatchIterator:
    """Batches of record indices, shuffled per epoch from a seed, resumable and sharded.

    **Arguments:**

    - `dataset_size`: number of records; `batch_size`: indices per batch *per shard*.
    - `seed`: the shuffling seed (the order of epoch `e` is `epoch_permutation(n, seed, e)`).
    - `drop_last`: drop the last incomplete global batch of each epoch (fixed shapes);
      otherwise it is split across the shards (shorter, possibly empty, batches).
    - `shuffle`: `False` visits records in order every epoch.
    - `shard_index`, `shard_count`: this shard and the number of shards.
    - `num_epochs`: stop after this many epochs (`None`: never stop).
    - `epoch`, `position`: where to start (as restored by `from_state`).

    Iterating yields `int64` index arrays of shape `[batch_size]`.
    """

    def __init__(
        self,
        dataset_size: int,
        batch_size: int,
        seed: int,
        *,
        drop_last: bool = True,
        shuffle: bool = True,
        shard_index: int = 0,
        shard_count: int = 1,
        num_epochs: int | None = None,
        epoch: int = 0,
        position: int = 0,
    ):
        if dataset_size < 1 or batch_size < 1:
            raise DataError(
                f"need a positive dataset_size and batch_size, got {dataset_size}, {batch_size}"
            )
        if not 0 <= shard_index < shard_count:
            raise DataError(
                f"need 0 <= shard_index < shard_count, got {shard_index}, {shard_count}"
            )
        global_batch = batch_size * shard_count
        if drop_last:
            steps = dataset_size // global_batch
        else:
            steps = -(-dataset_size // global_batch)
        if steps == 0:
            raise DataError(
                f"{dataset_size} records make no full batch of {batch_size} x {shard_count} shards"
            )
        if epoch < 0 or not 0 <= position <= steps:
            raise DataError(f"invalid position: epoch {epoch}, position {position} of {steps}")
        self.dataset_size = dataset_size
        self.batch_size = batch_size
        self.seed = seed
        self.drop_last = drop_last
        self.shuffle = shuffle
        self.shard_index = shard_index
        self.shard_count = shard_count
        self.num_epochs = num_epochs
        self.steps_per_epoch: int = steps
        self._epoch = epoch
        self._position = position
        self._perm_epoch: int | None = None
        self._perm: np.ndarray | None = None

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def position(self) -> int:
        return self._position

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            if self.shuffle:
                self._perm = epoch_permutation(self.dataset_size, self.seed, epoch)
            else:
                self._perm = np.arange(self.dataset_size)
            self._perm_epoch = epoch
        return self._perm

    def __iter__(self) -> "BatchIterator":
        return self

    def __next__(self) -> Int[np.ndarray, " b"]:
        if self._position >= self.steps_per_epoch:
            self._epoch += 1
            self._position = 0
        if self.num_epochs is not None and self._epoch >= self.num_epochs:
            raise StopIteration
        perm = self._permutation(self._epoch)
        g = self.batch_size * self.shard_count
        global_batch = perm[self._position * g : (self._position + 1) * g]
        if len(global_batch) == g:
            local = global_batch[
                self.shard_index * self.batch_size : (self.shard_index + 1) * self.batch_size
            ]
        else:
            local = np.array_split(global_batch, self.shard_count)[self.shard_index]
        self._position += 1
        return local.astype(np.int64)

    def state(self) -> IteratorState:
        """The current state; `from_state(state())` continues identically."""
        return IteratorState(
            dataset_size=self.dataset_size,
            batch_size=self.batch_size,
            seed=self.seed,
            drop_last=self.drop_last,
            shuffle=self.shuffle,
            shard_index=self.shard_index,
            shard_count=self.shard_count,
            num_epochs=self.num_epochs,
            epoch=self._epoch,
            position=self._position,
        )

    @classmethod
    def from_state(cls, state: IteratorState) -> "BatchIterator":
        """An iterator at `state` (from `state()`, or `IteratorState.from_dict`)."""
        return cls(
            state.dataset_size,
            state.batch_size,
            state.seed,
            drop_last=state.drop_last,
            shuffle=state.shuffle,
            shard_index=state.shard_index,
            shard_count=state.shard_count,
            num_epochs=state.num_epochs,
            epoch=state.epoch,
            position=state.position,
        )

    def __repr__(self) -> str:
        return (
            f"BatchIterator(dataset_size={self.dataset_size}, batch_size={self.batch_size}, "
            f"seed={self.seed}, shard={self.shard_index}/{self.shard_count}, "
            f"epoch={self._epoch}, position={self._position})"
        )
