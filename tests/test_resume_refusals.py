"""A resume that cannot continue is refused before anything in the run directory changes
(an iteration count below the latest checkpoint, step records missing before it), and
the run's metrics reach the device before each checkpoint that counts on them."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import quadratic_iteration, quadratic_state

from rlhf_eqx import pipelines as pl


def _cfg(run_dir, steps: int) -> pl.PipelineConfig:
    cfg = pl.PipelineConfig(stages=("sft",), out=str(run_dir))
    return dataclasses.replace(cfg, sft=dataclasses.replace(cfg.sft, steps=steps))


def _run(run_dir, steps: int, *, resume: bool = False, fail_at=None, data=None):
    """An SFT-like stage of `steps` iterations in `run_dir` through the run-directory layer
    (`open_run_dir`, then the loop with the stage's checkpoints and the run's log);
    `data`: the configuration's `data.path`."""
    cfg = _cfg(run_dir, steps)
    if data is not None:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=data))
    state, opt = quadratic_state()
    with pl.tools.open_run_dir(cfg, str(run_dir), resume=resume) as rd:
        return pl.loop.run_iterations(
            state,
            quadratic_iteration(opt, fail_at),
            num_iterations=steps,
            key=jax.random.key(3),
            ops=pl.OpsConfig(quiet=True, checkpoint_every=1, keep=2),
            log=pl.tools.MetricsLog(str(run_dir), "sft", quiet=True),
            checkpoint_dir=os.path.join(str(run_dir), "sft", "checkpoints"),
            resume=rd.resume,
            meta={"stage": "sft", "config": pl.config.config_to_dict(cfg)},
        )


def _snapshot(root) -> dict[str, bytes]:
    """Every file under `root` (relative path -> bytes)."""
    out = {}
    for d, _, files in os.walk(root):
        for n in files:
            path = os.path.join(d, n)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out


