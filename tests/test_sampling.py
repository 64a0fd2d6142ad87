"""Sampler: cached decoding == full forward, sampled log-probs == recomputed log-probs, EOS,
greedy."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlhf_eqx as rx
from rlhf_eqx import filter_logits

CFG = rx.TransformerConfig(vocab_size=53, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48)


@pytest.fixture(scope="module")
def policy():
    return rx.Policy(CFG, key=jax.random.key(1))


@eqx.filter_jit
def logprobs(model, tokens, mask, temperature):
    return jax.vmap(lambda t, m: rx.token_logprobs(model, t, m, temperature=temperature))(
        tokens, mask
    )


def _prompts():
    toks = jnp.array(
        [[0, 0, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16], [17, 18, 19, 0, 0, 0]], jnp.int32
    )
    masks = jnp.array([[0, 0, 1, 1, 1, 1], [1] * 6, [1, 1, 1, 0, 0, 0]], bool)
    return toks, masks


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=10),
        dict(temperature=1.3, top_p=0.9),
        dict(temperature=0.0),
    ],
)
def test_sampled_logprobs_equal_full_forward_logprobs(policy, settings):
    toks, masks = _prompts()
    out = rx.generate_batch(policy, toks, masks, jax.random.key(3), max_new_tokens=7, **settings)
    assert out.tokens.shape == (3, 13)
    temp = settings["temperature"] or 1.0
    recomputed = logprobs(policy, out.tokens, out.mask, temp)
    diff = jnp.where(out.completion_mask, recomputed - out.logprobs, 0.0)
    assert float(jnp.max(jnp.abs(diff))) < 1e-4
    assert bool(jnp.all(out.logprobs[:, :6] == 0.0))
    assert bool(jnp.all(out.completion_mask[:, 6:]))  # no EOS given: everything is generated


def test_cached_decoding_reproduces_full_forward_logits(policy):
    prompt = jnp.array([0, 0, 5, 6, 7], jnp.int32)
    pmask = jnp.array([0, 0, 1, 1, 1], bool)
    cont = jnp.array([21, 22, 23, 24], jnp.int32)
    full_t = jnp.concatenate([prompt, cont])
    full_m = jnp.concatenate([pmask, jnp.ones((4,), bool)])
    full = eqx.filter_jit(lambda m, t, k: m(t, k))(policy, full_t, full_m)

    @eqx.filter_jit
    def cached(model):
        logits, cache = model.prefill(prompt, pmask, cache_size=9)
        outs = [logits]
        pos = jnp.sum(pmask, dtype=jnp.int32)
        for i in range(3):
            logits, cache = model.decode_step(cont[i], cache, index=5 + i, position=pos + i)
            outs.append(logits)
        return jnp.stack(outs)

    np.testing.assert_allclose(cached(policy), full[4:8], atol=1e-4, rtol=1e-4)


def test_greedy_is_deterministic_and_top_k_one_is_greedy(policy):
    toks, masks = _prompts()
    a = rx.generate_batch(policy, toks, masks, jax.random.key(0), max_new_tokens=6, temperature=0.0)
    b = rx.generate_batch(policy, toks, masks, jax.random.key(9), max_new_tokens=6, temperature=0.0)
    c = rx.generate_batch(policy, toks, masks, jax.random.key(5), max_new_tokens=6, top_k=1)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.tokens, c.tokens)
    # greedy tokens are the argmax of the full-forward logits
    logits = eqx.filter_jit(lambda m, t, k: jax.vmap(m)(t, k))(policy, a.tokens, a.mask)
    prev, _ = jax.vmap(rx.previous_real_index)(a.mask)
    pred = jnp.take_along_axis(jnp.argmax(logits, -1), prev, axis=1)
    np.testing.assert_array_equal(pred[:, 6:], a.tokens[:, 6:])


def test_eos_stops_each_row_and_masks_the_rest(policy):
    toks, masks = _prompts()
    greedy = rx.generate_batch(
        policy, toks, masks, jax.random.key(0), max_new_tokens=6, temperature=0.0
    )
    eos = int(greedy.tokens[0, 8])  # the third token row 0 generates
    out = rx.generate_batch(
        policy,
        toks,
        masks,
        jax.random.key(0),
        max_new_tokens=6,
        temperature=0.0,
        eos_id=eos,
        pad_id=0,
    )
    for row in range(3):
        comp = np.asarray(greedy.tokens[row, 6:])
        hits = np.nonzero(comp == eos)[0]
        stop = hits[0] + 1 if hits.size else 6
        np.testing.assert_array_equal(out.tokens[row, 6 : 6 + stop], comp[:stop])
        assert bool(jnp.all(out.completion_mask[row, 6 : 6 + stop]))
        assert not bool(jnp.any(out.completion_mask[row, 6 + stop :]))
        assert bool(jnp.all(out.tokens[row, 6 + stop :] == 0))
        assert bool(jnp.all(out.logprobs[row, 6 + stop :] == 0.0))
    np.testing.assert_array_equal(out.mask[:, :6], masks)


def test_vmapped_generate_equals_generate_batch(policy):
    toks, masks = _prompts()
    batch = rx.generate_batch(
        policy, toks, masks, jax.random.key(0), max_new_tokens=5, temperature=0.0
    )
    vm = jax.vmap(
        lambda t, m: rx.generate(policy, t, m, jax.random.key(0), max_new_tokens=5, temperature=0.0)
    )(toks, masks)
    np.testing.assert_array_equal(vm.tokens, batch.tokens)
    np.testing.assert_allclose(vm.logprobs, batch.logprobs, atol=1e-5)
    one = rx.generate(
        policy, toks[2], masks[2], jax.random.key(0), max_new_tokens=5, temperature=0.0
    )
    np.testing.assert_array_equal(one.tokens, batch.tokens[2])


def test_filter_logits_top_k_and_top_p():
    logits = jnp.log(jnp.array([0.5, 0.2, 0.15, 0.1, 0.05], jnp.float32))
    k2 = filter_logits(logits, top_k=2)
    assert np.isfinite(np.asarray(k2)).tolist() == [True, True, False, False, False]
    p = filter_logits(logits, top_p=0.6)  # 0.5 < 0.6, 0.5 + 0.2 >= 0.6: keep two
    assert np.isfinite(np.asarray(p)).tolist() == [True, True, False, False, False]
    p = filter_logits(logits, top_p=0.3)  # the best token alone
    assert np.isfinite(np.asarray(p)).tolist() == [True, False, False, False, False]
    both = filter_logits(logits, top_k=3, top_p=0.99)
    assert np.isfinite(np.asarray(both)).tolist() == [True, True, True, False, False]
    assert filter_logits(logits) is logits


def test_sampling_frequencies_follow_the_distribution():
    logits = jnp.log(jnp.array([0.6, 0.3, 0.1], jnp.float32))
    keys = jax.random.split(jax.random.key(0), 4000)
    toks, lps = jax.vmap(lambda k: rx.sample_token(k, logits))(keys)
    freq = np.bincount(np.asarray(toks), minlength=3) / 4000
    np.testing.assert_allclose(freq, [0.6, 0.3, 0.1], atol=0.03)
    np.testing.assert_allclose(lps, np.log(np.array([0.6, 0.3, 0.1]))[np.asarray(toks)], atol=1e-5)


def test_bad_arguments_raise(policy):
    toks, masks = _prompts()
    with pytest.raises(ValueError, match="max_new_tokens"):
        rx.generate_batch(policy, toks, masks, jax.random.key(0), max_new_tokens=0)
    with pytest.raises(TypeError, match="AbstractDecoder"):
        rx.generate_batch(lambda t, m: t, toks, masks, jax.random.key(0), max_new_tokens=2)


def test_filtered_tokens_are_never_sampled():
    logits = jnp.log(jnp.array([0.05, 0.6, 0.05, 0.3], jnp.float32))
    keys = jax.random.split(jax.random.key(1), 3000)
    toks, _ = jax.vmap(lambda k: rx.sample_token(k, logits, top_k=2))(keys)
    freq = np.bincount(np.asarray(toks), minlength=4) / 3000
    assert freq[0] == 0.0 and freq[2] == 0.0
    np.testing.assert_allclose(freq[[1, 3]], [2 / 3, 1 / 3], atol=0.03)


# --- x64, argument checks, stop ids, stop strings, the decoder protocol -----------------


def test_every_public_function_works_under_x64(policy):
    toks, masks = _prompts()
    want = rx.generate_batch(
        policy, toks, masks, jax.random.key(0), max_new_tokens=4, temperature=0.0
    )
    logits = jnp.log(jnp.array([0.1, 0.6, 0.3], jnp.float32))
    with jax.enable_x64(True):
        got = rx.generate_batch(
            policy, toks, masks, jax.random.key(0), max_new_tokens=4, temperature=0.0, eos_id=[5, 6]
        )
        one = rx.generate(
            policy, toks[1], masks[1], jax.random.key(0), max_new_tokens=3, top_k=5, top_p=0.9
        )
        tok, _ = rx.sample_token(jax.random.key(0), logits, top_k=2, top_p=0.9)
        filtered = filter_logits(logits, top_k=2)
    assert got.tokens.dtype == jnp.int32 and one.tokens.shape == (9,)
    assert int(tok) in (1, 2) and bool(jnp.isneginf(filtered[0]))
    ok = ~jnp.isin(want.tokens, jnp.array([5, 6])).any()
    if bool(ok):  # the greedy completions are the same with x64 on and off
        np.testing.assert_array_equal(got.tokens, want.tokens)
    assert not jax.config.jax_enable_x64


@pytest.mark.parametrize(
    "bad, name",
    [
        (dict(top_k=2.5), "top_k"),
        (dict(top_k=0), "top_k"),
        (dict(max_new_tokens=2.0), "max_new_tokens"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(eos_id=[2, -1]), "eos_id"),
        (dict(eos_id=2.0), "eos_id"),
    ],
)
def test_bad_options_name_the_argument(policy, bad, name):
    toks, masks = _prompts()
    kwargs = dict(max_new_tokens=2) | bad
    with pytest.raises(ValueError, match=f"^{name} must"):
        rx.generate_batch(policy, toks, masks, jax.random.key(0), **kwargs)


def test_unknown_option_is_rejected(policy):
    toks, masks = _prompts()
    with pytest.raises(TypeError, match="top_n"):
        rx.generate_batch(policy, toks, masks, jax.random.key(0), max_new_tokens=2, top_n=3)


def test_prompt_ids_outside_the_vocabulary(policy):
    toks, masks = _prompts()
    bad = toks.at[2, 1].set(CFG.vocab_size + 7)
    with pytest.raises(
        ValueError, match=r"prompt row 2 has id 60 at position 1, outside the vocabulary \[0, 53\)"
    ):
        rx.generate_batch(policy, bad, masks, jax.random.key(0), max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt row 0 has id -1"):
        rx.generate(policy, toks[0].at[0].set(-1), masks[0], jax.random.key(0), max_new_tokens=2)

    @eqx.filter_jit
    def run(p, check):
        return rx.generate_batch(
            policy, p, masks, jax.random.key(0), max_new_tokens=2, check_ids=check
        )

    run(bad, False)  # traced prompts are not checked unless asked
    with pytest.raises(Exception, match="outside"):
        jax.block_until_ready(run(bad, True))
    run(toks, True)


def test_several_stop_ids(policy):
    toks, masks = _prompts()
    free = rx.generate_batch(
        policy, toks, masks, jax.random.key(0), max_new_tokens=8, temperature=0.0
    )
    comp = np.asarray(free.tokens[:, 6:])
    stops = [int(comp[0, 1]), int(comp[1, 2])]
    out = rx.generate_batch(
        policy,
        toks,
        masks,
        jax.random.key(0),
        max_new_tokens=8,
        temperature=0.0,
        eos_id=stops,
        pad_id=0,
    )
    for row in range(3):
        hits = np.flatnonzero(np.isin(comp[row], stops))
        n = hits[0] + 1 if len(hits) else 8
        np.testing.assert_array_equal(out.completion_mask[row, 6:], np.arange(8) < n)
        np.testing.assert_array_equal(out.tokens[row, 6 : 6 + n], comp[row, :n])


def test_no_sort_when_filters_are_off():
    logits = jnp.zeros((16,), jnp.float32)
    plain = str(jax.make_jaxpr(lambda k, x: rx.sample_token(k, x))(jax.random.key(0), logits))
    nucleus = str(
        jax.make_jaxpr(lambda k, x: rx.sample_token(k, x, top_p=0.9))(jax.random.key(0), logits)
    )
    assert not re.search(r"\bsort\[", plain) and re.search(r"\bsort\[", nucleus)


class _PieceTokenizer:
    """Decodes ids by concatenating fixed pieces."""

    pieces = ["", "Sure", ".", "\n", "\nHu", "man", ":", " more", "Hi", " there"]

    def decode(self, ids):
        return "".join(self.pieces[i] for i in ids)


def test_stop_strings_cut_a_new_chat_turn():
    # Row 0: "Sure.\n\nHuman: more" -> "Sure." ; row 1: no stop string ; row 2: stops at once.
    prompt = [[8, 9], [8, 9], [0, 8]]
    completion = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 1, 2, 0, 0, 0], [3, 4, 5, 6, 1, 0, 0]]
    real = [[1] * 7, [1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0]]
    tokens = jnp.asarray(np.concatenate([prompt, completion], 1), jnp.int32)
    cm = np.concatenate([np.zeros((3, 2), bool), np.asarray(real, bool)], 1)
    mask = cm | np.asarray([[1, 1, 0, 0, 0, 0, 0, 0, 0]] * 2 + [[0, 1] + [0] * 7], bool)
    out = rx.GenerationOutput(
        tokens=tokens,
        mask=jnp.asarray(mask),
        completion_mask=jnp.asarray(cm),
        logprobs=jnp.where(jnp.asarray(cm), -1.0, 0.0).astype(jnp.float32),
    )
    cut = rx.truncate_at_stop_strings(out, _PieceTokenizer(), ["\n\nHuman:", "<end>"])
    tok = _PieceTokenizer()
    texts = [
        tok.decode(np.asarray(cut.tokens[r])[np.asarray(cut.completion_mask[r])].tolist())
        for r in range(3)
    ]
    assert texts == ["Sure.", "Hi thereSure.", ""]
    np.testing.assert_array_equal(cut.completion_mask[0], [0, 0, 1, 1, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(cut.mask[0], [1, 1, 1, 1, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(cut.tokens[0, 4:], 0)
    np.testing.assert_array_equal(cut.logprobs[0], [0, 0, -1, -1, 0, 0, 0, 0, 0])
    for field in ("tokens", "mask", "completion_mask", "logprobs"):
        np.testing.assert_array_equal(getattr(cut, field)[1], getattr(out, field)[1])
    assert not bool(cut.completion_mask[2].any()) and bool(cut.mask[2, 1])
    with pytest.raises(TypeError, match="sequence of strings"):
        rx.truncate_at_stop_strings(out, tok, "\n\nHuman:")
