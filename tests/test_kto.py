"""KTO: the loss against a float64 transcription of the paper / TRL formula, its invariants,
the step (exact micro-batches, jit == eager, pmap == one device, learning), the unpaired
readers and the batches with their mismatched rows."""

import dataclasses
import json
from types import SimpleNamespace

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_tree_allclose
from hypothesis import given, settings, strategies as st
from jaxtyping import TypeCheckError
from scipy.special import expit
from test_train_common import CumMeanLM, counted, leaves_equal, sgd_delta, traces

import rlhf_eqx as rx
import rlhf_eqx.testing as rt
from rlhf_eqx import data
from rlhf_eqx.distributed import replicate, shard_batch_for_pmap, unreplicate
from rlhf_eqx.losses import KTO_LOSS_TYPES, kto_loss, kto_reference_point
from rlhf_eqx.train import (
    KTOBatch,
    KTOSettings,
    StepOptions,
    compute_kto_reference_logps,
    init_train_state,
    make_kto_step,
    make_optimizer,
    sequence_logps,
)

# --- the reference: TRL's KTOTrainer.kto_loss, transcribed in float64 -------------------


def numpy_kto(logp, ref, label, kl_logp, ref_kl_logp, *, beta, wd=1.0, wu=1.0, loss_type="kto"):
    """`(loss, rewards/chosen, rewards/rejected, kl)` of one batch, in float64."""
    f = lambda x: np.asarray(x, np.float64)
    logp, ref, kl_logp, ref_kl_logp = f(logp), f(ref), f(kl_logp), f(ref_kl_logp)
    label = np.asarray(label, bool)
    kl = max(float(np.mean(kl_logp - ref_kl_logp)), 0.0) if loss_type == "kto" else 0.0
    h = logp - ref
    hc, hr = h[label], h[~label]
    if loss_type == "kto":
        chosen = 1.0 - expit(beta * (hc - kl))
        rejected = 1.0 - expit(beta * (kl - hr))
    else:
        chosen = 1.0 - expit(beta * hc)
        rejected = expit(beta * hr)
    losses = np.concatenate([wd * chosen, wu * rejected])
    mean = lambda x: float(np.mean(x)) if x.size else 0.0
    return float(np.mean(losses)), mean(beta * hc), mean(beta * hr), kl


@jax.jit
def _batch_loss(logp, ref, label, kl_logp, ref_kl_logp, beta, wd, wu):
    """Mean KTO loss of a batch, with traced hyperparameters (one compilation)."""
    z0 = kto_reference_point(kl_logp, ref_kl_logp)
    one = lambda a, b, c: kto_loss(
        a, b, c, z0, beta=beta, desirable_weight=wd, undesirable_weight=wu
    )
    return jnp.mean(jax.vmap(one)(logp, ref, label))


@jax.jit
def _batch_apo(logp, ref, label, beta, wd, wu):
    one = lambda a, b, c: kto_loss(
        a,
        b,
        c,
        beta=beta,
        desirable_weight=wd,
        undesirable_weight=wu,
        loss_type="apo_zero_unpaired",
    )
    return jnp.mean(jax.vmap(one)(logp, ref, label))


B = 6
MIXED = np.array([1, 0, 1, 1, 0, 0], bool)
CASES = {
    # name: (logp, ref, kl_logp, ref_kl_logp, label, beta)
    "moderate": (
        [-12.0, -30.5, -8.25, -41.0, -19.0, -3.5],
        [-11.0, -28.0, -9.0, -45.5, -18.5, -4.0],
        [-20.0, -14.0, -33.0, -9.0, -27.0, -16.0],
        [-21.5, -13.0, -35.0, -9.5, -26.0, -17.0],
        MIXED,
        0.1,
    ),
    "near_minus_1e4": (
        [-9999.5, -9000.25, -1e4, -5.0, -9876.5, -7777.0],
        [-9990.0, -9300.0, -9.0, -1e4, -9870.0, -7700.5],
        [-1e4, -9500.0, -9999.0, -8000.0, -9000.0, -1e4],
        [-9998.0, -9490.0, -1e4, -8100.0, -9010.0, -9990.0],
        MIXED,
        1.0,
    ),
    "all_desirable": (
        [-5.0, -7.0, -2.5, -9.0, -4.0, -6.0],
        [-6.0, -6.5, -3.0, -9.5, -3.0, -7.0],
        [-8.0, -3.0, -6.0, -4.5, -7.0, -5.0],
        [-7.0, -4.0, -6.5, -4.0, -8.0, -5.5],
        np.ones(B, bool),
        0.5,
    ),
    "all_undesirable": (
        [-5.0, -7.0, -2.5, -9.0, -4.0, -6.0],
        [-6.0, -6.5, -3.0, -9.5, -3.0, -7.0],
        [-8.0, -3.0, -6.0, -4.5, -7.0, -5.0],
        [-7.0, -4.0, -6.5, -4.0, -8.0, -5.5],
        np.zeros(B, bool),
        0.5,
    ),
    "negative_kl_clamped": (
        [-5.0, -7.0, -2.5, -9.0, -4.0, -6.0],
        [-6.0, -6.5, -3.0, -9.5, -3.0, -7.0],
        [-9.0, -8.0, -9.0, -9.0, -9.0, -9.0],
        [-3.0, -2.0, -3.0, -3.0, -3.0, -3.0],
        MIXED,
        2.0,
    ),
}


