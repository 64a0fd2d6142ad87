"""Policy losses after DAPO (CISPO, GMPO, SAPO, Clip-Cov, KL-Cov, high-entropy tokens), the
adaptive entropy coefficient, and their wiring into the GRPO step.

Formulas are checked against float64 numpy references written from the papers / veRL's
published formulas; the step against hand-composed losses (micro-batches, devices)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_tree_allclose
from hypothesis import given, settings, strategies as st
from test_train_common import VOCAB, CumMeanLM, sgd_delta

import rlhf_eqx.testing as rt
from rlhf_eqx.distributed import replicate, shard_batch_for_pmap, unreplicate
from rlhf_eqx.losses import (
    BATCH_POLICY_LOSSES,
    POLICY_LOSSES,
    adaptive_entropy_coef,
    aggregate,
    aggregate_parts,
    cispo_policy_loss,
    clip_cov_policy_loss,
    entropy_quantile_mask,
    gmpo_policy_loss,
    grpo_policy_loss,
    high_entropy_policy_loss,
    kl_cov_policy_loss,
    kl_penalty,
    sapo_policy_loss,
)
from rlhf_eqx.models import AbstractBatchedModel
from rlhf_eqx.ops import entropy_from_logits, logprobs_from_logits
from rlhf_eqx.train import GRPOBatch, grpo_advantages, make_grpo_step

# --- float64 references --------------------------------------------------------------------


def _f64(*xs):
    return [np.asarray(x, np.float64) for x in xs]


def _np_log_ratio(lp, old, m):
    return np.where(m, np.clip(lp - old, -20.0, 20.0), 0.0)


def _np_sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _np_cispo(lp, old, a, m, lo, hi):
    w = np.exp(_np_log_ratio(lp, old, m))
    w_hat = np.minimum(w, 1 + hi) if lo is None else np.clip(w, 1 - lo, 1 + hi)
    loss = np.where(m, -w_hat * a * lp, 0.0)
    return loss, np.where(m, -w_hat * a, 0.0)  # value, d loss / d logp


def _np_gmpo(lp, old, a, m, eps):
    """Zhao et al.: L = -A exp(mean_t c_t), token-clipped in log space on A's side."""
    x = _np_log_ratio(lp, old, m)
    c = np.minimum(x, eps) if a > 0 else (np.maximum(x, -eps) if a < 0 else x)
    n = max(m.sum(), 1)
    s = np.exp(np.sum(np.where(m, c, 0.0)) / n)
    free = m & (np.abs(lp - old) < 20) & (c == x)
    # gradient of the completion's loss L with respect to logp_t
    return np.where(m, -a * s, 0.0), np.where(free, -a * s / n, 0.0)


def _np_sapo(lp, old, a, m, tau_pos, tau_neg):
    w = np.exp(_np_log_ratio(lp, old, m))
    tau = tau_pos if a > 0 else tau_neg
    sig = _np_sigmoid(tau * (w - 1.0))
    grad = np.where(m & (np.abs(lp - old) < 20), -4.0 * sig * (1 - sig) * w * a, 0.0)
    return np.where(m, -(4.0 / tau) * sig * a, 0.0), grad


def _np_ppo(lp, old, A, m, lo, hi):
    w = np.exp(_np_log_ratio(lp, old, m))
    pg1, pg2 = -A * w, -A * np.clip(w, 1 - lo, 1 + hi)
    return np.maximum(pg1, pg2), pg2 > pg1, w


def _np_top(priority, candidate, k):
    idx = np.flatnonzero(candidate)
    order = np.lexsort((idx, -priority.ravel()[idx]))
    out = np.zeros(candidate.size, bool)
    out[idx[order[:k]]] = True
    return out.reshape(candidate.shape)


def _np_cov(lp, A, m):
    return (A - A[m].mean()) * (lp - lp[m].mean()) if m.any() else np.zeros_like(lp)


def _np_clip_cov(lp, old, adv, m, *, lo, hi, frac, lb, ub):
    """veRL compute_policy_loss_clip_cov, with the top-covariance candidates."""
    A = np.broadcast_to(adv[:, None], lp.shape)
    loss, clipped, _ = _np_ppo(lp, old, A, m, lo, hi)
    cov = _np_cov(lp, A, m)
    cand = m & ~clipped & (cov > lb) & (cov < ub)
    cut = _np_top(cov, cand, max(int(frac * m.sum()), 1))
    return np.where(cut | ~m, 0.0, loss), cut, cand


