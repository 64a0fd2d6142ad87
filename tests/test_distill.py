"""Knowledge distillation: the generalised JSD against a float64 reference, its closed forms
and symmetries, masking properties, and the GKD / on-policy distillation steps (exact
micro-batching, jit == eager, pmap == one device, learning, vocabulary checks)."""

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_tree_allclose
from hypothesis import given, settings
from jaxtyping import TypeCheckError
from test_train_common import (
    VOCAB,
    CumMeanLM,
    counted,
    leaves_equal,
    sequence_batch,
    sgd_delta,
    tiny_config,
    traces,
)

import rlhf_eqx as rx
import rlhf_eqx.testing as rt
from rlhf_eqx.data import DataError
from rlhf_eqx.distributed import replicate, shard_batch_for_pmap, unreplicate
from rlhf_eqx.losses import aggregate, generalized_jsd, reverse_kl_reward
from rlhf_eqx.ops import previous_real_index
from rlhf_eqx.train import (
    DistillBatch,
    DistillSettings,
    OnPolicyDistillSettings,
    StepOptions,
    distill_loss,
    make_distill_step,
    make_onpolicy_distill_step,
    onpolicy_distill_loss,
)

# ------------------------------------------------------------------ float64 reference


def _log_softmax64(x):
    x = np.asarray(x, np.float64)
    z = x - x.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def _kl64(log_p, log_q):
    p = np.exp(log_p)
    # terms with p = 0 vanish (q may be 0 there too)
    return (p * np.where(p > 0, log_p - log_q, 0.0)).sum(axis=-1)


def reference_jsd(student, teacher, beta, temperature=1.0):
    """GKD's JSD(β) in float64, with the mixture formed in probability space."""
    ls = _log_softmax64(np.asarray(student, np.float64) / temperature)
    lt = _log_softmax64(np.asarray(teacher, np.float64) / temperature)
    if beta == 0.0:
        return _kl64(lt, ls)
    if beta == 1.0:
        return _kl64(ls, lt)
    m = beta * np.exp(lt) + (1.0 - beta) * np.exp(ls)
    with np.errstate(divide="ignore"):
        log_m = np.log(m)
    return beta * _kl64(lt, log_m) + (1.0 - beta) * _kl64(ls, log_m)


def _logit_cases(key, T=6, V=16):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    normal = (3.0 * jax.random.normal(k1, (T, V)), 3.0 * jax.random.normal(k2, (T, V)))
    extreme = (
        jax.random.uniform(k3, (T, V), minval=-1e4, maxval=1e4),
        jax.random.uniform(k4, (T, V), minval=-1e4, maxval=1e4),
    )
    # One-hot-like distributions at ±1e4, disagreeing, agreeing and against a flat one.
    hot = jnp.full((T, V), -1e4).at[jnp.arange(T), jnp.arange(T)].set(1e4)
    other = jnp.full((T, V), -1e4).at[jnp.arange(T), jnp.arange(T) + 1].set(1e4)
    flat = jnp.zeros((T, V)).at[0, 3].set(1e4)
    return [normal, extreme, (hot, other), (hot, flat), (flat, hot), (hot, hot)]


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_generalized_jsd_matches_float64_reference(getkey, beta, temperature):
    mask = jnp.array([True, True, False, True, True, True])
    for i, (s, t) in enumerate(_logit_cases(getkey())):
        got = np.asarray(generalized_jsd(s, t, mask, beta=beta, temperature=temperature))
        want = np.where(np.asarray(mask), reference_jsd(s, t, beta, temperature), 0.0)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"case {i}")
        assert np.all(np.isfinite(got)) and np.all(got >= -1e-5)


def test_endpoints_are_forward_and_reverse_kl_and_the_rescaled_limits(getkey):
    s, t = 2.0 * jax.random.normal(getkey(), (2, 5, 12))
    mask = jnp.ones((5,), bool)
    ls, lt = jax.nn.log_softmax(s), jax.nn.log_softmax(t)
    forward = jnp.sum(jnp.exp(lt) * (lt - ls), axis=-1)  # KL(teacher || student)
    reverse = jnp.sum(jnp.exp(ls) * (ls - lt), axis=-1)  # KL(student || teacher)
    np.testing.assert_allclose(generalized_jsd(s, t, mask, beta=0.0), forward, rtol=1e-5)
    np.testing.assert_allclose(generalized_jsd(s, t, mask, beta=1.0), reverse, rtol=1e-5)
    # JSD_β / β → forward KL as β → 0 and JSD_β / (1 - β) → reverse KL as β → 1 (GKD).
    eps = 1e-3
    np.testing.assert_allclose(generalized_jsd(s, t, mask, beta=eps) / eps, forward, rtol=2e-2)
    np.testing.assert_allclose(generalized_jsd(s, t, mask, beta=1 - eps) / eps, reverse, rtol=2e-2)
    # a case where the two directions differ
    assert float(jnp.max(forward)) > 0.1 and float(jnp.max(jnp.abs(forward - reverse))) > 1e-2


