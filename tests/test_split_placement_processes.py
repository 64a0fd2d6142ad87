"""GRPO's split placement in a multi-process run: two processes on 127.0.0.1 with four
CPU devices each (gloo CPU collectives) run GRPO with the trainer FSDP over four devices
and the sampler data parallel over the other four, each mesh spanning both processes
(two devices of each). After each update the behaviour policy moves from the trainer's
devices to the sampler's through the hosts (multi-controller JAX does not reshard
between different device sets across processes), and the sampled rows come back to
every host for decoding and rewards. Both processes end with the same parameters and
metrics as the same run in one process on eight simulated devices. The LoRA run killed
with SIGKILL after its first checkpoint and resumed across both processes ends as the
uninterrupted run (an expected failure while checkpoints of arrays spanning processes
are not written). The device choice itself is checked without processes.

Run as a script (`python tests/test_split_placement_processes.py OUT_FILE MODE`) this
file is one worker (`_worker`); the coordinator address, process count and id come from
the `RLHF_EQX_*` variables.
"""

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

LOCAL_DEVICES = 4
_PROMPTS = [f"Once upon a time {i}" for i in range(12)]
_TIMING = ("time", "iteration_time_s", "tokens_per_s", "rollout/weight_sync_s")
_SPLIT = dict(placement="split", trainer_mesh="fsdp:4", sampler_mesh="data:4")


def _cases():
    """The runs: LoRA (base frozen, one rollout ahead while the update runs), a full
    fine-tune (synchronous) and LoRA with DAPO's dynamic sampling and overlong shaping
    (synchronous), each with the split placement over eight devices."""
    from rlhf_eqx import pipelines as pl

    cfg = pl.animal_task_config().grpo
    optim = dataclasses.replace(cfg.optim, warmup_ratio=0.0)  # the first update moves
    lora = dict(rollouts=3, prompts_per_rollout=4, group_size=2, optim=optim, staleness=1)
    full = dict(
        lora,
        rollouts=2,
        staleness=0,
        lora=dataclasses.replace(cfg.lora, rank=0),
        optim=dataclasses.replace(optim, learning_rate=1e-4),
    )
    # DAPO's reward shaping: groups whose rewards all agree resampled (at most twice a
    # rollout) and completions near the token limit penalised
    dapo = dict(lora, rollouts=2, staleness=0, dynamic_sampling=2, overlong_buffer=3)
    return {
        name: dataclasses.replace(cfg, **c, **_SPLIT)
        for name, c in (("lora", lora), ("full", full), ("dapo", dapo))
    }


def _run(name: str, cfg, run_dir: str, mode: str = "once", checkpoints: str | None = None):
    """One GRPO run of `cfg`: its final parameters (whole, on the host), the metric records
    of its iterations and the processes holding the trainer's parameters. `mode`
    `"fresh"` checkpoints every iteration in the directory `checkpoints`, `"resume"`
    continues from there too, `"once"` writes no checkpoint."""
    import jax

    from rlhf_eqx import distributed as dist, pipelines as pl

    policy, tok = pl.tools.load_model("builtin")
    reward = [pl.runs.RewardFunction("parity", lambda p, t: float(len(t) % 2))]
    ctx = pl.RunContext(
        ops=pl.OpsConfig(monitor=False, quiet=True, checkpoint_every=1),
        log=pl.tools.MetricsLog(run_dir, name, quiet=True),
        key=jax.random.key(0),
        checkpoint_dir=None if mode == "once" else checkpoints,
        resume=mode == "resume",
        prompt_length=16,
        max_new_tokens=8,
    )
    res = pl.runs.run_grpo(policy, tok, _PROMPTS, reward=reward, cfg=cfg, ctx=ctx)
    records = [
        r
        for r in pl.tools.read_records(run_dir)
        if r.get("stage") == name and "step" in r and "event" not in r
    ]
    params = [x for x in jax.tree.leaves(res.state.params) if isinstance(x, jax.Array)]
    devices = {d.process_index for x in params for d in x.sharding.device_set}
    return dist.to_host(params), records, sorted(devices)


