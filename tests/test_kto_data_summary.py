"""`rlhf_eqx kto --data FILE` on an imbalanced unpaired file: the summary says what its
held-out metrics could not measure and how many prompts were cut (a `truncation` event
too), and the weights' balance is checked."""

import json

import pytest
from helpers import quiet_settings

from rlhf_eqx import data, pipelines as pl
from rlhf_eqx.__main__ import main

_SMALL = quiet_settings(
    "kto.steps=2",
    "kto.batch_size=4",
    "kto.max_length=40",
    "sampling.prompt_length=16",
    "sampling.max_new_tokens=4",
    "data.heldout_fraction=0.25",
)


def _imbalanced(n=16):
    """Three desirable examples for each undesirable one; two prompts longer than
    `sampling.prompt_length=16`."""
    long = " and then the cat sat" * 6
    return [
        data.UnpairedRecord(
            f"Once upon a time {i}" + (long if i in (1, 2) else ""),
            " a dog ran home." if i % 4 else " zzz zzz.",
            i % 4 != 0,
        )
        for i in range(n)
    ]


@pytest.mark.slow
def test_kto_on_an_imbalanced_file_notes_a_held_out_side_of_one_label(tmp_path):
    records = _imbalanced()
    train, held = data.split_held_out(records, fraction=0.25, seed=0)
    assert {r.label for r in held} == {True}  # the case under test
    n_good = sum(r.label for r in train)
    path = tmp_path / "unpaired.jsonl"
    path.write_text("".join(json.dumps(vars(r)) + "\n" for r in records))
    out = tmp_path / "run"
    assert main(["kto", "--data", str(path), "--out", str(out), *_SMALL]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["truncation"]["records"] == len(train)
    assert summary["truncation"]["prompt_truncated"] == 2  # cut, their end kept
    kto = summary["kto"]
    assert kto["heldout_desirable"] == len(held) and kto["heldout_undesirable"] == 0
    assert (kto["train_desirable"], kto["train_undesirable"]) == (n_good, len(train) - n_good)
    assert "heldout_reward_desirable" in kto
    assert "heldout_reward_margin" not in kto and "heldout_ordering_accuracy" not in kto
    assert "no undesirable example" in kto["note"] and "data.heldout_fraction" in kto["note"]
    events = {r["event"]: r for r in pl.tools.read_records(str(out)) if "event" in r}
    assert events["heldout_one_label"]["message"] == kto["note"]
    ratio = n_good / (len(train) - n_good)
    assert abs(events["kto_weights"]["ratio"] - ratio) < 1e-9
    low = (len(train) - n_good) / n_good
    assert (
        f"kto.desirable_weight in [{low:.3g}, {4 / 3 * low:.3g}]"
        in (events["kto_weights"]["message"])
    )
    cut = events["truncation"]
    assert (cut["prompt_truncated"], cut["completion_truncated"]) == (2, 0)
    assert cut["message"].startswith(f"{path}: 2 of {len(train)} prompts cut (their end kept)")
    assert "data.filter=long_prompt" in cut["message"]
    # the cut examples named by their lines (records 2 and 3 of the file, one a line)
    assert sorted(summary["truncation"]["truncated_records"]) == [2, 3]
    assert cut["truncated_records"] in ("2, 3", "3, 2")
    assert "; first cut: lines " in cut["message"]
