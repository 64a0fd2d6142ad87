"""Stage settings checked before anything is loaded: bounds that depend on other fields
(GRPO's staleness, a multi-turn episode's length), nested sections field by field
(`grpo.rollout_correction.*`), settings a stage inherits but does not use, the judge's
verdict tokens and vocabulary, a distillation teacher's vocabulary, and the sections a
single-stage run on a data file validates."""

import dataclasses
import json

import jax
import numpy as np
import pytest

import rlhf_eqx as rx
from rlhf_eqx import data, pipelines as pl
from rlhf_eqx.__main__ import main
from rlhf_eqx.assets import asset_path


class Loaded(Exception):
    """Raised by the patched model loader: validation let the run reach the model."""


@pytest.fixture
def no_loading(monkeypatch):
    """The model loaders raise `Loaded`: an error raised instead was raised before any
    weights were read."""

    def load(*a, **k):
        raise Loaded(a)

    monkeypatch.setattr(rx, "load_hf", load)
    monkeypatch.setattr(rx, "load_llama2c", load)


def _run(tmp_path, overrides, *, stages=None, on_data=None):
    cfg = pl.apply_overrides(pl.animal_task_config(), overrides)
    cfg = dataclasses.replace(cfg, out=str(tmp_path / "run"))
    if on_data is not None:
        return pl.run_on_data(cfg, on_data)
    if stages is not None:
        cfg = dataclasses.replace(cfg, stages=stages)
    return pl.run_pipeline(cfg)


def _refused(tmp_path, overrides, message, **kw):
    with pytest.raises(pl.ConfigError) as e:
        _run(tmp_path, overrides, **kw)
    assert message in str(e.value), str(e.value)
    assert "\n" not in str(e.value)
    return str(e.value)


def _hf_model(path, vocab: int, *, tokenizer: bool = True):
    cfg = rx.TransformerConfig(
        vocab_size=vocab, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32, max_seq_len=256
    )
    rx.save_hf(rx.Policy(cfg, key=jax.random.key(0)), str(path))
    if tokenizer:  # the shipped 512-token tokenizer beside it
        with open(asset_path("tok512.bin"), "rb") as src, open(path / "tokenizer.bin", "wb") as dst:
            dst.write(src.read())
    return str(path)


# --- GRPO staleness ---------------------------------------------------------------------


def test_a_staleness_no_rollout_reaches_is_refused_naming_the_bound(tmp_path, no_loading):
    msg = _refused(tmp_path, ["grpo.staleness=50", "grpo.rollouts=4"], "grpo.staleness=50: ")
    assert "grpo.rollouts=4" in msg and "< " in msg
    msg = _refused(tmp_path, ["grpo.staleness=4", "grpo.rollouts=4"], "grpo.staleness=4: ")
    assert "grpo.rollouts=4" in msg
    # the documented bound, whatever the rollouts
    msg = _refused(tmp_path, ["grpo.staleness=9", "grpo.rollouts=100"], "grpo.staleness=9: ")
    assert f"<= {pl.runs.MAX_STALENESS}" in msg
    with pytest.raises(Loaded):  # within both bounds: validation passes, the model loads
        _run(tmp_path, ["grpo.staleness=3", "grpo.rollouts=4"], stages=("sft", "grpo"))


# --- settings a stage inherits but does not use -----------------------------------------


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["multiturn.staleness=1"], "multiturn.staleness=1"),
        (["multiturn.overlap=false"], "multiturn.overlap=False"),
        (["multiturn.sampler_device=0"], "multiturn.sampler_device=0"),
        (["multiturn.placement=split"], "multiturn.placement='split'"),
        (["multiturn.dynamic_sampling=2"], "multiturn.dynamic_sampling=2"),
        (["multiturn.overlong_buffer=4"], "multiturn.overlong_buffer=4"),
        (["multiturn.reward_source=judge", "judge.model=/nonexistent"], "multiturn.reward_source"),
        (["multiturn.reward_model=/tmp"], "multiturn.reward_model='/tmp'"),
        (["multiturn.rollout_correction.mode=mask"], "multiturn.rollout_correction="),
    ],
)
def test_multiturn_refuses_the_grpo_settings_it_does_not_use(
    tmp_path, no_loading, overrides, field
):
    msg = _refused(tmp_path, overrides, field, stages=("sft", "multiturn"))
    assert "the multiturn stage does not use" in msg


