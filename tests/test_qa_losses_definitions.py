"""Every public loss against its published definition, written here again in float64
numpy from the paper or TRL's / veRL's formula (never from the library), and its closed
forms, extremes and transformations (jit, vmap over a hyperparameter, padding).

Sources: DPO (Rafailov et al. 2023), cDPO (Mitchell 2023), rDPO (Chowdhury et al. 2024),
SLiC hinge (Zhao et al. 2023), IPO (Azar et al. 2023), EXO (Ji et al. 2024), NCA (Chen
et al. 2024), BCO (Jung et al. 2024), SPPO (Wu et al. 2024), APO (D'Oosterlinck et al.
2024), DiscoPOP (Lu et al. 2024), SimPO (Meng et al. 2024), ORPO (Hong et al. 2024), AOT
(Melnyk et al. 2024), all as TRL's `DPOTrainer.dpo_loss` / `CPOTrainer` / `ORPOTrainer`;
KTO (Ethayarajh et al. 2024; TRL `KTOTrainer.kto_loss`); PPO (Schulman et al. 2017);
GRPO (Shao et al. 2024; TRL `GRPOTrainer`); GSPO (Zheng et al. 2025); CISPO (MiniMax
2025); SAPO (Gao et al. 2025; TRL `get_sapo_token_loss`); GMPO (Zhao et al. 2025; veRL
`compute_policy_loss_geo_mean`); KL estimators (Schulman 2020); GKD's generalised JSD
(Agarwal et al. 2024; TRL `generalized_jsd_loss`); Bradley-Terry (TRL `RewardTrainer`).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import rlhf_eqx.testing as rt
from rlhf_eqx import losses as L

B = 8
RNG = np.random.default_rng(20261206)
C, R, RC, RR = (-RNG.uniform(0.0, 60.0, B) for _ in range(4))
CL, RL = (RNG.integers(1, 40, B).astype(np.float64) for _ in range(2))
BETA, EPS, TAU, GAMMA, DELTA = 0.3, 0.1, 0.05, 0.5, 0.2


def logsig(x):
    return -np.logaddexp(0.0, -x)


def sig(x):
    return 1.0 / (1.0 + np.exp(-x))


def smoothed(z, eps):
    return -(1 - eps) * logsig(z) - eps * logsig(-z)


def log1mexp(x):
    return np.log1p(-np.exp(x))


def reference_dpo(loss_type, c, r, rc, rr, cl, rl, beta, eps):
    """TRL's `dpo_loss` branch of `loss_type`, in float64 numpy."""
    hw, hl = c - rc, r - rr
    u = hw - hl
    z = beta * u
    if loss_type == "sigmoid":
        return smoothed(z, eps)
    if loss_type == "robust":
        return (-(1 - eps) * logsig(z) + eps * logsig(-z)) / (1 - 2 * eps)
    if loss_type == "hinge":
        return np.maximum(0.0, 1.0 - z)
    if loss_type == "ipo":  # per-token averages
        ua = (c / cl - r / rl) - (rc / cl - rr / rl)
        return (ua - 1 / (2 * beta)) ** 2
    if loss_type == "exo_pair":
        e = eps or 1e-3
        return sig(z) * (logsig(z) - math.log(1 - e)) + sig(-z) * (logsig(-z) - math.log(e))
    if loss_type == "nca_pair":
        return -logsig(beta * hw) - 0.5 * logsig(-beta * hw) - 0.5 * logsig(-beta * hl)
    if loss_type == "bco_pair":
        return -logsig(beta * hw - DELTA) - logsig(-(beta * hl - DELTA))
    if loss_type == "sppo_hard":
        return (hw - 0.5 / beta) ** 2 + (hl + 0.5 / beta) ** 2
    if loss_type == "apo_zero":
        return 1 - sig(beta * hw) + sig(beta * hl)
    if loss_type == "apo_down":
        return sig(beta * hw) + 1 - sig(z)
    if loss_type == "discopop":
        mod = sig(z / TAU)
        return -logsig(z) * (1 - mod) + np.exp(-z) * mod
    if loss_type == "sigmoid_norm":
        ua = (c / cl - r / rl) - (rc / cl - rr / rl)
        return smoothed(beta * ua, eps)
    if loss_type == "simpo":  # reference-free, per-token averages
        return smoothed(beta * (c / cl - r / rl) - GAMMA, eps)
    if loss_type == "orpo":
        lw, ll = c / cl, r / rl
        log_odds = (lw - ll) - (log1mexp(lw) - log1mexp(ll))
        return -beta * logsig(log_odds)
    if loss_type == "aot":
        return smoothed(beta * (np.sort(c - r) - np.sort(rc - rr)), eps)
    if loss_type == "aot_pair":
        return smoothed(beta * (np.sort(hw) - np.sort(hl)), eps)
    raise AssertionError(loss_type)


