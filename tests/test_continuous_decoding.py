"""`ContinuousDecoding`: run to the end a few steps at a time it samples exactly what one
`generate_continuous` call does (whatever the steps per call, calls longer than
`log_steps` included); a cancelled row frees its slot for a waiting row; the host copy
grows by the new tokens of each call; one compiled program serves every step count."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import compilations

import rlhf_eqx as rx

CFG = rx.TransformerConfig(vocab_size=53, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48)
N = 8


@pytest.fixture(scope="module")
def policy():
    return rx.Policy(CFG, key=jax.random.key(1))


def _requests(lengths=(4, 6, 1, 3, 5), P=6):
    rng = np.random.default_rng(0)
    ids = rng.integers(4, CFG.vocab_size, size=(len(lengths), P))
    masks = np.arange(P)[None, :] >= (P - np.array(lengths))[:, None]
    toks = jnp.asarray(np.where(masks, ids, 0), jnp.int32)
    return toks, jnp.asarray(masks), jax.random.split(jax.random.key(7), len(lengths))


SETTINGS = [
    dict(slots=2, temperature=0.8, top_k=20, budgets=np.array([3, 8, 1, 6, 5], np.int32)),
    dict(slots=3, temperature=1.0, eos_id=3, stop_sequences=[[5, 6], [7]], num_samples=2),
    dict(
        slots=2,
        temperature=[0.0, 1.3, 0.5, 1.0, 0.7],
        top_k=[0, 5, 0, 9, 2],
        top_p=[1.0, 0.7, 0.9, 1.0, 0.8],
        eos_id=[3, 4],
    ),
]


def _to_the_end(decoding: rx.ContinuousDecoding, steps) -> int:
    calls = 0
    while not decoding.done:
        assert decoding.run(steps[min(calls, len(steps) - 1)]) >= 1
        calls += 1
    return calls


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("steps", [[1], [3], [2, 4, 8, 16], [100]])
def test_run_to_the_end_equals_generate_continuous(policy, settings, steps):
    """Whatever the steps per call (at most `log_steps` = 4: new tokens only; more:
    the whole completions), the tokens and log-probabilities are those of one call."""
    toks, masks, keys = _requests()
    want = rx.generate_continuous(policy, toks, masks, keys, max_new_tokens=N, **settings)
    decoding = rx.ContinuousDecoding(
        policy, toks, masks, keys, max_new_tokens=N, log_steps=4, **settings
    )
    _to_the_end(decoding, steps)
    got = decoding.output()
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.mask, want.mask)
    np.testing.assert_array_equal(got.completion_mask, want.completion_mask)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-6, rtol=0)
    P = toks.shape[1]
    np.testing.assert_array_equal(decoding.tokens, np.asarray(want.tokens)[:, P:])
    np.testing.assert_array_equal(decoding.lengths, np.asarray(want.completion_mask).sum(1))
    assert decoding.run(1) == 0  # nothing left


def test_each_call_adds_at_most_its_steps(policy):
    toks, masks, keys = _requests()
    decoding = rx.ContinuousDecoding(
        policy, toks, masks, keys, slots=2, max_new_tokens=N, temperature=1.0
    )
    before = decoding.lengths.copy()
    while not decoding.done:
        n = decoding.run(3)
        grew = decoding.lengths - before
        assert grew.min() >= 0 and grew.max() <= n <= 3
        assert grew.sum() <= 2 * n  # two slots
        before = decoding.lengths.copy()
    assert (decoding.lengths == N).all()


def test_cancelling_a_row_frees_its_slot_for_a_waiting_row(policy):
    """One slot, three rows: row 0 cancelled after 3 tokens keeps them, row 1 takes the
    slot at the next call and samples what it samples alone; row 2, cancelled while
    waiting, is never admitted."""
    toks, masks, keys = _requests()
    toks, masks, keys = toks[:3], masks[:3], keys[:3]
    kw = dict(max_new_tokens=N, temperature=1.0)
    want = rx.generate_continuous(policy, toks, masks, keys, slots=3, **kw)
    decoding = rx.ContinuousDecoding(policy, toks, masks, keys, slots=1, **kw)
    decoding.run(3)
    assert decoding.lengths.tolist() == [3, 0, 0]
    decoding.cancel([0])
    decoding.run(2)
    assert decoding.lengths.tolist() == [3, 2, 0]  # row 1 in the freed slot at once
    decoding.cancel([2])
    _to_the_end(decoding, [4])
    assert decoding.lengths.tolist() == [3, N, 0]
    P = toks.shape[1]
    full = np.asarray(want.tokens)[:, P:]
    np.testing.assert_array_equal(decoding.tokens[0, :3], full[0, :3])
    np.testing.assert_array_equal(decoding.tokens[1], full[1])
    out = decoding.output()
    assert np.asarray(out.completion_mask).sum(1).tolist() == [3, N, 0]


def test_one_program_serves_every_step_count(policy):
    toks, masks, keys = _requests()
    kw = dict(slots=2, max_new_tokens=N, temperature=1.0, log_steps=2)
    _to_the_end(rx.ContinuousDecoding(policy, toks, masks, keys, **kw), [1])

    def again():
        decoding = rx.ContinuousDecoding(policy, toks, masks, keys, **kw)
        decoding.run(2)
        decoding.cancel([3])
        _to_the_end(decoding, [5, 1, 7])

    assert compilations(again) == []


def test_bad_steps_are_refused(policy):
    toks, masks, keys = _requests()
    decoding = rx.ContinuousDecoding(policy, toks, masks, keys, slots=2, max_new_tokens=N)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="steps"):
            decoding.run(bad)
    for bad in (1.5, None):  # refused by the type checks when on, else by `run`
        with pytest.raises((TypeError, ValueError)):
            decoding.run(bad)
    with pytest.raises(ValueError, match="log_steps"):
        rx.ContinuousDecoding(policy, toks, masks, keys, slots=2, max_new_tokens=N, log_steps=0)
