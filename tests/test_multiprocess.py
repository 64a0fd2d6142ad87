"""Multi-process training: two processes on 127.0.0.1, each with two CPU devices, join one
run (`initialize_distributed`, gloo CPU collectives), read only their prompt-hash shard of
the data, and run DPO steps on a (2, 2) mesh spanning both (data parallel across the
processes, FSDP + tensor parallel within). Both end with identical parameters, equal to a
single-process run on the same global batch as far as the maths fixes them: the losses
and Adam's moments within a relative tolerance, the parameters within a bound scaled by
the learning rate (`helpers.assert_adam_steps_agree`).

Run as a script (`python tests/test_multiprocess.py OUT_FILE`) this file is one worker;
the coordinator address, process count and id come from the `RLHF_EQX_*` variables.
"""

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

STEPS = 3
N_PAIRS = 8
MAX_LEN = 24
LOCAL_DEVICES = 2
LR = 1e-3
ADAM_EPS = 1e-3  # = helpers.ADAM_EPS (the workers run without the tests' path)


def _records():
    from rlhf_eqx.data import PreferenceRecord

    animals = ["cat", "dog", "fox", "owl", "bee", "elk", "yak", "emu"]
    return [
        PreferenceRecord(
            prompt=f"Story {i}: the",
            chosen=f" {animals[i]} ran" + " far" * (i % 3),
            rejected=" it sat" + "." * (i % 4),
        )
        for i in range(N_PAIRS)
    ]


def _setup():
    """Tokenised pairs, initial policy, optimiser and step (identical in every process)."""
    import jax

    import rlhf_eqx as rx
    from rlhf_eqx import data
    from rlhf_eqx.train import make_dpo_step, make_optimizer

    tok = data.ByteTokenizer()
    pairs, _ = data.tokenize_preferences(_records(), tok, max_length=MAX_LEN, max_prompt_length=12)
    cfg = rx.TransformerConfig(
        vocab_size=260,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        max_seq_len=MAX_LEN,
    )
    policy = rx.Policy(cfg, key=jax.random.key(0))
    opt = make_optimizer(learning_rate=LR, eps=ADAM_EPS, total_steps=10)
    return tok, pairs, policy, opt, make_dpo_step(opt, beta=0.1, donate=False)


def _order(num_processes: int):
    """Global row order: process by process, device by device (prompt-hash assignment)."""
    from rlhf_eqx import distributed as dist

    per_process = [
        dist.process_record_indices(
            _records(), process_id=p, num_processes=num_processes, local_devices=LOCAL_DEVICES
        )
        for p in range(num_processes)
    ]
    return [[i for device in devices for i in device] for devices in per_process]


