"""Datasets as users have them: Parquet files, Arrow IPC files (stream and file formats)
and `datasets` `save_to_disk` directories, written by `datasets` and pyarrow themselves,
read into the same records as the same rows in JSON lines; errors naming the file, row
and column; the column mapping; a data-file run on a Parquet file."""

import gzip
import json
import os
import re

import pytest

from rlhf_eqx import data

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
pytest.importorskip("pyarrow.ipc")

datasets.disable_progress_bars()


def _jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def _ipc(path, rows, *, stream):
    table = datasets.Dataset.from_list(rows).data.table
    with pa.OSFile(str(path), "wb") as sink:
        new = pa.ipc.new_stream if stream else pa.ipc.new_file
        with new(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=3)  # several record batches
    return str(path)


def _save(path, rows, **kwargs):
    datasets.Dataset.from_list(rows).save_to_disk(str(path), **kwargs)
    return str(path)


def _parquet(path, rows):
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


WRITERS = {
    "parquet": lambda d, rows: _parquet(d / "rows.parquet", rows),
    "arrow-stream": lambda d, rows: _ipc(d / "rows.arrow", rows, stream=True),
    "arrow-file": lambda d, rows: _ipc(d / "rows.arrow", rows, stream=False),
    "save_to_disk": lambda d, rows: _save(d / "saved", rows),
    "save_to_disk-2-shards": lambda d, rows: _save(d / "saved", rows, num_shards=min(2, len(rows))),
}

_MSG = [{"role": "user", "content": "Hi there"}]

