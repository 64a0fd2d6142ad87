"""A user's DPO-family loss through `make_dpo_step`: as a callable `loss_type` or a name
registered with `register_dpo_loss`, it gives the built-in step's loss, gradients and
metrics on plain, shared-prompt packed and cached-reference batches, with traced β; a
loss that declares the completion lengths (R-DPO) gets them, and a hyperparameter without
a default comes from `loss_kwargs`."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_tree_allclose
from hypothesis import given, settings, strategies as st
from test_train_common import CumMeanLM, preference_batch, sgd_delta

import rlhf_eqx as rx
import rlhf_eqx.testing as rt
from rlhf_eqx import data, losses, pipelines as pl, train

V = 29


def user_hinge(chosen, rejected, ref_chosen, ref_rejected, *, beta, margin=1.0):
    """SLiC's hinge, max(0, margin - beta * u), written by a user."""
    u = (chosen - rejected) - (ref_chosen - ref_rejected)
    return jax.nn.relu(margin - beta * u)


def user_ipo(chosen, rejected, ref_chosen, ref_rejected, *, beta):
    """IPO, (u - 1 / (2 beta))^2 on per-token averages (the registry divides by length)."""
    return jnp.square((chosen - rejected) - (ref_chosen - ref_rejected) - 1.0 / (2.0 * beta))


losses.register_dpo_loss("user_ipo", user_ipo, length_normalised=True)


def packed_batch(seed=0, n=5):
    rng = np.random.default_rng(seed)

    def ids(k):
        return tuple(int(t) for t in rng.integers(3, V, k))

    pairs = []
    for _ in range(n):
        prompt = ids(rng.integers(1, 6))
        pairs.append(
            data.TokenizedPair(
                chosen=data.TokenizedSequence(prompt, ids(rng.integers(1, 6))),
                rejected=data.TokenizedSequence(prompt, ids(rng.integers(1, 6))),
            )
        )
    return data.pack_preferences(pairs, pad_id=0, pairs_per_row=2, row_length=24)


def setup(kind, key):
    """(policy, batch, step keywords, call keywords) for one batch layout."""
    k1, k2, k3 = jax.random.split(key, 3)
    if kind == "packed":  # needs a model with the completion-only head: `Policy`
        cfg = rx.TransformerConfig(
            vocab_size=V, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=32
        )
        policy, reference = rx.Policy(cfg, key=k1), rx.Policy(cfg, key=k2)
        return policy, packed_batch(), {"reference": "model"}, {"reference": reference}
    policy, reference = CumMeanLM(k1), CumMeanLM(k2)
    batch = preference_batch(k3)
    if kind == "cached":
        batch = train.compute_reference_logps(reference, batch)
        return policy, batch, {"reference": "cached"}, {}
    return policy, batch, {"reference": "model"}, {"reference": reference}


def run(policy, batch, call_kw, **step_kw):
    step = train.make_dpo_step(optax.sgd(1.0), donate=False, **step_kw)
    return sgd_delta(step, policy, batch, **call_kw)


def assert_same_step(got, want):
    (delta, metrics), (delta_want, metrics_want) = got, want
    assert_tree_allclose(delta, delta_want, rtol=1e-5, atol=1e-7)
    assert set(metrics) == set(metrics_want)
    for name in metrics_want:
        np.testing.assert_allclose(
            float(metrics[name]), float(metrics_want[name]), rtol=1e-5, atol=1e-7, err_msg=name
        )


@pytest.mark.parametrize("kind", ["plain", "packed", "cached"])
@pytest.mark.parametrize("custom, builtin", [(user_hinge, "hinge"), ("user_ipo", "ipo")])
def test_custom_losses_equal_the_builtin_ones(getkey, kind, custom, builtin):
    policy, batch, step_kw, call_kw = setup(kind, getkey())
    want = run(policy, batch, call_kw, beta=0.7, loss_type=builtin, **step_kw)
    assert float(want[1]["loss"]) > 0.0 and "rewards/margins" in want[1]
    assert_same_step(run(policy, batch, call_kw, beta=0.7, loss_type=custom, **step_kw), want)


