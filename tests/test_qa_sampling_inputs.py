"""Sampling settings as users give them: NumPy scalars (a config's or a tokenizer's
values, HF's `generation_config` read through NumPy) sample exactly as the Python numbers
they hold; a stop id the model can never sample (outside its vocabulary: another
tokenizer's EOS) is refused by every sampler, naming `eos_id`, as an out-of-vocabulary
stop sequence is, instead of decoding every row to `max_new_tokens` without a word."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlhf_eqx as rx


@pytest.fixture(scope="module")
def policy():
    cfg = rx.TransformerConfig(
        vocab_size=37, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=16
    )
    return rx.Policy(cfg, key=jax.random.key(0))


PROMPTS = jnp.array([[0, 5, 7], [3, 4, 9]], jnp.int32)
MASKS = jnp.array([[False, True, True], [True, True, True]])

CASES = [
    (dict(max_new_tokens=np.int64(4)), dict(max_new_tokens=4)),
    (
        dict(max_new_tokens=4, temperature=np.float64(0.7), top_k=np.int64(5)),
        dict(max_new_tokens=4, temperature=0.7, top_k=5),
    ),
    (
        dict(max_new_tokens=4, temperature=np.float32(0.0), eos_id=np.array([3, 4])),
        dict(max_new_tokens=4, temperature=0.0, eos_id=[3, 4]),
    ),
    (
        dict(max_new_tokens=3, top_p=np.float32(0.5), min_p=np.float64(0.1), pad_id=np.int32(1)),
        dict(max_new_tokens=3, top_p=float(np.float32(0.5)), min_p=0.1, pad_id=1),
    ),
    (
        dict(max_new_tokens=3, num_samples=np.int64(2), repetition_penalty=np.float64(1.3)),
        dict(max_new_tokens=3, num_samples=2, repetition_penalty=1.3),
    ),
]


def _same(a, b):
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_array_equal(np.asarray(a.mask), np.asarray(b.mask))
    np.testing.assert_array_equal(np.asarray(a.logprobs), np.asarray(b.logprobs))


@pytest.mark.parametrize("numpy_kw, python_kw", CASES)
def test_generate_batch_takes_numpy_scalars(policy, numpy_kw, python_kw):
    key = jax.random.key(1)
    got = rx.generate_batch(policy, PROMPTS, MASKS, key, **numpy_kw)
    _same(got, rx.generate_batch(policy, PROMPTS, MASKS, key, **python_kw))


def test_sampling_options_hold_python_numbers():
    opts = rx.SamplingOptions(
        max_new_tokens=np.int64(3), temperature=np.float32(0.5), top_k=np.int16(2)
    )
    assert type(opts.max_new_tokens) is int and type(opts.top_k) is int
    assert type(opts.temperature) is float
    assert rx.SamplingOptions(max_new_tokens=1, eos_id=np.array([2, 7])).eos_id == (2, 7)
    # a NumPy bool is no count, as a Python bool is none
    with pytest.raises(ValueError, match="max_new_tokens"):
        rx.SamplingOptions(max_new_tokens=np.bool_(True))


def test_generate_speculative_takes_numpy_scalars(policy):
    key = jax.random.key(2)
    spec = lambda n: rx.generate_speculative(  # noqa: E731
        policy, policy, PROMPTS, MASKS, key, k=2, temperature=0.0, max_new_tokens=n
    )
    _same(spec(np.int64(4)), spec(4))


@pytest.mark.parametrize("cache", ["dense", "paged"])
def test_generate_continuous_takes_numpy_scalars(policy, cache):
    keys = jax.random.split(jax.random.key(3), 2)
    numpy_kw = dict(
        slots=np.int64(2), max_new_tokens=np.int32(4), temperature=np.float32(0.5),
        top_k=np.int64(6), top_p=np.float64(0.9), eos_id=np.array([3, 4]), pad_id=np.int64(1),
        num_samples=np.int64(2), prefill_rows=np.int64(1),
    )  # fmt: skip
    python_kw = dict(
        slots=2, max_new_tokens=4, temperature=float(np.float32(0.5)), top_k=6, top_p=0.9,
        eos_id=[3, 4], pad_id=1, num_samples=2, prefill_rows=1,
    )  # fmt: skip
    if cache == "paged":
        numpy_kw |= dict(page_size=np.int64(2), num_pages=np.int64(12))
        python_kw |= dict(page_size=2, num_pages=12)
    run = lambda kw: rx.generate_continuous(policy, PROMPTS, MASKS, keys, cache=cache, **kw)  # noqa: E731
    _same(run(numpy_kw), run(python_kw))
    if cache == "paged":
        _, stats = rx.generate_paged(policy, PROMPTS, MASKS, keys, **numpy_kw)
        assert type(stats.dense_bytes) is int


def test_sample_token_and_filter_logits_take_numpy_scalars():
    logits = jax.random.normal(jax.random.key(4), (23,))
    got = rx.filter_logits(logits, top_k=np.int64(7), top_p=np.float32(0.8), min_p=np.float64(0.1))
    want = rx.filter_logits(logits, top_k=7, top_p=float(np.float32(0.8)), min_p=0.1)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    key = jax.random.key(5)
    seen = dict(context=jnp.zeros(23, bool).at[3].set(True), generated=jnp.zeros(23, jnp.int32))
    got = rx.sample_token(
        key,
        logits,
        temperature=np.float32(0.5),
        top_k=np.int32(5),
        repetition_penalty=np.float64(1.5),
        **seen,
    )
    want = rx.sample_token(key, logits, temperature=0.5, top_k=5, repetition_penalty=1.5, **seen)
    assert int(got[0]) == int(want[0]) and float(got[1]) == float(want[1])


KEYS = jax.random.split(jax.random.key(1), 2)
SAMPLERS = {
    "batch": lambda pol, **kw: rx.generate_batch(pol, PROMPTS, MASKS, KEYS, **kw),
    "one": lambda pol, **kw: rx.generate(pol, PROMPTS[1], MASKS[1], KEYS[0], **kw),
    "continuous": lambda pol, **kw: rx.generate_continuous(
        pol, PROMPTS, MASKS, KEYS, slots=1, **kw
    ),
    "paged": lambda pol, **kw: rx.generate_paged(pol, PROMPTS, MASKS, KEYS, slots=1, **kw),
    "decoding": lambda pol, **kw: rx.ContinuousDecoding(pol, PROMPTS, MASKS, KEYS, slots=1, **kw),
    "speculative": lambda pol, **kw: rx.generate_speculative(
        pol, pol, PROMPTS, MASKS, KEYS[0], k=2, **kw
    ),
}


@pytest.mark.parametrize("name", sorted(SAMPLERS))
@pytest.mark.parametrize("eos_id", [37, [2, 50256]])
def test_stop_id_outside_the_vocabulary_is_refused(policy, name, eos_id):
    with pytest.raises(ValueError, match=r"eos_id \d+ is outside the model's vocabulary \[0, 37\)"):
        SAMPLERS[name](policy, max_new_tokens=3, eos_id=eos_id)


def test_last_id_of_the_vocabulary_still_stops(policy):
    out = rx.generate_batch(policy, PROMPTS, MASKS, KEYS, max_new_tokens=3, eos_id=[36, 2])
    assert out.tokens.shape == (2, 6)
