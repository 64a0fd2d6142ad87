"""A user's per-token policy loss through `make_grpo_step` / `make_ppo_step`: registered by
name with `register_policy_loss` or passed as a callable, a copy of the clipped surrogate
(PPO, Schulman et al. 2017; GRPO, Shao et al. 2024) gives the built-in step's metrics and
update in every aggregation mode, on one row per completion and on shared-prompt rows;
its hyperparameters come from the settings (fields and `loss_kwargs`) and stay traced."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_tree_allclose
from test_train_common import CumMeanLM, CumMeanValue, preference_batch, sgd_delta
from test_train_grpo import _batch, _sampled_groups
from test_train_ppo import _rollout

import rlhf_eqx as rx
import rlhf_eqx.testing as rt
from rlhf_eqx import losses, train
from rlhf_eqx.losses import AGGREGATION_MODES, kl_cov_policy_loss, register_policy_loss


def user_clip(logp, old_logp, advantages, mask, *, clip_eps, clip_eps_high):
    """PPO's clipped surrogate with its clip flags, written by a user: the hyperparameters
    are `GRPOSettings` / `PPOSettings` fields, read by name."""
    high = clip_eps if clip_eps_high is None else clip_eps_high
    ratio = jnp.exp(jnp.clip(jnp.where(mask, logp - old_logp, 0.0), -20.0, 20.0))
    loss = jnp.maximum(-advantages * ratio, -advantages * jnp.clip(ratio, 1 - clip_eps, 1 + high))
    low_flag = (ratio < 1.0 - clip_eps) & (advantages < 0)
    high_flag = (ratio > 1.0 + high) & (advantages > 0)
    flags = dict(clipped_low=low_flag, clipped_high=high_flag, clipped=low_flag | high_flag)
    return loss, {k: v.astype(loss.dtype) for k, v in flags.items()}


def scaled_clip(logp, old_logp, advantages, mask, *, clip_eps, clip_eps_high, coef):
    """`coef` times the clipped surrogate; `coef` has no default (from `loss_kwargs`)."""
    loss, stats = user_clip(
        logp, old_logp, advantages, mask, clip_eps=clip_eps, clip_eps_high=clip_eps_high
    )
    return coef * loss, stats


def user_kl_cov(logp, old_logp, advantages, mask, *, cov_fraction, kl_cov_coef, axis_name):
    """A batch loss (its tokens selected over the micro-batch) with the step's device axis."""
    return kl_cov_policy_loss(
        logp, old_logp, advantages, mask, fraction=cov_fraction, kl_coef=kl_cov_coef,
        axis_name=axis_name,
    )  # fmt: skip


def user_high_entropy(logp, old_logp, advantages, mask, *, entropy, entropy_rho, axis_name):
    """The clipped loss on the top-`entropy_rho` tokens by entropy (Wang et al. 2025)."""
    return losses.high_entropy_policy_loss(
        logp, old_logp, advantages, mask, entropy, rho=entropy_rho, axis_name=axis_name
    )


def user_clip_cov(logp, old_logp, advantages, mask, *, cov_fraction, key):
    """Clip-Cov's random selection (Cui et al. 2025) with the key the step derives."""
    return losses.clip_cov_policy_loss(
        logp, old_logp, advantages, mask, fraction=cov_fraction, cov_low=-1e3, cov_high=1e3,
        key=key,
    )  # fmt: skip


register_policy_loss("user_clip", user_clip)
register_policy_loss("user_high_entropy", user_high_entropy, batch=True)
register_policy_loss("user_clip_cov", user_clip_cov, batch=True)
register_policy_loss("user_kl_cov", user_kl_cov, batch=True, advantages="sequence")


def _same_step(got, want, rtol=1e-5, atol=1e-6):
    (delta, metrics), (delta_want, metrics_want) = got, want
    assert set(metrics) == set(metrics_want)
    for name in metrics_want:
        np.testing.assert_allclose(
            float(metrics[name]), float(metrics_want[name]), rtol=rtol, atol=atol, err_msg=name
        )
    assert_tree_allclose(delta, delta_want, rtol=rtol, atol=atol)


def _mode_kw(mode):
    return dict(mode=mode, constant=12.0 if mode == "seq-mean-token-sum-norm" else None)