@settings(deadline=None, max_examples=40)
@given(rt.preference_pairs(batch=st.integers(1, 6)), st.sampled_from([0.01, 0.5, 20.0]))
def test_custom_losses_equal_the_builtin_formulas_at_extremes(pairs, beta):
    """`dpo_batch_loss` with the user's losses equals the built-in ones and the float64
    formulas, for log-probabilities down to -1e4, ties and one-token completions."""
    c, r, rc, rr, lc, lr = (np.asarray(x, np.float64) for x in pairs)
    args = [jnp.asarray(x) for x in pairs[:4]]
    lens = dict(
        chosen_len=jnp.asarray(pairs.chosen_len), rejected_len=jnp.asarray(pairs.rejected_len)
    )
    hinge = losses.dpo_batch_loss(*args, beta=beta, loss_type=user_hinge, **lens)
    ipo = losses.dpo_batch_loss(*args, beta=beta, loss_type="user_ipo", **lens)
    np.testing.assert_array_equal(hinge, losses.dpo_batch_loss(*args, beta=beta, loss_type="hinge"))
    np.testing.assert_array_equal(
        ipo, losses.dpo_batch_loss(*args, beta=beta, loss_type="ipo", **lens)
    )
    # float32 rounding moves u by up to ~`err` (1e-6 of the largest log-probability)
    err = 1e-6 * (1.0 + np.max(np.abs([c, r, rc, rr]), axis=0))
    u = (c - r) - (rc - rr)
    assert np.all(np.abs(hinge - np.maximum(0.0, 1.0 - beta * u)) <= beta * err + 1e-6)
    d = (c / lc - r / lr) - (rc / lc - rr / lr) - 1.0 / (2.0 * beta)
    assert np.all(np.abs(ipo - d**2) <= 2.0 * np.abs(d) * err + err**2 + 1e-5 * d**2 + 1e-6)


def test_custom_loss_hyperparameters_come_from_loss_kwargs(getkey):
    """A margin of 2 shifts the hinge: max(0, 2 - βu) = max(0, 1 - β'u) with β' = β / 2,
    times 2."""
    policy, batch, step_kw, call_kw = setup("cached", getkey())
    delta, m = run(
        policy,
        batch,
        call_kw,
        beta=0.6,
        loss_type=user_hinge,
        loss_kwargs={"margin": 2.0},
        **step_kw,
    )
    half, m_half = run(policy, batch, call_kw, beta=0.3, loss_type="hinge", **step_kw)
    np.testing.assert_allclose(float(m["loss"]), 2.0 * float(m_half["loss"]), rtol=1e-5)
    assert_tree_allclose(delta, jax.tree.map(lambda g: 2.0 * g, half), rtol=1e-5, atol=1e-7)


def test_traced_beta_under_vmap_equals_a_loop(getkey):
    policy, batch, _, _ = setup("cached", getkey())
    betas = jnp.asarray([0.2, 1.5], jnp.float32)

    def one(beta):
        step = train.make_dpo_step(
            optax.sgd(1.0), beta=beta, loss_type=user_hinge, reference="cached", donate=False
        )
        return sgd_delta(step, policy, batch)

    deltas, metrics = jax.vmap(one)(betas)

    @jax.jit  # one compilation for the loop over the built-in loss
    def builtin(beta):
        return run(policy, batch, {}, beta=beta, loss_type="hinge", reference="cached")

    for i, beta in enumerate(betas):
        want, m_want = builtin(beta)
        assert_tree_allclose(jax.tree.map(lambda x: x[i], deltas), want, rtol=1e-5, atol=1e-7)
        for name in ("loss", "rewards/chosen", "rewards/margins", "grad_norm"):
            np.testing.assert_allclose(
                float(metrics[name][i]), float(m_want[name]), rtol=1e-5, atol=1e-6
            )


def test_registered_loss_works_in_dpo_loss_and_the_pipeline_config():
    c, r, rc, rr = (jnp.asarray(x) for x in (-3.0, -5.0, -3.5, -4.0))
    ln = dict(chosen_len=jnp.asarray(4.0), rejected_len=jnp.asarray(6.0))
    got = losses.dpo_loss(c, r, rc, rr, beta=0.4, loss_type="user_ipo", **ln)
    want = losses.dpo_loss(c, r, rc, rr, beta=0.4, loss_type="ipo", **ln)
    u = (-3.0 / 4 - -5.0 / 6) - (-3.5 / 4 - -4.0 / 6)
    np.testing.assert_allclose(float(got), (u - 1 / 0.8) ** 2, rtol=1e-5)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    assert "user_ipo" in losses.dpo_loss_types()
    assert losses.DPO_LOSS_TYPES == losses.dpo_loss_types()[: len(losses.DPO_LOSS_TYPES)]
    pl.config.validate_stage("dpo", pl.DPOConfig(loss_type="user_ipo"))
    with pytest.raises(pl.ConfigError, match="loss_type"):
        pl.config.validate_stage("dpo", pl.DPOConfig(loss_type="user_ipo_typo"))


