"""The data readers on datasets as TRL users have them: a table whose first row holds a
null prompt beside `chosen` / `rejected` is a pair with a null prompt (refused by its
row and column, as the JSON line is), never read as implicit-prompt pairs."""

import bz2
import decimal
import json
import lzma
import re
import zipfile

import pytest

from rlhf_eqx import data


def _parquet(path, columns):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table(columns), path)
    return str(path)


_NULL_PROMPT_FIRST = {
    "prompt": [None, "The sea is"],
    "chosen": ["The sky is blue.", " blue."],
    "rejected": ["The sky is green.", " green."],
}


@pytest.mark.parametrize("load", [data.load_preferences, data.load_demonstrations])
def test_a_null_prompt_in_a_tables_first_row_is_refused_by_its_column(tmp_path, load):
    path = _parquet(tmp_path / "pairs.parquet", _NULL_PROMPT_FIRST)
    refusal = f"^{re.escape(path)}: row 0: column 'prompt' is null$"
    with pytest.raises(data.DataError, match=refusal):
        load(path)
    lenient = load(path, lenient=True)  # the other row, as the pair it is
    assert [r.prompt for r in lenient] == ["The sea is"]
    assert lenient.report.skipped == {"missing key": 1}
    lines = tmp_path / "pairs.jsonl"  # the same rows as JSON lines: the same refusal
    rows = [dict(zip(_NULL_PROMPT_FIRST, v)) for v in zip(*_NULL_PROMPT_FIRST.values())]
    lines.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(data.DataError, match=f"^{re.escape(str(lines))}:1: .*'prompt'"):
        load(lines)


@pytest.mark.parametrize("name,value", [("seed", -1), ("num_epochs", -1)])
def test_a_negative_seed_or_epoch_count_is_refused_when_made(name, value):
    with pytest.raises(data.DataError, match=f"^IteratorState.{name} must be >= 0, got -1$"):
        data.BatchIterator(4, 2, **{"seed": 0, name: value})


def test_a_float32_answer_column_reads_as_its_shortest_decimal(tmp_path):
    pa = pytest.importorskip("pyarrow")
    answers = pa.array([0.1, 2.5, None, 3.0], pa.float32())
    path = _parquet(tmp_path / "q.parquet", {"prompt": ["a", "b", "c", "d"], "answer": answers})
    records = data.load_prompts(path)
    assert [r.answer for r in records] == ["0.1", "2.5", None, "3"]
    assert records[0].columns["answer"] == 0.1
    assert data.exact_match_reward(["#### 0.1"], [records[0].answer]).tolist() == [1.0]


def test_a_decimal_answer_column_reads_as_its_number(tmp_path):
    pa = pytest.importorskip("pyarrow")
    answers = pa.array([decimal.Decimal("3.50"), decimal.Decimal("-2.00")], pa.decimal128(5, 2))
    path = _parquet(tmp_path / "q.parquet", {"prompt": ["a", "b"], "answer": answers})
    assert [r.answer for r in data.load_prompts(path)] == ["3.5", "-2"]


@pytest.mark.parametrize(
    "name,indent", [("pairs.json", None), ("pairs.json", 2), ("p.jsonl", None)]
)
def test_a_table_by_columns_is_refused_as_pandas_default_json(tmp_path, name, indent):
    by_columns = {
        k: {"0": v, "1": v} for k, v in {"prompt": "a", "chosen": "b", "rejected": "c"}.items()
    }
    path = tmp_path / name
    path.write_text(json.dumps(by_columns, indent=indent))
    refusal = f"^{re.escape(str(path))}: one object of columns \\(prompt, chosen, rejected\\), each"
    with pytest.raises(data.DataError, match=refusal + ".*orient='records', lines=True\\)$"):
        data.load_preferences(path, lenient=True)


def test_a_directory_without_a_dataset_names_what_it_holds(tmp_path):
    (tmp_path / "train.jsonl").write_text("{}\n")
    with pytest.raises(
        data.DataError, match=r"is a directory; .* \(it holds train.jsonl: give one\)$"
    ):
        data.load_preferences(tmp_path)
    clone = tmp_path / "clone"
    (clone / "data").mkdir(parents=True)
    _parquet(clone / "data" / "train-0.parquet", {"a": [1]})
    hint = f"(its data/ folder holds a dataset's files: give {clone / 'data'})"
    with pytest.raises(data.DataError, match=re.escape(hint) + "$"):
        data.load_prompts(clone)


