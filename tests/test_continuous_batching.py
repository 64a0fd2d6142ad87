"""Continuous batching: batching invariance (slots, order, alone), equality with the static
sampler, log-probs == full-forward log-probs, stop ids / stop sequences / budgets, one
prefill per prompt group, argument errors."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from helpers import compilations
from hypothesis import given, strategies as st

import rlhf_eqx as rx
from rlhf_eqx.models import AbstractDecoder

CFG = rx.TransformerConfig(vocab_size=53, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48)
N = 8  # max_new_tokens
P = 6
SAMPLING = dict(temperature=0.8, top_k=20)


@pytest.fixture(scope="module")
def policy():
    return rx.Policy(CFG, key=jax.random.key(1))


def _requests():
    """Five left-padded prompts of different lengths (1 to 6 real tokens)."""
    lengths = [4, 6, 1, 3, 5]
    rng = np.random.default_rng(0)
    ids = rng.integers(1, CFG.vocab_size, size=(len(lengths), P))
    masks = np.arange(P)[None, :] >= (P - np.array(lengths))[:, None]
    toks = jnp.asarray(np.where(masks, ids, 0), jnp.int32)
    return toks, jnp.asarray(masks), jax.random.split(jax.random.key(7), len(lengths))


BUDGETS = np.array([3, 8, 1, 6, 5], np.int32)


@eqx.filter_jit
def _logprobs(model, tokens, mask, temperature):
    return jax.vmap(lambda t, m: rx.token_logprobs(model, t, m, temperature=temperature))(
        tokens, mask
    )


def _assert_same(a: rx.GenerationOutput, b: rx.GenerationOutput):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.mask, b.mask)
    np.testing.assert_array_equal(a.completion_mask, b.completion_mask)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def _stop_after(completion: np.ndarray, stops: list[list[int]], ids: tuple[int, ...]) -> int:
    """Reference: tokens kept in a completion stopped by ids / token sequences."""
    for t in range(len(completion)):
        if completion[t] in ids:
            return t + 1
        for seq in stops:
            n = len(seq)
            if t + 1 >= n and list(completion[t + 1 - n : t + 1]) == list(seq):
                return t + 1
    return len(completion)


def test_greedy_equals_static_sampler_and_full_forward_logprobs(policy):
    toks, masks, keys = _requests()
    out = rx.generate_continuous(
        policy, toks, masks, keys, slots=2, max_new_tokens=N, temperature=0.0
    )
    ref = rx.generate_batch(policy, toks, masks, keys[0], max_new_tokens=N, temperature=0.0)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.mask, ref.mask)
    np.testing.assert_array_equal(out.completion_mask, ref.completion_mask)
    assert bool(jnp.all(out.completion_mask[:, P:]))
    full = _logprobs(policy, out.tokens, out.mask, 1.0)
    np.testing.assert_allclose(
        np.where(out.completion_mask, out.logprobs, 0.0),
        np.where(out.completion_mask, full, 0.0),
        atol=1e-5,
        rtol=0,
    )
    assert bool(jnp.all(out.logprobs[:, :P] == 0.0))


def test_sampled_logprobs_equal_full_forward_logprobs(policy):
    toks, masks, keys = _requests()
    out = rx.generate_continuous(
        policy, toks, masks, keys, slots=3, max_new_tokens=N, budgets=BUDGETS, **SAMPLING
    )
    full = _logprobs(policy, out.tokens, out.mask, SAMPLING["temperature"])
    cm = np.asarray(out.completion_mask)
    np.testing.assert_array_equal(cm[:, P:].sum(axis=1), BUDGETS)
    np.testing.assert_allclose(np.where(cm, out.logprobs, 0.0), np.where(cm, full, 0.0), atol=1e-5)
    assert bool(jnp.all(jnp.where(cm, 0.0, out.logprobs) == 0.0))
    np.testing.assert_array_equal(np.where(cm, 0, out.tokens)[:, P:], 0)  # pad_id after the end


SETTINGS = pytest.mark.parametrize(
    "settings", [dict(temperature=0.0), SAMPLING], ids=["greedy", "sample"]
)
PERM = np.array([3, 0, 4, 2, 1])


def _run(policy, rows, slots, settings, prefill_rows=None):
    """Requests `rows` of `_requests()` (budgets `BUDGETS`, stop id 5)."""
    toks, masks, keys = _requests()
    return rx.generate_continuous(
        policy, toks[rows], masks[rows], keys[rows], slots=slots, max_new_tokens=N,
        budgets=BUDGETS[rows], eos_id=5, prefill_rows=prefill_rows, **settings,
    )  # fmt: skip


def _rows(out, rows):
    return jax.tree.map(lambda x: x[rows], out)


@SETTINGS
def test_slots_do_not_change_outputs(policy, settings):
    every = np.arange(5)
    one = _run(policy, every, 1, settings)  # a refill after every request
    three = _run(policy, every, 3, settings)  # refills while other rows decode
    _assert_same(one, three)
    lengths = np.asarray(one.completion_mask[:, P:]).sum(axis=1)
    assert len(set(lengths.tolist())) > 2  # rows really end at different steps


@SETTINGS
def test_request_order_does_not_change_outputs(policy, settings):
    ordered = _run(policy, np.arange(5), 3, settings)
    permuted = _run(policy, PERM, 3, settings)
    _assert_same(permuted, _rows(ordered, PERM))


def test_a_request_alone_equals_its_row_among_others(policy):
    together = _run(policy, np.arange(5), 5, SAMPLING)  # every request in its own slot
    for r in range(5):
        _assert_same(_run(policy, np.array([r]), 1, SAMPLING), _rows(together, np.array([r])))


@pytest.mark.slow
@SETTINGS
def test_outputs_do_not_depend_on_slots_order_or_company(policy, settings):
    base = _run(policy, np.arange(5), 1, settings, prefill_rows=1)
    for slots in (2, 3, 4, 5):
        for prefill_rows in (1, 2, 5):
            _assert_same(base, _run(policy, np.arange(5), slots, settings, prefill_rows))
            permuted = _run(policy, PERM, slots, settings, prefill_rows)
            _assert_same(permuted, _rows(base, PERM))
    for r in range(5):
        _assert_same(_run(policy, np.array([r]), 1, settings), _rows(base, np.array([r])))


class _CountingPolicy(AbstractDecoder):
    """A decoder that delegates to a policy and counts the prefills it runs."""

    inner: rx.Policy
    counter: list = eqx.field(static=True)

    @property
    def vocab_size(self):
        return self.inner.vocab_size

    def __call__(self, tokens, mask, *, key=None):
        return self.inner(tokens, mask, key=key)

    def init_cache(self, cache_size):
        return self.inner.init_cache(cache_size)

    def prefill(self, tokens, mask, *, cache_size):
        jax.debug.callback(lambda t: self.counter.append(tuple(np.asarray(t).tolist())), tokens)
        return self.inner.prefill(tokens, mask, cache_size=cache_size)

    def decode_step(self, token, cache, *, index, position):
        return self.inner.decode_step(token, cache, index=index, position=position)


@pytest.mark.parametrize("prefill_rows", [1, 2])
def test_groups_share_one_prefill_and_equal_repeated_prompts(policy, prefill_rows):
    toks, masks, keys = _requests()
    toks, masks, keys = toks[:3], masks[:3], keys[:3]
    G = 3
    budgets = np.array([2, 7, 4, 8, 1, 3, 5, 6, 2], np.int32)
    counter: list = []
    counting = _CountingPolicy(policy, counter)
    grouped = rx.generate_continuous(
        counting, toks, masks, keys, slots=2, max_new_tokens=N, budgets=budgets,
        num_samples=G, prefill_rows=prefill_rows, **SAMPLING,
    )  # fmt: skip
    # each prompt is prefilled once for its G samples (a last batch of `prefill_rows`
    # prompts is filled up by repeating the last prompt)
    prompts = [tuple(np.asarray(t).tolist()) for t in toks]
    filler = -(-len(prompts) // prefill_rows) * prefill_rows - len(prompts)
    assert sorted(counter) == sorted(prompts + [prompts[-1]] * filler)
    row_keys = jax.vmap(jax.random.fold_in)(jnp.repeat(keys, G), jnp.tile(jnp.arange(G), 3))
    rep = lambda x: jnp.repeat(x, G, axis=0)
    repeated = rx.generate_continuous(
        policy, rep(toks), rep(masks), row_keys, slots=4, max_new_tokens=N, budgets=budgets,
        **SAMPLING,
    )  # fmt: skip
    _assert_same(grouped, repeated)
    # the samples of one prompt differ (they have their own keys)
    comp = np.asarray(grouped.tokens[:, P:])
    assert len({tuple(comp[r, :2]) for r in range(3)}) > 1


def test_stop_ids_and_stop_sequences_end_rows_right_after(policy):
    toks, masks, keys = _requests()
    free = rx.generate_continuous(
        policy, toks, masks, keys, slots=2, max_new_tokens=N, temperature=0.0
    )
    comp = np.asarray(free.tokens[:, P:])
    seq = comp[1, 2:4].tolist()  # occurs in row 1's completion, ending at step 3
    cross = [int(toks[0, -1]), int(comp[0, 0])]  # spans prompt and completion: never matched
    ids = (int(comp[3, 1]), int(comp[4, 4]))
    stops = [seq, cross]
    out = rx.generate_continuous(
        policy, toks, masks, keys, slots=2, max_new_tokens=N, temperature=0.0, eos_id=ids,
        stop_sequences=stops, pad_id=0,
    )  # fmt: skip
    got = np.asarray(out.tokens[:, P:])
    cm = np.asarray(out.completion_mask[:, P:])
    kept = [_stop_after(comp[r], [seq], ids) for r in range(comp.shape[0])]
    assert kept[1] <= 4 and kept[3] <= 2 and kept[4] <= 5
    assert min(kept) < N
    for r, k in enumerate(kept):
        np.testing.assert_array_equal(got[r, :k], comp[r, :k])
        np.testing.assert_array_equal(got[r, k:], 0)
        np.testing.assert_array_equal(cm[r], np.arange(N) < k)
    np.testing.assert_array_equal(out.mask[:, :P], masks)


@given(st.lists(st.integers(1, N), min_size=5, max_size=5))
def test_budgets_cut_each_row_of_the_unbounded_output(policy, budgets):
    toks, masks, keys = _requests()
    kw = dict(slots=2, max_new_tokens=N, **SAMPLING)
    full = rx.generate_continuous(policy, toks, masks, keys, **kw)
    out = rx.generate_continuous(policy, toks, masks, keys, budgets=budgets, **kw)
    keep = np.arange(N)[None, :] < np.array(budgets)[:, None]
    np.testing.assert_array_equal(out.completion_mask[:, P:], keep)
    np.testing.assert_array_equal(out.tokens[:, P:], np.where(keep, full.tokens[:, P:], 0))
    np.testing.assert_allclose(
        out.logprobs[:, P:], np.where(keep, full.logprobs[:, P:], 0.0), atol=1e-5
    )


def test_more_slots_than_rows_and_raw_keys(policy):
    toks, masks, keys = _requests()
    raw = jax.random.key_data(keys)
    kw = dict(max_new_tokens=N, prefill_rows=2, **SAMPLING)
    a = rx.generate_continuous(policy, toks, masks, raw, slots=64, **kw)
    b = rx.generate_continuous(policy, toks, masks, keys, slots=5, **kw)
    _assert_same(a, b)


@pytest.mark.parametrize("num_samples", [1, 2])
def test_static_sampler_with_one_key_per_prompt_equals_the_continuous_one(policy, num_samples):
    """`generate_batch` given one key per prompt (typed or raw) samples each row as
    `generate_continuous` does with those keys, so a row does not depend on its batch:
    prompts 3 and 1 alone give the rows they give among all five."""
    toks, masks, keys = _requests()
    kw = dict(max_new_tokens=N, eos_id=[5, 20], num_samples=num_samples, **SAMPLING)
    static = rx.generate_batch(policy, toks, masks, keys, **kw)
    _assert_same(static, rx.generate_continuous(policy, toks, masks, keys, slots=3, **kw))
    lengths = np.asarray(static.completion_mask[:, P:]).sum(axis=1)
    assert len(set(lengths.tolist())) > 1  # rows stop at different steps
    some = np.array([3, 1])
    alone = rx.generate_batch(
        policy, toks[some], masks[some], jax.random.key_data(keys[some]), **kw
    )
    rows = (some[:, None] * num_samples + np.arange(num_samples)).reshape(-1)
    _assert_same(alone, _rows(static, rows))
    with pytest.raises(jaxtyping.TypeCheckError):  # not one key per prompt
        rx.generate_batch(policy, toks, masks, keys[:4], **kw)


@pytest.fixture
def no_shape_checks():
    """The library as users get it: jaxtyping's checks switched off, so that the
    function's own checks answer."""
    before = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", before)


