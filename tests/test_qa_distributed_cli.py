"""The command line joins a multi-process run from the `RLHF_EQX_*` environment variables
(`RLHF_EQX_COORDINATOR`, `RLHF_EQX_NUM_PROCESSES`, `RLHF_EQX_PROCESS_ID`), before its
configuration checks start JAX's backend; incomplete or malformed settings are refused
with one line naming the variable, before anything runs."""

import os
import re
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ("RLHF_EQX_COORDINATOR", "RLHF_EQX_NUM_PROCESSES", "RLHF_EQX_PROCESS_ID")
SAMPLE = ["sample", "--prompt", "Once", "-n", "1", "--set", "sampling.max_new_tokens=4"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(local_devices: int = 1, **variables: str) -> dict:
    flags = re.sub(
        r"\s*--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")
    )
    env = {k: v for k, v in os.environ.items() if k not in NAMES}
    env.update(
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={local_devices}".strip(),
    )
    env.update(variables)
    return env


def _cli(env: dict, args=SAMPLE, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlhf_eqx", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    "variables, message",
    [
        (
            {"RLHF_EQX_PROCESS_ID": "1"},
            "missing coordinator_address (or RLHF_EQX_COORDINATOR), num_processes "
            "(or RLHF_EQX_NUM_PROCESSES)",
        ),
        (
            {
                "RLHF_EQX_COORDINATOR": "127.0.0.1:1",
                "RLHF_EQX_NUM_PROCESSES": "two",
                "RLHF_EQX_PROCESS_ID": "0",
            },
            "environment variable RLHF_EQX_NUM_PROCESSES='two' is not an integer",
        ),
        (
            {
                "RLHF_EQX_COORDINATOR": "127.0.0.1:1",
                "RLHF_EQX_NUM_PROCESSES": "2",
                "RLHF_EQX_PROCESS_ID": "2",
            },
            "process_id=2 is not in [0, num_processes=2)",
        ),
    ],
)
def test_cli_refuses_incomplete_or_bad_process_settings(variables, message):
    done = _cli(_env(**variables), timeout=60)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr, done.stderr
    assert done.stdout == ""


def test_cli_joins_a_one_process_run_from_the_environment():
    port = _free_port()
    env = _env(
        RLHF_EQX_COORDINATOR=f"127.0.0.1:{port}",
        RLHF_EQX_NUM_PROCESSES="1",
        RLHF_EQX_PROCESS_ID="0",
    )
    done = _cli(env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"rlhf_eqx: process 0 of 1 (coordinator 127.0.0.1:{port})" in done.stderr
    assert done.stdout.startswith("Once")


@pytest.mark.slow
def test_cli_runs_without_the_variables_join_nothing():
    done = _cli(_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rlhf_eqx: process" not in done.stderr


def _two_processes(args_of, *, local_devices: int, timeout: float):
    """Run `python -m rlhf_eqx *args_of(p)` as processes 0 and 1 of one run on
    127.0.0.1; returns `(port, [(returncode, stdout, stderr)] by process)`."""
    port = _free_port()
    procs = []
    for p in range(2):
        env = _env(
            local_devices=local_devices,
            RLHF_EQX_COORDINATOR=f"127.0.0.1:{port}",
            RLHF_EQX_NUM_PROCESSES="2",
            RLHF_EQX_PROCESS_ID=str(p),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "rlhf_eqx", *args_of(p)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        outs = [proc.communicate(timeout=timeout) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return port, [(proc.returncode, out, err) for proc, (out, err) in zip(procs, outs)]


@pytest.mark.slow
def test_cli_two_processes_join_one_run():
    port, runs = _two_processes(lambda p: SAMPLE, local_devices=2, timeout=240)
    for p, (code, out, err) in enumerate(runs):
        assert code == 0, err[-3000:]
        assert f"rlhf_eqx: process {p} of 2 (coordinator 127.0.0.1:{port})" in err
        assert out.startswith("Once")
    assert runs[0][1] == runs[1][1]  # the same seed samples the same text in each process


@pytest.mark.slow
def test_main_in_a_program_that_joined_already_does_not_join_again():
    """`main` called by a program that ran `initialize_distributed` itself (with the
    variables set, as a launcher does) runs on in the run it joined."""
    port = _free_port()
    env = _env(
        RLHF_EQX_COORDINATOR=f"127.0.0.1:{port}",
        RLHF_EQX_NUM_PROCESSES="1",
        RLHF_EQX_PROCESS_ID="0",
    )
    program = (
        "import sys\n"
        "from rlhf_eqx import distributed as dist\n"
        "from rlhf_eqx.__main__ import main\n"
        "assert dist.initialize_distributed() == (0, 1)\n"
        f"sys.exit(main({SAMPLE!r}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("Once")


@pytest.mark.slow
def test_cli_split_grpo_across_two_processes_exports_its_policy(tmp_path):
    """`grpo.placement=split` over two processes of 4 devices each: the trained policy's
    arrays are sharded across the processes, and each process gathers them for its own
    export (`save_hf` of the whole policy); both exports are the same model."""
    args = ["grpo", "--quiet", "--set", "grpo.placement=split"]
    args += ["--set", "grpo.trainer_mesh=fsdp:4", "--set", "grpo.sampler_mesh=data:4"]
    args += ["--set", "sft.steps=2", "--set", "grpo.rollouts=2", "--set", "eval_samples=2"]
    _, runs = _two_processes(
        lambda p: [*args, "--out", str(tmp_path / f"p{p}")], local_devices=4, timeout=500
    )
    for code, _, err in runs:
        assert code == 0, err[-3000:]
    files = [tmp_path / f"p{p}" / "grpo" / "hf" / "model.safetensors" for p in range(2)]
    assert files[0].read_bytes() == files[1].read_bytes()