def _f32(*xs):
    return tuple(jnp.asarray(np.asarray(x, np.float32)) for x in xs)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.33, 0.7)])
def test_loss_matches_float64_reference(case, weights):
    logp, ref, kl_logp, ref_kl_logp, label, beta = CASES[case]
    wd, wu = weights
    args = _f32(logp, ref, kl_logp, ref_kl_logp)
    hp = _f32(beta, wd, wu)
    got = float(_batch_loss(args[0], args[1], jnp.asarray(label), args[2], args[3], *hp))
    # the reference sees the float32-rounded inputs, in float64
    want, _, _, kl = numpy_kto(
        *(np.asarray(a) for a in args[:2]),
        label,
        *(np.asarray(a) for a in args[2:]),
        beta=beta,
        wd=wd,
        wu=wu,
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    z0 = float(kto_reference_point(args[2], args[3]))
    np.testing.assert_allclose(z0, kl, rtol=1e-5, atol=1e-5)
    apo = float(_batch_apo(args[0], args[1], jnp.asarray(label), *hp))
    want_apo = numpy_kto(
        *(np.asarray(a) for a in args[:2]),
        label,
        *(np.asarray(a) for a in args[2:]),
        beta=beta,
        wd=wd,
        wu=wu,
        loss_type="apo_zero_unpaired",
    )[0]
    np.testing.assert_allclose(apo, want_apo, rtol=1e-5, atol=1e-6)


def test_closed_forms_and_gradient_direction():
    # Policy == reference and z0 = 0: every example's loss is its weight times σ(0) = 1/2.
    assert float(kto_loss(-3.0, -3.0, True)) == pytest.approx(0.5)
    assert float(kto_loss(-3.0, -3.0, False, undesirable_weight=0.4)) == pytest.approx(0.2)
    # Raising a desirable completion's log-prob lowers its loss; the opposite when undesirable.
    grad = jax.grad(lambda lp, label: kto_loss(lp, -3.0, label, 0.5, beta=0.7))
    g_good, g_bad = float(grad(-2.0, True)), float(grad(-2.0, False))
    s = expit(0.7 * (1.0 - 0.5))
    assert g_good == pytest.approx(-0.7 * s * (1 - s), rel=1e-5)
    assert g_bad == pytest.approx(0.7 * s * (1 - s), rel=1e-5)
    # The reference point is held constant: no gradient reaches the mismatched rows.
    kl_logp = jnp.array([-3.0, -5.0, -1.0])
    g = jax.grad(
        lambda k: _batch_loss(
            jnp.zeros(3) - 4.0,
            jnp.zeros(3) - 5.0,
            jnp.array([True, False, True]),
            k,
            kl_logp - 2.0,
            0.3,
            1.0,
            1.0,
        )
    )(kl_logp)
    assert np.all(np.asarray(g) == 0.0)


def test_loss_validation_and_traced_hyperparameters():
    with pytest.raises(ValueError, match="beta must be positive"):
        kto_loss(-1.0, -1.0, True, beta=0.0)
    with pytest.raises(ValueError, match="undesirable_weight must be non-negative"):
        kto_loss(-1.0, -1.0, True, undesirable_weight=-1.0)
    with pytest.raises((ValueError, TypeCheckError), match="hinge"):
        kto_loss(-1.0, -1.0, True, loss_type="hinge")  # pyright: ignore
    assert KTO_LOSS_TYPES == ("kto", "apo_zero_unpaired")
    betas = jnp.array([0.05, 0.5, 2.0])
    swept = jax.vmap(lambda b: kto_loss(-4.0, -6.0, False, 0.3, beta=b))(betas)
    for i, b in enumerate([0.05, 0.5, 2.0]):
        np.testing.assert_allclose(swept[i], kto_loss(-4.0, -6.0, False, 0.3, beta=b), rtol=1e-6)
        np.testing.assert_allclose(swept[i], expit(b * (2.0 - 0.3)), rtol=1e-5)


# --- properties (rlhf_eqx.testing) ------------------------------------------------------


def _token_level_losses(logp, ref, kl_logp, ref_kl_logp, label, mask):
    """Per-example KTO losses `[B]` from per-token log-probabilities (rows' completion
    tokens = `mask`; the mismatched rows reuse the mask)."""
    seq = lambda x: rx.masked_sum(x, mask, axis=-1)
    z0 = kto_reference_point(seq(kl_logp), seq(ref_kl_logp))
    one = lambda a, b, c: kto_loss(a, b, c, z0, beta=0.1, desirable_weight=1.2)
    return jax.vmap(one)(seq(logp), seq(ref), label)


@settings(max_examples=10)
@given(
    rt.logprob_arrays(n=4, batch=4, length=st.integers(1, 5)),
    st.lists(st.booleans(), min_size=4, max_size=4),
)
def test_properties_finite_masking_inert_permutation(arrays, labels):
    *logps, mask = arrays
    label = jnp.asarray(labels)
    rt.check_finite(_token_level_losses, *logps, label, mask)
    rt.check_padding_invariance(_token_level_losses, (*logps, label), mask)
    rt.check_permutation_invariance(_token_level_losses, (*logps, label, mask))


def test_loss_jit_equals_eager():
    logp, ref, kl_logp, ref_kl_logp, label, beta = CASES["moderate"]
    args = (
        *_f32(logp, ref),
        jnp.asarray(label),
        *_f32(kl_logp, ref_kl_logp),
        *_f32(beta, 1.0, 0.5),
    )
    with jax.disable_jit():
        eager = _batch_loss(*args)
    assert_tree_allclose(_batch_loss(*args), eager, rtol=1e-6)


# --- the step -----------------------------------------------------------------------------

LABELS8 = jnp.array([1, 0, 1, 1, 0, 0, 1, 0], bool)
VOCAB = 32


def _rows(key, B, T, prompt=3):
    """Right-padded rows of uneven lengths, one with an empty completion."""
    k1, k2 = jax.random.split(key)
    tokens = jax.random.randint(k1, (B, T), 0, VOCAB)
    lengths = jax.random.randint(k2, (B,), prompt + 1, T + 1).at[1].set(prompt).at[2].set(T)
    pos = jnp.arange(T)[None, :]
    mask = pos < lengths[:, None]
    return tokens, mask, mask & (pos >= prompt)


def kto_batch(key, B=8, T=10, labels=None):
    """Rows and mismatched rows from two draws (the step does not care where the
    mismatched rows come from; `collate_unpaired` builds the real ones)."""
    k1, k2 = jax.random.split(key)
    tokens, mask, cm = _rows(k1, B, T)
    kl_tokens, kl_mask, kl_cm = _rows(k2, B, T)
    return KTOBatch(
        tokens=tokens,
        mask=mask,
        completion_mask=cm,
        label=LABELS8[:B] if labels is None else labels,
        kl_tokens=kl_tokens,
        kl_mask=kl_mask,
        kl_completion_mask=kl_cm,
    )


@eqx.filter_jit
def _seq(model, batch, kl=False):
    if kl:
        return sequence_logps(model, batch.kl_tokens, batch.kl_mask, batch.kl_completion_mask)
    return sequence_logps(model, batch.tokens, batch.mask, batch.completion_mask)


def _direct_loss(model, ref, batch, beta, wd, wu):
    sg = jax.lax.stop_gradient
    z0 = kto_reference_point(_seq(model, batch, True), sg(_seq(ref, batch, True)))
    one = lambda a, b, c: kto_loss(
        a, b, c, z0, beta=beta, desirable_weight=wd, undesirable_weight=wu
    )
    return jnp.mean(jax.vmap(one)(_seq(model, batch), sg(_seq(ref, batch)), batch.label))


def _models(key):
    """A policy and a peakier reference: on the (uniformly drawn) mismatched rows the
    reference point is then positive, so its clamp does not hide it."""
    k1, k2 = jax.random.split(key)
    ref = CumMeanLM(k2)
    return CumMeanLM(k1), eqx.tree_at(lambda m: m.head, ref, 3.0 * ref.head)


# Steps shared by the tests below (built once, each compiled once for the shapes used).
HP = dict(beta=0.5, desirable_weight=1.3, undesirable_weight=0.8, donate=False)
STEP = make_kto_step(optax.sgd(1.0), **HP)
STEP_MICRO = make_kto_step(optax.sgd(1.0), micro_batches=2, **HP)
STEP_CACHED = make_kto_step(optax.sgd(1.0), reference="cached", **HP)


def test_jitted_step_equals_direct_loss_and_trl_metrics(getkey):
    """The step's update and metrics against the loss written directly (differentiated
    with `eqx.filter_value_and_grad`) and the float64 formula."""
    policy, reference = _models(getkey())
    batch = kto_batch(getkey())
    delta, m = sgd_delta(STEP, policy, batch, reference=reference)
    loss, grads = eqx.filter_jit(eqx.filter_value_and_grad(_direct_loss))(
        policy, reference, batch, 0.5, 1.3, 0.8
    )
    np.testing.assert_allclose(float(m["loss"]), float(loss), rtol=1e-6)
    assert_tree_allclose(delta, jax.tree.map(lambda g: -g, grads), atol=1e-6)
    # TRL's metrics, from the float64 formula on the same sequence log-probabilities
    lp, rlp = _seq(policy, batch), _seq(reference, batch)
    klp, rklp = _seq(policy, batch, True), _seq(reference, batch, True)
    want_loss, rc, rr, kl = numpy_kto(lp, rlp, batch.label, klp, rklp, beta=0.5, wd=1.3, wu=0.8)
    label = np.asarray(batch.label)
    want = {
        "loss": want_loss,
        "rewards/chosen": rc,
        "rewards/rejected": rr,
        "kl": kl,
        "rewards/margins": rc - rr,
        "logps/chosen": np.mean(np.asarray(lp)[label]),
        "logps/rejected": np.mean(np.asarray(lp)[~label]),
        "count/chosen": 4.0,
        "count/rejected": 4.0,
    }
    assert kl > 0.1  # the reference point is active in this batch
    for name, value in want.items():
        np.testing.assert_allclose(float(m[name]), value, rtol=1e-5, atol=1e-6, err_msg=name)
    assert {"logits/chosen", "logits/rejected", "grad_norm", "nonfinite"} <= set(m)


def test_micro_batches_equal_full_batch_and_cached_equals_model(getkey):
    policy, ref_model = _models(getkey())
    batch = kto_batch(getkey())
    full, m_full = sgd_delta(STEP, policy, batch, reference=ref_model)
    micro, m_micro = sgd_delta(STEP_MICRO, policy, batch, reference=ref_model)
    cached_batch = compute_kto_reference_logps(ref_model, batch)
    assert cached_batch.ref_logp.shape == (8,) and cached_batch.ref_kl_logp.shape == (8,)
    cached, m_cached = sgd_delta(STEP_CACHED, policy, cached_batch)
    for delta, m in ((micro, m_micro), (cached, m_cached)):
        assert_tree_allclose(delta, full, atol=1e-6)
        assert set(m) == set(m_full)
        for name in m_full:
            np.testing.assert_allclose(
                float(m[name]), float(m_full[name]), rtol=1e-5, atol=1e-6, err_msg=name
            )
    # The micro-batches' own reference points differ from the batch's (TRL computes one per
    # micro-batch under gradient accumulation): the equality above needs the global one.
    halves = [
        kto_reference_point(_seq(policy, b, True), _seq(ref_model, b, True))
        for b in (jax.tree.map(lambda x: x[:4], batch), jax.tree.map(lambda x: x[4:], batch))
    ]
    assert min(abs(float(h) - float(m_full["kl"])) for h in halves) > 1e-2


@pytest.mark.parametrize("desirable", [True, False])
def test_one_sided_batches(getkey, desirable):
    """All-desirable / all-undesirable batches: the absent side's metrics are 0, with a
    count of 0, and micro-batches still equal the full batch."""
    policy, reference = _models(getkey())
    batch = kto_batch(getkey(), labels=jnp.full((8,), desirable))
    full, m = sgd_delta(STEP, policy, batch, reference=reference)
    micro, m_micro = sgd_delta(STEP_MICRO, policy, batch, reference=reference)
    assert_tree_allclose(micro, full, atol=1e-6)
    lp, rlp = _seq(policy, batch), _seq(reference, batch)
    klp, rklp = _seq(policy, batch, True), _seq(reference, batch, True)
    loss, rc, rr, kl = numpy_kto(lp, rlp, batch.label, klp, rklp, beta=0.5, wd=1.3, wu=0.8)
    present, absent = ("chosen", "rejected") if desirable else ("rejected", "chosen")
    for metrics in (m, m_micro):
        np.testing.assert_allclose(float(metrics["loss"]), loss, rtol=1e-5)
        np.testing.assert_allclose(
            float(metrics[f"rewards/{present}"]), rc if desirable else rr, rtol=1e-5, atol=1e-6
        )
        np.testing.assert_allclose(float(metrics["kl"]), kl, rtol=1e-5, atol=1e-6)
        assert float(metrics[f"count/{present}"]) == 8.0
        assert float(metrics[f"count/{absent}"]) == 0.0
        assert float(metrics[f"rewards/{absent}"]) == 0.0


def test_apo_zero_unpaired_needs_no_mismatched_rows(getkey):
    policy, reference = CumMeanLM(getkey()), CumMeanLM(getkey())
    full = kto_batch(getkey())
    batch = KTOBatch(
        tokens=full.tokens, mask=full.mask, completion_mask=full.completion_mask, label=full.label
    )
    step = make_kto_step(optax.sgd(1.0), beta=0.5, loss_type="apo_zero_unpaired", donate=False)
    _, m = sgd_delta(step, policy, batch, reference=reference)
    lp, rlp = _seq(policy, batch), _seq(reference, batch)
    want = numpy_kto(lp, rlp, batch.label, lp, lp, beta=0.5, loss_type="apo_zero_unpaired")[0]
    np.testing.assert_allclose(float(m["loss"]), want, rtol=1e-5)
    assert float(m["kl"]) == 0.0


def test_step_errors(getkey):
    policy = CumMeanLM(getkey())
    full = kto_batch(getkey(), B=4)
    no_kl = KTOBatch(
        tokens=full.tokens, mask=full.mask, completion_mask=full.completion_mask, label=full.label
    )
    opt = optax.sgd(1.0)
    with pytest.raises(ValueError, match="mismatched rows"):
        sgd_delta(make_kto_step(opt), policy, no_kl, reference=policy)
    with pytest.raises(ValueError, match="compute_kto_reference_logps"):
        sgd_delta(make_kto_step(opt, reference="cached"), policy, full)
    with pytest.raises(ValueError, match="reference="):
        sgd_delta(make_kto_step(opt), policy, full)
    with pytest.raises(ValueError, match="beta"):
        make_kto_step(opt, beta=0.0)
    with pytest.raises(ValueError, match="desirable_weight"):
        make_kto_step(opt, desirable_weight=-0.5)
    with pytest.raises((ValueError, TypeError), match="sigmoid"):
        make_kto_step(opt, loss_type="sigmoid")  # pyright: ignore
    with pytest.raises(TypeError, match="KTOBatch"):
        make_kto_step(opt)(
            policy,
            opt.init(policy),
            rx.SequenceBatch(
                tokens=full.tokens, mask=full.mask, completion_mask=full.completion_mask
            ),
            reference=policy,
        )


def test_batch_validation(getkey):
    b = kto_batch(getkey(), B=4)
    # the shape checks of the test run may reject the value first; both name the field
    with pytest.raises((data.DataError, TypeCheckError), match="label"):
        KTOBatch(
            tokens=b.tokens,
            mask=b.mask,
            completion_mask=b.completion_mask,
            label=jnp.array([1, 0, 1, 0]),
        )
    with pytest.raises(data.DataError, match="together"):
        KTOBatch(
            tokens=b.tokens,
            mask=b.mask,
            completion_mask=b.completion_mask,
            label=b.label,
            kl_tokens=b.kl_tokens,
        )
    with pytest.raises((data.DataError, TypeCheckError), match="kl_"):
        KTOBatch(
            tokens=b.tokens,
            mask=b.mask,
            completion_mask=b.completion_mask,
            label=b.label,
            kl_tokens=b.kl_tokens[:3],
            kl_mask=b.kl_mask[:3],
            kl_completion_mask=b.kl_completion_mask[:3],
        )


N_DEV = 8


def test_pmap_equals_one_device_with_a_global_reference_point(getkey):
    if jax.local_device_count() < N_DEV:
        pytest.skip(f"needs {N_DEV} devices")
    devices = jax.local_devices()[:N_DEV]
    policy, ref_model = _models(getkey())
    batch = compute_kto_reference_logps(ref_model, kto_batch(getkey()))  # one row per device
    # Reference log-probs of the mismatched rows chosen so that the devices' own means
    # differ (some negative) while the global mean, 0.3125, is positive.
    offsets = jnp.array([3.0, -1.0, 2.0, -2.0, 4.0, -1.0, 0.5, -3.0])
    batch = eqx.tree_at(lambda b: b.ref_kl_logp, batch, _seq(policy, batch, True) - offsets)
    one, one_m = sgd_delta(STEP_CACHED, policy, batch)
    np.testing.assert_allclose(float(one_m["kl"]), 0.3125, rtol=1e-4)
    opt = optax.sgd(1.0)
    opt_state = opt.init(eqx.filter(policy, eqx.is_inexact_array))
    step_dp = make_kto_step(opt, reference="cached", axis_name="data", **HP)
    dp = jax.pmap(lambda p, s, b: step_dp(p, s, b), axis_name="data", devices=devices)
    dp_params, _, dp_m = dp(
        replicate(policy, devices),
        replicate(opt_state, devices),
        shard_batch_for_pmap(batch, N_DEV),
    )
    params = eqx.filter(policy, eqx.is_inexact_array)
    got = jax.tree.map(
        lambda a, b: a - b, eqx.filter(unreplicate(dp_params), eqx.is_inexact_array), params
    )
    assert_tree_allclose(got, one, atol=1e-5)
    assert not leaves_equal(one, jax.tree.map(jnp.zeros_like, one))
    for name, value in one_m.items():
        np.testing.assert_allclose(
            np.asarray(dp_m[name]), np.full(N_DEV, float(value)), rtol=2e-4, atol=2e-5, err_msg=name
        )


# --- the settings record ------------------------------------------------------------------


def test_record_equals_keywords_and_a_shortcut_replaces_its_field(getkey):
    policy, reference = _models(getkey())
    batch = kto_batch(getkey())
    opt = optax.sgd(1.0)
    record = KTOSettings(beta=0.5, desirable_weight=1.3, undesirable_weight=0.8)
    # the record and the keywords of the shared steps above: the same update, bit for bit
    a = sgd_delta(make_kto_step(opt, record, donate=False), policy, batch, reference=reference)
    b = sgd_delta(STEP, policy, batch, reference=reference)
    assert leaves_equal(a, b)
    # with options, and a shortcut next to the record replacing its field
    cached = compute_kto_reference_logps(reference, batch)
    options = StepOptions(micro_batches=2, donate=False)
    other = dataclasses.replace(record, beta=0.9, reference="cached")
    c = sgd_delta(make_kto_step(opt, other, beta=0.5, options=options), policy, cached)
    d = sgd_delta(make_kto_step(opt, **HP, reference="cached", micro_batches=2), policy, cached)
    assert leaves_equal(c, d)
    assert_tree_allclose(c[0], a[0], atol=1e-6)  # cached, micro-batched: the same update
    moved = sgd_delta(make_kto_step(opt, other, options=options), policy, cached)
    assert float(moved[1]["rewards/chosen"]) != float(c[1]["rewards/chosen"])  # β = 0.9
    # TRL's defaults, in the record only: the `kto` stage reads them
    default, stage = KTOSettings(), rx.pipelines.KTOConfig()
    assert (default.beta, default.desirable_weight, default.loss_type) == (0.1, 1.0, "kto")
    for name in ("beta", "desirable_weight", "undesirable_weight", "loss_type"):
        assert getattr(stage, name) == getattr(default, name), name


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(beta=0.0), "beta=0.0: must be > 0"),
        (dict(beta=float("inf")), "beta=inf: must be a finite number > 0"),
        (dict(desirable_weight=-0.5), "desirable_weight=-0.5: must be >= 0"),
        (dict(undesirable_weight=-1.0), "undesirable_weight=-1.0: must be >= 0"),
        (dict(loss_type="sigmoid"), "loss_type='sigmoid': must be one of kto, apo_zero_unpaired"),
        (dict(reference="none"), "reference='none': must be one of model, cached"),
    ],
)
def test_record_refuses_a_bad_value_in_one_line(fields, message):
    for build in (lambda: KTOSettings(**fields), lambda: make_kto_step(optax.sgd(1.0), **fields)):
        with pytest.raises(ValueError) as info:
            build()
        assert str(info.value) == message
    with pytest.raises(TypeError, match=r"\['bta'\].*beta, desirable_weight.*micro_batches"):
        make_kto_step(optax.sgd(1.0), bta=0.1)