# Hand-written rows of every kind and TRL layout, with the reader that takes them.
KINDS = {
    "standard preferences": (
        data.load_preferences,
        [
            {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
            {"prompt": "Two and two", "chosen": " make four.", "rejected": " make five."},
            {"prompt": "Same", "chosen": " x", "rejected": " x"},  # skipped: identical
        ],
    ),
    "hh transcripts (implicit prompt)": (
        data.load_preferences,
        [
            {
                "chosen": "\n\nHuman: Hi\n\nAssistant: Hello!",
                "rejected": "\n\nHuman: Hi\n\nAssistant: Go away.",
            },
            {"chosen": "no turns here", "rejected": "nor here"},  # skipped: unsplittable
        ],
    ),
    "conversational preferences": (
        data.load_preferences,
        [
            {
                "prompt": _MSG,
                "chosen": [{"role": "assistant", "content": "Hello!"}],
                "rejected": [{"role": "assistant", "content": "Go away."}],
            },
            {  # no prompt in this row: datasets writes a null, read as absent
                "chosen": [*_MSG, {"role": "assistant", "content": "Hi!"}],
                "rejected": [*_MSG, {"role": "assistant", "content": "No."}],
            },
        ],
    ),
    "conversational preferences (implicit prompt)": (
        data.load_preferences,
        [
            {
                "chosen": [
                    {"role": "system", "content": "Be kind."},
                    *_MSG,
                    {"role": "assistant", "content": "Hello!"},
                ],
                "rejected": [
                    {"role": "system", "content": "Be kind."},
                    *_MSG,
                    {"role": "assistant", "content": "Bye."},
                ],
            }
        ],
    ),
    "sharegpt preferences": (
        data.load_preferences,
        [
            {
                "conversations": [{"from": "human", "value": "Hi"}],
                "chosen": {"from": "gpt", "value": "Hello!"},
                "rejected": {"from": "gpt", "value": "Bye."},
            }
        ],
    ),
    "prompts with answers": (
        data.load_prompts,
        [{"prompt": "What is 2 + 2?", "answer": "4"}, {"prompt": "Say hi."}],
    ),
    "conversational prompts": (
        data.load_prompts,
        [{"prompt": [{"role": "system", "content": "Be brief."}, *_MSG]}],
    ),
    "gsm8k prompts": (
        data.load_prompts,
        [{"question": "What is 3 * 4?", "answer": "3 * 4 = 12\n#### 12"}],
    ),
    "mt-bench prompts": (
        data.load_prompts,
        [{"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]}],
    ),
    "unpaired": (
        data.load_unpaired,
        [
            {"prompt": "The sky is", "completion": " blue.", "label": True},
            {"prompt": "The sky is", "completion": " green.", "label": False},
            {"prompt": "Empty", "completion": "  ", "label": True},  # skipped: empty
        ],
    ),
    "conversational unpaired": (
        data.load_unpaired,
        [
            {
                "prompt": _MSG,
                "completion": [{"role": "assistant", "content": "Hello!"}],
                "label": True,
            }
        ],
    ),
    "stepwise": (
        data.load_stepwise,
        [
            {"prompt": "2+3*4?", "completions": ["3*4 = 12", "2+12 = 15"], "labels": [True, False]},
            {"prompt": "1+1?", "completions": [], "labels": []},  # skipped: no steps
        ],
    ),
}


def _summary(dataset):
    r = dataset.report
    return r.format, r.read, r.kept, r.skipped


@pytest.mark.parametrize("writer", sorted(WRITERS))
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_row_reads_as_the_same_record_as_its_json_line(tmp_path, kind, writer):
    read, rows = KINDS[kind]
    expected = read(_jsonl(tmp_path / "rows.jsonl", rows))
    got = read(WRITERS[writer](tmp_path, rows))
    assert list(got) == list(expected) and len(got) > 0
    assert _summary(got) == _summary(expected)
    assert type(got) is type(expected)


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_nested_objects_read_without_the_nulls_their_table_gives_them(tmp_path, writer):
    # an Arrow struct column has every key of every row's object, null where a row's
    # object lacks it: two tool calls with other argument names must not train `null`s
    def call(name, arguments):
        return {"type": "function", "function": {"name": name, "arguments": arguments}}

    rows = [
        {
            "messages": [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [call("w", {"city": "Oslo"})]},
                {"role": "tool", "content": "Rain."},
                {"role": "assistant", "content": "It rains."},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": "Add."},
                {"role": "assistant", "content": "", "tool_calls": [call("add", {"a": 1, "b": 2})]},
                {"role": "tool", "content": "3"},
                {"role": "assistant", "content": "3."},
            ]
        },
    ]  # fmt: skip
    read = lambda path: data.load_demonstrations(path, template="chatml", assistant_turns="all")
    expected = read(_jsonl(tmp_path / "rows.jsonl", rows))
    got = read(WRITERS[writer](tmp_path, rows))
    assert list(got) == list(expected) and len(got) == 2
    assert all("null" not in r.completion for r in got)


def _hh_rows(shared_dir, n=20):
    path = os.path.join(shared_dir, "data", "hh-rlhf", "harmless-base", "test.jsonl.gz")
    if not os.path.isfile(path):
        pytest.skip(f"{path} is not present")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(next(f)) for _ in range(n)]


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_hh_rlhf_rows_read_the_same_from_every_format(shared_dir, tmp_path, writer):
    rows = _hh_rows(shared_dir)
    expected = data.load_preferences(_jsonl(tmp_path / "hh.jsonl", rows))
    got = data.load_preferences(WRITERS[writer](tmp_path, rows))
    assert len(expected) >= 15 and list(got) == list(expected)
    assert _summary(got) == _summary(expected) and got.report.format == "hh"
    # The same data-quality report, with and without a tokenizer.
    tok = data.ByteTokenizer()
    lengths = data.SequenceLengths(max_length=256, max_prompt_length=128)
    assert (
        data.preference_quality(got, tokenizer=tok, lengths=lengths).summary()
        == data.preference_quality(expected, tokenizer=tok, lengths=lengths).summary()
    )
    assert data.preference_quality(got) == data.preference_quality(expected)


def test_hh_rlhf_read_with_datasets_own_parquet_reader_matches(shared_dir, tmp_path):
    # The file datasets writes, read back by datasets itself and by the reader here.
    rows = _hh_rows(shared_dir)
    path = _parquet(tmp_path / "hh.parquet", rows)
    back = datasets.Dataset.from_parquet(path, cache_dir=str(tmp_path / "cache"))
    assert back.to_list() == rows
    assert list(data.load_preferences(path)) == [
        data.PreferenceRecord(*data.split_hh_transcript(r["chosen"], r["rejected"]))
        for r in rows
        if data.split_hh_transcript(r["chosen"], r["rejected"]) is not None
        and r["chosen"] != r["rejected"]
    ]


def test_a_dataset_dict_directory_reads_the_split_asked_for(tmp_path):
    train = [{"prompt": f"p{i}", "chosen": " a", "rejected": " b"} for i in range(5)]
    test = [{"prompt": "q", "chosen": " c", "rejected": " d"}]
    folder = tmp_path / "dd"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(train), "test": datasets.Dataset.from_list(test)}
    ).save_to_disk(str(folder))
    assert list(data.load_preferences(f"{folder}:test")) == [data.PreferenceRecord("q", " c", " d")]
    assert len(data.load_preferences(folder, split="train")) == 5
    assert len(data.load_preferences(f"{folder}:train", split="train")) == 5
    with pytest.raises(
        data.DataError,
        match=re.escape(f"{folder}: a DatasetDict with the splits ['train', 'test']; choose one"),
    ):
        data.load_preferences(folder)
    with pytest.raises(data.DataError, match=re.escape(f"{folder}: no split 'dev' (splits: ")):
        data.load_preferences(f"{folder}:dev")
    with pytest.raises(data.DataError, match="differs from split='test'"):
        data.load_preferences(f"{folder}:train", split="test")
    one = tmp_path / "one"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(test)}).save_to_disk(str(one))
    assert len(data.load_preferences(one)) == 1  # a single split needs no name
    # The files a run fingerprints: every split's without a split, one split's with one.
    assert len(data.dataset_files(folder, all_splits=True)) == 2
    with pytest.raises(data.DataError, match="choose one"):
        data.dataset_files(folder)
    assert data.dataset_files(f"{folder}:test") == [
        str(folder / "test" / "data-00000-of-00001.arrow")
    ]
    with pytest.raises(data.DataError, match="needs a directory written by DatasetDict"):
        data.load_preferences(_jsonl(tmp_path / "p.jsonl", test), split="train")