def _np_kl_cov(lp, old, adv, m, *, frac, coef):
    """veRL compute_policy_loss_kl_cov."""
    A = np.broadcast_to(adv[:, None], lp.shape)
    lr = _np_log_ratio(lp, old, m)
    sel = _np_top(_np_cov(lp, A, m), m, max(int(frac * m.sum()), 1))
    return np.where(m, -A * np.exp(lr) + np.where(sel, coef * np.abs(lr), 0.0), 0.0), sel


def _np_high_entropy(lp, old, adv, m, ent, *, rho, lo, hi):
    """Wang et al.: the clipped loss on tokens with entropy >= the (1 - rho)-quantile."""
    keep = m & (ent >= np.quantile(ent[m], 1 - rho)) if m.any() else np.zeros_like(m)
    loss, _, _ = _np_ppo(lp, old, np.broadcast_to(adv[:, None], lp.shape), m, lo, hi)
    return np.where(keep, loss, 0.0), keep


# --- inputs: ordinary, extreme and degenerate ----------------------------------------------

T = 7


def _sequence_cases():
    rng = np.random.default_rng(0)
    old = -np.abs(rng.normal(size=T)).astype(np.float32)
    ordinary = (old + 0.4 * rng.normal(size=T)).astype(np.float32)
    full = np.ones(T, bool)
    # log-ratios of exactly ±20, beyond the clamp (±25), and log-probs of -1e4
    ext_lp = np.array([-1e4, -9980.0, -3.0, -0.5, -1e4, -2.0, -1.0], np.float32)
    ext_old = np.array([-9980.0, -1e4, -28.0, -0.5, -9975.0, -1.9, -1.35], np.float32)
    one = np.zeros(T, bool)
    one[3] = True
    return [
        (ordinary, old, np.array([1, 1, 0, 1, 1, 1, 0], bool)),
        (ext_lp, ext_old, full),
        (ordinary, old, np.zeros(T, bool)),
        (ordinary, old, one),
    ]


PER_SEQUENCE = {
    "cispo": (
        lambda lp, o, a, m: cispo_policy_loss(lp, o, a, m, clip_eps_high=0.28),
        lambda lp, o, a, m: _np_cispo(lp, o, a, m, None, 0.28),
    ),
    "cispo_low": (
        lambda lp, o, a, m: cispo_policy_loss(lp, o, a, m, clip_eps_low=0.2, clip_eps_high=0.2),
        lambda lp, o, a, m: _np_cispo(lp, o, a, m, 0.2, 0.2),
    ),
    "gmpo": (
        lambda lp, o, a, m: gmpo_policy_loss(lp, o, a, m),
        lambda lp, o, a, m: _np_gmpo(lp, o, a, m, 0.4),
    ),
    "sapo": (
        lambda lp, o, a, m: sapo_policy_loss(lp, o, a, m, tau_pos=1.0, tau_neg=1.05),
        lambda lp, o, a, m: _np_sapo(lp, o, a, m, 1.0, 1.05),
    ),
}


@pytest.mark.parametrize("name", sorted(PER_SEQUENCE))
def test_per_sequence_losses_match_float64_references(name):
    ours, ref = PER_SEQUENCE[name]

    @jax.jit
    def loss_stats_grad(lp, o, a, m):
        def token_mean(x):
            loss, stats = ours(x, o, a, m)
            return jnp.sum(loss) / jnp.maximum(jnp.sum(m), 1).astype(loss.dtype), (loss, stats)

        (_, (loss, stats)), g = jax.value_and_grad(token_mean, has_aux=True)(lp)
        return loss, stats, g

    for lp, old, mask in _sequence_cases():
        n = max(mask.sum(), 1)
        care = np.abs(lp - old) != 20.0  # the clamp's corner, where no gradient is defined
        for a in (1.3, -0.7, 0.0):
            loss, stats, g = loss_stats_grad(
                jnp.asarray(lp), jnp.asarray(old), jnp.asarray(a, jnp.float32), jnp.asarray(mask)
            )
            want, want_grad = ref(*_f64(lp, old), a, mask)
            np.testing.assert_allclose(np.asarray(loss), want, rtol=1e-5, atol=1e-6)
            # GMPO's reference gradient is already that of the completion's (token-mean) loss
            want_grad = want_grad if name == "gmpo" else want_grad / n
            np.testing.assert_allclose(np.asarray(g)[care], want_grad[care], rtol=1e-5, atol=1e-7)
            assert np.all(np.asarray(loss)[~mask] == 0.0) and np.all(np.asarray(g)[~mask] == 0.0)
            assert all(np.all(np.asarray(v)[~mask] == 0.0) for v in stats.values())