def test_equal_records_share_one_program(getkey):
    """The build cache keys a KTO step by its record's fields and its options (not the
    step's own `donate`): an equal record or the same keywords compile nothing."""
    base, reference = _models(getkey())
    batch = compute_kto_reference_logps(reference, kto_batch(getkey()))
    policy, opt = counted(base), optax.sgd(1.0)
    record = KTOSettings(beta=0.3, reference="cached")
    sgd_delta(make_kto_step(opt, record, donate=False), policy, batch)
    once = traces(policy)
    sgd_delta(make_kto_step(opt, beta=0.3, reference="cached"), policy, batch)
    sgd_delta(make_kto_step(opt, dataclasses.replace(record), options=StepOptions()), policy, batch)
    assert traces(policy) == once
    sgd_delta(make_kto_step(opt, record, beta=0.4), policy, batch)  # another β: a new program
    assert traces(policy) == 2 * once


def test_traced_beta_changes_the_update_without_recompiling(getkey):
    """A step built from `KTOSettings(beta=b)` inside `jax.jit`, `b` traced: one
    compilation for every β, each equal to the step built from the Python float."""
    base, reference = _models(getkey())
    batch = compute_kto_reference_logps(reference, kto_batch(getkey()))
    policy, opt = counted(base), optax.sgd(1.0)

    @eqx.filter_jit
    def run(model, beta):
        step = make_kto_step(opt, KTOSettings(beta=beta, reference="cached"), donate=False)
        return sgd_delta(step, model, batch)

    out = [run(policy, jnp.asarray(0.1, jnp.float32))]
    once = traces(policy)
    out.append(run(policy, jnp.asarray(0.9, jnp.float32)))
    assert traces(policy) == once, "a new β compiled the step again"
    for (delta, m), beta in zip(out, (0.1, 0.9), strict=True):
        want, m_want = sgd_delta(make_kto_step(opt, beta=beta, reference="cached"), policy, batch)
        assert_tree_allclose(delta, want, rtol=1e-5, atol=1e-7)
        for name in ("loss", "rewards/chosen", "rewards/rejected", "kl"):
            np.testing.assert_allclose(m[name], m_want[name], rtol=1e-5, atol=1e-7, err_msg=name)
    assert float(out[0][1]["loss"]) != float(out[1][1]["loss"])
    # implicit rewards are β times the same log-ratios
    np.testing.assert_allclose(
        out[1][1]["rewards/chosen"], 9.0 * out[0][1]["rewards/chosen"], rtol=1e-5
    )


