"""Off-policy rollout corrections: importance weights (token / sequence / geometric,
truncate / mask) and mismatch metrics against a float64 reference of veRL's formulas,
their invariants, and the corrected GRPO step."""

import functools
import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, strategies as st
from test_train_common import CumMeanLM, sequence_batch, sgd_delta

import rlhf_eqx as rx
import rlhf_eqx.testing as rt
from rlhf_eqx.distributed import replicate, shard_batch_for_pmap, unreplicate
from rlhf_eqx.losses import (
    MISMATCH_EXTREMES,
    ROLLOUT_IS_LEVELS,
    ROLLOUT_IS_MODES,
    RolloutCorrection,
    aggregate_mismatch_metrics,
    importance_weights,
    mismatch_metrics,
)
from rlhf_eqx.train import GRPOBatch, grpo_advantages, make_grpo_step

COMBOS = list(itertools.product(ROLLOUT_IS_LEVELS, ROLLOUT_IS_MODES))
CLAMP = 20.0


# ----------------------------------------------------------------- float64 references


def np_log_weights(o, b, m, level):
    o, b, m = np.asarray(o, np.float64), np.asarray(b, np.float64), np.asarray(m, bool)
    r = np.where(m, o - b, 0.0)
    if level == "token":
        return r
    total = r.sum()
    if level == "geometric":
        total = total / max(m.sum(), 1)
    return np.full(r.shape, total)


def np_importance_weights(o, b, m, *, level, mode, upper, lower=None):
    """veRL `compute_rollout_importance_weights` for one row, in float64 (bounds compared
    with the unclamped log-weight)."""
    m = np.asarray(m, bool)
    log_w = np_log_weights(o, b, m, level)
    w = np.exp(np.clip(log_w, -CLAMP, CLAMP))
    if mode == "truncate":
        w, kept = np.minimum(w, upper), m.copy()
    else:
        low = 1.0 / upper if lower is None else lower
        kept = m & (log_w >= np.log(low)) & (log_w <= np.log(upper))
    return np.where(m, w, 0.0), kept, log_w


def np_mismatch(o, b, m, kept=None):
    """Per-row (value, count) pieces of veRL's off-policy metrics, float64."""
    o, b, m = np.asarray(o, np.float64), np.asarray(b, np.float64), np.asarray(m, bool)
    r = o - b
    n = float(m.sum())
    one = float(n > 0)
    rho = np.exp(np.clip(r, -CLAMP, CLAMP))
    mean_o = o[m].sum() / max(n, 1.0)
    mean_b = b[m].sum() / max(n, 1.0)

    def exp_(x):
        return float(np.exp(np.clip(x, -CLAMP, CLAMP))) * one

    out = {
        "kl": ((b - o)[m].sum(), n),
        "k3_kl": ((rho - r - 1.0)[m].sum(), n),
        "rollout_is_mean": (rho[m].sum(), n),
        "rollout_is_max": (rho[m].max() if n else 0.0, one),
        "rollout_is_min": (rho[m].min() if n else 0.0, one),
        "training_ppl": (exp_(-mean_o), one),
        "rollout_ppl": (exp_(-mean_b), one),
        "ppl_ratio": (exp_(mean_b - mean_o), one),
        "log_ppl_diff": ((mean_b - mean_o) * one, one),
    }
    if kept is not None:
        rejected = m & ~np.asarray(kept, bool)
        out["rollout_is_masked_fraction"] = (float(rejected.sum()), n)
        out["rollout_is_seq_masked_fraction"] = (float(rejected.any()), one)
    return {"rollout_corr/" + k: v for k, v in out.items()}


@functools.partial(jax.jit, static_argnames=("level", "mode"))
def jit_weights(o, b, m, *, level, mode, upper=2.0, lower=None):
    return importance_weights(o, b, m, level=level, mode=mode, upper=upper, lower=lower)


@jax.jit
def jit_mismatch(o, b, m, kept):
    return mismatch_metrics(o, b, m, kept=kept)