@pytest.mark.parametrize("custom", ["user_clip", user_clip])
@pytest.mark.parametrize(
    "mode",
    [
        m if m == "token-mean" else pytest.param(m, marks=pytest.mark.slow)
        for m in AGGREGATION_MODES
    ],
)
def test_user_clip_equals_grpo_in_every_mode(getkey, mode, custom):
    policy, ref = CumMeanLM(getkey()), CumMeanLM(getkey())
    batch = _batch(getkey(), policy, B=8, ref=ref)
    kw = dict(group_size=2, clip_eps_high=0.28, beta=0.05, donate=False, **_mode_kw(mode))
    want = sgd_delta(train.make_grpo_step(optax.sgd(1.0), **kw), policy, batch)
    got = sgd_delta(train.make_grpo_step(optax.sgd(1.0), policy_loss=custom, **kw), policy, batch)
    assert float(want[1]["clip_ratio/high_mean"]) > 0.0 and float(want[1]["kl"]) > 0.0
    _same_step(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum-norm"])
def test_user_clip_equals_grpo_on_shared_prompt_rows(getkey, mode):
    """Each group's prompt once (`prompt_length`), the LM head on the completions only."""
    cfg = rx.TransformerConfig(
        vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=64
    )
    policy = rx.Policy(cfg, key=getkey())
    out, rewards = _sampled_groups(getkey(), policy)
    old = jax.vmap(lambda t, m: rx.token_logprobs(policy, t, m))(out.tokens, out.mask)
    batch = train.GRPOBatch(
        tokens=out.tokens,
        mask=out.mask,
        completion_mask=out.completion_mask,
        rewards=rewards,
        old_logp=old + 0.3 * jax.random.normal(getkey(), old.shape),
        prompt_length=6,
        samples_per_prompt=2,
    )
    kw = dict(group_size=2, micro_batches=3, donate=False, **_mode_kw(mode))
    want = sgd_delta(train.make_grpo_step(optax.sgd(1.0), **kw), policy, batch)
    got = sgd_delta(
        train.make_grpo_step(optax.sgd(1.0), policy_loss="user_clip", **kw), policy, batch
    )
    assert float(want[1]["clip_ratio"]) > 0.0
    _same_step(got, want, rtol=1e-5, atol=1e-6)


def test_user_clip_equals_ppo_with_token_advantages(getkey):
    params = (CumMeanLM(getkey()), CumMeanValue(getkey()))
    batch = _rollout(getkey(), params, CumMeanLM(getkey()))
    kw = dict(clip_eps_high=0.28, mode="seq-mean-token-mean", donate=False)
    want = sgd_delta(train.make_ppo_step(optax.sgd(1.0), **kw), params, batch)
    got = sgd_delta(
        train.make_ppo_step(optax.sgd(1.0), policy_loss="user_clip", **kw), params, batch
    )
    assert float(want[1]["policy/clipfrac"]) > 0.0
    _same_step(got, want)


def test_registered_batch_loss_equals_kl_cov_over_micro_batches(getkey):
    policy = CumMeanLM(getkey())
    batch = _batch(getkey(), policy, B=8)
    kw = dict(group_size=2, cov_fraction=0.2, kl_cov_coef=0.5, micro_batches=2, donate=False)
    want = sgd_delta(
        train.make_grpo_step(optax.sgd(1.0), policy_loss="kl_cov", **kw), policy, batch
    )
    got = sgd_delta(
        train.make_grpo_step(optax.sgd(1.0), policy_loss="user_kl_cov", **kw), policy, batch
    )
    assert 0.0 < float(want[1]["selected_frac"]) < 1.0
    _same_step(got, want)


@pytest.mark.slow
def test_a_loss_that_takes_ref_logp_gets_the_reference_models(getkey):
    """The clipped loss plus its own k3 KL (from `ref_logp`, computed by the step's
    `reference=` model) equals the built-in loss with `beta` (the step's KL term)."""
    policy, ref = CumMeanLM(getkey()), CumMeanLM(getkey())
    batch = _batch(getkey(), policy, B=4)

    def clip_and_kl(logp, old_logp, advantages, mask, *, clip_eps, clip_eps_high, ref_logp, coef):
        loss, stats = user_clip(
            logp, old_logp, advantages, mask, clip_eps=clip_eps, clip_eps_high=clip_eps_high
        )
        return loss + coef * losses.kl_penalty(logp, ref_logp, kind="k3"), stats

    kw = dict(group_size=2, mode="token-mean", donate=False)
    want = sgd_delta(
        train.make_grpo_step(optax.sgd(1.0), beta=0.05, **kw), policy, batch, reference=ref
    )
    step = train.make_grpo_step(
        optax.sgd(1.0), policy_loss=clip_and_kl, loss_kwargs={"coef": 0.05}, **kw
    )
    got = sgd_delta(step, policy, batch, reference=ref)
    assert float(want[1]["kl"]) > 0.0
    _same_step(got, want)
    with pytest.raises(ValueError, match="takes ref_logp"):
        sgd_delta(step, policy, batch)
    with pytest.raises(ValueError, match="takes ref_logp: the PPO step"):
        train.PPOSettings(policy_loss=clip_and_kl, loss_kwargs={"coef": 0.05})


def test_a_name_registered_again_builds_the_new_loss(getkey):
    policy = CumMeanLM(getkey())
    batch = _batch(getkey(), policy, B=4)
    kw = dict(group_size=2, policy_loss="user_again", loss_kwargs={"coef": 2.0}, donate=False)
    register_policy_loss("user_again", scaled_clip)
    first = sgd_delta(train.make_grpo_step(optax.sgd(1.0), **kw), policy, batch)
    register_policy_loss(
        "user_again",
        lambda lp, olp, a, m, *, clip_eps, clip_eps_high, coef: scaled_clip(
            lp, olp, a, m, clip_eps=clip_eps, clip_eps_high=clip_eps_high, coef=-coef
        ),
    )
    again = sgd_delta(train.make_grpo_step(optax.sgd(1.0), **kw), policy, batch)
    np.testing.assert_allclose(float(again[1]["loss"]), -float(first[1]["loss"]), rtol=1e-6)
    assert float(first[1]["loss"]) != 0.0


def test_hyperparameters_are_traced_and_a_change_does_not_recompile(getkey):
    """`coef` from `loss_kwargs` and `clip_eps` from the settings, both traced: the step
    is traced once for every value, and `coef` scales the loss and the update."""
    policy = CumMeanLM(getkey())
    batch = _batch(getkey(), policy, B=4)
    traces = []

    def counted(logp, old_logp, advantages, mask, *, clip_eps, clip_eps_high, coef):
        traces.append(1)
        kw = dict(clip_eps=clip_eps, clip_eps_high=clip_eps_high, coef=coef)
        return scaled_clip(logp, old_logp, advantages, mask, **kw)

    @jax.jit
    def run(coef, clip_eps):
        step = train.make_grpo_step(
            optax.sgd(1.0), group_size=2, clip_eps=clip_eps, policy_loss=counted,
            loss_kwargs={"coef": coef}, donate=False,
        )  # fmt: skip
        return sgd_delta(step, policy, batch)

    base = sgd_delta(
        train.make_grpo_step(optax.sgd(1.0), group_size=2, donate=False), policy, batch
    )
    counts = []
    for coef in (1.0, 2.5, -0.5):
        delta, m = run(jnp.asarray(coef), jnp.asarray(0.2))
        counts.append(len(traces))
        np.testing.assert_allclose(float(m["loss"]), coef * float(base[1]["loss"]), rtol=1e-5)
        want = jax.tree.map(lambda g: coef * g, base[0])
        assert_tree_allclose(delta, want, rtol=1e-4, atol=1e-6)  # float32 rounding
    assert counts[0] >= 1 and counts == [counts[0]] * 3, counts


def test_bad_policy_losses_name_the_argument():
    def no_default(logp, old_logp, advantages, mask, *, alpha):
        return -alpha * advantages * logp

    with pytest.raises(ValueError, match="hyperparameter 'alpha', which has no default"):
        train.GRPOSettings(group_size=2, policy_loss=no_default)
    train.GRPOSettings(group_size=2, policy_loss=no_default, loss_kwargs={"alpha": 0.5})
    cases = [
        (dict(policy_loss=no_default, loss_kwargs={"beta_": 1.0}), "loss_kwargs 'beta_'"),
        (dict(policy_loss="user_clip", loss_kwargs={"clip_eps": 0.1}), "field of GRPOSettings"),
        (dict(policy_loss="user_clip", loss_kwargs={"entropy": 0.1}), "step input"),
        (dict(policy_loss=lambda lp, m: lp), "cannot be called"),
        (dict(policy_loss="user_clipp"), "policy_loss='user_clipp': must be one of grpo"),
        (dict(policy_loss="ppo"), r"policy_loss='ppo': must be one of .*\('ppo' is for PPO\)"),
        (dict(policy_loss="user_clip", delta=2.0), "delta=2.0: applies to policy_loss 'grpo'"),
    ]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            train.GRPOSettings(group_size=2, **kw)
    with pytest.raises(ValueError, match=r"policy_loss='user_kl_cov': must be one of ppo"):
        train.PPOSettings(policy_loss="user_kl_cov")
    with pytest.raises(ValueError, match="dual_clip=3.0: applies to policy_loss 'ppo' only"):
        train.PPOSettings(policy_loss="user_clip", dual_clip=3.0)
    with pytest.raises(ValueError, match="name 'grpo' is a built-in"):
        register_policy_loss("grpo", user_clip)
    with pytest.raises(ValueError, match="advantages"):
        register_policy_loss("user_other", user_clip, advantages="row")


def test_names_and_the_pipeline_config():
    assert losses.policy_loss_names()[: len(losses.POLICY_LOSSES)] == losses.POLICY_LOSSES
    assert {"user_clip", "user_kl_cov", "ppo"} <= set(losses.policy_loss_names())
    assert "user_kl_cov" not in losses.policy_loss_names("token")
    assert losses.policy_loss_names("token")[0] == "ppo" == train.PPOSettings().policy_loss
    pl = rx.pipelines
    pl.config.validate_stage("grpo", pl.GRPOConfig(policy_loss="user_clip"))
    with pytest.raises(pl.ConfigError, match="policy_loss"):
        pl.config.validate_stage("grpo", pl.GRPOConfig(policy_loss="user_clip_typo"))


def test_check_loss_matches_accepts_copies_and_names_a_difference():
    rt.check_loss_matches(
        user_clip, "grpo", settings=train.GRPOSettings(group_size=2, clip_eps_high=0.28)
    )
    rt.check_loss_matches("user_clip", "ppo", settings=train.PPOSettings())
    rt.check_loss_matches("user_kl_cov", "kl_cov")
    # step inputs: the entropies, and the same key for both (Clip-Cov's random tokens)
    rt.check_loss_matches("user_high_entropy", "high_entropy")
    cov = train.GRPOSettings(group_size=2, cov_fraction=0.3, clip_cov_low=-1e3, clip_cov_high=1e3)
    rt.check_loss_matches("user_clip_cov", "clip_cov", settings=cov)
    top = dataclasses.replace(cov, clip_cov_select="top")  # the library's tokens: the top ones
    with pytest.raises(AssertionError, match="does not match 'clip_cov'"):
        rt.check_loss_matches("user_clip_cov", "clip_cov", settings=top)
    rt.check_loss_matches(scaled_clip, "grpo", user_kwargs={"coef": 1.0})
    with pytest.raises(
        AssertionError, match=r"policy loss scaled_clip does not match 'grpo': per-token losses"
    ):
        rt.check_loss_matches(scaled_clip, "grpo", user_kwargs={"coef": 1.001})
    with pytest.raises(AssertionError, match="does not match 'cispo'"):
        rt.check_loss_matches("user_clip", "cispo")

    def no_gradient(logp, old_logp, advantages, mask, *, clip_eps, clip_eps_high):
        logp = jax.lax.stop_gradient(logp)
        return user_clip(logp, old_logp, advantages, mask, clip_eps=clip_eps, clip_eps_high=None)

    with pytest.raises(AssertionError, match="gradients w.r.t. logp"):
        rt.check_loss_matches(no_gradient, "grpo")


def test_a_wrong_output_is_named_per_completion(getkey):
    """A per-completion loss's output is checked for one completion's shapes: a scalar
    (a loss already aggregated), three outputs, a statistic of the completion."""
    policy = CumMeanLM(getkey())
    batch = _batch(getkey(), policy, B=4)
    T = batch.tokens.shape[1]

    def summed(logp, old_logp, advantages, mask):
        return -jnp.sum(jnp.where(mask, advantages * logp, 0.0))

    def three(logp, old_logp, advantages, mask):
        return -advantages * logp, {}, 0.0

    def row_stat(logp, old_logp, advantages, mask):
        return -advantages * logp, {"clipped": jnp.mean(logp)}

    cases = [
        (summed, rf"shape \({T},\) per completion \(as logp\), got shape \(\) and dtype float"),
        (three, r"must return the per-token loss or \(loss, stats dict\)"),
        (row_stat, rf"stats 'clipped' must be per-token, of shape \({T},\) per completion"),
    ]
    for fn, match in cases:
        step = train.make_grpo_step(optax.sgd(1.0), group_size=2, policy_loss=fn, donate=False)
        with pytest.raises(ValueError, match=match):
            sgd_delta(step, policy, batch)


register_policy_loss("scaled_clip", scaled_clip)


@dataclasses.dataclass(frozen=True)
class ScaledSettings(train.GRPOSettings):
    """A user's GRPO settings with a field for their loss's `coef`."""

    group_size: int = 2
    policy_loss: str = "scaled_clip"
    coef: float = 2.5


def test_a_settings_subclass_field_reaches_the_loss(getkey):
    """A field of a `GRPOSettings` subclass named like a hyperparameter of its loss is
    passed to the loss (as if in `loss_kwargs`), not dropped with the subclass: the step
    with `ScaledSettings(coef=2.5)` is the one with `loss_kwargs={"coef": 2.5}`; the same
    value given both ways is accepted, another refused."""
    policy = CumMeanLM(getkey())
    batch = _batch(getkey(), policy, B=4)
    kw = dict(group_size=2, policy_loss="scaled_clip", donate=False)
    want = sgd_delta(
        train.make_grpo_step(optax.sgd(1.0), loss_kwargs={"coef": 2.5}, **kw), policy, batch
    )
    got = sgd_delta(
        train.make_grpo_step(optax.sgd(1.0), ScaledSettings(), donate=False), policy, batch
    )
    _same_step(got, want)
    half = sgd_delta(
        train.make_grpo_step(optax.sgd(1.0), ScaledSettings(coef=1.25), donate=False), policy, batch
    )
    np.testing.assert_allclose(float(half[1]["loss"]), float(want[1]["loss"]) / 2, rtol=1e-5)
    with pytest.raises(ValueError, match="coef=2.5 .* and loss_kwargs 'coef'=1.0: give"):
        ScaledSettings(loss_kwargs={"coef": 1.0})
    assert ScaledSettings(loss_kwargs={"coef": 2.5}).coef == 2.5
    # a field the loss does not take stays the subclass's own
    assert train.GRPOSettings(group_size=2, policy_loss="user_clip").loss_kwargs is None


def margin_pair_loss(chosen, rejected, ref_chosen, ref_rejected, *, beta, margin):
    return jnp.maximum(0.0, margin - beta * ((chosen - ref_chosen) - (rejected - ref_rejected)))


losses.register_dpo_loss("margin_pair", margin_pair_loss)


@dataclasses.dataclass(frozen=True)
class MarginSettings(train.DPOSettings):
    loss_type: str = "margin_pair"
    margin: float = 1.0


def test_a_dpo_settings_subclass_field_reaches_the_loss(getkey):
    """The same for a DPO-family loss: `margin` (no default in the loss) comes from the
    subclass's field, and the step is the one with `loss_kwargs={"margin": 0.5}`."""
    assert losses.dpo_loss_hyperparameters("margin_pair") == ("margin",)
    assert losses.dpo_loss_hyperparameters("sigmoid") == (
        "bco_delta",
        "discopop_tau",
        "simpo_gamma",
    )
    policy, reference = CumMeanLM(getkey()), CumMeanLM(getkey())
    batch = preference_batch(getkey())

    def run(settings=None, **kw):
        step = train.make_dpo_step(optax.sgd(1.0), settings, donate=False, **kw)
        return sgd_delta(step, policy, batch, reference=reference)

    want = run(loss_type="margin_pair", loss_kwargs={"margin": 0.5})
    _same_step(run(MarginSettings(margin=0.5)), want)
    assert float(want[1]["loss"]) != float(run(MarginSettings(margin=2.0))[1]["loss"])
    with pytest.raises(ValueError, match="margin=0.5 .* and loss_kwargs 'margin'=2: give"):
        MarginSettings(margin=0.5, loss_kwargs={"margin": 2})
    assert MarginSettings(margin=2, loss_kwargs={"margin": 2}).margin == 2
    with pytest.raises(ValueError, match="has no default"):
        train.DPOSettings(loss_type="margin_pair")
