"""A resume of a run written by another version of the library names only real changes:
a setting the library no longer has is named once as no longer used (not refused, nor
printed as a change `None -> None`), a section of a stage registered since is no change,
and a real change is still refused naming it alone."""

import dataclasses
import json
import os

import pytest

from rlhf_eqx import pipelines as pl


def _dict(cfg=None) -> dict:
    return pl.config.config_to_dict(pl.animal_task_config() if cfg is None else cfg)


def _with_removed(d: dict) -> dict:
    """`d` as an older version wrote it: a field of `ppo` and a whole section the library
    has since dropped (one of whose fields was `None`)."""
    out = json.loads(json.dumps(d))
    out["ppo"]["old_knob"] = None
    out["ppo"]["old_scale"] = 0.5
    out["old_stage"] = {"steps": 10, "lora": {"rank": 4}, "path": None}
    return out


def test_settings_the_library_no_longer_has_are_no_change():
    new = _dict()
    assert pl.loop.check_resumable(_with_removed(new), new, where="run") == []


def test_a_real_change_is_refused_naming_it_alone():
    new = _dict(pl.apply_overrides(pl.animal_task_config(), ["dpo.beta=0.3"]))
    with pytest.raises(pl.loop.RunDirError) as e:
        pl.loop.check_resumable(_with_removed(_dict()), new, where="run")
    message = str(e.value)
    assert "dpo.beta: 0.1 -> 0.3" in message
    assert "old_knob" not in message and "old_stage" not in message
    assert "None -> None" not in message


def test_a_section_the_stored_config_lacks_is_no_change():
    """A stage registered after the run was written never ran in it: its section (here
    the task's own LoRA settings, not the class defaults) is no change."""
    new = _dict()
    old = json.loads(json.dumps(new))
    del old["kto"]
    assert (
        new["kto"]["lora"]["rank"]
        != pl.config.config_to_dict(pl.PipelineConfig())["kto"]["lora"]["rank"]
    )
    assert pl.loop.check_resumable(old, new, where="run") == []


def test_a_dict_setting_whose_key_went_is_still_a_change():
    """A key of a mapping setting (`data.columns`) that the new value lacks is a change
    of that setting, not a setting the library dropped."""
    cfg = pl.PipelineConfig(stages=("sft",))
    new = _dict(cfg)
    old = json.loads(json.dumps(new))
    old["data"]["columns"] = {"prompt": "question"}
    with pytest.raises(pl.loop.RunDirError, match="data.columns.prompt"):
        pl.loop.check_resumable(old, new, where="run")


def test_a_resume_names_the_settings_no_longer_used_once(tmp_path):
    run_dir = str(tmp_path / "run")
    cfg = dataclasses.replace(pl.PipelineConfig(stages=("sft",)), out=run_dir)
    with pl.tools.open_run_dir(cfg, run_dir):
        log = pl.tools.MetricsLog(run_dir, "sft", quiet=True)
        log.write({"iteration": 0, "step": 0, "loss": 1.0})
    path = os.path.join(run_dir, "config.json")
    with open(path) as f:
        stored = json.load(f)
    with open(path, "w") as f:
        json.dump(_with_removed(stored), f)

    with pl.tools.open_run_dir(cfg, run_dir, resume=True) as rd:
        named = [n for n in rd.notes if "no longer used" in n]
    assert len(named) == 1
    assert "ppo.old_knob, ppo.old_scale, old_stage: no longer used" in named[0]
    with open(path) as f:
        assert "old_stage" not in json.load(f)  # the resumed run's configuration


def test_eval_of_a_run_written_by_an_older_version_takes_its_sampling_settings(tmp_path):
    """`rlhf_eqx eval --model RUN` reads the run's evaluation settings from its
    `config.json`; one the library no longer has is not read (not an error)."""
    import argparse

    run = tmp_path / "run"
    run.mkdir()
    stored = _dict(pl.apply_overrides(pl.animal_task_config(), ["sampling.temperature=0.7"]))
    stored["sampling"]["old_knob"] = 3
    (run / "config.json").write_text(json.dumps(stored))
    args = argparse.Namespace(command="eval", model=str(run), config=None, overrides=[])
    cfg = pl.config.command_line_config(args)
    assert cfg.sampling.temperature == 0.7


def test_a_setting_renamed_since_is_refused_not_dropped():
    """A stored setting this version no longer has, in a section that gained one since
    (`optim.lr` then, `optim.learning_rate` now), may be the same setting renamed: the
    stored value would be lost for the new name's default, so the resume is refused,
    naming it, rather than going on without it."""
    new = _dict()
    old = json.loads(json.dumps(new))
    rate = old["dpo"]["optim"].pop("learning_rate")
    old["dpo"]["optim"]["lr"] = rate * 3
    with pytest.raises(pl.loop.RunDirError) as e:
        pl.loop.check_resumable(old, new, where="run")
    assert f"dpo.optim.lr: {rate * 3!r} -> None" in str(e.value)
    old["dpo"]["optim"]["learning_rate"] = rate  # the field of that name kept: no rename
    old["dpo"]["optim"]["lr"] = None
    assert pl.loop.check_resumable(old, new, where="run") == []
    assert "renamed? resume with the version that wrote the run" in str(e.value)
