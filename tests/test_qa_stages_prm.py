"""The `prm` stage as a TRL `PRMTrainer` user sets it: a conversational prompt (a list of
messages) is refused in one line that says the layout is not read, and
`train_on_last_step_only` trains and measures each solution's last step alone."""

import json

import pytest

from rlhf_eqx import data
from rlhf_eqx.__main__ import main


def test_a_conversational_prompt_is_named_as_such(tmp_path):
    rows = [
        {"prompt": "What is 1+1?", "completions": ["1+1 = 2"], "labels": [True]},
        {
            "prompt": [{"role": "user", "content": "What is 1+1?"}],
            "completions": ["1+1 = 2"],
            "labels": [True],
        },
    ]
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(data.DataError) as e:
        data.load_stepwise(str(path))
    (line,) = str(e.value).splitlines()
    assert line.startswith(f"{path}:2: wrong type: 'prompt' must be a string, got a list")
    assert "conversational" in line


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