def test_multiturn_dpo_refuses_max_length_it_does_not_use(tmp_path, no_loading):
    msg = _refused(
        tmp_path,
        ["multiturn-dpo.max_length=200"],
        "multiturn-dpo.max_length=200",
        stages=("sft", "multiturn-dpo"),
    )
    assert "the multiturn-dpo stage does not use" in msg


def test_packing_is_refused_where_the_dpo_stages_sample_their_pairs(tmp_path, no_loading):
    msg = _refused(tmp_path, ["dpo.packing=true"], "dpo.packing=True", stages=("sft", "dpo"))
    assert "applies to offline DPO on a data file" in msg


def test_online_dpo_refuses_packing_for_any_stage(tmp_path):
    """A stage of its own that runs online DPO (a registered one, with its own section)
    is refused too, before anything is sampled."""
    ctx = pl.RunContext(
        ops=pl.OpsConfig(quiet=True),
        log=pl.tools.MetricsLog(str(tmp_path), "mine", quiet=True),
        key=jax.random.key(0),
    )
    policy, tok = pl.tools.load_model("builtin")
    with pytest.raises(pl.ConfigError, match="packing=True: online DPO on the built-in task"):
        pl.runs.run_online_dpo(
            policy, tok, ["a"], lambda *a: [0.0], cfg=pl.DPOConfig(packing=True), ctx=ctx
        )


def test_the_unused_settings_are_listed_by_the_stage_configs():
    assert set(pl.MultiturnConfig.unused_fields) >= {"staleness", "reward_source", "overlap"}
    for cls in (pl.MultiturnConfig, pl.MultiturnDPOConfig):
        names = {f.name for f in dataclasses.fields(cls)}
        assert set(cls.unused_fields) <= names


# --- nested sections, field by field ----------------------------------------------------


@pytest.mark.parametrize(
    "override, message",
    [
        ("mode=bogus", "grpo.rollout_correction.mode='bogus': must be one of truncate, mask"),
        (
            "level=bogus",
            "grpo.rollout_correction.level='bogus': must be one of token, sequence, geometric",
        ),
        ("upper=0.5", "grpo.rollout_correction.upper=0.5: must be a finite number >= 1"),
        ("foo=1", "grpo.rollout_correction.foo: unknown field (known: level, lower, mode, upper)"),
    ],
)
def test_a_nested_section_names_its_sub_field_value_and_choices(override, message):
    with pytest.raises(pl.ConfigError) as e:
        pl.apply_overrides(pl.animal_task_config(), [f"grpo.rollout_correction.{override}"])
    assert str(e.value) == message


def test_a_nested_section_set_field_by_field_builds_the_record():
    cfg = pl.apply_overrides(
        pl.animal_task_config(),
        ["grpo.rollout_correction.mode=mask", "grpo.rollout_correction.lower=0.5"],
    )
    assert cfg.grpo.rollout_correction == rx.losses.RolloutCorrection(mode="mask", lower=0.5)


# --- the judge --------------------------------------------------------------------------


def test_the_built_in_tasks_judge_verdicts_are_single_tokens_of_its_tokenizer():
    j = pl.animal_task_config().judge
    tok = data.load_tokenizer(asset_path("tok512.bin"))
    assert len(tok.encode(j.yes)) == 1 and len(tok.encode(j.no)) == 1
    assert tok.encode(j.yes) != tok.encode(j.no)
    policy, tok = pl.tools.load_model("builtin")
    kw = dict(template=j.template, yes_token=j.yes, no_token=j.no, score=j.score)
    judge = rx.train.judge_reward(policy, tok, **kw)
    scores = judge.score(["Once upon a time,"], [" there was a cat."])
    assert judge.yes_id != judge.no_id and np.isfinite(scores).all()


def test_a_judge_verdict_of_several_tokens_is_refused_at_the_start(tmp_path, no_loading):
    msg = _refused(
        tmp_path,
        ["grpo.reward_source=judge", "judge.yes= Yes"],
        "judge.yes=' Yes': encodes to 4 tokens",
        stages=("sft", "grpo"),
    )
    assert "tok512.bin" in msg
    _refused(
        tmp_path,
        ["ppo.reward_source=judge", "judge.no=y"],
        "judge.no='y': the same token as judge.yes",
        stages=("sft", "ppo"),
    )


def test_a_judge_of_another_vocabulary_is_refused_naming_both_sizes(tmp_path, no_loading):
    judge = _hf_model(tmp_path / "judge", 1000)
    msg = _refused(
        tmp_path,
        ["grpo.reward_source=judge", f"judge.model={judge}"],
        f"judge.model={judge!r}",
        stages=("sft", "grpo"),
    )
    assert "1000" in msg and "512" in msg


