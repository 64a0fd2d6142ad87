"""On the built-in task the batch stages train on sampled sequences of up to
`sampling.prompt_length + sampling.max_new_tokens` tokens: a stage's `max_length` below
that would cut the samples and train on the cut text with the whole sample's label, so
it is refused naming both fields; the defaults hold a whole sample."""

import json

import pytest

import rlhf_eqx.pipelines as pl


def _validate(*overrides: str, stage: str | None = None):
    cfg = pl.apply_overrides(pl.animal_task_config(), list(overrides))
    pl.config.validate_config(cfg, stage=stage)


def test_the_defaults_hold_a_whole_sample():
    _validate("stages=sft,reward,dpo,kto,grpo,distill,online-dpo")


@pytest.mark.parametrize("key", ["sft", "reward", "dpo", "kto", "distill"])
def test_a_stage_too_short_for_its_samples_is_refused(key):
    stages = {"sft": "sft", "distill": "sft,grpo,distill"}.get(key, f"sft,{key}")
    long = [f"{k}.max_length=200" for k in ("sft", "reward", "dpo", "kto", "distill")]
    with pytest.raises(pl.ConfigError) as e:
        _validate(f"stages={stages}", "sampling.max_new_tokens=100", *long, f"{key}.max_length=80")
    line = str(e.value)
    assert line.startswith(f"{key}.max_length=80: must hold the samples"), line
    assert "sampling.prompt_length=32 + sampling.max_new_tokens=100 = 132" in line
    _validate(f"stages={stages}", "sampling.max_new_tokens=100", *long, f"{key}.max_length=132")


def test_online_dpo_reads_the_dpo_section():
    with pytest.raises(pl.ConfigError, match=r"^dpo\.max_length=80: must hold"):
        _validate(
            "stages=sft,reward,online-dpo",
            "sampling.max_new_tokens=49",
            "sft.max_length=81",
            "reward.max_length=81",
        )


def test_a_data_file_run_trains_on_the_file_not_on_samples(tmp_path):
    path = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"p{i}", "chosen": " a", "rejected": " b"} for i in range(4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _validate(f"data.path={path}", "sampling.max_new_tokens=100", "dpo.max_length=80", stage="dpo")