def test_jsd_zero_for_equal_distributions_and_symmetries(getkey):
    s, t = 4.0 * jax.random.normal(getkey(), (2, 7, 10))
    mask = jnp.ones((7,), bool)
    for beta in (0.0, 0.3, 0.5, 1.0):
        np.testing.assert_allclose(generalized_jsd(s, s, mask, beta=beta), 0.0, atol=1e-6)
        # A constant shift of the logits changes neither distribution.
        np.testing.assert_allclose(generalized_jsd(s + 7.0, s, mask, beta=beta), 0.0, atol=1e-5)
    half = generalized_jsd(s, t, mask, beta=0.5)
    np.testing.assert_allclose(half, generalized_jsd(t, s, mask, beta=0.5), rtol=1e-5, atol=1e-7)
    assert np.all(np.asarray(half) > 0.0) and np.all(np.asarray(half) <= math.log(2.0) + 1e-6)
    for beta in (0.0, 0.2, 0.7, 1.0):
        np.testing.assert_allclose(
            generalized_jsd(s, t, mask, beta=beta),
            generalized_jsd(t, s, mask, beta=1.0 - beta),
            rtol=1e-5,
            atol=1e-6,
        )
    # Disjoint supports: JSD_0.5 reaches its bound ln 2.
    a = jnp.full((1, 4), -1e4).at[0, 0].set(1e4)
    b = jnp.full((1, 4), -1e4).at[0, 1].set(1e4)
    np.testing.assert_allclose(
        generalized_jsd(a, b, jnp.ones((1,), bool)), [math.log(2.0)], rtol=1e-6
    )


def test_traced_beta_and_jit_match_eager(getkey):
    s, t = 3.0 * jax.random.normal(getkey(), (2, 4, 9))
    mask = jnp.array([True, False, True, True])
    betas = jnp.array([0.0, 0.25, 0.5, 1.0])
    swept = jax.jit(jax.vmap(lambda b: generalized_jsd(s, t, mask, beta=b, temperature=0.7)))(betas)
    for i, beta in enumerate((0.0, 0.25, 0.5, 1.0)):
        eager = generalized_jsd(s, t, mask, beta=beta, temperature=0.7)
        np.testing.assert_allclose(swept[i], eager, rtol=1e-6, atol=1e-7)
        if beta == 0.25:
            jitted = jax.jit(lambda a, b: generalized_jsd(a, b, mask, beta=0.25, temperature=0.7))
            np.testing.assert_allclose(jitted(s, t), eager, rtol=1e-6, atol=1e-7)
    # Gradients with a traced β at the end points are finite.
    g = jax.grad(lambda b, x: jnp.sum(generalized_jsd(x, t, mask, beta=b)), argnums=1)
    for b in (0.0, 1.0):
        assert np.all(np.isfinite(np.asarray(g(jnp.asarray(b), s))))


def test_jsd_rejects_bad_hyperparameters_and_vocab_mismatch():
    x = jnp.zeros((3, 5))
    m = jnp.ones((3,), bool)
    with pytest.raises(ValueError, match="beta"):
        generalized_jsd(x, x, m, beta=1.5)
    with pytest.raises(ValueError, match="temperature"):
        generalized_jsd(x, x, m, temperature=0.0)
    # the shape checks of the test run name the argument first; without them, a ValueError
    with pytest.raises((ValueError, TypeError), match="teacher_logits"):
        generalized_jsd(x, jnp.zeros((3, 6)), m)


def test_masked_rows_are_inert_even_when_not_finite(getkey):
    s, t = jax.random.normal(getkey(), (2, 5, 8))
    mask = jnp.array([True, False, True, False, True])
    junk_s = s.at[1].set(jnp.nan).at[3].set(jnp.inf)
    junk_t = t.at[1].set(-jnp.inf).at[3].set(1e30)
    for beta in (0.0, 0.5, 1.0):
        f = lambda a, b, beta=beta: jnp.sum(generalized_jsd(a, b, mask, beta=beta))
        np.testing.assert_allclose(f(junk_s, junk_t), f(s, t), rtol=1e-6)
        g = jax.grad(f)(junk_s, junk_t)
        assert np.all(np.isfinite(np.asarray(g))) and np.all(np.asarray(g)[~np.asarray(mask)] == 0)


