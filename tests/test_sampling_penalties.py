"""Sampling penalties (`repetition_penalty`, `presence_penalty`, `frequency_penalty`): the
formulas against a NumPy reference of Hugging Face's `RepetitionPenaltyLogitsProcessor`
and vLLM's `apply_penalties`, a step-by-step loop over the full forward (no cache) with
that reference giving `generate_batch`'s tokens (greedy and seeded), penalties off the
same numbers as without them, per-row values under continuous batching equal to each
row alone, prompt padding never counted, the multi-turn rollouts, and the checks."""

import equinox as eqx
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import compilations
from hypothesis import given, settings, strategies as st

import rlhf_eqx as rx
from rlhf_eqx.envs import Environment, rollout_multiturn, rollout_multiturn_host

CFG = rx.TransformerConfig(
    vocab_size=29, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=32
)
N = 8  # max_new_tokens
ROWS = [[5, 9, 2, 13], [17], [8, 8, 3, 21, 4], [11, 7]]
P = max(map(len, ROWS))
PENALTIES = dict(repetition_penalty=1.8, presence_penalty=0.7, frequency_penalty=0.4)


@pytest.fixture(scope="module")
def policy():
    # logits spread wide enough (the tiny random policy is close to uniform otherwise)
    p = rx.Policy(CFG, key=jax.random.key(1))
    return eqx.tree_at(lambda m: m.lm_head, p, p.lm_head * 6.0)


def _prompts(pad_ids=None):
    """`ROWS` left-padded (padding id 0, or row `b`'s `pad_ids[b]`), their masks and one
    key per row."""
    pad = pad_ids or [0] * len(ROWS)
    toks = jnp.asarray([[pad[b]] * (P - len(r)) + r for b, r in enumerate(ROWS)], jnp.int32)
    masks = jnp.asarray([[False] * (P - len(r)) + [True] * len(r) for r in ROWS])
    return toks, masks, jax.random.split(jax.random.key(7), len(ROWS))


# --- the reference ---------------------------------------------------------------------------


def _reference(logits, context_ids, generated_ids, r=1.0, p=0.0, f=0.0):
    """Hugging Face's `RepetitionPenaltyLogitsProcessor` (`gather` the logits of the ids in
    `input_ids`, `where(score < 0, score * r, score / r)`, `scatter` back) followed by
    vLLM's `apply_penalties` frequency and presence terms (`logits -= f * counts`, then
    `logits -= p * (counts > 0)`), over the generated ids only, in float32."""
    out = np.array(logits, np.float32)
    ids = np.unique(np.asarray(context_ids, np.int64))
    score = out[ids]
    out[ids] = np.where(score < 0, score * np.float32(r), score / np.float32(r))
    counts = np.bincount(np.asarray(generated_ids, np.int64), minlength=out.shape[-1])
    out = out - np.float32(f) * counts.astype(np.float32)
    return out - np.float32(p) * (counts > 0).astype(np.float32)


@eqx.filter_jit
def _last_logits(model, tokens):
    return model(tokens, jnp.ones(tokens.shape, bool))[-1]


def _by_full_forward(model, prompt, key, n, temperature, **penalties):
    """`n` tokens of one row, each drawn (greedy: the argmax) from the reference's
    penalised logits of a full forward over the real tokens so far (no cache), token `t`
    with `fold_in(key, t)` as `generate_batch` draws a row with its own key; and their
    log-probabilities at `temperature` before the penalties."""
    r = penalties.get("repetition_penalty", 1.0)
    p = penalties.get("presence_penalty", 0.0)
    f = penalties.get("frequency_penalty", 0.0)
    seq, lps = list(prompt), []
    for t in range(n):
        logits = np.asarray(_last_logits(model, jnp.asarray(seq, jnp.int32)))
        pen = _reference(logits, seq, seq[len(prompt) :], r, p, f)
        if temperature == 0:
            tok = int(np.argmax(pen))
            scaled = logits
        else:  # the draw of sample_token on the penalised logits (no penalty of its own)
            tok = int(
                rx.sample_token(
                    jax.random.fold_in(key, t), jnp.asarray(pen), temperature=temperature
                )[0]
            )
            scaled = logits / np.float32(temperature)
        lps.append(
            float(scaled[tok] - np.log(np.sum(np.exp(scaled - scaled.max()))) - scaled.max())
        )
        seq.append(tok)
    return seq[len(prompt) :], lps