# --- data: readers, unpairing, tokenising, collating ---------------------------------------


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def test_load_unpaired_plain_and_messages(tmp_path):
    path = write_jsonl(
        tmp_path / "kto.jsonl",
        [
            {"prompt": "Q: 1+1?", "completion": " 2", "label": True},
            {"prompt": "Q: 2+2?", "completion": " 5", "label": 0},
            {"prompt": "Q: 3+3?", "completion": "   ", "label": 1},  # blank: skipped
            {"prompt": "Q: 4+4?", "completion": " 8", "label": 1},
        ],
    )
    ds = data.load_unpaired(path)
    assert list(ds) == [
        data.UnpairedRecord("Q: 1+1?", " 2", True),
        data.UnpairedRecord("Q: 2+2?", " 5", False),
        data.UnpairedRecord("Q: 4+4?", " 8", True),
    ]
    assert all(type(r.label) is bool for r in ds)
    assert ds.report.format == "plain" and ds.report.skipped == {"empty completion": 1}
    msgs = write_jsonl(
        tmp_path / "m.jsonl",
        [
            {
                "prompt": [{"role": "user", "content": "Hi"}],
                "completion": [{"role": "assistant", "content": "Hello!"}],
                "label": False,
            }
        ],
    )
    (rec,) = data.load_unpaired(msgs)
    assert rec == data.UnpairedRecord("\n\nHuman: Hi\n\nAssistant:", " Hello!", False)
    assert rec.prompt + rec.completion == data.format_chat(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
        add_generation_prompt=False,
    )


