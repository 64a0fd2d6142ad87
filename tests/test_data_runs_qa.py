"""Data-file runs that lose nothing and name what they leave out: `--overwrite` with a
bad data file puts the previous run back; grpo, ppo and distill name the prompts they
drop by their lines; a record no chat template can render is named by its line in
every stage."""

import json

from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _snapshot(root) -> dict:
    """Every file below `root`, by its relative path, with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _finished_run(run) -> None:
    """A run directory as a finished dpo run leaves it: its configuration, step records,
    summary and export."""
    cfg = pl.apply_overrides(pl.PipelineConfig(), [f"out={run}"])
    with pl.tools.open_run_dir(cfg, str(run)):
        steps = [{"stage": "dpo", "iteration": i, "step": i, "loss": 0.69} for i in range(3)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
        (run / "summary.json").write_text('{"stopped": "done"}')
        (run / "dpo" / "hf").mkdir(parents=True)
        (run / "dpo" / "hf" / "config.json").write_text("{}")


def test_overwrite_with_a_bad_data_file_puts_the_previous_run_back(tmp_path, capsys):
    run = tmp_path / "run"
    _finished_run(run)
    before = _snapshot(run)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "Once", "chosen": " a cat", "rejected": " rain"}\n{"prompt": \n')
    argv = ["dpo", "--data", str(bad), "--out", str(run), "--overwrite", "--quiet"]
    assert main([*argv, "--set", "ops.monitor=false"]) == 1
    err = capsys.readouterr().err
    assert f"{bad}:2:" in err  # the data error, named
    assert f"nothing ran: the previous run is back in {run}" in err
    assert _snapshot(run) == before  # the previous run where it was, untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "run"]
