"""Sampler edge cases an embedding caller meets: rows of different lengths, one row, one
new token, a prompt filling the context, stop strings inside multi-byte characters."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlhf_eqx as rx
from rlhf_eqx import data

CFG = rx.TransformerConfig(
    vocab_size=41, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=12
)


@eqx.filter_jit
def _next_token(model, tokens, mask):
    return jnp.argmax(model(tokens, mask)[-1])


def _greedy_by_full_forward(model, prompt: list[int], n: int) -> list[int]:
    """`n` tokens, each the argmax of the full forward over the prompt and the tokens so
    far (no cache)."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(_next_token(model, jnp.asarray(seq), jnp.ones(len(seq), bool))))
    return seq[len(prompt) :]


def test_greedy_equals_the_full_forward_for_every_row_shape():
    """Left-padded rows of different lengths, a batch of one, one new token, and a
    prompt that with its completion fills `max_seq_len` exactly: each row's greedy
    completion is the argmax of the full forward, step by step, of its real tokens."""
    policy = rx.Policy(CFG, key=jax.random.key(3))
    rows = [[5, 9, 2, 33], [17], [8, 8, 30]]
    P = max(map(len, rows))
    prompts = jnp.asarray([[0] * (P - len(r)) + r for r in rows], jnp.int32)
    masks = jnp.asarray([[False] * (P - len(r)) + [True] * len(r) for r in rows])
    key = jax.random.key(0)
    for n in (1, CFG.max_seq_len - P):
        out = rx.generate_batch(policy, prompts, masks, key, max_new_tokens=n, temperature=0.0)
        for b, row in enumerate(rows):
            assert out.tokens[b, P:].tolist() == _greedy_by_full_forward(policy, row, n), (n, b)
    one = rx.generate_batch(
        policy, prompts[1:2], masks[1:2], key, max_new_tokens=2, temperature=0.0
    )
    assert one.tokens[0, P:].tolist() == _greedy_by_full_forward(policy, rows[1], 2)
    full = jnp.asarray([[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]], jnp.int32)  # 11 of 12
    out = rx.generate_batch(
        policy, full, jnp.ones_like(full, bool), key, max_new_tokens=1, temperature=0.0
    )
    assert out.tokens[0, -1:].tolist() == _greedy_by_full_forward(policy, full[0].tolist(), 1)


def test_stop_strings_never_cut_inside_a_character():
    """With byte tokens, the kept completion is the longest prefix of whole characters
    before the stop string; its log-probabilities are kept, the rest zeroed."""
    tok = data.ByteTokenizer()
    cases = [
        ("ab😀cd", ["c"], "ab😀"),
        ("ab😀cd", ["😀"], "ab"),
        ("日本語です。終わり", ["。"], "日本語です"),
        ("aéb", ["é", "b"], "a"),
        ("Sure.\n\nHuman: more", ["\n\nHuman:"], "Sure."),
    ]
    for text, stops, kept in cases:
        ids = tok.encode(text)
        cm = jnp.asarray([[False] + [True] * len(ids)])
        out = rx.GenerationOutput(
            tokens=jnp.asarray([[tok.bos_id] + ids], jnp.int32),
            mask=cm.at[0, 0].set(True),
            completion_mask=cm,
            logprobs=jnp.where(cm, -0.5, 0.0).astype(jnp.float32),
        )
        cut = rx.truncate_at_stop_strings(out, tok, stops)
        real = np.asarray(cut.completion_mask[0])
        assert tok.decode(np.asarray(cut.tokens[0])[real].tolist()) == kept, text
        n = len(kept.encode("utf-8"))
        np.testing.assert_array_equal(real[1:], np.arange(len(ids)) < n)
        np.testing.assert_array_equal(cut.logprobs[0, 1:], np.where(real[1:], -0.5, 0.0))


def test_a_prompt_without_a_real_token_is_refused():
    """A row of `prompt_masks` with no real token has nothing to condition on:
    `generate_batch` and `generate` name the row, as `generate_continuous` does."""
    policy = rx.Policy(CFG, key=jax.random.key(3))
    prompts = jnp.asarray([[3, 4, 5], [0, 0, 0], [0, 0, 0]], jnp.int32)
    masks = jnp.asarray([[1, 1, 1], [0, 0, 0], [0, 0, 0]], bool)
    key = jax.random.key(0)
    with pytest.raises(ValueError, match=r"prompt_masks: row 1 has no real token"):
        rx.generate_batch(policy, prompts, masks, key, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"prompt_masks: row 0 has no real token"):
        rx.generate(policy, prompts[1], masks[1], key, max_new_tokens=2)