def _worker(mode: str, out_path: str) -> None:
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    from process_workers import leave_run

    from rlhf_eqx import distributed as dist

    if mode == "mismatch":
        # Process 1 is started with another process count than the coordinator's.
        own = int(os.environ[dist.ENV_PROCESS_ID])
        try:
            dist.initialize_distributed(num_processes=2 + own, initialization_timeout=60)
            message = ""
        except ValueError as e:
            message = str(e)
        np.savez(out_path, message=np.asarray(message))
        leave_run()
    # "die": a peer silent for 5 s counts as dead (JAX's default: 100 s).
    timeouts = {"heartbeat_timeout_seconds": 5} if mode == "die" else {}
    process_id, num_processes = dist.initialize_distributed(initialization_timeout=60, **timeouts)
    assert jax.device_count() == LOCAL_DEVICES * num_processes, jax.devices()
    from jax.experimental import multihost_utils

    from rlhf_eqx import data
    from rlhf_eqx.train import init_train_state

    tok, pairs, policy, opt, step = _setup()
    mine = [i for device in dist.process_record_indices(_records()) for i in device]
    assert mine == _order(num_processes)[process_id]
    local = data.collate_preferences(
        [pairs[i] for i in mine], max_length=MAX_LEN, pad_id=tok.pad_id
    )
    mesh = dist.make_mesh(num_processes, LOCAL_DEVICES)
    if mode == "uneven":
        # Process 1 passes one row fewer: refused in both processes, naming the field.
        local = jax.tree.map(lambda x: x[: x.shape[0] - process_id], local)
        try:
            dist.global_batch(local, mesh)
            message = ""
        except ValueError as e:
            message = str(e)
        np.savez(out_path, message=np.asarray(message), mine=np.asarray(mine))
        leave_run()
    batch = dist.global_batch(local, mesh)
    if mode == "count":
        # A cross-process reduction over the global batch, without training.
        count = jax.jit(lambda b: jnp.sum(b.chosen_mask.astype(jnp.int32), axis=1))(batch)
        counts = np.asarray(multihost_utils.process_allgather(count, tiled=True))
        # the same batch built again without the cross-process shape check
        unchecked = dist.global_batch(local, mesh, check_shapes=False)
        same = all(
            np.array_equal(a.addressable_data(0), b.addressable_data(0))
            and a.sharding == b.sharding
            for a, b in zip(jax.tree.leaves(batch), jax.tree.leaves(unchecked))
        )
        np.savez(out_path, counts=counts, mine=np.asarray(mine), same=np.asarray(same))
        leave_run()
    state = dist.shard_train_state(init_train_state(policy, opt), mesh, fsdp=True)
    reference = dist.shard_model(policy, mesh, fsdp=True)
    if mode == "die":
        _die_after_one_step(process_id, state, step, batch, reference, out_path)
    losses = []
    for _ in range(STEPS):
        state, metrics = state.apply(step, batch, reference=reference)
        loss = metrics["loss"]
        assert loss.sharding.is_fully_replicated
        losses.append(float(loss.addressable_data(0)))

    def gathered(tree):
        return [np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in tree]

    leaves = gathered(jax.tree.leaves(state.params))
    moments = {f"opt_{i}": x for i, x in enumerate(gathered(_moments(state)))}
    np.savez(out_path, losses=np.asarray(losses), mine=np.asarray(mine), *leaves, **moments)
    leave_run()


def _die_after_one_step(process_id, state, step, batch, reference, out_path) -> None:
    """One step in both processes, then process 1 kills itself (SIGKILL) and process 0
    goes on: it writes what its next steps raised (or "finished") and leaves."""
    import signal

    import jax

    state, _ = state.apply(step, batch, reference=reference)
    jax.block_until_ready(state.params)
    if process_id == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        for _ in range(STEPS):
            state, metrics = state.apply(step, batch, reference=reference)
            float(metrics["loss"].addressable_data(0))
        message = "finished"
    except Exception as e:  # noqa: BLE001 - what the survivor sees is the result
        message = f"{type(e).__name__}: {e}"
    with open(out_path, "w") as f:
        f.write(message)
    sys.exit(0)  # JAX's shutdown then finds the peer gone and ends the process


def _moments(state) -> list:
    """Adam's moments (the optimiser state's arrays; its scalars are step counts and the
    learning rate)."""
    import jax

    return [x for x in jax.tree.leaves(state.opt_state) if x.ndim >= 1]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _single_process(order):
    import jax

    from rlhf_eqx import data
    from rlhf_eqx.train import init_train_state

    tok, pairs, policy, opt, step = _setup()
    batch = data.collate_preferences(
        [pairs[i] for i in order], max_length=MAX_LEN, pad_id=tok.pad_id
    )
    state = init_train_state(policy, opt)
    losses = []
    for _ in range(STEPS):
        state, metrics = state.apply(step, batch, reference=policy)
        losses.append(float(metrics["loss"]))
    moments = [np.asarray(x) for x in _moments(state)]
    return np.asarray(losses), [np.asarray(x) for x in jax.tree.leaves(state.params)], moments