def test_bad_custom_losses_name_the_argument(getkey):
    policy, batch, _, _ = setup("cached", getkey())

    def two_per_pair(c, r, rc, rr, *, beta):
        return jnp.stack([c - r, rc - rr])

    step = train.make_dpo_step(optax.sgd(1.0), loss_type=two_per_pair, reference="cached")
    with pytest.raises(ValueError, match=r"loss_type=.*two_per_pair.*shape \(\)"):
        sgd_delta(step, policy, batch)
    with pytest.raises(ValueError, match="loss_type=.*cannot be called"):
        train.make_dpo_step(optax.sgd(1.0), loss_type=lambda c, r: c - r)
    with pytest.raises(ValueError, match="loss_type=.*cannot be called.*margin"):
        train.make_dpo_step(optax.sgd(1.0), loss_type=user_ipo, loss_kwargs={"margin": 1.0})
    with pytest.raises((ValueError, TypeError), match="loss_type"):  # TypeCheckError
        train.make_dpo_step(optax.sgd(1.0), loss_type=3)
    with pytest.raises(ValueError, match="unknown loss_type 'user_hing'"):
        train.make_dpo_step(optax.sgd(1.0), loss_type="user_hing")
    with pytest.raises(ValueError, match="label_smoothing"):
        train.make_dpo_step(optax.sgd(1.0), loss_type=user_hinge, label_smoothing=0.1)
    with pytest.raises(TypeError, match="margin"):
        train.make_dpo_step(optax.sgd(1.0), loss_type="hinge", loss_kwargs={"margin": 1.0})
    with pytest.raises(ValueError, match="name 'sigmoid' is a built-in"):
        losses.register_dpo_loss("sigmoid", user_hinge)
    with pytest.raises((ValueError, TypeError), match="fn"):  # TypeCheckError
        losses.register_dpo_loss("not_a_loss", 1.0)
    assert "not_a_loss" not in losses.dpo_loss_types()


def test_reference_free_registered_loss_runs_no_reference(getkey):
    """A `reference_free` loss sees zeros for the reference and needs no model."""

    def margin_only(c, r, rc, rr, *, beta):
        return -jax.nn.log_sigmoid(beta * (c - r)) + 0.0 * (rc + rr)

    losses.register_dpo_loss("user_margin_only", margin_only, reference_free=True)
    policy, batch, _, _ = setup("plain", getkey())
    delta, m = run(policy, batch, {}, beta=0.5, loss_type="user_margin_only")
    want, m_want = run(policy, batch, {}, beta=0.5, loss_type="sigmoid", reference="none")
    assert_tree_allclose(delta, want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(m["loss"]), float(m_want["loss"]), rtol=1e-6)


def user_r_dpo(
    chosen, rejected, ref_chosen, ref_rejected, *, beta, alpha, chosen_len, rejected_len
):
    """R-DPO (Park et al. 2024), -log σ(βu + α(|y_w| - |y_l|)): a hyperparameter without a
    default (`alpha`, from `loss_kwargs`) and the completion lengths, declared by name."""
    u = (chosen - rejected) - (ref_chosen - ref_rejected)
    return -jax.nn.log_sigmoid(beta * u + alpha * (chosen_len - rejected_len))


losses.register_dpo_loss("user_r_dpo", user_r_dpo)


