"""min-p sampling (`min_p`): the kept set by hand and against Hugging Face's warpers (a
NumPy reference, temperature then top-k, top-p, min-p), `min_p=0` the same numbers as
without it, per-row values under continuous batching equal to each row alone, the
multi-turn rollouts, and the argument checks."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import compilations

import rlhf_eqx as rx
from rlhf_eqx.envs import Environment, rollout_multiturn, rollout_multiturn_host

CFG = rx.TransformerConfig(
    vocab_size=53, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=64
)
N = 6  # max_new_tokens
# p = [0.5, 0.2, 0.15, 0.1, 0.05]: p / max p = [1, 0.4, 0.3, 0.2, 0.1]
HAND = jnp.log(jnp.array([0.5, 0.2, 0.15, 0.1, 0.05], jnp.float32))


@pytest.fixture(scope="module")
def policy():
    return rx.Policy(CFG, key=jax.random.key(1))


def _kept(x) -> list[bool]:
    return np.isfinite(np.asarray(x)).tolist()


def _requests():
    """Five left-padded prompts of different lengths."""
    lengths = [4, 6, 1, 3, 5]
    rng = np.random.default_rng(0)
    ids = rng.integers(1, CFG.vocab_size, size=(len(lengths), 6))
    masks = np.arange(6)[None, :] >= (6 - np.array(lengths))[:, None]
    toks = jnp.asarray(np.where(masks, ids, 0), jnp.int32)
    return toks, jnp.asarray(masks), jax.random.split(jax.random.key(7), len(lengths))


# --- the kept set ------------------------------------------------------------------------


def test_kept_set_by_hand():
    assert _kept(rx.filter_logits(HAND, min_p=0.25)) == [True, True, True, False, False]
    assert _kept(rx.filter_logits(HAND, min_p=0.35)) == [True, True, False, False, False]
    assert _kept(rx.filter_logits(HAND, min_p=0.05)) == [True] * 5
    assert _kept(rx.filter_logits(HAND, min_p=1.0)) == [True, False, False, False, False]
    # after the temperature: at T = 2 the ratios are their square roots (0.63, 0.55, 0.45,
    # 0.32), so min_p = 0.5 keeps three tokens where at T = 1 it keeps one
    assert _kept(rx.filter_logits(HAND, min_p=0.5)) == [True, False, False, False, False]
    assert _kept(rx.filter_logits(HAND / 2, min_p=0.5)) == [True, True, True, False, False]
    # after top-k: the ratio to the best token does not depend on the tokens top-k drops
    assert _kept(rx.filter_logits(HAND, top_k=2, min_p=0.25)) == [True, True, False, False, False]
    # after top-p: top_p = 0.8 keeps 3 (masses above: 0, 0.5, 0.7), min-p keeps all 3 of
    # them; min-p first would renormalise to (0.59, 0.24, 0.18) and top-p keep only 2
    both = rx.filter_logits(HAND, top_p=0.8, min_p=0.25)
    assert _kept(both) == [True, True, True, False, False]
    np.testing.assert_array_equal(np.asarray(both)[:3], np.asarray(HAND)[:3])
    # 0 and None are off
    assert rx.filter_logits(HAND, min_p=0) is HAND and rx.filter_logits(HAND, min_p=None) is HAND


def test_sampled_tokens_follow_the_min_p_distribution():
    """At temperature 2 with min_p = 0.5, tokens 0-2 are drawn in proportion to √p; the
    log-probability is at the temperature, before the filter."""
    keys = jax.random.split(jax.random.key(0), 4000)
    toks, lps = jax.vmap(lambda k: rx.sample_token(k, HAND, temperature=2.0, min_p=0.5))(keys)
    freq = np.bincount(np.asarray(toks), minlength=5) / 4000
    root = np.sqrt([0.5, 0.2, 0.15, 0.1, 0.05])
    assert freq[3] == 0.0 and freq[4] == 0.0
    np.testing.assert_allclose(freq[:3], root[:3] / root[:3].sum(), atol=0.03)
    want = np.log(root / root.sum())[np.asarray(toks)]
    np.testing.assert_allclose(lps, want, atol=1e-5)


def _softmax(x):
    e = np.exp(x - np.max(x))
    return e / e.sum()


def _hf_kept(logits, temperature, top_k, top_p, min_p):
    """Hugging Face's sampling warpers, in `GenerationMixin._get_logits_processor`'s order
    (`TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper`,
    `MinPLogitsWarper`, each keeping at least one token), in float64: the tokens left."""
    s = np.asarray(logits, np.float64) / temperature
    if top_k is not None:  # drop scores below the k-th largest
        s = np.where(s < np.sort(s)[-top_k], -np.inf, s)
    if top_p is not None:  # ascending sort; drop while the cumulative mass <= 1 - top_p
        order = np.argsort(s, kind="stable")
        remove = np.cumsum(_softmax(s[order])) <= 1 - top_p
        remove[-1] = False
        s[order[remove]] = -np.inf
    if min_p is not None:  # drop p < min_p · max p
        p = _softmax(s)
        s = np.where(p < min_p * p.max(), -np.inf, s)
    return np.isfinite(s)


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p",
    [
        (1.0, None, None, 0.05),
        (0.7, None, None, 0.2),
        (1.5, None, None, 0.5),
        (1.0, 20, None, 0.1),
        (1.2, None, 0.9, 0.1),
        (0.8, 30, 0.7, 0.02),
        (1.0, None, None, 1.0),
    ],
)
def test_kept_set_equals_hugging_faces_on_random_logits(temperature, top_k, top_p, min_p):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, 100)).astype(np.float32) * 2.0
    ours = jax.vmap(
        lambda x: rx.filter_logits(x / temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    )(jnp.asarray(logits))
    want = np.stack([_hf_kept(row, temperature, top_k, top_p, min_p) for row in logits])
    np.testing.assert_array_equal(np.isfinite(np.asarray(ours)), want)
    assert 1 <= want.sum(-1).min() and want.sum(-1).max() < 100  # the filter cuts


# --- min_p = 0: today's numbers -------------------------------------------------------------


def test_min_p_zero_is_the_same_program_and_the_same_numbers(policy):
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(16,)), jnp.float32)
    trace = lambda **kw: str(  # noqa: E731
        jax.make_jaxpr(lambda k, x: rx.sample_token(k, x, **kw))(jax.random.key(0), logits)
    )
    for kw in (dict(), dict(top_p=0.9), dict(top_k=4, temperature=0.7)):
        assert trace(**kw, min_p=0.0) == trace(**kw) == trace(**kw, min_p=None)
    assert not re.search(r"\bsort\[", trace(min_p=0.1))  # min-p alone needs no sort
    toks, masks, keys = _requests()
    for kw in (dict(temperature=1.3, top_p=0.9), dict(temperature=0.8, top_k=20)):
        want = rx.generate_batch(policy, toks, masks, keys, max_new_tokens=N, **kw)
        got = rx.generate_batch(policy, toks, masks, keys, max_new_tokens=N, min_p=0, **kw)
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_array_equal(got.logprobs, want.logprobs)


def test_min_p_one_samples_the_greedy_tokens(policy):
    """min_p = 1 keeps the best token only (no ties among random logits)."""
    toks, masks, keys = _requests()
    greedy = rx.generate_batch(policy, toks, masks, keys, max_new_tokens=N, temperature=0.0)
    out = rx.generate_batch(policy, toks, masks, keys, max_new_tokens=N, min_p=1.0)
    np.testing.assert_array_equal(out.tokens, greedy.tokens)
    lp = jax.vmap(lambda t, m: rx.token_logprobs(policy, t, m, temperature=1.0))(
        out.tokens, out.mask
    )  # the log-probabilities are at temperature 1, before the filter
    np.testing.assert_allclose(
        np.where(out.completion_mask, lp, 0.0), out.logprobs, atol=1e-5, rtol=0
    )


# --- continuous batching: per-row min_p ------------------------------------------------------

# the tiny random policy is close to uniform (p / max p >= 0.5): min_p cuts above that
ROW_SETTINGS = [
    dict(temperature=0.8, min_p=0.8),
    dict(temperature=0.0, min_p=0.9),
    dict(temperature=1.3, top_p=0.9, min_p=0.75),
    dict(temperature=0.5, top_k=5, min_p=0.6),
    dict(temperature=1.0, min_p=1.0),
    dict(temperature=1.0),
]


@pytest.mark.slow
def test_per_row_min_p_equals_each_rows_own_and_compiles_once(policy):
    toks, masks, keys = (x[jnp.array([0, 1, 2, 3, 4, 0])] for x in _requests())
    kw = dict(slots=2, max_new_tokens=N, eos_id=3)
    rows = {
        "temperature": [s["temperature"] for s in ROW_SETTINGS],
        "top_k": [s.get("top_k", 0) for s in ROW_SETTINGS],
        "top_p": [s.get("top_p", 1.0) for s in ROW_SETTINGS],
        "min_p": [s.get("min_p", 0.0) for s in ROW_SETTINGS],
    }
    out = rx.generate_continuous(policy, toks, masks, keys, **kw, **rows)
    for i, settings in enumerate(ROW_SETTINGS):
        alone = rx.generate_continuous(policy, toks, masks, keys, **kw, **settings)
        np.testing.assert_array_equal(out.tokens[i], alone.tokens[i])
        np.testing.assert_array_equal(out.completion_mask[i], alone.completion_mask[i])
        np.testing.assert_allclose(out.logprobs[i], alone.logprobs[i], atol=1e-5, rtol=0)
    # min_p = 1 samples the greedy tokens (row 4); temperature 1 alone does not (row 5)
    greedy = rx.generate_continuous(policy, toks, masks, keys, **kw, temperature=0.0)
    np.testing.assert_array_equal(out.tokens[4], greedy.tokens[4])
    assert not np.array_equal(out.tokens[5], greedy.tokens[5])
    again = lambda: rx.generate_continuous(  # noqa: E731
        policy, toks, masks, keys, **kw, **(rows | dict(min_p=[0.0, 0.3, 0.99, 0.0, 0.5, 0.7]))
    ).tokens.block_until_ready()
    assert compilations(again) == []
    scalar = lambda: rx.generate_continuous(  # noqa: E731
        policy, toks, masks, keys, **kw, **(rows | dict(min_p=0.4))
    ).tokens.block_until_ready()
    assert compilations(scalar) == []


def test_continuous_decoding_and_the_paged_cache_take_min_p(policy):
    toks, masks, keys = _requests()
    kw = dict(slots=2, max_new_tokens=N, temperature=0.9, min_p=0.8)
    want = rx.generate_continuous(policy, toks, masks, keys, **kw)
    decoding = rx.ContinuousDecoding(policy, toks, masks, keys, **kw)
    while not decoding.done:
        decoding.run(4)
    np.testing.assert_array_equal(decoding.output().tokens, want.tokens)
    paged = rx.generate_continuous(policy, toks, masks, keys, **kw, cache="paged", page_size=4)
    np.testing.assert_array_equal(paged.tokens, want.tokens)


# --- multi-turn rollouts -------------------------------------------------------------------


class _Echo(Environment):
    """Observes `[50, 51]` after every turn; done after two turns."""

    max_observation_tokens: int = eqx.field(static=True, default=2)

    def reset(self, key, prompt, prompt_mask):
        return jnp.zeros((), jnp.int32), jnp.array([50, 51], jnp.int32), jnp.ones(2, bool)

    def step(self, state, completion, completion_mask):
        obs = jnp.array([50, 51], jnp.int32)
        return state + 1, obs, jnp.ones(2, bool), jnp.zeros(()), state >= 1


def test_rollouts_take_min_p(policy):
    toks, masks, _ = _requests()
    kw = dict(max_turns=2, max_new_tokens=3, max_total_tokens=20, eos_id=3)
    key = jax.random.key(3)
    greedy = rollout_multiturn(policy, _Echo(), toks, masks, key, **kw, temperature=0.0)
    jitted = rollout_multiturn(policy, _Echo(), toks, masks, key, **kw, min_p=1.0)
    host = rollout_multiturn_host(policy, _Echo(), toks, masks, key, **kw, min_p=1.0)
    np.testing.assert_array_equal(jitted.tokens, greedy.tokens)
    np.testing.assert_array_equal(host.tokens, jitted.tokens)


# --- argument checks -----------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-0.1, 1.5, True, float("nan")])
def test_bad_min_p_raises(policy, bad):
    with pytest.raises(ValueError, match="min_p"):
        rx.SamplingOptions(max_new_tokens=2, min_p=bad)
    with pytest.raises(ValueError, match="min_p"):
        rx.filter_logits(HAND, min_p=bad)


def test_bad_per_row_min_p_raises(policy):
    toks, masks, keys = _requests()
    kw = dict(slots=2, max_new_tokens=N)
    with pytest.raises(ValueError, match="min_p: each row's"):
        rx.generate_continuous(policy, toks, masks, keys, **kw, min_p=[0.1, 0.2, 1.5, 0.0, 0.0])
    with pytest.raises(ValueError, match="min_p"):
        rx.generate_continuous(policy, toks, masks, keys, **kw, temperature=[1.0] * 5, min_p=2)
    with pytest.raises(ValueError, match="one value per output row"):
        rx.generate_continuous(policy, toks, masks, keys, **kw, min_p=[0.1, 0.2])
    with pytest.raises(ValueError, match="cache='dense'"):
        rx.generate_continuous(policy, toks, masks, keys, **kw, min_p=[0.1] * 5, cache="paged")
