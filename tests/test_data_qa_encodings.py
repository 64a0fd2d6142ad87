"""Files as editors and tools save them (and cut them): UTF-16 with its byte-order mark
(Windows' "Unicode", PowerShell's `>`) reads as its text, lines counted as in the file; a table
whose first row has a null in a column of the layout is refused naming that row and
column, as a later row is; a CSV file is refused as such; a last line cut short (no
newline, its JSON left open) is said to be."""

import json
import re

import pytest

from rlhf_eqx import data

_PAIR = {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be"])
def test_a_utf16_file_reads_as_its_text(tmp_path, encoding):
    bom = {"utf-16-le": "\ufeff", "utf-16-be": "\ufeff"}.get(encoding, "")
    text = "\r\n" + json.dumps(_PAIR) + "\r\n\r\n" + json.dumps({**_PAIR, "chosen": " green."})
    path = tmp_path / "pairs.jsonl"
    path.write_bytes((bom + text + "\r\n").encode(encoding))
    records = data.load_preferences(path)
    assert list(records) == [data.PreferenceRecord(**_PAIR)]
    assert records.locations == (f"{path}:2",)
    assert records.report.examples == [f"{path}:4: identical completions"]


def test_a_bad_utf16_file_is_one_line_naming_its_line(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_bytes(("\n" + json.dumps(_PAIR) + "\n").encode("utf-16") + b"\x00\xd8\x00\x00")
    with pytest.raises(data.DataError, match=f"^{re.escape(str(path))}:3: invalid UTF-16"):
        data.load_preferences(path)


def _parquet(path, rows):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.mark.parametrize(
    "load,row,column",
    [
        (data.load_preferences, {**_PAIR, "rejected": None}, "rejected"),
        (data.load_unpaired, {"prompt": "a", "completion": None, "label": True}, "completion"),
        (data.load_unpaired, {"prompt": "a", "completion": " b", "label": None}, "label"),
        (data.load_stepwise, {"prompt": "a", "completions": ["s"], "labels": None}, "labels"),
        (data.load_prompts, {"question": "q?", "answer": None}, "answer"),
    ],
)
def test_a_null_in_the_first_row_of_a_table_names_its_column(tmp_path, load, row, column):
    path = _parquet(tmp_path / "rows.parquet", [row, row])
    with pytest.raises(data.DataError, match=f"^{re.escape(path)}: row 0: column '{column}'"):
        load(path)
    lenient = load(path, lenient=True)
    assert lenient.report.read == 2 and lenient.report.num_skipped == 2


def test_a_null_mapped_column_in_the_first_row_names_the_file_column(tmp_path):
    rows = [{"q": "The sky is", "a": " blue.", "b": None}]
    path = _parquet(tmp_path / "arena.parquet", rows)
    columns = {"prompt": "q", "chosen": "a", "rejected": "b"}
    with pytest.raises(data.DataError, match=f"^{re.escape(path)}: row 0: column 'b' is null$"):
        data.load_preferences(path, columns=columns)


@pytest.mark.parametrize("name", ["pairs.csv", "pairs.tsv"])
def test_a_csv_file_is_refused_as_such(tmp_path, name):
    path = tmp_path / name
    sep = "," if name.endswith(".csv") else "\t"
    path.write_text(sep.join(_PAIR) + "\n" + sep.join(_PAIR.values()) + "\n")
    kind = name.rsplit(".", 1)[1].upper()
    with pytest.raises(data.DataError, match=f"^{re.escape(str(path))}: a {kind} file is not"):
        data.load_preferences(path, lenient=True)


@pytest.mark.parametrize(
    "tail,torn",
    [
        ('{"prompt": "a", "chosen": " b", "rej', True),
        ('{"prompt": "a", "chosen": [" b",', True),
        ("{'prompt': 'a'}", False),  # not JSON, but not cut short
    ],
)
def test_a_last_line_cut_short_is_said_so(tmp_path, tail, torn):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(_PAIR) + "\n\n" + tail)
    with pytest.raises(data.DataError, match=f"^{re.escape(str(path))}:3: invalid JSON") as e:
        data.load_preferences(path)
    assert str(e.value).endswith("(the last line, with no newline: the file looks cut short)") == (
        torn
    )
    path.write_text(json.dumps(_PAIR) + "\n\n" + tail + "\n")  # ended: not the hint
    with pytest.raises(data.DataError, match="invalid JSON") as e:
        data.load_preferences(path)
    assert "cut short" not in str(e.value)


def test_a_bad_byte_in_a_json_list_is_named_by_its_line_and_byte(tmp_path):
    path = tmp_path / "pairs.json"
    pair = json.dumps(_PAIR).encode()
    path.write_bytes(b"[\n  " + pair + b',\n  {"prompt": "caf\xe9"}\n]')
    want = f"^{re.escape(str(path))}:3: invalid UTF-8: byte 17: invalid continuation byte$"
    with pytest.raises(data.DataError, match=want):
        data.load_preferences(path)