def test_column_mapping_reads_other_names_in_every_format(tmp_path):
    rows = [
        {"instruction": "The sky is", "response_a": " blue.", "response_b": " green."},
        {"instruction": "Two and two", "response_a": " four.", "response_b": " five."},
    ]
    columns = {"prompt": "instruction", "chosen": "response_a", "rejected": "response_b"}
    expected = [
        data.PreferenceRecord("The sky is", " blue.", " green."),
        data.PreferenceRecord("Two and two", " four.", " five."),
    ]
    paths = [_jsonl(tmp_path / "rows.jsonl", rows), _parquet(tmp_path / "rows.parquet", rows)]
    paths.append(_save(tmp_path / "saved", rows))
    for path in paths:
        assert list(data.load_preferences(path, columns=columns)) == expected
    # Swapping two fields swaps them, and a file column named like a field but not
    # mapped gives way to the mapped one.
    swapped = data.load_preferences(
        paths[1], columns={**columns, "chosen": "response_b", "rejected": "response_a"}
    )
    assert [r.chosen for r in swapped] == [" green.", " five."]
    canonical = [{"prompt": "p", "chosen": " a", "rejected": " b"}]
    assert list(
        data.load_preferences(
            _parquet(tmp_path / "c.parquet", canonical),
            columns={"chosen": "rejected", "rejected": "chosen"},
        )
    ) == [data.PreferenceRecord("p", " b", " a")]
    # Other kinds: unpaired, prompts, stepwise.
    kto = [{"q": "The sky is", "reply": " blue.", "thumbs_up": True}]
    got = data.load_unpaired(
        _parquet(tmp_path / "kto.parquet", kto),
        columns={"prompt": "q", "completion": "reply", "label": "thumbs_up"},
    )
    assert list(got) == [data.UnpairedRecord("The sky is", " blue.", True)]
    got = data.load_prompts(
        _jsonl(tmp_path / "p.jsonl", [{"problem": "1+1?", "solution": "2"}]),
        columns={"prompt": "problem", "answer": "solution"},
    )
    assert list(got) == [data.PromptRecord("1+1?", "2")]
    got = data.load_stepwise(
        _parquet(tmp_path / "s.parquet", [{"prompt": "x", "steps": ["a"], "ok": [True]}]),
        columns={"completions": "steps", "labels": "ok"},
    )
    assert list(got) == [data.StepwiseRecord("x", ("a",), (True,))]


