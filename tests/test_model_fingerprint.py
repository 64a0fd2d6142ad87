"""A run records what its model was read from (`model.json`: the files, their size and
SHA-256), and a resume on a model whose files changed is refused, as a resume on changed
data or settings is: the resumed steps would start from weights the first ones never had,
and the reference model would differ."""

import json
import os
import re
import shutil

import pytest

from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main
from rlhf_eqx.assets import asset_path


def _copy_model(tmp_path):
    model = tmp_path / "stories.bin"
    shutil.copy(asset_path("stories260K.bin"), model)
    return model, asset_path("tok512.bin")


def _flip_last_byte(path):
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))


def test_check_model_records_and_compares_the_fingerprint(tmp_path):
    model, tok = _copy_model(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    pl.tools.check_model(str(run), str(model), tok, resume=False)
    stored = json.loads((run / "model.json").read_text())
    assert stored["files"] == [str(model), tok]
    assert stored["size"] == os.path.getsize(model) + os.path.getsize(tok)
    pl.tools.check_model(str(run), str(model), tok, resume=True)  # unchanged: resumes
    _flip_last_byte(model)  # the same size, another weight
    what = re.escape(f"cannot resume: the model (model.source={str(model)!r}")
    with pytest.raises(pl.loop.RunDirError, match=what):
        pl.tools.check_model(str(run), str(model), tok, resume=True)
    pl.tools.check_model(str(run), str(model), tok, resume=False)  # a new run records it
    # a run without a record (an older one) records it when it resumes
    (run / "model.json").unlink()
    pl.tools.check_model(str(run), str(model), tok, resume=True)
    assert (run / "model.json").is_file()


def test_the_files_of_each_kind_of_source(tmp_path):
    assert pl.tools.model_files("builtin") == [
        asset_path("stories260K.bin"),
        asset_path("tok512.bin"),
    ]
    hf = tmp_path / "hf"
    hf.mkdir()
    for name in ["config.json", "model.safetensors", "tokenizer.json", "README.md", "x.bin"]:
        (hf / name).write_text(name)
    assert pl.tools.model_files(str(hf)) == [
        str(hf / n) for n in ["config.json", "model.safetensors", "tokenizer.json"]
    ]
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert pl.tools.model_files(str(gguf), str(hf / "tokenizer.json")) == [
        str(gguf),
        str(hf / "tokenizer.json"),
    ]


@pytest.mark.slow
def test_a_resume_on_a_changed_model_is_refused(tmp_path, capsys):
    model, tok = _copy_model(tmp_path)
    data_file = tmp_path / "text.jsonl"
    data_file.write_text(
        "".join(
            json.dumps({"text": f"Once upon a time there was a cat {i}."}) + "\n" for i in range(12)
        )
    )
    out = tmp_path / "run"
    argv = ["sft", "--data", str(data_file), "--model", str(model), "--tokenizer", tok]
    argv += ["--out", str(out), "--quiet", "--set", "sft.steps=2", "--set", "sft.batch_size=2"]
    assert main(argv) == 0
    original = model.read_bytes()
    _flip_last_byte(model)
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"error: {out}: cannot resume: the model (model.source={str(model)!r}")
    model.write_bytes(original)
    assert main([*argv, "--resume"]) == 0  # the same model again: resumes (finished already)