# ------------------------------------------------------------- hypothesis properties

_V = 6
_W_STUDENT = jnp.linspace(-1.0, 1.0, _V)
_W_TEACHER = jnp.cos(jnp.arange(_V, dtype=jnp.float32))


def _logits(a, b):
    """Per-token scalars `[..., T]` -> student and teacher logits `[..., T, V]` (extreme
    scalars give extreme logits)."""
    lead = (1,) * a.ndim
    ws, wt = _W_STUDENT.reshape(lead + (_V,)), _W_TEACHER.reshape(lead + (_V,))
    return a[..., None] * ws, b[..., None] * wt + 0.5 * a[..., None]


def _per_token_jsd(a, b, mask):
    s, t = _logits(a, b)
    return generalized_jsd(s, t, mask, beta=0.5)


def _batch_jsd(a, b, mask):
    s, t = _logits(a, b)
    per_token = jax.vmap(lambda x, y, m: generalized_jsd(x, y, m, beta=0.3, temperature=2.0))(
        s, t, mask
    )
    return aggregate(per_token, mask, mode="seq-mean-token-mean")


def _batch_forward_kl(a, b, mask):
    s, t = _logits(a, b)
    per_token = jax.vmap(lambda x, y, m: generalized_jsd(x, y, m, beta=0.0))(s, t, mask)
    return aggregate(per_token, mask, mode="token-mean")


def _batch_reverse_kl_reward(a, b, mask):
    return aggregate(jax.vmap(reverse_kl_reward)(a, b, mask), mask, mode="token-mean")


@settings(max_examples=10)
@given(rt.logprob_arrays(n=2, batch=3, length=5))
def test_batch_losses_are_finite_and_padding_invariant(data):
    a, b, mask = data
    for fn in (_batch_jsd, _batch_forward_kl, _batch_reverse_kl_reward):
        rt.check_finite(fn, a, b, mask)
        rt.check_padding_invariance(fn, (a, b), mask)
        rt.check_all_masked_contributes_nothing(fn, (a, b), mask)
        rt.check_permutation_invariance(fn, (a, b, mask))


@settings(max_examples=10)
@given(rt.logprob_arrays(n=2, length=6))
def test_per_token_values_are_zero_where_masked_and_padding_invariant(data):
    a, b, mask = data
    out = rt.check_finite(_per_token_jsd, a, b, mask)
    assert np.all(np.asarray(out)[~np.asarray(mask)] == 0.0)
    rt.check_padding_invariance(_per_token_jsd, (a, b), mask)
    r = np.asarray(reverse_kl_reward(a, b, mask))
    want = np.where(np.asarray(mask), np.asarray(b) - np.asarray(a), 0.0)
    # XLA's CPU backend flushes float32 subnormals to zero: a difference below the
    # smallest normal number may come out as ±0
    np.testing.assert_allclose(r, want, atol=np.finfo(np.float32).tiny)


# ------------------------------------------------------------------------- the steps


def _distill_batch(key, **kw):
    b = sequence_batch(key, **kw)  # uneven rows, one with an empty completion
    return DistillBatch(tokens=b.tokens, mask=b.mask, completion_mask=b.completion_mask)


def _teacher_cm(key):
    """A different-size teacher (wider hidden state) with sharper predictions."""
    t = CumMeanLM(key, dim=24)
    return eqx.tree_at(lambda m: m.head, t, 4.0 * t.head)


def _reference_distill_loss(student, teacher, batch, *, beta, temperature, mode):
    """Full logits, the predicting position of each completion token gathered explicitly."""
    ls = jax.vmap(student)(batch.tokens, batch.mask)
    lt = jax.vmap(teacher)(batch.tokens, batch.mask)
    prev, has_prev = jax.vmap(previous_real_index)(batch.mask)
    gather = jax.vmap(lambda lg, p: lg[p])
    m = batch.completion_mask & batch.mask & has_prev
    per_token = jax.vmap(
        lambda a, b, mm: generalized_jsd(a, b, mm, beta=beta, temperature=temperature)
    )(gather(ls, prev), jax.lax.stop_gradient(gather(lt, prev)), m)
    return aggregate(per_token, m, mode=mode)


_reference_value_and_grad = eqx.filter_jit(eqx.filter_value_and_grad(_reference_distill_loss))


