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

**Grouping by length** (`group_by_length=k` with the records' `lengths`; TRL's
`group_by_length`): each epoch's permutation is cut into windows of `k` global
batches and each window is sorted by length, longest first (stable), before it is cut
into batches. Batches then hold rows of similar length, so collating with a
`bucket_size` pads little; the order is still a function of `(seed, epoch, lengths)`.

**Why not Grain.** Grain (the loader Tunix uses) offers the same guarantees —
deterministic, checkpointable, sharded index sampling — along with multi-process
prefetching. rlhf_eqx's records are small text pairs that are tokenised once and held
in memory, so the sampler is all that is needed; writing it here (a permutation per
epoch and two integers of state) keeps the core dependent on numpy only and makes the
order a documented function of `(seed, epoch, step)` that tests pin down. A Grain
pipeline can wrap the same tokenised records if asynchronous loading is ever needed.
"""

import dataclasses
from collections.abc import Sequence

import numpy as np
from jaxtyping import Int

from ._errors import DataError


def epoch_permutation(dataset_size: int, seed: int, epoch: int) -> Int[np.ndarray, " N"]:
    """The order of epoch `epoch`: a permutation of `range(dataset_size)` from `(seed, epoch)`."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch])))
    return rng.permutation(dataset_size)


@dataclasses.dataclass(frozen=True)
class IteratorState:
    """Everything that determines a `BatchIterator`'s future batches.

    `epoch` and `position` (batches already taken in that epoch) move; the rest is the
    configuration (see `BatchIterator` for each field). A state is checked when it is
    made: a `DataError` names the field that is out of range. `to_dict` / `from_dict`
    give a JSON-friendly form for checkpoints.
    """

    dataset_size: int
    batch_size: int
    seed: int
    drop_last: bool = True
    shuffle: bool = True
    shard_index: int = 0
    shard_count: int = 1
    num_epochs: int | None = None
    group_by_length: int = 0
    epoch: int = 0
    position: int = 0

    def __post_init__(self):
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if name in ("drop_last", "shuffle"):
                kind, ok = "a bool", isinstance(value, bool | np.bool_)
            else:
                kind = "an int or None" if name == "num_epochs" else "an int"
                ok = (value is None and name == "num_epochs") or (
                    isinstance(value, int | np.integer) and not isinstance(value, bool)
                )
            if not ok:
                raise DataError(f"IteratorState.{name} must be {kind}, got {value!r}")
        # numpy's seed sequence takes no negative entropy: refused here, not at the first
        # batch.
        for name in ("group_by_length", "seed", "num_epochs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise DataError(f"IteratorState.{name} must be >= 0, got {value}")
        if self.dataset_size < 1 or self.batch_size < 1:
            raise DataError(
                "need a positive dataset_size and batch_size, got "
                f"{self.dataset_size}, {self.batch_size}"
            )
        if not 0 <= self.shard_index < self.shard_count:
            raise DataError(
                f"need 0 <= shard_index < shard_count, got {self.shard_index}, {self.shard_count}"
            )
        if self.steps_per_epoch == 0:
            raise DataError(
                f"{self.dataset_size} records make no full batch of {self.batch_size} x "
                f"{self.shard_count} shards"
            )
        if self.epoch < 0 or not 0 <= self.position <= self.steps_per_epoch:
            raise DataError(
                f"invalid position: epoch {self.epoch}, position {self.position} of "
                f"{self.steps_per_epoch}"
            )

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch (every shard makes the same number)."""
        global_batch = self.batch_size * self.shard_count
        if self.drop_last:
            return self.dataset_size // global_batch
        return -(-self.dataset_size // global_batch)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "IteratorState":
        """The state saved by `to_dict`; unknown or missing keys are named in a `DataError`."""
        names = [f.name for f in dataclasses.fields(cls)]
        required = {"dataset_size", "batch_size", "seed"}
        unknown = sorted(set(d) - set(names))
        missing = sorted(required - set(d))
        if unknown or missing:
            raise DataError(f"not an IteratorState: unknown keys {unknown}, missing keys {missing}")
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
    - `group_by_length`: `k > 0` sorts windows of `k` global batches by `lengths`
      (module docstring); 0 (the default) does not.
    - `lengths`: each record's length (e.g. `len(pair.chosen) + len(pair.rejected)`);
      needed with `group_by_length`.
    - `epoch`, `position`: where to start (as restored by `from_state`).

    Iterating yields `int64` index arrays of shape `[batch_size]`. The iterator holds
    one immutable `IteratorState` (`it.state`), replaced as batches are taken; each of
    its fields is also a read-only property of the iterator (`it.seed`, `it.epoch`, ...).
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
        group_by_length: int = 0,
        lengths: Sequence[int] | None = None,
        epoch: int = 0,
        position: int = 0,
    ):
        self._state = IteratorState(
            dataset_size=dataset_size,
            batch_size=batch_size,
            seed=seed,
            drop_last=drop_last,
            shuffle=shuffle,
            shard_index=shard_index,
            shard_count=shard_count,
            num_epochs=num_epochs,
            group_by_length=group_by_length,
            epoch=epoch,
            position=position,
        )
        self._lengths: np.ndarray | None = None
        if group_by_length:
            if lengths is None or len(lengths) != dataset_size:
                got = "none" if lengths is None else f"{len(lengths)}"
                raise DataError(
                    f"group_by_length needs the lengths of all {dataset_size} records, got {got}"
                )
            self._lengths = np.asarray(lengths, dtype=np.int64)
        self._perm_epoch: int | None = None
        self._perm: np.ndarray | None = None

    @property
    def state(self) -> IteratorState:
        """The current state; `from_state(it.state)` continues identically."""
        return self._state

    @property
    def steps_per_epoch(self) -> int:
        return self._state.steps_per_epoch

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            s = self._state
            if s.shuffle:
                self._perm = epoch_permutation(s.dataset_size, s.seed, epoch)
            else:
                self._perm = np.arange(s.dataset_size)
            if self._lengths is not None:
                window = s.group_by_length * s.batch_size * s.shard_count
                parts = [self._perm[i : i + window] for i in range(0, s.dataset_size, window)]
                self._perm = np.concatenate(
                    [p[np.argsort(-self._lengths[p], kind="stable")] for p in parts]
                )
            self._perm_epoch = epoch
        return self._perm

    def __iter__(self) -> "BatchIterator":
        return self

    def __next__(self) -> Int[np.ndarray, " b"]:
        s = self._state
        epoch, position = s.epoch, s.position
        if position >= s.steps_per_epoch:
            epoch, position = epoch + 1, 0
        if s.num_epochs is not None and epoch >= s.num_epochs:
            self._state = dataclasses.replace(s, epoch=epoch, position=position)
            raise StopIteration
        perm = self._permutation(epoch)
        g = s.batch_size * s.shard_count
        global_batch = perm[position * g : (position + 1) * g]
        if len(global_batch) == g:
            local = global_batch[s.shard_index * s.batch_size : (s.shard_index + 1) * s.batch_size]
        else:
            local = np.array_split(global_batch, s.shard_count)[s.shard_index]
        self._state = dataclasses.replace(s, epoch=epoch, position=position + 1)
        return local.astype(np.int64)

    @classmethod
    def from_state(
        cls,
        state: IteratorState,
        *,
        dataset_size: int | None = None,
        batch_size: int | None = None,
        seed: int | None = None,
        lengths: Sequence[int] | None = None,
    ) -> "BatchIterator":
        """An iterator at `state` (from `it.state`, or `IteratorState.from_dict`).

        Pass the current run's `dataset_size` (and `batch_size`, `seed`) to have them
        checked against the saved state: a dataset that changed size since the state
        was saved would continue with a different permutation, silently revisiting or
        skipping records, so any difference is a `DataError` naming the field. A state
        saved with `group_by_length` needs the records' `lengths` again.
        """
        if not isinstance(state, IteratorState):
            raise DataError(
                f"expected an IteratorState, got {type(state).__name__} (a saved dict: "
                "IteratorState.from_dict)"
            )
        for name, now in (
            ("dataset_size", dataset_size),
            ("batch_size", batch_size),
            ("seed", seed),
        ):
            saved = getattr(state, name)
            if now is not None and now != saved:
                raise DataError(
                    f"the saved iterator state has {name}={saved} but this run has "
                    f"{name}={now}; resuming would not continue the saved order"
                )
        return cls(**dataclasses.asdict(state), lengths=lengths)

    def __repr__(self) -> str:
        s = self._state
        return (
            f"BatchIterator(dataset_size={s.dataset_size}, batch_size={s.batch_size}, "
            f"seed={s.seed}, shard={s.shard_index}/{s.shard_count}, "
            f"epoch={s.epoch}, position={s.position})"
        )


def _state_field(name: str) -> property:
    return property(lambda self: getattr(self._state, name), doc=f"`state.{name}`.")


for _name in IteratorState.__dataclass_fields__:
    setattr(BatchIterator, _name, _state_field(_name))
del _name