@pytest.mark.parametrize("include_eos", [True, False])
@pytest.mark.parametrize(
    "source,eos,answer",
    [
        (
            "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content']"
            " + '<|im_end|>\\n' }}{% endfor %}",
            "<|im_end|>",
            "a",
        ),
        (
            "{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
            "{% else %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>{% endif %}"
            "{% endfor %}",
            "<｜end▁of▁sentence｜>",
            "A",
        ),
    ],
)
def test_an_answer_also_in_the_templates_markup_is_masked_where_it_is_said(
    source, eos, answer, include_eos
):
    pytest.importorskip("jinja2")
    template = data.JinjaChatTemplate(source, eos_token=eos)
    messages = [
        {"role": "user", "content": "Pick a or b."},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Again?"},
        {"role": "assistant", "content": answer},
    ]
    chat = template.render_with_assistant_mask(messages, include_eos=include_eos)
    said = answer + (eos if include_eos else "")
    assert [chat.text[a:b] for a, b in chat.spans] == [said, said]
    assert all(chat.text.startswith(eos, a + len(answer)) for a, _ in chat.spans)


def test_hub_split_files_of_one_split_word_are_splits_of_their_own(tmp_path):
    names = {"train_prefs": "a", "train_sft": "b", "test_prefs": "c"}
    for split, prompt in names.items():
        pair = {"prompt": [prompt], "chosen": [" x"], "rejected": [" y"]}
        _parquet(tmp_path / f"{split}-00000-of-00001-0a1b2c.parquet", pair)
    splits = "test_prefs, train_prefs, train_sft"
    with pytest.raises(data.DataError, match=rf"no split 'train' \(.*splits: {splits}\)$"):
        data.load_preferences(f"{tmp_path}:train")  # not train_prefs and train_sft together
    assert [r.prompt for r in data.load_preferences(f"{tmp_path}:train_sft")] == ["b"]
    with pytest.raises(data.DataError, match=r"files of the splits \['test_prefs', "):
        data.load_preferences(tmp_path)


def test_a_trl_prompt_beside_gsm8k_columns_is_the_prompt(tmp_path):
    system = {"role": "system", "content": "End with #### <n>."}
    question = "Tom has 3 apples and buys 2. How many?"
    row = {"question": question, "answer": "3 + 2 = 5\n#### 5"}
    row["prompt"] = [system, {"role": "user", "content": question}]
    path = tmp_path / "grpo.jsonl"
    path.write_text(json.dumps(row) + "\n")
    (record,) = data.load_prompts(path, template="chatml")
    assert record.prompt.startswith("<|im_start|>system\nEnd with #### <n>.<|im_end|>\n")
    assert data.exact_match_reward(["#### 5"], [record.answer]).tolist() == [1.0]
    assert record.columns["question"] == question


class _CountingTokenizer(data.ByteTokenizer):
    """A ByteTokenizer that counts the ids it decodes."""

    decoded = 0

    def decode(self, ids):
        self.decoded += len(ids)
        return super().decode(ids)


def test_token_offsets_of_a_long_text_decode_far_fewer_than_every_prefix():
    text = "héllo wörld, 中文 🤖\n" * 100
    tok = _CountingTokenizer()
    ids, offsets = data.token_offsets(tok, text)
    n = len(ids)
    assert tok.decoded < n * n / 10  # every prefix: n * n / 2
    ends = [len(data.ByteTokenizer().decode(ids[: k + 1])) for k in range(0, n, 97)]
    assert [offsets[k][1] for k in range(0, n, 97)] == [min(e, len(text)) for e in ends]
    assert offsets[-1][1] == len(text) and all(a <= b for a, b in offsets)
    assert "".join(text[a:b] for a, b in offsets) == text


@pytest.mark.parametrize("name", ["pairs.jsonl.bz2", "pairs.json.xz"])
def test_bzip2_and_xz_files_read_as_their_text(tmp_path, name):
    pair = {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}
    text = json.dumps([pair, pair]) if ".json." in name else json.dumps(pair) + "\n"
    compress = bz2.compress if name.endswith(".bz2") else lzma.compress
    path = tmp_path / name
    path.write_bytes(compress(text.encode()))
    records = data.load_preferences(path)
    assert records[0] == data.PreferenceRecord(**pair)
    path.write_bytes(compress(text.encode())[:-8])  # cut short
    with pytest.raises(data.DataError, match=f"^{re.escape(str(path))}: cannot decompress: "):
        data.load_preferences(path)