def _check_against_reference(o, b, m, level, mode, upper, lower):
    w, kept = jit_weights(o, b, m, level=level, mode=mode, upper=upper, lower=lower)
    w_ref, kept_ref, log_w = np_importance_weights(
        o, b, m, level=level, mode=mode, upper=upper, lower=lower
    )
    np.testing.assert_allclose(np.asarray(w, np.float64), w_ref, rtol=1e-5, atol=1e-6)
    # float32 vs float64 log-weights may fall on either side of a bound that they touch.
    bounds = np.log([upper, 1.0 / upper if lower is None else lower])
    clear = np.min(np.abs(log_w[:, None] - bounds[None, :]), axis=1) > 1e-4
    np.testing.assert_array_equal(np.asarray(kept)[clear], kept_ref[clear])


# ------------------------------------------------------------------- importance weights


@pytest.mark.parametrize("level,mode", COMBOS)
@given(data=rt.logprob_arrays(n=2, length=6, min_value=-10.0), upper=st.sampled_from([1.2, 2.0]))
def test_weights_match_float64_reference(level, mode, data, upper):
    o, b, m = data
    lower = 0.7 if mode == "mask" and upper == 2.0 else None
    _check_against_reference(o, b, m, level, mode, upper, lower)


def test_weights_closed_forms():
    o = jnp.asarray([-1.0, -2.0, -3.0, -0.5])
    b = jnp.asarray([-1.5, -1.0, -3.0, 7.0])
    m = jnp.asarray([True, True, True, False])
    e = np.exp
    cases = {
        ("token", "truncate"): ([e(0.5), e(-1.0), 1.0, 0.0], [1, 1, 1, 0]),
        ("token", "mask"): ([e(0.5), e(-1.0), 1.0, 0.0], [1, 0, 1, 0]),
        ("sequence", "truncate"): ([e(-0.5)] * 3 + [0.0], [1, 1, 1, 0]),
        ("sequence", "mask"): ([e(-0.5)] * 3 + [0.0], [1, 1, 1, 0]),
        ("geometric", "truncate"): ([e(-0.5 / 3)] * 3 + [0.0], [1, 1, 1, 0]),
        ("geometric", "mask"): ([e(-0.5 / 3)] * 3 + [0.0], [0, 0, 0, 0]),
    }
    for (level, mode), (w_ref, kept_ref) in cases.items():
        upper = 1.1 if level == "geometric" and mode == "mask" else 2.0
        w, kept = importance_weights(o, b, m, level=level, mode=mode, upper=upper)
        np.testing.assert_allclose(np.asarray(w), w_ref, rtol=1e-6, err_msg=f"{level} {mode}")
        np.testing.assert_array_equal(np.asarray(kept), np.asarray(kept_ref, bool))
    # Truncation at `upper`; a lower bound of its own in mask mode.
    w, _ = importance_weights(o, b - 5.0, m, level="token", upper=3.0)
    np.testing.assert_allclose(np.asarray(w), [3.0, 3.0, 3.0, 0.0])
    _, kept = importance_weights(o, b, m, level="token", mode="mask", upper=2.0, lower=0.3)
    np.testing.assert_array_equal(np.asarray(kept), [True, True, True, False])


@pytest.mark.parametrize("level,mode", COMBOS)
def test_weights_extreme_inputs(level, mode):
    """Log-ratios of ±1e3, empty rows and one-token rows: finite, saturated, as the reference."""
    o = jnp.zeros(4)
    rows = [
        (jnp.asarray([1e3, 1e3, -1e3, 0.0]), jnp.asarray([True, True, True, True])),
        (jnp.asarray([-1e3, -1e3, -1e3, 5.0]), jnp.asarray([True, True, True, False])),
        (jnp.asarray([1e3, jnp.nan, jnp.inf, -jnp.inf]), jnp.asarray([False] * 4)),
        (jnp.asarray([-1e3, 0.0, 0.0, 0.0]), jnp.asarray([True, False, False, False])),
        (jnp.asarray([1e3, 0.0, 0.0, 0.0]), jnp.asarray([True, False, False, False])),
    ]
    for b, m in rows:
        w, kept = importance_weights(o, b, m, level=level, mode=mode, upper=2.0)
        assert np.all(np.isfinite(np.asarray(w)))
        w_ref, kept_ref, _ = np_importance_weights(
            np.zeros(4), np.where(m, b, 0.0), m, level=level, mode=mode, upper=2.0
        )
        np.testing.assert_allclose(np.asarray(w, np.float64), w_ref, rtol=1e-5)
        np.testing.assert_array_equal(np.asarray(kept), kept_ref)
    # ratio e^{-1e3} (the sampler put 1e3 nats more on the token): weight e^{-20}, rejected.
    w, kept = importance_weights(o[:1], jnp.asarray([1e3]), jnp.asarray([True]), level=level)
    np.testing.assert_allclose(np.asarray(w), [np.exp(-20.0)], rtol=1e-5)
    if mode == "mask":
        _, kept = importance_weights(
            o[:1], jnp.asarray([1e3]), jnp.asarray([True]), level=level, mode="mask"
        )
        assert not bool(kept[0])


