"""`rlhf_eqx prm --data FILE`: the summary counts the training solutions whose prompt was
cut and whose later steps did not fit `prm.max_length`, and a `truncation` event says so
on stderr."""

import json

from rlhf_eqx import data
from rlhf_eqx.__main__ import main


def test_prm_summary_counts_cut_prompts_and_dropped_steps(tmp_path, capsys):
    long_prompt = {1, 2, 5}
    long_step = {3, 4, 6}
    records = []
    for i in range(16):
        prompt = f"What is {i} plus 1?" + (" Think about it." * 8 if i in long_prompt else "")
        last = "so it is that" * (20 if i in long_step else 1)
        records.append({"prompt": prompt, "completions": [f"it is {i + 1}", last]})
        records[-1]["labels"] = [True, i % 3 != 0]
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    train, _ = data.split_held_out([r["prompt"] for r in records], fraction=0.25, seed=0)
    n_long_prompt = sum(records[i]["prompt"] in train for i in long_prompt)
    n_long_step = sum(records[i]["prompt"] in train for i in long_step)
    assert n_long_prompt and n_long_step  # the cases under test are trained on
    out = tmp_path / "run"
    argv = ["prm", "--data", str(path), "--out", str(out), "--quiet"]
    argv += ["--set", "prm.steps=2", "--set", "prm.batch_size=4", "--set", "prm.max_length=48"]
    argv += ["--set", "sampling.prompt_length=16", "--set", "data.heldout_fraction=0.25"]
    assert main([*argv, "--set", "ops.monitor=false"]) == 0
    prm = json.loads((out / "summary.json").read_text())["prm"]
    assert prm["train_solutions"] == len(train)
    assert prm["truncation"] == {
        "solutions": len(train),
        "prompt_truncated": n_long_prompt,
        "steps_dropped": n_long_step,
        "too_long": 0,
        "truncated_records": prm["truncation"]["truncated_records"],
    }
    events = [
        json.loads(line)
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if '"truncation"' in line
    ]
    (event,) = [e for e in events if e.get("event") == "truncation"]
    assert (event["prompt_truncated"], event["completion_truncated"]) == (
        n_long_prompt,
        n_long_step,
    )
    # the first cut solutions named by their lines (one record a line, 1-based)
    cut_lines = {i + 1 for i in long_prompt | long_step if records[i]["prompt"] in train}
    named = prm["truncation"]["truncated_records"]
    assert len(named) == min(5, len(cut_lines)) and set(named) <= cut_lines
    assert event["truncated_records"] == ", ".join(map(str, named))
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "truncation" in x]
    assert "; first cut: lines " in line
    assert line.startswith(f"[prm] truncation: {path}: {n_long_prompt} of {len(train)} prompts cut")
    assert "lost their later steps" in line and "prm.max_length" in line