def test_column_mapping_errors_name_the_files_columns(tmp_path):
    rows = [
        {"instruction": "p", "response_a": " a", "response_b": " b"},
        {"instruction": "p", "response_a": None, "response_b": " b"},
    ]
    columns = {"prompt": "instruction", "chosen": "response_a", "rejected": "response_b"}
    path = _parquet(tmp_path / "rows.parquet", rows)
    with pytest.raises(
        data.DataError, match=f"^{re.escape(path)}: row 1: column 'response_a' is null$"
    ):
        data.load_preferences(path, columns=columns)
    jsonl = _jsonl(tmp_path / "rows.jsonl", [rows[0], {"instruction": "p", "response_b": " b"}])
    with pytest.raises(
        data.DataError, match=re.escape(f"{jsonl}:2: missing key: no 'response_a' in a record")
    ):
        data.load_preferences(jsonl, columns=columns)
    with pytest.raises(
        data.DataError,
        match=re.escape(
            f"{path}: column 'answer_a' (read as 'chosen') is missing "
            "(columns: instruction, response_a, response_b)"
        ),
    ):
        data.load_preferences(path, columns={**columns, "chosen": "answer_a"})
    with pytest.raises(data.DataError, match=r"^columns: unknown field 'chosn' \(known: prompt, "):
        data.load_preferences(path, columns={"chosn": "response_a"})
    assert data.COLUMN_NAMES[:3] == ("prompt", "chosen", "rejected")


def test_errors_name_the_file_row_and_column(tmp_path):
    good = {"prompt": "p", "chosen": " a", "rejected": " b"}
    rows = [good] * 17 + [{"prompt": "p", "chosen": None, "rejected": " b"}]
    path = _parquet(tmp_path / "data.parquet", rows)
    with pytest.raises(
        data.DataError, match=f"^{re.escape(path)}: row 17: column 'chosen' is null$"
    ):
        data.load_preferences(path)
    # Lenient: the row is skipped and counted under the reason a JSON line would get.
    lenient = data.load_preferences(path, lenient=True)
    assert len(lenient) == 17 and lenient.report.skipped == {"missing key": 1}
    assert lenient.report.examples == [f"{path}: row 17: missing key (column 'chosen' is null)"]
    # A column the file does not have.
    missing = _parquet(tmp_path / "missing.parquet", [{"prompt": "p", "rejected": " b"}])
    with pytest.raises(
        data.DataError,
        match=f"^{re.escape(missing)}: row 0: column 'chosen' is missing "
        r"\(columns: prompt, rejected\)$",
    ):
        data.load_preferences(missing, format="plain")
    # A column of the wrong type.
    typed = _parquet(tmp_path / "typed.parquet", [{"prompt": "p", "chosen": " a", "rejected": 3}])
    with pytest.raises(
        data.DataError,
        match=f"^{re.escape(typed)}: row 0: column 'rejected' must be a string, got int$",
    ):
        data.load_preferences(typed)
    label = _parquet(
        tmp_path / "label.parquet", [{"prompt": "p", "completion": " a", "label": "yes"}]
    )
    with pytest.raises(data.DataError, match=r"row 0: column 'label' must be a boolean"):
        data.load_unpaired(label)
    steps = _save(
        tmp_path / "steps",
        [{"prompt": "p", "completions": ["a"], "labels": [True]}] * 3
        + [{"prompt": "p", "completions": ["a", "b"], "labels": [True]}],
        num_shards=2,
    )
    second = os.path.join(steps, "data-00001-of-00002.arrow")
    with pytest.raises(
        data.DataError, match=f"^{re.escape(second)}: row 1: length mismatch: 2 completions"
    ):
        data.load_stepwise(steps)
    # Row numbers are per file: the same row in a JSON lines file is line 4.
    jsonl = _jsonl(tmp_path / "steps.jsonl", datasets.load_from_disk(steps).to_list())
    with pytest.raises(data.DataError, match=f"^{re.escape(jsonl)}:4: length mismatch"):
        data.load_stepwise(jsonl)


