"""GRPO's split placement in a multi-process run: two processes on 127.0.0.1 with four
CPU devices each (gloo CPU collectives) check a configuration with the split placement,
and each is refused with one `ConfigError` naming `grpo.placement`, before anything is
loaded (the placement itself checks the same when it is built). The reason is
checked on the same processes: `jax.device_put` refuses to move an array from the
first two devices of each process (a trainer mesh spanning both) to the other two (the
sampler's), the weight transfer the placement makes after every update.

Run as a script (`python tests/test_split_placement_processes.py OUT_FILE`) this file is
one worker; the coordinator address, process count and id come from the `RLHF_EQX_*`
variables.
"""

import json
import os
import socket
import subprocess
import sys

import pytest

LOCAL_DEVICES = 4


def _worker(out_path: str) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    from rlhf_eqx import distributed as dist

    process_id, num_processes = dist.initialize_distributed(initialization_timeout=60)
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from rlhf_eqx import pipelines as pl

    out: dict = {"devices": jax.device_count(), "processes": num_processes}
    split = ["grpo.placement=split", "grpo.trainer_mesh=fsdp:4", "grpo.sampler_mesh=data:4"]
    try:
        pl.config.validate_config(pl.apply_overrides(pl.PipelineConfig(), split))
        out["refused"] = None
    except pl.ConfigError as e:
        out["refused"] = str(e)
    mine = {p: [d for d in jax.devices() if d.process_index == p] for p in range(num_processes)}
    trainer = dist.make_mesh(4, 1, devices=[d for p in mine for d in mine[p][:2]])
    sampler = dist.make_mesh(4, 1, devices=[d for p in mine for d in mine[p][2:]])
    rows = jax.device_put(
        np.arange(8.0).reshape(4, 2), NamedSharding(trainer, PartitionSpec("data"))
    )
    try:
        jax.device_put(rows, NamedSharding(sampler, PartitionSpec("data")))
        out["transfer"] = None
    except ValueError as e:
        out["transfer"] = str(e).splitlines()[0]
    with open(out_path, "w") as f:
        json.dump(out, f)
    del process_id


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_the_split_placement_is_refused_across_processes_naming_the_setting(tmp_path):
    port, root = _free_port(), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs, outs = [], []
    for p in range(2):
        env = dict(
            os.environ,
            PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
            JAX_PLATFORMS="cpu",
            XLA_FLAGS=f"--xla_force_host_platform_device_count={LOCAL_DEVICES}",
            RLHF_EQX_COORDINATOR=f"127.0.0.1:{port}",
            RLHF_EQX_NUM_PROCESSES="2",
            RLHF_EQX_PROCESS_ID=str(p),
        )
        outs.append(tmp_path / f"process{p}.json")
        cmd = [sys.executable, os.path.abspath(__file__), str(outs[-1])]
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    try:
        logs = [proc.communicate(timeout=120)[0].decode(errors="replace") for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, log in zip(procs, logs):
        assert proc.returncode == 0, log[-4000:]
    for path in outs:
        got = json.loads(path.read_text())
        assert got["devices"] == 2 * LOCAL_DEVICES and got["processes"] == 2
        assert got["refused"].startswith(
            "grpo.placement='split': runs in one process, not across the 2 of this run: "
        )
        assert got["refused"].endswith("use placement=colocated here")
        # why: the weight transfer between two device sets spanning both processes
        assert got["transfer"].startswith("For a cross-host reshard in multi-controller JAX")


if __name__ == "__main__":
    _worker(sys.argv[1])
