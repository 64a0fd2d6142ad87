"""Where a record is in its file: a reader's dataset keeps each record's location as its
errors name it (the line of a JSON lines file, counting blank lines; the item of a JSON
list; the row of a table), slices and selections keep them, and a data-file stage's
`truncation` event names the cut records by those lines."""

import json
import re
import types

import pytest

from rlhf_eqx import data, pipelines as pl
from rlhf_eqx.pipelines import runs

_LONG = " and the cat sat on the mat" * 8


def _pairs(n=12, long=(3, 7)):
    return [
        {
            "prompt": f"Story {i}: once",
            "chosen": " a cat ran." + (_LONG if i in long else ""),
            "rejected": " a dog sat.",
        }
        for i in range(n)
    ]


def _with_blank_lines(path, rows) -> list[int]:
    """Write `rows` with two blank lines before each; return each row's line (1-based)."""
    lines, at = [], []
    for row in rows:
        lines += ["", "  "]
        lines.append(json.dumps(row))
        at.append(len(lines))
    path.write_text("\n".join(lines) + "\n")
    return at


def test_locations_are_the_file_lines_counting_blank_ones(tmp_path):
    path = tmp_path / "pairs.jsonl"
    rows = _pairs(4)
    rows[1]["chosen"] = rows[1]["rejected"]  # identical: skipped
    at = _with_blank_lines(path, rows)
    records = data.load_preferences(path)
    assert len(records) == 3
    assert records.locations == tuple(f"{path}:{n}" for n in (at[0], at[2], at[3]))
    assert records[1:].locations == records.locations[1:]
    assert records.select([2, 0]).locations == (records.locations[2], records.locations[0])
    assert records.report.examples == [f"{path}:{at[1]}: identical completions"]


def test_locations_of_a_json_list_and_a_table(tmp_path):
    rows = _pairs(3)
    listed = tmp_path / "pairs.json"
    listed.write_text(json.dumps(rows))  # one line
    assert data.load_preferences(listed).locations == tuple(
        f"{listed}:1: item {n}" for n in range(3)
    )
    listed.write_text(json.dumps(rows, indent=2))  # an item over five lines
    assert data.load_preferences(listed).locations == tuple(
        f"{listed}:{2 + 5 * n}: item {n}" for n in range(3)
    )
    listed.write_text(json.dumps([*rows[:2], {**rows[2], "chosen": 7}], indent=2))
    want = f"^{re.escape(str(listed))}:12: item 2: wrong type: 'chosen' must be a string"
    with pytest.raises(data.DataError, match=want):
        data.load_preferences(listed)
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = tmp_path / "pairs.parquet"
    pq.write_table(pa.Table.from_pylist(rows), table)
    assert data.load_preferences(table).locations == tuple(f"{table}: row {n}" for n in range(3))


def test_a_dataset_built_by_hand_has_unknown_locations(tmp_path):
    report = data.LoadReport(path="pairs.jsonl", read=1)
    records = data.PreferenceDataset([data.PreferenceRecord("a", " b", " c")], report)
    assert records.locations == (None,)
    path = tmp_path / "pairs.jsonl"
    _with_blank_lines(path, _pairs(3))
    read = data.load_preferences(path)  # its records reordered, with its report
    assert data.PreferenceDataset(list(read)[::-1], read.report).locations == (None,) * 3


def _env(path, run_dir, **data_settings):
    cfg = pl.PipelineConfig()
    settings = {"path": str(path), "heldout_fraction": 0.25, **data_settings}
    cfg = pl.apply_overrides(cfg, [f"data.{k}={v}" for k, v in settings.items()])
    cfg = pl.apply_overrides(cfg, ["sampling.prompt_length=16", "dpo.max_length=48"])
    log = pl.tools.MetricsLog(str(run_dir), "dpo", quiet=True)
    ctx = types.SimpleNamespace(log=log)
    env = types.SimpleNamespace(
        cfg=cfg,
        tok=data.ByteTokenizer(),
        ctx=lambda stage, periodic=True: ctx,
        summary={},
        say=lambda *a: None,
        stage="dpo",
    )
    return env, log


def test_a_cut_pair_is_named_by_its_line(tmp_path):
    path = tmp_path / "pairs.jsonl"
    rows = _pairs()
    at = _with_blank_lines(path, rows)
    env, log = _env(path, tmp_path / "run", chat_template="none")
    train, _ = runs.preference_split(env, env.cfg.dpo)
    (event,) = [e for e in pl.tools.read_records(log.run_dir) if e.get("event") == "truncation"]
    trained = {r.prompt for r in train}
    cut = [at[i] for i in (3, 7) if rows[i]["prompt"] in trained]
    assert cut, "a long pair is trained on"
    assert event["truncated_records"] == ", ".join(map(str, cut))
    assert f"first cut: lines {', '.join(map(str, cut))};" in event["message"]
    assert "dpo.max_length=48" in event["message"]
    assert event["completion_truncated"] == len(cut)


def test_a_cut_row_of_a_table_is_named_by_its_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = _pairs()
    path = tmp_path / "pairs.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    env, log = _env(path, tmp_path / "run", chat_template="none")
    train, _ = runs.preference_split(env, env.cfg.dpo)
    (event,) = [e for e in pl.tools.read_records(log.run_dir) if e.get("event") == "truncation"]
    trained = {r.prompt for r in train}
    cut = [i for i in (3, 7) if rows[i]["prompt"] in trained]
    assert f"first cut: rows {', '.join(map(str, cut))} (0-based);" in event["message"]


def test_the_pairs_the_reader_left_out_are_named_by_their_lines(tmp_path):
    path = tmp_path / "pairs.jsonl"
    rows = _pairs()
    rows[5]["chosen"] = ""  # an empty completion, skipped
    at = _with_blank_lines(path, rows)
    env, log = _env(path, tmp_path / "run", chat_template="none")
    runs.preference_split(env, env.cfg.dpo)
    records = pl.tools.read_records(log.run_dir)
    (event,) = [e for e in records if e.get("event") == "skipped_records"]
    assert event["message"].endswith(f": {path}:{at[5]}: empty completion")
    assert (event["skipped"], event["read"]) == (1, len(rows))


_SILENT = (  # a template that writes no tool calls
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_a_record_the_chat_template_cannot_render_is_named_by_its_line(tmp_path):
    user = {"role": "user", "content": "Weather?"}
    call = {"type": "function", "function": {"name": "wx", "arguments": {"city": "Paris"}}}
    calling = [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
    ]
    plain = {"role": "assistant", "content": "No idea."}
    rows = [{"prompt": [user], "chosen": [plain], "rejected": [plain | {"content": "?"}]}] * 3
    rows.append({"prompt": [user], "chosen": [plain], "rejected": calling})
    path = tmp_path / "tools.jsonl"
    at = _with_blank_lines(path, rows)
    records = data.load_preferences(path)
    rendering = runs.ChatRendering(data.JinjaChatTemplate(_SILENT), "<|end|>")
    want = f"^{path}:{at[3]}: 'rejected': message 1 .assistant. has tool_calls, but the chat"
    with pytest.raises(data.DataError, match=want):
        rendering.records(records)
    with pytest.raises(data.DataError, match=want):  # a part of the dataset, named by it
        rendering.records(list(records)[2:], records)
