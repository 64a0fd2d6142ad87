"""Bad input is refused where it enters: token ids outside the vocabulary, malformed
batches. Shape checks are off for users by default, so these run with them off."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest

import rlhf_eqx as rx
from rlhf_eqx import data

BYTES = data.ByteTokenizer()


@pytest.fixture
def no_shape_checks():
    """The library as users get it: jaxtyping's checks switched off."""
    before = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", before)


def seq(prompt, completion):
    return data.TokenizedSequence(tuple(prompt), tuple(completion))


# --- token ids outside the vocabulary ----------------------------------------------------


def test_collate_refuses_an_id_past_the_vocabulary():
    pairs = [
        data.TokenizedPair(seq([1, 5], [6, 2]), seq([1, 5], [7, 2])),
        data.TokenizedPair(seq([1, 5], [6, 2]), seq([1, 5], [300, 2])),
    ]
    with pytest.raises(data.DataError, match=r"row 1 has token id 300 at position 2.*\[0, 259\)"):
        data.collate_preferences(pairs, max_length=6, pad_id=0, vocab_size=259)
    batch = data.collate_preferences(pairs, max_length=6, pad_id=0, vocab_size=301)
    assert int(batch.rejected_tokens[1, 2]) == 300


def test_collate_refuses_negative_ids_even_without_a_vocabulary():
    with pytest.raises(data.DataError, match="row 0 has token id -3 at position 1"):
        data.collate_sft([seq([1, -3], [4])], max_length=4, pad_id=0)
    with pytest.raises(data.DataError, match=r"token id 4294967296 .*int32"):
        data.collate_sft([seq([1], [2**32])], max_length=4, pad_id=0)


def test_collate_refuses_a_pad_id_outside_the_vocabulary():
    with pytest.raises(data.DataError, match=r"pad_id=512 is outside .*\[0, 512\)"):
        data.collate_sft([seq([1], [4])], max_length=4, pad_id=512, vocab_size=512)


def test_collate_prompts_checks_ids():
    with pytest.raises(data.DataError, match="prompt 1 has token id 9 at position 3"):
        data.collate_prompts([[1, 3], [1, 2, 9]], max_length=4, pad_id=0, vocab_size=8)
    batch = data.collate_prompts([[1, 3], [1, 2, 7]], max_length=4, pad_id=0, vocab_size=8)
    np.testing.assert_array_equal(batch.tokens, [[0, 0, 1, 3], [0, 1, 2, 7]])


def test_check_vocab_names_both_sizes(shared_dir):
    tok = data.load_tokenizer(f"{shared_dir}/models/stories260K/tok512.bin")
    data.check_vocab(tok, 512)
    data.check_vocab(tok, 576)  # a padded model vocabulary is fine
    with pytest.raises(data.DataError, match="tokenizer has 512 ids.*only 259"):
        data.check_vocab(tok, 259)
    data.check_vocab(BYTES, 259)
    with pytest.raises(data.DataError, match="259 ids.*only 100"):
        data.check_vocab(BYTES, 100)


def test_check_vocab_refuses_special_ids_outside():
    class Odd(data.ByteTokenizer):
        vocab_size = 10
        eos_id = 12

    with pytest.raises(data.DataError, match=r"eos_id=12 is outside .*\[0, 10\)"):
        data.check_vocab(Odd(), 10)


# --- batches validate themselves ---------------------------------------------------------

B, T = 3, 5
TOK = jnp.zeros((B, T), jnp.int32)
MASK = jnp.ones((B, T), bool)


def preference(**changes):
    fields = dict(
        chosen_tokens=TOK,
        chosen_mask=MASK,
        chosen_completion_mask=MASK,
        rejected_tokens=TOK,
        rejected_mask=MASK,
        rejected_completion_mask=MASK,
    )
    fields.update(changes)
    return rx.PreferenceBatch(**fields)


