"""The paged, prefix-shared KV cache: paged attention == dense attention, the paged decode
step == the dense one, the paged sampler's rows == the dense continuous sampler's ==
`generate_batch`'s (slots, page sizes, pool sizes, shared prefixes, GRPO groups), pages
all returned, sharing counted, a pool too small refused, one compile per shape."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import rlhf_eqx as rx
from rlhf_eqx.models import PagedKVCache, attention, paged_attention, paged_decode_step

CFG = rx.TransformerConfig(vocab_size=53, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48)
N = 8  # max_new_tokens
P = 6
SAMPLING = dict(temperature=0.8, top_k=20)
BUDGETS = np.array([3, 8, 1, 6, 5], np.int32)


@pytest.fixture(scope="module")
def policy():
    return rx.Policy(CFG, key=jax.random.key(1))


def _requests():
    """Five left-padded prompts of different lengths (1 to 6 real tokens), as in the
    continuous-batching tests."""
    lengths = [4, 6, 1, 3, 5]
    rng = np.random.default_rng(0)
    ids = rng.integers(1, CFG.vocab_size, size=(len(lengths), P))
    masks = np.arange(P)[None, :] >= (P - np.array(lengths))[:, None]
    toks = jnp.asarray(np.where(masks, ids, 0), jnp.int32)
    return toks, jnp.asarray(masks), jax.random.split(jax.random.key(7), len(lengths))


def _assert_same(a: rx.GenerationOutput, b: rx.GenerationOutput):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.mask, b.mask)
    np.testing.assert_array_equal(a.completion_mask, b.completion_mask)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def _assert_returned(stats: rx.PagedCacheStats, *, room: bool = False):
    """Every page came back; with room for every slot's worst case, nothing waited."""
    assert int(stats.pages_in_use) == 0
    assert 0 < int(stats.peak_pages) <= stats.num_pages
    if room:
        assert int(stats.stalls) == 0


# --- attention and the decode step -----------------------------------------------------------


@pytest.mark.parametrize("with_new", [False, True])
def test_paged_attention_equals_dense_attention(getkey, with_new):
    K, H, hd, Np, ps, T = 2, 4, 8, 7, 4, 2
    pool_k = jax.random.normal(getkey(), (K, hd, Np, ps))
    pool_v = jax.random.normal(getkey(), (K, Np, ps, hd))
    # layer 1 of a two-layer pool (layer 0 is noise)
    pool = lambda k, v: PagedKVCache(k=jnp.stack([k + 3.0, k]), v=jnp.stack([v - 3.0, v]))
    q = jax.random.normal(getkey(), (T, H, hd))
    table = jnp.array([5, 2, 6, -1], jnp.int32)  # the last entry unused
    S = table.shape[0] * ps
    # the slots of the pages in table order, laid out densely
    k = jnp.concatenate([pool_k[:, :, p] for p in (5, 2, 6, 0)], axis=-1)  # [K, hd, S]
    v = jnp.concatenate([pool_v[:, p] for p in (5, 2, 6, 0)], axis=-2)  # [K, S, hd]
    lengths = jnp.array([9, 11])  # masked tails: part of page 6 and the unused entry
    allowed = jnp.arange(S)[None, :] < lengths[:, None]
    kw = {}
    dense_k, dense_v = jnp.swapaxes(k, -1, -2), v
    if with_new:  # two tokens being fed at slots 9 and 10, causal among themselves
        kn = jax.random.normal(getkey(), (T, K, hd))
        vn = jax.random.normal(getkey(), (T, K, hd))
        kw = dict(k_new=kn, v_new=vn, new_at=9)
        dense_k = dense_k.at[:, 9:11].set(jnp.swapaxes(kn, 0, 1))
        dense_v = dense_v.at[:, 9:11].set(jnp.swapaxes(vn, 0, 1))
        allowed = jnp.arange(S)[None, :] < jnp.array([10, 11])[:, None]
    got = paged_attention(q, pool(pool_k, pool_v), 1, table, allowed, **kw)
    want = attention(q, dense_k, dense_v, allowed)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    # the masked slots do not matter: change them and nothing moves
    noisy_k = pool_k.at[:, :, 6, 3:].add(100.0).at[:, :, 0].add(100.0)
    noisy_v = pool_v.at[:, 6, 3:].add(100.0).at[:, 0].add(100.0)
    again = paged_attention(q, pool(noisy_k, noisy_v), 1, table, allowed, **kw)
    np.testing.assert_allclose(again, got, atol=1e-6, rtol=0)