def test_the_judge_is_not_checked_when_no_stage_uses_it(tmp_path, no_loading):
    with pytest.raises(Loaded):
        _run(tmp_path, ["judge.yes= Yes"], stages=("sft", "grpo"))


# --- derived limits ---------------------------------------------------------------------


def test_a_multiturn_episode_longer_than_the_model_is_refused_before_sft(tmp_path, no_loading):
    msg = _refused(
        tmp_path,
        ["multiturn.turn_tokens=300"],
        "multiturn.turn_tokens=300",
        stages=("sft", "multiturn"),
    )
    assert "max_seq_len=512" in msg and "multiturn.max_turns=2" in msg
    assert "sampling.prompt_length=32" in msg
    _refused(
        tmp_path,
        ["multiturn-dpo.turn_tokens=300"],
        "multiturn-dpo.turn_tokens=300",
        stages=("sft", "multiturn-dpo"),
    )
    with pytest.raises(Loaded):  # the largest that fits is accepted
        _run(tmp_path, ["multiturn.turn_tokens=200"], stages=("sft", "multiturn"))


# --- distillation teacher ---------------------------------------------------------------


def test_a_teacher_of_another_vocabulary_is_refused_before_loading(tmp_path, no_loading):
    teacher = _hf_model(tmp_path / "teacher", 1000)
    msg = _refused(
        tmp_path,
        [f"distill.teacher={teacher}"],
        f"distill.teacher={teacher!r}",
        stages=("sft", "distill"),
    )
    assert "vocab_size=1000" in msg and "vocab_size=512" in msg


def test_a_loaded_teacher_of_another_vocabulary_names_the_teacher_and_both_sizes(tmp_path):
    small = _hf_model(tmp_path / "small", 256)  # its shipped tokenizer has 512 tokens
    student, _ = pl.tools.load_model("builtin")
    with pytest.raises(pl.ConfigError) as e:
        pl.runs.load_teacher(small, student)
    msg = str(e.value)
    assert msg.startswith(f"distill.teacher={small!r}") and "model.tokenizer" not in msg
    assert "vocab_size=256" in msg and "vocab_size=512" in msg
    same = _hf_model(tmp_path / "same", 512, tokenizer=False)  # no tokenizer file needed
    assert pl.runs.load_teacher(same, student).cfg.vocab_size == 512


# --- every float finite -----------------------------------------------------------------


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_the_ensemble_penalty_must_be_finite(tmp_path, no_loading, value):
    _refused(tmp_path, [f"reward.ensemble_penalty={value}"], f"reward.ensemble_penalty={value}")


# --- a single-stage run on a data file --------------------------------------------------


def test_run_on_data_validates_the_stage_asked_for(tmp_path, no_loading):
    path = tmp_path / "unpaired.jsonl"
    rows = [{"prompt": f"p{i}", "completion": "c", "label": i % 2 == 0} for i in range(8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = [f"data.path={path}", "sampling.prompt_length=192", "kto.max_length=256"]
    # sft's max_length is below the prompt length, but sft does not run
    with pytest.raises(Loaded):
        _run(tmp_path, [*common, "sft.max_length=80"], on_data="kto")
    _refused(tmp_path, [*common, "kto.max_length=100"], "kto.max_length=100", on_data="kto")


def test_the_cli_refuses_with_one_line_before_loading(capsys):
    assert main(["grpo", "--set", "grpo.staleness=50", "--set", "grpo.rollouts=4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "grpo.staleness=50" in err[0]


# --- the help states the bounds ---------------------------------------------------------


def test_the_help_of_the_affected_stages_states_the_bounds_and_defaults(capsys):
    assert main(["grpo", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"at most `MAX_STALENESS` ({pl.runs.MAX_STALENESS}) and below `rollouts`" in out
    assert "judge.yes = y" in out and "single tokens" in out
    assert main(["multiturn", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "must fit the model's `max_seq_len`" in out and "`staleness`, `overlap`" in out
    assert "multiturn.turn_tokens = 40" in out
    assert main(["reward", "--help"]) == 0
    assert "finite number >= 0" in " ".join(capsys.readouterr().out.split())
    assert main(["distill", "--help"]) == 0
    assert "`vocab_size` is checked" in " ".join(capsys.readouterr().out.split())