# the loss types that take label smoothing (TRL applies it to these)
SMOOTHED = {"sigmoid", "robust", "exo_pair", "sigmoid_norm", "simpo", "aot", "aot_pair"}


def _library(loss_type, beta, eps, *arrays):
    c, r, rc, rr, cl, rl = (jnp.asarray(x, jnp.float32) for x in arrays)
    return L.dpo_batch_loss(
        c, r, rc, rr, beta=beta, loss_type=loss_type, label_smoothing=eps,
        chosen_len=cl, rejected_len=rl, bco_delta=DELTA, discopop_tau=TAU, simpo_gamma=GAMMA,
    )  # fmt: skip


@pytest.mark.parametrize("loss_type", L.DPO_LOSS_TYPES)
def test_dpo_family_matches_the_published_formula(loss_type):
    eps = EPS if loss_type in SMOOTHED else 0.0
    # ORPO needs average log-probabilities below 0 and not tiny: divide by short lengths
    got = np.asarray(_library(loss_type, BETA, eps, C, R, RC, RR, CL, RL), np.float64)
    want = reference_dpo(loss_type, C, R, RC, RR, CL, RL, BETA, eps)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-5)


@pytest.mark.parametrize("beta", [1e-3, 0.1, 1.0, 7.0])
def test_dpo_closed_forms(beta):
    z = jnp.float32(-3.0)
    # zero margin: log 2 for DPO, cDPO and rDPO (any smoothing), 1 for hinge
    for lt, eps in [("sigmoid", 0.0), ("sigmoid", 0.2), ("robust", 0.3), ("sigmoid_norm", 0.1)]:
        loss = L.dpo_loss(z, z - 1, z + 2, z + 1, beta=beta, loss_type=lt, label_smoothing=eps,
                          chosen_len=3, rejected_len=3)  # fmt: skip
        assert float(loss) == pytest.approx(math.log(2.0), rel=1e-6)
    assert float(L.dpo_loss(z, z, z, z, beta=beta, loss_type="hinge")) == pytest.approx(1.0)
    assert float(L.dpo_loss(z + 1 / beta, z, z, z, beta=beta, loss_type="hinge")) == (
        pytest.approx(0.0, abs=1e-5)
    )
    # IPO's minimum is at the per-token margin 1 / (2 beta), with zero gradient
    target = 1.0 / (2.0 * beta)

    def ipo(c):
        return L.dpo_loss(c, -2.0, -1.0, -2.0, beta=beta, loss_type="ipo")

    best = jnp.float32(-1.0 + target)
    assert float(ipo(best)) == pytest.approx(0.0, abs=1e-6 * max(1.0, target**2))
    assert abs(float(jax.grad(ipo)(best))) <= 1e-4 * max(1.0, target)
    assert float(ipo(best + 0.5)) > float(ipo(best)) < float(ipo(best - 0.5))
    # SPPO (hard labels) is zero at h_w = 1 / (2 beta), h_l = -1 / (2 beta)
    sppo = L.dpo_loss(target - 1.0, -target - 1.0, -1.0, -1.0, beta=beta, loss_type="sppo_hard")
    assert float(sppo) == pytest.approx(0.0, abs=1e-6 * max(1.0, target**2))
    # policy == reference: NCA and BCO (delta 0) are 2 log 2, APO 1, ORPO beta log 2
    for lt, want in [("nca_pair", 2 * math.log(2)), ("bco_pair", 2 * math.log(2)),
                     ("apo_zero", 1.0), ("apo_down", 1.0)]:  # fmt: skip
        assert float(L.dpo_loss(z, z - 4, z, z - 4, beta=beta, loss_type=lt)) == (
            pytest.approx(want, rel=1e-6)
        )
    orpo = L.dpo_loss(z, z, loss_type="orpo", beta=beta, chosen_len=4, rejected_len=4)
    assert float(orpo) == pytest.approx(beta * math.log(2.0), rel=1e-6)


