"""Runs you can trust: the run directory has one owner, resume checks what it resumes,
counters and logs continue, divergence ends honestly, bad settings are named before
anything is loaded, and the command line says what happened."""

import dataclasses
import errno
import json
import math
import os
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import quadratic_iteration, quadratic_state

import rlhf_eqx as rx
from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main, resume_command

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _cfg(out, **kw):
    return dataclasses.replace(pl.animal_task_config(), out=str(out), **kw)


# --- one owner per run directory --------------------------------------------------------


def test_a_second_run_into_a_live_directory_refuses_naming_the_holder(tmp_path):
    # A real second process holds the directory.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import sys, time
                from rlhf_eqx.pipelines.loop import RunLock
                lock = RunLock({str(tmp_path)!r})
                print("held", flush=True)
                time.sleep(60)
                """
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(
            pl.loop.RunDirError, match=f"in use by another run \\(process {holder.pid}"
        ):
            pl.tools.open_run_dir(_cfg(tmp_path), str(tmp_path))
        assert not (tmp_path / "config.json").exists()  # nothing was written
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    # Killed with SIGKILL, the holder left its lock file: it is stale and taken over.
    assert (tmp_path / ".lock").exists()
    with pl.tools.open_run_dir(_cfg(tmp_path), str(tmp_path)) as rd:
        assert any(f"process {holder.pid}" in n for n in rd.notes)
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    assert not (tmp_path / ".lock").exists()


def test_a_new_run_into_an_old_one_refuses_and_overwrite_moves_it_aside(tmp_path):
    run = tmp_path / "run"
    with pl.tools.open_run_dir(_cfg(run), str(run)):
        (run / "metrics.jsonl").write_text('{"stage": "sft", "step": 0}\n')
    with pytest.raises(pl.loop.RunDirError, match="--resume.*--overwrite"):
        pl.tools.open_run_dir(_cfg(run, label_noise=0.2), str(run))
    assert json.loads((run / "config.json").read_text())["label_noise"] == 0.1
    with pl.tools.open_run_dir(_cfg(run, label_noise=0.2), str(run), overwrite=True) as rd:
        (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
        assert any(str(aside) in n for n in rd.notes)
    assert (aside / "metrics.jsonl").exists()  # nothing deleted
    assert json.loads((aside / "config.json").read_text())["label_noise"] == 0.1
    assert json.loads((run / "config.json").read_text())["label_noise"] == 0.2
    assert not (run / "metrics.jsonl").exists()


def test_pruning_never_removes_another_runs_later_checkpoints(tmp_path):
    d = str(tmp_path)
    tree = {"w": jnp.ones(3)}
    pl.tools.save_checkpoint(d, 40, tree, {}, keep=2)
    for i in range(1, 6):
        pl.tools.save_checkpoint(d, i, tree, {}, keep=2)
    assert sorted(os.listdir(d)) == ["iter_00000004", "iter_00000005", "iter_00000040"]


# --- resume checks what it resumes ------------------------------------------------------


def test_resume_refuses_a_changed_configuration_and_keeps_config_json(tmp_path):
    run = tmp_path / "run"
    with pl.tools.open_run_dir(_cfg(run), str(run)):
        (run / "metrics.jsonl").write_text("")
    stored = (run / "config.json").read_text()
    changed = dataclasses.replace(
        _cfg(run),
        dpo=dataclasses.replace(_cfg(run).dpo, beta=0.3),
        ops=dataclasses.replace(_cfg(run).ops, seed=1),
    )
    with pytest.raises(pl.loop.RunDirError) as e:
        pl.tools.open_run_dir(changed, str(run), resume=True)
    assert "dpo.beta: 0.1 -> 0.3" in str(e.value) and "ops.seed: 0 -> 1" in str(e.value)
    assert (run / "config.json").read_text() == stored
    # Operations settings and iteration counts may change.
    allowed = dataclasses.replace(
        _cfg(run),
        ops=dataclasses.replace(_cfg(run).ops, log_every=3, quiet=True),
        grpo=dataclasses.replace(_cfg(run).grpo, rollouts=20),
    )
    with pl.tools.open_run_dir(allowed, str(run), resume=True):
        assert json.loads((run / "config.json").read_text())["grpo"]["rollouts"] == 20


def test_a_changed_count_of_an_upstream_stage_is_refused(tmp_path):
    run = tmp_path / "run"
    with pl.tools.open_run_dir(_cfg(run), str(run)):
        pl.tools.save_checkpoint(
            str(run / "grpo" / "checkpoints"), 1, {"w": jnp.ones(2)}, {}, keep=1
        )
    more_sft = _cfg(run, sft=dataclasses.replace(_cfg(run).sft, steps=40))
    with pytest.raises(pl.loop.RunDirError, match="sft.steps changed 30 -> 40, but grpo"):
        pl.tools.open_run_dir(more_sft, str(run), resume=True)


def test_the_checkpointed_config_is_checked_by_the_loop(tmp_path):
    state, opt = quadratic_state()
    d = str(tmp_path / "ck")
    ops = pl.OpsConfig(quiet=True, checkpoint_every=1)
    log = pl.tools.MetricsLog(str(tmp_path), "q", quiet=True)
    kw = dict(key=jax.random.key(0), ops=ops, log=log, checkpoint_dir=d)
    meta = {"config": pl.config.config_to_dict(pl.animal_task_config())}
    pl.loop.run_iterations(state, quadratic_iteration(opt), num_iterations=3, meta=meta, **kw)
    other = pl.animal_task_config()
    other = dataclasses.replace(other, sft=dataclasses.replace(other.sft, batch_size=4))
    with pytest.raises(pl.loop.RunDirError, match="sft.batch_size: 16 -> 4"):
        pl.loop.run_iterations(
            state,
            quadratic_iteration(opt),
            num_iterations=3,
            meta={"config": pl.config.config_to_dict(other)},
            resume=True,
            **kw,
        )
    with pytest.raises(pl.loop.RunDirError, match="past the 2 iterations"):
        pl.loop.run_iterations(
            state, quadratic_iteration(opt), num_iterations=2, meta=meta, resume=True, **kw
        )


# --- counters and logs continue ---------------------------------------------------------


def test_resume_continues_step_and_writes_no_record_twice(tmp_path):
    state, opt = quadratic_state()
    d = str(tmp_path / "ck")
    ops = pl.OpsConfig(quiet=True, checkpoint_every=2, eval_every=2)
    log = pl.tools.MetricsLog(str(tmp_path), "q", quiet=True)
    kw = dict(num_iterations=8, key=jax.random.key(3), ops=ops, log=log, checkpoint_dir=d)
    evaluate = lambda s, i: {"w0": float(s.params["w"][0])}  # noqa: E731
    # Crash in iteration 5: iteration 4 was logged after the checkpoint at 4.
    with pytest.raises(RuntimeError):
        pl.loop.run_iterations(state, quadratic_iteration(opt, 5, 2), evaluate=evaluate, **kw)
    # A torn last line, as a crash mid-write leaves it.
    with open(log.path, "a") as f:
        f.write('{"stage": "q", "iter')
    log = pl.tools.MetricsLog(str(tmp_path), "q", quiet=True)  # repairs the torn line
    kw["log"] = log
    res = pl.loop.run_iterations(
        state, quadratic_iteration(opt, None, 2), evaluate=evaluate, resume=True, **kw
    )
    recs = _records(log.path)
    steps = [r["step"] for r in recs if "event" not in r and not r.get("eval")]
    assert steps == list(range(16))  # two steps an iteration, strictly increasing, once each
    iters = [r["iteration"] for r in recs if "event" not in r and not r.get("eval")]
    assert iters == [i for i in range(8) for _ in range(2)]
    assert [r["iteration"] for r in recs if r.get("eval")] == [2, 4, 6]
    assert res.history[0]["step"] == 8
    full = pl.loop.run_iterations(
        state,
        quadratic_iteration(opt, None, 2),
        num_iterations=8,
        key=jax.random.key(3),
        ops=ops,
        log=pl.tools.MetricsLog(str(tmp_path / "full"), "q", quiet=True),
    )
    np.testing.assert_array_equal(res.state.params["w"], full.state.params["w"])


def test_plot_tolerates_a_torn_last_line(tmp_path):
    lines = [
        json.dumps({"stage": "dpo", "iteration": i, "step": i, "loss": 1.0 / (i + 1)})
        for i in range(4)
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"stage": "dpo", "it')
    assert len(pl.tools.read_metrics(str(tmp_path))["dpo"]) == 4


def test_partial_checkpoints_left_by_a_crash_are_removed(tmp_path):
    run = tmp_path / "run"
    with pl.tools.open_run_dir(_cfg(run), str(run)):
        ck = run / "sft" / "checkpoints"
        pl.tools.save_checkpoint(str(ck), 1, {"w": jnp.ones(2)}, {}, keep=2)
        (ck / "iter_00000002.tmp999").mkdir()
        (run / "config.json.tmp999").write_text("{")
        (ck / "iter_00000002.tmp999" / "state.eqx").write_bytes(b"half")
    with pl.tools.open_run_dir(_cfg(run), str(run), resume=True) as rd:
        assert os.listdir(ck) == ["iter_00000001"]
        assert not (run / "config.json.tmp999").exists()
        assert any("partial file" in n for n in rd.notes)


def test_a_full_disk_names_the_directory_and_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    d = tmp_path / "ck"

    def full(f, tree):
        f.write(b"x" * 10)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(eqx, "tree_serialise_leaves", full)
    with pytest.raises(OSError, match=f"no space left on the device of {d}"):
        pl.tools.save_checkpoint(str(d), 3, {"w": jnp.ones(2)}, {}, keep=2)
    assert os.listdir(d) == []


# --- divergence ends honestly -----------------------------------------------------------


def test_divergence_rolls_back_to_a_verified_state_then_stops(tmp_path):
    # lr 1e3 ruins the weights at the first update: each rollback must land on the
    # starting state (the only one whose loss was measured finite and in range), and the
    # run ends "diverged" with finite weights once the rollbacks are spent.
    state, opt = quadratic_state(lr=1e3)
    log = pl.tools.MetricsLog(str(tmp_path), "q", quiet=True)
    ops = pl.OpsConfig(quiet=True, max_rollbacks=2, lr_backoff=10.0)
    res = pl.loop.run_iterations(
        state, quadratic_iteration(opt), num_iterations=6, key=jax.random.key(0), ops=ops, log=log
    )
    assert res.stopped == "diverged" and res.rollbacks == 2
    assert bool(jnp.all(jnp.isfinite(res.state.params["w"])))
    events = [r for r in _records(log.path) if "event" in r]
    assert [e["event"] for e in events] == ["rollback", "rollback", "diverged"]
    assert all(e["restored"] == 0 for e in events)
    steps = [r["step"] for r in _records(log.path) if "event" not in r]
    assert steps == sorted(set(steps))


def test_a_run_recovers_when_a_lower_rate_is_enough(tmp_path):
    state, opt = quadratic_state(lr=3.0)  # diverges at 3.0, converges at 0.3
    log = pl.tools.MetricsLog(str(tmp_path), "q", quiet=True)
    res = pl.loop.run_iterations(
        state,
        quadratic_iteration(opt),
        num_iterations=12,
        key=jax.random.key(0),
        ops=pl.OpsConfig(quiet=True),
        log=log,
    )
    assert res.stopped == "done" and res.rollbacks >= 1
    assert pl.loop.get_lr_scale(res.state.opt_state) == pytest.approx(0.1)
    assert all(math.isfinite(h["loss"]) for h in res.history)


def test_no_export_writes_non_finite_weights(tmp_path):
    cfg = rx.TransformerConfig(
        vocab_size=16, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=16, max_seq_len=8
    )
    policy = rx.Policy(cfg, key=jax.random.key(0))
    bad = eqx.tree_at(lambda p: p.lm_head, policy, policy.lm_head.at[0, 0].set(jnp.nan))
    with pytest.raises(ValueError, match="lm_head has non-finite values"):
        pl.runs.export_policy(bad, str(tmp_path), "dpo")
    assert not (tmp_path / "dpo" / "hf").exists()


# --- validation where the values live ---------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["dpo.loss_type=bogus"], "dpo.loss_type='bogus': unknown loss_type 'bogus'; expected"),
        (["data.format=xml"], "data.format='xml': must be one of auto, hh"),
        (["ops.max_rollbacks=-1"], "ops.max_rollbacks=-1: must be >= 0"),
        (["ops.seed=-3"], "ops.seed=-3: must be >= 0"),
        (["ops.log_every=0"], "ops.log_every=0: must be >= 1"),
        (["reward.eval_every=-1"], "reward.eval_every=-1: must be >= 0"),
    ],
)
def test_bad_settings_are_refused_by_the_library_before_loading(tmp_path, overrides, message):
    # a train record's setting is refused when the config is built, the others by the run
    with pytest.raises(pl.ConfigError, match=message.replace("(", r"\(")):
        pl.run_pipeline(pl.apply_overrides(_cfg(tmp_path / "run"), overrides))
    assert not (tmp_path / "run").exists()  # nothing loaded, nothing written


def test_show_config_refuses_a_bogus_loss_type(capsys):
    assert main(["dpo", "--set", "dpo.loss_type=bogus", "--show-config"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "dpo.loss_type='bogus'" in err[0] and "sigmoid" in err[0]


def test_each_stage_checks_its_own_settings():
    sft = pl.SFTConfig(batch_size=0)
    with pytest.raises(pl.ConfigError, match="sft.batch_size=0"):
        pl.config.validate_stage("sft", sft)
    with pytest.raises(pl.ConfigError, match="grpo.group_size=1"):
        pl.config.validate_stage("grpo", pl.GRPOConfig(group_size=1))


# --- the command line -------------------------------------------------------------------


def test_stage_help_lists_its_fields_with_defaults(capsys):
    assert main(["dpo", "--help"]) == 0
    out = capsys.readouterr().out
    assert "dpo.beta = 0.1" in out and "dpo.loss_type = sigmoid" in out
    assert "sampling.max_new_tokens = 40" in out and "ops.max_rollbacks = 3" in out
    assert "ppo.vf_coef" not in out


def test_the_resume_command_is_the_original_one_with_resume():
    assert resume_command(["dpo", "--data", "a b.jsonl", "--overwrite"]) == (
        "rlhf_eqx dpo --data 'a b.jsonl' --resume"
    )


def test_run_dir_errors_are_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    with pl.tools.open_run_dir(_cfg(run), str(run)):
        (run / "metrics.jsonl").write_text("")
    assert main(["--out", str(run), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds a run" in err[0] and "--resume" in err[0]
