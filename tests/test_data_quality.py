"""The preference data-quality report, its filters, and the held-out split by prompt."""

import os

import pytest

from rlhf_eqx import data

R = data.PreferenceRecord


def hand_made():
    return [
        R("Q1", " the cat sat", " a dog ran"),  # 0 fine
        R("Q2", " same", " same"),  # 1 identical
        R("Q3", " ", " something"),  # 2 empty chosen
        R("Q1", " the cat ran", " a dog sat"),  # 3 repeated prompt
        R("Q1", " the cat sat", " a dog ran"),  # 4 exact duplicate of 0 (and repeated prompt)
        R("", " x", " y"),  # 5 empty prompt
    ]


def test_report_on_hand_made_records():
    q = data.preference_quality(hand_made())
    assert q.total == 6 and q.distinct_prompts == 4
    assert q.identical == (1,) and q.empty == (2, 5)
    assert q.exact_duplicates == (4,) and q.duplicate_prompts == (3, 4)
    assert q.unit == "characters"
    assert q.chosen_lengths.max == len(" the cat sat") and q.prompt_lengths.max == 2
    # Responses' words: 12 texts; distinct-1 counts unique words over all words.
    responses = [t for r in hand_made() for t in (r.chosen, r.rejected)]
    words = [w for t in responses for w in t.split()]
    assert q.distinct_1 == pytest.approx(len(set(words)) / len(words))
    assert q.truncation is None
    text = q.summary()
    assert "6 preference pairs, 4 distinct prompts" in text
    assert "identical chosen/rejected: 1 (16.7%); empty: 2 (33.3%)" in text
    assert "distinct-1" in text and "distinct-2" in text


def test_distinct_n():
    assert data.distinct_n(["a b a b"], 1) == pytest.approx(2 / 4)
    assert data.distinct_n(["a b a b"], 2) == pytest.approx(2 / 3)  # "a b", "b a", "a b"
    assert data.distinct_n(["a b", "b c"], 2) == 1.0  # n-grams do not cross texts
    assert data.distinct_n([], 2) == 0.0 and data.distinct_n(["a"], 2) == 0.0


def test_report_on_nothing_does_not_divide_by_zero():
    q = data.preference_quality([], tokenizer=data.ByteTokenizer())
    assert q.total == 0 and q.distinct_1 == 0.0 and q.chosen_lengths.max == 0
    assert "0 preference pairs" in q.summary()


def test_filters_return_what_they_dropped():
    records = hand_made()
    kept, dropped = data.filter_preferences(records)
    assert kept == [records[0], records[3]]
    assert dropped == {
        "identical": [records[1]],
        "empty": [records[2], records[5]],
        "exact_duplicate": [records[4]],
    }
    kept, dropped = data.filter_preferences(records, drop=("duplicate_prompt",))
    assert kept == [records[0], records[1], records[2], records[5]]
    assert dropped == {"duplicate_prompt": [records[3], records[4]]}
    with pytest.raises(data.DataError, match="unknown filters \\['typo'\\]"):
        data.filter_preferences(records, drop=("typo",))


def test_report_on_hh_rlhf(shared_dir):
    path = os.path.join(shared_dir, "data", "hh-rlhf", "harmless-base", "test.jsonl.gz")
    ds = data.load_preferences(path)[:300]
    tok = data.load_tokenizer(os.path.join(shared_dir, "models", "stories260K", "tok512.bin"))
    lengths = data.SequenceLengths(max_length=512, max_prompt_length=256)
    q = data.preference_quality(ds, tokenizer=tok, lengths=lengths)
    assert q.total == 300 and q.unit == "tokens"
    assert q.identical == () and q.empty == ()  # the reader already skipped those
    assert 0.0 < q.distinct_2 <= 1.0 and q.distinct_1 < q.distinct_2
    assert q.truncation is not None and q.truncation.total == 300
    assert 0.0 < q.truncation.prompt_truncation_rate < 1.0
    assert q.prompt_lengths.max > 256 and q.chosen_lengths.mean > 0
    kept, dropped = data.filter_preferences(ds, drop=("duplicate_prompt",))
    assert isinstance(kept, data.PreferenceDataset)
    assert len(kept) + len(dropped["duplicate_prompt"]) == 300
    assert len(kept) == q.distinct_prompts
    print(q.summary())


def test_held_out_split_keeps_prompts_on_one_side():
    records = [R(f"prompt {i % 40}", f" a{i}", f" b{i}") for i in range(200)]
    train, held = data.split_held_out(records, fraction=0.25, seed=3)
    assert len(train) + len(held) == 200
    assert {r.prompt for r in train}.isdisjoint({r.prompt for r in held})
    assert 0 < len({r.prompt for r in held}) < 40
    # Deterministic, order-free, and stable when records are added.
    again = data.split_held_out(list(reversed(records)), fraction=0.25, seed=3)[1]
    assert sorted(again, key=records.index) == held
    more = records + [R("new prompt", " c", " d")]
    assert [r for r in data.split_held_out(more, fraction=0.25, seed=3)[1] if r in records] == held
    other = data.split_held_out(records, fraction=0.25, seed=4)[1]
    assert {r.prompt for r in other} != {r.prompt for r in held}
    assert data.split_held_out(records, fraction=0.0)[1] == []
    assert data.split_held_out(records, fraction=1.0)[0] == []
    with pytest.raises(data.DataError, match="fraction must be in"):
        data.split_held_out(records, fraction=1.5)


def test_held_out_split_of_a_dataset(shared_dir):
    ds = data.load_preferences(
        os.path.join(shared_dir, "data", "hh-rlhf", "harmless-base", "test.jsonl.gz")
    )[:400]
    train, held = data.split_held_out(ds, fraction=0.1, seed=0)
    assert isinstance(train, data.PreferenceDataset) and isinstance(held, data.PreferenceDataset)
    assert {r.prompt for r in train}.isdisjoint({r.prompt for r in held})
    assert 10 <= len(held) <= 80
