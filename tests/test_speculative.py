"""Speculative decoding: greedy tokens equal `generate_batch`'s for any draft, sampled
tokens follow the target's distribution exactly (a chi-square test against the exact
joint probabilities), log-probs are the target's, stop ids and budgets per row, bad
arguments, one compile; and the multi-token cached decode it verifies with."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chi2

import rlhf_eqx as rx
from rlhf_eqx.assets import asset_path

# --- decode_chunk: several tokens against the cache in one pass ------------------------

SMALL = rx.TransformerConfig(
    vocab_size=37, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=64
)
WINDOWED = rx.TransformerConfig(
    vocab_size=37,
    d_model=32,
    n_layers=3,
    n_heads=4,
    n_kv_heads=2,
    d_ff=48,
    max_seq_len=64,
    sliding_window=3,
    window_layers=(True, False, True),
)


@pytest.mark.parametrize("cfg", [SMALL, WINDOWED], ids=["global", "sliding-window"])
def test_decode_chunk_equals_decode_steps_and_the_full_forward(cfg):
    policy = rx.Policy(cfg, key=jax.random.key(0))
    prompt = jnp.array([0, 0, 5, 6, 7, 8], jnp.int32)
    pmask = jnp.array([0, 0, 1, 1, 1, 1], bool)
    chunk = jnp.array([9, 10, 11, 12, 13], jnp.int32)
    P, C, real = 6, 5, 4
    _, cache = policy.prefill(prompt, pmask, cache_size=P + C + 3)
    logits, chunk_cache = policy.decode_chunk(chunk, cache, index=P, position=real)
    assert logits.shape == (C, cfg.vocab_size)

    steps, step_cache = [], cache
    for c in range(C):
        lg, step_cache = policy.decode_step(
            chunk[c], step_cache, index=P + c, position=jnp.int32(real + c)
        )
        steps.append(lg)
    np.testing.assert_allclose(logits, jnp.stack(steps), rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(chunk_cache), jax.tree.leaves(step_cache)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    full = policy(jnp.concatenate([prompt, chunk]), jnp.concatenate([pmask, jnp.ones(C, bool)]))
    np.testing.assert_allclose(logits, full[P:], rtol=1e-5, atol=1e-5)


def test_decode_chunk_drops_the_slots_after_it():
    """A chunk fed where rejected proposals were cached gives what it gives on a clean
    cache: their slots are dropped, so the next step cannot see them either."""
    policy = rx.Policy(SMALL, key=jax.random.key(1))
    prompt, pmask = jnp.array([3, 4, 5], jnp.int32), jnp.ones(3, bool)
    _, cache = policy.prefill(prompt, pmask, cache_size=12)
    _, dirty = policy.decode_chunk(
        jnp.array([20, 21, 22, 23, 24], jnp.int32), cache, index=3, position=3
    )
    chunk = jnp.array([9, 10], jnp.int32)
    clean_logits, clean = policy.decode_chunk(chunk, cache, index=3, position=3)
    logits, redone = policy.decode_chunk(chunk, dirty, index=3, position=3)
    np.testing.assert_allclose(logits, clean_logits, rtol=1e-6, atol=1e-6)
    assert bool(jnp.all(redone.mask == clean.mask))
    assert redone.mask.tolist() == [True] * 5 + [False] * 7
    # the next decode step agrees too (a decode step attends to every kept slot)
    a, _ = policy.decode_step(jnp.int32(11), redone, index=5, position=jnp.int32(5))
    b, _ = policy.decode_step(jnp.int32(11), clean, index=5, position=jnp.int32(5))
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_truncated_draft_is_the_first_layers():
    policy = rx.Policy(WINDOWED, key=jax.random.key(2))
    draft = rx.models.truncated_draft(policy, 2)
    assert draft.cfg.n_layers == 2 and draft.cfg.window_layers == (True, False)
    assert draft.transformer.layers.wqkv.shape[0] == 2
    assert draft.transformer.embed is policy.transformer.embed
    # the same model built directly from those layers
    direct = rx.Policy(draft.cfg, key=jax.random.key(9))
    direct = eqx.tree_at(
        lambda p: (p.transformer.embed, p.transformer.layers, p.transformer.final_norm, p.lm_head),
        direct,
        (
            policy.transformer.embed,
            jax.tree.map(lambda a: a[:2], policy.transformer.layers),
            policy.transformer.final_norm,
            policy.lm_head,
        ),
    )
    tokens, mask = jnp.array([1, 2, 3, 4], jnp.int32), jnp.ones(4, bool)
    np.testing.assert_allclose(draft(tokens, mask), direct(tokens, mask), rtol=1e-6, atol=1e-6)
    for bad in (0, 4):
        with pytest.raises(ValueError, match="n_layers"):
            rx.models.truncated_draft(policy, bad)


# --- greedy: exactly generate_batch's tokens --------------------------------------------

_TRACES = {"prefill": 0}


class PlainDecoder(rx.models.AbstractDecoder):
    """A decoder with `prefill` / `decode_step` only (no `decode_chunk`): verified token
    by token, its cache rolled back by picking the one after the last accepted token.
    Counts its prefill traces."""

    model: rx.Policy

    def __call__(self, tokens, mask, *, key=None):
        return self.model(tokens, mask)

    @property
    def vocab_size(self):
        return self.model.vocab_size

    def init_cache(self, cache_size):
        return self.model.init_cache(cache_size)

    def prefill(self, tokens, mask, *, cache_size):
        _TRACES["prefill"] += 1
        return self.model.prefill(tokens, mask, cache_size=cache_size)

    def decode_step(self, token, cache, *, index, position):
        return self.model.decode_step(token, cache, index=index, position=position)


@pytest.fixture(scope="module")
def stories():
    policy, tok = rx.load_llama2c(asset_path("stories260K.bin"), asset_path("tok512.bin"))
    prompts = jnp.array(
        [[0, 0, tok.bos_id, 403], [tok.bos_id, 403, 280, 300], [0, 0, 0, tok.bos_id]], jnp.int32
    )
    return policy, prompts, prompts != 0


def _drafts(policy):
    return {
        "random": rx.Policy(policy.cfg, key=jax.random.key(5)),
        "1-layer": rx.models.truncated_draft(policy, 1),
        "3-layer": rx.models.truncated_draft(policy, 3),
        "itself": policy,
    }


@pytest.mark.parametrize("name", ["random", "1-layer", "3-layer", "itself"])
def test_greedy_tokens_equal_generate_batch(stories, name):
    policy, prompts, masks = stories
    draft = _drafts(policy)[name]
    key = jax.random.key(0)
    ref = rx.generate_batch(policy, prompts, masks, key, max_new_tokens=23, temperature=0.0)
    out, stats = rx.generate_speculative(
        policy, draft, prompts, masks, key, max_new_tokens=23, temperature=0.0, k=4, with_stats=True
    )
    assert out.tokens.shape == ref.tokens.shape == (3, 27)
    assert out.tokens.tolist() == ref.tokens.tolist()
    assert out.mask.tolist() == ref.mask.tolist()
    assert out.completion_mask.tolist() == ref.completion_mask.tolist()
    np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5)
    passes = np.asarray(stats.target_passes)
    assert np.all(np.asarray(stats.proposed) == 4 * passes)
    if name == "itself":
        # every proposal is accepted: 22 tokens after the first in passes of 5
        assert float(stats.acceptance_rate) == 1.0
        assert passes.tolist() == [5, 5, 5]
    if name == "random":
        assert float(stats.acceptance_rate) < 0.5


def test_right_padded_prompts_and_the_target_as_its_own_draft(stories):
    """Right-, left- and un-padded prompts: the target drafting for itself has every
    proposal accepted, greedy or sampled (p = q), and greedy tokens are unchanged."""
    policy, _, _ = stories
    prompts = jnp.array([[1, 403, 280, 0, 0], [0, 0, 1, 403, 280], [1, 403, 280, 300, 9]])
    masks = jnp.array([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], bool)
    key = jax.random.key(3)
    ref = rx.generate_batch(policy, prompts, masks, key, max_new_tokens=11, temperature=0.0)
    for temperature in (0.0, 1.0):
        out, stats = rx.generate_speculative(
            policy,
            policy,
            prompts,
            masks,
            key,
            max_new_tokens=11,
            temperature=temperature,
            k=3,
            with_stats=True,
        )
        assert float(stats.acceptance_rate) == 1.0
        assert stats.target_passes.tolist() == [3, 3, 3]  # 1 + 4 + 4 + (2 of 4)
        if temperature == 0.0:
            assert out.tokens.tolist() == ref.tokens.tolist()
            assert (
                rx.generate_batch(
                    policy, prompts[:1, :3], masks[:1, :3], key, max_new_tokens=11, temperature=0.0
                )
                .tokens[0, 3:]
                .tolist()
                == out.tokens[0, 5:].tolist()
            )


def test_greedy_with_a_decoder_without_decode_chunk(stories):
    """Target and draft verified and rolled back step by step give the same tokens."""
    policy, prompts, masks = stories
    key = jax.random.key(0)
    ref = rx.generate_batch(policy, prompts, masks, key, max_new_tokens=17, temperature=0.0)
    target, draft = PlainDecoder(policy), PlainDecoder(rx.models.truncated_draft(policy, 2))
    out = rx.generate_speculative(
        target, draft, prompts, masks, key, max_new_tokens=17, temperature=0.0, k=3
    )
    assert out.tokens.tolist() == ref.tokens.tolist()
    np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5)


def test_stop_ids_per_row(stories):
    """A row stops at its stop id even inside an accepted run (the target as its own
    draft accepts all k); the rest is padding."""
    policy, prompts, masks = stories
    key = jax.random.key(0)
    plain = rx.generate_batch(policy, prompts, masks, key, max_new_tokens=12, temperature=0.0)
    eos = int(plain.tokens[1, 4 + 2])  # row 1's third new token: mid-way through a pass of 5
    kw = dict(max_new_tokens=12, temperature=0.0, eos_id=eos, pad_id=7)
    ref = rx.generate_batch(policy, prompts, masks, key, **kw)
    out = rx.generate_speculative(policy, policy, prompts, masks, key, k=4, **kw)
    assert out.tokens.tolist() == ref.tokens.tolist()
    assert out.mask.tolist() == ref.mask.tolist()
    assert int(out.completion_mask[1].sum()) <= 3
    assert np.all(np.asarray(out.tokens[1, 4 + 3 :]) == 7)


@pytest.mark.parametrize("n", [1, 2, 7])
def test_budgets_and_num_samples(stories, n):
    """Budgets not a multiple of k + 1 (within the first pass, and over several), with
    several samples per prompt: generate_batch's tokens."""
    policy, prompts, masks = stories
    key = jax.random.key(0)
    kw = dict(max_new_tokens=n, temperature=0.0, num_samples=2)
    ref = rx.generate_batch(policy, prompts, masks, key, **kw)
    out = rx.generate_speculative(
        policy, rx.models.truncated_draft(policy, 2), prompts, masks, key, k=3, **kw
    )
    assert out.tokens.tolist() == ref.tokens.tolist()
    assert out.mask.tolist() == ref.mask.tolist()


