"""Prompts as Hugging Face users hold them: every sampler and multi-turn rollout takes
NumPy prompt ids of any integer dtype (`tokenizer(..., return_tensors="np")` gives
int64) and 0 / 1 integer attention masks, and samples exactly what it samples from the
same values as JAX int32 ids and bool masks. A mask value other than 0 and 1 is refused
naming the argument; the shape checks still refuse a prompt of the wrong rank."""

import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from helpers import CountingEnv

import rlhf_eqx as rx
from rlhf_eqx.assets import STORIES260K, TOK512, asset_path


@pytest.fixture(scope="module")
def policy():
    model, _ = rx.load_llama2c(asset_path(STORIES260K), asset_path(TOK512))
    return model


# left-padded, as `rlhf_eqx.data` collates prompts
IDS = [[1, 403, 407, 300], [0, 0, 1, 500]]
MASK = [[1, 1, 1, 1], [0, 0, 1, 1]]
REFERENCE = (jnp.asarray(IDS, jnp.int32), jnp.asarray(MASK, jnp.bool_))
# what users hold: NumPy ids of any integer dtype, bool or 0 / 1 integer masks
VARIANTS = {
    "numpy int32, bool": (np.asarray(IDS, np.int32), np.asarray(MASK, bool)),
    "numpy int64, int64": (np.asarray(IDS, np.int64), np.asarray(MASK, np.int64)),
    "numpy uint16, int8": (np.asarray(IDS, np.uint16), np.asarray(MASK, np.int8)),
    "jax int32, int32": (jnp.asarray(IDS, jnp.int32), jnp.asarray(MASK, jnp.int32)),
}
KEY = jax.random.key(3)
KEYS = jax.random.split(KEY, 2)
SAMPLING = dict(max_new_tokens=4, temperature=1.0)


def _decoding(policy, prompts, masks):
    decoding = rx.ContinuousDecoding(policy, prompts, masks, KEYS, slots=1, **SAMPLING)
    while not decoding.done:
        decoding.run(3)
    return decoding.output()


ROLLOUT = dict(max_turns=2, max_new_tokens=3, max_total_tokens=16, temperature=1.0)
ENTRY_POINTS = {
    "generate": lambda policy, p, m: rx.generate(policy, p[1], m[1], KEY, **SAMPLING),
    "generate_batch": lambda policy, p, m: rx.generate_batch(
        policy, p, m, KEY, num_samples=2, **SAMPLING
    ),
    "generate_continuous": lambda policy, p, m: rx.generate_continuous(
        policy, p, m, KEYS, slots=1, **SAMPLING
    ),
    "generate_paged": lambda policy, p, m: rx.generate_paged(
        policy, p, m, KEYS, slots=2, page_size=2, **SAMPLING
    )[0],
    "ContinuousDecoding": _decoding,
    "generate_speculative": lambda policy, p, m: rx.generate_speculative(
        policy, policy, p, m, KEY, k=2, **SAMPLING
    ),
    "rollout_multiturn": lambda policy, p, m: rx.envs.rollout_multiturn(
        policy, CountingEnv(), p, m, KEY, **ROLLOUT
    ),
    "rollout_multiturn_host": lambda policy, p, m: rx.envs.rollout_multiturn_host(
        policy, CountingEnv(), p, m, KEY, **ROLLOUT
    ),
}


def _assert_identical(got, want):
    got_leaves, got_def = jax.tree.flatten(got)
    want_leaves, want_def = jax.tree.flatten(want)
    assert got_def == want_def
    for g, w in zip(got_leaves, want_leaves):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_numpy_ids_and_integer_masks_sample_as_jax_ids_and_bools(policy, entry):
    run = ENTRY_POINTS[entry]
    want = run(policy, *REFERENCE)
    for name, (prompts, masks) in VARIANTS.items():
        try:
            _assert_identical(run(policy, prompts, masks), want)
        except AssertionError as e:
            raise AssertionError(f"{entry} with {name} prompts and masks: {e}") from None