@pytest.mark.usefixtures("no_shape_checks")
@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"rejected_mask": jnp.ones((B, T + 1), bool)},
            r"rejected_mask has shape \(3, 6\) but PreferenceBatch.chosen_tokens has shape "
            r"\(3, 5\)",
        ),
        (
            {"rejected_tokens": jnp.zeros((B + 1, T), jnp.int32)},
            r"rejected_tokens has shape \(4, 5\)",
        ),
        (
            {"chosen_mask": jnp.ones((B, T), jnp.int32)},
            "chosen_mask must be a boolean mask, got dtype int32",
        ),
        (
            {"chosen_completion_mask": jnp.ones((B, T), jnp.float32)},
            "chosen_completion_mask must be a boolean",
        ),
        (
            {"chosen_tokens": jnp.zeros((B, T), jnp.float32)},
            "chosen_tokens must hold integer token ids",
        ),
        (
            {"chosen_tokens": jnp.zeros((T,), jnp.int32)},
            r"chosen_tokens must be a batch .*\[B, T\], got shape \(5,\)",
        ),
        (
            {"ref_chosen_logp": jnp.zeros((B + 1,), jnp.float32)},
            r"ref_chosen_logp has shape \(4,\).*B=3",
        ),
        (
            {"ref_rejected_logp": jnp.zeros((B,), jnp.int32)},
            "ref_rejected_logp must be floating point",
        ),
    ],
)
def test_preference_batch_refuses(changes, message):
    with pytest.raises(data.DataError, match=message):
        preference(**changes)


@pytest.mark.usefixtures("no_shape_checks")
@pytest.mark.parametrize("shape", [(0, T), (B, 0)])
def test_batches_refuse_empty(shape):
    tok, mask = jnp.zeros(shape, jnp.int32), jnp.ones(shape, bool)
    for make in (
        lambda: rx.SequenceBatch(tok, mask, mask),
        lambda: rx.PromptBatch(tok, mask),
        lambda: preference(
            chosen_tokens=tok,
            chosen_mask=mask,
            chosen_completion_mask=mask,
            rejected_tokens=tok,
            rejected_mask=mask,
            rejected_completion_mask=mask,
        ),
    ):
        with pytest.raises(data.DataError, match="at least one row and one position"):
            make()


@pytest.mark.usefixtures("no_shape_checks")
def test_sequence_and_prompt_batches_refuse():
    with pytest.raises(data.DataError, match=r"SequenceBatch.completion_mask has shape \(3, 4\)"):
        rx.SequenceBatch(TOK, MASK, jnp.ones((B, T - 1), bool))
    with pytest.raises(data.DataError, match="PromptBatch.mask must be a boolean mask"):
        rx.PromptBatch(TOK, jnp.ones((B, T), jnp.uint8))
    with pytest.raises(data.DataError, match=r"SequenceBatch.tokens must be a batch"):
        rx.SequenceBatch(TOK[0], MASK[0], MASK[0])


def test_batches_still_work_under_transformations():
    batch = preference(
        ref_chosen_logp=jnp.zeros((B,), jnp.float32), ref_rejected_logp=jnp.zeros((B,), jnp.float32)
    )
    # Per-sample code under vmap sees rows without the batch axis.
    lengths = jax.vmap(lambda b: jnp.sum(b.chosen_mask))(batch)
    np.testing.assert_array_equal(lengths, [T] * B)
    jitted = jax.jit(lambda b: preference(chosen_tokens=b.chosen_tokens + 1))(batch)
    assert int(jitted.chosen_tokens[0, 0]) == 1
    filled = eqx.tree_at(
        lambda b: b.ref_chosen_logp,
        preference(),
        jnp.ones((B,), jnp.float32),
        is_leaf=lambda x: x is None,
    )
    assert filled.ref_chosen_logp.shape == (B,)
    micro = jax.tree.map(lambda x: x.reshape((B, 1) + x.shape[1:]), batch)
    assert micro.chosen_tokens.shape == (B, 1, T)
    shapes = jax.eval_shape(lambda: preference())
    assert shapes.chosen_tokens.shape == (B, T)


@pytest.mark.usefixtures("no_shape_checks")
def test_an_in_axes_specification_is_not_refused():
    # Built from the class, it holds integers, not arrays.
    spec = rx.PreferenceBatch(0, 0, 0, 0, 0, 0, None, None)
    out = jax.vmap(lambda b: b.chosen_tokens.sum(), in_axes=(spec,))(preference())
    assert out.shape == (B,)
