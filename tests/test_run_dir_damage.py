"""Run directories a crash, a full disk or a hand edit left damaged: what a resume and a
checkpoint write make of them."""

import errno
import os
import types

import equinox as eqx
import jax.numpy as jnp
import pytest

from rlhf_eqx import pipelines as pl


def test_a_short_write_on_a_full_disk_is_named_as_such_and_the_old_checkpoint_kept(
    tmp_path, monkeypatch
):
    # numpy reports a write cut short by a full disk as `OSError: N requested and M
    # written` (no errno), wrapped by equinox; the space it filled is freed when the
    # partial checkpoint is removed, so the device must be asked before that.
    d = str(tmp_path / "ck")
    tree = {"w": jnp.arange(1000.0)}
    pl.tools.save_checkpoint(d, 1, tree, {}, keep=2)
    real_statvfs = os.statvfs

    def partial_files() -> bool:
        return any(".tmp" in n for n in os.listdir(d))

    def statvfs(path):
        st = real_statvfs(path)
        free = 0 if partial_files() else 1 << 40
        return types.SimpleNamespace(f_bavail=free, f_frsize=st.f_frsize)

    def short_write(f, pytree):
        f.write(b"x" * 100)
        try:
            raise OSError("4000 requested and 100 written")
        except OSError as e:
            raise RuntimeError("Error at leaf with path ('w',)") from e

    monkeypatch.setattr(os, "statvfs", statvfs)
    monkeypatch.setattr(eqx, "tree_serialise_leaves", short_write)
    with pytest.raises(OSError) as e:
        pl.tools.save_checkpoint(d, 2, tree, {}, keep=2)
    assert e.value.errno == errno.ENOSPC
    assert str(e.value) == f"no space left on the device of {d} (checkpoint not written)"
    assert sorted(os.listdir(d)) == ["iter_00000001"]
    assert pl.tools.latest_checkpoint(d).endswith("iter_00000001")


def _started_run(run_dir: str) -> pl.PipelineConfig:
    cfg = pl.PipelineConfig(stages=("sft",), out=run_dir)
    with pl.tools.open_run_dir(cfg, run_dir):
        log = pl.tools.MetricsLog(run_dir, "sft", quiet=True)
        for step in range(3):
            log.write({"iteration": step, "step": step, "loss": 1.0})
    return cfg


@pytest.mark.parametrize("line", ["garbage\n", '{"stage": "sft", "ste\n', "[1, 2]\n"])
def test_a_resume_refuses_a_metrics_line_that_is_not_a_record_naming_it(tmp_path, line):
    # Such a line (a hand edit) would otherwise let the resumed run train to its end and
    # then fail reading the log back for its plots.
    run_dir = str(tmp_path / "run")
    cfg = _started_run(run_dir)
    path = os.path.join(run_dir, "metrics.jsonl")
    with open(path) as f:
        lines = f.readlines()
    lines.insert(2, line)
    with open(path, "w") as f:
        f.writelines(lines)
    before = (tmp_path / "run" / "config.json").read_text()
    with pytest.raises(pl.loop.RunDirError, match=r"metrics\.jsonl:3: not a? ?JSON"):
        pl.tools.open_run_dir(cfg, run_dir, resume=True)
    assert (tmp_path / "run" / "config.json").read_text() == before
    assert not os.path.exists(os.path.join(run_dir, ".lock"))  # released
    lines.pop(2)
    with open(path, "w") as f:
        f.writelines(lines)
    with pl.tools.open_run_dir(cfg, run_dir, resume=True) as rd:
        assert rd.resume


def test_a_resume_still_cuts_a_torn_last_line(tmp_path):
    run_dir = str(tmp_path / "run")
    cfg = _started_run(run_dir)
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        f.write('{"stage": "sft", "iter')
    with pl.tools.open_run_dir(cfg, run_dir, resume=True) as rd:
        assert any("torn last line" in n for n in rd.notes)