def _steps(run_dir) -> list[int]:
    with open(os.path.join(str(run_dir), "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [r["step"] for r in records if "event" not in r and not r.get("eval")]


def _interrupted(tmp_path, steps=6, at=4):
    """A run of `steps` iterations stopped by a crash in iteration `at` (checkpoints of
    every iteration before it), and the uninterrupted run's final state."""
    full = _run(tmp_path / "full", steps)
    run_dir = tmp_path / "run"
    with pytest.raises(RuntimeError, match="crash"):
        _run(run_dir, steps, fail_at=at)
    assert _steps(run_dir) == list(range(at))
    return run_dir, full


def test_a_resume_with_fewer_steps_than_the_checkpoint_changes_nothing(tmp_path):
    run_dir, full = _interrupted(tmp_path)
    before = _snapshot(run_dir)
    with pytest.raises(pl.loop.RunDirError, match="at iteration 4, past the 3 iterations of sft"):
        _run(run_dir, 3, resume=True)
    assert _snapshot(run_dir) == before  # config.json included, byte for byte
    # The right count afterwards continues exactly.
    res = _run(run_dir, 6, resume=True)
    assert _steps(run_dir) == list(range(6))
    np.testing.assert_array_equal(res.state.params["w"], full.state.params["w"])
    stored = json.loads((run_dir / "config.json").read_text())
    assert stored["sft"]["steps"] == 6


def test_a_resume_with_fewer_steps_is_refused_by_open_run_dir_alone(tmp_path):
    run_dir, _ = _interrupted(tmp_path)
    before = _snapshot(run_dir)
    with pytest.raises(pl.loop.RunDirError, match="past the 2 iterations of sft"):
        pl.tools.open_run_dir(_cfg(run_dir, 2), str(run_dir), resume=True)
    assert _snapshot(run_dir) == before
    assert not (run_dir / ".lock").exists()
    # a count at the checkpoint or past it is accepted
    with pl.tools.open_run_dir(_cfg(run_dir, 4), str(run_dir), resume=True) as rd:
        assert rd.resume


def test_a_checkpoint_of_a_run_stopped_early_is_not_refused_for_its_count(tmp_path):
    run_dir = tmp_path / "run"
    with pl.tools.open_run_dir(_cfg(run_dir, 10), str(run_dir)):
        meta = {"stage": "sft", "steps": 0, "stopped": "kl_guard", "num_iterations": 10}
        meta["config"] = pl.config.config_to_dict(_cfg(run_dir, 10))
        ck = str(run_dir / "sft" / "checkpoints")
        pl.tools.save_checkpoint(ck, 8, {"w": jnp.ones(2)}, meta, keep=2)
    with pl.tools.open_run_dir(_cfg(run_dir, 5), str(run_dir), resume=True) as rd:
        assert rd.resume


def _remove_steps(run_dir, gone: set[int]) -> None:
    path = os.path.join(str(run_dir), "metrics.jsonl")
    with open(path) as f:
        lines = f.readlines()
    kept = [x for x in lines if json.loads(x).get("step") not in gone or "event" in x]
    with open(path, "w") as f:
        f.writelines(kept)


def test_step_lines_removed_before_the_checkpoint_are_refused_naming_file_and_steps(tmp_path):
    run_dir, full = _interrupted(tmp_path)
    _remove_steps(run_dir, {1, 2})
    before = _snapshot(run_dir)
    metrics = os.path.join(str(run_dir), "metrics.jsonl")
    with pytest.raises(pl.loop.RunDirError) as e:
        _run(run_dir, 6, resume=True)
    assert str(e.value).startswith(f"{metrics}: ")
    assert "lack step(s) 1-2" in str(e.value)
    assert _snapshot(run_dir) == before


def test_a_step_line_copied_by_hand_is_refused_naming_the_step(tmp_path):
    run_dir, _ = _interrupted(tmp_path)
    path = os.path.join(str(run_dir), "metrics.jsonl")
    with open(path) as f:
        lines = f.readlines()
    (third,) = [x for x in lines if json.loads(x).get("step") == 2 and "event" not in x]
    with open(path, "a") as f:
        f.write(third)
    before = _snapshot(run_dir)
    with pytest.raises(pl.loop.RunDirError, match=r"hold step\(s\) 2 more than once"):
        _run(run_dir, 6, resume=True)
    assert _snapshot(run_dir) == before


def test_the_loop_alone_refuses_missing_step_lines(tmp_path):
    # A run resumed without the run-directory layer (a stage function with a resuming
    # `RunContext`) is refused by its loop.
    state, opt = quadratic_state()
    kw = dict(
        num_iterations=5,
        key=jax.random.key(3),
        ops=pl.OpsConfig(quiet=True, checkpoint_every=1),
        log=pl.tools.MetricsLog(str(tmp_path), "q", quiet=True),
        checkpoint_dir=str(tmp_path / "ck"),
    )
    with pytest.raises(RuntimeError, match="crash"):
        pl.loop.run_iterations(state, quadratic_iteration(opt, fail_at=3), **kw)
    _remove_steps(tmp_path, {0})
    with pytest.raises(pl.loop.RunDirError, match=r"metrics\.jsonl: .* lack step\(s\) 0;"):
        pl.loop.run_iterations(state, quadratic_iteration(opt), resume=True, **kw)


def test_the_metrics_are_on_the_device_before_each_checkpoint_commits(tmp_path, monkeypatch):
    # A power cut cannot be made here; what is checked is the order of the calls: the
    # metrics file (and, once, its directory) is flushed after its last line and before
    # the rename that makes a checkpoint, and the rename itself is flushed.
    run_dir = str(tmp_path / "run")
    metrics = os.path.join(run_dir, "metrics.jsonl")
    ck = os.path.join(run_dir, "sft", "checkpoints")
    events = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        size = os.path.getsize(path) if path == metrics else None
        events.append(("fsync", path, size))
        real_fsync(fd)

    def rename(src, dst):
        real_rename(src, dst)
        if os.path.dirname(dst) == ck and ".tmp" not in os.path.basename(dst):
            events.append(("commit", dst, os.path.getsize(metrics)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    _run(run_dir, 3)
    commits = [i for i, e in enumerate(events) if e[0] == "commit"]
    assert [os.path.basename(events[i][1]) for i in commits] == [f"iter_{n:08d}" for n in (1, 2, 3)]
    previous = 0
    for i in commits:
        size = events[i][2]
        synced = [e for e in events[previous:i] if e[:2] == ("fsync", metrics)]
        assert synced and synced[-1][2] == size  # flushed with every line before it
        assert ("fsync", ck, None) in events[i + 1 :]  # the rename flushed
        previous = i
    assert ("fsync", run_dir, None) in events[: commits[0]]  # the file's entry
    # Once per checkpoint, not per line (one step line an iteration here).
    assert sum(e[:2] == ("fsync", metrics) for e in events) == 3


@pytest.mark.parametrize(
    ("stage", "at", "refused", "accepted"),
    [
        ("online-dpo", 3, {"rounds": 2}, {"steps": 5}),  # online DPO counts rounds
        ("dpo", 10, {"steps": 5}, {"rounds": 1}),  # offline DPO counts steps
    ],
)
def test_a_stage_with_two_counts_is_checked_against_the_one_its_loop_ran(
    tmp_path, stage, at, refused, accepted
):
    run_dir = tmp_path / "run"
    base = pl.animal_task_config()
    cfg = dataclasses.replace(base, out=str(run_dir), stages=("sft", stage))
    with pl.tools.open_run_dir(cfg, str(run_dir)):
        d = pl.config.config_to_dict(cfg)
        count = cfg.dpo.rounds if stage == "online-dpo" else cfg.dpo.steps
        meta = {"stage": stage, "config": d, "num_iterations": count}
        ck = str(run_dir / stage / "checkpoints")
        pl.tools.save_checkpoint(ck, at, {"w": jnp.ones(2)}, meta, keep=2)

    def changed(**kw):
        return dataclasses.replace(cfg, dpo=dataclasses.replace(cfg.dpo, **kw))

    with pytest.raises(pl.loop.RunDirError, match=f"past the .* iterations of {stage}"):
        pl.tools.open_run_dir(changed(**refused), str(run_dir), resume=True)
    with pl.tools.open_run_dir(changed(**accepted), str(run_dir), resume=True) as rd:
        assert rd.resume


# --- a directory of several runs is no single run's, and the reverse ----------------------


def _fake_many(root, kind: str) -> None:
    """A sweep's directory (`sweep.json`, its members' logs) or a run's over several seeds
    (`seed-<seed>/` run directories)."""
    member = root / ("members/lr=0.1,seed=0" if kind == "sweep" else "seed-0")
    member.mkdir(parents=True)
    (member / "metrics.jsonl").write_text('{"stage": "sft", "iteration": 0, "step": 0}\n')
    if kind == "sweep":
        (root / "sweep.json").write_text('{"stage": "sft"}')


@pytest.mark.parametrize(
    ("kind", "what"), [("sweep", "a sweep"), ("seeds", "a run over several seeds")]
)
def test_a_single_run_into_a_directory_of_several_runs_is_refused(tmp_path, kind, what):
    root = tmp_path / "many"
    _fake_many(root, kind)
    before = _snapshot(root)
    for resume in (False, True):
        with pytest.raises(pl.loop.RunDirError, match=f"holds {what}, not a single run"):
            pl.tools.open_run_dir(_cfg(root, 3), str(root), resume=resume)
        assert _snapshot(root) == before
    # --overwrite moves it aside, as it does a run
    with pl.tools.open_run_dir(_cfg(root, 3), str(root), overwrite=True) as rd:
        assert any("moved the previous run" in n for n in rd.notes)
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("many.replaced-")]
    assert _snapshot(aside) == before


def test_a_sweep_into_a_single_runs_directory_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    _run(run_dir, 2)
    before = _snapshot(run_dir)
    with pytest.raises(pl.loop.RunDirError, match="holds a run, not a sweep"):
        pl.sweep("sft", pl.animal_task_config(), seeds=1, out=str(run_dir))
    assert _snapshot(run_dir) == before


def test_a_run_over_several_seeds_into_a_sweep_s_directory_is_refused(tmp_path):
    root = tmp_path / "many"
    _fake_many(root, "sweep")
    before = _snapshot(root)
    cfg = dataclasses.replace(pl.animal_task_config(), out=str(root))
    for resume in (False, True):
        with pytest.raises(pl.loop.RunDirError, match="holds a sweep; choose another --out"):
            pl.tools.run_seeds(cfg, 2, resume=resume)
    assert _snapshot(root) == before


@pytest.mark.parametrize("out", [".", "..", "inner/.."])
def test_overwrite_refuses_to_move_the_working_directory_aside(tmp_path, monkeypatch, out):
    run_dir = tmp_path / "run"
    _run(run_dir, 2)
    (run_dir / "inner").mkdir()
    monkeypatch.chdir(run_dir / "inner" if out == ".." else run_dir)
    before = _snapshot(run_dir)
    with pytest.raises(pl.loop.RunDirError, match="cannot move .* aside: it holds the working"):
        pl.tools.open_run_dir(_cfg(out, 2), out, overwrite=True)
    assert _snapshot(run_dir) == before  # nothing moved, no lock left
    assert not [p for p in tmp_path.iterdir() if ".replaced-" in p.name]


# --- a changed data file or model is refused before anything changes ---------------------


def _data_run(tmp_path):
    """A data-file run's directory as a run leaves it: its data and model fingerprints,
    the data-quality event every start writes again, steps."""
    data = tmp_path / "pairs.jsonl"
    rec = {"prompt": "Tom saw a dog.", "chosen": " It ran.", "rejected": " No."}
    data.write_text(json.dumps(rec) + "\n")
    run_dir = tmp_path / "run"
    cfg = _cfg(run_dir, 3)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(data)))
    with pl.tools.open_run_dir(cfg, str(run_dir)):
        pl.tools.check_data(str(run_dir), str(data), resume=False)
        pl.tools.check_model(str(run_dir), "builtin", None, resume=False)
        log = pl.tools.MetricsLog(str(run_dir), "sft", quiet=True)
        log.write({"event": "data_quality", "message": "1 pair"})
        for step in range(2):
            log.write({"iteration": step, "step": step, "loss": 1.0})
    return cfg, data, run_dir


def test_a_data_path_written_another_way_resumes(tmp_path, monkeypatch):
    """A run started with a relative `data.path` resumes with the absolute path of the
    same file (or through a link to it), exactly; another file at another path, even of
    the same contents, is refused."""
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"prompt": "Tom saw a dog.", "chosen": " Hi.", "rejected": " No."}))
    (tmp_path / "link.jsonl").symlink_to(data)
    (tmp_path / "copy.jsonl").write_text(data.read_text())

    full = _run(tmp_path / "full", 4, data="pairs.jsonl")
    for n, path in enumerate((str(data), "./link.jsonl")):
        cut = tmp_path / f"cut{n}"
        with pytest.raises(RuntimeError, match="crash"):
            _run(cut, 4, fail_at=2, data="pairs.jsonl")
        resumed = _run(cut, 4, resume=True, data=path)
        np.testing.assert_array_equal(resumed.state.params["w"], full.state.params["w"])
    with pytest.raises(RuntimeError, match="crash"):
        _run(tmp_path / "cut2", 4, fail_at=2, data="pairs.jsonl")
    with pytest.raises(pl.loop.RunDirError, match="data.path: 'pairs.jsonl' -> 'copy.jsonl'"):
        _run(tmp_path / "cut2", 4, resume=True, data="copy.jsonl")


def test_a_resume_on_a_changed_data_file_changes_nothing(tmp_path):
    cfg, data, run_dir = _data_run(tmp_path)
    data.write_text(data.read_text().replace("dog", "cat"))  # same size, other contents
    before = _snapshot(run_dir)
    with pytest.raises(pl.loop.RunDirError, match="the data file .* changed since the run"):
        pl.tools.open_run_dir(cfg, str(run_dir), resume=True)
    assert _snapshot(run_dir) == before  # the data-quality event kept, config.json as it was
    data.write_text(data.read_text().replace("cat", "dog"))
    with pl.tools.open_run_dir(cfg, str(run_dir), resume=True) as rd:
        assert rd.resume


def test_a_resume_on_changed_model_files_changes_nothing(tmp_path):
    cfg, _, run_dir = _data_run(tmp_path)
    recorded = json.loads((run_dir / "model.json").read_text())
    (run_dir / "model.json").write_text(json.dumps(dict(recorded, sha256="0" * 64)))
    before = _snapshot(run_dir)
    with pytest.raises(pl.loop.RunDirError, match="the model .* changed since the run"):
        pl.tools.open_run_dir(cfg, str(run_dir), resume=True)
    assert _snapshot(run_dir) == before