@pytest.mark.parametrize(
    "label,shown",
    [("true", "str 'true'"), (2, "int 2"), (0.5, "float 0.5"), (None, "NoneType None")],
)
def test_load_unpaired_rejects_non_boolean_labels_with_file_and_line(tmp_path, label, shown):
    path = write_jsonl(
        tmp_path / "bad.jsonl",
        [
            {"prompt": "a", "completion": "b", "label": True},
            {"prompt": "c", "completion": "d", "label": False},
            {"prompt": "e", "completion": "f", "label": label},
        ],
    )
    with pytest.raises(
        data.DataError,
        match=rf"bad\.jsonl:3: wrong type: 'label' must be a "
        rf"boolean \(true/false, or 0/1\), got {shown}",
    ):
        data.load_unpaired(path)
    lenient = data.load_unpaired(path, lenient=True)
    assert len(lenient) == 2 and lenient.report.skipped == {"wrong type": 1}


def test_load_unpaired_other_errors_name_file_and_line(tmp_path):
    missing = write_jsonl(
        tmp_path / "missing.jsonl",
        [
            {"prompt": "a", "completion": "b", "label": True},
            {"prompt": "c", "completion": "d"},
        ],
    )
    with pytest.raises(data.DataError, match=r"missing\.jsonl:2: missing key: no 'label'"):
        data.load_unpaired(missing)
    wrong = write_jsonl(tmp_path / "wrong.jsonl", [{"prompt": "a", "completion": 7, "label": True}])
    with pytest.raises(data.DataError, match=r"wrong\.jsonl:1: .*'completion' must be a string"):
        data.load_unpaired(wrong, format="plain")
    bad_json = tmp_path / "broken.jsonl"
    bad_json.write_text('{"prompt": "a", "completion": "b", "label": true}\n{"prompt": \n')
    with pytest.raises(data.DataError, match=r"broken\.jsonl:2: invalid JSON"):
        data.load_unpaired(bad_json)
    unknown = write_jsonl(tmp_path / "unknown.jsonl", [{"prompt": "a", "chosen": "b"}])
    with pytest.raises(data.DataError, match=r"unknown\.jsonl:1: cannot tell the unpaired format"):
        data.load_unpaired(unknown)