def _launch(mode: str, tmp_path, *, timeout: float, tries: int = 2):
    """Run two workers in `mode`; return their saved results (after checking both succeeded).

    A launch whose workers have not finished within `timeout` is killed and started again
    on a fresh port, `tries` times in all: rarely (a few in a hundred launches with both
    cores loaded) a gloo collective between the two CPU processes never completes, in
    both processes at once, which says nothing of the run being tested."""
    hung = []
    for attempt in range(tries):
        done, logs = _launch_once(mode, tmp_path / f"try{attempt}", timeout=timeout)
        if done is not None:
            return done
        hung.append(logs)
    pytest.fail(f"the two processes did not finish within {timeout} s, {tries} times: {hung}")


def _launch_once(mode: str, out_dir, *, timeout: float):
    """One launch of two workers: (their saved results, logs), or (None, the logs' tails)
    when they did not finish within `timeout` (then both are killed and reaped)."""
    procs, outs = _start(mode, out_dir)
    logs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            logs.append(out.decode(errors="replace"))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        return None, [proc.communicate()[0].decode(errors="replace")[-2000:] for proc in procs]
    for p, (proc, log) in enumerate(zip(procs, logs)):
        assert proc.returncode == 0, f"process {p} failed:\n{log[-4000:]}"
    return [np.load(path) for path in outs], logs


def _start(mode: str, out_dir) -> tuple[list[subprocess.Popen], list[str]]:
    """Start two workers in `mode` on a fresh port: the processes and their output paths."""
    from conftest import FAST_COMPILE_FLAGS  # the parent's compile flags (not the workers')

    devices = f"--xla_force_host_platform_device_count={LOCAL_DEVICES}"

    num_processes = 2
    port = _free_port()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out_dir.mkdir(parents=True)
    procs, outs = [], []
    for p in range(num_processes):
        env = dict(os.environ)
        env.update(
            PYTHONPATH=root + os.pathsep + env.get("PYTHONPATH", ""),
            JAX_PLATFORMS="cpu",
            XLA_FLAGS=f"{FAST_COMPILE_FLAGS} {devices}",
            RLHF_EQX_COORDINATOR=f"127.0.0.1:{port}",
            RLHF_EQX_NUM_PROCESSES=str(num_processes),
            RLHF_EQX_PROCESS_ID=str(p),
        )
        outs.append(str(out_dir / f"process{p}.npz"))
        procs.append(
            subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), mode, outs[-1]],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                cwd=root,
            )
        )
    return procs, outs


def test_two_processes_read_their_shards_and_reduce_the_global_batch(tmp_path):
    results = _launch("count", tmp_path, timeout=120)
    order = _order(2)
    assert [list(r["mine"]) for r in results] == order
    assert sorted(i for o in order for i in o) == list(range(N_PAIRS))
    pairs = _setup()[1]
    expected = [len(pairs[i].chosen) for o in order for i in o]
    for r in results:
        np.testing.assert_array_equal(r["counts"], expected)
        assert bool(r["same"])  # `check_shapes=False` builds the same global batch


@pytest.mark.slow
def test_two_processes_with_different_batch_shapes_are_refused_by_name(tmp_path):
    """Batches whose rows differ between the processes would compile different programs
    in each (gloo then aborts both with "Received data size doesn't match expected size");
    `global_batch` refuses them in every process, naming the field and the shapes."""
    results = _launch("uneven", tmp_path, timeout=120)
    rows = len(_order(2)[0])
    for r in results:
        message = str(r["message"])
        assert "batch field .chosen_tokens differs between the processes" in message
        shapes = f"process 0: shape ({rows}, {MAX_LEN}), process 1: shape ({rows - 1}, {MAX_LEN})"
        assert shapes in message


def test_a_process_started_with_another_process_count_is_refused(tmp_path):
    """JAX takes the coordinator's process count; a process started with another one is
    refused by name instead of running on with settings its peers do not share."""
    first, second = _launch("mismatch", tmp_path, timeout=120)
    assert str(first["message"]) == ""
    message = str(second["message"])
    assert "started with num_processes=3 (RLHF_EQX_NUM_PROCESSES)" in message
    assert "has 2 processes" in message