def test_distill_step_equals_reference_micro_batched_and_chunked(getkey):
    student, teacher = CumMeanLM(getkey()), _teacher_cm(getkey())
    batch = _distill_batch(getkey(), B=4, T=10)
    kw = dict(beta=0.3, temperature=1.5, mode="token-mean")
    full, m_full = sgd_delta(
        make_distill_step(optax.sgd(1.0), **kw), student, batch, teacher=teacher
    )
    loss, grads = _reference_value_and_grad(student, teacher, batch, **kw)
    np.testing.assert_allclose(float(m_full["loss"]), float(loss), rtol=1e-5)
    assert_tree_allclose(full, jax.tree.map(lambda g: -g, grads), atol=1e-6)
    assert float(m_full["num_tokens"]) == float(jnp.sum(batch.completion_mask))
    # micro-batches with chunks of 1 position (20 chunks per micro-batch: a scan, empty
    # chunks skipped): the same update
    step = make_distill_step(optax.sgd(1.0), **kw, micro_batches=2, chunk=1)
    delta, metrics = sgd_delta(step, student, batch, teacher=teacher)
    assert_tree_allclose(delta, full, atol=1e-6)
    for name in ("loss", "jsd", "num_tokens", "grad_norm"):
        np.testing.assert_allclose(metrics[name], m_full[name], rtol=1e-5, err_msg=name)


def test_distill_loss_fn_eager_equals_jitted_step_and_cached_teacher_logits(getkey):
    student, teacher = CumMeanLM(getkey()), _teacher_cm(getkey())
    batch = _distill_batch(getkey(), B=4, T=10)
    # eager: the loss function itself, op by op (chunks, conditionals, scatter), running
    # the teacher model
    nums, dens, sums = distill_loss(beta=0.7, chunk=8)(student, (None, teacher), batch, None)
    # jitted: the step, with the teacher's logits cached in the batch (no teacher model)
    cached = eqx.tree_at(
        lambda b: b.teacher_logits,
        batch,
        jax.vmap(teacher)(batch.tokens, batch.mask),
        is_leaf=lambda x: x is None,
    )
    step = make_distill_step(optax.sgd(1.0), beta=0.7, chunk=8)
    _, metrics = sgd_delta(step, student, cached)
    np.testing.assert_allclose(float(nums["distill"] / dens["distill"]), metrics["loss"], rtol=1e-6)
    np.testing.assert_allclose(float(sums["jsd"][0] / sums["jsd"][1]), metrics["jsd"], rtol=1e-6)
    assert float(metrics["loss"]) > 1e-3


class _Opaque(eqx.Module):
    """A `Policy` behind a plain call: steps see a generic `(tokens, mask) -> logits` model."""

    policy: rx.Policy

    def __call__(self, tokens, mask):
        return self.policy(tokens, mask)


def _teacher_config(vocab=VOCAB):
    return rx.TransformerConfig(
        vocab_size=vocab, d_model=48, n_layers=3, n_heads=4, n_kv_heads=4, d_ff=96, max_seq_len=16
    )


def _sharp_policy_teacher(key, vocab=VOCAB):
    t = rx.Policy(_teacher_config(vocab), key=key)
    return eqx.tree_at(lambda p: p.lm_head, t, 60.0 * t.lm_head)


def test_policy_distilled_from_larger_teacher_lowers_the_loss(getkey):
    """A tiny `Policy` student learns from a wider, deeper `Policy` teacher. Both take the
    hidden-state path (LM heads on completion positions only), which gives the loss of the
    full-logits path (the same models behind an opaque call)."""
    student = rx.Policy(tiny_config(), key=getkey())
    teacher = _sharp_policy_teacher(getkey())
    batch = _distill_batch(getkey(), B=4, T=10)
    step = make_distill_step(optax.sgd(2.0), beta=0.5, chunk=8)
    params, opt_state = student, optax.sgd(2.0).init(eqx.filter(student, eqx.is_inexact_array))
    losses = []
    for _ in range(30):
        params, opt_state, metrics = step(params, opt_state, batch, teacher=teacher)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < 0.5 * losses[0], losses
    # the full-logits path on the same models
    loss_fn = distill_loss(beta=0.5, chunk=8)
    nums, dens, _ = eqx.filter_jit(loss_fn)(_Opaque(student), (None, _Opaque(teacher)), batch, None)
    np.testing.assert_allclose(nums["distill"] / dens["distill"], losses[0], rtol=1e-5)


# -------------------------------------------------------------- on-policy distillation