@pytest.mark.parametrize(
    "settings", [dict(temperature=0.8, top_k=20), dict(temperature=1.2, top_p=0.9)]
)
def test_sampled_logprobs_are_the_targets(stories, settings):
    policy, prompts, masks = stories
    draft = rx.models.truncated_draft(policy, 1)
    out = rx.generate_speculative(
        policy, draft, prompts, masks, jax.random.key(4), max_new_tokens=20, k=3, **settings
    )
    t = settings["temperature"]
    ref = jax.vmap(lambda x, m: rx.token_logprobs(policy, x, m, temperature=t))(
        out.tokens, out.mask
    )
    assert bool(jnp.all(out.completion_mask[:, 4:]))
    np.testing.assert_allclose(
        np.where(out.completion_mask, out.logprobs, 0.0),
        np.where(out.completion_mask, ref, 0.0),
        atol=1e-5,
    )


def test_top_k_one_is_greedy(stories):
    policy, prompts, masks = stories
    draft = rx.Policy(policy.cfg, key=jax.random.key(5))
    ref = rx.generate_batch(
        policy, prompts, masks, jax.random.key(0), max_new_tokens=15, temperature=0.0
    )
    out = rx.generate_speculative(
        policy,
        draft,
        prompts,
        masks,
        jax.random.key(1),
        max_new_tokens=15,
        temperature=1.3,
        top_k=1,
    )
    assert out.tokens.tolist() == ref.tokens.tolist()


