"""`resume=True` (`rlhf_eqx sweep ... --resume`) on a directory that holds no sweep says
so on stderr, as a run's resume does, and starts the sweep."""

import pytest

from rlhf_eqx import pipelines as pl

TINY = ["sft.steps=2", "eval_samples=2", "ops.quiet=true", "ops.monitor=false"]


@pytest.mark.slow  # a whole run of a stage (8-15 s): in the slow suite
def test_a_resume_with_nothing_to_resume_says_so_and_starts(tmp_path, capsys):
    cfg = pl.apply_overrides(pl.animal_task_config(), TINY)
    out = str(tmp_path / "s")
    res = pl.sweep("sft", cfg, seeds=1, out=out, resume=True)
    assert res.summaries["seed=0"]["stopped"] == "done"
    assert f"note: nothing to resume in {out}: starting a new sweep" in capsys.readouterr().err
