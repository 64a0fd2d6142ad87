"""`kto` (on an unpaired file) and `prm` say which lines their reader left out (an empty
completion, a solution without steps or with an empty one): a `skipped_records` event on
stderr and in `metrics.jsonl` naming the file and line, beside the summary's counts."""

import json

import pytest

from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["kto", "prm"])
def test_the_lines_the_reader_left_out_are_named(tmp_path, capsys, stage):
    if stage == "kto":
        rows = [
            {"prompt": f"Tom {i}", "completion": " ran.", "label": bool(i % 2)} for i in range(12)
        ]
        rows[4]["completion"], reason = "", "empty completion"
    else:
        rows = [
            {"prompt": f"Q{i}", "completions": ["s1", "s2"], "labels": [True, bool(i % 2)]}
            for i in range(12)
        ]
        rows[4]["completions"], reason = ["s1", " "], "empty step"
    path = _write(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "run"
    argv = [stage, "--data", path, "--out", str(out), "--quiet", "--set", f"{stage}.steps=1"]
    argv += ["--set", "data.heldout_fraction=0.3", "--set", "ops.monitor=false"]
    if stage == "kto":
        argv += ["--set", "data.eval_prompts=0"]
    assert main(argv) == 0
    want = f"the reader left out 1 of the 12 records ({reason}: 1): {path}:5: {reason}"
    lines = [x for x in capsys.readouterr().err.splitlines() if "skipped_records" in x]
    assert lines == [f"[{stage}] skipped_records: {want}"]
    (event,) = [r for r in pl.tools.read_records(str(out)) if r.get("event") == "skipped_records"]
    assert (event["message"], event["skipped"], event["read"]) == (want, 1, 12)
    summary = json.loads((out / "summary.json").read_text())
    skipped = (summary["data_quality"] if stage == "kto" else summary["prm"])["skipped_by_reader"]
    assert skipped == {reason: 1}


@pytest.mark.slow  # a whole run of a stage (8-15 s): in the slow suite
def test_eval_prompts_zero_samples_no_held_out_completions(tmp_path):
    """`data.eval_prompts=0` is none, as the setting says: the run samples no held-out
    completion (`sampled.prompts` 0, no NLL or KL of samples)."""
    rows = [{"prompt": f"Tom {i}", "completion": " ran.", "label": bool(i % 2)} for i in range(12)]
    out = tmp_path / "run"
    argv = ["kto", "--data", _write(tmp_path / "rows.jsonl", rows), "--out", str(out), "--quiet"]
    argv += ["--set", "kto.steps=1", "--set", "data.heldout_fraction=0.3"]
    argv += ["--set", "ops.monitor=false", "--set", "data.eval_prompts=0"]
    assert main(argv) == 0
    sampled = json.loads((out / "summary.json").read_text())["kto"]["sampled"]
    assert sampled["prompts"] == 0 and "base_nll_after" not in sampled, sampled