def test_static_sampler_refuses_keys_of_another_count(policy, no_shape_checks):
    toks, masks, keys = _requests()
    with pytest.raises(ValueError, match=r"key must be one PRNG key or one per prompt \(5\)"):
        rx.generate_batch(policy, toks, masks, keys[:4], max_new_tokens=N)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(slots=0), "slots must be a positive int, got 0"),
        (dict(slots=1.5), "slots must be a positive int"),
        (
            dict(keys=jax.random.split(jax.random.key(0), 4)),
            r"keys must hold .* \(5,\), got \(4,\)",
        ),
        (dict(keys=jax.random.key(0)), r"keys must hold .* got \(\)"),
        (dict(keys=jnp.zeros((5, 3), jnp.uint32)), r"keys must be 5 PRNG keys"),
        (
            dict(prompts=jnp.full((5, P), 3, jnp.int32).at[2, 4].set(CFG.vocab_size)),
            r"prompts: row 2 has id 53 at position 4, outside the vocabulary \[0, 53\)",
        ),
        (dict(prompts=jnp.full((5, P), -1, jnp.int32)), "prompts: row 0 has id -1"),
        (dict(prompt_masks=jnp.ones((5, P), bool).at[3].set(False)), "prompt_masks: row 3"),
        (dict(budgets=[1, 2, 3]), r"budgets must be 5 ints"),
        (dict(budgets=[0, 1, 1, 1, 1]), r"budgets must lie in \[1, max_new_tokens=8\]"),
        (dict(budgets=[1, 1, 1, 1, N + 1]), r"budgets must lie in .* to 9"),
        (dict(stop_sequences=[[]]), "stop_sequences: each entry must be a non-empty"),
        (dict(stop_sequences=[[1, CFG.vocab_size]]), r"stop_sequences: \[1, 53\] has ids"),
        (dict(stop_sequences="ab"), "stop_sequences must be a sequence of token-id sequences"),
        (dict(max_new_tokens=0), "max_new_tokens must be a positive int"),
        (dict(num_samples=0), "num_samples must be a positive int"),
        (dict(temperature=-1.0), "temperature must be a number >= 0"),
    ],
)
def test_bad_arguments_name_the_argument(policy, no_shape_checks, change, match):
    toks, masks, keys = _requests()
    args = dict(prompts=toks, prompt_masks=masks, keys=keys, slots=2, max_new_tokens=N)
    args.update(change)
    with pytest.raises((ValueError, TypeError), match=match):
        rx.generate_continuous(policy, **args)


