"""`dpo.missing_eos_penalty` (TRL's `OnlineDPOConfig.missing_eos_penalty`): online DPO
subtracts it from the label of every sample cut at `sampling.max_new_tokens` without a
stop, before pairing best with worst; refused below 0, and on a data file, where offline
DPO samples nothing."""

import json

import jax
import pytest

from rlhf_eqx import pipelines as pl

PROMPTS = ["Once upon a time", "Tom had a red ball", "The sun"]


def _round(tmp_path, name: str, penalty) -> dict:
    """The step record of one round of 2 samples a prompt, labelled 0 and 1."""

    def label(ps, texts, r):
        return [float(j % 2) for j in range(len(texts))]

    policy, tok = pl.tools.load_model("builtin")
    ctx = pl.RunContext(
        ops=pl.OpsConfig(quiet=True),
        log=pl.tools.MetricsLog(str(tmp_path / name), "online-dpo", quiet=True),
        key=jax.random.key(0),
        prompt_length=16,
        max_new_tokens=6,
    )
    cfg = pl.DPOConfig(
        rounds=1, samples=2, steps=1, batch_size=2, max_length=40, missing_eos_penalty=penalty
    )
    pl.runs.run_online_dpo(policy, tok, PROMPTS, label, cfg=cfg, ctx=ctx)
    (step,) = [r for r in pl.tools.read_records(str(tmp_path / name)) if "step" in r]
    return step


def test_the_penalty_lowers_the_labels_of_samples_cut_without_a_stop(tmp_path):
    off = _round(tmp_path, "off", None)
    on = _round(tmp_path, "on", 0.25)
    assert "rollout/missing_eos" not in off and off["rollout/label_mean"] == 0.5
    cut = on["rollout/missing_eos"]  # the same samples: the same key
    assert cut > 0  # 6 new tokens: the tiny model stops on few of them
    assert on["rollout/label_mean"] == pytest.approx(0.5 - 0.25 * cut)


def _validate(*overrides: str, stage=None):
    cfg = pl.apply_overrides(pl.animal_task_config(), list(overrides))
    pl.config.validate_config(cfg, stage=stage)


def test_the_penalty_is_checked_and_read_by_the_sampling_stages_only(tmp_path):
    _validate("stages=sft,reward,online-dpo", "dpo.missing_eos_penalty=1")
    _validate("stages=sft,dpo", "dpo.missing_eos_penalty=0")
    with pytest.raises(pl.ConfigError, match=r"^dpo\.missing_eos_penalty=-1\.0?: must be >= 0"):
        _validate("stages=sft,dpo", "dpo.missing_eos_penalty=-1")
    path = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"p{i}", "chosen": " a", "rejected": " b"} for i in range(4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(pl.ConfigError, match=r"^dpo\.missing_eos_penalty=1\.0?: applies to"):
        _validate(f"data.path={path}", "dpo.missing_eos_penalty=1", stage="dpo")