def _worker(out_path: str, mode: str) -> None:
    """This process's part of the runs: every case and the refused settings (`mode`
    `"once"`), or the LoRA case alone, checkpointed (`"fresh"`) or resumed (`"resume"`):
    its metrics in a run directory of each process's own, its checkpoints in one
    directory that both processes write (as on a shared file system)."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    from process_workers import leave_run

    from rlhf_eqx import distributed as dist

    process_id, num_processes = dist.initialize_distributed(initialization_timeout=60)
    from rlhf_eqx import pipelines as pl

    if mode == "mismatch":
        # process 1 lays its trainer out otherwise: refused by name in both processes
        mesh = "fsdp:4" if process_id == 0 else "data:4"
        cfg = dataclasses.replace(_cases()["full"], trainer_mesh=mesh)
        try:
            _run("mismatch", cfg, os.path.join(os.path.dirname(out_path), f"run{process_id}"))
            message = ""
        except pl.ConfigError as e:
            message = str(e)
        np.savez(out_path + ".npz")
        with open(out_path, "w") as f:
            json.dump({"message": message}, f)
        leave_run()
    if mode != "once":
        run_dir = os.path.join(os.path.dirname(out_path), f"lora{process_id}")
        shared = os.path.join(os.path.dirname(out_path), "ckpt")
        params, records, _ = _run("lora", _cases()["lora"], run_dir, mode, shared)
        np.savez(out_path + ".npz", *params)
        with open(out_path, "w") as f:
            json.dump({"records": records, "events": pl.tools.read_records(run_dir)}, f)
        leave_run()
    out: dict = {"devices": jax.device_count(), "processes": num_processes, "refused": []}
    split = [f"grpo.{k}={v}" for k, v in _SPLIT.items()]
    for changes in (
        ["trainer_devices=3", "sampler_devices=4"],  # counts that do not divide over the
        ["trainer_devices=2", "sampler_devices=5"],  # processes
        ["staleness=1", "partial_rollouts=4"],
    ):
        try:
            cfg = pl.apply_overrides(pl.PipelineConfig(), split + [f"grpo.{c}" for c in changes])
            pl.config.validate_config(cfg)
            out["refused"].append(None)
        except pl.ConfigError as e:
            out["refused"].append(str(e))
    arrays = {}
    for name, cfg in _cases().items():
        run_dir = os.path.join(os.path.dirname(out_path), f"{name}{process_id}")
        params, records, processes = _run(name, cfg, run_dir)
        out[name] = {"records": records, "trainer_processes": processes}
        arrays.update({f"{name}_{i}": x for i, x in enumerate(params)})
    np.savez(out_path + ".npz", **arrays)
    with open(out_path, "w") as f:
        json.dump(out, f)
    leave_run()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path, mode: str = "once", stop=None) -> list[tuple[dict, dict]]:
    """Both workers' results in `tmp_path`: (json, arrays) per process. With `stop`, both
    workers are killed with SIGKILL once `stop()` holds (polled), and `[]` returned.

    In mode `"once"` (no run directory carried from one launch to the next) a launch not
    finished within its deadline is killed and started once more on a fresh port: rarely
    a gloo collective between the two CPU processes never completes, in both at once."""
    if mode == "once" and stop is None:
        try:
            return _launch_once(tmp_path / "try0", mode, stop)
        except subprocess.TimeoutExpired:
            return _launch_once(tmp_path / "try1", mode, stop)
    return _launch_once(tmp_path, mode, stop)


def _launch_once(tmp_path, mode: str, stop) -> list[tuple[dict, dict]]:
    """One launch of the two workers (`_launch`); `subprocess.TimeoutExpired` when they
    did not finish by the deadline (both killed and reaped)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    port, root = _free_port(), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    flags = re.sub(
        r"\s*--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")
    )
    procs, outs = [], []
    for p in range(2):
        env = dict(
            os.environ,
            PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
            JAX_PLATFORMS="cpu",
            XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={LOCAL_DEVICES}".strip(),
            RLHF_EQX_COORDINATOR=f"127.0.0.1:{port}",
            RLHF_EQX_NUM_PROCESSES="2",
            RLHF_EQX_PROCESS_ID=str(p),
        )
        outs.append(tmp_path / f"process{p}.json")
        cmd = [sys.executable, os.path.abspath(__file__), str(outs[-1]), mode]
        with open(f"{outs[-1]}.log", "wb") as log:
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    logs = lambda: [Path(f"{o}.log").read_text(errors="replace")[-4000:] for o in outs]  # noqa: E731
    try:
        deadline = time.time() + 300
        while stop is not None and not stop() and time.time() < deadline:
            assert all(proc.poll() is None for proc in procs), logs()
            time.sleep(0.02)
        assert stop is None or stop(), logs()
        for proc in procs:
            if stop is not None:
                proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=max(deadline - time.time(), 1))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if stop is not None:
        assert [proc.returncode for proc in procs] == [-signal.SIGKILL] * 2, logs()
        return []
    for proc, log in zip(procs, logs()):
        assert proc.returncode == 0, log
    return [(json.loads(o.read_text()), dict(np.load(str(o) + ".npz"))) for o in outs]


