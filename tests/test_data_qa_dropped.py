"""A record the tokeniser leaves out (nothing of it fits) is said in the `truncation`
event with its reason, beside the cut ones, even when nothing was cut."""

import json

import pytest

from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main


@pytest.mark.slow
def test_a_solution_with_no_step_that_fits_is_said_left_out(tmp_path):
    rows = [
        {"prompt": f"Q{i}?", "completions": ["s1", "s2"], "labels": [True, bool(i % 2)]}
        for i in range(12)
    ]
    for row in rows[:5]:  # a first step too long for prm.max_length
        row["completions"][0] = "a long first step " * 6
    path = tmp_path / "steps.jsonl"
    path.write_text("".join("\n" + json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    argv = ["prm", "--data", str(path), "--out", str(out), "--quiet"]
    argv += ["--set", "prm.steps=1", "--set", "prm.max_length=48", "--set", "ops.monitor=false"]
    argv += ["--set", "sampling.prompt_length=16", "--set", "data.heldout_fraction=0.25"]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())["prm"]["truncation"]
    (event,) = [e for e in pl.tools.read_records(str(out)) if e.get("event") == "truncation"]
    assert event["dropped"] == summary["too_long"] > 0
    assert (
        f"{summary['too_long']} of {summary['solutions']} left out (too long: "
        in (event["message"])
    )