def test_unpaired_from_preferences():
    pairs = [data.PreferenceRecord("p1", "c1", "r1"), data.PreferenceRecord("p2", "c2", "r2")]
    out = data.unpaired_from_preferences(pairs)
    U = data.UnpairedRecord
    assert out == [
        U("p1", "c1", True),
        U("p2", "c2", True),
        U("p1", "r1", False),
        U("p2", "r2", False),
    ]
    with pytest.raises(data.DataError, match="chosen"):
        data.unpaired_from_preferences([data.UnpairedRecord("p", "c", True)])


def test_tokenize_and_collate_with_mismatched_rows():
    tok = data.ByteTokenizer()
    records = [
        data.UnpairedRecord("ab", "xyz", True),
        data.UnpairedRecord("c", "uv", False),
        data.UnpairedRecord("def", "w" * 40, True),
    ]
    lengths = data.SequenceLengths(max_length=12, max_prompt_length=5)
    examples, report = data.tokenize_unpaired(records, tok, lengths=lengths)
    assert [e.label for e in examples] == [True, False, True]
    assert report.kept == 3 and report.completion_truncated == 1
    batch = data.collate_unpaired(examples, pad_id=tok.pad_id, lengths=lengths, vocab_size=259)
    assert isinstance(batch, KTOBatch)
    np.testing.assert_array_equal(batch.label, [True, False, True])
    ids = lambda s: [b + 3 for b in s.encode()]
    rows = [np.asarray(batch.tokens[i])[np.asarray(batch.mask[i])].tolist() for i in range(3)]
    comps = [
        np.asarray(batch.tokens[i])[np.asarray(batch.completion_mask[i])].tolist() for i in range(3)
    ]
    assert rows[0] == [1] + ids("ab") + ids("xyz") + [2]
    assert comps[1] == ids("uv") + [2]
    assert comps[2] == ids("w" * 8)  # cut to fit 12 tokens: its EOS is lost
    # mismatched row i: prompt i, completion of example i - 1 (cyclically), as TRL's KL dataset
    kl_rows = [
        np.asarray(batch.kl_tokens[i])[np.asarray(batch.kl_mask[i])].tolist() for i in range(3)
    ]
    kl_comps = [
        np.asarray(batch.kl_tokens[i])[np.asarray(batch.kl_completion_mask[i])].tolist()
        for i in range(3)
    ]
    assert kl_rows[0] == [1] + ids("ab") + comps[2][: 12 - 3]
    assert kl_rows[1] == [1] + ids("c") + comps[0]
    assert kl_rows[2] == [1] + ids("def") + comps[1]
    assert kl_comps[1] == comps[0]
    assert batch.kl_tokens.shape == batch.tokens.shape == (3, 12)
    plain = data.collate_unpaired(examples[:1], pad_id=0, lengths=lengths, kl=False)
    assert plain.kl_tokens is None and plain.tokens.shape == (1, 12)
    with pytest.raises(data.DataError, match="at least two examples"):
        data.collate_unpaired(examples[:1], pad_id=0, lengths=lengths)
    with pytest.raises(data.DataError, match="empty batch"):
        data.collate_unpaired([], pad_id=0, lengths=lengths)
    with pytest.raises(data.DataError, match="boolean .label"):
        data.tokenize_unpaired([SimpleNamespace(prompt="a", completion="b", label="yes")], tok)