# --- the formulas -----------------------------------------------------------------------------


def test_penalize_logits_by_hand():
    logits = jnp.array([2.0, -1.0, 0.5, -3.0, 1.0])
    context = jnp.array([True, True, False, False, True])
    generated = jnp.array([0, 2, 0, 1, 0], jnp.int32)
    out = rx.penalize_logits(
        logits,
        context,
        generated,
        repetition_penalty=2.0,
        presence_penalty=0.5,
        frequency_penalty=0.25,
    )
    # 2 / 2; -1 · 2 - 2 · 0.25 - 0.5; untouched; -3 - 0.25 - 0.5; 1 / 2
    np.testing.assert_allclose(out, [1.0, -3.0, 0.5, -3.75, 0.5])
    off = rx.penalize_logits(logits, context, generated)
    assert off is logits
    # per-row values, traced: one row off, one on
    rows = rx.penalize_logits(
        jnp.stack([logits, logits]),
        jnp.stack([context, context]),
        jnp.stack([generated, generated]),
        repetition_penalty=jnp.array([1.0, 2.0]),
        presence_penalty=jnp.array([0.0, 0.5]),
        frequency_penalty=jnp.array([0.0, 0.25]),
    )
    np.testing.assert_array_equal(rows[0], logits)
    np.testing.assert_allclose(rows[1], out)
    numpy_rows = rx.penalize_logits(
        jnp.stack([logits, logits]),
        jnp.stack([context, context]),
        jnp.stack([generated, generated]),
        repetition_penalty=np.array([1.0, 2.0], np.float32),
        presence_penalty=np.array([0.0, 0.5], np.float32),
        frequency_penalty=np.array([0.0, 0.25], np.float32),
    )
    np.testing.assert_array_equal(numpy_rows, rows)


_BIG = float(np.float32(1e30))
_LOGITS = hnp.arrays(
    np.float32,
    (3, 7),
    elements=st.one_of(
        st.floats(-_BIG, _BIG, width=32).filter(lambda x: x == 0 or abs(x) > 1e-20),
        st.sampled_from([0.0, -np.inf, 1e-20, -1e-20]),
    ),
)


@jax.jit
def _penalized(logits, context, generated, r, p, f):
    """`penalize_logits` with per-row (traced) penalties: one program for every example."""
    return rx.penalize_logits(
        logits, context, generated, repetition_penalty=r, presence_penalty=p, frequency_penalty=f
    )


@settings(max_examples=40, deadline=None)
@given(
    logits=_LOGITS,
    context=hnp.arrays(np.bool_, (3, 7)),
    generated=hnp.arrays(np.int32, (3, 7), elements=st.integers(0, 50)),
    r=st.floats(1e-3, 1e6),
    p=st.floats(-2, 2),
    f=st.floats(-2, 2),
)
def test_penalize_logits_property(logits, context, generated, r, p, f):
    """Against the reference, on extreme logits (±1e30, -inf, ±1e-20, 0: nothing that r
    would push into the subnormals XLA flushes to 0) and r up to 1e6; zero counts and an
    empty context are the identity; the repetition penalty never flips a sign, and with
    r >= 1 moves positive logits down."""
    rows = lambda x: jnp.full((3,), x, jnp.float32)  # noqa: E731
    got = np.asarray(_penalized(logits, context, generated, rows(r), rows(p), rows(f)))
    for b in range(3):
        want = _reference(
            logits[b], np.flatnonzero(context[b]), np.repeat(np.arange(7), generated[b]), r, p, f
        )
        np.testing.assert_allclose(got[b], want, rtol=1e-6, atol=0)
    nothing = np.zeros((3, 7), bool), np.zeros((3, 7), np.int32)
    empty = _penalized(logits, *nothing, rows(r), rows(p), rows(f))
    np.testing.assert_array_equal(empty, logits)
    zero = rows(0.0)
    only_rep = np.asarray(_penalized(logits, context, nothing[1], rows(r), zero, zero))
    assert np.all(np.sign(only_rep) == np.sign(logits))  # the sign never flips
    finite = np.isfinite(logits) & context
    if r >= 1:
        assert np.all(np.abs(only_rep[finite]) <= np.abs(logits[finite]) * max(r, 1.0))
        assert np.all(only_rep[finite & (logits > 0)] <= logits[finite & (logits > 0)])


