"""`rlhf_eqx distill --data FILE` on TRL's layouts: preference pairs (their chosen
responses), prompt-completion and conversational `messages` records (the last assistant
message the completion); language-modelling text, without prompts, is refused."""

import json

import equinox as eqx
import pytest
from helpers import quiet_settings

import rlhf_eqx as rx
from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main
from rlhf_eqx.assets import asset_path

_SMALL = quiet_settings(
    "distill.steps=2",
    "distill.batch_size=4",
    "distill.max_length=40",
    "sampling.prompt_length=16",
    "sampling.max_new_tokens=4",
    "data.heldout_fraction=0.25",
)


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.slow
def test_distill_reads_pairs_prompt_completion_and_messages(tmp_path, capsys):
    policy, _ = pl.tools.load_model("builtin")
    policy = eqx.tree_at(lambda p: p.transformer.final_norm, policy, replace_fn=lambda w: 1.5 * w)
    teacher = tmp_path / "teacher"
    rx.save_hf(policy, teacher)
    pl.runs.copy_tokenizer(asset_path("tok512.bin"), str(teacher))
    prompts = [f"The cat {i}" for i in range(12)]
    files = {
        "pairs": [{"prompt": p, "chosen": " sat on a mat.", "rejected": " zz."} for p in prompts],
        "completions": [{"prompt": p, "completion": " sat on a mat."} for p in prompts],
        "messages": [
            {
                "messages": [
                    {"role": "user", "content": p},
                    {"role": "assistant", "content": " zz."},
                    {"role": "user", "content": "More."},
                    {"role": "assistant", "content": " sat on a mat."},
                ]
            }
            for p in prompts
        ],
    }
    summaries = {}
    for name, rows in files.items():
        out = tmp_path / name
        argv = ["distill", "--data", _write(tmp_path / f"{name}.jsonl", rows), "--out", str(out)]
        argv += [*_SMALL, "--set", f"distill.teacher={teacher}"]
        if name == "messages":  # three turns of prompt
            argv += ["--set", "sampling.prompt_length=64", "--set", "distill.max_length=96"]
        assert main(argv) == 0, name
        summaries[name] = json.loads((out / "summary.json").read_text())
    # the same prompts and completions: the same run
    assert summaries["completions"]["distill"] == summaries["pairs"]["distill"]
    assert summaries["messages"]["data_quality"]["format"] == "messages"
    assert summaries["messages"]["distill"]["heldout_jsd_before"] > 0
    text = _write(tmp_path / "text.jsonl", [{"text": f"The cat {i} sat."} for i in range(12)])
    argv = ["distill", "--data", text, "--out", str(tmp_path / "text"), *_SMALL]
    capsys.readouterr()
    assert main([*argv, "--set", f"distill.teacher={teacher}"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "language-modelling text has no prompt" in err[0]
    assert not (tmp_path / "text").exists()


def test_distill_accepts_the_demonstration_formats_it_reads(tmp_path, capsys):
    """`data.format=prompt_completion` / `messages` pass distill's checks (the teacher is
    the next thing checked); `text` is refused naming what distill does not read."""
    path = _write(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": "b"}])
    base = ["distill", "--data", path, "--set", f"distill.teacher={tmp_path}", "--show-config"]
    for fmt in ("prompt_completion", "messages"):
        assert main([*base, "--set", f"data.format={fmt}"]) == 2
        assert "distill.teacher=" in capsys.readouterr().err
    assert main([*base, "--set", "data.format=text"]) == 2
    assert capsys.readouterr().err == (
        "error: invalid configuration: data.format='text': distill does not read it "
        "(text, preference: sft's demonstrations)\n"
    )