def test_cispo_gradient_flows_through_clipped_tokens():
    """CISPO's point: a token whose weight is clipped still gets -clip(w) A ∇log π."""
    lp = jnp.log(jnp.array([0.9, 0.1, 0.5]))
    old = jnp.log(jnp.array([0.1, 0.9, 0.5]))  # w = 9, 1/9, 1
    mask = jnp.ones(3, bool)
    for a in (1.0, -1.0):
        g = jax.grad(lambda x: jnp.sum(cispo_policy_loss(x, old, jnp.asarray(a), mask)[0]))(lp)
        np.testing.assert_allclose(np.asarray(g), [-5.0 * a, -a / 9, -a], rtol=1e-5)
        ppo = jax.grad(lambda x: jnp.sum(grpo_policy_loss(x, old, jnp.asarray(a), mask)[0]))(lp)
        assert float(ppo[0 if a > 0 else 1]) == 0.0  # PPO drops that token instead
    _, stats = cispo_policy_loss(lp, old, jnp.asarray(1.0), mask, clip_eps_low=0.5)
    np.testing.assert_array_equal(np.asarray(stats["clipped_high"]), [1, 0, 0])
    np.testing.assert_array_equal(np.asarray(stats["clipped_low"]), [0, 1, 0])


def test_gmpo_is_the_geometric_mean_and_clips_per_token():
    lp = jnp.array([-1.0, -2.0, -0.5, -3.0])
    old = jnp.array([-1.5, -1.0, -0.5, -2.9])  # log-ratios 0.5, -1, 0, -0.1
    mask = jnp.array([True, True, True, False])
    loss, stats = gmpo_policy_loss(lp, old, jnp.asarray(2.0), mask)
    # A > 0: the 0.5 log-ratio is clipped to 0.4; the -1 is not (clipping is one-sided)
    s = np.exp((0.4 - 1.0 + 0.0) / 3)
    np.testing.assert_allclose(np.asarray(loss), [-2 * s] * 3 + [0.0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(stats["ratio"]), [s] * 3 + [0.0], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(stats["clipped_high"]), [1, 0, 0, 0])
    seq = aggregate(loss[None], mask[None], mode="seq-mean-token-mean")
    np.testing.assert_allclose(float(seq), -2 * s, rtol=1e-6)
    g = jax.grad(
        lambda x: aggregate(
            gmpo_policy_loss(x, old, jnp.asarray(2.0), mask)[0][None],
            mask[None],
            mode="seq-mean-token-mean",
        )
    )(lp)
    np.testing.assert_allclose(np.asarray(g), [0.0, -2 * s / 3, -2 * s / 3, 0.0], rtol=1e-6)


def test_sapo_gate_is_the_policy_gradient_on_policy():
    lp = jnp.array([-1.0, -2.0, -0.7])
    mask = jnp.ones(3, bool)
    for a, tau in ((1.5, 1.0), (-1.5, 1.05)):
        loss, stats = sapo_policy_loss(lp, lp, jnp.asarray(a), mask)
        np.testing.assert_allclose(np.asarray(loss), -2.0 * a / tau, rtol=1e-6)  # (4/τ)σ(0)
        g = jax.grad(lambda x: jnp.sum(sapo_policy_loss(x, lp, jnp.asarray(a), mask)[0]))(lp)
        np.testing.assert_allclose(np.asarray(g), -a, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(stats["gate"]), 1.0, rtol=1e-6)


# --- batch losses --------------------------------------------------------------------------


def _batch_case(B=6, seed=1, extreme=True):
    rng = np.random.default_rng(seed)
    old = -np.abs(rng.normal(size=(B, T))).astype(np.float32)
    lp = (old + 0.3 * rng.normal(size=(B, T))).astype(np.float32)
    mask = rng.random((B, T)) < 0.8
    mask[2] = False  # an empty row
    mask[3] = np.arange(T) == 4  # one token
    if extreme:  # log-probabilities of -1e4, log-ratios of ±20 and ±25 in the last row
        lp[-1], old[-1] = _sequence_cases()[1][0], _sequence_cases()[1][1]
    adv = rng.normal(size=B).astype(np.float32)
    ent = np.abs(rng.normal(size=(B, T))).astype(np.float32)
    return lp, old, adv, mask, ent


def _grad_logp(fn, lp, *rest):
    return np.asarray(jax.grad(lambda x: jnp.sum(fn(x, *rest)[0]))(jnp.asarray(lp)))


def _clip_cov(lb, ub, select="top", key=None):
    return lambda x, o, a, m: clip_cov_policy_loss(
        x,
        o,
        a,
        m,
        clip_eps=0.2,
        clip_eps_high=0.28,
        fraction=0.1,
        cov_low=lb,
        cov_high=ub,
        select=select,
        key=key,
    )


def test_clip_cov_matches_reference_and_cuts_gradients():
    for extreme, lb, ub in ((False, 0.01, 0.3), (True, -1e9, 1e9)):
        lp, old, adv, mask, _ = _batch_case(extreme=extreme)
        want, cut, cand = _np_clip_cov(
            *_f64(lp, old, adv), mask, lo=0.2, hi=0.28, frac=0.1, lb=lb, ub=ub
        )
        assert 0 < cut.sum() < cand.sum() < mask.sum()  # every rule is exercised
        args = tuple(jnp.asarray(x) for x in (lp, old, adv, mask))
        loss, stats = jax.jit(_clip_cov(lb, ub))(*args)
        np.testing.assert_allclose(np.asarray(loss), want, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(stats["selected"]) == 1.0, cut)
        g = _grad_logp(_clip_cov(lb, ub), *args)
        A = np.broadcast_to(adv[:, None], lp.shape)
        ppo, clipped, w = _np_ppo(*_f64(lp, old), A, mask, 0.2, 0.28)
        live = mask & ~cut & ~clipped & (np.abs(lp - old) < 20)
        np.testing.assert_allclose(g[live], (-A * w)[live], rtol=1e-5)
        assert np.all(g[~live & (np.abs(lp - old) != 20)] == 0.0)  # (no gradient at the clamp)
        assert np.all(g[cut] == 0.0) and cut.any()
        # random selection: as many tokens, drawn among the same candidates
        loss_r, stats_r = _clip_cov(lb, ub, "random", jax.random.key(3))(*args)
        picked = np.asarray(stats_r["selected"]) == 1.0
        assert picked.sum() == cut.sum() and np.all(cand[picked])
        np.testing.assert_allclose(
            np.asarray(loss_r), np.where(picked | ~mask, 0.0, ppo), rtol=1e-5, atol=1e-6
        )
    with pytest.raises(ValueError, match="key"):
        clip_cov_policy_loss(*args)


def test_kl_cov_matches_reference():
    lp, old, adv, mask, _ = _batch_case()
    want, sel = _np_kl_cov(*_f64(lp, old, adv), mask, frac=0.15, coef=0.5)
    assert sel.sum() == int(0.15 * mask.sum()) > 1
    args = tuple(jnp.asarray(x) for x in (lp, old, adv, mask))
    fn = lambda *x: kl_cov_policy_loss(*x, fraction=0.15, kl_coef=0.5)
    loss, stats = jax.jit(fn)(*args)
    np.testing.assert_allclose(np.asarray(loss), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(stats["selected"]) == 1.0, sel)
    # at least one token whatever the fraction; none in an all-masked batch
    _, s1 = kl_cov_policy_loss(*args, fraction=1e-6)
    assert float(jnp.sum(s1["selected"])) == 1.0
    out, s0 = kl_cov_policy_loss(*args[:3], jnp.zeros_like(args[3]))
    assert float(jnp.sum(s0["selected"])) == 0.0 and float(jnp.sum(jnp.abs(out))) == 0.0


@pytest.mark.parametrize("rho", [0.2, 0.5, 1.0])
def test_high_entropy_matches_reference_and_masks_gradients(rho):
    lp, old, adv, mask, ent = _batch_case()
    want, keep = _np_high_entropy(
        *_f64(lp, old, adv), mask, np.float64(ent), rho=rho, lo=0.2, hi=0.28
    )
    args = tuple(jnp.asarray(x) for x in (lp, old, adv, mask, ent))
    fn = lambda *x: high_entropy_policy_loss(*x, rho=rho, clip_eps_high=0.28)
    loss, stats = jax.jit(fn)(*args)
    np.testing.assert_allclose(np.asarray(loss), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(
        np.asarray(entropy_quantile_mask(args[4], args[3], rho=rho)), keep
    )
    np.testing.assert_array_equal(np.asarray(stats["selected"]) == 1.0, keep)
    if rho == 1.0:
        np.testing.assert_array_equal(keep, mask)
    g = _grad_logp(fn, *args)
    assert np.all(g[~keep] == 0.0)
    full = _grad_logp(
        lambda *x: jax.vmap(lambda *r: grpo_policy_loss(*r, clip_eps_high=0.28))(*x[:4]), *args
    )
    np.testing.assert_allclose(g[keep], full[keep], rtol=1e-6)
    assert np.any(g[keep] != 0.0)
    # no real token: nothing is selected
    assert not np.any(np.asarray(entropy_quantile_mask(args[4], jnp.zeros_like(args[3]))))


# --- properties (rlhf_eqx.testing) ---------------------------------------------------------


def _per_sequence_all(logp, old, mask):
    a = jnp.asarray(0.8)
    return (
        cispo_policy_loss(logp, old, a, mask),
        gmpo_policy_loss(logp, old, -a, mask),
        sapo_policy_loss(logp, old, -a, mask),
    )


@settings(max_examples=10)
@given(rt.logprob_arrays(n=2, length=6))
def test_per_sequence_losses_finite_and_padding_invariant(data):
    logp, old, mask = data
    rt.check_finite(_per_sequence_all, logp, old, mask)
    rt.check_padding_invariance(_per_sequence_all, (logp, old), mask)


def _batch_all(logp, old, ent, adv, mask, axis_name=None):
    return (
        clip_cov_policy_loss(
            logp,
            old,
            adv,
            mask,
            fraction=0.3,
            cov_low=-1e9,
            cov_high=1e9,
            select="top",
            axis_name=axis_name,
        ),
        kl_cov_policy_loss(logp, old, adv, mask, fraction=0.3, axis_name=axis_name),
        high_entropy_policy_loss(logp, old, adv, mask, ent, rho=0.4, axis_name=axis_name),
    )


@settings(max_examples=5)
@given(
    rt.logprob_arrays(n=3, batch=3, length=5, min_value=-30.0),
    st.lists(st.floats(-2.0, 2.0, width=32), min_size=3, max_size=3),
)
def test_batch_losses_masking_inert(data, adv):
    logp, old, ent, mask = data
    arrays = (logp, old, -ent, jnp.asarray(adv, jnp.float32))  # entropies are >= 0
    rt.check_finite(_batch_all, *arrays, mask)
    rt.check_padding_invariance(_batch_all, arrays, mask)
    rt.check_all_masked_contributes_nothing(_batch_all, arrays, mask)


# --- traced hyperparameters and the entropy coefficient -----------------------------------


def test_traced_hyperparameters():
    lp, old, adv, mask, ent = (jnp.asarray(x) for x in _batch_case())
    taus = jnp.array([0.5, 2.0])
    swept = jax.jit(
        jax.vmap(
            lambda t: jax.vmap(lambda *r: sapo_policy_loss(*r, tau_pos=t, tau_neg=t))(
                lp, old, adv, mask
            )[0]
        )
    )(taus)
    for i, t in enumerate((0.5, 2.0)):
        want = jax.vmap(lambda *r: sapo_policy_loss(*r, tau_pos=t, tau_neg=t))(lp, old, adv, mask)
        assert_tree_allclose(swept[i], want[0])
    fractions = jnp.array([0.1, 0.3])
    got = jax.jit(jax.vmap(lambda f: kl_cov_policy_loss(lp, old, adv, mask, fraction=f)[0]))(
        fractions
    )
    assert_tree_allclose(got[1], kl_cov_policy_loss(lp, old, adv, mask, fraction=0.3)[0])
    rho = jax.jit(lambda r: entropy_quantile_mask(ent, mask, rho=r))(jnp.asarray(0.5))
    np.testing.assert_array_equal(rho, entropy_quantile_mask(ent, mask, rho=0.5))
    eps = jax.jit(lambda e: gmpo_policy_loss(lp[0], old[0], adv[0], mask[0], clip_eps=e)[0])
    assert_tree_allclose(
        eps(jnp.asarray(0.1)), gmpo_policy_loss(lp[0], old[0], adv[0], mask[0], clip_eps=0.1)[0]
    )


def test_adaptive_entropy_coef():
    up = adaptive_entropy_coef(0.1, 0.2, target=0.5, lr=0.5)
    np.testing.assert_allclose(float(up), 0.1 + 0.5 * 0.3, rtol=1e-6)
    assert float(adaptive_entropy_coef(0.1, 2.0, target=0.5, lr=0.5)) == 0.0  # clamped at 0
    assert float(adaptive_entropy_coef(0.1, 0.0, target=5.0, lr=1.0, max_coef=0.3)) == np.float32(
        0.3
    )
    c = jax.jit(lambda c, h: adaptive_entropy_coef(c, h, target=0.5, lr=0.1))(0.2, 0.4)
    assert c.dtype == jnp.float32
    with pytest.raises(ValueError, match="lr"):
        adaptive_entropy_coef(0.1, 0.2, target=0.5, lr=-1.0)


# --- the GRPO step -------------------------------------------------------------------------

STEP_KW = {
    "cispo": dict(cispo_eps_high=0.28),
    "gmpo": dict(gmpo_clip=0.1),
    "sapo": dict(),
    "clip_cov": dict(clip_cov_select="top", cov_fraction=0.2, clip_cov_low=-1e3, clip_cov_high=1e3),
    "kl_cov": dict(cov_fraction=0.2, kl_cov_coef=0.5),
    "high_entropy": dict(entropy_rho=0.3),
}
TOKEN_FNS = {
    "cispo": lambda *x: jax.vmap(lambda *r: cispo_policy_loss(*r, clip_eps_high=0.28))(*x[:4]),
    "gmpo": lambda *x: jax.vmap(lambda *r: gmpo_policy_loss(*r, clip_eps=0.1))(*x[:4]),
    "sapo": lambda *x: jax.vmap(sapo_policy_loss)(*x[:4]),
    "clip_cov": lambda *x: clip_cov_policy_loss(
        *x[:4], fraction=0.2, cov_low=-1e3, cov_high=1e3, select="top"
    ),
    "kl_cov": lambda *x: kl_cov_policy_loss(*x[:4], fraction=0.2, kl_coef=0.5),
    "high_entropy": lambda *x: high_entropy_policy_loss(*x, rho=0.3),
}


def _uneven_batch(key, B, T=10, prompt=3, noise=0.3, policy=None):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    tokens = jax.random.randint(k1, (B, T), 0, VOCAB)
    lengths = jax.random.randint(k2, (B,), prompt + 1, T + 1).at[1].set(prompt)
    pos = jnp.arange(T)[None, :]
    mask = pos < lengths[:, None]
    old = None
    if policy is not None:
        old = jax.vmap(lambda t, m: logprobs_from_logits(policy(t, m), t, m))(tokens, mask)
        old = old + noise * jax.random.normal(k3, old.shape)
    rewards = jax.random.normal(k4, (B,))
    return GRPOBatch(
        tokens=tokens,
        mask=mask,
        completion_mask=mask & (pos >= prompt),
        rewards=rewards,
        old_logp=old,
    )


def _manual(policy, batch, token_fn, *, parts, mode, ent_coef=None, reference=None):
    """The step's loss composed by hand, and its gradient: policy-loss numerators of each
    part of the rows over the denominator of the whole batch."""

    def loss(params):
        model = eqx.combine(params, policy)
        logits = jax.vmap(model)(batch.tokens, batch.mask)
        logp = jax.vmap(logprobs_from_logits)(logits, batch.tokens, batch.mask)
        ent = jax.vmap(entropy_from_logits)(logits, batch.mask)
        adv = grpo_advantages(batch.rewards, group_size=2)
        m = batch.completion_mask & batch.mask
        size = batch.tokens.shape[0] // parts
        num = 0.0
        for i in range(parts):
            r = slice(i * size, (i + 1) * size)
            per_token, _ = token_fn(logp[r], batch.old_logp[r], adv[r], m[r], ent[r])
            if reference is not None:
                ref, beta = reference
                ref_logp = jax.vmap(logprobs_from_logits)(
                    jax.vmap(ref)(batch.tokens[r], batch.mask[r]), batch.tokens[r], batch.mask[r]
                )
                per_token = per_token + beta * kl_penalty(logp[r], ref_logp, kind="k3")
            num = num + aggregate_parts(per_token, m[r], mode=mode)[0]
        total = num / aggregate_parts(logp, m, mode=mode)[1]
        if ent_coef is not None:
            total = total - ent_coef * aggregate(ent, m, mode=mode)
        return total

    params = eqx.filter(policy, eqx.is_inexact_array)
    return eqx.filter_jit(eqx.filter_value_and_grad(loss))(params)


@pytest.mark.parametrize("name", sorted(STEP_KW))
def test_step_micro_batches(getkey, name):
    """Two micro-batches: a per-completion loss gives the loss and gradient of the full
    batch; a batch loss selects its tokens within each micro-batch (the documented
    behaviour), over the full batch's denominator. Both composed by hand."""
    policy = CumMeanLM(getkey())
    batch = _uneven_batch(getkey(), 8, policy=policy)
    mode = "seq-mean-token-mean" if name == "gmpo" else "token-mean"
    kw = dict(group_size=2, mode=mode, policy_loss=name, donate=False, **STEP_KW[name])
    delta, m = sgd_delta(make_grpo_step(optax.sgd(1.0), micro_batches=2, **kw), policy, batch)
    per_micro = name in BATCH_POLICY_LOSSES
    value, grad = _manual(policy, batch, TOKEN_FNS[name], parts=2 if per_micro else 1, mode=mode)
    np.testing.assert_allclose(float(m["loss"]), float(value), rtol=1e-5, atol=1e-6)
    assert_tree_allclose(delta, jax.tree.map(jnp.negative, grad), atol=1e-5)
    assert float(value) != 0.0
    assert (0.0 < float(m["selected_frac"]) < 1.0) if per_micro else "selected_frac" not in m


def _batch_all_on(axis_name):
    return lambda lp, o, e, a, m: _batch_all(lp, o, e, a, m, axis_name=axis_name)


def test_batch_losses_pmap_equal_one_device():
    """Inside `pmap`, the batch losses select over every device's tokens."""
    n_dev = 8
    if jax.local_device_count() < n_dev:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    lp, old, adv, mask, ent = (jnp.asarray(x) for x in _batch_case(B=2 * n_dev, seed=4))
    want = jax.jit(_batch_all)(lp, old, ent, adv, mask)
    shard = lambda x: x.reshape(n_dev, -1, *x.shape[1:])
    got = jax.pmap(_batch_all_on("d"), axis_name="d", devices=jax.local_devices()[:n_dev])(
        *(shard(x) for x in (lp, old, ent, adv, mask))
    )
    got = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), got)
    assert_tree_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert all(0 < float(jnp.sum(out[1]["selected"])) < float(jnp.sum(mask)) for out in want)