def test_a_zip_archive_is_refused_as_such(tmp_path):
    path = tmp_path / "pairs.jsonl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("pairs.jsonl", "{}\n")
    with pytest.raises(data.DataError, match=f"^{re.escape(str(path))}: a zip archive; extract"):
        data.load_preferences(path, lenient=True)


def test_a_null_label_in_a_tables_first_row_keeps_it_unpaired_data(tmp_path):
    rows = {"prompt": ["a", "b"], "completion": [" x", " y"], "label": [None, False]}
    path = _parquet(tmp_path / "kto.parquet", rows)
    with pytest.raises(data.DataError, match="keys \\['completion', 'label', 'prompt'\\]"):
        data.load_demonstrations(path)  # not an undesirable completion trained on
    with pytest.raises(data.DataError, match=f"^{re.escape(path)}: row 0: column 'label' is null"):
        data.load_unpaired(path)


def test_an_arrow_file_cut_short_names_the_first_row_it_cannot_read(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pytest.importorskip("pyarrow.ipc")
    rows = [{"prompt": f"p{i}" * 200, "chosen": " a", "rejected": " b"} for i in range(6)]
    table = pa.Table.from_pylist(rows)
    path = tmp_path / "pairs.arrow"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=2):
            writer.write_batch(batch)
    path.write_bytes(path.read_bytes()[:-900])  # into the last batch's body
    refusal = (
        f"^{re.escape(str(path))}: row 4: not a readable Arrow file: .* \\(from this row on\\)$"
    )
    with pytest.raises(data.DataError, match=refusal):
        data.load_preferences(path)


def test_a_conversational_prompt_with_a_text_completion_says_both_must_agree(tmp_path):
    path = tmp_path / "sft.jsonl"
    row = {"prompt": [{"role": "user", "content": "Hi"}], "completion": "Hello."}
    path.write_text(json.dumps(row) + "\n")
    says = ":1: wrong type: 'prompt' is a list of messages but 'completion' is a string; give"
    with pytest.raises(data.DataError, match=f"^{re.escape(str(path) + says)}"):
        data.load_demonstrations(path)


@pytest.mark.parametrize("name", ["pairs.jsonl", "pairs.json"])
def test_a_lone_surrogate_escape_is_refused_by_its_line_and_field(tmp_path, name):
    good = {"prompt": "Hi \\ud83d\\ude00", "chosen": [{"role": "assistant", "content": "a"}]}
    bad = {"prompt": "Hi", "chosen": [{"role": "assistant", "content": "cut \\ud83d"}]}
    rows = [{**r, "rejected": [{"role": "assistant", "content": "b"}]} for r in (good, bad)]
    text = "[" + ",\n".join(json.dumps(r) for r in rows) + "]" if name.endswith(".json") else ""
    text = text or "".join(json.dumps(r) + "\n" for r in rows)
    path = tmp_path / name
    path.write_text(text.replace("\\\\u", "\\u"))  # the JSON escapes \\ud83d, \\ude00
    where = f"{path}:2" + (": item 1" if name.endswith(".json") else "")
    says = "invalid text: 'chosen'[0]['content']: a lone surrogate \\ud83d at character 4"
    with pytest.raises(data.DataError, match=f"^{re.escape(where + ': ' + says)} "):
        data.load_preferences(path)
    kept = data.load_preferences(path, lenient=True)
    assert len(kept) == 1 and kept.report.skipped == {"invalid text": 1}
    assert "\U0001f600" in kept[0].prompt  # a whole pair is a character


def test_a_messages_prompt_beside_string_replies_names_the_mix(tmp_path):
    # TRL's preference layouts keep prompt, chosen and rejected alike: strings or messages
    path = tmp_path / "mixed.jsonl"
    row = {"prompt": [{"role": "user", "content": "hi"}], "chosen": "yes", "rejected": "no"}
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(
        data.DataError, match=r"mixed\.jsonl:1: wrong type: 'prompt' is a list"
    ) as e:
        data.load_preferences(path)
    assert "'chosen' and 'rejected' as lists of messages too" in str(e.value)
