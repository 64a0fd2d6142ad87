"""DPO family and Bradley-Terry: hand-computed points (TRL formulas), invariants, batching."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_allclose
from hypothesis import given
from jaxtyping import TypeCheckError

import rlhf_eqx.testing as rt
from rlhf_eqx.losses import (
    DPO_BATCH_LOSS_TYPES,
    DPO_LOSS_TYPES,
    DPOLossType,
    RunningMean,
    bradley_terry_loss,
    check_choice,
    combine_losses,
    dpo_batch_loss,
    dpo_implicit_rewards,
    dpo_loss,
    orpo_log_odds,
    orpo_loss,
    running_mean_update,
)

PAIR_TYPES = [t for t in DPO_LOSS_TYPES if t not in DPO_BATCH_LOSS_TYPES]
SORT_TYPES = list(DPO_BATCH_LOSS_TYPES)


# --- plain-Python references, transcribed from TRL's DPOTrainer.dpo_loss / CPO / ORPO ---


def logsig(x):
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def sig(x):
    return math.exp(logsig(x))


C, R, RC, RR = -3.0, -7.0, -4.0, -6.0  # policy chosen / rejected, reference chosen / rejected
LC, LR = 3, 5  # completion lengths
BETA = 0.5
EPS = 0.1
DELTA = 0.3  # BCO running reward mean
TAU = 0.05
GAMMA = 0.4


def reference_loss(loss_type):
    hw, hl = C - RC, R - RR  # 1, -1
    u = (C - R) - (RC - RR)  # 2
    b = BETA
    if loss_type == "sigmoid":
        return -logsig(b * u) * (1 - EPS) - logsig(-b * u) * EPS
    if loss_type == "robust":
        return (-logsig(b * u) * (1 - EPS) + logsig(-b * u) * EPS) / (1 - 2 * EPS)
    if loss_type == "hinge":
        return max(0.0, 1 - b * u)
    if loss_type == "ipo":
        ubar = (C / LC - R / LR) - (RC / LC - RR / LR)
        return (ubar - 1 / (2 * b)) ** 2
    if loss_type == "exo_pair":
        return sig(b * u) * (logsig(b * u) - math.log(1 - EPS)) + sig(-b * u) * (
            logsig(-b * u) - math.log(EPS)
        )
    if loss_type == "nca_pair":
        cr, rr = b * hw, b * hl
        return -logsig(cr) - 0.5 * logsig(-cr) - 0.5 * logsig(-rr)
    if loss_type == "bco_pair":
        return -logsig(b * hw - DELTA) - logsig(-(b * hl - DELTA))
    if loss_type == "sppo_hard":
        return (hw - 0.5 / b) ** 2 + (hl + 0.5 / b) ** 2
    if loss_type == "apo_zero":
        return (1 - sig(b * hw)) + sig(b * hl)
    if loss_type == "apo_down":
        return sig(b * hw) + (1 - sig(b * (hw - hl)))
    if loss_type == "discopop":
        z = b * u
        mod = sig(z / TAU)
        return -logsig(z) * (1 - mod) + math.exp(-z) * mod
    if loss_type == "sigmoid_norm":
        ubar = (C - RC) / LC - (R - RR) / LR
        return -logsig(b * ubar) * (1 - EPS) - logsig(-b * ubar) * EPS
    if loss_type == "simpo":
        z = b * (C / LC - R / LR) - GAMMA
        return -logsig(z) * (1 - EPS) - logsig(-z) * EPS
    if loss_type == "orpo":
        lw, ll = C / LC, R / LR
        log_odds = (lw - ll) - (math.log1p(-math.exp(lw)) - math.log1p(-math.exp(ll)))
        return -b * logsig(log_odds)
    raise AssertionError(loss_type)


def _loss(loss_type, **kw):
    args = dict(
        beta=BETA,
        loss_type=loss_type,
        label_smoothing=EPS,
        chosen_len=jnp.asarray(LC),
        rejected_len=jnp.asarray(LR),
        bco_delta=DELTA,
        discopop_tau=TAU,
        simpo_gamma=GAMMA,
    )
    args.update(kw)
    return float(dpo_loss(C, R, RC, RR, **args))


@pytest.mark.parametrize("loss_type", PAIR_TYPES)
def test_hand_computed_points(loss_type):
    assert _loss(loss_type) == pytest.approx(reference_loss(loss_type), rel=1e-5, abs=1e-6)


def test_exo_default_smoothing_and_unsmoothed_sigmoid():
    u = (C - R) - (RC - RR)
    z = BETA * u
    e = 1e-3
    exo = sig(z) * (logsig(z) - math.log(1 - e)) + sig(-z) * (logsig(-z) - math.log(e))
    assert _loss("exo_pair", label_smoothing=0.0) == pytest.approx(exo, rel=1e-5)
    assert _loss("sigmoid", label_smoothing=0.0) == pytest.approx(-logsig(z), rel=1e-6)
    assert _loss("robust", label_smoothing=0.0) == pytest.approx(-logsig(z), rel=1e-6)


def test_reference_free_and_missing_reference():
    # reference_free: reference log-probs are 0.
    z = BETA * (C - R)
    assert _loss("sigmoid", label_smoothing=0.0, reference_free=True) == pytest.approx(
        -logsig(z), rel=1e-6
    )
    # SimPO / ORPO need no reference at all.
    simpo = float(
        dpo_loss(
            C, R, beta=BETA, loss_type="simpo", chosen_len=LC, rejected_len=LR, simpo_gamma=GAMMA
        )
    )
    assert simpo == pytest.approx(-logsig(BETA * (C / LC - R / LR) - GAMMA), rel=1e-6)
    with pytest.raises(ValueError):
        dpo_loss(C, R, loss_type="sigmoid")
    with pytest.raises(ValueError):
        dpo_loss(C, R, RC, RR, loss_type="aot")
    with pytest.raises(ValueError):
        dpo_loss(C, R, RC, RR, label_smoothing=0.5)


def test_ipo_without_lengths_uses_logps_as_given():
    u = (C - R) - (RC - RR)
    assert float(dpo_loss(C, R, RC, RR, beta=BETA, loss_type="ipo")) == pytest.approx(
        (u - 1 / (2 * BETA)) ** 2
    )


@given(rt.preference_pairs())
def test_dpo_is_ln2_when_policy_equals_reference(pair):
    c, r = pair.chosen_logp, pair.rejected_logp
    for beta in (0.1, 1.0):
        assert float(dpo_loss(c, r, c, r, beta=beta)) == pytest.approx(math.log(2.0), rel=1e-6)


def test_dpo_gradient_direction():
    grad = jax.grad(lambda c, r: dpo_loss(c, r, RC, RR), argnums=(0, 1))
    g = grad(jnp.asarray(C), jnp.asarray(R))
    assert float(g[0]) < 0 < float(g[1])
    # d/dc of -log σ(β u) is -β σ(-β u)
    u = (C - R) - (RC - RR)
    assert float(g[0]) == pytest.approx(-0.1 * sig(-0.1 * u), rel=1e-5)


def test_implicit_rewards_and_orpo_parts():
    rc, rr = dpo_implicit_rewards(C, R, RC, RR, beta=BETA)
    assert float(rc) == pytest.approx(BETA * (C - RC))
    assert float(rr) == pytest.approx(BETA * (R - RR))
    rc0, _ = dpo_implicit_rewards(C, R, beta=BETA)
    assert float(rc0) == pytest.approx(BETA * C)
    total, parts = orpo_loss(C, R, chosen_len=LC, rejected_len=LR, beta=BETA)
    assert float(parts["nll"]) == pytest.approx(-C / LC)
    assert float(parts["or_loss"]) == pytest.approx(reference_loss("orpo"), rel=1e-5)
    assert float(total) == pytest.approx(-C / LC + reference_loss("orpo"), rel=1e-5)
    # log(1 - e^x) stays finite at x = 0.
    assert np.isfinite(float(orpo_log_odds(0.0, -1.0)))


def test_combine_losses_rpo():
    dpo = dpo_loss(C, R, RC, RR)
    nll = jnp.asarray(-C / LC)
    out = combine_losses({"dpo": dpo, "nll": nll}, {"dpo": 1.0, "nll": 0.5})
    assert float(out) == pytest.approx(float(dpo) + 0.5 * (-C / LC), rel=1e-6)
    with pytest.raises(ValueError):
        combine_losses({"dpo": dpo}, {"dpo": 1.0, "nll": 0.5})


def test_running_mean_matches_concatenation():
    a = jnp.array([1.0, 2.0, 6.0])
    b = jnp.array([-4.0, 10.0])
    s = running_mean_update(running_mean_update(RunningMean(), a), b)
    assert float(s.mean) == pytest.approx(float(jnp.mean(jnp.concatenate([a, b]))), rel=1e-6)
    assert float(s.count) == 5.0


# --- bradley-terry ---------------------------------------------------------------------


def test_bradley_terry_hand_computed():
    assert float(bradley_terry_loss(1.0, 1.0)) == pytest.approx(math.log(2.0), rel=1e-6)
    assert float(bradley_terry_loss(2.0, -1.0)) == pytest.approx(-logsig(3.0), rel=1e-6)
    assert float(bradley_terry_loss(2.0, -1.0, margin=1.5)) == pytest.approx(-logsig(1.5), rel=1e-6)
    assert float(bradley_terry_loss(2.0, -1.0, center_coef=0.01)) == pytest.approx(
        -logsig(3.0) + 0.01 * 1.0, rel=1e-6
    )
    margin = jnp.asarray(0.25)
    assert float(bradley_terry_loss(0.5, 1.0, margin=margin)) == pytest.approx(
        -logsig(-0.75), rel=1e-6
    )
    # Extreme rewards: finite, and linear in the gap.
    assert float(bradley_terry_loss(-1e6, 1e6)) == pytest.approx(2e6, rel=1e-6)
    assert float(bradley_terry_loss(1e6, -1e6)) == 0.0


def _bt_batch(r):
    return jax.vmap(lambda a, b: bradley_terry_loss(a, b, center_coef=1e-3))(r[:, 0], r[:, 1])


@given(rt.reward_groups(n_groups=2, group_size=2))
def test_bradley_terry_finite_on_extreme_rewards(rewards):
    rt.check_finite(_bt_batch, rewards)


# --- batches: vmap == loop, permutations, AOT, finiteness ------------------------------


def _pair_losses(c, r, rc, rr, cl, rl):
    return {
        t: dpo_batch_loss(
            c,
            r,
            rc,
            rr,
            loss_type=t,
            chosen_len=cl,
            rejected_len=rl,
            label_smoothing=0.05,
            bco_delta=0.1,
        )
        for t in PAIR_TYPES
    }


def _sort_losses(c, r, rc, rr, cl, rl):
    del cl, rl
    return {t: dpo_batch_loss(c, r, rc, rr, loss_type=t, label_smoothing=0.05) for t in SORT_TYPES}


@given(rt.preference_pairs(batch=4))
def test_batch_properties(pairs):
    arrays = tuple(pairs)
    rt.check_finite(_pair_losses, *arrays)
    rt.check_finite(_sort_losses, *arrays)
    rt.check_permutation_invariance(_pair_losses, arrays)
    # AOT outputs are rank-ordered: a joint permutation of the batch changes nothing.
    rt.check_permutation_invariance(_sort_losses, arrays, permute_outputs=False)


def test_batch_equals_python_loop(getkey):
    B = 3
    c, r, rc, rr = (-jnp.abs(jax.random.normal(getkey(), (B,))) * 5 for _ in range(4))
    cl = jnp.array([1, 4, 9])
    rl = jnp.array([2, 3, 7])
    batch = _pair_losses(c, r, rc, rr, cl, rl)
    for t in PAIR_TYPES:
        loop = [
            dpo_loss(
                c[i],
                r[i],
                rc[i],
                rr[i],
                loss_type=t,
                chosen_len=cl[i],
                rejected_len=rl[i],
                label_smoothing=0.05,
                bco_delta=0.1,
            )
            for i in range(B)
        ]
        assert_tree_allclose(batch[t], jnp.stack(loop))


def test_aot_closed_forms():
    # One pair: sorting is the identity, so AOT reduces to (smoothed) sigmoid DPO.
    one = [jnp.array([x]) for x in (C, R, RC, RR)]
    sigmoid = dpo_batch_loss(*one, label_smoothing=0.05)
    for t in SORT_TYPES:
        assert_tree_allclose(dpo_batch_loss(*one, loss_type=t, label_smoothing=0.05), sigmoid)
    # Two pairs whose orders disagree: AOT couples sorted quantities, not the given pairs.
    c = jnp.array([-1.0, -9.0])
    r = jnp.array([-5.0, -2.0])  # logratios c - r: [4, -7]
    rc = jnp.array([-3.0, -3.0])
    rr = jnp.array([-1.0, -6.0])  # ref logratios: [-2, 3]
    aot = np.asarray(dpo_batch_loss(c, r, rc, rr, loss_type="aot", beta=1.0))
    # sorted(c - r) - sorted(rc - rr) = [-7, 4] - [-2, 3]
    np.testing.assert_allclose(aot, [-logsig(-5.0), -logsig(1.0)], rtol=1e-6)
    # h_w = c - rc = [2, -6], h_l = r - rr = [-4, 4]; sorted: [-6, 2] - [-4, 4]
    aot_pair = np.asarray(dpo_batch_loss(c, r, rc, rr, loss_type="aot_pair", beta=1.0))
    np.testing.assert_allclose(aot_pair, [-logsig(-2.0), -logsig(-2.0)], rtol=1e-6)
    sig_loss = np.asarray(dpo_batch_loss(c, r, rc, rr, beta=1.0))
    np.testing.assert_allclose(sig_loss, [-logsig(6.0), -logsig(-10.0)], rtol=1e-6)


def test_jit_equals_eager():
    args = [jnp.array([x, -2.0 - i]) for i, x in enumerate((C, R, RC, RR))]
    lens = (jnp.array([3, 4]), jnp.array([5, 2]))
    for t in ("sigmoid", "ipo", "aot", "discopop"):

        def f(c, r, rc, rr, cl, rl, t=t):
            return dpo_batch_loss(c, r, rc, rr, loss_type=t, chosen_len=cl, rejected_len=rl)

        assert_tree_allclose(jax.jit(f)(*args, *lens), f(*args, *lens))


def test_extremes_are_finite():
    # -1e4 sums, beta = 1: logits of ±1e4 must not overflow any branch.
    for t in PAIR_TYPES:
        for c, r in ((0.0, -1e4), (-1e4, 0.0)):
            out = dpo_loss(c, r, -5e3, -5e3, beta=1.0, loss_type=t, chosen_len=1, rejected_len=1)
            assert np.isfinite(float(out)), t


# --- the registry and traced hyperparameters --------------------------------------------


def test_loss_type_literal_and_reference_cover_the_registry():
    assert DPOLossType.__args__ == DPO_LOSS_TYPES
    assert len(set(DPO_LOSS_TYPES)) == len(DPO_LOSS_TYPES) == 16
    for t in PAIR_TYPES:  # every per-pair type has a hand-written reference
        reference_loss(t)
    # The shape checker rejects it first when on (TypeCheckError); both name the value.
    with pytest.raises((ValueError, TypeCheckError), match="sigmoyd"):
        dpo_loss(C, R, RC, RR, loss_type="sigmoyd")  # pyright: ignore
    with pytest.raises(ValueError, match="^unknown loss_type 'sigmoyd'; expected one of 'sigmoid'"):
        check_choice("loss_type", "sigmoyd", DPO_LOSS_TYPES)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "exo_pair", "discopop", "simpo", "robust"])
def test_vmap_over_traced_beta_equals_per_value(loss_type):
    betas = jnp.array([0.05, 0.5, 2.0])
    eps = 0.1 if loss_type != "exo_pair" else jnp.asarray(0.1)

    def f(beta, label_smoothing=eps):
        return dpo_loss(
            C,
            R,
            RC,
            RR,
            beta=beta,
            loss_type=loss_type,
            label_smoothing=label_smoothing,
            chosen_len=LC,
            rejected_len=LR,
            discopop_tau=TAU,
            simpo_gamma=GAMMA,
        )

    swept = jax.vmap(f)(betas)
    for i, b in enumerate([0.05, 0.5, 2.0]):
        np.testing.assert_allclose(swept[i], f(b), rtol=1e-6)
    # Traced label smoothing too, including 0 (EXO's 1e-3 default).
    grid = jax.vmap(lambda e: f(0.5, e))(jnp.array([0.0, 0.1]))
    np.testing.assert_allclose(grid, [f(0.5, 0.0), f(0.5, 0.1)], rtol=1e-6)


def test_jit_traced_beta_batch_and_aot():
    args = [jnp.array([x, -2.0 - i]) for i, x in enumerate((C, R, RC, RR))]
    for t in ("sigmoid", "aot", "bco_pair"):
        f = jax.jit(
            lambda b, t=t: dpo_batch_loss(*args, loss_type=t, beta=b, label_smoothing=b / 10)
        )
        np.testing.assert_allclose(
            f(jnp.asarray(0.3)),
            dpo_batch_loss(*args, loss_type=t, beta=0.3, label_smoothing=0.03),
            rtol=1e-6,
        )


def test_python_hyperparameters_are_still_validated():
    with pytest.raises(ValueError, match="beta must be positive"):
        dpo_loss(C, R, RC, RR, beta=0.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(C, R, RC, RR, label_smoothing=0.5)
    with pytest.raises(ValueError, match="center_coef"):
        bradley_terry_loss(1.0, 0.0, center_coef=-1.0)


def test_bradley_terry_traced_center_coef():
    f = jax.vmap(lambda c: bradley_terry_loss(1.0, 0.5, center_coef=c))
    np.testing.assert_allclose(
        f(jnp.array([0.0, 0.01])),
        [bradley_terry_loss(1.0, 0.5), bradley_terry_loss(1.0, 0.5, center_coef=0.01)],
        rtol=1e-6,
    )


def test_running_mean_ignores_an_empty_batch():
    """The mean of an empty batch is NaN, and `NaN * 0` stuck in the running mean."""
    for state in (RunningMean(), RunningMean(0.25, 8.0)):
        after = running_mean_update(state, jnp.zeros((0,), jnp.float32))
        assert float(after.mean) == float(state.mean) and float(after.count) == float(state.count)
    s = running_mean_update(running_mean_update(RunningMean(), jnp.zeros((0,))), jnp.array([2.0]))
    assert float(s.mean) == 2.0 and float(s.count) == 1.0
