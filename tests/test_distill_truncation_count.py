"""`distill --data` with sampled steps leaves the prompts longer than
`sampling.prompt_length` out (`prompts_left_out`); its `truncation` event and
`summary["truncation"]` count the cuts of the records it trains on, after that filter,
so a prompt left out is not also reported as cut."""

import json

import pytest
from helpers import quiet_settings

import rlhf_eqx as rx
from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main
from rlhf_eqx.assets import asset_path


def _events(out, name: str) -> list[dict]:
    with open(out / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if r.get("event") == name]


@pytest.mark.slow
def test_prompts_left_out_are_not_counted_as_cut(tmp_path):
    policy, _ = pl.tools.load_model("builtin")
    teacher = tmp_path / "teacher"
    rx.save_hf(policy, teacher)
    pl.runs.copy_tokenizer(asset_path("tok512.bin"), str(teacher))
    long = "Once upon a time a very small cat sat on a very big mat all day"
    rows = [
        {
            "prompt": (long if i % 3 == 0 else "The cat") + f" {i}",
            "chosen": " sat.",
            "rejected": " ran.",
        }
        for i in range(12)
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    argv = ["distill", "--data", str(path), "--out", str(out)]
    argv += ["--set", f"distill.teacher={teacher}"]
    argv += quiet_settings(
        "distill.steps=1",
        "distill.batch_size=2",
        "distill.max_length=40",
        "distill.lmbda=0.5",
        "sampling.prompt_length=12",
        "sampling.max_new_tokens=4",
        "data.heldout_fraction=0.25",
    )
    assert main(argv) == 0
    (left,) = _events(out, "prompts_left_out")
    assert left["left_out"] > 0
    assert _events(out, "truncation") == []  # the long prompts went: nothing kept was cut
    summary = json.loads((out / "summary.json").read_text())
    assert summary["truncation"]["prompt_truncated"] == 0
    assert summary["truncation"]["records"] == left["records"] - left["left_out"]