def test_too_long_for_the_model_is_refused():
    small = rx.Policy(
        rx.TransformerConfig(
            vocab_size=53, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=10
        ),
        key=jax.random.key(0),
    )
    toks, masks, keys = _requests()
    with pytest.raises(ValueError, match="max_seq_len"):
        rx.generate_continuous(small, toks, masks, keys, slots=2, max_new_tokens=N)


def test_under_the_callers_jit_equals_the_direct_call(policy):
    toks, masks, keys = _requests()
    kw = dict(slots=3, max_new_tokens=N, eos_id=5, check_ids=True, **SAMPLING)
    direct = rx.generate_continuous(policy, toks, masks, keys, budgets=BUDGETS, **kw)
    jitted = eqx.filter_jit(
        lambda m, t, k, ks, b: rx.generate_continuous(m, t, k, ks, budgets=b, **kw)
    )(policy, toks, masks, keys, jnp.asarray(BUDGETS))
    _assert_same(jitted, direct)
    with pytest.raises(Exception, match="prompts: ids outside"):
        eqx.filter_jit(lambda m, t: rx.generate_continuous(m, t, masks, keys, **kw))(
            policy, toks.at[1, 5].set(CFG.vocab_size)
        ).tokens.block_until_ready()


ROW_SETTINGS = [
    dict(temperature=0.8, top_k=20),
    dict(temperature=0.0),
    dict(temperature=1.3, top_p=0.7),
    dict(temperature=0.5, top_k=5, top_p=0.9),
    dict(temperature=1.0),
]