def test_paged_attention_rows_with_no_key_are_zero(getkey):
    pool = PagedKVCache(
        k=jax.random.normal(getkey(), (1, 1, 4, 3, 2)),
        v=jax.random.normal(getkey(), (1, 1, 3, 2, 4)),
    )
    q = jax.random.normal(getkey(), (1, 2, 4))
    out = paged_attention(q, pool, 0, jnp.array([1, 0]), jnp.zeros((1, 4), bool))
    np.testing.assert_array_equal(out, 0.0)


def test_paged_decode_step_equals_decode_step(policy):
    """Two left-padded prompts prefilled densely, then their real tokens in pages of 4
    (pages out of order, one sequence's pages interleaved with the other's): the next
    token's logits agree, and the fed tokens' keys and values land in their pages; a
    sequence that does not store leaves the pool as it was."""
    toks, masks, _ = _requests()
    rows, fed = (1, 4), jnp.array([9, 17], jnp.int32)
    tables = jnp.array([[3, 1, -1], [0, 4, -1]], jnp.int32)
    pages = PagedKVCache.empty(policy, num_pages=6, page_size=4)
    want, after = [], []
    for b, r in enumerate(rows):
        t, m = toks[r], masks[r]
        n = int(m.sum())
        _, cache = policy.prefill(t, m, cache_size=P + 4)
        pos = jnp.arange(n)
        real = jnp.nonzero(m)[0]
        k, v = cache.k[..., real], cache.v[..., real, :]
        pages = pages.write(k, v, tables[b, pos // 4], pos % 4)
        logits, c = policy.decode_step(fed[b], cache, index=P, position=jnp.int32(n))
        want.append(logits)
        after.append((c.k[..., P], c.v[..., P, :], n))
    index = jnp.array([after[0][2], after[1][2]], jnp.int32)
    got, pool = paged_decode_step(policy, fed, pages, tables, index=index)
    np.testing.assert_allclose(got, jnp.stack(want), atol=1e-5, rtol=1e-5)
    for b, (k, v, n) in enumerate(after):
        page, off = int(tables[b, n // 4]), n % 4
        np.testing.assert_allclose(pool.k[..., page, off], k, atol=1e-6)
        np.testing.assert_allclose(pool.v[:, :, page, off], v, atol=1e-6)
    _, kept = paged_decode_step(
        policy, fed, pages, tables, index=index, store=jnp.array([True, False])
    )
    page1, off1 = int(tables[1, after[1][2] // 4]), after[1][2] % 4
    np.testing.assert_array_equal(kept.v[:, :, page1, off1], pages.v[:, :, page1, off1])
    np.testing.assert_allclose(kept.v[:, :, 1, 2], after[0][1], atol=1e-6)


def test_paged_decode_step_on_sliding_window_layers_equals_decode_step():
    """A model whose local layers attend to a window of 3 (their own rotary base, as Gemma
    3): the paged step narrows each row's slots to the window as the dense step does."""
    cfg = dataclasses.replace(
        CFG, sliding_window=3, window_layers=(True, False), rope_local_theta=500.0
    )
    policy = rx.Policy(cfg, key=jax.random.key(2))
    toks, masks, _ = _requests()
    t, m = toks[1], masks[1]
    n = int(m.sum())
    _, cache = policy.prefill(t, m, cache_size=P + 1)
    want, _ = policy.decode_step(jnp.int32(9), cache, index=P, position=jnp.int32(n))
    real = jnp.nonzero(m)[0]
    pos = jnp.arange(n)
    pages = PagedKVCache.empty(policy, num_pages=2, page_size=4)
    pages = pages.write(cache.k[..., real], cache.v[..., real, :], pos // 4, pos % 4)
    tables = jnp.array([[0, 1]], jnp.int32)
    got, _ = paged_decode_step(policy, jnp.array([9]), pages, tables, index=jnp.array([n]))
    np.testing.assert_allclose(got[0], want, atol=1e-5, rtol=1e-5)


# --- the sampler -----------------------------------------------------------------------------


def _paged(policy, rows, settings, **pool):
    toks, masks, keys = _requests()
    return rx.generate_paged(
        policy, toks[rows], masks[rows], keys[rows], max_new_tokens=N, budgets=BUDGETS[rows],
        eos_id=5, **settings, **pool,
    )  # fmt: skip


@pytest.mark.parametrize("settings", [dict(temperature=0.0), SAMPLING], ids=["greedy", "sample"])
def test_rows_equal_the_dense_sampler_and_generate_batch(policy, settings):
    toks, masks, keys = _requests()
    every = np.arange(5)
    dense = rx.generate_continuous(
        policy, toks, masks, keys, slots=3, max_new_tokens=N, budgets=BUDGETS, eos_id=5,
        **settings,
    )  # fmt: skip
    # small pages, a pool that makes rows wait for pages
    paged, stats = _paged(policy, every, settings, slots=3, page_size=2, num_pages=9)
    _assert_same(paged, dense)
    _assert_returned(stats)
    assert int(stats.stalls) > 0
    lengths = np.asarray(dense.completion_mask[:, P:]).sum(axis=1)
    assert len(set(lengths.tolist())) > 2  # rows really end at different steps
    if settings["temperature"] == 0.0:
        # each request alone through generate_batch: the same tokens and log-probs up to
        # its end (generate_batch has no budgets: it may go on)
        for r in range(5):
            one = rx.generate_batch(
                policy, toks[r : r + 1], masks[r : r + 1], keys[r], max_new_tokens=N, eos_id=5,
                temperature=0.0,
            )  # fmt: skip
            end = P + int(lengths[r])
            np.testing.assert_array_equal(paged.tokens[r, :end], one.tokens[0, :end])
            np.testing.assert_allclose(paged.logprobs[r, :end], one.logprobs[0, :end], atol=1e-5)


def test_greedy_equals_generate_batch_and_full_forward_logprobs(policy):
    toks, masks, keys = _requests()
    out, stats = rx.generate_paged(
        policy, toks, masks, keys, slots=2, max_new_tokens=N, temperature=0.0, page_size=4
    )
    ref = rx.generate_batch(policy, toks, masks, keys[0], max_new_tokens=N, temperature=0.0)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.completion_mask, ref.completion_mask)
    np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5)
    full = jax.vmap(lambda t, m: rx.token_logprobs(policy, t, m))(out.tokens, out.mask)
    cm = np.asarray(out.completion_mask)
    np.testing.assert_allclose(np.where(cm, out.logprobs, 0.0), np.where(cm, full, 0.0), atol=1e-5)
    _assert_returned(stats, room=True)


def test_cache_paged_through_generate_continuous(policy):
    toks, masks, keys = _requests()
    kw = dict(slots=2, max_new_tokens=N, budgets=BUDGETS, stop_sequences=[[7, 8]], **SAMPLING)
    a = rx.generate_continuous(policy, toks, masks, keys, cache="paged", page_size=3, **kw)
    b, _ = rx.generate_paged(policy, toks, masks, keys, page_size=3, **kw)
    c = rx.generate_continuous(policy, toks, masks, keys, **kw)
    _assert_same(a, b)
    _assert_same(a, c)


def _grpo_requests(G: int):
    """Three prompts sharing an 8-token system prompt (left-padded, different lengths),
    prompt 2 a repeat of prompt 0."""
    rng = np.random.default_rng(3)
    system = rng.integers(1, CFG.vocab_size, size=8)
    tails = [rng.integers(1, CFG.vocab_size, size=n) for n in (3, 1)]
    Pl = 12
    rows = [np.concatenate([system, tails[0]]), np.concatenate([system, tails[1]])]
    rows.append(rows[0])
    toks = np.zeros((3, Pl), np.int32)
    masks = np.zeros((3, Pl), bool)
    for r, ids in enumerate(rows):
        toks[r, Pl - len(ids) :] = ids
        masks[r, Pl - len(ids) :] = True
    keys = jax.random.split(jax.random.key(11), 3)
    budgets = np.random.default_rng(4).integers(1, N + 1, size=3 * G).astype(np.int32)
    return jnp.asarray(toks), jnp.asarray(masks), keys, budgets


def test_shared_prefixes_and_groups_equal_the_dense_sampler(policy):
    G = 3
    toks, masks, keys, budgets = _grpo_requests(G)
    kw = dict(max_new_tokens=N, budgets=budgets, num_samples=G, **SAMPLING)
    dense = rx.generate_continuous(policy, toks, masks, keys, slots=4, **kw)
    paged, stats = rx.generate_paged(policy, toks, masks, keys, slots=4, page_size=4, **kw)
    _assert_same(paged, dense)
    _assert_returned(stats, room=True)
    # every row maps the 2 full system-prompt pages (the rest of a prompt is a partial
    # page, private): once held, they are mapped, not written again
    assert int(stats.pages_shared) > 0


def test_a_groups_prompt_pages_are_held_once(policy):
    """One 8-token prompt, 4 samples of 5 tokens each, pages of 4: each row stores 12
    tokens (3 pages); the 2 prompt pages are shared, so 2 + 4 pages at the peak
    instead of 12, and 3 rows x 2 pages were mapped instead of written."""
    _, _, keys = _requests()
    prompt = jnp.arange(1, 9, dtype=jnp.int32)[None]
    mask = jnp.ones_like(prompt, bool)
    budgets = np.full(4, 5, np.int32)
    kw = dict(max_new_tokens=5, budgets=budgets, num_samples=4, **SAMPLING)
    out, stats = rx.generate_paged(policy, prompt, mask, keys[:1], slots=4, page_size=4, **kw)
    assert int(stats.peak_pages) == 6
    assert int(stats.pages_shared) == 6
    assert int(stats.pages_in_use) == 0 and int(stats.stalls) == 0
    assert stats.dense_bytes == 4 * (8 + 5) * stats.page_bytes // 4
    assert int(stats.peak_bytes) == 6 * stats.page_bytes
    _assert_same(out, rx.generate_continuous(policy, prompt, mask, keys[:1], slots=4, **kw))


def test_a_pool_too_small_for_one_request_is_refused(policy):
    toks, masks, keys = _requests()
    # row 1: 6 real tokens + 8 new - 1 = 13 tokens = 7 pages of 2
    with pytest.raises(ValueError, match=r"num_pages=6 is too small: request row 1 may hold 7"):
        rx.generate_paged(
            policy, toks, masks, keys, slots=2, max_new_tokens=N, page_size=2, num_pages=6
        )


def test_the_smallest_pool_still_finishes_every_row(policy):
    """A pool of exactly the largest request's worst case: rows wait for pages, none
    deadlocks, the rows are the dense sampler's."""
    toks, masks, keys = _requests()
    kw = dict(max_new_tokens=N, budgets=BUDGETS, eos_id=5, **SAMPLING)
    dense = rx.generate_continuous(policy, toks, masks, keys, slots=3, **kw)
    paged, stats = rx.generate_paged(
        policy, toks, masks, keys, slots=3, page_size=2, num_pages=7, **kw
    )
    _assert_same(paged, dense)
    _assert_returned(stats)
    assert int(stats.stalls) > 0


@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(
    slots=st.integers(1, 5),
    page_size=st.integers(1, 4),
    extra=st.integers(0, 6),
    budgets=st.lists(st.integers(1, N), min_size=5, max_size=5),
)
def test_any_pool_finishes_with_the_dense_rows(policy, slots, page_size, extra, budgets):
    """Pools from the smallest allowed up: every row finishes, equal to the dense rows."""
    toks, masks, keys = _requests()
    kw = dict(max_new_tokens=N, budgets=np.array(budgets, np.int32), eos_id=5, **SAMPLING)
    n = np.asarray(masks).sum(axis=1)
    worst = int(np.max(-(-(n + np.array(budgets) - 1) // page_size)))
    dense = rx.generate_continuous(policy, toks, masks, keys, slots=slots, **kw)
    paged, stats = rx.generate_paged(
        policy, toks, masks, keys, slots=slots, page_size=page_size,
        num_pages=worst + extra, **kw,
    )  # fmt: skip
    _assert_same(paged, dense)
    _assert_returned(stats)


def test_one_compile_per_shape(policy):
    """Other prompts, budgets and sharing (same shapes): no new compilation."""
    toks, masks, keys = _requests()
    kw = dict(slots=2, max_new_tokens=N, page_size=4, num_pages=12, **SAMPLING)
    rx.generate_paged(policy, toks, masks, keys, budgets=BUDGETS, **kw)[
        0
    ].tokens.block_until_ready()
    traces = []

    def listen(event, duration, fun_name="", **_):
        if event == "/jax/core/compile/jaxpr_trace_duration" and "generate_paged" in fun_name:
            traces.append(fun_name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        same = jnp.broadcast_to(toks[1], toks.shape)  # every prompt shares its pages
        out, stats = rx.generate_paged(
            policy, same, jnp.ones_like(masks), keys, budgets=BUDGETS[::-1].copy(), **kw
        )
        out.tokens.block_until_ready()
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert traces == []
    assert int(stats.pages_shared) > 0


@pytest.mark.slow
@pytest.mark.parametrize("settings", [dict(temperature=0.0), SAMPLING], ids=["greedy", "sample"])
def test_outputs_do_not_depend_on_slots_pages_or_pool(policy, settings):
    every = np.arange(5)
    perm = np.array([3, 0, 4, 2, 1])
    toks, masks, keys = _requests()
    base = rx.generate_continuous(
        policy, toks, masks, keys, slots=1, max_new_tokens=N, budgets=BUDGETS, eos_id=5,
        **settings,
    )  # fmt: skip
    for slots, page_size, num_pages in [(1, 1, 13), (2, 4, None), (5, 3, 6), (4, 16, 4)]:
        pool = dict(slots=slots, page_size=page_size, num_pages=num_pages)
        out, stats = _paged(policy, every, settings, **pool)
        _assert_same(out, base)
        _assert_returned(stats)
        permuted, _ = _paged(policy, perm, settings, **pool)
        _assert_same(permuted, jax.tree.map(lambda x: x[perm], base))


@pytest.mark.slow
def test_shared_prefixes_at_every_page_size(policy):
    G = 4
    toks, masks, keys, budgets = _grpo_requests(G)
    kw = dict(max_new_tokens=N, budgets=budgets, num_samples=G, eos_id=5, **SAMPLING)
    dense = rx.generate_continuous(policy, toks, masks, keys, slots=5, **kw)
    for page_size in (1, 2, 5, 8):
        for slots in (1, 3, 12):  # one slot: pages freed and the prefix written again
            out, stats = rx.generate_paged(
                policy, toks, masks, keys, slots=slots, page_size=page_size, **kw
            )
            _assert_same(out, dense)
            _assert_returned(stats)
            assert int(stats.pages_shared) > 0 or slots == 1


class _NotAPolicy(rx.models.AbstractDecoder):
    vocab: int = 5

    @property
    def vocab_size(self):
        return self.vocab

    def __call__(self, tokens, mask, *, key=None):
        return jnp.zeros(tokens.shape + (self.vocab,))

    def init_cache(self, cache_size):
        return jnp.zeros((), jnp.int32)

    def prefill(self, tokens, mask, *, cache_size):
        return jnp.zeros((self.vocab,)), jnp.zeros((), jnp.int32)

    def decode_step(self, token, cache, *, index, position):
        return jnp.zeros((self.vocab,)), cache


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(page_size=0), "page_size must be a positive int, got 0"),
        (dict(num_pages=0), "num_pages must be a positive int or None, got 0"),
        (dict(cache="pages"), "cache must be 'dense' or 'paged', got 'pages'"),
        (dict(cache="dense", num_pages=4), "page_size and num_pages apply to cache='paged'"),
        (dict(slots=0), "slots must be a positive int, got 0"),
    ],
)
def test_bad_arguments_name_the_argument(policy, change, match):
    toks, masks, keys = _requests()
    args = dict(slots=2, max_new_tokens=N, cache="paged")
    args.update(change)
    with pytest.raises((ValueError, TypeError), match=match):
        rx.generate_continuous(policy, toks, masks, keys, **args)


def test_paged_needs_a_policy_and_concrete_prompts(policy):
    toks, masks, keys = _requests()
    with pytest.raises(TypeError, match="needs a rlhf_eqx.Policy"):
        rx.generate_paged(_NotAPolicy(), toks, masks, keys, slots=2, max_new_tokens=N)
    with pytest.raises(ValueError, match="prompts and prompt_masks must be concrete"):
        jax.jit(lambda t: rx.generate_paged(policy, t, masks, keys, slots=2, max_new_tokens=N)[0])(
            toks
        )