def _token_logps(model, batch):
    return jax.vmap(lambda t, m: rx.token_logprobs(model, t, m))(batch.tokens, batch.mask)


def test_onpolicy_gradient_is_unbiased_for_the_reverse_kl_gradient(getkey):
    """E_{y ~ student}[per-sample gradient] = ∇ KL(student || teacher) at that prefix, exactly
    (enumerating every token y of a one-token completion)."""
    student, teacher = CumMeanLM(getkey()), _teacher_cm(getkey())
    prompt = jax.random.randint(getkey(), (3,), 0, VOCAB)
    tokens = jnp.concatenate(
        [jnp.broadcast_to(prompt, (VOCAB, 3)), jnp.arange(VOCAB)[:, None]], axis=1
    )
    mask = jnp.ones((VOCAB, 4), bool)
    rows = DistillBatch(
        tokens=tokens, mask=mask, completion_mask=mask & (jnp.arange(4) == 3)[None, :]
    )
    loss_fn = onpolicy_distill_loss(kl_coef=0.5)

    def row_loss(s, row):  # the step's loss on a batch of one sampled completion
        nums, dens, _ = loss_fn(s, (None, teacher), jax.tree.map(lambda x: x[None], row), None)
        return nums["distill"] / dens["distill"]

    per_row = eqx.filter_jit(jax.vmap(lambda row: eqx.filter_grad(row_loss)(student, row)))(rows)
    probs = jax.nn.softmax(student(tokens[0], mask[0])[2])
    expected = jax.tree.map(lambda g: jnp.tensordot(probs, g, axes=1), per_row)

    def reverse_kl(s):
        ls, lt = s(tokens[0], mask[0])[2:3], teacher(tokens[0], mask[0])[2:3]
        return 0.5 * generalized_jsd(ls, lt, jnp.ones((1,), bool), beta=1.0)[0]

    assert_tree_allclose(expected, eqx.filter_jit(eqx.filter_grad(reverse_kl))(student), atol=1e-6)


def test_onpolicy_step_values_old_logp_cached_teacher_and_micro_batches(getkey):
    student, teacher = CumMeanLM(getkey()), _teacher_cm(getkey())
    batch = _distill_batch(getkey(), B=4, T=10)
    m = batch.completion_mask & batch.mask
    logp, tlp = _token_logps(student, batch), _token_logps(teacher, batch)
    step = make_onpolicy_distill_step(optax.sgd(1.0), kl_coef=2.0)
    base, mb = sgd_delta(step, student, batch, teacher=teacher)
    # loss = kl_coef · token-mean(log π_s - log π_t) on the sampled tokens (ratio 1)
    kl = aggregate(jnp.where(m, logp - tlp, 0.0), m, mode="token-mean")
    np.testing.assert_allclose(mb["loss"], 2.0 * kl, rtol=1e-5)
    np.testing.assert_allclose(mb["reverse_kl"], kl, rtol=1e-5)

    # reference gradient: kl_coef · Σ sg(log π_s - log π_t) ∇ log π_s / n
    def surrogate(s):
        lp = _token_logps(s, batch)
        adv = jax.lax.stop_gradient(jnp.where(m, lp - tlp, 0.0))
        return 2.0 * jnp.sum(adv * lp) / jnp.sum(m).astype(jnp.float32)

    grads = eqx.filter_jit(eqx.filter_grad(surrogate))(student)
    assert_tree_allclose(base, jax.tree.map(lambda g: -g, grads), atol=1e-6)
    # old_logp equal to the current log-probs, cached teacher log-probs, micro-batches:
    # the same update
    full = DistillBatch(
        tokens=batch.tokens,
        mask=batch.mask,
        completion_mask=batch.completion_mask,
        old_logp=logp,
        teacher_logp=tlp,
    )
    micro = make_onpolicy_distill_step(optax.sgd(1.0), kl_coef=2.0, micro_batches=2)
    delta, metrics = sgd_delta(micro, student, full)
    assert_tree_allclose(delta, base, atol=1e-6)
    np.testing.assert_allclose(metrics["loss"], mb["loss"], rtol=1e-5)
    # stale samples: the importance ratio weights the advantage
    stale = eqx.tree_at(lambda b: b.old_logp, full, jnp.where(m, logp - 0.5, 0.0))
    _, ms = sgd_delta(micro, student, stale)
    ratio_adv = jnp.where(m, -math.exp(0.5) * 2.0 * (tlp - (logp - 0.5)), 0.0)
    np.testing.assert_allclose(ms["loss"], aggregate(ratio_adv, m, mode="token-mean"), rtol=1e-5)
    np.testing.assert_allclose(ms["reverse_kl"], kl - 0.5, rtol=1e-5)
    # the clipped variant (ratio e^-0.5 < 1 - ε where the advantage is negative: clipped)
    ahead = eqx.tree_at(lambda b: b.old_logp, full, jnp.where(m, logp + 0.5, 0.0))
    clipped = make_onpolicy_distill_step(optax.sgd(1.0), clip_eps=0.2)
    _, mc = sgd_delta(clipped, student, ahead)
    assert float(mc["clipfrac"]) > 0.0


