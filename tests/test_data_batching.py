"""Tokenising records into fixed-shape batches: layout, truncation, reports, real data."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import rlhf_eqx as rx
from rlhf_eqx import data

BYTES = data.ByteTokenizer()


def b(text):
    """Byte-tokenizer ids of `text`."""
    return [c + 3 for c in text.encode()]


def test_preference_layout_exact():
    rec = data.PreferenceRecord("ab", "cd", "e")
    pairs, report = data.tokenize_preferences([rec], BYTES, max_length=8, max_prompt_length=4)
    assert report.total == report.kept == 1 and report.num_dropped == 0
    (pair,) = pairs
    assert pair.chosen == data.TokenizedSequence((1, *b("ab")), (*b("cd"), 2))
    assert pair.rejected == data.TokenizedSequence((1, *b("ab")), (*b("e"), 2))
    batch = data.collate_preferences(pairs, max_length=8, pad_id=0)
    assert isinstance(batch, rx.PreferenceBatch)
    np.testing.assert_array_equal(batch.chosen_tokens, [[1, *b("ab"), *b("cd"), 2, 0, 0]])
    np.testing.assert_array_equal(batch.chosen_mask, [[1, 1, 1, 1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(batch.chosen_completion_mask, [[0, 0, 0, 1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(batch.rejected_tokens, [[1, *b("ab"), *b("e"), 2, 0, 0, 0]])
    np.testing.assert_array_equal(batch.rejected_mask, [[1, 1, 1, 1, 1, 0, 0, 0]])
    np.testing.assert_array_equal(batch.rejected_completion_mask, [[0, 0, 0, 1, 1, 0, 0, 0]])
    for leaf in (batch.chosen_tokens, batch.rejected_tokens):
        assert isinstance(leaf, jax.Array) and leaf.dtype == jnp.int32
    for leaf in (batch.chosen_mask, batch.chosen_completion_mask, batch.rejected_completion_mask):
        assert isinstance(leaf, jax.Array) and leaf.dtype == jnp.bool_
    assert batch.ref_chosen_logp is None


def test_no_bos_eos():
    pairs, _ = data.tokenize_preferences(
        [data.PreferenceRecord("ab", "cd", "e")],
        BYTES,
        max_length=8,
        max_prompt_length=4,
        add_bos=False,
        add_eos=False,
    )
    assert pairs[0].chosen == data.TokenizedSequence(tuple(b("ab")), tuple(b("cd")))


def test_truncation_keep_end():
    rec = data.PreferenceRecord("0123456789", "abcdef", "xy")
    pairs, report = data.tokenize_preferences([rec], BYTES, max_length=8, max_prompt_length=4)
    (pair,) = pairs
    # Prompt: BOS + its last 3 tokens; chosen: cut to the 4 positions left (EOS lost).
    assert pair.chosen.prompt == (1, *b("789"))
    assert pair.chosen.completion == tuple(b("abcd"))
    assert pair.rejected.completion == (*b("xy"), 2)
    assert (report.prompt_truncated, report.completion_truncated, report.kept) == (1, 1, 1)
    batch = data.collate_preferences(pairs, max_length=8, pad_id=0)
    assert batch.chosen_mask.all() and int(batch.chosen_completion_mask.sum()) == 4


def test_truncation_drop_over_long_records():
    records = [
        data.PreferenceRecord("p", "short", "ok"),
        data.PreferenceRecord("a very long prompt indeed", "x", "y"),
        data.PreferenceRecord("p", "a completion far too long for the limit", "y"),
    ]
    pairs, report = data.tokenize_preferences(
        records, BYTES, max_length=12, max_prompt_length=6, truncation="drop"
    )
    assert len(pairs) == 1 and pairs[0].chosen.completion == (*b("short"), 2)
    assert report.dropped == {"too long": 2} and report.total == 3 and report.kept == 1
    _, kept = data.tokenize_preferences(records, BYTES, max_length=12, max_prompt_length=6)
    assert kept.kept == 3 and kept.prompt_truncated == 1 and kept.completion_truncated == 1


def test_empty_completion_dropped():
    pairs, report = data.tokenize_preferences(
        [data.PreferenceRecord("p", "", "y")],
        BYTES,
        max_length=8,
        max_prompt_length=4,
        add_eos=False,
    )
    assert pairs == [] and report.dropped == {"empty completion": 1}


def test_bad_arguments():
    rec = [data.PreferenceRecord("p", "a", "b")]
    with pytest.raises(data.DataError, match="max_prompt_length < max_length"):
        data.tokenize_preferences(rec, BYTES, max_length=4, max_prompt_length=4)
    with pytest.raises(data.DataError, match="truncation"):
        data.tokenize_preferences(rec, BYTES, max_length=8, max_prompt_length=4, truncation="left")
    pairs, _ = data.tokenize_preferences(rec, BYTES, max_length=8, max_prompt_length=4)
    with pytest.raises(data.DataError, match="more than max_length"):
        data.collate_preferences(pairs, max_length=3, pad_id=0)
    with pytest.raises(data.DataError, match="empty batch"):
        data.collate_preferences([], max_length=3, pad_id=0)


def test_boundary_merge_moves_split(shared_dir):
    """With tok512, "Once up" + "on a time" merges "upon" across the boundary."""
    tok = data.Llama2cTokenizer.from_file(
        os.path.join(shared_dir, "models", "stories260K", "tok512.bin")
    )
    full = tok.encode("Once upon a time")
    assert tok.encode("Once up") != full[: len(tok.encode("Once up"))]
    seqs, report = data.tokenize_sft(
        [("Once up", "on a time")], tok, max_length=16, max_prompt_length=8
    )
    assert report.boundary_merged == 1
    (seq,) = seqs
    assert seq.prompt + seq.completion == (tok.bos_id, *full, tok.eos_id)
    assert seq.prompt == (tok.bos_id, full[0])  # " Once"; " upon" belongs to the completion
    # No merge across a space: the prompt's own ids are kept.
    seqs, report = data.tokenize_sft(
        [("Once upon", " a time")], tok, max_length=16, max_prompt_length=8
    )
    assert report.boundary_merged == 0 and seqs[0].prompt == (tok.bos_id, *tok.encode("Once upon"))


texts = st.text(alphabet="abc é", max_size=12)


@given(
    texts,
    texts,
    texts,
    st.integers(1, 10),
    st.integers(1, 12),
    st.sampled_from(["keep_end", "drop"]),
)
def test_tokenize_invariants(prompt, chosen, rejected, max_prompt_length, extra, truncation):
    max_length = max_prompt_length + extra
    rec = data.PreferenceRecord(prompt, chosen, rejected)
    pairs, report = data.tokenize_preferences(
        [rec],
        BYTES,
        max_length=max_length,
        max_prompt_length=max_prompt_length,
        truncation=truncation,
    )
    assert report.total == 1 and report.kept + report.num_dropped == 1
    fits = all(
        len(b(prompt)) + 1 <= max_prompt_length and len(b(prompt)) + len(b(c)) + 2 <= max_length
        for c in (chosen, rejected)
    )
    if truncation == "drop":
        assert len(pairs) == int(fits)
    else:
        assert len(pairs) == 1
    for pair in pairs:
        for seq, text in ((pair.chosen, chosen), (pair.rejected, rejected)):
            assert seq.prompt[0] == BYTES.bos_id and len(seq.prompt) <= max_prompt_length
            assert 1 <= len(seq.completion) and len(seq) <= max_length
            full = (1, *b(prompt), *b(text), 2)
            # Truncation keeps the end of the prompt and the start of the completion.
            kept = len(seq.prompt) - 1
            assert tuple(b(prompt))[len(b(prompt)) - kept :] == seq.prompt[1:]
            assert full[len(b(prompt)) + 1 :][: len(seq.completion)] == seq.completion
            if fits:
                assert seq.prompt + seq.completion == full
        batch = data.collate_preferences(pairs, max_length=max_length, pad_id=0)
        for tokens, mask, cmask, seq in (
            (batch.chosen_tokens, batch.chosen_mask, batch.chosen_completion_mask, pair.chosen),
            (
                batch.rejected_tokens,
                batch.rejected_mask,
                batch.rejected_completion_mask,
                pair.rejected,
            ),
        ):
            tokens, mask, cmask = np.asarray(tokens[0]), np.asarray(mask[0]), np.asarray(cmask[0])
            n = len(seq)
            assert mask[:n].all() and not mask[n:].any()  # right padding
            assert not (cmask & ~mask).any()
            assert cmask.sum() == len(seq.completion) and cmask[len(seq.prompt) : n].all()
            assert (tokens[n:] == 0).all()


def test_sft_batch():
    seqs, report = data.tokenize_sft(
        [("hi", "yo"), data.PreferenceRecord("a", "bc", "zz")],
        BYTES,
        max_length=6,
        max_prompt_length=3,
    )
    assert report.kept == 2
    batch = data.collate_sft(seqs, max_length=6, pad_id=0)
    assert isinstance(batch, rx.SequenceBatch)
    np.testing.assert_array_equal(
        batch.tokens, [[1, *b("hi"), *b("yo"), 2], [1, *b("a"), *b("bc"), 2, 0]]
    )
    np.testing.assert_array_equal(batch.completion_mask, [[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 0]])
    np.testing.assert_array_equal(batch.mask, [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]])
    with pytest.raises(data.DataError, match="SFT records"):
        data.tokenize_sft([3], BYTES, max_length=6, max_prompt_length=3)


def test_prompt_batch_left_padded():
    prompts, report = data.tokenize_prompts(
        [data.PromptRecord("abc"), "a", data.PromptRecord("abcdefgh")], BYTES, max_prompt_length=5
    )
    assert prompts == [(1, *b("abc")), (1, *b("a")), (1, *b("efgh"))]
    assert report.prompt_truncated == 1
    batch = data.collate_prompts(prompts, max_length=5, pad_id=0)
    assert isinstance(batch, rx.PromptBatch)
    np.testing.assert_array_equal(
        batch.tokens, [[0, 1, *b("abc")], [0, 0, 0, 1, *b("a")], [1, *b("efgh")]]
    )
    np.testing.assert_array_equal(batch.mask, [[0, 1, 1, 1, 1], [0, 0, 0, 1, 1], [1, 1, 1, 1, 1]])
    assert batch.tokens.dtype == jnp.int32 and batch.mask.dtype == jnp.bool_
    dropped, report = data.tokenize_prompts(
        ["abcdefgh"], BYTES, max_prompt_length=5, truncation="drop"
    )
    assert dropped == [] and report.dropped == {"too long": 1}
    with pytest.raises(data.DataError, match="more than max_length"):
        data.collate_prompts(prompts, max_length=4, pad_id=0)


def test_hh_rlhf_batch_with_stories_tokenizer(shared_dir):
    tok = data.load_tokenizer(os.path.join(shared_dir, "models", "stories260K", "tok512.bin"))
    ds = data.load_preferences(
        os.path.join(shared_dir, "data", "hh-rlhf", "harmless-base", "test.jsonl.gz")
    )
    records = ds[:16]
    pairs, report = data.tokenize_preferences(records, tok, max_length=256, max_prompt_length=128)
    assert report.kept == 16 and report.boundary_merged == 0
    assert report.prompt_truncated > 0  # HH prompts are long for 128 tokens
    batch = data.collate_preferences(pairs, max_length=256, pad_id=tok.pad_id)
    for name in ("chosen", "rejected"):
        tokens = np.asarray(getattr(batch, f"{name}_tokens"))
        mask = np.asarray(getattr(batch, f"{name}_mask"))
        cmask = np.asarray(getattr(batch, f"{name}_completion_mask"))
        assert tokens.shape == mask.shape == cmask.shape == (16, 256)
        assert tokens.dtype == np.int32 and mask.dtype == cmask.dtype == np.bool_
        assert ((tokens >= 0) & (tokens < tok.vocab_size)).all()
        assert (tokens[:, 0] == tok.bos_id).all()
        lengths = mask.sum(1)
        assert (mask == (np.arange(256)[None, :] < lengths[:, None])).all()
        assert not (cmask & ~mask).any() and (cmask.sum(1) > 0).all()
        assert (tokens[~mask] == tok.pad_id).all()
    # Chosen and rejected share the prompt tokens exactly.
    prompt_c = np.asarray(batch.chosen_mask & ~batch.chosen_completion_mask)
    prompt_r = np.asarray(batch.rejected_mask & ~batch.rejected_completion_mask)
    np.testing.assert_array_equal(prompt_c, prompt_r)
    np.testing.assert_array_equal(
        np.where(prompt_c, batch.chosen_tokens, 0), np.where(prompt_r, batch.rejected_tokens, 0)
    )
    # An untruncated row decodes back to its text.
    for pair, rec in zip(pairs, records):
        if (
            len(pair.chosen) < 256
            and pair.chosen.completion[-1] == tok.eos_id
            and len(pair.chosen.prompt) < 128
        ):
            assert (
                tok.decode(pair.chosen.prompt + pair.chosen.completion) == rec.prompt + rec.chosen
            )
            assert tok.decode(pair.chosen.completion) == rec.chosen.removeprefix(" ")
            break
    else:
        pytest.fail("no untruncated pair among the first 16")