@given(
    data=rt.logprob_arrays(n=2, length=6, min_value=-1e4),
    garbage=st.sampled_from([np.nan, np.inf, -np.inf, 1e30, -7.0]),
)
def test_masked_positions_are_inert(data, garbage):
    o, b, m = data
    o2 = jnp.where(m, o, garbage)
    b2 = jnp.where(m, b, -garbage)
    for level, mode in COMBOS:
        a = jit_weights(o, b, m, level=level, mode=mode)
        c = jit_weights(o2, b2, m, level=level, mode=mode)
        for x, y in zip(a, c):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        kept = a[1]
        ma, mc = jit_mismatch(o, b, m, kept), jit_mismatch(o2, b2, m, kept)
        for k in ma:
            np.testing.assert_array_equal(np.asarray(ma[k]), np.asarray(mc[k]), err_msg=k)


@given(data=rt.logprob_arrays(n=2, length=6, min_value=-1e4), upper=st.floats(1.0, 1e3))
def test_truncated_weights_never_exceed_upper(data, upper):
    o, b, m = data
    for level in ROLLOUT_IS_LEVELS:
        w, kept = jit_weights(o, b, m, level=level, mode="truncate", upper=upper)
        w = np.asarray(w)
        assert np.all(np.isfinite(w)) and np.all(w >= 0.0)
        assert np.all(w <= np.float32(upper))
        np.testing.assert_array_equal(np.asarray(kept), np.asarray(m))
        # Mask mode: kept tokens lie in [1/upper, upper] and are real tokens.
        w, kept = jit_weights(o, b, m, level=level, mode="mask", upper=upper)
        kept = np.asarray(kept)
        assert not np.any(kept & ~np.asarray(m))
        assert np.all(np.asarray(w)[kept] <= np.float32(upper) * (1 + 1e-6))
        assert np.all(np.asarray(w)[kept] >= np.float32(1.0 / upper) * (1 - 1e-6))
        assert np.all(np.asarray(w)[~np.asarray(m)] == 0.0)


@given(
    data=rt.logprob_arrays(n=2, length=1, min_value=-1e3), mode=st.sampled_from(ROLLOUT_IS_MODES)
)
def test_one_token_levels_agree(data, mode):
    o, b, m = data
    token = jit_weights(o, b, m, level="token", mode=mode)
    for level in ("sequence", "geometric"):
        other = jit_weights(o, b, m, level=level, mode=mode)
        for x, y in zip(token, other):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_weights_are_constants():
    o = jnp.asarray([-1.0, -2.0, -0.3])
    b = jnp.asarray([-1.2, -1.5, -0.3])
    m = jnp.asarray([True, True, False])
    for level, mode in COMBOS:

        def total(o, b):
            return jnp.sum(importance_weights(o, b, m, level=level, mode=mode)[0])

        go, gb = jax.grad(total, argnums=(0, 1))(o, b)
        np.testing.assert_array_equal(np.asarray(go), 0.0)
        np.testing.assert_array_equal(np.asarray(gb), 0.0)


