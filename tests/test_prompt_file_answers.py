"""Reference answers of prompt files as users write them: numbers of any JSON or Parquet
type, a GSM8K answer that is the number alone, and the types refused (one line naming
the file, the line or row and the column)."""

import json
import re

import pytest

from rlhf_eqx import data


def _jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def test_numeric_answers_read_in_their_normal_form(tmp_path):
    rows = [
        {"prompt": "a", "answer": 7},
        {"prompt": "b", "answer": 3.0},  # pandas writes an int column with nulls as floats
        {"prompt": "c", "answer": 2.50},
        {"prompt": "d", "answer": -0.0},
        {"prompt": "e", "solution": 1.5},
        {"prompt": "f", "answer": "x = 4"},
    ]
    got = [r.answer for r in data.load_prompts(_jsonl(tmp_path / "p.jsonl", rows))]
    assert got == ["7", "3", "2.5", "0", "1.5", "x = 4"]
    # the exact-match reward compares them as the numbers they are
    assert data.exact_match_reward(["so 3", "2.5"], got[1:3]).tolist() == [1.0, 1.0]


def test_a_float_answer_column_of_a_parquet_file(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = str(tmp_path / "p.parquet")
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "answer": [1.0, 2.5, None]}), path)
    assert list(data.load_prompts(path)) == [
        data.PromptRecord("a", "1"),
        data.PromptRecord("b", "2.5"),
        data.PromptRecord("c", None),
    ]


def test_a_gsm8k_answer_may_be_the_number_alone(tmp_path):
    rows = [
        {"question": "q1", "answer": "2 + 2 = 4\n#### 4"},
        {"question": "q2", "answer": "1,200"},
        {"question": "q3", "answer": 12},
    ]
    ds = data.load_prompts(_jsonl(tmp_path / "g.jsonl", rows))
    assert ds.report.format == "gsm8k"
    assert [r.answer for r in ds] == ["4", "1200", "12"]


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "a", "answer": True}, "'answer' must be a string or a number, got bool"),
        ({"prompt": "a", "answer": [4]}, "'answer' must be a string or a number, got list"),
        ({"prompt": "a", "answer": float("nan")}, "'answer' must be a finite number, got nan"),
        ({"prompt": "a", "solution": {"x": 1}}, "'solution' must be a string or a number"),
        ({"question": "q", "answer": "no final answer"}, "no answer: the 'answer' has no"),
    ],
)
def test_answers_refused_name_the_line_and_column(tmp_path, row, message):
    path = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok", "answer": "1"}, row])
    if "question" in row:
        path = _jsonl(tmp_path / "bad.jsonl", [{"question": "ok", "answer": "#### 1"}, row])
    with pytest.raises(data.DataError, match=f"^{re.escape(path)}:2: .*{re.escape(message)}"):
        data.load_prompts(path)