EXTREMES = st.sampled_from([0.0, -1e-7, -1.0, -60.0, -1e4])


@settings(max_examples=25, deadline=None)
@given(
    st.tuples(EXTREMES, EXTREMES, EXTREMES, EXTREMES),
    st.sampled_from([1e-8, 0.1, 1e8]),
    st.sampled_from([lt for lt in L.DPO_LOSS_TYPES if lt not in L.DPO_BATCH_LOSS_TYPES]),
)
def test_dpo_family_finite_at_extremes(logps, beta, loss_type):
    def loss(c, r):
        return L.dpo_loss(c, r, logps[2], logps[3], beta=beta, loss_type=loss_type,
                          chosen_len=5, rejected_len=1)  # fmt: skip

    value, grads = jax.value_and_grad(loss, argnums=(0, 1))(*map(jnp.float32, logps[:2]))
    assert np.isfinite(value) and np.all(np.isfinite(grads)), (loss_type, logps, beta)


def test_dpo_family_jit_and_beta_sweep_match_eager():
    arrays = (C, R, RC, RR, CL, RL)
    betas = jnp.asarray([1e-3, 0.1, 1.0, 10.0], jnp.float32)
    for lt in L.DPO_LOSS_TYPES:
        eps = EPS if lt in SMOOTHED else 0.0
        eager = np.stack([_library(lt, float(b), eps, *arrays) for b in betas])
        swept = jax.jit(jax.vmap(lambda b, lt=lt, eps=eps: _library(lt, b, eps, *arrays)))(betas)
        np.testing.assert_allclose(swept, eager, rtol=1e-5, atol=1e-6, err_msg=lt)
        if eps:  # a traced label smoothing, 0 included, is the Python number's loss
            for e in (0.0, eps):
                traced = jax.jit(lambda e_, lt=lt: _library(lt, 0.1, e_, *arrays))(jnp.float32(e))
                np.testing.assert_allclose(
                    traced, _library(lt, 0.1, e, *arrays), rtol=1e-5, atol=1e-6
                )


def test_aot_is_invariant_to_a_joint_permutation():
    arrays = tuple(jnp.asarray(x, jnp.float32) for x in (C, R, RC, RR))
    for lt in L.DPO_BATCH_LOSS_TYPES:
        rt.check_permutation_invariance(
            lambda c, r, rc, rr, lt=lt: L.dpo_batch_loss(c, r, rc, rr, loss_type=lt),
            arrays, permute_outputs=False,
        )  # fmt: skip


