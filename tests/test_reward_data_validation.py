"""`rlhf_eqx reward --data FILE` with the default seeds (`data.seed = ops.seed = 0`):
the validation split of checkpoint selection is drawn from the training pairs
independently of the file's held-out split, so it is not empty."""

import json

import pytest

from rlhf_eqx import data, pipelines as pl
from rlhf_eqx.__main__ import main


@pytest.mark.slow
def test_reward_on_a_data_file_selects_on_a_validation_split(tmp_path):
    rows = [
        {"prompt": f"Once upon a time {i}", "chosen": " a dog ran home.", "rejected": f" zzz {i}."}
        for i in range(60)
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, held = data.split_held_out(
        [data.PreferenceRecord(**r) for r in rows], fraction=0.1, seed=0
    )
    # the same key twice: every training prompt hashes above the threshold
    assert train and held and not data.split_held_out(train, fraction=0.1, seed=0)[1]
    out = tmp_path / "run"
    argv = ["reward", "--data", str(path), "--out", str(out), "--quiet"]
    for s in ("steps=4", "batch_size=4", "max_length=40", "eval_every=2"):
        argv += ["--set", f"reward.{s}"]
    assert main([*argv, "--set", "ops.monitor=false"]) == 0
    rm = json.loads((out / "summary.json").read_text())["reward_model"]
    assert rm["validation_pairs"] > 0 and rm["train_pairs"] + rm["validation_pairs"] == len(train)
    assert rm["heldout_pairs"] == len(held)
    assert rm["selected_step"] in (2, 4) and 0.0 <= rm["validation_accuracy"] <= 1.0
    events = [r.get("event") for r in pl.tools.read_records(str(out))]
    assert "no_validation" not in events and "reward_selection" in events