def test_step_pmap_equals_one_device(getkey):
    n_dev = 8
    if jax.local_device_count() < n_dev:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    devices = jax.local_devices()[:n_dev]
    policy, ref = CumMeanLM(getkey()), CumMeanLM(getkey())
    batch = _uneven_batch(getkey(), 16, policy=policy)
    opt = optax.sgd(1.0)
    opt_state = opt.init(eqx.filter(policy, eqx.is_inexact_array))
    name = "high_entropy"
    kw = dict(group_size=2, policy_loss=name, beta=0.05, mode="token-mean", **STEP_KW[name])
    one, _, m_one = make_grpo_step(opt, **kw)(policy, opt_state, batch, reference=ref)
    dp = jax.pmap(
        lambda p, s, b, r: make_grpo_step(opt, axis_name="d", **kw)(p, s, b, reference=r),
        axis_name="d",
        devices=devices,
    )
    got, _, m_dp = dp(
        replicate(policy, devices),
        replicate(opt_state, devices),
        shard_batch_for_pmap(batch, n_dev),
        replicate(ref, devices),
    )
    trained = lambda p: eqx.filter(p, eqx.is_inexact_array)
    assert_tree_allclose(trained(unreplicate(got)), trained(one), atol=1e-5)
    for k, v in m_one.items():
        np.testing.assert_allclose(
            np.asarray(m_dp[k][0]), np.asarray(v), rtol=1e-4, atol=1e-6, err_msg=k
        )
    assert 0.0 < float(m_one["selected_frac"]) < 1.0 and float(m_one["kl"]) > 0.0
    # ... and the one-device step is the loss composed by hand (with the k3 KL term)
    value, grad = _manual(
        policy, batch, TOKEN_FNS[name], parts=1, mode="token-mean", reference=(ref, 0.05)
    )
    np.testing.assert_allclose(float(m_one["loss"]), float(value), rtol=1e-5)
    assert_tree_allclose(
        trained(one), jax.tree.map(lambda p, g: p - g, trained(policy), grad), atol=1e-5
    )