def test_bad_arguments_name_the_argument(stories):
    policy, prompts, masks = stories
    key = jax.random.key(0)
    call = lambda draft, **kw: rx.generate_speculative(
        policy, draft, prompts, masks, key, max_new_tokens=4, **kw
    )
    for k in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=r"^generate_speculative: k must be a positive int"):
            call(policy, k=k)
    other = rx.Policy(
        rx.TransformerConfig(vocab_size=100, d_model=16, n_layers=1, n_heads=2, d_ff=16),
        key=key,
    )
    with pytest.raises(ValueError, match=r"^generate_speculative: draft has vocab_size 100 but"):
        call(other)
    value = rx.ValueModel(policy.cfg, key=key)
    with pytest.raises(TypeError, match=r"^generate_speculative: draft must be a decoder"):
        call(value)
    with pytest.raises(ValueError, match="top_k"):
        call(policy, top_k=0)


def test_compiles_once_for_the_same_shapes(stories):
    policy, prompts, masks = stories
    target = PlainDecoder(policy)
    draft = rx.models.truncated_draft(policy, 1)
    before = _TRACES["prefill"]
    for seed in (0, 1, 2):
        rx.generate_speculative(
            target, draft, prompts, masks, jax.random.key(seed), max_new_tokens=5, k=2
        )
    assert _TRACES["prefill"] == before + 1


