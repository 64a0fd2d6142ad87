"""Faults in real processes, no mocks: `kill -9` at random moments (inside checkpoint
writes too) with a resume after each until the run completes; two runs racing for one
run directory; a disk that fills up; Ctrl-C on the command line.

Every run here is a separate process. The SIGKILL loop forks its runs from a server
process that has imported JAX and rlhf_eqx once (before any computation, so forking is
safe): a fresh interpreter costs seconds of imports per run, which would leave room for
only a handful of kills in the time the test may take. The forked runs share a JAX
compilation cache, so a resumed run does not compile its step again.
"""

import contextlib
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import signal_when

from rlhf_eqx import pipelines as pl

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))

# A tiny SFT run driven through the run-directory layer (`open_run_dir`, a `MetricsLog`
# in the run directory, checkpoints in `<run_dir>/sft/checkpoints`).
#   python child.py serve   read JSON requests on stdin; fork one run per request, kill
#                           it as asked, report how it ended (one JSON line each)
#   python child.py hold RUN_DIR OUT STEPS
#                           take RUN_DIR, print "held", wait for a line on stdin, then run
CHILD = textwrap.dedent(
    """
    import json, os, signal, sys, time, traceback

    import equinox as eqx
    import jax
    import rlhf_eqx as rx
    from rlhf_eqx import pipelines as pl
    from rlhf_eqx.assets import asset_path


    def config(run_dir, steps):
        sft = pl.SFTConfig(
            steps=steps, batch_size=4, max_length=24,
            optim=rx.train.OptimizerSettings(learning_rate=1e-2, warmup_ratio=0.1),
            lora=pl.LoRASettings(rank=4, alpha=8.0, dropout=0.1),
        )
        ops = pl.OpsConfig(quiet=True, checkpoint_every=1, keep=2, seed=3, monitor=False)
        return pl.PipelineConfig(sft=sft, ops=ops, stages=("sft",), out=run_dir)


    def train(run_dir, out, resume, steps, fsync_sleep=0.0, held=None):
        if fsync_sleep:  # slow every fsync down, so that kills land inside writes
            fsync = os.fsync

            def slow_fsync(fd):
                time.sleep(fsync_sleep)
                fsync(fd)

            os.fsync = slow_fsync
        cfg = config(run_dir, steps)
        with pl.tools.open_run_dir(cfg, run_dir, resume=resume) as rd:
            for note in rd.notes:
                print("note:", note, flush=True)
            if held is not None:
                held()
            tok = rx.data.load_tokenizer(asset_path("tok512.bin"))
            mcfg = rx.TransformerConfig(vocab_size=512, d_model=16, n_layers=1, n_heads=2,
                                        n_kv_heads=1, d_ff=32, max_seq_len=64)
            policy = rx.Policy(mcfg, key=jax.random.key(0))
            records = [("Once upon a time", " a dog ran."), ("The cat", " sat on a mat."),
                       ("Lily saw", " a big red ball."), ("Tom had", " a little fish.")] * 3
            ctx = pl.RunContext(
                ops=cfg.ops, log=pl.tools.MetricsLog(run_dir, "sft", quiet=True),
                key=jax.random.key(7),
                checkpoint_dir=os.path.join(run_dir, "sft", "checkpoints"),
                resume=rd.resume, prompt_length=12,
                meta={"stage": "sft", "config": pl.config.config_to_dict(cfg)},
            )
            res = pl.runs.run_sft(policy, tok, records, cfg=cfg.sft, ctx=ctx)
            eqx.tree_serialise_leaves(out + ".part", res.state)
            os.replace(out + ".part", out)
            summary = os.path.join(run_dir, "summary.json")
            with open(summary + ".part", "w") as f:
                json.dump({"stopped": res.loop.stopped}, f)
            os.replace(summary + ".part", summary)


    def names(d):
        try:
            return set(os.listdir(d))
        except FileNotFoundError:
            return set()


    def watch(pid, t0, req):
        # Poll the run until it ends or it is time to kill it: `kill_after` seconds after
        # the fork, or `delay` seconds after the `count`-th file named `prefix*.tmp<pid>`
        # appeared in `dir` (a write through a temporary: a checkpoint, config.json, the
        # rewritten metrics.jsonl). The run is reaped only below, so its pid cannot be
        # reused while it may still be signalled.
        ck = os.path.join(req["run_dir"], "sft", "checkpoints")
        before = {n for n in names(ck) if ".tmp" not in n}
        suffix = f".tmp{pid}"
        on = req.get("kill_on")
        writes, first, due, killed = set(), None, None, None
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            now = time.monotonic() - t0
            if first is None and {n for n in names(ck) if ".tmp" not in n} - before:
                first = now
            if on and due is None:
                writes |= {
                    n for n in names(on["dir"])
                    if n.startswith(on["prefix"]) and n.endswith(suffix)
                }
                if len(writes) >= on["count"]:
                    due = now + on["delay"]
            if (
                (due is not None and now >= due)
                or now >= req.get("kill_after", float("inf"))
                or now > req["timeout"]
            ):
                os.kill(pid, signal.SIGKILL)
                killed = now
                _, status = os.waitpid(pid, 0)
                break
            time.sleep(0.005)
        return {
            "pid": pid,
            "code": os.waitstatus_to_exitcode(status),
            "wall": time.monotonic() - t0,
            "killed_at": killed,
            "timed_out": killed is not None and killed > req["timeout"],
            "first_checkpoint": first,
            "partial_checkpoints": sorted(n for n in names(ck) if n.endswith(suffix)),
            "partial_files": sorted(n for n in names(req["run_dir"]) if n.endswith(suffix)),
        }


    def serve():
        print("ready", flush=True)
        while True:
            line = sys.stdin.readline()
            if not line:
                return
            req = json.loads(line)
            t0 = time.monotonic()
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                    os.dup2(fd, 1)
                    os.dup2(fd, 2)
                    print(f"--- process {os.getpid()}", flush=True)
                    train(req["run_dir"], req["out"], req["resume"], req["steps"],
                          req["fsync_sleep"])
                    code = 0
                except BaseException:
                    traceback.print_exc()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            print(json.dumps(watch(pid, t0, req)), flush=True)


    if __name__ == "__main__":
        if sys.argv[1] == "serve":
            serve()
        else:
            run_dir, out, steps = sys.argv[2], sys.argv[3], int(sys.argv[4])

            def held():
                print("held", flush=True)
                sys.stdin.readline()

            train(run_dir, out, False, steps, held=held)
    """
)

