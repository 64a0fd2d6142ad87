"""NaN (or inf) at masked positions reaches neither the value nor the gradient of the
losses: the per-token losses that take several per-token inputs, the whitening of
advantages, and a PPO step whose batch carries NaN where its completion mask is false."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import rlhf_eqx as rx
from rlhf_eqx import losses as L
from rlhf_eqx.ops import masked_whiten
from rlhf_eqx.train import GRPOBatch, PPOBatch, make_grpo_step, make_ppo_step

MASK = jnp.array([True, True, True, False, False])
LOGP = jnp.array([-1.0, -2.0, -0.5, 0.0, 0.0])
OLD = jnp.array([-1.2, -1.5, -0.7, 0.0, 0.0])
REF = jnp.array([-1.1, -1.9, -0.4, 0.0, 0.0])
RET = jnp.array([0.1, 0.2, 0.3, 0.0, 0.0])


def _nan_where_masked(x):
    return jnp.where(MASK, x, jnp.nan)


def _value_and_grad(fn, x, *rest):
    return jax.value_and_grad(lambda y: jnp.sum(fn(y, *rest)))(x)


def _same_with_nan_where_masked(fn, x, *rest):
    """`fn(x, *rest)` summed: value and gradient with NaN at the masked positions of
    every argument equal those with zeros there, and the masked gradient is 0."""
    value, grad = _value_and_grad(fn, x, *rest)
    nan_value, nan_grad = _value_and_grad(fn, _nan_where_masked(x), *map(_nan_where_masked, rest))
    np.testing.assert_allclose(float(nan_value), float(value), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(nan_grad), np.asarray(grad), rtol=1e-6, atol=1e-7)
    assert np.all(np.asarray(nan_grad)[~np.asarray(MASK)] == 0.0)


def test_grpo_kl_term_ignores_nan_at_masked_positions():
    def loss(logp, old, ref):
        return L.grpo_policy_loss(logp, old, 1.0, MASK, ref_logp=ref, beta=0.1)[0]

    _same_with_nan_where_masked(loss, LOGP, OLD, REF)


def test_ppo_value_loss_ignores_nan_at_masked_positions():
    for clip_eps in (0.2, None):

        def loss(values, old, returns, clip_eps=clip_eps):
            return L.ppo_value_loss(values, old, returns, MASK, clip_eps=clip_eps)[0]

        _same_with_nan_where_masked(loss, LOGP, OLD, RET)


def test_whitening_ignores_nan_at_masked_positions():
    """A NaN at a masked position used to make the gradient of every real one NaN."""
    _same_with_nan_where_masked(lambda a: L.whiten_advantages(a, MASK) * RET, LOGP)
    _same_with_nan_where_masked(lambda a: masked_whiten(a, MASK, shift_mean=False) * RET, LOGP)


def _plain_clip(logp, old_logp, advantages, mask, *, clip_eps):
    """A user's clipped surrogate, written without any care for masked positions."""
    ratio = jnp.exp(logp - old_logp)
    clipped = jnp.clip(ratio, 1 - clip_eps, 1 + clip_eps)
    return -jnp.minimum(ratio * advantages, clipped * advantages)


L.register_policy_loss("qa_plain_clip", _plain_clip, advantages="token")


def _ppo_updates(fill, **settings):
    """One PPO step on a batch whose per-token fields hold `fill` where the completion
    mask is false: `(params, metrics)`."""
    V, T, B = 16, 6, 2
    cfg = rx.TransformerConfig(
        vocab_size=V, d_model=8, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=16, max_seq_len=T
    )
    params = (rx.Policy(cfg, key=jax.random.key(0)), rx.ValueModel(cfg, key=jax.random.key(1)))
    pos = jnp.arange(T)[None]
    mask = pos < jnp.array([[T], [4]])
    completion = mask & (pos >= 2)
    per_token = jax.random.normal(jax.random.key(2), (B, T)) - 1.0
    masked = lambda x: jnp.where(completion, x, fill)  # noqa: E731
    batch = PPOBatch(
        tokens=jax.random.randint(jax.random.key(3), (B, T), 0, V),
        mask=mask,
        completion_mask=completion,
        old_logp=masked(per_token),
        old_values=masked(per_token),
        advantages=masked(per_token),
        returns=masked(per_token + 0.5),
    )
    opt = optax.sgd(0.1)
    step = make_ppo_step(opt, **settings)
    new, _, metrics = step(params, opt.init(eqx.filter(params, eqx.is_inexact_array)), batch)
    return new, metrics


def test_ppo_step_with_nan_in_masked_fields_updates_as_with_zeros():
    """The built-in loss and a user's per-token loss that multiplies the advantages
    without masking them: NaN in the padding of `old_logp`, `old_values`, `advantages`
    and `returns` changes nothing."""
    for settings in ({}, {"policy_loss": "qa_plain_clip"}):
        clean, m_clean = _ppo_updates(0.0, **settings)
        dirty, m_dirty = _ppo_updates(jnp.nan, **settings)
        assert float(m_dirty["nonfinite"]) == 0.0, settings
        np.testing.assert_allclose(float(m_dirty["loss"]), float(m_clean["loss"]), rtol=1e-6)
        for a, b in zip(jax.tree.leaves(dirty), jax.tree.leaves(clean), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


class _FullLogits(eqx.Module):
    """A policy that returns full logits (no selective LM head), as a user's model does."""

    policy: rx.Policy

    def __call__(self, tokens, mask, key=None):
        return self.policy(tokens, mask)


def test_grpo_step_with_nan_in_masked_reference_logps_updates_as_with_zeros():
    V, T, B = 16, 6, 4
    cfg = rx.TransformerConfig(
        vocab_size=V, d_model=8, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=16, max_seq_len=T
    )
    model = _FullLogits(rx.Policy(cfg, key=jax.random.key(0)))
    pos = jnp.arange(T)[None]
    mask = pos < jnp.array([[T], [4], [5], [T]])
    completion = mask & (pos >= 2)
    per_token = jax.random.normal(jax.random.key(2), (B, T)) - 1.0
    tokens = jax.random.randint(jax.random.key(3), (B, T), 0, V)
    opt = optax.sgd(0.1)
    step = make_grpo_step(opt, group_size=2, beta=0.1)
    opt_state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    out = []
    for fill in (0.0, jnp.nan):
        batch = GRPOBatch(
            tokens=tokens,
            mask=mask,
            completion_mask=completion,
            rewards=jnp.array([1.0, 0.0, 0.5, 2.0]),
            old_logp=jnp.where(completion, per_token, fill),
            ref_logp=jnp.where(completion, per_token - 0.3, fill),
        )
        out.append(step(model, opt_state, batch))
    (clean, _, m_clean), (dirty, _, m_dirty) = out
    assert float(m_dirty["nonfinite"]) == 0.0
    np.testing.assert_allclose(float(m_dirty["loss"]), float(m_clean["loss"]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(dirty), jax.tree.leaves(clean), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