def test_unreadable_files_and_directories_are_named(tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 this is not a parquet file")
    with pytest.raises(
        data.DataError, match=f"^{re.escape(str(bad))}: not a readable Parquet file"
    ):
        data.load_preferences(bad)
    bad_arrow = tmp_path / "bad.arrow"
    bad_arrow.write_bytes(b"\x00" * 64)
    with pytest.raises(data.DataError, match=f"^{re.escape(str(bad_arrow))}: not a readable Arrow"):
        data.load_prompts(bad_arrow)
    empty = _parquet(tmp_path / "empty.parquet", [])
    with pytest.raises(data.DataError, match=f"^{re.escape(empty)}: no records$"):
        data.load_preferences(empty)
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "notes.txt").write_text("hi")
    with pytest.raises(data.DataError, match=f"^{re.escape(str(folder))}: is a directory"):
        data.load_preferences(folder)
    with pytest.raises(data.DataError, match=f"^{re.escape(str(folder))}: is a directory"):
        data.dataset_files(folder)
    # A directory of Parquet files (a hub dataset's layout) is read in name order.
    shards = tmp_path / "shards"
    shards.mkdir()
    _parquet(shards / "train-00001.parquet", [{"prompt": "b", "chosen": " x", "rejected": " y"}])
    _parquet(shards / "train-00000.parquet", [{"prompt": "a", "chosen": " x", "rejected": " y"}])
    assert [r.prompt for r in data.load_preferences(shards)] == ["a", "b"]


def test_a_parquet_file_without_its_suffix_is_recognised(tmp_path):
    rows = KINDS["standard preferences"][1]
    path = _parquet(tmp_path / "rows.parquet", rows)
    plain = tmp_path / "rows.data"
    os.rename(path, plain)
    assert list(data.load_preferences(plain)) == list(
        data.load_preferences(_jsonl(tmp_path / "rows.jsonl", rows))
    )


def _cli_pairs(n=8):
    return [
        {"instruction": f"The cat {i}", "response_a": " sat on a mat.", "response_b": " zz."}
        for i in range(n)
    ]