REFUSALS = {
    "generate": (lambda policy, p, m: rx.generate(policy, p[0], m[0], KEY, **SAMPLING)),
    **{name: ENTRY_POINTS[name] for name in ENTRY_POINTS if name != "generate"},
}


@pytest.mark.parametrize("entry", REFUSALS)
def test_a_mask_value_other_than_0_and_1_is_refused_naming_the_argument(policy, entry):
    masks = np.asarray(MASK, np.int64)
    masks[0, 2] = 2
    name = "prompt_mask" if entry == "generate" else "prompt_masks"
    with pytest.raises(ValueError, match=rf"^{name}:.* holds 2 at position 2"):
        REFUSALS[entry](policy, np.asarray(IDS), masks)


def test_int64_ids_past_the_int32_range_are_refused_not_wrapped(policy):
    ids = np.asarray(IDS, np.int64)
    ids[1, 3] = 2**32 + 5  # would wrap to 5, an id of the vocabulary, as int32
    with pytest.raises(ValueError, match="row 1 has id 4294967301 at position 3"):
        rx.generate_batch(policy, ids, np.asarray(MASK), KEY, **SAMPLING)
    with pytest.raises(ValueError, match="row 1 has id 4294967301 at position 3"):
        rx.generate_continuous(policy, ids, np.asarray(MASK), KEYS, slots=1, **SAMPLING)
    with pytest.raises(ValueError, match="row 1 has id 4294967301 at position 3"):
        rx.envs.rollout_multiturn(policy, CountingEnv(), ids, np.asarray(MASK), KEY, **ROLLOUT)


def test_the_shape_checks_still_refuse_a_prompt_of_the_wrong_rank(policy):
    ids, masks = np.asarray(IDS), np.asarray(MASK)
    with pytest.raises(jaxtyping.TypeCheckError, match="parameter 'prompts'"):
        rx.generate_batch(policy, ids[0], masks, KEY, **SAMPLING)
    with pytest.raises(jaxtyping.TypeCheckError, match="parameter 'prompt_masks'"):
        rx.generate_batch(policy, ids, masks[0], KEY, **SAMPLING)
    with pytest.raises(jaxtyping.TypeCheckError, match="parameter 'prompts'"):
        rx.generate_continuous(policy, ids[0], masks[0], KEYS, slots=1, **SAMPLING)
    with pytest.raises(jaxtyping.TypeCheckError, match="parameter 'prompt_masks'"):
        rx.generate_batch(policy, ids, masks.astype(np.float32), KEY, **SAMPLING)
    with pytest.raises(jaxtyping.TypeCheckError, match="parameter 'prompts'"):
        rx.generate_batch(policy, IDS, MASK, KEY, **SAMPLING)  # nested lists


def test_traced_prompts_and_masks_sample_as_concrete_ones(policy):
    """Under the caller's `jit` the checks stand aside and the results are the same; a
    traced 0 / 1 integer mask is read as `mask != 0`."""
    want = rx.generate_batch(policy, *REFERENCE, KEY, **SAMPLING)
    sample = jax.jit(lambda p, m: rx.generate_batch(policy, p, m, KEY, **SAMPLING))
    _assert_identical(sample(*REFERENCE), want)
    _assert_identical(sample(REFERENCE[0], jnp.asarray(MASK, jnp.int32)), want)


def test_generate_vmapped_over_prompts_takes_integer_masks(policy):
    """`generate` under the caller's `vmap` (traced rows): an integer mask samples as
    the bool one."""
    sample = jax.vmap(lambda p, m: rx.generate(policy, p, m, KEY, **SAMPLING))
    want = sample(*REFERENCE)
    _assert_identical(sample(REFERENCE[0], jnp.asarray(MASK, jnp.int32)), want)
    _assert_identical(sample(REFERENCE[0], jnp.asarray(MASK, jnp.uint8)), want)