# The command-line runs: the shipped model on a tiny preference file, small shapes.
CLI_SETTINGS = [
    "--quiet",
    "--set",
    "sft.max_length=32",
    "--set",
    "sft.batch_size=4",
    "--set",
    "data.limit=40",
    "--set",
    "sampling.prompt_length=16",
    "--set",
    "ops.monitor=false",
]


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
    """A JAX compilation cache shared by this module's processes."""
    return str(tmp_path_factory.mktemp("jax-cache"))


def _env(cache: str) -> dict:
    return dict(
        os.environ,
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        JAX_COMPILATION_CACHE_DIR=cache,
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )


def _child_script(tmp_path) -> str:
    path = tmp_path / "child.py"
    path.write_text(CHILD)
    return str(path)


def _tiny_data(tmp_path) -> str:
    animals = ["dog", "cat", "bird", "fish", "frog", "cow", "pig", "fox"]
    path = tmp_path / "tiny.jsonl"
    with open(path, "w") as f:
        for i in range(40):
            a = animals[i % len(animals)]
            rec = {
                "prompt": f"Tom saw a {a} number {i}.",
                "chosen": f" The {a} was happy.",
                "rejected": " It was bad.",
            }
            f.write(json.dumps(rec) + "\n")
    return str(path)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlhf_eqx", *args]


def _tail(path, n: int = 4000) -> str:
    with open(path) as f:
        return f.read()[-n:]


