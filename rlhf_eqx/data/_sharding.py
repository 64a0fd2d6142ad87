"""Splitting records by prompt: across processes and devices, and into training and
held-out parts.

All pairs that share a prompt go to the same shard: prefix sharing (computing a prompt
once for several completions) and per-prompt statistics (GRPO groups) then stay local,
and no prompt is seen by two shards of one step.

- `shard_of(prompt, num_shards)`: a stable hash (BLAKE2b of the UTF-8 text, *not*
  Python's salted `hash`), so the shard of a prompt is the same on every host, in
  every run, under any `PYTHONHASHSEED`. Cheap and stateless; balanced in expectation.
- `assign_shards(records, num_processes, local_devices)`: balanced by construction.
  Prompt groups are placed largest first (ties broken by the prompt's hash) on the
  least-loaded process, then the groups of each process on its least-loaded device
  (greedy "longest processing time first", R. L. Graham, 1969). Loads of two
  processes (or two devices of a process) differ by at most the size of the largest
  prompt group. The result depends only on the records' prompts, not on their order
  or on the host.
- `split_held_out(records, fraction=..., seed=...)`: a seeded train / held-out split
  decided by each prompt's keyed hash, so one prompt never lands on both sides.
"""

import hashlib
from collections.abc import Sequence

from ._errors import DataError
from ._io import RecordDataset


def prompt_hash(prompt: str) -> int:
    """A stable 64-bit hash of a prompt (BLAKE2b, 8-byte digest, big-endian)."""
    digest = hashlib.blake2b(prompt.encode("utf-8", errors="surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def shard_of(prompt: str, num_shards: int) -> int:
    """The shard (`0 <= shard < num_shards`) of a prompt: `prompt_hash(prompt) % num_shards`."""
    if num_shards < 1:
        raise DataError(f"num_shards must be positive, got {num_shards}")
    return prompt_hash(prompt) % num_shards


def _prompt(record: object) -> str:
    if isinstance(record, str):
        return record
    prompt = getattr(record, "prompt", None)
    if not isinstance(prompt, str):
        raise DataError(f"records need a string .prompt, got {type(record).__name__}")
    return prompt


def _greedy(groups: list[tuple[str, list[int]]], bins: int) -> list[list[tuple[str, list[int]]]]:
    """Place groups (already in placement order) on the least-loaded bin (lowest index on ties)."""
    loads = [0] * bins
    out: list[list[tuple[str, list[int]]]] = [[] for _ in range(bins)]
    for group in groups:
        b = min(range(bins), key=lambda i: (loads[i], i))
        out[b].append(group)
        loads[b] += len(group[1])
    return out


def assign_shards(
    records: Sequence, num_processes: int, local_devices: int
) -> list[list[list[int]]]:
    """Assign records to `num_processes` processes and `local_devices` devices each.

    **Arguments:**

    - `records`: objects with a `.prompt` (e.g. a `PreferenceDataset`) or prompt strings.
    - `num_processes`: number of processes (hosts).
    - `local_devices`: devices per process.

    **Returns:** `assignment[process][device]`, the sorted indices of the records of
    that device. Every record appears exactly once; all records with the same prompt
    are on one device. See the module docstring for the balancing rule.
    """
    if num_processes < 1 or local_devices < 1:
        raise DataError(
            f"need positive counts, got {num_processes} processes, {local_devices} devices"
        )
    by_prompt: dict[str, list[int]] = {}
    for i, record in enumerate(records):
        by_prompt.setdefault(_prompt(record), []).append(i)
    groups = sorted(by_prompt.items(), key=lambda g: (-len(g[1]), prompt_hash(g[0]), g[0]))
    assignment = []
    for process_groups in _greedy(groups, num_processes):
        devices = _greedy(process_groups, local_devices)
        assignment.append([sorted(i for _, idx in dev for i in idx) for dev in devices])
    return assignment


def split_held_out(
    records: Sequence, *, fraction: float, seed: int = 0
) -> tuple[Sequence, Sequence]:
    """Split records into a training and a held-out part, by prompt.

    A record is held out when the hash of its prompt (BLAKE2b keyed by `seed`) falls in
    the lowest `fraction` of the hash range, so: every record of a prompt lands on the
    same side (no prompt is both trained on and evaluated); the split is the same on
    every host, in every run and whatever the records' order; and a prompt keeps its
    side when records are added or removed. The held-out share of prompts is `fraction`
    in expectation, not exactly.

    **Arguments:**

    - `records`: objects with a `.prompt` (e.g. a `PreferenceDataset`) or prompt strings.
    - `fraction`: the expected share held out, in `[0, 1]`.
    - `seed`: another seed gives another, independent split.

    **Returns:** `(train, held_out)`, in the records' order; datasets of the records'
    class when `records` is a `PreferenceDataset` / `PromptDataset`, else lists.
    """
    if not 0.0 <= fraction <= 1.0:
        raise DataError(f"fraction must be in [0, 1], got {fraction}")
    threshold = int(fraction * 2**64)
    key = int(seed).to_bytes(16, "big", signed=True)
    train, held_out = [], []
    for i, record in enumerate(records):
        text = _prompt(record).encode("utf-8", errors="surrogatepass")
        digest = hashlib.blake2b(text, digest_size=8, key=key).digest()
        (held_out if int.from_bytes(digest, "big") < threshold else train).append(i)
    if isinstance(records, RecordDataset):
        return records.select(train), records.select(held_out)
    return [records[i] for i in train], [records[i] for i in held_out]
