"""Sharding records by prompt: stable, disjoint, covering, balanced."""

import hashlib
import json
import os
import random
import subprocess
import sys

import pytest
from hypothesis import given, strategies as st

from rlhf_eqx import data

PINNED = {
    "": (16476032584258269876, 4),
    "Hello": (4349503209558009990, 6),
    "\n\nHuman: hi\n\nAssistant:": (15716870227934263605, 5),
    "héllo 😀": (7919108468530537434, 2),
}


def test_shard_of_pinned():
    for prompt, (h, shard) in PINNED.items():
        assert data.prompt_hash(prompt) == h
        assert h == int.from_bytes(hashlib.blake2b(prompt.encode(), digest_size=8).digest(), "big")
        assert data.shard_of(prompt, 8) == shard == h % 8
    with pytest.raises(data.DataError):
        data.shard_of("x", 0)


def test_stable_across_processes():
    """Same shards and assignment under a different PYTHONHASHSEED (Python's `hash` of a
    str changes with it; the prompt hash must not)."""
    prompts = [f"prompt {i % 7}" for i in range(30)] + list(PINNED)
    code = (
        "import json, sys\n"
        "from rlhf_eqx import data\n"
        "prompts = json.loads(sys.stdin.read())\n"
        "shards = [data.shard_of(p, 5) for p in prompts]\n"
        "print(json.dumps([shards, data.assign_shards(prompts, 2, 2), hash('x')]))\n"
    )
    seed = "12345" if os.environ.get("PYTHONHASHSEED") != "12345" else "54321"
    out = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps(prompts),
        check=True,
        env=dict(os.environ, PYTHONHASHSEED=seed),
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    shards, assignment, other_hash = json.loads(out.stdout)
    assert other_hash != hash("x")  # Python's own hash did change
    assert shards == [data.shard_of(p, 5) for p in prompts]
    assert assignment == data.assign_shards(prompts, 2, 2)


def check_assignment(prompts, assignment, num_processes, local_devices):
    assert len(assignment) == num_processes
    assert all(len(devices) == local_devices for devices in assignment)
    flat = [i for devices in assignment for dev in devices for i in dev]
    assert sorted(flat) == list(range(len(prompts)))  # disjoint and covering
    where = {}
    for p, devices in enumerate(assignment):
        for d, dev in enumerate(devices):
            assert dev == sorted(dev)
            for i in dev:
                assert where.setdefault(prompts[i], (p, d)) == (p, d)  # one prompt, one device
    largest = max((prompts.count(p) for p in set(prompts)), default=0)
    process_loads = [sum(len(dev) for dev in devices) for devices in assignment]
    assert max(process_loads) - min(process_loads) <= largest
    for devices in assignment:
        loads = [len(dev) for dev in devices]
        assert max(loads) - min(loads) <= largest


@given(
    st.lists(st.integers(0, 15), max_size=80),
    st.integers(1, 4),
    st.integers(1, 4),
)
def test_assign_shards_properties(prompt_ids, num_processes, local_devices):
    prompts = [f"p{i}" for i in prompt_ids]
    assignment = data.assign_shards(prompts, num_processes, local_devices)
    check_assignment(prompts, assignment, num_processes, local_devices)
    # Independent of the records' order: the same prompts land on the same devices.
    order = list(range(len(prompts)))
    random.Random(0).shuffle(order)
    shuffled = [prompts[i] for i in order]
    placed = {
        prompts[i]: (p, d)
        for p, devs in enumerate(assignment)
        for d, dev in enumerate(devs)
        for i in dev
    }
    again = data.assign_shards(shuffled, num_processes, local_devices)
    for p, devs in enumerate(again):
        for d, dev in enumerate(devs):
            assert all(placed[shuffled[i]] == (p, d) for i in dev)


def test_assign_shards_records_and_errors():
    records = [data.PreferenceRecord(p, "a", "b") for p in ["x", "x", "y", "z"]]
    # "x" (two pairs) first, then "y" and "z" onto the less-loaded device.
    assert data.assign_shards(records, 1, 2) == [[[0, 1], [2, 3]]]
    assert data.assign_shards(records, 2, 1) == [[[0, 1]], [[2, 3]]]
    with pytest.raises(data.DataError):
        data.assign_shards(records, 0, 1)
    with pytest.raises(data.DataError, match=r"\.prompt"):
        data.assign_shards([1, 2], 1, 1)


def test_assign_shards_hh_rlhf(shared_dir):
    ds = data.load_preferences(
        os.path.join(shared_dir, "data", "hh-rlhf", "harmless-base", "test.jsonl.gz")
    )
    prompts = [r.prompt for r in ds]
    assignment = data.assign_shards(ds, 2, 4)
    check_assignment(prompts, assignment, 2, 4)
    loads = [len(dev) for devices in assignment for dev in devices]
    assert sum(loads) == 2308 and max(loads) - min(loads) <= 1
