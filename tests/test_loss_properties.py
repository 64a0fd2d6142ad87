"""Every public loss under property tests: extreme inputs, masks, jit, vmap and float64.

For each per-sequence loss (policy losses, KL, SFT, process reward, distillation) and
each DPO-family `loss_type`, on inputs drawn by `rlhf_eqx.testing` (log-probabilities
down to -1e4 and exact zeros, advantages of ±1e6, all-masked, one-token and holed
masks):

- values and gradients are finite;
- masked positions change neither the value nor the gradient, and get no gradient;
- `jax.jit` equals eager, `jax.vmap` equals a loop over the rows;
- float32 equals float64 up to rounding on ordinary inputs.

Closed forms (DPO at equal log-ratios, its gradient) and the edge cases found by these
properties are pinned by regression tests at the end.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import rlhf_eqx.losses as L
import rlhf_eqx.testing as rt

T = 6
FAST = settings(max_examples=8, deadline=None)
ADVANTAGES = st.sampled_from([-1e6, -1.0, 0.0, 0.5, 1e6]).map(jnp.float32)


# --- per-sequence losses: fn(logp, old_logp, ref_logp, advantage, mask) -----------------
# Module-level functions, so that every hypothesis example reuses one compilation.


def _grpo(lp, old, ref, adv, mask):
    return L.grpo_policy_loss(lp, old, adv, mask, ref_logp=ref, beta=0.04, clip_eps_high=0.28)


def _gspo(lp, old, ref, adv, mask):
    return L.grpo_policy_loss(lp, old, adv, mask, importance="sequence", delta=3.0)


def _ppo(lp, old, ref, adv, mask):
    return L.ppo_policy_loss(lp, old, jnp.full_like(lp, adv), mask, dual_clip=3.0)


def _cispo(lp, old, ref, adv, mask):
    return L.cispo_policy_loss(lp, old, adv, mask, clip_eps_low=0.2)


def _gmpo(lp, old, ref, adv, mask):
    return L.gmpo_policy_loss(lp, old, adv, mask)


def _sapo(lp, old, ref, adv, mask):
    return L.sapo_policy_loss(lp, old, adv, mask)


def _value(lp, old, ref, adv, mask):
    return L.ppo_value_loss(lp, old, ref + adv, mask, clip_eps=0.2)


def _sft(lp, old, ref, adv, mask):
    return L.sft_nll(lp, mask)


def _kl_k3(lp, old, ref, adv, mask):
    return jnp.where(mask, L.kl_penalty(lp, ref, kind="k3"), 0.0)


def _kl_shaped(lp, old, ref, adv, mask):
    return L.kl_shaped_rewards(adv, lp, ref, mask, kl_coef=0.05, kind="k3")


def _reverse_kl(lp, old, ref, adv, mask):
    return L.reverse_kl_reward(lp, ref, mask)


def _prm(lp, old, ref, adv, mask):
    return L.process_reward_loss(lp + adv, mask, jnp.exp(ref))


def _prm_min(lp, old, ref, adv, mask):
    return L.process_sequence_reward(lp, mask, aggregation="min")


def _prm_last(lp, old, ref, adv, mask):
    return L.process_sequence_reward(lp, mask, aggregation="last")


def _importance(lp, old, ref, adv, mask):
    weights, kept = L.importance_weights(lp, old, mask, level="geometric", mode="mask", upper=2.0)
    return weights, kept


def _jsd(lp, old, ref, adv, mask):
    logits = jnp.stack([lp, old, ref], axis=-1)  # [T, 3]
    return L.generalized_jsd(logits, jnp.roll(logits, 1, axis=-1), mask, beta=0.5)


def _forward_kl(lp, old, ref, adv, mask):
    logits = jnp.stack([lp, old, ref], axis=-1)
    return L.generalized_jsd(logits, jnp.roll(logits, 1, axis=-1), mask, beta=0.0)


SEQUENCE_LOSSES = {
    f.__name__[1:]: f
    for f in (
        _grpo,
        _gspo,
        _ppo,
        _cispo,
        _gmpo,
        _sapo,
        _value,
        _sft,
        _kl_k3,
        _kl_shaped,
        _reverse_kl,
        _prm,
        _prm_min,
        _prm_last,
        _importance,
        _jsd,
        _forward_kl,
    )
}


def _leaves(tree):
    return [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(tree)]


def _assert_trees_close(a, b, rtol, atol, what):
    la, lb = _leaves(a), _leaves(b)
    assert len(la) == len(lb), what
    for x, y in zip(la, lb):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=what)


@pytest.mark.parametrize("name", sorted(SEQUENCE_LOSSES))
@FAST
@given(data=rt.logprob_arrays(n=3, length=T), adv=ADVANTAGES)
def test_sequence_loss_finite_and_mask_invariant(name, data, adv):
    fn = SEQUENCE_LOSSES[name]
    lp, old, ref, mask = data
    rt.check_finite(fn, lp, old, ref, adv, mask)
    fixed = jax.tree_util.Partial(lambda a, b, c, m, adv=adv: fn(a, b, c, adv, m))
    rt.check_padding_invariance(fixed, (lp, old, ref), mask)
    rt.check_masked_gradients_zero(fixed, (lp, old, ref), mask)


@pytest.mark.parametrize("name", sorted(SEQUENCE_LOSSES))
@settings(max_examples=4, deadline=None)
@given(data=rt.logprob_arrays(n=3, batch=3, length=T), adv=ADVANTAGES)
def test_sequence_loss_jit_vmap_and_eager_agree(name, data, adv):
    fn = SEQUENCE_LOSSES[name]
    lp, old, ref, mask = data
    advs = jnp.full((3,), adv)
    batched = jax.jit(jax.vmap(fn))(lp, old, ref, advs, mask)
    rows = [fn(lp[i], old[i], ref[i], adv, mask[i]) for i in range(3)]  # eager
    looped = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *rows)
    _assert_trees_close(batched, looped, 1e-5, 1e-5, f"{name}: jit(vmap) vs an eager loop")


@pytest.mark.parametrize("name", sorted(SEQUENCE_LOSSES))
@settings(max_examples=3, deadline=None)
@given(data=rt.logprob_arrays(n=3, length=T, min_value=-8.0), adv=st.floats(-2.0, 2.0, width=32))
def test_sequence_loss_float32_matches_float64(name, data, adv):
    fn = SEQUENCE_LOSSES[name]
    lp, old, ref, mask = data
    # ordinary inputs: the policy near the sampling policy, as in training
    old = lp + 0.05 * jnp.tanh(old)
    single = fn(lp, old, ref, jnp.float32(adv), mask)
    with jax.enable_x64(True):
        f64 = [jnp.asarray(np.asarray(x), jnp.float64) for x in (lp, old, ref)]
        double = fn(*f64, jnp.float64(adv), mask)
        dtypes = {str(x.dtype) for x in jax.tree_util.tree_leaves(double)} - {"bool"}
    # generalized_jsd is computed in float32 by design (documented)
    if name not in ("jsd", "forward_kl"):
        assert dtypes == {"float64"}, f"{name}: float64 inputs give {dtypes}"
    _assert_trees_close(single, double, 2e-5, 2e-5, f"{name}: float32 vs float64")


# --- DPO family --------------------------------------------------------------------------

PAIR_LOSS_TYPES = [t for t in L.DPO_LOSS_TYPES if t not in L.DPO_BATCH_LOSS_TYPES]
BETAS = [1e-8, 0.1, 1e8]


def _dpo_batch(loss_type, beta, pairs):
    return L.dpo_batch_loss(
        pairs.chosen_logp,
        pairs.rejected_logp,
        pairs.ref_chosen_logp,
        pairs.ref_rejected_logp,
        beta=beta,
        loss_type=loss_type,
        chosen_len=pairs.chosen_len,
        rejected_len=pairs.rejected_len,
    )


@pytest.mark.parametrize("loss_type", L.DPO_LOSS_TYPES)
@settings(max_examples=6, deadline=None)
@given(pairs=rt.preference_pairs(batch=3, max_length=16), beta=rt.scales())
def test_dpo_family_finite_at_extremes(loss_type, pairs, beta):
    """Values and gradients (log-probabilities and β) finite for β from 1e-8 to 1e8."""

    def fn(c, r, rc, rr, b):
        fields = dict(chosen_logp=c, rejected_logp=r, ref_chosen_logp=rc, ref_rejected_logp=rr)
        return _dpo_batch(loss_type, b, pairs._replace(**fields))

    rt.check_finite(fn, *pairs[:4], jnp.float32(beta))


@pytest.mark.parametrize("loss_type", PAIR_LOSS_TYPES)
@settings(max_examples=4, deadline=None)
@given(pairs=rt.preference_pairs(batch=3, max_length=16))
def test_dpo_batch_equals_a_loop_of_dpo_loss_and_jit(loss_type, pairs):
    batch = jax.jit(lambda p: _dpo_batch(loss_type, 0.1, p))(pairs)
    looped = jnp.stack(
        [
            L.dpo_loss(
                *(x[i] for x in pairs[:4]),
                beta=0.1,
                loss_type=loss_type,
                chosen_len=pairs.chosen_len[i],
                rejected_len=pairs.rejected_len[i],
            )
            for i in range(3)
        ]
    )
    np.testing.assert_allclose(np.asarray(batch), np.asarray(looped), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("loss_type", L.DPO_LOSS_TYPES)
@settings(max_examples=3, deadline=None)
@given(pairs=rt.preference_pairs(batch=3, min_value=-40.0, max_length=16))
def test_dpo_family_float32_matches_float64(loss_type, pairs):
    single = _dpo_batch(loss_type, 0.1, pairs)
    with jax.enable_x64(True):
        wide = pairs._replace(
            **{
                f: jnp.asarray(np.asarray(getattr(pairs, f)), jnp.float64)
                for f in pairs._fields[:4]
            }
        )
        double = _dpo_batch(loss_type, 0.1, wide)
        assert double.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(single), np.asarray(double), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("loss_type", ["sigmoid", "robust", "sigmoid_norm"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1, 0.4])
@settings(max_examples=5, deadline=None)
@given(
    logp=st.floats(-1e3, 0.0, width=32),
    shift=st.floats(-50.0, 50.0, width=32),
    beta=st.sampled_from([1e-3, 0.1, 2.0]),
)
def test_dpo_at_equal_log_ratios_is_log_2_and_pushes_the_pair_apart(
    loss_type, label_smoothing, logp, shift, beta
):
    """At $u = 0$ every sigmoid-type loss is $\\log 2$ (Rafailov et al. 2023, eq. 7, for any
    label smoothing), and its gradient is $\\mp c$ on the chosen / rejected
    log-probability: $c = \\beta/2$ (eq. 8 at $\\sigma(0) = 1/2$), $\\beta(1-2\\varepsilon)/2$
    for cDPO (Mitchell 2023) and $\\beta / (2(1-2\\varepsilon))$ for rDPO (Chowdhury et al.
    2024, eq. 8; TRL `loss_type="robust"`)."""
    lp = jnp.float32(logp)
    ref = jnp.float32(logp + shift)
    n = jnp.asarray(1)  # per-token averages equal the sums for one token

    def loss(c, r):
        return L.dpo_loss(
            c,
            r,
            ref,
            ref,
            beta=beta,
            loss_type=loss_type,
            label_smoothing=label_smoothing,
            chosen_len=n,
            rejected_len=n,
        )

    value, (gc, gr) = jax.value_and_grad(loss, argnums=(0, 1))(lp, lp)
    assert float(value) == pytest.approx(math.log(2.0), rel=1e-6)
    coef = beta * (1.0 - 2.0 * label_smoothing) / 2.0  # cDPO: the smoothed weights
    if loss_type == "robust":  # rDPO's unbiased loss divides by 1 - 2ε
        coef = beta / (2.0 * (1.0 - 2.0 * label_smoothing))
    assert float(gc) == pytest.approx(-coef, rel=1e-5, abs=1e-12)
    assert float(gr) == pytest.approx(coef, rel=1e-5, abs=1e-12)


# --- other per-example losses -------------------------------------------------------------


@pytest.mark.parametrize("loss_type", L.KTO_LOSS_TYPES)
@pytest.mark.parametrize("beta", BETAS)
@FAST
@given(
    data=rt.logprob_arrays(n=3, length=4, allow_all_masked=False),
    kl=st.sampled_from([0.0, 1.0, 1e4]),
)
def test_kto_finite_at_extremes(loss_type, beta, data, kl):
    logp, ref, kl_logp, label = data
    fn = jax.vmap(
        lambda a, b, lab, k: L.kto_loss(a, b, lab, k, beta=beta, loss_type=loss_type),
        in_axes=(0, 0, 0, None),
    )
    z0 = L.kto_reference_point(kl_logp, ref)
    rt.check_finite(lambda a, b, lab: fn(a, b, lab, z0 + kl), logp, ref, label)


@settings(max_examples=10, deadline=None)
@given(data=rt.logprob_arrays(n=2, length=1))
def test_orpo_and_bradley_terry_finite_at_extremes(data):
    c, r, _ = data
    rt.check_finite(lambda a, b: L.orpo_loss(a[0], b[0], chosen_len=3, rejected_len=1), c, r)
    rt.check_finite(lambda a, b: L.bradley_terry_loss(1e2 * a[0], b[0], center_coef=0.01), c, r)


@pytest.mark.parametrize("scale", L.ADVANTAGE_SCALES)
@pytest.mark.parametrize("eps", [1e-4, 0.0])
@FAST
@given(rewards=rt.reward_groups(n_groups=2, group_size=st.integers(1, 5)))
def test_group_advantages_finite_and_zero_for_constant_groups(scale, eps, rewards):
    adv = rt.check_finite(lambda r: L.group_advantages(r, scale=scale, eps=eps), rewards)
    same = np.all(np.asarray(rewards) == np.asarray(rewards)[:, :1], axis=-1)
    assert np.all(np.asarray(adv)[same] == 0.0)


LOG2 = math.log(2.0)
# Every per-pair loss where the policy equals the reference and the chosen equals the
# rejected completion (h_w = h_l = u = 0), at beta = 0.1, from the formulas of the papers
# cited by `dpo_loss` (and TRL's `DPOTrainer.dpo_loss` branch of the same name).
AT_THE_START = {
    "sigmoid": LOG2,  # -log σ(0)
    "robust": LOG2,  # [(1-ε) log 2 - ε log 2] / (1 - 2ε)
    "sigmoid_norm": LOG2,
    "hinge": 1.0,  # max(0, 1 - 0)
    "ipo": (1.0 / 0.2) ** 2,  # (0 - 1/(2β))²
    "exo_pair": 0.5 * (-LOG2 - math.log(1 - 1e-3)) + 0.5 * (-LOG2 - math.log(1e-3)),
    "nca_pair": 2.0 * LOG2,  # -log σ(0) - ½ log σ(0) - ½ log σ(0)
    "bco_pair": 2.0 * LOG2,  # δ = 0
    "sppo_hard": 2.0 * (0.5 / 0.1) ** 2,  # (0 - 1/(2β))² + (0 + 1/(2β))²
    "apo_zero": 1.0,  # 1 - σ(0) + σ(0)
    "apo_down": 1.0,  # σ(0) + 1 - σ(0)
    "discopop": LOG2 * 0.5 + 0.5,  # -log σ(0)(1 - σ(0)) + e^0 σ(0)
    "simpo": math.log1p(math.exp(0.5)),  # -log σ(-γ), γ = 0.5
    "orpo": 0.1 * LOG2,  # -β log σ(0)
    "aot": LOG2,
    "aot_pair": LOG2,
}


def test_closed_forms_cover_every_loss_type():
    assert set(AT_THE_START) == set(L.DPO_LOSS_TYPES)


@pytest.mark.parametrize("loss_type", sorted(AT_THE_START))
@settings(max_examples=4, deadline=None)
@given(logp=st.floats(-200.0, -0.5, width=32), n=st.integers(1, 9))
def test_dpo_family_closed_form_at_the_start_of_training(loss_type, logp, n):
    lp = jnp.full((2,), logp, jnp.float32)
    length = jnp.full((2,), n)
    out = L.dpo_batch_loss(
        lp, lp, lp, lp, beta=0.1, loss_type=loss_type, chosen_len=length, rejected_len=length
    )
    np.testing.assert_allclose(np.asarray(out), AT_THE_START[loss_type], rtol=2e-6)
