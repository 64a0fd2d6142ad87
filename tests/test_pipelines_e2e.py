"""The default pipeline end to end on the shipped stories260K model, at small sizes."""

import json
import os

import pytest

from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main


@pytest.mark.slow
def test_pipeline_end_to_end_small(tmp_path, capsys):
    out = tmp_path / "run"
    argv = [
        "--out",
        str(out),
        "--quiet",
        "--set",
        "stages=sft,reward,ppo,dpo,grpo,online-dpo",
        "--set",
        "sft.steps=2",
        "--set",
        "reward.steps=2",
        "--set",
        "reward.pairs_per_prompt=1",
        "--set",
        "ppo.rollouts=1",
        "--set",
        "ppo.prompts_per_rollout=8",
        "--set",
        "dpo.rounds=1",
        "--set",
        "dpo.steps=2",
        "--set",
        "dpo.samples=2",
        "--set",
        "grpo.rollouts=1",
        "--set",
        "grpo.prompts_per_rollout=2",
        "--set",
        "grpo.group_size=2",
        "--set",
        "eval_samples=1",
        "--set",
        "sampling.max_new_tokens=8",
        "--set",
        "ops.checkpoint_every=1",
    ]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    for stage in ("sft", "ppo", "dpo", "grpo", "online-dpo"):
        assert 0.0 <= summary[stage]["score"] <= 1.0
        assert os.path.isfile(out / stage / "hf" / "config.json")
        assert os.path.isfile(out / stage / "hf" / "model.safetensors")
    for stage in ("ppo", "dpo", "grpo"):
        assert {"score", "win_rate_vs_sft", "kl"} <= set(summary[stage])
    for stage in ("base", "sft", "ppo", "dpo", "grpo", "online-dpo"):
        assert 0.0 <= summary[stage]["score_se"] <= 0.5
    for stage in ("ppo", "dpo", "grpo", "online-dpo"):
        assert 0.0 <= summary[stage]["win_rate_vs_sft_se"] <= 0.5
    rm = summary["reward_model"]
    assert 0.0 <= rm["heldout_accuracy"] <= 1.0
    p, n = rm["heldout_accuracy"], rm["heldout_pairs"]
    assert rm["heldout_accuracy_se"] == pytest.approx((p * (1 - p) / n) ** 0.5)
    rm_config = json.loads((out / "reward" / "hf" / "config.json").read_text())
    assert rm_config["architectures"][0].endswith("ForSequenceClassification")
    for stage in ("sft", "ppo", "dpo", "grpo"):
        assert os.path.isfile(out / stage / "adapter" / "adapter_config.json")
        assert os.path.isfile(out / stage / "adapter" / "adapter_model.safetensors")
    assert json.loads((out / "config.json").read_text())["sft"]["steps"] == 2
    stages = pl.tools.read_metrics(str(out))
    assert {"sft", "reward", "ppo", "dpo", "grpo"} <= set(stages)
    assert pl.tools.latest_checkpoint(str(out / "ppo" / "checkpoints")) is not None
    # The saved policy reloads and samples.
    assert (
        main(
            [
                "sample",
                "--model",
                str(out / "dpo" / "hf"),
                "--tokenizer",
                _tok(),
                "-n",
                "1",
                "--quiet",
                "--set",
                "sampling.max_new_tokens=4",
            ]
        )
        == 0
    )


def _tok():
    from rlhf_eqx.assets import asset_path

    return asset_path("tok512.bin")