def test_r_dpo_with_lengths_matches_its_closed_form_and_alpha_is_traced(getkey):
    policy, batch, step_kw, _ = setup("cached", getkey())
    seq = lambda t, m, cm: np.asarray(train.sequence_logps(policy, t, m, cm), np.float64)
    c = seq(batch.chosen_tokens, batch.chosen_mask, batch.chosen_completion_mask)
    r = seq(batch.rejected_tokens, batch.rejected_mask, batch.rejected_completion_mask)
    rc, rr = (np.asarray(x, np.float64) for x in (batch.ref_chosen_logp, batch.ref_rejected_logp))
    n_c = np.sum(np.asarray(batch.chosen_completion_mask & batch.chosen_mask), axis=-1)
    n_r = np.sum(np.asarray(batch.rejected_completion_mask & batch.rejected_mask), axis=-1)
    assert np.any(n_c != n_r)
    traces = []

    def counted(c, r, rc, rr, *, beta, alpha, chosen_len, rejected_len):
        traces.append(1)
        lengths = dict(chosen_len=chosen_len, rejected_len=rejected_len)
        return user_r_dpo(c, r, rc, rr, beta=beta, alpha=alpha, **lengths)

    @jax.jit
    def traced(alpha):
        kw = dict(beta=0.7, loss_type=counted, loss_kwargs={"alpha": alpha}, **step_kw)
        return run(policy, batch, {}, **kw)

    counts = []
    for alpha in (0.0, 0.3, -1.2):
        _, m = traced(jnp.asarray(alpha))
        counts.append(len(traces))
        z = 0.7 * ((c - r) - (rc - rr)) + alpha * (n_c - n_r)
        want = np.mean(np.logaddexp(0.0, -z))  # -log σ(z)
        np.testing.assert_allclose(float(m["loss"]), want, rtol=1e-5)
    assert counts[0] >= 1 and counts == [counts[0]] * 3, counts
    # α = 0 is DPO: same loss and update as the built-in `sigmoid`
    kw = dict(beta=0.7, **step_kw)
    got = run(policy, batch, {}, loss_type="user_r_dpo", loss_kwargs={"alpha": 0.0}, **kw)
    assert_same_step(got, run(policy, batch, {}, loss_type="sigmoid", **kw))


def test_a_missing_hyperparameter_or_length_is_named():
    with pytest.raises(ValueError, match="loss_type='user_r_dpo' takes the hyperparameter 'alpha'"):
        train.make_dpo_step(optax.sgd(1.0), loss_type="user_r_dpo")
    # a registered loss is named by its name, not by its function's
    losses.register_dpo_loss("user_length_dpo", user_r_dpo)
    with pytest.raises(ValueError, match="loss_type='user_length_dpo' takes the hyperparameter"):
        train.DPOSettings(loss_type="user_length_dpo")
    with pytest.raises(ValueError, match="loss_type='user_length_dpo' cannot be called as .* 'x'"):
        train.DPOSettings(loss_type="user_length_dpo", loss_kwargs={"alpha": 0.1, "x": 1.0})
    with pytest.raises(ValueError, match="'alpha'"):
        train.DPOSettings(loss_type=user_r_dpo)
    with pytest.raises(ValueError, match="chosen_len"):
        losses.dpo_loss(-1.0, -2.0, -1.0, -2.0, loss_type="user_r_dpo", alpha=0.1)
    with pytest.raises(ValueError, match="completion lengths"):
        train.DPOSettings(loss_type=user_r_dpo, loss_kwargs={"alpha": 0.1, "chosen_len": 3.0})
    c, r, rc, rr = -3.0, -5.0, -3.5, -4.0
    got = losses.dpo_loss(
        c, r, rc, rr, beta=0.4, loss_type="user_r_dpo", chosen_len=4, rejected_len=6, alpha=0.1
    )
    z = 0.4 * ((c - r) - (rc - rr)) + 0.1 * (4 - 6)
    np.testing.assert_allclose(float(got), np.logaddexp(0.0, -z), rtol=1e-6)


def test_check_loss_matches_on_the_dpo_registry():
    rt.check_loss_matches(user_hinge, "hinge")
    rt.check_loss_matches("user_ipo", "ipo")
    rt.check_loss_matches("user_r_dpo", "sigmoid", user_kwargs={"alpha": 0.0}, beta=2.0)
    with pytest.raises(AssertionError, match=r"dpo loss 'user_r_dpo' does not match 'sigmoid'"):
        rt.check_loss_matches("user_r_dpo", "sigmoid", user_kwargs={"alpha": 0.01})
    with pytest.raises(AssertionError, match="user_hinge does not match 'sigmoid': per-pair"):
        rt.check_loss_matches(user_hinge, "sigmoid")
    with pytest.raises(ValueError, match="registry"):
        rt.check_loss_matches(user_hinge, user_hinge)


def test_a_name_registered_again_builds_the_new_loss(getkey):
    """Equal settings share a compiled step: the name's current function is part of what
    the step computes, so registering the name again does not reuse the old build."""
    policy, batch, step_kw, _ = setup("cached", getkey())
    losses.register_dpo_loss("user_again", user_hinge)
    first = run(policy, batch, {}, beta=0.5, loss_type="user_again", **step_kw)
    losses.register_dpo_loss("user_again", user_ipo)
    again = run(policy, batch, {}, beta=0.5, loss_type="user_again", **step_kw)
    assert_same_step(first, run(policy, batch, {}, beta=0.5, loss_type="hinge", **step_kw))
    assert_same_step(again, run(policy, batch, {}, beta=0.5, loss_type=user_ipo, **step_kw))