def test_a_crash_while_pruning_leaves_no_half_removed_checkpoint(tmp_path, monkeypatch):
    import shutil

    d = str(tmp_path / "ck")
    tree = {"w": jnp.arange(10.0)}
    for i in (1, 2):
        pl.tools.save_checkpoint(d, i, tree, {}, keep=2)
    real_rmtree = shutil.rmtree

    def killed_midway(path, ignore_errors=False):  # the first file goes, then the crash
        os.remove(os.path.join(path, sorted(os.listdir(path))[0]))
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        pl.tools.save_checkpoint(d, 3, tree, {}, keep=2)
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    left = sorted(os.listdir(d))
    assert [n for n in left if ".tmp" not in n] == ["iter_00000002", "iter_00000003"]
    pl.tools.save_checkpoint(d, 4, tree, {}, keep=2)  # removes what the crash left
    assert sorted(os.listdir(d)) == ["iter_00000003", "iter_00000004"]


def test_a_resume_drops_the_events_of_no_iteration_which_every_run_writes_again(tmp_path):
    # A stage writes them as it prepares its data (`kto_weights`, `no_validation`, ...)
    # or ends (`reward_selection`): kept, each resume would add one more of each.
    run_dir = str(tmp_path / "run")
    cfg = _started_run(run_dir)
    log = pl.tools.MetricsLog(run_dir, "kto", quiet=True)
    log.event("kto_weights", "outside the recommended range", ratio=2.0)
    log.write({"event": "reward_selection", "message": "kept step 3", "selected_step": 3})
    log.event("rollback", "loss spiked", iteration=1, step=1)
    with pl.tools.open_run_dir(cfg, run_dir, resume=True):
        pass
    records = pl.tools.read_records(run_dir)
    assert [r.get("event") for r in records] == [None, None, None, "rollback"]


@pytest.mark.parametrize("kind", ["file", "damaged"])
def test_a_checkpoint_replaces_whatever_holds_its_name(tmp_path, kind):
    d = tmp_path / "ck"
    tree = {"w": jnp.arange(10.0)}
    pl.tools.save_checkpoint(str(d), 1, tree, {}, keep=3)
    if kind == "file":
        (d / "iter_00000002").write_text("not a checkpoint")
    else:
        (d / "iter_00000002").mkdir()
        (d / "iter_00000002" / "state.eqx").write_bytes(b"torn")
    pl.tools.save_checkpoint(str(d), 2, tree, {}, keep=3)
    assert sorted(os.listdir(d)) == ["iter_00000001", "iter_00000002"]
    latest = pl.tools.latest_checkpoint(str(d))
    assert latest.endswith("iter_00000002")
    restored, _ = pl.tools.restore_checkpoint(latest, tree)
    assert bool((restored["w"] == tree["w"]).all())


def test_a_lock_released_while_it_is_taken_is_taken_on_the_file_others_see(tmp_path, monkeypatch):
    # The holder removes `.lock` as it releases it; a run that opened the file just
    # before must not end up holding a lock on the removed file, which a third run
    # would not see (two runs in one directory).
    import fcntl

    run_dir = str(tmp_path / "run")
    path = os.path.join(run_dir, ".lock")
    real_flock = fcntl.flock
    calls = []

    def released_meanwhile(fd, op):
        if not calls:
            os.remove(path)
        calls.append(op)
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", released_meanwhile)
    cfg = pl.PipelineConfig(stages=("sft",), out=run_dir)
    with pl.tools.open_run_dir(cfg, run_dir):
        monkeypatch.setattr(fcntl, "flock", real_flock)
        with pytest.raises(pl.loop.RunDirError, match="in use by another run"):
            pl.tools.open_run_dir(cfg, run_dir)


def test_a_write_refused_on_a_nearly_full_device_is_not_called_a_full_disk(tmp_path, monkeypatch):
    # a permission error (an errno other than ENOSPC) is what it is, however little the
    # device has free; the previous checkpoint stays
    d = str(tmp_path / "ck")
    tree = {"w": jnp.arange(10.0)}
    pl.tools.save_checkpoint(d, 1, tree, {}, keep=2)
    monkeypatch.setattr(os, "statvfs", lambda p: types.SimpleNamespace(f_bavail=0, f_frsize=4096))

    def refused(f, pytree):
        try:
            raise PermissionError(errno.EACCES, "Permission denied")
        except OSError as e:
            raise RuntimeError("Error at leaf with path ('w',)") from e

    monkeypatch.setattr(eqx, "tree_serialise_leaves", refused)
    with pytest.raises(RuntimeError, match="Error at leaf") as e:
        pl.tools.save_checkpoint(d, 2, tree, {}, keep=2)
    assert isinstance(e.value.__cause__, PermissionError)
    assert sorted(os.listdir(d)) == ["iter_00000001"]