def test_the_cli_reads_a_parquet_file_through_its_column_mapping(tmp_path, capsys):
    # One pair: the run reads the file and stops at the held-out split (nothing is
    # compiled); without the mapping it stops at the file's columns.
    from rlhf_eqx.__main__ import main

    path = _parquet(tmp_path / "one.parquet", _cli_pairs(1))
    argv = ["dpo", "--data", path, "--out", str(tmp_path / "run"), "--quiet"]
    mapping = ["data.columns.prompt=instruction", "data.columns.chosen=response_a"]
    mapping.append("data.columns.rejected=response_b")
    assert main([*argv, *(a for m in mapping for a in ("--set", m))]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: data.heldout_fraction=0.1: the split of the 1 record of {path} by prompt "
        "left 1 for training and 0 held out; use more records, another fraction or another "
        "data.seed (it picks the prompts held out)"
    ]
    assert main([*argv, "--overwrite"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: {path}: row 0: cannot tell the preference format from the keys "
        "['instruction', 'response_a', 'response_b']; expected 'chosen'/'rejected' (HH "
        "transcripts or message lists), 'prompt'/'chosen'/'rejected', or "
        "'conversations'/'chosen'/'rejected'"
    ]


@pytest.mark.slow
def test_dpo_runs_on_a_parquet_file_with_a_column_mapping(tmp_path, capsys):
    from rlhf_eqx import pipelines as pl
    from rlhf_eqx.__main__ import main

    path = _parquet(tmp_path / "pairs.parquet", _cli_pairs())
    out = tmp_path / "run"
    sets = (
        "data.columns.prompt=instruction",
        "data.columns.chosen=response_a",
        "data.columns.rejected=response_b",
        "data.heldout_fraction=0.25",
        "data.eval_prompts=0",
        "ops.monitor=false",
        "dpo.steps=2",
        "dpo.batch_size=2",
        "dpo.max_length=24",
        "sampling.prompt_length=8",
    )
    argv = ["dpo", "--data", path, "--out", str(out), "--quiet"]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"] == "done" and summary["data"] == path
    assert [r["step"] for r in pl.tools.read_metrics(str(out))["dpo"]] == [0, 1]
    saved = json.loads((out / "config.json").read_text())["data"]
    assert saved["columns"] == {
        "prompt": "instruction",
        "chosen": "response_a",
        "rejected": "response_b",
    }
    fingerprint = json.loads((out / "data.json").read_text())
    assert fingerprint["size"] == os.path.getsize(path)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("rlhf_eqx dpo: done:")


def test_the_data_settings_are_checked_before_a_run(tmp_path):
    from rlhf_eqx import pipelines as pl

    def check(*overrides):
        cfg = pl.apply_overrides(pl.animal_task_config(), list(overrides))
        pl.config.validate_config(cfg, stage="dpo")

    path = _parquet(tmp_path / "pairs.parquet", _cli_pairs())
    check(f"data.path={path}", "data.columns.chosen=response_a")
    with pytest.raises(pl.ConfigError, match=r"data.columns=\{'chosn': 'x'\}: unknown field"):
        check(f"data.path={path}", "data.columns.chosn=x")
    folder = tmp_path / "dd"
    rows = [{"prompt": "p", "chosen": " a", "rejected": " b"}]
    splits = {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows)}
    datasets.DatasetDict(splits).save_to_disk(str(folder))
    check(f"data.path={folder}:test")
    check(f"data.path={folder}", "data.split=train")
    with pytest.raises(pl.ConfigError, match=r"a DatasetDict with the splits \['train', 'test'\]"):
        check(f"data.path={folder}")
    with pytest.raises(pl.ConfigError, match=r"data.split='dev': no split 'dev' \(splits: "):
        check(f"data.path={folder}", "data.split=dev")
    with pytest.raises(pl.ConfigError, match="data.split='train': only applies to a DatasetDict"):
        check("data.split=train")
    # A resumed run refuses a changed split (the fingerprint covers the split's files).
    run = tmp_path / "run"
    run.mkdir()
    pl.tools.check_data(str(run), f"{folder}:test", resume=False)
    pl.tools.check_data(str(run), f"{folder}:test", resume=True)
    datasets.Dataset.from_list(rows * 2).save_to_disk(str(tmp_path / "other"))
    for name in os.listdir(tmp_path / "other"):
        os.replace(tmp_path / "other" / name, folder / "test" / name)
    with pytest.raises(pl.loop.RunDirError, match="cannot resume: the data file"):
        pl.tools.check_data(str(run), f"{folder}:test", resume=True)


def test_every_data_stage_reads_its_kind_from_arrow_files_with_a_mapping(tmp_path, capsys):
    # One record each: the run reads it through the mapping and stops at the held-out
    # split (nothing is compiled); a stage that could not read it names the file.
    from rlhf_eqx.__main__ import main

    kto = _parquet(tmp_path / "kto.parquet", [{"q": "Once", "reply": " a cat", "ok": True}])
    grpo = _ipc(tmp_path / "grpo.arrow", [{"problem": "1+1?", "solution": "2"}], stream=True)
    prm = _save(tmp_path / "prm", [{"prompt": "1+1?", "steps": ["1+1 = 2"], "ok": [True]}])
    runs = {
        "kto": (kto, "prompt=q", "completion=reply", "label=ok"),
        "grpo": (grpo, "prompt=problem", "answer=solution"),
        "prm": (prm, "completions=steps", "labels=ok"),
    }
    for stage, (path, *mapping) in runs.items():
        argv = [stage, "--data", path, "--out", str(tmp_path / stage), "--quiet"]
        assert main([*argv, *(a for m in mapping for a in ("--set", f"data.columns.{m}"))]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(
            f"error: data.heldout_fraction=0.1: the split of the 1 record of {path} by prompt"
        ), (stage, err)