def test_sample_token_greedy_takes_the_penalised_argmax_and_reports_the_models_logprob():
    logits = jnp.array([3.0, 2.5, 0.0, -1.0])
    context, generated = jnp.array([True, False, False, False]), jnp.zeros(4, jnp.int32)
    key = jax.random.key(0)
    tok, lp = rx.sample_token(key, logits, temperature=0.0)
    assert int(tok) == 0
    tok, lp = rx.sample_token(
        key,
        logits,
        temperature=0.0,
        repetition_penalty=2.0,
        context=context,
        generated=generated,
    )
    assert int(tok) == 1  # 3 / 2 < 2.5
    np.testing.assert_allclose(lp, logits[1] - jax.nn.logsumexp(logits), rtol=1e-6)
    with pytest.raises(ValueError, match="context and generated"):
        rx.sample_token(key, logits, presence_penalty=0.5)


# --- generate_batch against the reference loop --------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_generate_batch_equals_the_full_forward_reference(policy, temperature):
    toks, masks, keys = _prompts()
    out = rx.generate_batch(
        policy, toks, masks, keys, max_new_tokens=N, temperature=temperature, **PENALTIES
    )
    plain = rx.generate_batch(policy, toks, masks, keys, max_new_tokens=N, temperature=temperature)
    assert not np.array_equal(out.tokens, plain.tokens)  # the penalties change the draws
    for b, row in enumerate(ROWS):
        want, lps = _by_full_forward(policy, row, keys[b], N, temperature, **PENALTIES)
        assert out.tokens[b, P:].tolist() == want, b
        np.testing.assert_allclose(out.logprobs[b, P:], lps, atol=2e-4)


def test_each_penalty_alone_equals_the_reference(policy):
    toks, masks, keys = _prompts()
    for name, value in [
        ("repetition_penalty", 0.6),
        ("presence_penalty", 2.0),
        ("frequency_penalty", -1.0),
    ]:
        out = rx.generate_batch(
            policy, toks, masks, keys, max_new_tokens=N, temperature=0.0, **{name: value}
        )
        for b, row in enumerate(ROWS):
            want, _ = _by_full_forward(policy, row, keys[b], N, 0.0, **{name: value})
            assert out.tokens[b, P:].tolist() == want, (name, b)


def test_num_samples_rows_count_their_own_tokens(policy):
    """Each of a prompt's samples starts from the prompt alone: sample `g` of prompt `p`
    equals the reference drawn with the row key `fold_in(keys[p], g)`."""
    toks, masks, keys = _prompts()
    out = rx.generate_batch(
        policy,
        toks,
        masks,
        keys,
        max_new_tokens=N,
        temperature=1.1,
        num_samples=2,
        **PENALTIES,
    )
    for b, row in enumerate(ROWS[:2]):
        for g in range(2):
            key = jax.random.fold_in(keys[b], g)
            want, _ = _by_full_forward(policy, row, key, N, 1.1, **PENALTIES)
            assert out.tokens[2 * b + g, P:].tolist() == want, (b, g)


def test_prompt_padding_never_counts(policy):
    """Pad each row with the token it picks first: counted, a strong repetition penalty
    would push it away; it is picked all the same, and the tokens are those of the rows
    padded with 0, under continuous batching and the paged cache too."""
    toks, masks, keys = _prompts()
    kw = dict(max_new_tokens=3, temperature=0.0, repetition_penalty=50.0)
    zero_padded = rx.generate_batch(policy, toks, masks, keys, **kw)
    t0 = zero_padded.tokens[:, P].tolist()
    toks, masks, keys = _prompts(pad_ids=t0)
    out = rx.generate_batch(policy, toks, masks, keys, **kw)
    np.testing.assert_array_equal(out.tokens[:, P:], zero_padded.tokens[:, P:])
    assert any(t0[b] not in row and len(row) < P for b, row in enumerate(ROWS))
    cont = rx.generate_continuous(policy, toks, masks, keys, slots=2, **kw)
    np.testing.assert_array_equal(cont.tokens, out.tokens)
    paged = rx.generate_continuous(policy, toks, masks, keys, slots=2, cache="paged", **kw)
    np.testing.assert_array_equal(paged.tokens, out.tokens)


