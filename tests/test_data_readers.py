"""Chat formatting, preference and prompt readers, and their handling of bad input."""

import gzip
import json
import os
import re

import pytest

from rlhf_eqx import data

HH = os.path.join("data", "hh-rlhf", "harmless-base", "test.jsonl.gz")


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


# ---------------------------------------------------------------------------------- chat


def test_format_chat_hh():
    messages = [user("Hi"), assistant("Hello!"), user("How are you?")]
    assert data.format_chat(messages) == (
        "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: How are you?\n\nAssistant:"
    )
    assert data.format_chat(messages, add_generation_prompt=False) == (
        "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: How are you?"
    )
    system = [{"role": "system", "content": "Be brief."}, {"role": "human", "content": "Hi"}]
    assert data.format_chat(system) == "Be brief.\n\nHuman: Hi\n\nAssistant:"


def test_format_chat_chatml():
    messages = [{"role": "system", "content": "S"}, user("Hi"), {"role": "gpt", "content": "Yo"}]
    assert data.format_chat(messages, "chatml", add_generation_prompt=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nYo<|im_end|>\n"
    )
    assert data.format_chat([user("Hi")], data.CHATML_TEMPLATE).endswith(
        "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_format_chat_errors():
    with pytest.raises(data.DataError, match="unknown chat role"):
        data.format_chat([{"role": "narrator", "content": "x"}])
    with pytest.raises(data.DataError, match="unknown chat template"):
        data.format_chat([user("x")], "llama9")
    with pytest.raises(data.DataError, match="'role' and 'content'"):
        data.format_chat([{"content": "x"}])
    with pytest.raises(data.DataError, match="must be strings"):
        data.format_chat([{"role": "user", "content": 3}])


# --------------------------------------------------------------------- HH-RLHF (real file)


def test_hh_rlhf_real_file(shared_dir):
    path = os.path.join(shared_dir, HH)
    ds = data.load_preferences(path)
    report = ds.report
    assert report.format == "hh"
    assert report.read == 2312
    assert len(ds) == report.kept == 2308
    # Every pair of this file shares a prompt ending in "\n\nAssistant:"; four have a
    # blank chosen reply (" ").
    assert report.skipped == {"empty completion": 4}
    assert report.skipped.get("unsplittable", 0) == 0
    with gzip.open(path, "rt", encoding="utf-8") as f:
        originals = [json.loads(line) for line in f]
    kept = [o for o in originals if o["chosen"] != o["rejected"]]
    by_chosen = {o["chosen"]: o["rejected"] for o in kept}
    for r in ds:
        assert r.prompt.startswith("\n\nHuman: ")
        assert r.prompt.endswith("\n\nAssistant:")
        assert r.chosen.strip() and r.rejected.strip() and r.chosen != r.rejected
        assert by_chosen[r.prompt + r.chosen] == r.prompt + r.rejected
    first = ds[0]
    assert first.prompt.startswith("\n\nHuman: what are some pranks with a pen i can do?")
    assert first.chosen.startswith(" No, sorry!")
    assert isinstance(ds[:3], data.PreferenceDataset) and len(ds[:3]) == 3


def test_hh_split_rules():
    assert data.split_hh_transcript(
        "\n\nHuman: Q\n\nAssistant: Yes", "\n\nHuman: Q\n\nAssistant: No"
    ) == ("\n\nHuman: Q\n\nAssistant:", " Yes", " No")
    # The split is at the *last* shared "\n\nAssistant:", even when the completions
    # share a beginning.
    assert data.split_hh_transcript(
        "\n\nHuman: Q\n\nAssistant: A\n\nHuman: R\n\nAssistant: Sure, yes",
        "\n\nHuman: Q\n\nAssistant: A\n\nHuman: R\n\nAssistant: Sure, no",
    ) == ("\n\nHuman: Q\n\nAssistant: A\n\nHuman: R\n\nAssistant:", " Sure, yes", " Sure, no")
    assert data.split_hh_transcript("\n\nHuman: A", "\n\nHuman: B") is None


def test_hh_unsplittable_reported(tmp_path):
    path = write_jsonl(
        tmp_path / "hh.jsonl",
        [
            {
                "chosen": "\n\nHuman: Q\n\nAssistant: good",
                "rejected": "\n\nHuman: Q\n\nAssistant: bad",
            },
            {"chosen": "\n\nHuman: A\n\nAssistant: x", "rejected": "\n\nHuman: B\n\nAssistant: x"},
            {"chosen": "no markers at all", "rejected": "nothing"},
            {
                "chosen": "\n\nHuman: Q\n\nAssistant: same",
                "rejected": "\n\nHuman: Q\n\nAssistant: same",
            },
            {"chosen": "\n\nHuman: Q\n\nAssistant:", "rejected": "\n\nHuman: Q\n\nAssistant: bad"},
        ],
    )
    ds = data.load_preferences(path)
    assert [(r.prompt, r.chosen, r.rejected) for r in ds] == [
        ("\n\nHuman: Q\n\nAssistant:", " good", " bad")
    ]
    assert ds.report.skipped == {
        "unsplittable": 2,
        "identical completions": 1,
        "empty completion": 1,
    }
    assert ds.report.examples[0] == f"{path}:2: unsplittable"
    assert "skipped 4" in str(ds.report)


# ------------------------------------------------------------------------- other formats


def test_messages_format_ultrafeedback(tmp_path):
    record = {
        "prompt": "What is 2+2?",
        "chosen": [user("What is 2+2?"), assistant("4")],
        "rejected": [user("What is 2+2?"), assistant("5")],
    }
    path = write_jsonl(tmp_path / "uf.jsonl", [record])
    (r,) = data.load_preferences(path)
    assert data.load_preferences(path).report.format == "messages"
    assert r == data.PreferenceRecord("\n\nHuman: What is 2+2?\n\nAssistant:", " 4", " 5")
    (r,) = data.load_preferences(path, template="chatml")
    assert r.prompt == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert (r.chosen, r.rejected) == ("4<|im_end|>\n", "5<|im_end|>\n")
    assert r.prompt + r.chosen == data.format_chat(
        record["chosen"], "chatml", add_generation_prompt=False
    )


def test_messages_format_multiturn_and_trl_conversational(tmp_path):
    shared = [user("a"), assistant("b"), user("c")]
    records = [
        {"chosen": shared + [assistant("yes")], "rejected": shared + [assistant("no")]},
        # TRL conversational: the prompt is a message list, completions are replies only.
        {"prompt": shared, "chosen": [assistant("yes")], "rejected": [assistant("no")]},
        # Diverging in a user turn: the prompt is cut before the last shared assistant turn.
        {
            "chosen": [user("a"), assistant("b"), user("c"), assistant("d")],
            "rejected": [user("a"), assistant("b"), user("X"), assistant("d")],
        },
        # Nothing shared before an assistant turn.
        {"chosen": [user("a"), assistant("b")], "rejected": [user("z"), assistant("b")]},
    ]
    ds = data.load_preferences(write_jsonl(tmp_path / "m.jsonl", records))
    prompt = "\n\nHuman: a\n\nAssistant: b\n\nHuman: c\n\nAssistant:"
    assert ds[0] == ds[1] == data.PreferenceRecord(prompt, " yes", " no")
    assert ds[2] == data.PreferenceRecord(
        "\n\nHuman: a\n\nAssistant:",
        " b\n\nHuman: c\n\nAssistant: d",
        " b\n\nHuman: X\n\nAssistant: d",
    )
    assert len(ds) == 3 and ds.report.skipped == {"unsplittable": 1}


def test_sharegpt_format(tmp_path):
    record = {
        "conversations": [{"from": "system", "value": "S."}, {"from": "human", "value": "Hi"}],
        "chosen": {"from": "gpt", "value": "Hello"},
        "rejected": {"from": "gpt", "value": "Go away"},
    }
    ds = data.load_preferences(write_jsonl(tmp_path / "s.jsonl", [record]))
    assert ds.report.format == "sharegpt"
    assert ds[0] == data.PreferenceRecord("S.\n\nHuman: Hi\n\nAssistant:", " Hello", " Go away")


def test_plain_format_json_and_gzip(tmp_path):
    records = [
        {"prompt": "P1", "chosen": "A", "rejected": "B"},
        {"prompt": "", "chosen": "C", "rejected": "D"},
    ]
    expected = [data.PreferenceRecord("P1", "A", "B"), data.PreferenceRecord("", "C", "D")]
    (tmp_path / "list.json").write_text(json.dumps(records, indent=2))
    with gzip.open(tmp_path / "list.json.gz", "wt") as f:
        json.dump(records, f)
    with gzip.open(tmp_path / "lines.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps(r) for r in records) + "\n\n")
    (tmp_path / "lines.json").write_text("\n".join(json.dumps(r) for r in records))
    for name in ("list.json", "list.json.gz", "lines.jsonl.gz", "lines.json"):
        ds = data.load_preferences(tmp_path / name)
        assert list(ds) == expected, name
        assert ds.report.format == "plain" and ds.report.read == 2
    assert len(data.load_preferences(tmp_path / "list.json", format="plain")) == 2


def test_unknown_format(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [{"text": "hello"}])
    with pytest.raises(
        data.DataError, match=r"cannot tell the preference format from the keys \['text'\]"
    ):
        data.load_preferences(path)
    with pytest.raises(data.DataError, match="unknown preference format"):
        data.load_preferences(path, format="csv")
    with pytest.raises(data.DataError, match="cannot tell the prompt format"):
        data.load_prompts(path)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(data.DataError, match="empty.jsonl: no records"):
        data.load_preferences(tmp_path / "empty.jsonl")


# ----------------------------------------------------------------------------- bad input

GOOD = {"prompt": "p", "chosen": "a", "rejected": "b"}


def test_malformed_json_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        json.dumps(GOOD) + "\n\n" + '{"prompt": "p", "chosen": \n' + json.dumps(GOOD) + "\n"
    )
    with pytest.raises(data.DataError, match=re.escape(f"{path}:3: invalid JSON")) as info:
        data.load_preferences(path)
    assert isinstance(info.value, ValueError)
    assert "bad.jsonl:3" in str(info.value)
    ds = data.load_preferences(path, lenient=True)
    assert len(ds) == 2
    assert ds.report.skipped == {"invalid JSON": 1} and ds.report.read == 3
    assert ds.report.examples[0].startswith(f"{path}:3: invalid JSON")


def test_malformed_json_list(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[\n{"prompt": "p", "chosen": "a", "rejected": "b"},\n{"prompt": }\n]')
    for lenient in (False, True):  # a broken list cannot be read past the error
        with pytest.raises(data.DataError, match=re.escape(f"{path}:3: invalid JSON")):
            data.load_preferences(path, lenient=lenient)


def test_a_json_file_of_one_object_over_several_lines_is_named_as_such(tmp_path):
    pair = {"prompt": "p", "chosen": "a", "rejected": "b"}
    for name, value in (("wrapped.json", {"data": [pair]}), ("one.json", pair)):
        path = tmp_path / name
        path.write_text(json.dumps(value, indent=2))
        for lenient in (False, True):
            with pytest.raises(data.DataError, match="holds a single object") as e:
                data.load_preferences(path, lenient=lenient)
            assert str(e.value).startswith(f"{path}: ") and str(sorted(value)) in str(e.value)
    path = tmp_path / "lines.jsonl"  # not a .json file: its first line is invalid JSON
    path.write_text(json.dumps(pair, indent=2))
    with pytest.raises(data.DataError, match=re.escape(f"{path}:1: invalid JSON")):
        data.load_preferences(path)


def test_non_utf8_bytes(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(
        (json.dumps(GOOD) + "\n").encode()
        + b'{"prompt": "caf\xe9", "chosen": "a", "rejected": "b"}\n'
    )
    with pytest.raises(data.DataError, match=re.escape(f"{path}:2: invalid UTF-8")):
        data.load_preferences(path)
    ds = data.load_preferences(path, lenient=True)
    assert list(ds) == [data.PreferenceRecord("p", "a", "b")]
    assert ds.report.skipped == {"invalid UTF-8": 1}


def test_missing_keys_and_wrong_types(tmp_path):
    path = write_jsonl(
        tmp_path / "keys.jsonl",
        [
            GOOD,
            {"prompt": "p", "chosen": "a"},
            {"prompt": "p", "chosen": 1, "rejected": "b"},
            [1, 2],
        ],
    )
    with pytest.raises(data.DataError, match=re.escape(f"{path}:2: missing key: no 'rejected'")):
        data.load_preferences(path, format="plain")
    ds = data.load_preferences(path, format="plain", lenient=True)
    assert len(ds) == 1
    assert ds.report.skipped == {"missing key": 1, "wrong type": 1, "not a JSON object": 1}
    msgs = write_jsonl(
        tmp_path / "msgs.jsonl",
        [
            {
                "chosen": [user("a"), assistant("b")],
                "rejected": [user("a"), {"role": "alien", "content": "c"}],
            }
        ],
    )
    with pytest.raises(
        data.DataError,
        match="msgs.jsonl:1: unknown chat role: a message in 'rejected' has the role 'alien'",
    ):
        data.load_preferences(msgs)


def test_empty_strings(tmp_path):
    path = write_jsonl(
        tmp_path / "empty.jsonl",
        [
            {"prompt": "p", "chosen": "", "rejected": "b"},
            {"prompt": "p", "chosen": "a", "rejected": "   "},
            {"prompt": "", "chosen": "a", "rejected": "b"},
        ],
    )
    ds = data.load_preferences(path)  # unusable, not malformed: skipped without lenient
    assert list(ds) == [data.PreferenceRecord("", "a", "b")]
    assert ds.report.skipped == {"empty completion": 2}
    prompts = write_jsonl(
        tmp_path / "prompts.jsonl", [{"prompt": "  "}, {"prompt": "q", "answer": "1"}]
    )
    pd = data.load_prompts(prompts)
    assert list(pd) == [data.PromptRecord("q", "1")]
    assert pd.report.skipped == {"empty prompt": 1}


# ---------------------------------------------------------------------------------- prompts


def test_gsm8k_real_file(shared_dir):
    ds = data.load_prompts(os.path.join(shared_dir, "data", "gsm8k", "test.jsonl"))
    assert ds.report.format == "gsm8k"
    assert len(ds) == 1319 and ds.report.num_skipped == 0
    assert all(re.fullmatch(r"-?\d+", r.answer) for r in ds)
    assert ds[0].answer == "18" and ds[0].prompt.startswith("Janet\u2019s ducks lay 16 eggs")
    answers = [int(r.answer) for r in ds]
    assert 1450000 in answers  # "#### 1,450,000"
    assert sorted(a for a in answers if a < 0) == [-10, -3]


def test_mt_bench_real_file(shared_dir):
    path = os.path.join(shared_dir, "data", "mt-bench", "question.jsonl")
    ds = data.load_prompts(path)
    assert ds.report.format == "mt-bench" and len(ds) == 80
    with open(path) as f:
        first_turns = [json.loads(line)["turns"][0] for line in f]
    assert [r.prompt for r in ds] == first_turns
    assert all(r.answer is None for r in ds)
    templated = data.load_prompts(path, template="chatml")
    assert templated[0].prompt == (
        f"<|im_start|>user\n{first_turns[0]}<|im_end|>\n<|im_start|>assistant\n"
    )


def test_prompt_formats_and_errors(tmp_path):
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [{"prompt": "q1"}, {"prompt": "q2", "answer": 7}],
    )
    ds = data.load_prompts(path)
    assert list(ds) == [data.PromptRecord("q1"), data.PromptRecord("q2", "7")]
    chat = write_jsonl(tmp_path / "c.jsonl", [{"prompt": [user("hi")]}])
    assert list(data.load_prompts(chat)) == [data.PromptRecord("\n\nHuman: hi\n\nAssistant:")]
    assert data.load_prompts(path, template="hh")[0].prompt == "\n\nHuman: q1\n\nAssistant:"
    gsm = write_jsonl(tmp_path / "g.jsonl", [{"question": "q", "answer": "no final answer"}])
    with pytest.raises(data.DataError, match="g.jsonl:1: no answer"):
        data.load_prompts(gsm)
    assert data.load_prompts(gsm, lenient=True).report.skipped == {"no answer": 1}
    mt = write_jsonl(tmp_path / "mt.jsonl", [{"turns": []}])
    with pytest.raises(data.DataError, match="mt.jsonl:1: wrong type"):
        data.load_prompts(mt)
    # TRL's math sets name the reference `solution`: read as the answer
    sol = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "q", "solution": "x = 4"}])
    assert list(data.load_prompts(sol)) == [data.PromptRecord("q", "x = 4")]
    bad = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "q", "solution": [4]}])
    with pytest.raises(data.DataError, match="b.jsonl:1: wrong type: 'solution' must be a string"):
        data.load_prompts(bad)


def test_a_directory_is_named_as_such(tmp_path):
    with pytest.raises(data.DataError, match="is a directory"):
        data.load_preferences(tmp_path)
    with pytest.raises(data.DataError, match="is a directory"):
        data.load_prompts(tmp_path)