# --- sampling: exactly the target's distribution ---------------------------------------

TINY = rx.TransformerConfig(
    vocab_size=8, d_model=16, n_layers=2, n_heads=2, d_ff=32, max_seq_len=16
)


def _peaked(key, scale=10.0):
    """A tiny random policy whose next-token distributions are far from uniform."""
    policy = rx.Policy(TINY, key=key)
    return eqx.tree_at(lambda p: p.lm_head, policy, policy.lm_head * scale)


def _exact_joint(policy, prompt, n, temperature, top_k, top_p, min_p=None):
    """The probability of each of the V**n continuations of `prompt`, under the filtered,
    temperature-scaled distributions `sample_token` draws from."""
    V, P = TINY.vocab_size, prompt.shape[0]
    conts = np.array(np.meshgrid(*[np.arange(V)] * n, indexing="ij")).reshape(n, -1).T
    seqs = jnp.concatenate([jnp.tile(prompt, (len(conts), 1)), jnp.asarray(conts, jnp.int32)], 1)
    logits = jax.vmap(policy)(seqs, jnp.ones_like(seqs, bool))[:, P - 1 : P - 1 + n]
    filt = jax.vmap(
        jax.vmap(lambda x: rx.filter_logits(x / temperature, top_k=top_k, top_p=top_p, min_p=min_p))
    )
    probs = jax.nn.softmax(filt(logits), axis=-1)
    picked = jnp.take_along_axis(probs, jnp.asarray(conts)[..., None], axis=-1)[..., 0]
    return np.asarray(jnp.prod(picked, axis=-1), np.float64)