def _strip(records, drop=()):
    return [{k: v for k, v in r.items() if k not in _TIMING + drop} for r in records]


@pytest.mark.slow
def test_a_placement_that_differs_between_the_processes_is_refused_by_name(tmp_path):
    """Each process compiles the programs of its own settings: with another trainer mesh
    in one process the collectives do not match (gloo timed out after 30 s, "Gloo
    context initialization failed"). The run refuses it in both processes first."""
    results = _launch(tmp_path, "mismatch")
    for (out, _), mine in zip(results, ("fsdp:4", "data:4"), strict=True):
        assert out["message"] == (
            f"grpo.trainer_mesh={mine!r}: must be the same in every process of this run "
            "(process 0: 'fsdp:4', process 1: 'data:4')"
        )


@pytest.mark.slow
def test_split_placement_across_two_processes_is_the_one_process_run(tmp_path):
    """LoRA (staleness 1: the next rollout sampled, gathered, decoded and scored by a worker
    thread while the update runs), a full fine-tune and LoRA with DAPO's dynamic sampling
    and overlong shaping, each split over two processes:
    both processes end with the same parameters and records, those of the split run in
    one process on eight devices up to float reassociation; the trainer mesh spans both
    processes, only the adapters move after a LoRA update and every parameter after a
    full one; device counts that do not divide over the processes, and partial rollouts,
    are refused there."""
    import jax

    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    (first, first_arrays), (second, second_arrays) = _launch(tmp_path)
    for out in (first, second):
        assert out["devices"] == 2 * LOCAL_DEVICES and out["processes"] == 2
        assert out["refused"] == [
            f"grpo.{field}={n}.0: {n} device(s) must divide evenly over the 2 processes of this "
            "run (each process holds the same share of the trainer's and the sampler's devices)"
            for field, n in (("trainer_devices", 3), ("sampler_devices", 5))
        ] + [
            "grpo.partial_rollouts=4: must be 0 with grpo.placement=split across the 2 "
            "processes of this run (partial rollouts are continued on the sampler's devices, "
            "which one process does not hold alone)"
        ]
    # the two processes hold the same run, bit for bit
    assert first_arrays.keys() == second_arrays.keys()
    for key in first_arrays:
        np.testing.assert_array_equal(first_arrays[key], second_arrays[key], err_msg=key)
    for name, cfg in _cases().items():
        assert _strip(first[name]["records"]) == _strip(second[name]["records"]), name
        assert first[name]["trainer_processes"] == [0, 1]
        params, records, processes = _run(name, cfg, str(tmp_path / f"{name}_one"))
        assert processes == [0]
        # The cross-process all-reduces (gloo) sum the FSDP shards in another order than
        # one process does, and Adam's normalised steps (learning rate 2e-3 with LoRA)
        # magnify the reassociated sums: the bound of tests/test_split_placement.py.
        theirs = [first_arrays[f"{name}_{i}"] for i in range(len(params))]
        for x, y in zip(params, theirs, strict=True):
            np.testing.assert_allclose(y, x, atol=1e-4, rtol=0, err_msg=name)
        for ra, rb in zip(_strip(first[name]["records"]), _strip(records), strict=True):
            assert ra.keys() == rb.keys()
            for key in ra:
                if isinstance(ra[key], str):
                    assert ra[key] == rb[key], key
                else:
                    np.testing.assert_allclose(ra[key], rb[key], rtol=1e-3, atol=1e-4, err_msg=key)
        sync = [r["rollout/weight_sync_bytes"] for r in first[name]["records"]]
        trainable = float(sum(x.nbytes for x in params))
        # rollout 0 is sampled by the initial policy; each LoRA iteration moves the next
        # one's (none after the last), each full fine-tuning iteration its own
        assert sync == ([trainable] * 2 + [0.0] if name == "lora" else [trainable] * 2)
        assert [r["rollout/base_transfers"] for r in first[name]["records"]] == [1.0] * len(sync)
    # DAPO's shaping ran across the processes: groups resampled, the overlong penalty taken
    dapo = first["dapo"]["records"]
    assert max(r["rollout/dynamic_sampling/samplings"] for r in dapo) > 1, dapo
    assert all("rollout/overlong_penalty" in r for r in dapo), dapo


