"""Run directories used as a Trainer user would use `output_dir`: `--out` naming a file or
an unwritable directory (one line naming it, exit status 2), two runs started into the
same new directory at once (the one refused leaves the other's directory alone), and a
checkpoint directory whose newest checkpoint is damaged (the run goes on from the older
whole one, which `keep` then never prunes in favour of the damaged one)."""

import errno
import os

import pytest

from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main


def _cli(out, *extra) -> list[str]:
    return ["sft", "--out", str(out), "--quiet", "--set", "sft.steps=2", *extra]


def test_out_naming_a_file_is_refused_in_one_line(tmp_path, capsys):
    file = tmp_path / "notes.txt"
    file.write_text("mine\n")
    assert main(_cli(file)) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: {file} is a file, not a directory; choose a directory for the run (--out)"
    )
    assert file.read_text() == "mine\n"
    assert main(_cli(file / "run")) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {file / 'run'} passes through a file, not a directory; choose a "
        "directory for the run (--out)"
    )


def test_an_unwritable_out_is_refused_in_one_line(tmp_path, monkeypatch):
    target = str(tmp_path / "locked" / "run")
    makedirs = os.makedirs

    def denied(path, *args, **kwargs):
        if str(path) == target:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return makedirs(path, *args, **kwargs)

    monkeypatch.setattr(os, "makedirs", denied)
    with pytest.raises(pl.loop.RunDirError) as e:
        pl.loop.RunLock(target)
    assert str(e.value) == (
        f"{target}: cannot write the run directory ({target}: permission denied); "
        "choose a writable --out"
    )


def test_a_run_refused_by_a_run_that_took_the_new_directory_first_leaves_it(tmp_path, monkeypatch):
    # Two runs into one new directory at once: both see no directory, the other one
    # takes the lock first, and this one is refused; the other's directory stays.
    out = tmp_path / "seeds"
    take = pl.loop.RunLock.__init__
    other = []

    def second(self, run_dir):
        if not other:  # the other run, a moment earlier
            other.append(object.__new__(pl.loop.RunLock))
            take(other[0], run_dir)
            (out / "config.json").write_text("{}")
        take(self, run_dir)

    monkeypatch.setattr(pl.loop.RunLock, "__init__", second)
    with pytest.raises(pl.loop.RunDirError, match="is in use by another run"):
        pl.tools.run_seeds(pl.PipelineConfig(out=str(out)), 2, run=lambda c, **kw: {})
    assert sorted(os.listdir(out)) == [".lock", "config.json"]
    other[0].release()