# --- off: today's numbers -----------------------------------------------------------------------

OFF = dict(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)


def test_penalties_off_are_the_same_program_and_numbers(policy):
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(16,)), jnp.float32)
    trace = lambda **kw: str(  # noqa: E731
        jax.make_jaxpr(lambda k, x: rx.sample_token(k, x, **kw))(jax.random.key(0), logits)
    )
    for kw in (dict(), dict(top_p=0.9), dict(temperature=0.0)):
        assert trace(**kw, **OFF) == trace(**kw)
    toks, masks, keys = _prompts()
    for kw in (dict(temperature=1.3, top_p=0.9), dict(temperature=0.0)):
        want = rx.generate_batch(policy, toks, masks, keys, max_new_tokens=N, **kw)
        got = rx.generate_batch(policy, toks, masks, keys, max_new_tokens=N, **kw, **OFF)
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_array_equal(got.logprobs, want.logprobs)
        kw = kw | dict(slots=2, max_new_tokens=N)
        want = rx.generate_continuous(policy, toks, masks, keys, **kw)
        got = rx.generate_continuous(policy, toks, masks, keys, **kw, **OFF)
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_array_equal(got.logprobs, want.logprobs)


# --- continuous batching: per-row penalties ----------------------------------------------------

ROW_SETTINGS = [
    dict(temperature=0.0, repetition_penalty=1.8),
    dict(temperature=0.9, presence_penalty=1.5, frequency_penalty=0.5),
    dict(temperature=1.2, top_p=0.9, repetition_penalty=0.7, frequency_penalty=-0.5),
    dict(temperature=0.0),
    dict(temperature=1.0, min_p=0.2, **PENALTIES),
]


def test_continuous_equals_generate_batch_with_penalties(policy):
    toks, masks, keys = _prompts()
    kw = dict(max_new_tokens=N, temperature=0.9, eos_id=3, **PENALTIES)
    want = rx.generate_batch(policy, toks, masks, keys, **kw)
    cont = rx.generate_continuous(policy, toks, masks, keys, slots=2, **kw)
    np.testing.assert_array_equal(cont.tokens, want.tokens)
    np.testing.assert_allclose(cont.logprobs, want.logprobs, atol=1e-5)
    decoding = rx.ContinuousDecoding(policy, toks, masks, keys, slots=2, **kw)
    while not decoding.done:
        decoding.run(3)
    np.testing.assert_array_equal(decoding.output().tokens, want.tokens)
    paged = rx.generate_paged(policy, toks, masks, keys, slots=2, page_size=4, **kw)[0]
    np.testing.assert_array_equal(paged.tokens, want.tokens)


def test_per_row_penalties_equal_each_rows_own_and_compile_once(policy):
    toks, masks, keys = (x[jnp.array([0, 1, 2, 3, 1])] for x in _prompts())
    kw = dict(slots=2, max_new_tokens=N, eos_id=3)
    names = ("temperature", "top_p", "min_p", *PENALTIES)
    offs = dict(top_p=1.0, min_p=0.0, **OFF)
    rows = {name: [s.get(name, offs.get(name)) for s in ROW_SETTINGS] for name in names}
    out = rx.generate_continuous(policy, toks, masks, keys, **kw, **rows)
    for i, row_settings in enumerate(ROW_SETTINGS):
        alone = rx.generate_continuous(policy, toks, masks, keys, **kw, **row_settings)
        np.testing.assert_array_equal(out.tokens[i], alone.tokens[i])
        np.testing.assert_allclose(out.logprobs[i], alone.logprobs[i], atol=1e-5, rtol=0)
    again = lambda: rx.generate_continuous(  # noqa: E731
        policy,
        toks,
        masks,
        keys,
        **kw,
        **(rows | dict(repetition_penalty=[1.1, 2.0, 1.0, 0.5, 3.0], presence_penalty=-1.0)),
    ).tokens.block_until_ready()
    assert compilations(again) == []


