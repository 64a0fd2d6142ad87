"""A setting that the run would not read is refused before anything loads, one line
naming the field and what applies instead: the data settings on the built-in task, the
built-in task's settings on a data file, the held-out sampling settings of the stages
that sample nothing, the judge when nothing scores with it, `ops.eval_every` where
nothing evaluates periodically, a reward model with a source that does not read it,
and adapter settings without adapters. The defaults (the usual ones and the built-in
task's) are never refused."""

import json

import pytest

from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main


def _validate(overrides, stage=None):
    cfg = pl.apply_overrides(pl.animal_task_config(), overrides)
    pl.config.validate_config(cfg, stage=stage)


@pytest.fixture
def pairs(tmp_path):
    path = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"Say {i}.", "chosen": f"A cat {i}.", "rejected": "No."} for i in range(8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


BUILTIN_REFUSED = [
    (["data.limit=5"], r"^data\.limit=5: applies to a data file \(data\.path, --data FILE\)"),
    (["data.eval_prompts=3"], r"^data\.eval_prompts=3: applies to a data file"),
    (["data.filter=identical"], r"^data\.filter=identical: applies to a data file"),
    (["data.assistant_turns=last"], r"^data\.assistant_turns='last': applies to a data file"),
    (["stages=sft", "ops.eval_every=2"], r"^ops\.eval_every=2: a run of sft and reward alone"),
    (["stages=sft,dpo", "judge.score=prob"], r"^judge\.score='prob': no stage of this run"),
    (["stages=sft,grpo", "grpo.reward_model=/tmp"], r"^grpo\.reward_model='/tmp': read only"),
    (
        ["stages=sft,ppo", "ppo.reward_source=judge", "ppo.reward_model=/tmp"],
        r"^ppo\.reward_model='/tmp': read only with ppo\.reward_source=reward_model or prm",
    ),
    (
        ["dpo.lora.rank=0", "dpo.lora.alpha=3"],
        r"^dpo\.lora\.alpha=3\.0: dpo\.lora\.rank=0 trains every weight without LoRA",
    ),
    (["grpo.lora.rank=0", "grpo.lora.targets=q"], r"^grpo\.lora\.targets=q: grpo\.lora"),
    (["sft.lora.rank=0", "sft.lora.use_dora=true"], r"^sft\.lora\.use_dora=True: sft\.lora"),
    (
        ["distill.lmbda=0", "distill.temperature=0.7"],
        r"^distill\.temperature=0\.7: samples the on-policy completions only",
    ),
    (["reward.ensemble_penalty=0.5"], r"^reward\.ensemble_penalty=0\.5: combines the members"),
    (["reward.ensemble_mode=min"], r"^reward\.ensemble_mode='min': combines the members"),
    (
        ["reward.ensemble=2", "reward.ensemble_penalty=0.5", "reward.ensemble_mode=min"],
        r"^reward\.ensemble_penalty=0\.5: weighs the members' spread in ensemble_mode std or var",
    ),
    (["ops.rollback=false", "ops.lr_backoff=2"], r"^ops\.lr_backoff=2\.0: applies to the"),
    (["ops.rollback=false", "ops.max_rollbacks=1"], r"^ops\.max_rollbacks=1: applies to the"),
    (["ops.tracker_group=g"], r"^ops\.tracker_group='g': no tracker of the run groups runs"),
    (
        ["ops.tracker_group=g", "ops.trackers=tensorboard"],
        r"^ops\.tracker_group='g': no tracker of the run groups runs",
    ),
]


@pytest.mark.parametrize(("overrides", "message"), BUILTIN_REFUSED)
def test_a_setting_the_built_in_task_does_not_read_is_refused(overrides, message):
    with pytest.raises(pl.ConfigError, match=message):
        _validate(overrides)


DATA_REFUSED = [
    ("dpo", ["label_noise=0.2"], r"^label_noise=0\.2: applies to the built-in task's noisy"),
    ("reward", ["data.eval_prompts=3"], r"^data\.eval_prompts=3: the reward stage does not"),
    ("dpo", ["data.assistant_turns=last"], r"^data\.assistant_turns='last': the dpo stage"),
    ("reward", ["eval_samples=3"], r"^eval_samples=3: the reward stage's held-out evaluation"),
    ("dpo", ["ops.eval_every=2"], r"^ops\.eval_every=2: a data-file run has no periodic"),
    ("sft", ["sft.samples=3"], r"^sft\.samples=3: applies to the built-in task's sampled"),
    ("dpo", ["dpo.rounds=2"], r"^dpo\.rounds=2: applies to the built-in task's sampled"),
    ("kto", ["kto.samples=3"], r"^kto\.samples=3: applies to the built-in task's sampled"),
    ("reward", ["reward.pairs_per_prompt=2"], r"^reward\.pairs_per_prompt=2: applies to the"),
    ("dpo", ["judge.template={completion}"], r"^judge\.template='\{completion\}': no stage"),
    ("reward", ["sampling.max_new_tokens=8"], r"^sampling\.max_new_tokens=8: the reward stage"),
    ("prm", ["sampling.temperature=0.5"], r"^sampling\.temperature=0\.5: the prm stage samples"),
]


@pytest.mark.parametrize(("stage", "overrides", "message"), DATA_REFUSED)
def test_a_setting_a_data_file_run_does_not_read_is_refused(pairs, stage, overrides, message):
    with pytest.raises(pl.ConfigError, match=message):
        _validate([*overrides, f"data.path={pairs}"], stage=stage)


def test_the_defaults_and_the_settings_that_are_read_pass(pairs):
    _validate([])  # the built-in pipeline, every default
    for stage in ("sft", "reward", "dpo", "kto"):
        _validate([f"data.path={pairs}"], stage=stage)
    _validate([f"data.path={pairs}", "sampling.prompt_length=16"], stage="reward")
    _validate(["stages=sft,dpo", "ops.eval_every=2"])  # DPO is evaluated against SFT
    _validate(["dpo.lora.rank=0"])  # the task's adapter settings stay, unread
    _validate(["dpo.lora.rank=0", "dpo.lora.alpha=32", "dpo.lora.dropout=0.05"])  # usual ones
    _validate(["stages=sft,grpo", "grpo.reward_source=judge", "judge.score=prob"])
    _validate(["ops.tracker_group=g", "ops.trackers=tensorboard,mlflow"])
    _validate(["distill.lmbda=0"])
    _validate(["distill.lmbda=0", "distill.seq_kd=true", "distill.temperature=0.7"])  # teacher's
    _validate(["ops.rollback=false", "ops.loss_spike=5", "ops.kl_spike=3"])  # spikes noted
    _validate(["reward.ensemble=2", "reward.ensemble_penalty=0.5", "reward.ensemble_mode=var"])
    _validate(["reward.ensemble=2", "reward.ensemble_mode=min"])
    _validate(["data.chat_template=none"])  # `rlhf_eqx sample` renders its prompts with it
    read = ["data.eval_prompts=3", "eval_samples=2", "data.limit=6", "dpo.beta=0.2"]
    _validate([*read, f"data.path={pairs}"], stage="dpo")
    _validate([f"data.path={pairs}", "data.assistant_turns=last"], stage="sft")


def test_the_command_line_refuses_before_it_shows_the_config(pairs, capsys):
    assert main(["sft", "--set", "data.limit=5", "--show-config"]) == 2
    assert "data.limit=5: applies to a data file" in capsys.readouterr().err
    assert main(["dpo", "--data", pairs, "--set", "dpo.samples=2", "--show-config"]) == 2
    assert "dpo.samples=2: applies to the built-in task's" in capsys.readouterr().err
