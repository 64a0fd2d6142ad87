"""Exact resume: a run killed with SIGKILL mid-way and resumed from its last checkpoint
ends with parameters bit-identical to an uninterrupted run with the same seed."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from rlhf_eqx import pipelines as pl

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))

SCRIPT = textwrap.dedent(
    """
    import sys, time
    import equinox as eqx, jax
    import rlhf_eqx as rx
    from rlhf_eqx import pipelines as pl
    from rlhf_eqx.assets import asset_path

    ckpt, out, resume, pause = sys.argv[1], sys.argv[2], sys.argv[3] == "1", float(sys.argv[4])
    tok = rx.data.load_tokenizer(asset_path("tok512.bin"))
    cfg = rx.TransformerConfig(vocab_size=512, d_model=16, n_layers=1, n_heads=2,
                               n_kv_heads=1, d_ff=32, max_seq_len=64)
    policy = rx.Policy(cfg, key=jax.random.key(0))
    records = [("Once upon a time", " a dog ran."), ("The cat", " sat on a mat."),
               ("Lily saw", " a big red ball."), ("Tom had", " a little fish.")] * 3
    sft = pl.SFTConfig(steps=10, batch_size=4, max_length=24,
                       optim=rx.train.OptimizerSettings(learning_rate=1e-2, warmup_ratio=0.1),
                       lora=pl.LoRASettings(rank=4, alpha=8.0, dropout=0.1))
    ops = pl.OpsConfig(quiet=True, checkpoint_every=1, keep=3, seed=3)
    ctx = pl.RunContext(ops=ops, log=pl.tools.MetricsLog(ckpt, "sft", quiet=True),
                        key=jax.random.key(7), checkpoint_dir=ckpt, resume=resume,
                        prompt_length=12)
    if pause:
        step = rx.train.TrainState.apply
        def slow(self, *a, **k):
            time.sleep(pause)
            return step(self, *a, **k)
        rx.train.TrainState.apply = slow
    res = pl.runs.run_sft(policy, tok, records, cfg=sft, ctx=ctx)
    eqx.tree_serialise_leaves(out, res.state)
    """
)


def _run(tmp_path, name, resume, pause, **kw):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = [
        sys.executable,
        str(script),
        str(tmp_path / name),
        str(tmp_path / f"{name}.eqx"),
        "1" if resume else "0",
        str(pause),
    ]
    return subprocess.Popen(args, env=env, **kw)


@pytest.mark.slow
def test_kill_9_then_resume_is_bit_identical(tmp_path):
    assert _run(tmp_path, "full", False, 0.0).wait(timeout=300) == 0

    proc = _run(tmp_path, "killed", False, 0.5)
    ckpt = str(tmp_path / "killed")
    deadline = time.time() + 300
    while time.time() < deadline:
        latest = pl.tools.latest_checkpoint(ckpt)
        if latest is not None and int(latest[-8:]) >= 4:
            break
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert not (tmp_path / "killed.eqx").exists()
    assert int(pl.tools.latest_checkpoint(ckpt)[-8:]) < 10

    assert _run(tmp_path, "killed", True, 0.0).wait(timeout=300) == 0
    with open(os.path.join(ckpt, "metrics.jsonl")) as f:
        assert '"event": "resume"' in f.read()  # it continued; it did not start over
    full = (tmp_path / "full.eqx").read_bytes()
    resumed = (tmp_path / "killed.eqx").read_bytes()
    assert full == resumed