def test_speculative_refuses_penalties(policy):
    toks, masks, _ = _prompts()
    with pytest.raises(ValueError, match="presence_penalty=0.5"):
        rx.generate_speculative(
            policy,
            policy,
            toks,
            masks,
            jax.random.key(0),
            max_new_tokens=2,
            presence_penalty=0.5,
        )


# --- multi-turn rollouts ----------------------------------------------------------------------


class _Echo(Environment):
    """Observes `[20, 21]` after every turn; done after three turns."""

    max_observation_tokens: int = eqx.field(static=True, default=2)

    def reset(self, key, prompt, prompt_mask):
        return jnp.zeros((), jnp.int32), jnp.array([20, 21], jnp.int32), jnp.ones(2, bool)

    def step(self, state, completion, completion_mask):
        obs = jnp.array([20, 21], jnp.int32)
        return state + 1, obs, jnp.ones(2, bool), jnp.zeros(()), state >= 2


def test_rollouts_penalise_the_whole_context(policy):
    """Greedy: every sampled token is the argmax of the reference over the episode's
    buffer before it (context: prompt, earlier turns, observations; counts: the sampled
    tokens of every turn); the jitted and the host rollouts agree."""
    toks, masks, _ = _prompts()
    kw = dict(max_turns=3, max_new_tokens=3, max_total_tokens=24, temperature=0.0, **PENALTIES)
    key = jax.random.key(3)
    traj = rollout_multiturn(policy, _Echo(), toks, masks, key, **kw)
    host = rollout_multiturn_host(policy, _Echo(), toks, masks, key, **kw)
    np.testing.assert_array_equal(host.tokens, traj.tokens)
    plain = rollout_multiturn(policy, _Echo(), toks, masks, key, **(kw | OFF))
    assert not np.array_equal(plain.tokens, traj.tokens)
    tokens, mask, sampled = (np.asarray(x) for x in (traj.tokens, traj.mask, traj.loss_mask))
    checked = 0
    for b in range(len(ROWS)):
        for j in np.flatnonzero(sampled[b]):
            before = mask[b, :j]
            real = tokens[b, :j][before]
            logits = np.asarray(_last_logits(policy, jnp.asarray(real, jnp.int32)))
            pen = _reference(logits, real, tokens[b, :j][sampled[b, :j]], *PENALTIES.values())
            assert int(np.argmax(pen)) == tokens[b, j], (b, j)
            checked += 1
    assert checked > 20


# --- argument checks ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, bad",
    [
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", float("inf")),
        ("repetition_penalty", True),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("frequency_penalty", float("nan")),
    ],
)
def test_bad_penalties_raise_naming_the_argument(name, bad):
    with pytest.raises(ValueError, match=f"{name} must be .*got {bad!r}"):
        rx.SamplingOptions(max_new_tokens=2, **{name: bad})
    with pytest.raises(ValueError, match=name):
        rx.penalize_logits(jnp.zeros(3), jnp.zeros(3, bool), jnp.zeros(3, jnp.int32), **{name: bad})


def test_bad_per_row_penalties_raise(policy):
    toks, masks, keys = _prompts()
    kw = dict(slots=2, max_new_tokens=2)
    with pytest.raises(ValueError, match="repetition_penalty: each row's"):
        rx.generate_continuous(
            policy, toks, masks, keys, **kw, repetition_penalty=[1.0, 0.0, 1.0, 1.0]
        )
    with pytest.raises(ValueError, match="presence_penalty: each row's"):
        rx.generate_continuous(
            policy, toks, masks, keys, **kw, presence_penalty=[0.0, 0.0, 3.0, 0.0]
        )
    with pytest.raises(ValueError, match="frequency_penalty"):
        rx.generate_continuous(
            policy, toks, masks, keys, **kw, temperature=[1.0] * 4, frequency_penalty=9
        )
    with pytest.raises(ValueError, match="cache='dense'"):
        rx.generate_continuous(
            policy, toks, masks, keys, **kw, presence_penalty=[0.1] * 4, cache="paged"
        )