def _records(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def _step_records(path) -> list[dict]:
    return [r for r in _records(path) if "event" not in r and not r.get("eval")]


def _iteration(checkpoint: str | None) -> int | None:
    return None if checkpoint is None else int(os.path.basename(checkpoint)[len("iter_") :])


_TIMING = ("iteration_time_s", "tokens_per_s", "mfu")


def _without_timing(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if k not in _TIMING}


@contextlib.contextmanager
def _sigint_delivered():
    """Children started inside inherit a SIGINT that is not ignored (a test run started
    in the background may ignore it, and an ignored signal stays ignored across exec)."""
    old = signal.getsignal(signal.SIGINT)
    if old == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if old == signal.SIG_IGN:
            signal.signal(signal.SIGINT, old)


# --- kill -9 at random moments ----------------------------------------------------------


class _Server:
    """The fork server of `CHILD`: `run(**request)` forks one run and returns its report."""

    def __init__(self, script: str, env: dict):
        self.proc = subprocess.Popen(
            [sys.executable, script, "serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdout.readline().strip() == "ready"

    def run(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "the fork server ended"
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


STEPS = 60  # iterations of the run (one step and one checkpoint each)
KILLS = 22  # SIGKILLs before the run is let to finish
MAX_ATTEMPTS = 45
FSYNC_SLEEP = 0.05  # each checkpoint write lasts at least 2 x this


@pytest.mark.slow
def test_kill_9_at_random_moments_then_resume_is_bit_identical(tmp_path, jax_cache):
    t_start = time.monotonic()
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    server = _Server(_child_script(tmp_path), _env(jax_cache))
    run_dir, log = str(tmp_path / "run"), str(tmp_path / "runs.log")
    ck = os.path.join(run_dir, "sft", "checkpoints")
    common = dict(steps=STEPS, fsync_sleep=FSYNC_SLEEP, log=log, timeout=240.0)
    try:
        ref = server.run(
            run_dir=str(tmp_path / "reference"),
            out=str(tmp_path / "reference.eqx"),
            resume=False,
            **common,
        )
        assert ref["code"] == 0, _tail(log)
        # Seconds per iteration (a step and a slowed checkpoint write) once compiled.
        per_iter = (ref["wall"] - ref["first_checkpoint"]) / (STEPS - 1)
        first = ref["first_checkpoint"]  # from the fork to the first checkpoint written
        kills, in_write, attempts, history = 0, 0, 0, []
        while True:
            attempts += 1
            assert attempts <= MAX_ATTEMPTS, f"seed {seed}: {history}"
            done = _iteration(pl.tools.latest_checkpoint(ck)) or 0
            req = dict(run_dir=run_dir, out=str(tmp_path / "run.eqx"), resume=attempts > 1)
            if kills < KILLS:
                if attempts in (2, 3):
                    # Inside the resume's rewrite of config.json, then (the first run was
                    # killed after logging its last step, before its checkpoint was
                    # whole) inside the rewrite of metrics.jsonl that drops that step.
                    prefix = "config.json" if attempts == 2 else "metrics.jsonl"
                    on = dict(dir=run_dir, prefix=prefix, count=1, delay=0.01)
                    req.update(kill_on=on, kill_after=first + 2 * per_iter)
                elif attempts % 3 == 1 or STEPS - done < 12:
                    # Inside a checkpoint write: the k-th write this run starts, after a
                    # random part of its length (near the end, the first write only, so
                    # that the run cannot finish before every kill is made).
                    k = 1 if STEPS - done < 12 else rng.randint(1, 3)
                    delay = rng.uniform(0, 2 * FSYNC_SLEEP)
                    req.update(kill_on=dict(dir=ck, prefix="iter_", count=k, delay=delay))
                else:
                    # Anywhere: opening the run directory, restoring, compiling, a step,
                    # the metrics log, a checkpoint write, pruning.
                    req.update(kill_after=rng.uniform(0, first + 8 * per_iter))
            rep = server.run(**req, **common)
            assert not rep["timed_out"], f"seed {seed}: a run hung: {rep}"
            history.append(
                (
                    done,
                    None if rep["killed_at"] is None else round(rep["killed_at"], 2),
                    rep["partial_checkpoints"] + rep["partial_files"],
                )
            )
            if rep["first_checkpoint"] is not None:
                first = rep["first_checkpoint"]
            if rep["killed_at"] is None:
                assert rep["code"] == 0, _tail(log)
                break
            assert rep["code"] == -signal.SIGKILL, rep
            kills += 1
            in_write += bool(rep["partial_checkpoints"])
    finally:
        server.close()
    elapsed = time.monotonic() - t_start
    print(
        f"seed {seed}: {kills} kills ({in_write} inside a checkpoint write) in {attempts} "
        f"runs, {elapsed:.0f} s; (checkpoint at start, killed at s, partial files): {history}"
    )
    assert kills >= 20, f"seed {seed}: the run finished after {kills} kills: {history}"
    assert in_write >= 3, f"seed {seed}: {in_write} kills inside a checkpoint write: {history}"

    # The parameters and optimiser state are those of the uninterrupted run, bit for bit.
    assert (tmp_path / "run.eqx").read_bytes() == (tmp_path / "reference.eqx").read_bytes()

    # Every step logged exactly once, in order, with the uninterrupted run's values.
    steps = _step_records(os.path.join(run_dir, "metrics.jsonl"))
    assert [r["step"] for r in steps] == list(range(STEPS))
    assert [r["iteration"] for r in steps] == list(range(STEPS))  # one step an iteration
    ref_steps = _step_records(tmp_path / "reference" / "metrics.jsonl")
    assert [_without_timing(r) for r in steps] == [_without_timing(r) for r in ref_steps]
    events = [r["event"] for r in _records(os.path.join(run_dir, "metrics.jsonl")) if "event" in r]
    assert events and set(events) == {"resume"}

    # Nothing half-written is left, the run's last checkpoint is whole, the lock is gone.
    assert not [n for n in os.listdir(ck) if ".tmp" in n]
    assert _iteration(pl.tools.latest_checkpoint(ck)) == STEPS
    assert not os.path.exists(os.path.join(run_dir, ".lock"))
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == {"stopped": "done"}
    # Nor any other file a killed run was writing through a temporary.
    left = [
        os.path.relpath(os.path.join(d, n), run_dir)
        for d, dirs, files in os.walk(run_dir)
        for n in dirs + files
        if ".tmp" in n
    ]
    assert not left, f"half-written files left by killed runs: {left}"


# --- two runs, one directory ------------------------------------------------------------


@pytest.mark.slow
def test_a_second_run_into_a_held_directory_is_refused_and_the_first_is_unharmed(
    tmp_path, jax_cache
):
    run_dir = tmp_path / "run"
    data = _tiny_data(tmp_path)
    env = _env(jax_cache)
    holder_err = tmp_path / "holder.err"
    with open(holder_err, "w") as err:
        holder = subprocess.Popen(
            [
                sys.executable,
                _child_script(tmp_path),
                "hold",
                str(run_dir),
                str(tmp_path / "a"),
                "3",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
        )
    try:
        assert holder.stdout.readline().strip() == "held", holder_err.read_text()
        config = (run_dir / "config.json").read_bytes()
        before = sorted(os.listdir(run_dir))
        base = ["sft", "--data", data, "--out", str(run_dir), *CLI_SETTINGS]
        t0 = time.monotonic()
        others = [
            subprocess.Popen(
                _cli(*base, *extra),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
                cwd=tmp_path,
            )
            for extra in (["--resume"], [], ["--overwrite"])
        ]
        outs = [p.communicate(timeout=180) for p in others]
        refused_in = time.monotonic() - t0
        # All were refused (resume, new run, and --overwrite, which must never move a
        # live run aside) while the first run still held the directory (it waits for a
        # line on its stdin): they did not wait for the lock.
        assert holder.poll() is None
        for p, (out, err) in zip(others, outs):
            lines = err.strip().splitlines()
            assert p.returncode == 2, err
            assert len(lines) == 1, err
            assert f"in use by another run (process {holder.pid} on host" in lines[0]
        assert refused_in < 120
        assert (run_dir / "config.json").read_bytes() == config
        assert sorted(os.listdir(run_dir)) == before
        holder.stdin.write("go\n")
        holder.stdin.flush()
        assert holder.wait(timeout=180) == 0, holder_err.read_text()[-4000:]
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        holder.stdin.close()
        holder.stdout.close()
    # The first run completed as if alone.
    assert (run_dir / "config.json").read_bytes() == config
    steps = _step_records(run_dir / "metrics.jsonl")
    assert [(r["iteration"], r["step"]) for r in steps] == [(0, 0), (1, 1), (2, 2)]
    assert _iteration(pl.tools.latest_checkpoint(str(run_dir / "sft" / "checkpoints"))) == 3
    assert json.loads((run_dir / "summary.json").read_text()) == {"stopped": "done"}
    assert (tmp_path / "a").exists() and not (run_dir / ".lock").exists()


# --- a full disk ------------------------------------------------------------------------


@pytest.mark.slow
def test_a_full_disk_stops_the_run_with_one_line_and_keeps_earlier_checkpoints(tmp_path, jax_cache):
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)],
        capture_output=True,
        text=True,
    )
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a 2 MiB tmpfs: {(mount.stderr or mount.stdout).strip()}")
    try:
        # A checkpoint of the shipped model (LoRA and optimiser state included) is about
        # 1.6 MB: the first fits, the second cannot.
        run_dir = disk / "run"
        proc = subprocess.run(
            _cli(
                "sft",
                "--data",
                _tiny_data(tmp_path),
                "--out",
                str(run_dir),
                *CLI_SETTINGS,
                "--set",
                "sft.steps=4",
                "--set",
                "ops.checkpoint_every=1",
            ),
            capture_output=True,
            text=True,
            env=_env(jax_cache),
            cwd=tmp_path,
            timeout=300,
        )
        assert proc.returncode == 1, proc.stderr[-2000:]
        ck = run_dir / "sft" / "checkpoints"
        assert not [n for n in os.listdir(ck) if ".tmp" in n]
        latest = pl.tools.latest_checkpoint(str(ck))  # checks the checksum
        assert _iteration(latest) == 1
        assert json.loads((ck / "iter_00000001" / "meta.json").read_text())["steps"] == 1
        records = _records(run_dir / "metrics.jsonl")  # every line whole
        assert [r["step"] for r in records if "event" not in r][:2] == [0, 1]
        # the run's events (`[sft] truncation: ...`) aside, one line: the error
        lines = [x for x in proc.stderr.strip().splitlines() if not x.startswith("[sft] ")]
        assert len(lines) == 1, proc.stderr[-2000:]
        assert lines[0].startswith("error: no space left on the device of "), lines[0]
        assert str(run_dir) in lines[0]
        assert not (run_dir / ".lock").exists()
    finally:
        umount = subprocess.run(["umount", str(disk)], capture_output=True, text=True)
        if umount.returncode != 0:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)


# --- Ctrl-C -----------------------------------------------------------------------------


@pytest.mark.slow
def test_ctrl_c_checkpoints_prints_the_resume_command_and_it_finishes(tmp_path, jax_cache):
    run_dir = tmp_path / "run"
    ck = run_dir / "sft" / "checkpoints"
    env = _env(jax_cache)
    args = [
        "sft",
        "--data",
        _tiny_data(tmp_path),
        "--out",
        str(run_dir),
        *CLI_SETTINGS,
        "--set",
        "sft.steps=200",
        "--set",
        "ops.checkpoint_every=1",
    ]
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        with _sigint_delivered():
            proc = subprocess.Popen(_cli(*args), stdout=out, stderr=err, env=env, cwd=tmp_path)
        ready = lambda: ck.is_dir() and [n for n in os.listdir(ck) if ".tmp" not in n]  # noqa: E731
        code = signal_when(proc, ready, signal.SIGINT, log=tmp_path / "err.txt")
    stderr = (tmp_path / "err.txt").read_text()
    assert code == 130, stderr[-4000:]
    assert "Traceback" not in stderr
    (line,) = [x for x in stderr.splitlines() if x.startswith("interrupted:")]
    m = re.fullmatch(
        r"interrupted: sft at iteration (\d+)/200; checkpoint (\S+); resume with: (.*)", line
    )
    assert m, line
    at = int(m.group(1))
    assert 1 <= at < 200
    assert _iteration(m.group(2)) == at and os.path.isdir(m.group(2))
    command = shlex.split(m.group(3))
    assert command[0] == "rlhf_eqx" and command[-1] == "--resume"
    assert command[1:-1] == args

    resumed = subprocess.run(
        _cli(*command[1:]), capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    records = _records(run_dir / "metrics.jsonl")
    (resume,) = [r for r in records if r.get("event") == "resume"]
    assert resume["iteration"] == at and resume["step"] == at
    assert [r["step"] for r in records if "event" not in r and not r.get("eval")] == list(
        range(200)
    )
    assert json.loads((run_dir / "summary.json").read_text())["stopped"] == "done"
