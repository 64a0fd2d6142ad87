"""Stepwise records as a TRL `PRMTrainer` user writes them: a conversational prompt (a
list of messages) is refused in one line that says the layout is not read."""

import json

import pytest

from rlhf_eqx import data


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