def test_kto_matches_trl():
    h, kl = C - RC, 2.0
    for label in (True, False):
        got = jax.vmap(lambda lp, ref, label=label: L.kto_loss(lp, ref, label, kl, beta=BETA,
                       desirable_weight=1.5, undesirable_weight=0.5))(C, RC)  # fmt: skip
        want = 1.5 * (1 - sig(BETA * (h - kl))) if label else 0.5 * (1 - sig(BETA * (kl - h)))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
        got = jax.vmap(lambda lp, ref, label=label: L.kto_loss(
            lp, ref, label, kl, beta=BETA, loss_type="apo_zero_unpaired"))(C, RC)  # fmt: skip
        want = 1 - sig(BETA * h) if label else sig(BETA * h)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_bradley_terry_and_kl_estimators_match_their_definitions():
    got = jax.vmap(lambda a, b: L.bradley_terry_loss(a, b, margin=0.5, center_coef=0.01))(C, R)
    np.testing.assert_allclose(got, -logsig(C - R - 0.5) + 0.01 * (C + R) ** 2, rtol=1e-5)
    lp, ref = C / 10.0, R / 10.0
    log_r = ref - lp
    want = {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": np.exp(log_r) - log_r - 1,
            "abs": np.abs(log_r)}  # fmt: skip
    for kind, w in want.items():
        got = L.kl_penalty(jnp.asarray(lp, jnp.float32), jnp.asarray(ref, jnp.float32), kind=kind)
        np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-6, err_msg=kind)
        assert float(jnp.abs(L.kl_penalty(jnp.float32(-3.0), jnp.float32(-3.0), kind=kind))) == 0


T, V = 5, 7
S_LOGITS = jnp.asarray(RNG.normal(0.0, 3.0, (T, V)), jnp.float32)
T_LOGITS = jnp.asarray(RNG.normal(0.0, 3.0, (T, V)), jnp.float32)
ROW_MASK = jnp.array([True, True, False, True, False])


def reference_jsd(s, t, beta, temperature):
    def log_softmax(x):
        x = np.asarray(x, np.float64) / temperature
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    ls, lt = log_softmax(s), log_softmax(t)

    def kl(a, b):  # KL(exp a || exp b)
        return (np.exp(a) * (a - b)).sum(-1)

    if beta == 0.0:
        return kl(lt, ls)
    if beta == 1.0:
        return kl(ls, lt)
    lm = np.logaddexp(lt + math.log(beta), ls + math.log(1 - beta))
    return beta * kl(lt, lm) + (1 - beta) * kl(ls, lm)


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_generalized_jsd_matches_gkd(beta, temperature):
    got = L.generalized_jsd(S_LOGITS, T_LOGITS, ROW_MASK, beta=beta, temperature=temperature)
    want = np.where(ROW_MASK, reference_jsd(S_LOGITS, T_LOGITS, beta, temperature), 0.0)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    # JSD_beta(P || Q) = JSD_{1-beta}(Q || P): swap teacher and student
    swapped = L.generalized_jsd(
        T_LOGITS, S_LOGITS, ROW_MASK, beta=1 - beta, temperature=temperature
    )
    np.testing.assert_allclose(got, swapped, rtol=1e-4, atol=1e-6)


def test_generalized_jsd_extremes_and_nonfinite_padding():
    assert np.all(L.generalized_jsd(S_LOGITS * 1e4, T_LOGITS * 1e4, ROW_MASK) <= math.log(2) + 1e-6)
    junk = jnp.where(ROW_MASK[:, None], 0.0, jnp.nan)
    for temperature in (1e-8, 1.0, 1e8):
        for beta in (0.0, 0.5, 1.0):

            def loss(s, t, temperature=temperature, beta=beta):
                return jnp.sum(L.generalized_jsd(s + junk, t - junk, ROW_MASK, beta=beta,
                                                 temperature=temperature))  # fmt: skip

            value, (gs, gt) = jax.value_and_grad(loss, argnums=(0, 1))(
                S_LOGITS * 1e4, T_LOGITS * 1e4
            )
            assert np.isfinite(value) and np.all(np.isfinite(gs)) and np.all(np.isfinite(gt))
            assert not np.any(np.asarray(gs)[~np.asarray(ROW_MASK)])


