"""Settings a data-file stage would not read are refused naming the field: `data.filter`
problems that are not the records' (a pair's `identical` on demonstrations, the pair and
demonstration problems on unpaired KTO examples), and the `sampling` fields a `distill`
run on a data file never reads."""

import json

import pytest

import rlhf_eqx as rx
from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main

_PROMPTS = [f"Tom had a ball {i}" for i in range(12)]


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _error_line(capsys) -> str:
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    return line


@pytest.mark.parametrize("problem", ["identical", "exact_duplicate", "duplicate_prompt"])
def test_kto_unpaired_file_refuses_the_filters_of_pairs_and_demonstrations(
    tmp_path, capsys, problem
):
    rows = [
        {"prompt": p, "completion": " and it was red.", "label": bool(i % 2)}
        for i, p in enumerate(_PROMPTS)
    ]
    out = tmp_path / "run"
    argv = ["kto", "--data", _write(tmp_path / "kto.jsonl", rows), "--out", str(out), "--quiet"]
    argv += ["--set", f"data.filter=empty,{problem}", "--set", "data.heldout_fraction=0.3"]
    assert main(argv) == 2
    line = _error_line(capsys)
    assert line.startswith(
        f"error: invalid configuration: data.filter=empty,{problem}: {problem}: not a "
        "problem of unpaired KTO examples (on an unpaired file only empty and long_prompt apply"
    ), line
    assert not out.exists()  # refused before any step


@pytest.mark.parametrize("stage", ["sft", "distill"])
def test_demonstrations_refuse_the_identical_filter(tmp_path, capsys, stage):
    rows = [{"prompt": p, "completion": " and it was red."} for p in _PROMPTS]
    out = tmp_path / "run"
    argv = [stage, "--data", _write(tmp_path / "pc.jsonl", rows), "--out", str(out), "--quiet"]
    argv += ["--set", "data.filter=identical", "--set", "data.heldout_fraction=0.3"]
    if stage == "distill":  # the teacher: the student's own weights
        policy, _ = pl.tools.load_model("builtin")
        rx.save_hf(policy, tmp_path / "teacher")
        argv += ["--set", f"distill.teacher={tmp_path / 'teacher'}"]
    assert main(argv) == 2
    line = _error_line(capsys)
    assert line.startswith(
        "error: invalid configuration: data.filter=identical: identical: a preference "
        "pair's problem, not a demonstration's"
    ), line


@pytest.mark.parametrize(
    "settings, field",
    [
        (["sampling.temperature=0.5"], "sampling.temperature=0.5"),
        (["distill.lmbda=0.5", "sampling.temperature=0.7"], "sampling.temperature=0.7"),
        (["distill.lmbda=0", "sampling.max_new_tokens=5"], "sampling.max_new_tokens=5"),
        (["distill.lmbda=0", "sampling.slots=4"], "sampling.slots=4"),
    ],
)
def test_distill_on_a_data_file_refuses_the_sampling_it_does_not_read(
    tmp_path, capsys, settings, field
):
    path = _write(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": "b"}])
    argv = ["distill", "--data", path, "--set", f"distill.teacher={tmp_path}", "--show-config"]
    for s in settings:
        argv += ["--set", s]
    assert main(argv) == 2
    assert _error_line(capsys).startswith(f"error: invalid configuration: {field}: ")


def test_distill_on_a_data_file_reads_the_on_policy_sampling(tmp_path, capsys):
    """With `distill.lmbda > 0` the on-policy completions read `max_new_tokens`: not
    refused (the teacher, an empty directory here, is what is refused next)."""
    path = _write(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": "b"}])
    argv = ["distill", "--data", path, "--set", f"distill.teacher={tmp_path}", "--show-config"]
    main([*argv, "--set", "distill.lmbda=0.5", "--set", "sampling.max_new_tokens=5"])
    assert "sampling." not in capsys.readouterr().err
    # so do the teacher's completions of `distill.seq_kd`, without on-policy steps
    main(
        [
            *argv,
            "--set",
            "distill.lmbda=0",
            "--set",
            "distill.seq_kd=true",
            "--set",
            "sampling.max_new_tokens=5",
        ]
    )
    assert "sampling." not in capsys.readouterr().err


@pytest.mark.parametrize("stage", ["sft", "dpo", "kto"])
@pytest.mark.parametrize(
    "setting", ["sampling.temperature=0.7", "sampling.max_new_tokens=9", "eval_samples=3"]
)
def test_no_held_out_prompts_read_no_sampling(tmp_path, capsys, stage, setting):
    """With `data.eval_prompts=0` a data-file sft, dpo or kto run samples nothing: the
    sampling settings and `eval_samples` are refused; with held-out prompts they are read."""
    row = {"prompt": "a", "chosen": "b", "rejected": "c"}
    path = _write(tmp_path / "rows.jsonl", [row])
    argv = [stage, "--data", path, "--set", setting, "--show-config"]
    assert main([*argv, "--set", "data.eval_prompts=0"]) == 2
    field = setting.split("=")[0]
    line = _error_line(capsys)
    assert line.startswith(f"error: invalid configuration: {field}=") and (
        "with data.eval_prompts=0" in line
    ), line
    assert main(argv) == 0