@pytest.mark.slow
def test_per_row_settings_equal_each_rows_own_and_compile_once(policy):
    """Temperature, top-k and top-p given per row are traced: each row samples as with
    its settings given alone, and other values compile nothing new."""
    toks, masks, keys = _requests()
    kw = dict(slots=2, max_new_tokens=N, budgets=BUDGETS, eos_id=3)
    rows = {
        "temperature": [s["temperature"] for s in ROW_SETTINGS],
        "top_k": [s.get("top_k", 0) for s in ROW_SETTINGS],
        "top_p": [s.get("top_p", 1.0) for s in ROW_SETTINGS],
    }
    out = rx.generate_continuous(policy, toks, masks, keys, **kw, **rows)
    for i, settings in enumerate(ROW_SETTINGS):
        alone = rx.generate_continuous(policy, toks, masks, keys, **kw, **settings)
        np.testing.assert_array_equal(out.tokens[i], alone.tokens[i])
        np.testing.assert_array_equal(out.completion_mask[i], alone.completion_mask[i])
        np.testing.assert_allclose(out.logprobs[i], alone.logprobs[i], atol=1e-5, rtol=0)
    other = dict(temperature=[0.3, 1.7, 0.0, 0.9, 1.1], top_k=[0, 7, 2, 0, 1])
    again = lambda: rx.generate_continuous(  # noqa: E731
        policy, toks, masks, keys, **kw, **other, top_p=0.6
    ).tokens.block_until_ready()
    assert compilations(again) == []
    with pytest.raises(ValueError, match="top_p"):
        rx.generate_continuous(policy, toks, masks, keys, **kw, temperature=[1.0] * 5, top_p=0.0)
    with pytest.raises(ValueError, match="one value per output row"):
        rx.generate_continuous(policy, toks, masks, keys, **kw, temperature=[1.0, 0.5])
    with pytest.raises(ValueError, match="cache='dense'"):
        rx.generate_continuous(
            policy, toks, masks, keys, **kw, temperature=[1.0] * 5, cache="paged"
        )