def test_step_default_is_grpo_and_entropy_bonus(getkey):
    policy = CumMeanLM(getkey())
    batch = _uneven_batch(getkey(), 8, policy=policy)
    base = dict(group_size=2, clip_eps_high=0.28, mode="token-mean", donate=False)
    plain, m_plain = sgd_delta(make_grpo_step(optax.sgd(1.0), **base), policy, batch)
    # every new hyperparameter is inert under policy_loss="grpo"
    named, m_named = sgd_delta(
        make_grpo_step(
            optax.sgd(1.0),
            policy_loss="grpo",
            cispo_eps_high=0.1,
            gmpo_clip=0.2,
            sapo_tau_pos=3.0,
            cov_fraction=0.5,
            kl_cov_coef=9.0,
            entropy_rho=0.5,
            **base,
        ),
        policy,
        batch,
    )
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), named, plain))
    assert set(m_named) == set(m_plain) and "selected_frac" not in m_plain
    assert all(float(m_named[k]) == float(m_plain[k]) for k in m_plain)
    # the entropy bonus, with a run-time coefficient (the adaptive controller's output)
    step = make_grpo_step(optax.sgd(1.0), **base)
    coef = adaptive_entropy_coef(0.0, m_plain["entropy"], target=10.0, lr=0.01)
    assert float(coef) > 0.0
    delta, m = sgd_delta(step, policy, batch, entropy_coef=coef)
    grpo = lambda *x: jax.vmap(lambda *r: grpo_policy_loss(*r, clip_eps_high=0.28))(*x[:4])
    value, grad = _manual(policy, batch, grpo, parts=1, mode="token-mean", ent_coef=coef)
    np.testing.assert_allclose(float(m["loss"]), float(value), rtol=1e-5)
    np.testing.assert_allclose(
        float(m["loss/entropy"]), -float(coef) * float(m["entropy"]), rtol=1e-5
    )
    assert_tree_allclose(delta, jax.tree.map(jnp.negative, grad), atol=1e-5)


