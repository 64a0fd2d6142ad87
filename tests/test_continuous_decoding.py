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


@pytest.mark.parametrize("settings", [SETTINGS[0], SETTINGS[2]])
@pytest.mark.parametrize("steps", [[3], [100]])
def test_top_logprobs_are_those_of_a_forward_pass(policy, settings, steps):
    """`top_logprobs=K` keeps at each sampled position the K likeliest tokens at the
    row's temperature (1 when greedy), from the logits the decode step sampled from:
    those of a forward pass over prompt ++ completion; the sampled token's entry is its
    log-probability; the tokens are unchanged."""
    toks, masks, keys = _requests()
    K = 5
    kw = dict(max_new_tokens=N, log_steps=4, **settings)
    plain = rx.ContinuousDecoding(policy, toks, masks, keys, **kw)
    decoding = rx.ContinuousDecoding(policy, toks, masks, keys, top_logprobs=K, **kw)
    _to_the_end(plain, steps)
    _to_the_end(decoding, steps)
    np.testing.assert_array_equal(decoding.tokens, plain.tokens)
    np.testing.assert_array_equal(decoding.logprobs, plain.logprobs)
    assert decoding.top_ids.shape == decoding.top_logprobs.shape == (5, N, K)
    out = decoding.output()
    logits = jax.vmap(policy)(out.tokens, out.mask).astype(jnp.float32)
    temps = np.broadcast_to(np.asarray(settings.get("temperature", 1.0), np.float32), (5,))
    temps = np.where(temps == 0, 1.0, temps)
    logp = jax.nn.log_softmax(logits / temps[:, None, None], axis=-1)
    P = toks.shape[1]
    want_lp, want_ids = jax.lax.top_k(logp[:, P - 1 : -1], K)
    real = np.arange(N)[None, :] < decoding.lengths[:, None]
    np.testing.assert_array_equal(decoding.top_ids[real], np.asarray(want_ids)[real])
    np.testing.assert_allclose(
        decoding.top_logprobs[real], np.asarray(want_lp)[real], atol=1e-5, rtol=0
    )
    assert not decoding.top_logprobs[~real].any()
    # the sampled token's log-probability is its entry among the alternatives
    for b, t in zip(*np.nonzero(real)):
        hit = decoding.top_ids[b, t] == decoding.tokens[b, t]
        if hit.any():
            assert decoding.top_logprobs[b, t][hit][0] == decoding.logprobs[b, t]


def test_a_pause_token_ends_the_call_after_its_step(policy):
    """A call ends right after the step in which a row samples one of its pause tokens;
    the tokens are those of the calls without pauses."""
    toks, masks, keys = _requests()
    kw = dict(slots=2, max_new_tokens=N, temperature=1.0)
    plain = rx.ContinuousDecoding(policy, toks, masks, keys, **kw)
    _to_the_end(plain, [N])
    pause = np.zeros((5, CFG.vocab_size), bool)
    marked = int(plain.tokens[1, 2])  # row 1's third token
    pause[1, marked] = True
    decoding = rx.ContinuousDecoding(policy, toks, masks, keys, pause_tokens=pause, **kw)
    first = decoding.run(N)
    assert first <= 3 and marked in decoding.tokens[1, : decoding.lengths[1]]
    assert decoding.tokens[1, decoding.lengths[1] - 1] == marked
    _to_the_end(decoding, [N])
    np.testing.assert_array_equal(decoding.tokens, plain.tokens)
    with pytest.raises(ValueError, match="pause_tokens"):
        rx.ContinuousDecoding(policy, toks, masks, keys, pause_tokens=pause[:2], **kw)
    with pytest.raises(ValueError, match="top_logprobs"):
        rx.ContinuousDecoding(policy, toks, masks, keys, top_logprobs=-1, **kw)
