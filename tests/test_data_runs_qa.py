"""Data-file runs that lose nothing and name what they leave out: `--overwrite` with a
bad data file puts the previous run back; grpo, ppo and distill name the prompts they
drop by their lines; a record no chat template can render is named by its line in
every stage."""

import json

import pytest

import rlhf_eqx as rx
from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main
from rlhf_eqx.assets import asset_path


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _snapshot(root) -> dict:
    """Every file below `root`, by its relative path, with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _finished_run(run) -> None:
    """A run directory as a finished dpo run leaves it: its configuration, step records,
    summary and export."""
    cfg = pl.apply_overrides(pl.PipelineConfig(), [f"out={run}"])
    with pl.tools.open_run_dir(cfg, str(run)):
        steps = [{"stage": "dpo", "iteration": i, "step": i, "loss": 0.69} for i in range(3)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
        (run / "summary.json").write_text('{"stopped": "done"}')
        (run / "dpo" / "hf").mkdir(parents=True)
        (run / "dpo" / "hf" / "config.json").write_text("{}")


def test_overwrite_with_a_bad_data_file_puts_the_previous_run_back(tmp_path, capsys):
    run = tmp_path / "run"
    _finished_run(run)
    before = _snapshot(run)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "Once", "chosen": " a cat", "rejected": " rain"}\n{"prompt": \n')
    argv = ["dpo", "--data", str(bad), "--out", str(run), "--overwrite", "--quiet"]
    assert main([*argv, "--set", "ops.monitor=false"]) == 1
    err = capsys.readouterr().err
    assert f"{bad}:2:" in err  # the data error, named
    assert f"nothing ran: the previous run is back in {run}" in err
    assert _snapshot(run) == before  # the previous run where it was, untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "run"]


# --- prompts a stage leaves out, named by their lines --------------------------------------

_LONG = "Once upon a time there was a little cat who " * 6  # over 32 tokens


def _run_fails_at_the_split(tmp_path, capsys, argv) -> tuple[list[str], list[dict]]:
    """Run `argv` into a directory made first (kept when the run fails) that stops at the
    held-out split (one prompt is left); return its event lines on stderr and its events
    in `metrics.jsonl`."""
    out = tmp_path / "run"
    out.mkdir()
    argv = [*argv, "--out", str(out), "--quiet", "--set", "ops.monitor=false"]
    assert main([*argv, "--set", "sampling.prompt_length=32"]) == 1
    err = capsys.readouterr().err
    assert "the split of the 1 record" in err.splitlines()[-1]
    events = [r for r in pl.tools.read_records(str(out)) if "event" in r]
    return err.splitlines(), events


def test_grpo_names_the_prompts_it_leaves_out_by_their_lines(tmp_path, capsys):
    rows = [
        {"prompt": "Tom had 2 cats.", "answer": 2},
        {"prompt": "Lily saw a dog."},  # no answer: left out by the exact match
        {"prompt": "", "answer": 1},  # the reader skips it
        {"prompt": _LONG, "answer": 3},  # too long
    ]
    path = _write(tmp_path / "q.jsonl", rows)
    err, events = _run_fails_at_the_split(tmp_path, capsys, ["grpo", "--data", path])
    want = (
        f"{path}: 2 of 3 prompts left out: 1 without a reference answer (line 2); 1 longer "
        "than sampling.prompt_length=32 with BOS (line 4); raise "
        "sampling.prompt_length to keep the long ones; grpo.reward_functions=MODULE:NAME "
        "(or another grpo.reward_source) scores prompts without an answer"
    )
    assert f"[grpo] prompts_left_out: {want}" in err
    skipped = f"the reader left out 1 of the 4 records (empty prompt: 1): {path}:3: empty prompt"
    assert f"[grpo] skipped_records: {skipped}" in err
    (left,) = [e for e in events if e["event"] == "prompts_left_out"]
    assert (left["message"], left["left_out_records"]) == (want, "2, 4")
    assert (left["left_out"], left["records"], left["without_answer"], left["long_prompt"]) == (
        2,
        3,
        1,
        1,
    )
    assert [e["message"] for e in events if e["event"] == "skipped_records"] == [skipped]


def test_ppo_names_the_prompts_it_leaves_out_by_their_lines(tmp_path, capsys):
    rows = [{"prompt": "Tom had 2 cats.", "answer": 2}, {"prompt": " "}]
    rows += [{"prompt": _LONG + str(i), "answer": i} for i in range(3)]
    path = _write(tmp_path / "q.jsonl", rows)
    argv = ["ppo", "--data", path, "--set", "ppo.reward_source=task"]
    out = tmp_path / "run"
    out.mkdir()
    argv += ["--out", str(out), "--quiet", "--set", "ops.monitor=false"]
    assert main([*argv, "--set", "sampling.prompt_length=32"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert "training and" in err[-1] and "held-out prompts of" in err[-1]  # one side is empty
    want = (
        f"{path}: 3 of 4 prompts left out: 3 longer than sampling.prompt_length=32 with BOS "
        "(lines 3, 4, 5); raise sampling.prompt_length to keep them"
    )
    assert f"[ppo] prompts_left_out: {want}" in err
    assert any(line.endswith(f"{path}:2: empty prompt") for line in err)
    events = [r for r in pl.tools.read_records(str(out)) if "event" in r]
    (left,) = [e for e in events if e["event"] == "prompts_left_out"]
    assert (left["message"], left["left_out_records"], left["long_prompt"]) == (want, "3, 4, 5", 3)
    assert [e["event"] for e in events] == ["skipped_records", "prompts_left_out"]


def test_distill_names_the_prompts_its_on_policy_steps_cannot_sample_from(tmp_path, capsys):
    teacher = tmp_path / "teacher"
    rx.save_hf(pl.tools.load_model("builtin")[0], teacher)
    pl.runs.copy_tokenizer(asset_path("tok512.bin"), str(teacher))
    rows = [{"prompt": f"{i} {_LONG}", "completion": " sat on a mat."} for i in range(8)]
    path = _write(tmp_path / "pc.jsonl", rows)
    out = tmp_path / "run"
    out.mkdir()
    argv = ["distill", "--data", path, "--out", str(out), "--quiet", "--set", "ops.monitor=false"]
    argv += ["--set", f"distill.teacher={teacher}", "--set", "data.heldout_fraction=0.25"]
    assert main([*argv, "--set", "sampling.prompt_length=32"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert "sampling.prompt_length=32: no training prompt fits" in err[-1]
    events = [r for r in pl.tools.read_records(str(out)) if r.get("event") == "prompts_left_out"]
    (left,) = events
    n = left["records"]
    assert 0 < n < 8 and left["left_out"] == left["long_prompt"] == n  # every training one
    lines = [int(x) for x in left["left_out_records"].split(", ")]
    assert lines == sorted(lines) and len(lines) == min(n, 5) and set(lines) <= set(range(1, 9))
    named = ", ".join(map(str, lines)) + (", ...)" if n > 5 else ")")
    word = "line" if n == 1 else "lines"
    want = f"{n} longer than sampling.prompt_length=32 with BOS ({word} {named}"
    assert left["message"].startswith(f"{path}: {n} of {n} prompts left out: {want}; ")
    assert "distill.lmbda=0.5" in left["message"]
    assert f"[distill] prompts_left_out: {left['message']}" in err


# --- a record the chat template cannot render, named by its line ----------------------------

_PICKY = (  # a template that refuses a message with the word "forbidden"
    "{% for m in messages %}{% if 'forbidden' in m['content'] %}"
    "{{ raise_exception('no forbidden words') }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.mark.parametrize("stage", ["kto", "prm", "ppo", "grpo"])
def test_a_record_the_chat_template_cannot_render_is_named_by_its_line(tmp_path, capsys, stage):
    template = tmp_path / "picky.jinja"
    template.write_text(_PICKY)
    user = lambda text: [{"role": "user", "content": text}]  # noqa: E731
    rows = []
    for i in range(12):
        if stage == "kto":
            reply = [{"role": "assistant", "content": "ran."}]
            rows.append({"prompt": user(f"Tom {i}"), "completion": reply, "label": i % 2 == 0})
        elif stage == "prm":
            rows.append({"prompt": f"Q{i}", "completions": ["s1", "s2"], "labels": [True, False]})
        else:
            rows.append({"prompt": user(f"Tom had {i} cats."), "answer": i})
    bad = rows[9]
    bad["prompt"] = user("a forbidden word") if stage != "prm" else "a forbidden word"
    path = tmp_path / "rows.jsonl"
    path.write_text("\n" + "".join(json.dumps(r) + "\n" for r in rows))  # a blank first line
    argv = [stage, "--data", str(path), "--out", str(tmp_path / "run"), "--quiet"]
    argv += ["--set", f"data.chat_template={template}", "--set", "ops.monitor=false"]
    argv += ["--set", "data.heldout_fraction=0.25"]
    if stage == "ppo":
        argv += ["--set", "ppo.reward_source=task"]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    field = "" if stage == "prm" else "'prompt': "
    assert err[-1] == f"error: {path}:11: {field}chat template: no forbidden words"
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_grpo_run_that_trains_names_what_it_left_out(tmp_path, capsys):
    rows = [{"prompt": f"Tom had {i} cats.", "answer": i} for i in range(8)]
    rows[2] = {"prompt": "Lily saw a dog."}  # no answer
    rows[5] = {"prompt": _LONG, "answer": 5}  # too long
    path = _write(tmp_path / "q.jsonl", rows)
    out = tmp_path / "run"
    argv = ["grpo", "--data", path, "--out", str(out), "--quiet", "--set", "ops.monitor=false"]
    for setting in (
        "grpo.rollouts=1",
        "grpo.prompts_per_rollout=2",
        "grpo.group_size=2",
        "sampling.max_new_tokens=4",
        "sampling.prompt_length=32",
        "data.heldout_fraction=0.25",
    ):
        argv += ["--set", setting]
    assert main(argv) == 0
    (left,) = [r for r in pl.tools.read_records(str(out)) if r.get("event") == "prompts_left_out"]
    assert (left["left_out_records"], left["without_answer"], left["long_prompt"]) == ("3, 6", 1, 1)
    assert f"[grpo] prompts_left_out: {left['message']}" in capsys.readouterr().err
    quality = json.loads((out / "summary.json").read_text())["data_quality"]
    assert (quality["without_answer"], quality["longer_than_prompt_length"]) == (1, 1)