# ----------------------------------------------------------------- errors and checks


def test_vocabulary_mismatch_is_refused_naming_both_sizes(getkey):
    student = rx.Policy(tiny_config(), key=getkey())
    teacher = rx.Policy(_teacher_config(vocab=48), key=getkey())
    batch = _distill_batch(getkey(), B=2, T=8)
    msg = "teacher vocab_size=48 differs from student vocab_size=32"
    for step in (make_distill_step(optax.sgd(1.0)), make_onpolicy_distill_step(optax.sgd(1.0))):
        with pytest.raises(ValueError, match=msg):
            sgd_delta(step, student, batch, teacher=teacher)
        with pytest.raises(ValueError, match="teacher vocab_size=40 differs"):
            sgd_delta(step, CumMeanLM(getkey()), batch, teacher=CumMeanLM(getkey(), vocab=40))
    cached = eqx.tree_at(
        lambda b: b.teacher_logits, batch, jnp.zeros((2, 8, 40)), is_leaf=lambda x: x is None
    )
    with pytest.raises(ValueError, match="teacher vocab_size=40 differs"):
        sgd_delta(make_distill_step(optax.sgd(1.0)), student, cached)


def test_batch_validation_and_missing_teacher(getkey):
    b = _distill_batch(getkey(), B=2, T=8)
    fields = dict(tokens=b.tokens, mask=b.mask, completion_mask=b.completion_mask)
    with pytest.raises((DataError, TypeCheckError), match="teacher_logits"):
        DistillBatch(**fields, teacher_logits=jnp.zeros((2, 7, VOCAB)))
    with pytest.raises((DataError, TypeCheckError), match="old_logp"):
        DistillBatch(**fields, old_logp=jnp.zeros((2, 8, 1)))
    with pytest.raises((DataError, TypeCheckError), match="teacher_logp"):
        DistillBatch(**fields, teacher_logp=jnp.zeros((2, 8), jnp.int32))
    student = CumMeanLM(getkey())
    with pytest.raises(ValueError, match="teacher="):
        sgd_delta(make_distill_step(optax.sgd(1.0)), student, b)
    with pytest.raises(ValueError, match="teacher="):
        sgd_delta(make_onpolicy_distill_step(optax.sgd(1.0)), student, b)
    with pytest.raises(TypeError, match="DistillBatch"):
        sgd_delta(make_distill_step(optax.sgd(1.0)), student, rx.SequenceBatch(**fields))
    with pytest.raises(ValueError, match="beta"):
        make_distill_step(optax.sgd(1.0), beta=-0.1)
    with pytest.raises(ValueError, match="chunk"):
        make_distill_step(optax.sgd(1.0), chunk=0)


# ---------------------------------------------------------------------- settings records


def test_records_equal_keywords_and_a_shortcut_replaces_its_field(getkey):
    student, teacher = CumMeanLM(getkey()), _teacher_cm(getkey())
    batch = _distill_batch(getkey(), B=4, T=10)
    opt, options = optax.sgd(1.0), StepOptions(micro_batches=2, donate=False)
    cases = [
        (
            make_distill_step,
            DistillSettings(beta=0.3, temperature=1.5, chunk=8),
            dict(beta=0.3, temperature=1.5, chunk=8),
            dict(temperature=0.5),
        ),
        (
            make_onpolicy_distill_step,
            OnPolicyDistillSettings(kl_coef=2.0, clip_eps=0.2, temperature=0.8),
            dict(kl_coef=2.0, clip_eps=0.2, temperature=0.8),
            dict(kl_coef=0.5),
        ),
    ]
    for build, record, keywords, other in cases:
        run = lambda step: sgd_delta(step, student, batch, teacher=teacher)  # noqa: E731
        a = run(build(opt, record, options=options))
        b = run(build(opt, **keywords, micro_batches=2, donate=False))
        # a shortcut next to a record replaces that field (and the record's value matters)
        replaced = dataclasses.replace(record, **other)
        c = run(build(opt, replaced, **{k: keywords[k] for k in other}, options=options))
        assert leaves_equal(a, b) and leaves_equal(a, c), build.__name__
        assert float(run(build(opt, replaced, options=options))[1]["loss"]) != float(a[1]["loss"])
    # the loss functions take the same records
    for loss_fn, build, record in (
        (distill_loss, make_distill_step, cases[0][1]),
        (onpolicy_distill_loss, make_onpolicy_distill_step, cases[1][1]),
    ):
        nums, dens, _ = loss_fn(record)(student, (None, teacher), batch, None)
        _, m = sgd_delta(build(opt, record), student, batch, teacher=teacher)
        np.testing.assert_allclose(nums["distill"] / dens["distill"], m["loss"], rtol=1e-6)