@pytest.mark.slow
def test_a_process_killed_mid_run_does_not_leave_the_other_waiting(tmp_path):
    """Process 1 is killed with SIGKILL after a step: process 0's next step fails (gloo
    sees the connection reset) and the process ends (JAX's shutdown finds the peer gone
    after the heartbeat timeout, 5 s here) instead of waiting for its peer forever."""
    procs, outs = _start("die", tmp_path / "run")
    try:
        logs = [proc.communicate(timeout=240)[0].decode(errors="replace") for proc in procs]
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        logs = [proc.communicate()[0].decode(errors="replace")[-2000:] for proc in procs]
        pytest.fail(f"a process still ran 240 s after the launch: {logs}")
    assert procs[1].returncode == -9, logs[1][-2000:]
    assert procs[0].returncode != 0, logs[0][-2000:]  # not a clean exit with a peer gone
    if os.path.exists(outs[0]):  # the step's error, unless JAX ended the process first
        with open(outs[0]) as f:
            assert f.read() != "finished"


def test_two_processes_train_like_one(tmp_path):
    results = _launch("train", tmp_path, timeout=300)
    order = _order(2)
    # Each process read only its own records, and together they read each record once.
    assert [list(r["mine"]) for r in results] == order
    assert sorted(i for o in order for i in o) == list(range(N_PAIRS))
    n = len([k for k in results[0].files if k.startswith("arr_")])
    a = [results[0][f"arr_{i}"] for i in range(n)]
    b = [results[1][f"arr_{i}"] for i in range(n)]
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    from helpers import ADAM_EPS as TESTS_ADAM_EPS, assert_adam_steps_agree

    assert ADAM_EPS == TESTS_ADAM_EPS
    losses, single, single_moments = _single_process([i for o in order for i in o])
    np.testing.assert_allclose(results[0]["losses"], losses, rtol=1e-5)
    assert losses[-1] < losses[0]
    assert len(single) == n
    moments = [results[0][f"opt_{i}"] for i in range(len(single_moments))]
    assert_adam_steps_agree(
        a, single, lr=LR, steps=STEPS, a_opt_state=moments, b_opt_state=single_moments
    )


@pytest.mark.parametrize(
    "env, kwargs, message",
    [
        (
            {"RLHF_EQX_COORDINATOR": "127.0.0.1:1"},
            {},
            r"missing num_processes \(or RLHF_EQX_NUM_PROCESSES\), process_id",
        ),
        ({"RLHF_EQX_NUM_PROCESSES": "two"}, {}, r"RLHF_EQX_NUM_PROCESSES='two' is not an integer"),
        (
            {},
            {"coordinator_address": "127.0.0.1:1", "num_processes": 2, "process_id": 2},
            r"process_id=2 is not in \[0, num_processes=2\)",
        ),
    ],
)
def test_initialize_distributed_names_missing_or_bad_settings(monkeypatch, env, kwargs, message):
    from rlhf_eqx import distributed as dist

    for name in (dist.ENV_COORDINATOR, dist.ENV_NUM_PROCESSES, dist.ENV_PROCESS_ID):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        dist.initialize_distributed(**kwargs)


def test_process_record_indices_give_each_record_to_one_process_and_device():
    from rlhf_eqx import distributed as dist

    prompts = ["a", "b", "a", "c", "d", "b", "e", "f", "g"]
    shards = [
        dist.process_record_indices(prompts, process_id=p, num_processes=3, local_devices=2)
        for p in range(3)
    ]
    flat = [i for process in shards for device in process for i in device]
    assert sorted(flat) == list(range(len(prompts)))
    for process in shards:
        for device in process:
            others = [i for p2 in shards for d2 in p2 if d2 is not device for i in d2]
            assert not {prompts[i] for i in device} & {prompts[i] for i in others}


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