LP = jnp.asarray(-RNG.uniform(0.1, 3.0, (4, 6)), jnp.float32)
OLD = LP + jnp.asarray(RNG.normal(0.0, 0.4, (4, 6)), jnp.float32)
ADV = jnp.asarray([1.3, -0.7, 0.0, 2.0], jnp.float32)
MASK = jnp.asarray(RNG.random((4, 6)) < 0.7).at[0, :3].set(True)


def _per_row(fn, **kw):
    return jax.vmap(lambda lp, old, a, m: fn(lp, old, a, m, **kw)[0])(LP, OLD, ADV, MASK)


def test_token_policy_losses_match_their_papers():
    w = np.exp(np.asarray(LP, np.float64) - np.asarray(OLD, np.float64))
    a = np.asarray(ADV, np.float64)[:, None]
    m = np.asarray(MASK)
    # GRPO / DAPO clip-higher with TRL's delta on the unclipped branch
    lo, hi, delta = 0.2, 0.28, 1.5
    want = -np.minimum(np.minimum(w, delta) * a, np.clip(w, 1 - lo, 1 + hi) * a)
    got = _per_row(L.grpo_policy_loss, clip_eps=lo, clip_eps_high=hi, delta=delta)
    np.testing.assert_allclose(got, np.where(m, want, 0.0), rtol=1e-5, atol=1e-6)
    # CISPO: -sg[clip(w, 1 - lo, 1 + hi)] A log pi
    want = -np.clip(w, 1 - 0.5, 1 + 4.0) * a * np.asarray(LP, np.float64)
    got = _per_row(L.cispo_policy_loss, clip_eps_low=0.5, clip_eps_high=4.0)
    np.testing.assert_allclose(got, np.where(m, want, 0.0), rtol=1e-5, atol=1e-6)
    # SAPO: -(4 / tau) sigma(tau (w - 1)) A, tau by the advantage's sign
    tau = np.where(a > 0, 1.0, 1.05)
    want = -(4 / tau) * sig(tau * (w - 1)) * a
    np.testing.assert_allclose(_per_row(L.sapo_policy_loss), np.where(m, want, 0.0), rtol=1e-5)
    # GMPO (veRL geo_mean): -A exp(mean_t sgn-clipped log w) on every real token
    x = np.log(w)
    sgn = np.sign(a)
    c = sgn * np.minimum(sgn * x, sgn * np.clip(x, -0.4, 0.4))
    mean_c = (c * m).sum(-1, keepdims=True) / np.maximum(m.sum(-1, keepdims=True), 1)
    want = -a * np.exp(mean_c)
    got = _per_row(L.gmpo_policy_loss, clip_eps=0.4)
    np.testing.assert_allclose(got, np.where(m, want, 0.0), rtol=1e-5, atol=1e-6)


def test_gspo_has_the_gradient_of_trl_sequence_ratio():
    """`importance="sequence"` after "seq-mean-token-mean" has TRL's value and gradient:
    the ratio s = exp(mean_t log w_t) differentiated through, clipped per sequence."""
    eps = 0.2

    def ours(lp):
        per_token = jax.vmap(lambda a, b, c, d: L.grpo_policy_loss(
            a, b, c, d, clip_eps=eps, importance="sequence")[0])(lp, OLD, ADV, MASK)  # fmt: skip
        return L.aggregate(per_token, MASK, mode="seq-mean-token-mean")

    def trl(lp):
        n = jnp.maximum(MASK.sum(-1), 1).astype(jnp.float32)
        s = jnp.exp(jnp.sum(jnp.where(MASK, lp - OLD, 0.0), -1) / n)
        per_seq = -jnp.minimum(s * ADV, jnp.clip(s, 1 - eps, 1 + eps) * ADV)
        return jnp.sum(per_seq) / jnp.sum(MASK.any(-1)).astype(jnp.float32)

    np.testing.assert_allclose(ours(LP), trl(LP), rtol=1e-5)
    np.testing.assert_allclose(jax.grad(ours)(LP), jax.grad(trl)(LP), rtol=1e-4, atol=1e-7)


