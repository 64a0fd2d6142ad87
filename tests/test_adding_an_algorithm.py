"""docs/pipelines.md's worked example ("Adding an algorithm"), run as written: its code
blocks become a package, and the new `margin-hinge` stage runs through the command line
on the built-in task and on a small preference file, with its own setting; its loss is
checked against the closed form `max(0, margin - beta * h)`."""

import importlib
import json
import math
import pathlib
import re
import sys

import jax
import numpy as np
import pytest

from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "pipelines.md"
PACKAGE = "margin_hinge"


def _example_files() -> dict[str, str]:
    """`{file name: source}` of the section's code blocks that open with `# margin_hinge/FILE`."""
    text = DOC.read_text()
    section = text[text.index("### Adding an algorithm") :]
    section = section[: section.index("\n## ")]
    files = {}
    for block in re.findall(r"```python\n(.*?)```", section, flags=re.S):
        first, _, body = block.partition("\n")
        m = re.fullmatch(rf"# {PACKAGE}/(\w+\.py)", first.strip())
        if m:
            files[m[1]] = body
    return files


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    root = tmp_path_factory.mktemp("example")
    (root / PACKAGE).mkdir()
    for name, source in _example_files().items():
        (root / PACKAGE / name).write_text(source)
    sys.path.insert(0, str(root))
    try:
        yield importlib.import_module(PACKAGE)
    finally:
        pl.config.unregister_stage("margin-hinge")
        sys.path.remove(str(root))
        for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
            del sys.modules[name]


def test_the_example_is_three_files_and_three_exports():
    files = _example_files()
    assert sorted(files) == ["__init__.py", "loss.py", "stage.py", "step.py"]
    exports = [line for line in files["__init__.py"].splitlines() if line.strip()]
    assert len(exports) == 3 and all(line.startswith("from .") for line in exports)


def test_the_loss_is_the_closed_form(example):
    c, r, rc, rr = jax.random.normal(jax.random.key(0), (4, 64)) * 3.0
    beta, margin = 0.3, 0.7
    got = jax.vmap(lambda *a: example.margin_hinge_loss(*a, beta=beta, margin=margin))(c, r, rc, rr)
    h = np.asarray((c - rc) - (r - rr))
    np.testing.assert_allclose(np.asarray(got), np.maximum(0.0, margin - beta * h), rtol=1e-6)
    assert (np.asarray(got) == 0).any() and (np.asarray(got) > 0).any()  # both sides of the hinge


def test_its_settings_are_checked_before_the_run(example, capsys):
    """A value the step could not run (another loss type, which takes no `margin`) stops
    the command line with one line naming the field, before anything is compiled."""
    for value, message in [
        ("loss_type=sigmoid", "margin-hinge.loss_type='sigmoid': must be margin_hinge"),
        ("margin=-1", "margin-hinge.margin=-1.0: must be > 0"),
        ("nope=1", "margin-hinge.nope: unknown field"),
    ]:
        assert main(["margin-hinge", "--set", f"margin-hinge.{value}", "--show-config"]) == 2
        assert message in capsys.readouterr().err
    assert main(["margin-hinge", "--set", "margin-hinge.margin=0.5", "--show-config"]) == 0
    assert json.loads(capsys.readouterr().out)["margin-hinge"]["margin"] == 0.5


_DATA = ["--quiet", "--set", "ops.monitor=false", "--set", "eval_samples=1"]
_DATA += ["--set", "sampling.max_new_tokens=8"]
_HINGE = ["--set", "margin-hinge.steps=2", "--set", "margin-hinge.batch_size=4"]
_SMALL = [*_DATA, "--set", "sft.steps=2", *_HINGE]  # on the built-in task, after SFT


def _first_loss(out: pathlib.Path) -> float:
    records = pl.tools.read_metrics(str(out))["margin-hinge"]
    return records[0]["loss"]


@pytest.mark.slow
def test_the_stage_runs_from_the_cli_on_the_builtin_task(example, tmp_path, capsys):
    assert main(["margin-hinge", "--help"]) == 0
    text = capsys.readouterr().out
    assert "margin-hinge.margin = 1.0" in text and "margin-hinge.lora.rank = 8" in text
    assert main(["margin-hinge", "--set", "margin-hinge.margin=0", "--show-config"]) == 2
    assert "margin-hinge.margin=0.0: must be > 0" in capsys.readouterr().err
    out = tmp_path / "task"
    argv = ["margin-hinge", "--out", str(out), *_SMALL, "--set", "margin-hinge.margin=0.7"]
    argv += ["--set", "margin-hinge.rounds=1", "--set", "margin-hinge.samples=2"]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["margin-hinge"]["stopped"] == "done"
    assert 0 <= summary["margin-hinge"]["score"] <= 1
    config = json.loads((out / "config.json").read_text())
    assert config["stages"] == ["sft", "margin-hinge"]
    assert config["margin-hinge"]["margin"] == 0.7 and config["margin-hinge"]["lora"]["rank"] == 8
    # policy == reference at the first step (LoRA's B = 0): h = 0, the loss is the margin
    assert math.isclose(_first_loss(out), 0.7, abs_tol=1e-5)
    assert (out / "margin-hinge" / "hf" / "config.json").exists()


@pytest.mark.slow
def test_the_stage_runs_from_the_cli_on_a_preference_file(example, tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    animals = ["cat", "dog", "bird", "fox"]
    with open(pairs, "w") as f:
        for i in range(16):
            prompt = f"Once upon a time there was a little girl number {i}."
            chosen = f" She saw a {animals[i % 4]} in the park."
            f.write(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": " She sat."}))
            f.write("\n")
    out = tmp_path / "data"
    argv = ["margin-hinge", "--data", str(pairs), "--out", str(out), *_DATA, *_HINGE]
    argv += ["--set", "margin-hinge.margin=1.5", "--set", "margin-hinge.beta=0.2"]
    assert main(argv) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["stages"] == ["margin-hinge"] and config["margin-hinge"]["beta"] == 0.2
    assert math.isclose(_first_loss(out), 1.5, abs_tol=1e-5)
    assert len(pl.tools.read_metrics(str(out))["margin-hinge"]) == 2
    assert (out / "margin-hinge" / "hf" / "config.json").exists()
    # held-out metrics as `dpo --data` reports them (its summary entry's keys)
    held = json.loads((out / "summary.json").read_text())["margin-hinge"]
    assert 0.0 <= held["heldout_reward_accuracy"] <= 1.0
    assert held["heldout_reward_accuracy_se"] >= 0.0 and held["sampled"]


def test_the_stage_holds_out_pairs_of_a_preference_file_as_dpo_does(example, tmp_path, capsys):
    """One prompt cannot be split into training and held-out pairs: the stage stops, as
    `dpo --data` does, naming `data.heldout_fraction` (before anything is compiled)."""
    pairs = tmp_path / "one_prompt.jsonl"
    row = {"prompt": "Once upon a time", "chosen": " a cat sat.", "rejected": " it rained."}
    pairs.write_text((json.dumps(row) + "\n") * 8)
    for stage, own in (("dpo", []), ("margin-hinge", _HINGE)):
        argv = [stage, "--data", str(pairs), "--out", str(tmp_path / stage), *_DATA, *own]
        assert main(argv) != 0
        assert "data.heldout_fraction=0.1: the split of the 8 records" in capsys.readouterr().err