def test_jit_equals_eager_and_vmap_equals_loop(getkey):
    B, T = 3, 5
    o = -jax.random.uniform(getkey(), (B, T), maxval=4.0)
    b = o + 0.4 * jax.random.normal(getkey(), (B, T))
    m = jax.random.bernoulli(getkey(), 0.7, (B, T)).at[1].set(False).at[2, :].set(True)
    for level, mode in COMBOS:
        kw = dict(level=level, mode=mode, upper=1.5)
        batched = jax.vmap(lambda x, y, z: importance_weights(x, y, z, **kw))(o, b, m)
        for i in range(B):
            eager = importance_weights(o[i], b[i], m[i], **kw)
            jitted = jit_weights(o[i], b[i], m[i], **kw)
            for e, j, v in zip(eager, jitted, batched):
                np.testing.assert_array_equal(np.asarray(e), np.asarray(j))
                np.testing.assert_array_equal(np.asarray(e), np.asarray(v[i]))
    kept = m & (b < o)
    batched = jax.vmap(jit_mismatch)(o, b, m, kept)
    for i in range(B):
        eager = mismatch_metrics(o[i], b[i], m[i], kept=kept[i])
        for k, (v, c) in eager.items():
            np.testing.assert_allclose(np.asarray(v), np.asarray(batched[k][0][i]), rtol=1e-6)
            np.testing.assert_array_equal(np.asarray(c), np.asarray(batched[k][1][i]))


def test_traced_bounds():
    o = jnp.asarray([-1.0, -2.0, -3.0])
    b = jnp.asarray([-1.5, -1.0, -3.0])
    m = jnp.ones(3, bool)
    f = jax.jit(lambda u, lo: importance_weights(o, b, m, mode="mask", upper=u, lower=lo))
    for u, lo in [(2.0, 0.5), (1.5, 0.3), (1.0, 1.0)]:
        got = f(jnp.float32(u), jnp.float32(lo))
        ref = importance_weights(o, b, m, mode="mask", upper=u, lower=lo)
        for x, y in zip(got, ref):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(level="tok"), r"RolloutCorrection\.level 'tok'; expected one of 'token'"),
        (dict(mode="clip"), r"RolloutCorrection\.mode 'clip'; expected one of 'truncate'"),
        (dict(upper=0.5), r"RolloutCorrection\.upper must be a finite number >= 1, got 0\.5"),
        (dict(upper=float("inf")), r"RolloutCorrection\.upper"),
        (dict(mode="mask", lower=1.5), r"RolloutCorrection\.lower must be in \(0, 1\]"),
        (dict(mode="mask", lower=0.0), r"RolloutCorrection\.lower must be in \(0, 1\]"),
        (dict(lower=0.5), r"RolloutCorrection\.lower=0\.5 applies to mode='mask' only"),
    ],
)
def test_rollout_correction_validates_itself(kw, match):
    with pytest.raises(ValueError, match=match):
        RolloutCorrection(**kw)


def test_rollout_correction_calls_importance_weights():
    o = jnp.asarray([-1.0, -2.0, -3.0])
    b = jnp.asarray([-1.5, -1.0, -4.0])
    m = jnp.asarray([True, True, False])
    c = RolloutCorrection(level="sequence", mode="mask", upper=3, lower=0.4)
    ref = importance_weights(o, b, m, level="sequence", mode="mask", upper=3, lower=0.4)
    for x, y in zip(c(o, b, m), ref):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # A value that is not a number at all fails the annotation check.
    with pytest.raises((ValueError, TypeError)):
        RolloutCorrection(upper=jnp.float32(2.0))  # pyright: ignore
    with pytest.raises((ValueError, TypeError), match="level"):
        importance_weights(o, b, m, level="seq")  # pyright: ignore
    with pytest.raises(ValueError, match="upper"):
        importance_weights(o, b, m, upper=0.9)


# --------------------------------------------------------------------- mismatch metrics


def _assert_pieces(got, ref):
    assert set(got) == set(ref)
    for k, (v, c) in ref.items():
        np.testing.assert_allclose(float(got[k][0]), v, rtol=1e-5, atol=1e-5, err_msg=k)
        np.testing.assert_allclose(float(got[k][1]), c, err_msg=k)