@pytest.mark.parametrize(
    "build, fields, message",
    [
        (DistillSettings, dict(beta=1.5), "beta=1.5: must be in [0, 1]"),
        (DistillSettings, dict(temperature=0.0), "temperature=0.0: must be > 0"),
        (DistillSettings, dict(chunk=0), "chunk=0: must be a positive int"),
        (DistillSettings, dict(mode="mean"), "mode='mean': must be one of"),
        (
            DistillSettings,
            dict(constant=4.0),
            "constant=4.0: only used by mode='seq-mean-token-sum-norm' (mode='token-mean')",
        ),
        (OnPolicyDistillSettings, dict(kl_coef=-1.0), "kl_coef=-1.0: must be >= 0"),
        (OnPolicyDistillSettings, dict(clip_eps=0.0), "clip_eps=0.0: must be > 0"),
        (OnPolicyDistillSettings, dict(temperature=-1.0), "temperature=-1.0: must be > 0"),
    ],
)
def test_records_refuse_a_bad_value_in_one_line(build, fields, message):
    builder = make_distill_step if build is DistillSettings else make_onpolicy_distill_step
    for make in (lambda: build(**fields), lambda: builder(optax.sgd(1.0), **fields)):
        with pytest.raises(ValueError) as info:
            make()
        text = str(info.value)
        assert text.startswith(message) and "\n" not in text
    with pytest.raises(TypeError, match=r"\['bta'\].*micro_batches"):
        builder(optax.sgd(1.0), bta=0.1)


def test_onpolicy_temperature_is_a_python_number():
    # it selects the scaling of the logits when the step is traced: never an array
    with pytest.raises((ValueError, TypeCheckError), match="temperature"):
        OnPolicyDistillSettings(temperature=jnp.asarray(0.8))


def test_equal_records_share_one_program(getkey):
    base, teacher = CumMeanLM(getkey()), _teacher_cm(getkey())
    batch = _distill_batch(getkey(), B=4, T=10)
    student, opt = counted(base), optax.sgd(1.0)
    for build, record, other in (
        (make_distill_step, DistillSettings(beta=0.2, chunk=8), dict(temperature=1.5)),
        (make_onpolicy_distill_step, OnPolicyDistillSettings(kl_coef=0.5), dict(kl_coef=0.6)),
    ):
        start = traces(student)
        sgd_delta(build(opt, record), student, batch, teacher=teacher)
        once = traces(student) - start
        assert once > 0
        sgd_delta(build(opt, dataclasses.replace(record)), student, batch, teacher=teacher)
        sgd_delta(build(opt, **dataclasses.asdict(record)), student, batch, teacher=teacher)
        assert traces(student) - start == once, build.__name__
        sgd_delta(build(opt, record, **other), student, batch, teacher=teacher)
        assert traces(student) - start == 2 * once, build.__name__


def test_traced_temperature_changes_the_update_without_recompiling(getkey):
    """A step built from `DistillSettings(temperature=t)` inside `jax.jit`, `t` traced: one
    compilation for every τ, each equal to the step built from the Python float."""
    base, teacher = CumMeanLM(getkey()), _teacher_cm(getkey())
    batch = _distill_batch(getkey(), B=4, T=10)
    student, opt = counted(base), optax.sgd(1.0)

    @eqx.filter_jit
    def run(model, temperature):
        settings = DistillSettings(beta=0.3, temperature=temperature, chunk=8)
        step = make_distill_step(opt, settings, donate=False)
        return sgd_delta(step, model, batch, teacher=teacher)

    out = [run(student, jnp.asarray(0.7, jnp.float32))]
    once = traces(student)
    out.append(run(student, jnp.asarray(2.0, jnp.float32)))
    assert traces(student) == once, "a new temperature compiled the step again"
    for (delta, m), tau in zip(out, (0.7, 2.0), strict=True):
        eager = make_distill_step(opt, beta=0.3, temperature=tau, chunk=8)
        want, m_want = sgd_delta(eager, student, batch, teacher=teacher)
        assert_tree_allclose(delta, want, rtol=1e-5, atol=1e-7)
        for name in ("loss", "jsd"):
            np.testing.assert_allclose(m[name], m_want[name], rtol=1e-5, err_msg=name)
    assert float(out[0][1]["loss"]) != float(out[1][1]["loss"])