def test_tiny_model_learns_from_collated_text(getkey):
    tok = data.ByteTokenizer()
    records = [
        data.UnpairedRecord("Q:", " yes", True),
        data.UnpairedRecord("Q:", " no", False),
        data.UnpairedRecord("A:", " ok", True),
        data.UnpairedRecord("A:", " bad", False),
    ]
    lengths = data.SequenceLengths(max_length=10, max_prompt_length=4)
    examples, _ = data.tokenize_unpaired(records, tok, lengths=lengths)
    batch = data.collate_unpaired(examples, pad_id=tok.pad_id, lengths=lengths, vocab_size=259)
    policy = CumMeanLM(getkey(), vocab=tok.vocab_size)
    opt = make_optimizer(learning_rate=1e-2, total_steps=20, schedule="constant")
    state = init_train_state(policy, opt)
    step = make_kto_step(
        opt, beta=1.0, desirable_weight=1.0, undesirable_weight=0.6, check_token_ids=259
    )
    state, first = state.apply(step, batch, reference=policy)
    # policy == reference: every loss is its weight times σ(0), and the reference point is 0
    np.testing.assert_allclose(float(first["loss"]), 0.5 * (2 * 1.0 + 2 * 0.6) / 4, rtol=1e-6)
    np.testing.assert_allclose(float(first["kl"]), 0.0, atol=1e-6)
    for _ in range(12):
        state, metrics = state.apply(step, batch, reference=policy)
    assert float(metrics["loss"]) < float(first["loss"]) - 0.1
    assert float(metrics["rewards/margins"]) > 0.0
    assert float(metrics["nonfinite"]) == 0.0


def test_reference_point_keeps_float64_and_widens_bfloat16():
    """The mean was taken in float32 for every input, narrowing float64 ones."""
    a = np.array([-3.0, -1.0 - 1e-9, -2.0])
    b = np.array([-3.0, -1.0, -2.0])
    with jax.enable_x64(True):
        z0 = kto_reference_point(jnp.asarray(b), jnp.asarray(a))
        assert z0.dtype == jnp.float64
        assert float(z0) == pytest.approx(1e-9 / 3, rel=1e-6)
    half = jnp.asarray(a, jnp.bfloat16)
    assert kto_reference_point(half, half).dtype == jnp.float32
