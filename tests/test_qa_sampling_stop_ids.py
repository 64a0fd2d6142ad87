"""A stop id the model can never sample (outside its vocabulary: another tokenizer's
EOS) is refused by every sampler, naming `eos_id`, as an out-of-vocabulary stop
sequence is, instead of decoding every row to `max_new_tokens` without a word."""

import jax
import jax.numpy as jnp
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
