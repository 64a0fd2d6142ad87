"""A resumed run whose data file or model moved (renamed, or another path to the same
bytes: the size and SHA-256 recorded in `data.json` / `model.json`) goes on, saying so in
one line and recording the new path; one whose contents at the new path differ is refused
naming both paths, before anything in the run directory changes."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
from helpers import quadratic_iteration, quadratic_state

from rlhf_eqx import pipelines as pl


def _run(run_dir, steps, *, resume=False, fail_at=None, data=None, model=None):
    """A stage of `steps` iterations on the data file `data` (and the model directory
    `model`) through the run-directory layer as a run on a data file takes it
    (`open_run_dir`, the fingerprints, then the loop with checkpoints whose configuration
    is checked as it resumes). **Returns:** `(result, notes)`."""
    cfg = pl.PipelineConfig(stages=("sft",), out=str(run_dir))
    cfg = dataclasses.replace(cfg, sft=dataclasses.replace(cfg.sft, steps=steps))
    if data is not None:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(data)))
    if model is not None:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, source=str(model)))
    state, opt = quadratic_state()
    with pl.tools.open_run_dir(cfg, str(run_dir), resume=resume) as rd:
        if data is not None:
            pl.tools.check_data(str(run_dir), str(data), resume=rd.resume)
        if model is not None:
            pl.tools.check_model(str(run_dir), str(model), None, resume=rd.resume)
        result = pl.loop.run_iterations(
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
        return result, rd.notes


def _snapshot(root) -> dict[str, bytes]:
    out = {}
    for d, _, files in os.walk(root):
        for n in files:
            with open(os.path.join(d, n), "rb") as f:
                out[os.path.relpath(os.path.join(d, n), root)] = f.read()
    return out


def _pairs(path, chosen=" It ran."):
    rec = {"prompt": "Tom saw a dog.", "chosen": chosen, "rejected": " No."}
    path.write_text(json.dumps(rec) + "\n")
    return path


def _crashed(run_dir, **inputs):
    with pytest.raises(RuntimeError, match="crash"):
        _run(run_dir, 4, fail_at=2, **inputs)


def _read(path):
    with open(path) as f:
        return json.load(f)


def test_a_renamed_data_file_resumes_exactly_and_records_its_new_path(tmp_path):
    full, _ = _run(tmp_path / "full", 4, data=_pairs(tmp_path / "full.jsonl"))
    old = _pairs(tmp_path / "pairs.jsonl")
    run_dir = tmp_path / "run"
    _crashed(run_dir, data=old)
    new = tmp_path / "moved" / "renamed.jsonl"
    new.parent.mkdir()
    os.rename(old, new)

    resumed, notes = _run(run_dir, 4, resume=True, data=new)

    np.testing.assert_array_equal(resumed.state.params["w"], full.state.params["w"])
    moved = [n for n in notes if "moved" in n]
    assert len(moved) == 1
    assert str(old) in moved[0] and str(new) in moved[0] and "contents are the same" in moved[0]
    assert _read(run_dir / "data.json")["path"] == str(new)
    assert _read(run_dir / "config.json")["data"]["path"] == str(new)
    # and once more from there: the new path is the recorded one, no move to report
    _, notes = _run(run_dir, 5, resume=True, data=new)
    assert not [n for n in notes if "moved" in n]


def test_a_data_file_at_the_new_path_with_other_contents_is_refused_naming_both(tmp_path):
    old = _pairs(tmp_path / "pairs.jsonl")
    run_dir = tmp_path / "run"
    _crashed(run_dir, data=old)
    other = _pairs(tmp_path / "other.jsonl", chosen=" It ran away.")
    before = _snapshot(run_dir)
    with pytest.raises(pl.loop.RunDirError) as e:
        _run(run_dir, 4, resume=True, data=other)
    message = str(e.value)
    assert str(old) in message and str(other) in message and "differs" in message
    assert "\n" not in message
    assert _snapshot(run_dir) == before


def test_a_moved_model_directory_resumes_and_a_changed_one_is_refused(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (model / "model.safetensors").write_bytes(b"\x00" * 64)
    run_dir = tmp_path / "run"
    _crashed(run_dir, model=model)
    moved = tmp_path / "models" / "renamed"
    moved.parent.mkdir()
    os.rename(model, moved)
    before = _snapshot(run_dir)

    (moved / "model.safetensors").write_bytes(b"\x01" * 64)  # other weights: refused
    with pytest.raises(pl.loop.RunDirError, match="model's files at the new path differ"):
        _run(run_dir, 4, resume=True, model=moved)
    assert _snapshot(run_dir) == before

    (moved / "model.safetensors").write_bytes(b"\x00" * 64)  # the same bytes: resumes
    _, notes = _run(run_dir, 4, resume=True, model=moved)
    assert [n for n in notes if "model.source: the model moved" in n]
    assert _read(run_dir / "model.json")["source"] == str(moved)


def test_a_moved_data_file_without_a_recorded_fingerprint_is_still_a_change(tmp_path):
    """A run that recorded no fingerprint cannot tell a moved file from another one."""
    old = _pairs(tmp_path / "pairs.jsonl")
    run_dir = tmp_path / "run"
    _crashed(run_dir, data=old)
    os.remove(run_dir / "data.json")
    new = tmp_path / "renamed.jsonl"
    os.rename(old, new)
    with pytest.raises(pl.loop.RunDirError, match="data.path: .*pairs.jsonl' -> .*renamed"):
        _run(run_dir, 4, resume=True, data=new)


def test_a_run_over_seeds_reads_back_its_finished_seeds_after_the_data_moved(tmp_path, capsys):
    calls = []

    def one_seed(c, **kw):
        """A finished run of one seed on `c.data.path`: its configuration, the data's
        fingerprint, a step record and its summary."""
        calls.append(c.ops.seed)
        with pl.tools.open_run_dir(c, c.out, **kw) as rd:
            pl.tools.check_data(c.out, c.data.path, resume=rd.resume)
            pl.tools.MetricsLog(c.out, "dpo", quiet=True).write({"step": 0, "loss": 0.5})
            with open(os.path.join(c.out, "summary.json"), "w") as f:
                json.dump({"stopped": "done", "dpo": {"loss": 0.5}}, f)
        return {"stopped": "done", "dpo": {"loss": 0.5}}

    def config(data):
        cfg = pl.PipelineConfig(stages=("dpo",), out=str(tmp_path / "seeds"))
        return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(data)))

    old = _pairs(tmp_path / "pairs.jsonl")
    pl.tools.run_seeds(config(old), 2, run=one_seed)
    new = tmp_path / "renamed.jsonl"
    os.rename(old, new)
    capsys.readouterr()
    pl.tools.run_seeds(config(new), 2, resume=True, run=one_seed)
    assert calls == [0, 1]  # both seeds read back, not run again
    moved = [x for x in capsys.readouterr().err.splitlines() if "the data file moved" in x]
    assert len(moved) == 2 and all(str(new) in x for x in moved)

    (tmp_path / "other.jsonl").write_text(new.read_text().replace("ran", "hid"))
    with pytest.raises(pl.loop.RunDirError, match="other.jsonl"):
        pl.tools.run_seeds(config(tmp_path / "other.jsonl"), 2, resume=True, run=one_seed)