def test_one_default_temperature():
    """The distillation and sampled steps' records, the sampler and the pipeline's sampling
    section share the sampling layer's default."""
    assert DistillSettings().temperature == rx.DEFAULT_TEMPERATURE == 1.0
    assert OnPolicyDistillSettings().temperature == rx.train.SampledSettings().temperature
    assert rx.SamplingOptions(max_new_tokens=1).temperature == rx.DEFAULT_TEMPERATURE
    assert rx.pipelines.SamplingConfig().temperature == rx.DEFAULT_TEMPERATURE
    # the `distill` stage samples at its own 0.9 (TRL `GKDConfig.temperature`); its loss
    # and its β are the record's
    stage = rx.pipelines.DistillConfig()
    assert (stage.temperature, stage.beta) == (0.9, DistillSettings().beta)


# --------------------------------------------------------------------------------- pmap

N_DEV = 8


def _uneven_distill_batch(key, B=16, T=12, prompt=3):
    k1, k2 = jax.random.split(key)
    tokens = jax.random.randint(k1, (B, T), 1, VOCAB)
    lengths = jax.random.randint(k2, (B,), prompt + 1, T + 1).at[0].set(prompt).at[5].set(T)
    pos = jnp.arange(T)[None, :]
    mask = pos < lengths[:, None]
    return DistillBatch(tokens=tokens, mask=mask, completion_mask=mask & (pos >= prompt))


def test_pmap_equals_one_device(getkey):
    if jax.local_device_count() < N_DEV:
        pytest.skip(f"needs {N_DEV} devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    devices = jax.local_devices()[:N_DEV]
    student, teacher = CumMeanLM(getkey()), _teacher_cm(getkey())
    batch = _uneven_distill_batch(getkey())
    opt = optax.sgd(1.0)
    opt_state = opt.init(eqx.filter(student, eqx.is_inexact_array))
    # per-sequence mode, rows of very different lengths (one empty completion) spread over
    # the devices, and two micro-batches per device: still the one-device update
    kw = dict(beta=0.4, mode="seq-mean-token-mean")
    one_params, _, one_m = make_distill_step(opt, **kw)(student, opt_state, batch, teacher=teacher)
    dp_step = make_distill_step(opt, **kw, axis_name="data", micro_batches=2)
    dp = jax.pmap(lambda p, s, b, t: dp_step(p, s, b, teacher=t), axis_name="data", devices=devices)
    dp_params, _, dp_m = dp(
        replicate(student, devices),
        replicate(opt_state, devices),
        shard_batch_for_pmap(batch, N_DEV),
        replicate(teacher, devices),
    )
    got = eqx.filter(unreplicate(dp_params), eqx.is_inexact_array)
    want = eqx.filter(one_params, eqx.is_inexact_array)
    assert_tree_allclose(got, want, atol=1e-5)
    moved = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(eqx.filter(student, eqx.is_array)))
    )
    assert moved > 1e-4
    for name, value in one_m.items():
        np.testing.assert_allclose(
            unreplicate(dp_m)[name], value, rtol=2e-4, atol=2e-5, err_msg=name
        )


def test_reverse_kl_reward_keeps_float64_and_widens_bfloat16():
    """The difference was taken in float32 for every input, narrowing float64 ones."""
    a = np.array([-3.0, -1.0 - 1e-12, -2.0])
    b = np.array([-3.5, -1.0, -2.5])
    mask = jnp.array([True, True, False])
    with jax.enable_x64(True):
        r = reverse_kl_reward(jnp.asarray(a), jnp.asarray(b), mask)
        assert r.dtype == jnp.float64
        assert float(r[1]) == pytest.approx(1e-12, rel=1e-3)
        assert float(r[2]) == 0.0
    half = jnp.asarray(a, jnp.bfloat16)
    assert reverse_kl_reward(half, half, mask).dtype == jnp.float32