@pytest.mark.slow
def test_split_run_across_two_processes_killed_then_resumed_is_exact(tmp_path):
    """The LoRA split run over two processes, both checkpointing every iteration into one
    directory, killed with SIGKILL (both processes) once the checkpoint of iteration 1
    is on disk and resumed from it over two processes: both processes resume from
    iteration 1 and end with the uninterrupted run's parameters and records, bit for
    bit; the shared directory holds one checkpoint an iteration (the last two kept)."""
    import jax

    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    full, cut = tmp_path / "full", tmp_path / "cut"
    full.mkdir(), cut.mkdir()
    runs = _launch(full, "fresh")
    assert sorted(os.listdir(full / "ckpt")) == ["iter_00000002", "iter_00000003"]
    _launch(cut, "fresh", stop=lambda: os.path.isdir(cut / "ckpt" / "iter_00000001"))
    names = os.listdir(cut / "ckpt")  # killed before a later checkpoint was in place
    assert [n for n in names if ".tmp" not in n] == ["iter_00000001"], names
    for (want, want_arrays), (got, got_arrays) in zip(runs, _launch(cut, "resume"), strict=True):
        assert [r["iteration"] for r in got["events"] if r.get("event") == "resume"] == [1]
        # The resumed iteration samples its rollout again (the prepared one died with the
        # processes): not overlapped, and its stale behaviour adapters move to the sampler
        # before the updated ones do.
        moved = ("rollout/overlapped", "rollout/weight_sync_bytes")
        assert _strip(got["records"], moved) == _strip(want["records"], moved)
        assert len(want["records"]) == 3
        for key, resumed in zip(moved, (lambda x: 0.0, lambda x: 2 * x)):
            x = [r[key] for r in want["records"]]
            assert [r[key] for r in got["records"]] == [x[0], resumed(x[1]), x[2]], key
        assert want_arrays.keys() == got_arrays.keys()
        for key in want_arrays:
            np.testing.assert_array_equal(got_arrays[key], want_arrays[key], err_msg=key)


@pytest.mark.parametrize("processes", [1, 2])
def test_each_mesh_spans_every_process(processes):
    """Eight devices, four a process with two processes: the trainer's four are the first
    two of each process and the sampler's four the next two; with one process, the
    first four and the next four. Counts that do not divide over the processes are
    refused."""
    from rlhf_eqx import distributed as dist

    @dataclasses.dataclass(frozen=True)
    class Device:
        id: int
        process_index: int

    devices = [Device(i, i // (8 // processes)) for i in range(8)]
    ids = lambda counts: [[d.id for d in g] for g in dist.spanning_devices(devices, counts)]  # noqa: E731
    if processes == 1:
        assert ids((4, 4)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert ids((2, 5)) == [[0, 1], [2, 3, 4, 5, 6]]
    else:
        assert ids((4, 4)) == [[0, 1, 4, 5], [2, 3, 6, 7]]
        assert ids((2, 6)) == [[0, 4], [1, 2, 3, 5, 6, 7]]
        with pytest.raises(
            ValueError, match=r"group 1 of 3 device\(s\) does not divide over the 2"
        ):
            dist.spanning_devices(devices, (2, 3))
        with pytest.raises(ValueError, match=r"need 5 local devices in each of the 2 processes"):
            dist.spanning_devices(devices, (4, 6))


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