@given(data=rt.logprob_arrays(n=2, length=6, min_value=-15.0), seed=st.integers(0, 2**16))
def test_mismatch_metrics_match_float64_reference(data, seed):
    o, b, m = data
    kept = m & jnp.asarray(np.random.default_rng(seed).random(6) < 0.7)
    _assert_pieces(jit_mismatch(o, b, m, kept), np_mismatch(o, b, m, kept))
    assert set(mismatch_metrics(o, b, m)) == set(np_mismatch(o, b, m))


def test_mismatch_metrics_extreme_inputs():
    o = jnp.asarray([0.0, 0.0, -1e4, 0.0])
    m = jnp.asarray([True, True, True, False])
    for b in (jnp.asarray([1e3, -1e3, 0.0, jnp.nan]), jnp.asarray([-1e3, -1e3, -1e3, 0.0])):
        got = mismatch_metrics(o, b, m, kept=m)
        ref = np_mismatch(o, jnp.where(m, b, 0.0), m, m)
        for k, (v, c) in got.items():
            assert np.isfinite(float(v)) and np.isfinite(float(c)), k
        _assert_pieces(got, ref)
    # Empty row: every piece (0, 0); a one-token row.
    empty = mismatch_metrics(o, o, jnp.zeros(4, bool), kept=jnp.zeros(4, bool))
    assert all(float(v) == 0.0 and float(c) == 0.0 for v, c in empty.values())
    one = jnp.asarray([True, False, False, False])
    _assert_pieces(mismatch_metrics(o, o - 0.5, one, kept=one), np_mismatch(o, o - 0.5, one, one))


def test_mismatch_metrics_aggregate_over_rows_and_devices(getkey):
    B, T = 8, 5
    o = -jax.random.uniform(getkey(), (B, T), maxval=3.0)
    b = o + 0.5 * jax.random.normal(getkey(), (B, T))
    m = jax.random.bernoulli(getkey(), 0.6, (B, T)).at[1].set(False)
    kept = m & (jnp.abs(o - b) < 0.6)
    pieces = jax.vmap(jit_mismatch)(o, b, m, kept)
    got = aggregate_mismatch_metrics(pieces)
    # veRL's batch formulas: token means over the real tokens, sequence means over the
    # non-empty rows, max / min over the real tokens.
    on, bn, mn, kn = (np.asarray(x, np.float64) for x in (o, b, m, kept))
    mn, kn = mn.astype(bool), kn.astype(bool)
    r = on - bn
    rows = mn.any(axis=1)
    lo = np.where(mn, on, 0).sum(1)[rows] / mn.sum(1)[rows]
    lb = np.where(mn, bn, 0).sum(1)[rows] / mn.sum(1)[rows]
    expected = {
        "kl": (bn - on)[mn].mean(),
        "k3_kl": (np.exp(r) - r - 1)[mn].mean(),
        "rollout_is_mean": np.exp(r)[mn].mean(),
        "rollout_is_max": np.exp(r)[mn].max(),
        "rollout_is_min": np.exp(r)[mn].min(),
        "training_ppl": np.exp(-lo).mean(),
        "rollout_ppl": np.exp(-lb).mean(),
        "ppl_ratio": np.exp(lb - lo).mean(),
        "log_ppl_diff": (lb - lo).mean(),
        "rollout_is_masked_fraction": (mn & ~kn).sum() / mn.sum(),
        "rollout_is_seq_masked_fraction": (mn & ~kn).any(1)[rows].mean(),
    }
    assert set(got) == {"rollout_corr/" + k for k in expected}
    for k, v in expected.items():
        np.testing.assert_allclose(float(got["rollout_corr/" + k]), v, rtol=1e-5, err_msg=k)
    # The same over 4 devices of 2 rows each.
    split = jax.tree.map(lambda x: x.reshape(4, 2, *x.shape[1:]), pieces)
    per_device = jax.pmap(
        lambda p: aggregate_mismatch_metrics(p, axis_name="d"),
        axis_name="d",
        devices=jax.devices()[:4],
    )(split)
    for k, v in got.items():
        np.testing.assert_allclose(np.asarray(per_device[k]), float(v), rtol=1e-6, err_msg=k)
    # Nothing counted anywhere: zeros.
    none = aggregate_mismatch_metrics(jax.vmap(jit_mismatch)(o, b, m & False, kept & False))
    assert all(float(v) == 0.0 for v in none.values())
    assert set(MISMATCH_EXTREMES) <= set(none)