def test_step_rejects_bad_policy_loss_arguments():
    opt = optax.sgd(1.0)
    assert POLICY_LOSSES == ("grpo", "cispo", "gmpo", "sapo", "clip_cov", "kl_cov", "high_entropy")
    bad = [
        (dict(policy_loss="ppo"), "policy_loss"),
        (dict(policy_loss="cispo", importance="sequence"), "importance"),
        (dict(policy_loss="sapo", delta=2.0), "delta"),
        (dict(policy_loss="clip_cov", clip_cov_low=5.0, clip_cov_high=1.0), "clip_cov_low"),
        (dict(policy_loss="clip_cov", clip_cov_select="all"), "clip_cov_select"),
        (dict(policy_loss="high_entropy", entropy_rho=0.0), "entropy_rho"),
        (dict(policy_loss="kl_cov", cov_fraction=1.5), "cov_fraction"),
        (dict(policy_loss="sapo", sapo_tau_neg=-1.0), "sapo_tau_neg"),
    ]
    for kw, match in bad:
        with pytest.raises((ValueError, TypeError), match=match):
            make_grpo_step(opt, group_size=2, **kw)


class _KeyedLM(AbstractBatchedModel):
    """`CumMeanLM` that takes (and ignores) the step's `key=`, one row or a batch."""

    lm: CumMeanLM

    def __call__(self, tokens, mask, *, key=None):
        del key
        return self.lm(tokens, mask) if tokens.ndim == 1 else jax.vmap(self.lm)(tokens, mask)


def test_step_clip_cov_random_needs_a_key(getkey):
    policy = _KeyedLM(CumMeanLM(getkey()))
    batch = _uneven_batch(getkey(), 4, policy=policy)
    step = make_grpo_step(
        optax.sgd(1.0),
        group_size=2,
        policy_loss="clip_cov",
        cov_fraction=0.2,
        clip_cov_low=-1e3,
        clip_cov_high=1e3,
    )
    with pytest.raises(ValueError, match="key"):
        sgd_delta(step, policy, batch)
    _, m = sgd_delta(step, policy, batch, key=getkey())
    assert 0.0 < float(m["selected_frac"]) < 1.0
