"""Mistakes a user of the step builders makes, refused by name: a reference model of
another vocabulary (whose gathers would clamp the policy's token ids silently), and a
PPO model that is neither a (policy, value) pair nor returns (logits, values)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import rlhf_eqx as rx
from rlhf_eqx import train as T

V, L, B = 32, 8, 4


def _policy(vocab=V, seed=0):
    cfg = rx.TransformerConfig(
        vocab_size=vocab, d_model=8, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=16, max_seq_len=L
    )
    return rx.Policy(cfg, key=jax.random.key(seed))


def _rows():
    tokens = jax.random.randint(jax.random.key(1), (B, L), 0, V)
    pos = jnp.arange(L)[None]
    mask = pos < jnp.array([[L], [L - 2], [5], [L - 1]])
    return tokens, mask, mask & (pos >= 2)


def _call(step, policy, batch, **kw):
    opt = optax.sgd(0.1)
    return step(opt)(policy, opt.init(eqx.filter(policy, eqx.is_inexact_array)), batch, **kw)


def test_a_reference_of_another_vocabulary_is_refused_by_each_step():
    tokens, mask, completion = _rows()
    small = _policy(vocab=V // 2, seed=1)
    pairs = rx.PreferenceBatch(
        chosen_tokens=tokens,
        chosen_mask=mask,
        chosen_completion_mask=completion,
        rejected_tokens=tokens[::-1],
        rejected_mask=mask[::-1],
        rejected_completion_mask=completion[::-1],
    )
    unpaired = T.KTOBatch(
        tokens=tokens,
        mask=mask,
        completion_mask=completion,
        label=jnp.array([True, False, True, False]),
        kl_tokens=tokens[::-1],
        kl_mask=mask[::-1],
        kl_completion_mask=completion[::-1],
    )
    groups = T.GRPOBatch(
        tokens=tokens, mask=mask, completion_mask=completion, rewards=jnp.arange(B, dtype=float)
    )
    cases = [
        ("make_dpo_step", lambda o: T.make_dpo_step(o), pairs),
        ("make_kto_step", lambda o: T.make_kto_step(o), unpaired),
        ("make_grpo_step", lambda o: T.make_grpo_step(o, group_size=2, beta=0.1), groups),
    ]
    for name, step, batch in cases:
        with pytest.raises(
            ValueError,
            match=rf"^{name}: the reference model's vocab_size=16 differs from the policy's "
            r"vocab_size=32",
        ):
            _call(step, _policy(), batch, reference=small)
    # the same vocabulary trains as before
    _call(cases[0][1], _policy(), pairs, reference=_policy(seed=2))


def test_ppo_names_a_model_that_returns_no_values():
    tokens, mask, completion = _rows()
    per_token = jnp.zeros((B, L))
    batch = T.PPOBatch(
        tokens=tokens,
        mask=mask,
        completion_mask=completion,
        old_logp=per_token,
        old_values=per_token,
        advantages=per_token,
        returns=per_token,
    )
    with pytest.raises(
        ValueError,
        match=r"\(policy, value_model\) pair or one model returning \(logits, values\): "
        r"Policy returned an array of shape \(4, 8, 32\) for tokens of shape \(4, 8\)",
    ):
        _call(lambda o: T.make_ppo_step(o), _policy(), batch)


def test_float16_trainable_weights_are_refused_naming_a_leaf():
    tokens, mask, completion = _rows()
    half = jax.tree.map(
        lambda x: x.astype(jnp.float16) if eqx.is_inexact_array(x) else x, _policy()
    )
    batch = rx.SequenceBatch(tokens=tokens, mask=mask, completion_mask=completion)
    with pytest.raises(
        ValueError,
        match=r"^float16 trainable weights \(params\.transformer\.embed \(shape \(32, 8\)\) and "
        r"\d+ more\)",
    ):
        _call(lambda o: T.make_sft_step(o), half, batch)


def test_a_step_of_a_language_model_names_a_model_that_returns_no_logits():
    tokens, mask, completion = _rows()
    cfg = rx.TransformerConfig(
        vocab_size=V, d_model=8, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=16, max_seq_len=L
    )
    scorer = rx.RewardModel(cfg, key=jax.random.key(0))
    batch = rx.SequenceBatch(tokens=tokens, mask=mask, completion_mask=completion)
    with pytest.raises(
        ValueError,
        match=r"^the policy must return next-token logits \[T, V\] for each sequence: "
        r"RewardModel returned shape \(4,\) for tokens of shape \(4, 8\)",
    ):
        _call(lambda o: T.make_sft_step(o), scorer, batch)