def test_ppo_losses_match_schulman_and_baselines():
    adv = jnp.asarray(RNG.normal(size=(4, 6)), jnp.float32)
    got = jax.vmap(lambda *a: L.ppo_policy_loss(*a, clip_eps=0.2, dual_clip=3.0)[0])(
        LP, OLD, adv, MASK
    )
    w = np.exp(np.asarray(LP, np.float64) - np.asarray(OLD, np.float64))
    a = np.asarray(adv, np.float64)
    want = np.maximum(-a * w, -a * np.clip(w, 0.8, 1.2))
    want = np.where(a < 0, np.minimum(want, -3.0 * a), want)  # dual clip (veRL clip_ratio_c)
    np.testing.assert_allclose(got, np.where(MASK, want, 0.0), rtol=1e-5, atol=1e-6)
    values, old_values, returns = LP, OLD, adv
    got = jax.vmap(lambda *a: L.ppo_value_loss(*a, clip_eps=0.2)[0])(
        values, old_values, returns, MASK
    )
    v, ov, ret = (np.asarray(x, np.float64) for x in (values, old_values, returns))
    want = 0.5 * np.maximum((v - ret) ** 2, (np.clip(v, ov - 0.2, ov + 0.2) - ret) ** 2)
    np.testing.assert_allclose(got, np.where(MASK, want, 0.0), rtol=1e-5, atol=1e-6)


def test_aggregation_modes_and_padding_length():
    x = np.asarray(LP, np.float64)
    m = np.asarray(MASK).copy()
    m[2] = False  # an empty row counts nowhere
    n = m.sum(-1)
    rows = n > 0
    want = {
        "token-mean": (x * m).sum() / n.sum(),
        "seq-mean-token-mean": ((x * m).sum(-1)[rows] / n[rows]).mean(),
        "seq-mean-token-sum": (x * m).sum() / rows.sum(),
        "seq-mean-token-sum-norm": (x * m).sum() / (rows.sum() * 16.0),
    }
    padded_x = jnp.concatenate([LP, jnp.full((4, 3), jnp.nan)], -1)
    padded_m = jnp.concatenate([jnp.asarray(m), jnp.zeros((4, 3), bool)], -1)
    for mode, w in want.items():
        kw = {"constant": 16.0} if mode.endswith("norm") else {}
        got = L.aggregate(LP, jnp.asarray(m), mode=mode, **kw)
        assert float(got) == pytest.approx(w, rel=1e-5), mode
        # appended padding (NaN) changes nothing when the Dr.GRPO constant is fixed
        assert float(L.aggregate(padded_x, padded_m, mode=mode, **kw)) == pytest.approx(w, rel=1e-5)


def test_group_advantages_and_ensemble_match_their_definitions():
    rewards = jnp.asarray(RNG.normal(size=(3, 5)), jnp.float32).at[1].set(0.7)
    r = np.asarray(rewards, np.float64)
    centred = r - r.mean(-1, keepdims=True)
    want = centred / (r.std(-1, ddof=1, keepdims=True) + 1e-4)  # TRL: torch.std + 1e-4
    np.testing.assert_allclose(L.group_advantages(rewards), want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(L.group_advantages(rewards, scale="none"), centred, atol=1e-6)
    loo = r - (r.sum(-1, keepdims=True) - r) / 4
    np.testing.assert_allclose(L.rloo_advantages(rewards), loo, rtol=1e-5, atol=1e-6)
    k = r[0]
    for mode, w in [("mean", k.mean()), ("min", k.min()), ("std", k.mean() - 0.5 * k.std()),
                    ("var", k.mean() - 0.5 * k.var())]:  # fmt: skip
        assert float(L.conservative_reward(rewards[0], penalty=0.5, mode=mode)) == (
            pytest.approx(w, rel=1e-5)
        )
