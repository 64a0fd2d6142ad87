"""Real processes killed with SIGKILL, then resumed in ways the first run did not foresee:
a sweep, another `ops.checkpoint_every`, a run directory whose path has spaces and
non-ASCII letters given relative first and absolute after (from another working
directory), the compilation cache deleted in between. Each resumed run ends with the
uninterrupted run's weights, bit for bit, and every step logged once."""

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))

SETTINGS = [
    "--quiet",
    *("--set", "sft.max_length=32", "--set", "sft.batch_size=4", "--set", "data.limit=40"),
    *("--set", "sampling.prompt_length=16", "--set", "ops.monitor=false"),
    *("--set", "sft.steps=12"),
]


def _data(tmp_path) -> str:
    animals = ["dog", "cat", "bird", "fish", "frog", "cow", "pig", "fox"]
    path = tmp_path / "tiny.jsonl"
    with open(path, "w") as f:
        for i in range(40):
            a = animals[i % len(animals)]
            rec = {"prompt": f"Tom saw a {a} {i}.", "chosen": f" The {a} ran.", "rejected": " No."}
            f.write(json.dumps(rec) + "\n")
    return str(path)


def _env(cache_home) -> dict:
    # The command line's own compilation cache, under a cache home of the test's.
    env = dict(os.environ, PYTHONPATH=ROOT, XDG_CACHE_HOME=str(cache_home))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env


def _cli(*args) -> list[str]:
    return [sys.executable, "-m", "rlhf_eqx", *args]


def _run(args, cwd, env):
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _latest(ck) -> int:
    names = os.listdir(ck) if os.path.isdir(ck) else []
    return max([int(n[5:]) for n in names if n.startswith("iter_") and n[5:].isdigit()] or [0])


def _killed_at(args, cwd, env, ck, at: int) -> None:
    """Run `args` and SIGKILL it once its checkpoint directory `ck` holds iteration `at`."""
    proc = subprocess.Popen(args, cwd=cwd, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while _latest(ck) < at:
        assert proc.poll() is None, f"the run ended before it was killed: {proc.stderr.read()}"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    proc.stderr.close()


def _steps(metrics) -> list[int]:
    with open(metrics) as f:
        records = [json.loads(line) for line in f]
    return [r["step"] for r in records if "event" not in r and not r.get("eval")]


def _weights(run_dir) -> dict[str, bytes]:
    pattern = os.path.join(run_dir, "**", "hf", "model.safetensors")
    found = sorted(glob.glob(pattern, recursive=True))
    assert found
    out = {}
    for path in found:
        with open(path, "rb") as f:
            out[os.path.relpath(path, run_dir)] = f.read()
    return out


@pytest.mark.slow
def test_a_killed_sweep_resumes_bit_identical_with_another_checkpoint_every(tmp_path):
    data, env = _data(tmp_path), _env(tmp_path / "cache")

    def sweep(out, every, *extra):
        return _cli(
            "sweep", "sft", "--data", data, "--seeds", "1",
            "--grid", "sft.optim.learning_rate=1e-3,3e-3", "--out", out, "--export",
            *SETTINGS, "--set", f"ops.checkpoint_every={every}", *extra,
        )  # fmt: skip

    _run(sweep("full", 3), tmp_path, env)
    _killed_at(sweep("cut", 3), tmp_path, env, tmp_path / "cut" / "checkpoints", 6)
    _run(sweep("cut", 5, "--resume"), tmp_path, env)
    assert _weights(tmp_path / "cut") == _weights(tmp_path / "full")
    for member in os.listdir(tmp_path / "full" / "members"):
        assert _steps(tmp_path / "cut" / "members" / member / "metrics.jsonl") == list(range(12))
    assert sorted(os.listdir(tmp_path / "cut" / "checkpoints"))[-1] == "iter_00000012"


@pytest.mark.slow
def test_a_killed_run_resumes_from_another_directory_after_the_cache_went(tmp_path):
    data, env = _data(tmp_path), _env(tmp_path / "cache")
    _run(_cli("sft", "--data", data, "--out", "full", *SETTINGS), tmp_path, env)
    parent = tmp_path / "my runs ü"
    parent.mkdir()
    rel = os.path.join("my runs ü", "été 1")  # relative to tmp_path
    every3 = ("--set", "ops.checkpoint_every=3")
    ck = tmp_path / rel / "sft" / "checkpoints"
    _killed_at(_cli("sft", "--data", data, "--out", rel, *SETTINGS, *every3), tmp_path, env, ck, 6)
    cache = tmp_path / "cache" / "rlhf_eqx" / "jax"
    assert os.listdir(cache)  # the killed run kept its compiled programs there
    shutil.rmtree(tmp_path / "cache")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    every2 = ("--set", "ops.checkpoint_every=2")
    again = _cli("sft", "--data", data, "--out", str(tmp_path / rel), *SETTINGS, *every2)
    _run([*again, "--resume"], elsewhere, env)
    assert _weights(tmp_path / rel) == _weights(tmp_path / "full")
    assert _steps(tmp_path / rel / "metrics.jsonl") == list(range(12))
    assert not os.path.exists(tmp_path / rel / ".lock")
