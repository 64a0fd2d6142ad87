"""The `prm` stage as a TRL `PRMTrainer` user sets it: `train_on_last_step_only` trains
and measures each solution's last step alone."""

import json

from rlhf_eqx.__main__ import main


def _run(tmp_path, name, *sets):
    rows = [
        {
            "prompt": f"What is {i % 7}+{i % 5}?",
            "completions": ["Add them.", "Carry the one.", f"It is {i}."],
            "labels": [True, True, bool(i % 3)],
        }
        for i in range(24)
    ]
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / name
    argv = ["prm", "--data", str(path), "--out", str(out), "--quiet"]
    for s in ("prm.steps=1", "prm.batch_size=4", "prm.max_length=64", *sets):
        argv += ["--set", s]
    argv += ["--set", "data.heldout_fraction=0.3", "--set", "ops.monitor=false"]
    assert main(argv) == 0
    return json.loads((out / "summary.json").read_text())["prm"]


def test_train_on_last_step_only_marks_one_step_per_solution(tmp_path):
    every = _run(tmp_path, "every")
    last = _run(tmp_path, "last", "prm.train_on_last_step_only=true")
    held = every["heldout_steps"] // 3  # three steps per solution, none dropped
    assert every["heldout_steps"] == 3 * held and held > 0
    assert last["heldout_steps"] == held
    assert last["train_solutions"] == every["train_solutions"]
