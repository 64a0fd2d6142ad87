"""The CLI on the real data files in ../shared: DPO and a reward model on HH-RLHF, GRPO
on GSM8K with the exact-match reward (tiny sizes: the formats run end to end)."""

import json
import math
import os

import pytest

from rlhf_eqx.__main__ import main


@pytest.mark.slow
def test_dpo_and_reward_on_hh_rlhf(shared_dir, tmp_path):
    hh = os.path.join(shared_dir, "data", "hh-rlhf", "harmless-base", "test.jsonl.gz")
    common = [
        "--data",
        hh,
        "--quiet",
        "--set",
        "data.limit=24",
        "--set",
        "sampling.prompt_length=96",
    ]
    out = tmp_path / "dpo"
    assert (
        main(
            [
                "dpo",
                "--out",
                str(out),
                *common,
                "--set",
                "dpo.steps=2",
                "--set",
                "dpo.batch_size=4",
                "--set",
                "dpo.max_length=128",
                "--set",
                "data.filter=identical,empty,exact_duplicate",
            ]
        )
        == 0
    )
    s = json.loads((out / "summary.json").read_text())
    assert 0.0 <= s["dpo"]["heldout_reward_accuracy"] <= 1.0
    assert s["truncation"]["records"] > 0 and (out / "dpo" / "hf" / "config.json").exists()
    assert "prompts were cut" in s["truncation"]["policy"] and "identical" in s["data_quality"]
    assert (out / "dpo" / "adapter" / "adapter_config.json").exists()
    lines = (out / "metrics.jsonl").read_text().splitlines()
    events = [json.loads(line).get("event") for line in lines]
    assert "data_quality" in events and "data_filter" in events
    out = tmp_path / "rm"
    assert (
        main(
            [
                "reward",
                "--out",
                str(out),
                *common,
                "--set",
                "reward.steps=2",
                "--set",
                "reward.batch_size=4",
                "--set",
                "reward.max_length=128",
            ]
        )
        == 0
    )
    s = json.loads((out / "summary.json").read_text())
    assert 0.0 <= s["reward_model"]["heldout_accuracy"] <= 1.0
    rm_config = json.loads((out / "reward" / "hf" / "config.json").read_text())
    assert rm_config["architectures"][0].endswith("ForSequenceClassification")


@pytest.mark.slow
def test_grpo_on_gsm8k_exact_match(shared_dir, tmp_path):
    gsm = os.path.join(shared_dir, "data", "gsm8k", "test.jsonl")
    out = tmp_path / "grpo"
    assert (
        main(
            [
                "grpo",
                "--data",
                gsm,
                "--out",
                str(out),
                "--quiet",
                "--set",
                "data.limit=16",
                "--set",
                "grpo.rollouts=1",
                "--set",
                "grpo.prompts_per_rollout=2",
                "--set",
                "grpo.group_size=2",
                "--set",
                "sampling.prompt_length=256",
                "--set",
                "sampling.max_new_tokens=8",
            ]
        )
        == 0
    )
    s = json.loads((out / "summary.json").read_text())
    g = s["grpo"]
    rates = ("heldout_exact_match_before", "heldout_exact_match")
    assert set(g) == {*rates, *(r + "_se" for r in rates), "sampled"}
    sampled = g["sampled"]
    for r in rates:
        # the standard error over held-out prompts is NaN with one prompt (prompt_se)
        se = float(g[r + "_se"])  # "NaN" as the run's JSON files write it
        assert 0.0 <= g[r] <= 1.0 and (se >= 0.0 or (math.isnan(se) and sampled["prompts"] < 2))
    assert sampled["samples_per_prompt"] == 8 and sampled["prompts"] >= 1
    assert sampled["base_nll_before"] > 0 and sampled["base_nll_after"] > 0
    assert {"prompt", "before", "after"} <= set(sampled["examples"][0])
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("rollout/frac_reward_zero_std" in r for r in rows)