# ------------------------------------------------------------------ the corrected step


def _grpo_batch(key, policy, *, B=4, T=10, behaviour_shift=0.4, old=True):
    k1, k2, k3 = jax.random.split(key, 3)
    s = sequence_batch(k1, B=B, T=T)
    logp = jax.vmap(lambda t, m: rx.token_logprobs(policy, t, m))(s.tokens, s.mask)
    old_logp = logp + 0.2 * jax.random.normal(k2, logp.shape)
    behaviour = old_logp + behaviour_shift * jax.random.normal(k3, logp.shape)
    return GRPOBatch(
        tokens=s.tokens,
        mask=s.mask,
        completion_mask=s.completion_mask,
        rewards=jnp.asarray([1.0, 0.0, 0.5, 2.0, 0.0, 1.0, 1.0, 0.0][:B]),
        old_logp=old_logp if old else None,
        behaviour_logp=jnp.where(s.mask, behaviour, 0.0),
    )


def _without_behaviour(batch):
    return eqx.tree_at(lambda b: b.behaviour_logp, batch, None)


def _equal_trees(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(
    "correction,kw",
    [
        (RolloutCorrection(level="token", mode="truncate", upper=2.0), dict()),
        (RolloutCorrection(level="sequence", mode="mask", upper=3.0), dict(beta=0.1)),
        pytest.param(
            RolloutCorrection(level="geometric", mode="mask", upper=1.01),
            dict(mode="token-mean"),
            marks=pytest.mark.slow,
        ),
    ],
)
def test_correction_with_matching_behaviour_changes_nothing(getkey, correction, kw):
    """behaviour_logp == old_logp: weights 1, nothing rejected: loss and gradient exact."""
    policy, ref = CumMeanLM(getkey()), CumMeanLM(getkey())
    batch = _grpo_batch(getkey(), policy)
    batch = eqx.tree_at(lambda b: b.behaviour_logp, batch, batch.old_logp)
    plain = make_grpo_step(optax.sgd(1.0), group_size=2, donate=False, **kw)
    corrected = make_grpo_step(
        optax.sgd(1.0), group_size=2, donate=False, rollout_correction=correction, **kw
    )
    extra = dict(reference=ref) if "beta" in kw else {}
    d0, m0 = sgd_delta(plain, policy, _without_behaviour(batch), **extra)
    d1, m1 = sgd_delta(corrected, policy, batch, **extra)
    _equal_trees(d0, d1)
    for name in m0:
        np.testing.assert_array_equal(np.asarray(m0[name]), np.asarray(m1[name]), err_msg=name)
    assert float(m1["rollout_corr/kl"]) == 0.0
    assert float(m1["rollout_corr/rollout_is_masked_fraction"]) == 0.0
    assert (
        float(m1["rollout_corr/rollout_is_max"]) == float(m1["rollout_corr/rollout_is_min"]) == 1.0
    )


def test_behaviour_logp_without_correction_only_adds_metrics(getkey):
    """No correction: the step with or without `behaviour_logp` is today's step, bit for bit."""
    policy = CumMeanLM(getkey())
    batch = _grpo_batch(getkey(), policy)
    step = make_grpo_step(optax.sgd(1.0), group_size=2, donate=False)
    d0, m0 = sgd_delta(step, policy, _without_behaviour(batch))
    d1, m1 = sgd_delta(step, policy, batch)
    _equal_trees(d0, d1)
    assert not any(k.startswith("rollout_corr/") for k in m0)
    for name in m0:
        np.testing.assert_array_equal(np.asarray(m0[name]), np.asarray(m1[name]), err_msg=name)
    # The step's metrics are those of the pure functions on the batch.
    m = batch.completion_mask & batch.mask
    pieces = jax.vmap(jit_mismatch)(batch.old_logp, batch.behaviour_logp, m, m)
    for k, v in aggregate_mismatch_metrics(pieces).items():
        np.testing.assert_allclose(float(m1[k]), float(v), rtol=1e-5, atol=1e-7, err_msg=k)
    assert float(m1["rollout_corr/kl"]) != 0.0


@pytest.mark.parametrize(
    "correction,old,mode",
    [
        (RolloutCorrection(level="token", mode="mask", upper=1.3), True, "seq-mean-token-mean"),
        (RolloutCorrection(level="sequence", mode="truncate", upper=1.5), False, "token-mean"),
    ],
)
def test_corrected_step_micro_batches_match_full_batch(getkey, correction, old, mode):
    policy, ref = CumMeanLM(getkey()), CumMeanLM(getkey())
    batch = _grpo_batch(getkey(), policy, old=old)
    kw = dict(group_size=2, beta=0.05, mode=mode, donate=False, rollout_correction=correction)
    full, m_full = sgd_delta(make_grpo_step(optax.sgd(1.0), **kw), policy, batch, reference=ref)
    micro, m_micro = sgd_delta(
        make_grpo_step(optax.sgd(1.0), micro_batches=2, **kw), policy, batch, reference=ref
    )
    for x, y in zip(jax.tree.leaves(micro), jax.tree.leaves(full)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
    for name in m_full:
        np.testing.assert_allclose(
            float(m_micro[name]), float(m_full[name]), rtol=1e-5, atol=1e-6, err_msg=name
        )
    if correction.mode == "mask":
        assert 0.0 < float(m_full["rollout_corr/rollout_is_masked_fraction"]) < 1.0


@pytest.mark.parametrize(
    "correction,mode",
    [
        (RolloutCorrection(level="token", mode="truncate", upper=1.2), "seq-mean-token-mean"),
        (RolloutCorrection(level="token", mode="mask", upper=1.3, lower=0.8), "token-mean"),
        pytest.param(
            RolloutCorrection(level="geometric", mode="mask", upper=1.1),
            "seq-mean-token-mean",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_corrected_loss_matches_numpy_reference(getkey, correction, mode):
    """veRL: per-token clipped surrogate times the rollout weight, aggregated over the
    kept tokens, plus beta times the (unweighted) k3 KL."""
    policy, ref = CumMeanLM(getkey()), CumMeanLM(getkey())
    batch = _grpo_batch(getkey(), policy)
    beta, eps = 0.1, 0.2
    step = make_grpo_step(
        optax.sgd(1.0),
        group_size=2,
        beta=beta,
        clip_eps=eps,
        mode=mode,
        donate=False,
        rollout_correction=correction,
    )
    _, metrics = sgd_delta(step, policy, batch, reference=ref)

    f64 = functools.partial(np.asarray, dtype=np.float64)
    lp = f64(jax.vmap(lambda t, m: rx.token_logprobs(policy, t, m))(batch.tokens, batch.mask))
    rlp = f64(jax.vmap(lambda t, m: rx.token_logprobs(ref, t, m))(batch.tokens, batch.mask))
    old, beh = f64(batch.old_logp), f64(batch.behaviour_logp)
    adv = f64(grpo_advantages(batch.rewards, group_size=2))
    m = np.asarray(batch.completion_mask & batch.mask)
    ratio = np.exp(lp - old)
    surrogate = -np.minimum(ratio * adv[:, None], np.clip(ratio, 1 - eps, 1 + eps) * adv[:, None])
    kl = np.exp(rlp - lp) - (rlp - lp) - 1.0
    rows = [
        np_importance_weights(
            old[i],
            beh[i],
            m[i],
            level=correction.level,
            mode=correction.mode,
            upper=correction.upper,
            lower=correction.lower,
        )
        for i in range(len(m))
    ]
    w = np.stack([r[0] for r in rows])
    kept = np.stack([r[1] for r in rows])
    per_token = surrogate * w + beta * kl
    if mode == "token-mean":
        expected = per_token[kept].sum() / kept.sum()
    else:
        nonempty = kept.any(axis=1)
        expected = np.mean([per_token[i][kept[i]].mean() for i in range(len(m)) if nonempty[i]])
    np.testing.assert_allclose(float(metrics["loss"]), expected, rtol=1e-5)
    assert kept.sum() < m.sum() or correction.mode == "truncate"
    assert np.any(w[m] != 1.0)


def test_corrected_step_needs_behaviour_logp(getkey):
    policy = CumMeanLM(getkey())
    batch = _without_behaviour(_grpo_batch(getkey(), policy))
    step = make_grpo_step(
        optax.sgd(1.0), group_size=2, donate=False, rollout_correction=RolloutCorrection()
    )
    with pytest.raises(ValueError, match="behaviour_logp"):
        sgd_delta(step, policy, batch)
    with pytest.raises((ValueError, TypeError), match="rollout_correction"):
        make_grpo_step(optax.sgd(1.0), group_size=2, rollout_correction="token")  # pyright: ignore


@pytest.mark.slow
def test_corrected_step_under_pmap_equals_one_device(getkey):
    """Devices stay exact: rejected tokens leave the global denominators, the metrics
    (max / min included) are those of the whole batch."""
    n_dev = 4
    if jax.local_device_count() < n_dev:
        pytest.skip(f"needs {n_dev} devices")
    devices = jax.local_devices()[:n_dev]
    policy = CumMeanLM(getkey())
    batch = _grpo_batch(getkey(), policy, B=8)
    opt = optax.sgd(1.0)
    correction = RolloutCorrection(level="token", mode="mask", upper=1.3)
    kw = dict(group_size=2, mode="token-mean", rollout_correction=correction)
    opt_state = opt.init(eqx.filter(policy, eqx.is_inexact_array))
    one_params, _, one_m = make_grpo_step(opt, donate=False, **kw)(policy, opt_state, batch)
    dp = jax.pmap(
        lambda p, s, b: make_grpo_step(opt, axis_name="d", **kw)(p, s, b),
        axis_name="d",
        devices=devices,
    )
    dp_params, _, dp_m = dp(
        replicate(policy, devices),
        replicate(opt_state, devices),
        shard_batch_for_pmap(batch, n_dev),
    )
    for a, b in zip(
        jax.tree.leaves(eqx.filter(unreplicate(dp_params), eqx.is_inexact_array)),
        jax.tree.leaves(eqx.filter(one_params, eqx.is_inexact_array)),
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    for name, v in one_m.items():
        np.testing.assert_allclose(
            np.asarray(dp_m[name][0]), np.asarray(v), rtol=1e-5, atol=1e-6, err_msg=name
        )
    assert 0.0 < float(one_m["rollout_corr/rollout_is_masked_fraction"]) < 1.0
    assert float(one_m["rollout_corr/rollout_is_max"]) > 1.3


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_inputs_under_strict_promotion(dtype):
    """`promote_types(bfloat16, float32)` raised under strict dtype promotion: the weights
    and metrics of bfloat16 log-probabilities are computed in float32."""
    old = jnp.array([-1.0, -2.0, -0.5], dtype)
    behaviour = jnp.array([-1.1, -1.9, -0.5], dtype)
    mask = jnp.array([True, True, False])
    w, kept = importance_weights(old, behaviour, mask, level="geometric", mode="mask", upper=2.0)
    assert w.dtype == jnp.float32 and kept.dtype == jnp.bool_
    ref = importance_weights(
        old.astype(jnp.float32),
        behaviour.astype(jnp.float32),
        mask,
        level="geometric",
        mode="mask",
        upper=2.0,
    )
    np.testing.assert_array_equal(np.asarray(w), np.asarray(ref[0]))
    np.testing.assert_array_equal(np.asarray(kept), np.asarray(ref[1]))
    metrics = mismatch_metrics(old, behaviour, mask)
    assert all(v.dtype == jnp.float32 for pair in metrics.values() for v in pair)


def test_float64_inputs_keep_float64():
    with jax.enable_x64(True):
        old = jnp.array([-1.0, -2.0 - 1e-12], jnp.float64)
        mask = jnp.array([True, True])
        w, _ = importance_weights(old, jnp.array([-1.0, -2.0], jnp.float64), mask)
        assert w.dtype == jnp.float64 and float(w[1]) == pytest.approx(1.0 - 1e-12, abs=1e-15)
        metrics = mismatch_metrics(old, old, mask)
        assert all(v.dtype == jnp.float64 for pair in metrics.values() for v in pair)
