"""The `kto` stage: on an unpaired file, on preference pairs, and its settings checked."""

import json

import pytest

from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main

_SMALL = [
    "--quiet",
    "--set",
    "kto.steps=3",
    "--set",
    "kto.batch_size=4",
    "--set",
    "kto.max_length=40",
    "--set",
    "sampling.prompt_length=16",
    "--set",
    "data.heldout_fraction=0.25",
    "--set",
    "ops.monitor=false",
]


def _unpaired(path, n=16):
    with open(path, "w") as f:
        for i in range(n):
            good = i % 2 == 0
            rec = {
                "prompt": f"Once upon a time {i}",
                "completion": " a dog ran home." if good else " zzz zzz.",
                "label": good,
            }
            f.write(json.dumps(rec) + "\n")


def test_kto_runs_on_an_unpaired_file(tmp_path, capsys):
    data = tmp_path / "unpaired.jsonl"
    _unpaired(data)
    out = tmp_path / "run"
    assert main(["kto", "--data", str(data), "--out", str(out), *_SMALL]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"] == "done"
    kto = summary["kto"]
    assert 0.0 <= kto["heldout_ordering_accuracy"] <= 1.0
    assert {"heldout_reward_desirable", "heldout_reward_undesirable"} <= set(kto)
    assert (out / "kto" / "hf" / "tokenizer.bin").exists()
    steps = [r for r in pl.read_metrics(str(out))["kto"]]
    assert [r["step"] for r in steps] == [0, 1, 2]
    assert all("kl" in r and "rewards/chosen" in r for r in steps)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("rlhf_eqx kto: done:") and "summary.json" in last


def test_kto_splits_preference_pairs(tmp_path):
    data = tmp_path / "pairs.jsonl"
    with open(data, "w") as f:
        for i in range(12):
            rec = {"prompt": f"The cat {i}", "chosen": " sat on a mat.", "rejected": " zz."}
            f.write(json.dumps(rec) + "\n")
    out = tmp_path / "run"
    assert main(["kto", "--data", str(data), "--out", str(out), *_SMALL]) == 0
    kto = json.loads((out / "summary.json").read_text())["kto"]
    assert 0.0 <= kto["heldout_pair_accuracy"] <= 1.0


def test_kto_settings_are_checked():
    with pytest.raises(pl.ConfigError, match="kto.loss_type='x': must be one of kto"):
        pl.validate_stage("kto", pl.KTOConfig(loss_type="x"))
    with pytest.raises(pl.ConfigError, match="kto.desirable_weight=-1"):
        pl.validate_stage("kto", pl.KTOConfig(desirable_weight=-1.0))
