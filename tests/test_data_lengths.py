"""Length limits stated once, the truncation report, and length-bucketed collation."""

import os

import numpy as np
import pytest

from rlhf_eqx import data

BYTES = data.ByteTokenizer()


def test_defaults_are_trl_like_and_checked():
    lengths = data.SequenceLengths()
    assert (lengths.max_length, lengths.max_prompt_length, lengths.max_completion_length) == (
        1024,
        512,
        None,
    )
    with pytest.raises(data.DataError, match="max_prompt_length < max_length.*=8 and max_length=8"):
        data.SequenceLengths(max_length=8, max_prompt_length=8)
    with pytest.raises(
        data.DataError, match="SequenceLengths.max_completion_length must be a positive int"
    ):
        data.SequenceLengths(max_completion_length=0)
    with pytest.raises(data.DataError, match="SequenceLengths.max_length must be a positive int"):
        data.SequenceLengths(max_length=0)


def test_one_lengths_object_serves_tokenising_and_collating():
    lengths = data.SequenceLengths(max_length=10, max_prompt_length=4, max_completion_length=3)
    rec = data.PreferenceRecord("abcdef", "ghijk", "l")
    pairs, report = data.tokenize_preferences([rec], BYTES, lengths=lengths)
    (pair,) = pairs
    assert pair.chosen.prompt == (1, *[c + 3 for c in b"def"])  # BOS + the prompt's end
    assert pair.chosen.completion == tuple(c + 3 for c in b"ghi")  # cut to 3, start kept
    assert pair.rejected.completion == (ord("l") + 3, 2)
    batch = data.collate_preferences(pairs, lengths=lengths, pad_id=0)
    assert batch.chosen_tokens.shape == (1, 10)
    # Explicit numbers replace single fields.
    pairs, _ = data.tokenize_preferences([rec], BYTES, lengths=lengths, max_completion_length=5)
    assert len(pairs[0].chosen.completion) == 5
    seqs, _ = data.tokenize_sft([("ab", "cd")], BYTES, lengths=lengths)
    assert data.collate_sft(seqs, lengths=lengths, pad_id=0).tokens.shape == (1, 10)
    prompts, _ = data.tokenize_prompts(["abcdef"], BYTES, lengths=lengths)
    assert prompts == [(1, *[c + 3 for c in b"def"])]
    assert data.collate_prompts(prompts, lengths=lengths, pad_id=0).tokens.shape == (1, 4)


def test_truncation_summary_for_a_run_log():
    records = [data.PreferenceRecord("p" * n, "c" * m, "r") for n, m in [(20, 2), (3, 2), (20, 30)]]
    _, report = data.tokenize_preferences(records, BYTES, max_length=16, max_prompt_length=8)
    assert report.prompt_truncation_rate == pytest.approx(2 / 3)
    assert report.completion_truncation_rate == pytest.approx(1 / 3)
    assert report.summary() == (
        "67% (2/3) of prompts were cut to 8 tokens (kept the end); "
        "33% (1/3) of records had a completion cut to fit 16 tokens in all "
        "(kept the start, lost the EOS); kept 3 of 3"
    )
    assert str(report) == report.summary()
    _, no_eos = data.tokenize_preferences(
        records, BYTES, max_length=16, max_prompt_length=8, add_eos=False
    )
    assert "(kept the start, lost its end)" in no_eos.summary()
    _, dropped = data.tokenize_preferences(
        records, BYTES, max_length=16, max_prompt_length=8, truncation="drop"
    )
    assert dropped.summary() == "67% (2/3) dropped (too long: 2); kept 1 of 3"
    _, none = data.tokenize_preferences([], BYTES)
    assert none.summary() == "no records tokenised" and none.prompt_truncation_rate == 0.0


def test_bucketed_rows_round_up_to_a_multiple():
    seqs = [data.TokenizedSequence((1, 5), (6,) * n) for n in (3, 9)]
    batch = data.collate_sft(seqs, max_length=64, pad_id=0, bucket_size=8)
    assert batch.tokens.shape == (2, 16)  # longest row 11 -> 16
    np.testing.assert_array_equal(batch.mask.sum(1), [5, 11])
    capped = data.collate_sft(seqs, max_length=12, pad_id=0, bucket_size=8)
    assert capped.tokens.shape == (2, 12)  # never past max_length
    pairs = [data.TokenizedPair(seqs[0], seqs[1])]
    batch = data.collate_preferences(pairs, max_length=64, pad_id=0, bucket_size=4)
    assert batch.chosen_tokens.shape == batch.rejected_tokens.shape == (1, 12)
    prompts = data.collate_prompts([[1, 2, 3]], max_length=64, pad_id=0, bucket_size=2)
    np.testing.assert_array_equal(prompts.tokens, [[0, 1, 2, 3]])
    with pytest.raises(data.DataError, match="bucket_size must be a positive int"):
        data.collate_sft(seqs, max_length=64, pad_id=0, bucket_size=0)
    stats = data.padding_stats([batch, prompts])
    assert stats["num_shapes"] == 2
    assert stats["tokens"] == 5 + 11 + 3 and stats["positions"] == 24 + 4
    assert data.padding_stats([])["padding_fraction"] == 0.0


@pytest.mark.slow
def test_bucketing_on_hh_rlhf(shared_dir):
    """HH-RLHF harmless-base (test split) tokenised with the stories260K tokenizer, max
    length 512, batches of 8 pairs: padding to 512, to the longest row rounded up to 64,
    and the same with batches grouped by length."""
    tok = data.load_tokenizer(os.path.join(shared_dir, "models", "stories260K", "tok512.bin"))
    records = data.load_preferences(
        os.path.join(shared_dir, "data", "hh-rlhf", "harmless-base", "test.jsonl.gz")
    )
    lengths = data.SequenceLengths(max_length=512, max_prompt_length=256)
    pairs, _ = data.tokenize_preferences(records, tok, lengths=lengths)
    sizes = [max(len(p.chosen), len(p.rejected)) for p in pairs]

    def stats(bucket_size, group_by_length=0):
        it = data.BatchIterator(
            len(pairs), 8, seed=0, num_epochs=1, group_by_length=group_by_length, lengths=sizes
        )
        return data.padding_stats(
            [
                data.collate_preferences(
                    [pairs[i] for i in idx],
                    lengths=lengths,
                    pad_id=tok.pad_id,
                    bucket_size=bucket_size,
                )
                for idx in it
            ]
        )

    fixed, bucketed, grouped = stats(None), stats(64), stats(64, group_by_length=50)
    for name, s in (
        ("max length", fixed),
        ("buckets of 64", bucketed),
        ("buckets of 64, grouped by length", grouped),
    ):
        print(
            f"{len(pairs)} pairs, {name}: {100 * s['padding_fraction']:.1f}% padding, "
            f"{s['num_shapes']} shapes"
        )
    assert fixed["num_shapes"] == 1 and bucketed["tokens"] == fixed["tokens"]
    assert bucketed["num_shapes"] <= 8 and grouped["num_shapes"] <= 8
    assert grouped["padding_fraction"] < bucketed["padding_fraction"] < fixed["padding_fraction"]
