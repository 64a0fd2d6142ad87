"""Every length of model input a run reads (a stage's `max_length`, the sampled
`sampling.prompt_length + sampling.max_new_tokens`) fits the model's context
(`max_seq_len`: the built-in stories model's 512, a checkpoint's
`max_position_embeddings`), or the run is refused before any step, in one line naming
the settings, their values, the context and the model. Settings the run does not read
are not compared; the built-in pipeline's defaults fit."""

import json
import os

import jax
import pytest

import rlhf_eqx as rx
from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main
from rlhf_eqx.assets import asset_path

DATA_STAGES = ("sft", "reward", "dpo", "kto", "prm", "grpo", "ppo", "distill")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "pairs.jsonl"
    rows = [{"prompt": f"Say {i}.", "chosen": f"A cat {i}.", "rejected": "No."} for i in range(8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _tiny_policy(max_seq_len: int) -> rx.Policy:
    cfg = rx.TransformerConfig(
        vocab_size=512,
        d_model=16,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        d_ff=32,
        max_seq_len=max_seq_len,
    )
    return rx.Policy(cfg, key=jax.random.key(0))


@pytest.fixture(scope="module")
def short_hf(tmp_path_factory):
    """A Hugging Face checkpoint directory of the shipped vocabulary with a context of 64."""
    path = str(tmp_path_factory.mktemp("models") / "short")
    rx.save_hf(_tiny_policy(64), path)
    return path


@pytest.fixture(scope="module")
def teacher_hf(tmp_path_factory):
    """A Hugging Face checkpoint directory with the built-in model's context (512)."""
    path = str(tmp_path_factory.mktemp("models") / "teacher")
    rx.save_hf(_tiny_policy(512), path)
    return path


@pytest.fixture(scope="module")
def short_gguf(tmp_path_factory):
    """A GGUF file of the shipped vocabulary with a context of 64."""
    tok = rx.data.load_tokenizer(asset_path("tok512.bin"))
    path = str(tmp_path_factory.mktemp("models") / "short.gguf")
    rx.save_gguf(_tiny_policy(64), path, tokenizer=tok, dtype="f32")
    return path


def _validate(overrides, stage=None, base=None):
    cfg = pl.apply_overrides(base or pl.animal_task_config(), overrides)
    pl.config.validate_config(cfg, stage=stage)


def _data(pairs, *overrides):
    return [f"data.path={pairs}", *overrides]


@pytest.mark.parametrize("base", [pl.PipelineConfig, pl.animal_task_config])
def test_the_defaults_fit_the_builtin_model(pairs, teacher_hf, base):
    everything = ",".join(s.name for s in pl.config.stages() if s.builtin is not None)
    _validate([f"stages={everything}"], base=base())
    for stage in DATA_STAGES:
        teacher = [f"distill.teacher={teacher_hf}"] if stage == "distill" else []
        _validate(_data(pairs, *teacher), stage=stage, base=base())


@pytest.mark.parametrize(
    ("stage", "overrides", "named"),
    [
        ("sft", ["sft.max_length=600"], "sft.max_length=600 exceeds"),
        ("reward", ["reward.max_length=513"], "reward.max_length=513 exceeds"),
        ("dpo", ["dpo.max_length=1024"], "dpo.max_length=1024 exceeds"),
        ("kto", ["kto.max_length=1024"], "kto.max_length=1024 exceeds"),
        ("prm", ["prm.max_length=4096"], "prm.max_length=4096 exceeds"),
        (
            "kto",
            ["sampling.prompt_length=480", "kto.max_length=500"],
            "sampling.prompt_length=480 + sampling.max_new_tokens=40 = 520 exceeds",
        ),
        (
            "grpo",
            ["sampling.prompt_length=100", "sampling.max_new_tokens=500"],
            "sampling.prompt_length=100 + sampling.max_new_tokens=500 = 600 exceeds",
        ),
        (
            "ppo",
            ["sampling.prompt_length=500"],
            "sampling.prompt_length=500 + sampling.max_new_tokens=40 = 540 exceeds",
        ),
        (
            "dpo",
            ["dpo.max_length=2048", "sampling.prompt_length=480"],
            "dpo.max_length=2048 and sampling.prompt_length=480 + sampling.max_new_tokens=40 "
            "= 520 exceed",
        ),
    ],
)
def test_a_data_file_length_past_the_context_is_refused(pairs, stage, overrides, named):
    with pytest.raises(pl.ConfigError) as e:
        _validate(_data(pairs, *overrides), stage=stage)
    line = str(e.value)
    assert line.startswith(named), line
    assert "the context of the model 'builtin'" in line and "max_seq_len=512" in line
    assert "\n" not in line


def test_a_distillation_length_past_the_context_is_refused(pairs, teacher_hf):
    teacher = f"distill.teacher={teacher_hf}"
    with pytest.raises(pl.ConfigError, match=r"^distill\.max_length=600 exceeds"):
        _validate(_data(pairs, teacher, "distill.max_length=600"), stage="distill")
    long = ["sampling.prompt_length=480", "distill.max_length=500"]
    with pytest.raises(pl.ConfigError, match=r"^sampling\.prompt_length=480 \+ .* = 520 exceeds"):
        _validate(_data(pairs, teacher, *long), stage="distill")
    _validate(_data(pairs, teacher, *long, "distill.lmbda=0"), stage="distill")  # samples none


def test_the_builtin_pipeline_refuses_what_it_reads(pairs):
    with pytest.raises(pl.ConfigError, match=r"^dpo\.max_length=1000 exceeds .*'builtin'"):
        _validate(["stages=sft,dpo", "dpo.max_length=1000"])
    with pytest.raises(pl.ConfigError, match=r"^sampling\.prompt_length=480 \+ .* = 520"):
        _validate(["stages=sft,grpo", "sampling.prompt_length=480", "sft.max_length=500"])
    _validate(["stages=sft", "dpo.max_length=1000"])  # dpo does not run: not read


@pytest.mark.parametrize(
    ("stage", "overrides"),
    [
        ("reward", ["sampling.prompt_length=480", "reward.max_length=500"]),
        ("prm", ["sampling.prompt_length=480", "prm.max_length=500"]),
        ("kto", ["sampling.prompt_length=480", "kto.max_length=500", "data.eval_prompts=0"]),
        ("sft", ["sampling.prompt_length=480", "sft.max_length=500", "data.format=text"]),
        ("reward", ["kto.max_length=4096"]),
    ],
)
def test_lengths_the_run_does_not_read_are_not_compared(pairs, stage, overrides):
    _validate(_data(pairs, *overrides), stage=stage)


def test_a_checkpoint_directory_is_compared_with_its_own_context(pairs, short_hf):
    source = f"model.source={short_hf}"
    _validate(_data(pairs, source, "dpo.max_length=64", "sampling.prompt_length=16"), stage="dpo")
    with pytest.raises(pl.ConfigError) as e:
        _validate(_data(pairs, source), stage="dpo")  # 80, and 32 + 40 = 72
    line = str(e.value)
    assert line.startswith("dpo.max_length=80 and sampling.prompt_length=32 + "), line
    assert f"the context of the model {short_hf!r}" in line and "max_seq_len=64" in line


def test_the_command_line_refuses_before_any_step(pairs, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["kto", "--data", pairs, "--out", str(out), "--quiet", "--set", "kto.max_length=1024"]
    assert main([*argv, "--show-config"]) == 2
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0] == err[1], err
    assert err[0].startswith("error: invalid configuration: kto.max_length=1024 exceeds"), err
    assert "'builtin'" in err[0] and "max_seq_len=512" in err[0]
    assert not out.exists()  # no checkpoint, no metrics


def test_a_gguf_header_gives_its_sizes_without_loading(short_gguf):
    assert rx.models.read_gguf_sizes(short_gguf) == (512, 64)
    try:
        smollm2 = pl.model_path("smollm2-135m")
    except pl.ConfigError:
        return  # its package is not installed
    assert rx.models.read_gguf_sizes(smollm2) == (49152, 8192)


def test_a_gguf_model_is_checked_before_its_run_directory(pairs, short_gguf, tmp_path):
    """A GGUF file's context is read from its metadata header during validation: the
    run stops before its directory is taken."""
    out = tmp_path / "run"
    cfg = pl.apply_overrides(
        pl.PipelineConfig(),
        [f"model.source={short_gguf}", f"data.path={pairs}", f"out={out}", "ops.quiet=true"],
    )
    with pytest.raises(pl.ConfigError) as e:
        pl.run_on_data(cfg, "kto")
    line = str(e.value)
    assert line.startswith("kto.max_length=80 and sampling.prompt_length=32 + "), line
    assert f"the context of the model {short_gguf!r}" in line and "max_seq_len=64" in line
    assert not os.path.exists(out)


def test_the_builtin_pipeline_refuses_a_short_gguf_model(short_gguf, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["--model", short_gguf, "--out", str(out), "--quiet"]
    assert main([*argv, "--show-config"]) == 2
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0] == err[1], err
    assert f"exceed the context of the model {short_gguf!r}" in err[0], err
    assert "max_seq_len=64" in err[0] and "sampling.prompt_length=32 + " in err[0], err
    assert not out.exists()
    # lengths within its context pass
    fits = ["stages=sft", "sampling.prompt_length=16", "sft.max_length=60"]
    _validate([f"model.source={short_gguf}", *fits], base=pl.PipelineConfig())


def test_a_teacher_shorter_than_what_it_scores_is_refused(pairs, short_hf, short_gguf):
    for teacher in (short_hf, short_gguf):
        with pytest.raises(pl.ConfigError) as e:
            _validate(_data(pairs, f"distill.teacher={teacher}"), stage="distill")
        line = str(e.value)
        assert line.startswith("distill.max_length=80 and sampling.prompt_length=32 + "), line
        assert f"the model distill.teacher={teacher!r}: max_seq_len=64" in line, line
    fits = ["distill.max_length=64", "sampling.prompt_length=16", "distill.lmbda=0"]
    _validate(_data(pairs, f"distill.teacher={short_hf}", *fits), stage="distill")


def _reward_model(path, max_seq_len):
    cfg = _tiny_policy(max_seq_len).cfg
    rx.save_hf(rx.RewardModel(cfg, key=jax.random.key(1)), str(path))
    return str(path)


@pytest.mark.parametrize("kind", ["one", "ensemble", "prm"])
def test_a_reward_model_shorter_than_the_samples_is_refused(pairs, tmp_path, kind):
    if kind == "ensemble":
        rm = tmp_path / "ensemble"
        _reward_model(rm / "member_0", 512)
        scored = _reward_model(rm / "member_1", 64)
        (rm / "ensemble.json").write_text(json.dumps({"biases": [0.0, 0.0]}))
    else:
        rm = scored = _reward_model(tmp_path / kind, 64)
    source = "prm" if kind == "prm" else "reward_model"
    if kind == "prm":
        (tmp_path / kind / "prm.json").write_text(json.dumps({"bias": 0.0}))
    for stage in ("ppo", "grpo"):
        sets = [f"{stage}.reward_source={source}", f"{stage}.reward_model={rm}"]
        with pytest.raises(pl.ConfigError) as e:
            _validate(_data(pairs, *sets), stage=stage)
        line = str(e.value)
        assert line.startswith("sampling.prompt_length=32 + sampling.max_new_tokens=40 = 72"), line
        assert f"the model {stage}.reward_model={scored!r}: max_seq_len=64" in line, line
        _validate(_data(pairs, *sets, "sampling.max_new_tokens=32"), stage=stage)


def test_a_judge_shorter_than_the_samples_is_refused(pairs, short_hf):
    sets = ["ppo.reward_source=judge", f"judge.model={short_hf}"]
    with pytest.raises(pl.ConfigError) as e:
        _validate(_data(pairs, *sets), stage="ppo")
    line = str(e.value)
    assert line.startswith("sampling.prompt_length=32 + sampling.max_new_tokens=40 = 72"), line
    assert f"the model judge.model={short_hf!r}: max_seq_len=64" in line, line