def _cells(tokens, n):
    """Each row's first `n` tokens as one index into the `V**n` continuations."""
    cells = np.zeros(len(tokens), np.int64)
    for i in range(n):
        cells = cells * TINY.vocab_size + np.asarray(tokens[:, i])
    return cells


def _chi2_pvalue(tokens, expected_probs, n):
    """Pearson's chi-square test of the rows' first `n` tokens against `expected_probs`
    (cells expected fewer than 5 times pooled into one); 0 when a continuation of
    probability 0 occurs."""
    V = TINY.vocab_size
    cells = _cells(tokens, n)
    counts = np.bincount(cells, minlength=V**n).astype(np.float64)
    expected = expected_probs * len(tokens)
    small = expected < 5  # pooled into one cell
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    if np.any(obs[~keep] > 0):  # a continuation of probability 0 was sampled
        return 0.0
    stat = float(np.sum((obs[keep] - exp[keep]) ** 2 / exp[keep]))
    return float(chi2.sf(stat, int(keep.sum()) - 1))


P_VALUE = 1e-3


@pytest.mark.slow
@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=1.0),
        dict(temperature=0.8, top_k=4),
        dict(temperature=1.3, top_p=0.8),
        dict(temperature=1.2, min_p=0.1),
        dict(temperature=1.0, plain=True),
    ],
    ids=["t1", "top-k", "top-p", "min-p", "no-decode-chunk"],
)
def test_sampled_tokens_follow_the_targets_distribution(settings):
    settings = dict(settings)
    plain = settings.pop("plain", False)
    target, draft = _peaked(jax.random.key(11)), _peaked(jax.random.key(12))
    prompt = jnp.array([1, 2, 3], jnp.int32)
    R, n = 20000, 3
    filters = [settings.get(name) for name in ("top_k", "top_p", "min_p")]
    exact = _exact_joint(target, prompt, n, settings["temperature"], *filters)
    assert abs(exact.sum() - 1.0) < 1e-5
    prompts, masks = jnp.tile(prompt, (R, 1)), jnp.ones((R, 3), bool)
    if plain:
        target, draft = PlainDecoder(target), PlainDecoder(draft)
    out, stats = rx.generate_speculative(
        target,
        draft,
        prompts,
        masks,
        jax.random.key(7),
        max_new_tokens=n,
        k=2,
        with_stats=True,
        **settings,
    )
    # the draft is far from the target: rejections (and the residual) happen often
    assert 0.2 < float(stats.acceptance_rate) < 0.8
    assert _chi2_pvalue(out.tokens[:, 3:], exact, n) > P_VALUE
    assert np.all(exact[_cells(out.tokens[:, 3:], n)] > 0)  # never a filtered-out token
    # the test has power: the draft's own samples fail it
    own = rx.generate_batch(draft, prompts, masks, jax.random.key(7), max_new_tokens=n, **settings)
    assert _chi2_pvalue(own.tokens[:, 3:], exact, n) < P_VALUE


def test_a_truncated_draft_of_a_policy_with_per_layer_adapters_keeps_its_layers_ranks(tmp_path):
    """DoRA and per-layer-rank adapters carry their layers' ranks as static fields: the
    draft's adapters count and save its own layers only."""
    policy = rx.Policy(WINDOWED, key=jax.random.key(2))
    dora = rx.apply_lora(policy, rx.LoRAConfig(rank=2, use_dora=True), key=jax.random.key(3))
    draft = rx.models.truncated_draft(dora, 2)
    direct = rx.apply_lora(
        rx.models.truncated_draft(policy, 2),
        rx.LoRAConfig(rank=2, use_dora=True),
        key=jax.random.key(3),
    )
    trainable = lambda m: rx.count_params(eqx.filter(m, rx.lora_filter(m)))  # noqa: E731
    assert trainable(draft) == trainable(direct)
    rx.save_lora_adapter(draft, str(tmp_path / "adapter"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config.get("layers_to_transform") in (None, [0, 1])
