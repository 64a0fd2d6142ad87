"""Run directories used as a Trainer user would use `output_dir`: `--out` naming a file or
an unwritable directory (one line naming it, exit status 2), two runs started into the
same new directory at once (the one refused leaves the other's directory alone), and a
checkpoint directory whose newest checkpoint is damaged (the run goes on from the older
whole one, which `keep` then never prunes in favour of the damaged one)."""

import dataclasses
import errno
import json
import os

import jax
import pytest
from helpers import quadratic_run

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
    link = tmp_path / "latest"
    link.symlink_to(tmp_path / "gone")
    assert main(_cli(link)) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {link} is a link to {tmp_path / 'gone'}, which does not exist, not a "
        "directory; choose a directory for the run (--out)"
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


def test_a_resume_past_a_damaged_checkpoint_sets_it_aside_and_keeps_the_whole_ones(
    tmp_path, capsys
):
    state, iteration = quadratic_run()
    log = pl.tools.MetricsLog(str(tmp_path), "q", quiet=True)
    ck = str(tmp_path / "ck")
    kw = dict(key=jax.random.key(0), log=log, checkpoint_dir=ck)
    ops = pl.OpsConfig(quiet=True, checkpoint_every=2, keep=3)
    pl.loop.run_iterations(state, iteration, num_iterations=6, ops=ops, **kw)
    assert sorted(os.listdir(ck)) == ["iter_00000002", "iter_00000004", "iter_00000006"]
    with open(os.path.join(ck, "iter_00000006", "state.eqx"), "r+b") as f:
        f.truncate(10)  # torn on the disk
    capsys.readouterr()
    # resumed with more iterations, a final checkpoint only and ops.keep=2: it goes on from
    # iteration 4, and the damaged 6 does not take the place of the whole 4
    ops = pl.OpsConfig(quiet=True, checkpoint_every=0, keep=2)
    pl.loop.run_iterations(state, iteration, num_iterations=8, ops=ops, resume=True, **kw)
    err = capsys.readouterr().err
    aside = os.path.join(ck, "iter_00000006.damaged")
    assert f"iter_00000006 (checksum mismatch); kept as {aside}" in err
    assert sorted(os.listdir(ck)) == ["iter_00000004", "iter_00000006.damaged", "iter_00000008"]
    assert pl.tools.latest_checkpoint(ck).endswith("iter_00000008")


def test_a_data_file_run_resumed_by_another_stage_command_is_refused(tmp_path):
    # `sft --data FILE --out RUN`, then `dpo --data FILE --out RUN --resume`: DPO on a
    # data file starts from model.source, so it would not continue the SFT run, only
    # replace its summary in the same directory
    data = tmp_path / "pairs.jsonl"
    data.write_text('{"prompt": "Tom saw a dog.", "chosen": " Hi.", "rejected": " No."}\n')
    run_dir = str(tmp_path / "run")

    def cfg(stage):
        c = pl.PipelineConfig(out=run_dir, stages=(stage,))
        return dataclasses.replace(c, data=dataclasses.replace(c.data, path=str(data)))

    with pl.tools.open_run_dir(cfg("sft"), run_dir):
        pl.tools.MetricsLog(run_dir, "sft", quiet=True).write({"iteration": 0, "step": 0})
    with open(os.path.join(run_dir, "config.json")) as f:
        stored = f.read()
    with pytest.raises(pl.loop.RunDirError) as e:
        pl.tools.open_run_dir(cfg("dpo"), run_dir, resume=True)
    assert str(e.value) == (
        f"{run_dir} holds a run of sft on a data file, which dpo does not continue (a stage "
        f"on a data file starts from model.source); choose another --out (--model {run_dir} "
        "trains from its exported policy)"
    )
    with open(os.path.join(run_dir, "config.json")) as f:
        assert f.read() == stored
    with pl.tools.open_run_dir(cfg("sft"), run_dir, resume=True) as rd:  # its own stage resumes
        assert rd.resume


def test_a_refused_resume_names_what_may_change_of_the_stages_it_runs(tmp_path):
    run_dir = str(tmp_path / "run")
    cfg = pl.PipelineConfig(out=run_dir, stages=("sft",))
    with pl.tools.open_run_dir(cfg, run_dir):
        pl.tools.MetricsLog(run_dir, "sft", quiet=True).write({"iteration": 0, "step": 0})
    seeded = dataclasses.replace(cfg, ops=dataclasses.replace(cfg.ops, seed=3))
    with pytest.raises(pl.loop.RunDirError) as e:
        pl.tools.open_run_dir(seeded, run_dir, resume=True)
    message = str(e.value)
    assert message.startswith(
        f"{run_dir}: cannot resume with a different configuration (ops.seed: 0 -> 3). Only "
        "iteration counts (sft.steps) and out, notes, stages, eval_samples, ops.quiet,"
    )
    assert "\n" not in message and "grpo." not in message and "dpo." not in message


def test_seeds_refuse_resume_with_overwrite_even_when_every_seed_finished(tmp_path):
    out = tmp_path / "seeds"
    cfg = pl.PipelineConfig(out=str(out))
    for seed in (0, 1):  # two finished seeds of this configuration
        seed_dir = out / f"seed-{seed}"
        seed_dir.mkdir(parents=True)
        ops = dataclasses.replace(cfg.ops, seed=seed)
        one = dataclasses.replace(cfg, out=str(seed_dir), ops=ops)
        (seed_dir / "config.json").write_text(json.dumps(pl.config.config_to_dict(one)))
        (seed_dir / "summary.json").write_text('{"stopped": "done"}')
    ran = []

    def run(c, **kw):
        ran.append(c)
        return {}

    with pytest.raises(pl.loop.RunDirError, match="^--resume and --overwrite exclude each other$"):
        pl.tools.run_seeds(cfg, 2, resume=True, overwrite=True, run=run)
    assert ran == [] and sorted(os.listdir(out)) == ["seed-0", "seed-1"]
    assert pl.tools.run_seeds(cfg, 2, resume=True, run=run)["seeds"] == [0, 1]
    assert ran == []  # both read back
