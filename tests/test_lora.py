"""LoRA adapters: attach, freeze with filter specs, merge, drop (reference model), dropout."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import rlhf_eqx as rx
from rlhf_eqx.models import (
    LORA_TARGETS,
    LoRAConfig,
    apply_lora,
    count_params,
    lora_filter,
    merge_lora,
    without_lora,
)

CFG = rx.TransformerConfig(
    vocab_size=32, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24, max_seq_len=32
)
# `(in, out)` of each adaptable projection of CFG: q/o span the query heads, k/v the
# kv heads, gate/up/down the feed-forward width.
SHAPES = {
    "q": (CFG.d_model, CFG.n_heads * CFG.head_dim),
    "k": (CFG.d_model, CFG.n_kv_heads * CFG.head_dim),
    "v": (CFG.d_model, CFG.n_kv_heads * CFG.head_dim),
    "o": (CFG.n_heads * CFG.head_dim, CFG.d_model),
    "gate": (CFG.d_model, CFG.d_ff),
    "up": (CFG.d_model, CFG.d_ff),
    "down": (CFG.d_ff, CFG.d_model),
}
# One adapter configuration for most tests, so compiled forwards are shared.
LCFG = LoRAConfig(rank=4, alpha=8.0, targets=LORA_TARGETS)
TOKENS = jnp.asarray([1, 5, 9, 2, 30, 7, 7, 11], jnp.int32)
MASK = jnp.asarray([True] * 7 + [False])


@eqx.filter_jit
def _out(model, key=None):
    return model(TOKENS, MASK, key=key)


def _perturb_b(model, key, scale=0.5):
    """Set every adapter's `b` to random values so the adapters matter."""
    lora = model.transformer.layers.lora
    names = sorted(lora)
    keys = dict(zip(names, jax.random.split(key, len(names))))
    new = {
        n: eqx.tree_at(lambda a: a.b, lora[n], scale * jax.random.normal(keys[n], lora[n].b.shape))
        for n in names
    }
    return eqx.tree_at(lambda m: m.transformer.layers.lora, model, new)


def test_config_validation():
    cfg = LoRAConfig()
    assert (cfg.rank, cfg.alpha, cfg.dropout, cfg.targets) == (16, 32.0, 0.05, ("q", "v"))
    assert cfg.scale == 2.0
    assert LoRAConfig(targets="o").targets == ("o",)
    assert LoRAConfig(targets=["q", "up"]).targets == ("q", "up")
    with pytest.raises(
        ValueError,
        match=r"unknown projection.*'wq'.*allowed: \['q', 'k', 'v', 'o', 'gate', 'up', 'down'\]",
    ):
        LoRAConfig(targets=("q", "wq"))
    for bad in (
        dict(rank=0),
        dict(dropout=1.0),
        dict(dropout=-0.1),
        dict(targets=()),
        dict(targets=("q", "q")),
        dict(rank=True),
        dict(alpha=0),
        dict(alpha=-2.0),
        dict(alpha=float("nan")),
        dict(alpha=float("inf")),
    ):
        with pytest.raises(ValueError):
            LoRAConfig(**bad)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rank = 3


@pytest.mark.parametrize("kind", ["policy", "value", "reward", "transformer"])
def test_fresh_adapters_leave_outputs_unchanged(kind, getkey):
    make = {
        "policy": rx.Policy,
        "value": rx.ValueModel,
        "reward": rx.RewardModel,
        "transformer": rx.Transformer,
    }
    model = make[kind](CFG, key=getkey())
    adapted = apply_lora(model, LCFG, key=getkey())
    layers = adapted.layers if kind == "transformer" else adapted.transformer.layers
    assert sorted(layers.lora) == sorted(LORA_TARGETS)
    for name, (fan_in, fan_out) in SHAPES.items():
        ad = layers.lora[name]
        assert ad.a.shape == (CFG.n_layers, fan_in, 4) and ad.b.shape == (CFG.n_layers, 4, fan_out)
        assert ad.scale == 2.0 and ad.dropout == 0.05
        assert not np.any(np.asarray(ad.b))
        a = np.asarray(ad.a)
        assert np.all(np.abs(a) <= 1.0 / np.sqrt(fan_in)) and np.std(a) > 0.2 / np.sqrt(fan_in)
        assert not np.allclose(a[0], a[1])  # layers get different draws
    np.testing.assert_array_equal(np.asarray(_out(adapted)), np.asarray(_out(model)))


@pytest.mark.parametrize(
    "targets, cfg_kw",
    [
        (LORA_TARGETS, {}),
        (("k", "gate", "down"), dict(attn_bias=True, head_dim=6, tie_embeddings=True)),
    ],
)
def test_merge_equals_unmerged(targets, cfg_kw, getkey):
    cfg = rx.TransformerConfig(**{**CFG.__dict__, **cfg_kw})
    base = rx.Policy(cfg, key=getkey())
    lcfg = dataclasses.replace(LCFG, targets=targets)
    model = _perturb_b(apply_lora(base, lcfg, key=getkey()), getkey())
    unmerged = np.asarray(_out(model))
    assert np.max(np.abs(unmerged - np.asarray(_out(base)))) > 1e-3
    merged = merge_lora(model)
    assert merged.transformer.layers.lora is None
    np.testing.assert_allclose(np.asarray(_out(merged)), unmerged, atol=1e-5, rtol=1e-5)
    # Untargeted weights are untouched; targeted column ranges moved.
    wqkv0, wqkv1 = (
        np.asarray(base.transformer.layers.wqkv),
        np.asarray(merged.transformer.layers.wqkv),
    )
    Q, KV = cfg.q_size, cfg.kv_size
    for name, sl in (("q", slice(0, Q)), ("k", slice(Q, Q + KV)), ("v", slice(Q + KV, Q + 2 * KV))):
        changed = not np.array_equal(wqkv0[..., sl], wqkv1[..., sl])
        assert changed == (name in targets), name
    assert merge_lora(base) is base


def test_merge_keeps_bfloat16(getkey):
    cfg = rx.TransformerConfig(**{**CFG.__dict__, "dtype": "bfloat16"})
    model = _perturb_b(apply_lora(rx.Policy(cfg, key=getkey()), LCFG, key=getkey()), getkey())
    merged = merge_lora(model)
    wqkv0 = np.asarray(model.transformer.layers.wqkv, np.float32)
    wqkv1 = merged.transformer.layers.wqkv
    assert wqkv1.dtype == jnp.bfloat16
    q = model.transformer.layers.lora["q"]
    delta = np.einsum("lir,lro->lio", np.asarray(q.a), np.asarray(q.b)) * q.scale
    np.testing.assert_allclose(
        np.asarray(wqkv1, np.float32)[..., : cfg.q_size],
        wqkv0[..., : cfg.q_size] + delta,
        rtol=1e-2,
        atol=1e-2,
    )


def test_optimizer_state_only_for_adapters(getkey):
    lcfg = LoRAConfig(rank=4, targets=("q", "v", "down"))
    model = apply_lora(rx.Policy(CFG, key=getkey()), lcfg, key=getkey())
    trainable, frozen = eqx.partition(model, lora_filter(model))
    opt = optax.adamw(1e-3)
    state = opt.init(eqx.filter(trainable, eqx.is_array))
    expected = CFG.n_layers * sum(4 * (SHAPES[t][0] + SHAPES[t][1]) for t in lcfg.targets)
    assert count_params(model, lora_filter(model)) == expected
    assert count_params(trainable) == expected
    assert count_params(model) == CFG.num_params() + expected
    float_sizes = [
        x.size for x in jax.tree_util.tree_leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)
    ]
    assert sum(float_sizes) == 2 * expected  # mu and nu, nothing for the base
    assert len(float_sizes) == 2 * 2 * len(lcfg.targets)


def _sft_loss(trainable, frozen, key):
    """Negative log-likelihood of TOKENS (LoRA dropout on when `key` is given)."""
    model = eqx.combine(trainable, frozen)
    logits = model(TOKENS, MASK, key=key)
    return -jnp.sum(rx.logprobs_from_logits(logits, TOKENS, MASK))


def test_gradient_and_update_touch_only_adapters(getkey):
    model = apply_lora(rx.Policy(CFG, key=getkey()), LCFG, key=getkey())
    spec = lora_filter(model)
    assert sum(jax.tree_util.tree_leaves(spec)) == 2 * len(LORA_TARGETS)
    trainable, frozen = eqx.partition(model, spec)
    opt = optax.adamw(1e-2)
    state = opt.init(eqx.filter(trainable, eqx.is_array))

    @eqx.filter_jit
    def step(trainable, state, key):
        grads = eqx.filter_grad(_sft_loss)(trainable, frozen, key)
        with jax.numpy_dtype_promotion("standard"):  # optax's bias correction: float ** int32
            updates, state = opt.update(grads, state, trainable)
        return eqx.apply_updates(trainable, updates), state, grads

    new_trainable, state, grads = step(trainable, state, getkey())
    # grads exist only at adapter leaves; at init only `b` gets a gradient (b = 0).
    assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(trainable)
    for name, ad in grads.transformer.layers.lora.items():
        assert np.any(np.asarray(ad.b) != 0), name
        assert not np.any(np.asarray(ad.a))
    new_model = eqx.combine(new_trainable, frozen)
    old_leaves = jax.tree_util.tree_leaves(without_lora(model))
    new_leaves = jax.tree_util.tree_leaves(without_lora(new_model))
    assert all(a is b for a, b in zip(old_leaves, new_leaves))
    for name in LORA_TARGETS:
        assert not np.array_equal(
            np.asarray(new_model.transformer.layers.lora[name].b),
            np.asarray(model.transformer.layers.lora[name].b),
        )
    assert not np.array_equal(np.asarray(_out(new_model)), np.asarray(_out(model)))


def test_dropout_only_with_key(getkey):
    drop = _perturb_b(
        apply_lora(
            rx.Policy(CFG, key=getkey()), dataclasses.replace(LCFG, dropout=0.5), key=getkey()
        ),
        getkey(),
    )
    det = np.asarray(_out(drop))
    np.testing.assert_array_equal(det, np.asarray(_out(drop)))
    # Without a key the adapters act in full: the merged model gives the same logits.
    np.testing.assert_allclose(det, np.asarray(_out(merge_lora(drop))), atol=1e-5, rtol=1e-5)
    k1, k2 = getkey(), getkey()
    s1, s2 = np.asarray(_out(drop, k1)), np.asarray(_out(drop, k2))
    assert np.max(np.abs(s1 - det)) > 1e-3 and np.max(np.abs(s1 - s2)) > 1e-3
    np.testing.assert_array_equal(s1, np.asarray(_out(drop, k1)))  # same key, same mask


def test_without_lora_is_the_base_model(getkey):
    base = rx.Policy(CFG, key=getkey())
    model = _perturb_b(apply_lora(base, LCFG, key=getkey()), getkey())
    ref = without_lora(model)
    assert ref.transformer.layers.lora is None
    assert jax.tree_util.tree_structure(ref) == jax.tree_util.tree_structure(base)
    assert all(
        a is b for a, b in zip(jax.tree_util.tree_leaves(ref), jax.tree_util.tree_leaves(base))
    )
    np.testing.assert_array_equal(np.asarray(_out(ref)), np.asarray(_out(base)))
    assert not np.allclose(np.asarray(_out(model)), np.asarray(_out(base)), atol=1e-3)
    assert without_lora(base) is base


def test_errors(getkey):
    base = rx.Policy(CFG, key=getkey())
    model = apply_lora(base, LoRAConfig(rank=2), key=getkey())
    with pytest.raises(ValueError, match="already has LoRA"):
        apply_lora(model, LoRAConfig(rank=2), key=getkey())
    with pytest.raises(ValueError, match="no LoRA adapters"):
        lora_filter(base)
    with pytest.raises(TypeError, match="Transformer"):
        apply_lora({"w": jnp.ones(3)}, LoRAConfig(), key=getkey())


def test_lora_policy_generates(getkey):
    model = _perturb_b(apply_lora(rx.Policy(CFG, key=getkey()), LCFG, key=getkey()), getkey())
    out = rx.generate(model, TOKENS[:3], MASK[:3], getkey(), max_new_tokens=5, temperature=0.0)
    assert out.tokens.shape == TOKENS.shape
    # Greedy decoding with the KV cache follows the full forward's argmax (adapters included).
    logits = np.asarray(model(out.tokens, jnp.ones_like(MASK)))
    np.testing.assert_array_equal(np.asarray(out.tokens)[3:], np.argmax(logits, axis=-1)[2:-1])


def test_peft_adapter_round_trip(tmp_path, getkey):
    import json

    from safetensors.numpy import load_file

    from rlhf_eqx.models import load_lora_adapter, save_lora_adapter

    cfg = rx.TransformerConfig(
        vocab_size=40, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24
    )
    base = rx.Policy(cfg, key=getkey())
    model = rx.apply_lora(
        base, rx.LoRAConfig(rank=3, alpha=6.0, targets=("q", "o", "down")), key=getkey()
    )
    lora = model.transformer.layers.lora
    model = eqx.tree_at(
        lambda m: [m.transformer.layers.lora[t].b for t in lora],
        model,
        [jax.random.normal(getkey(), lora[t].b.shape) for t in lora],
    )
    save_lora_adapter(model, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 3, 6.0)
    assert config["target_modules"] == ["down_proj", "o_proj", "q_proj"]
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    assert tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"].shape == (
        3,
        16,
    )
    assert tensors["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"].shape == (16, 3)
    loaded = load_lora_adapter(base, tmp_path)
    toks = jnp.array([1, 5, 9, 3, 7], jnp.int32)
    ones = jnp.ones((5,), bool)
    np.testing.assert_allclose(
        eqx.filter_jit(loaded)(toks, ones), eqx.filter_jit(model)(toks, ones), atol=1e-5
    )
    config["use_dora"] = True
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="`use_dora`"):
        load_lora_adapter(base, tmp_path)


def test_lora_filter_trains_a_scalar_head_as_peft_sequence_classifiers_do(getkey):
    """On a reward or value model, `lora_filter` marks the adapters and the scalar
    read-out (PEFT's `SEQ_CLS` keeps its `score` head in `modules_to_save`): a reward step
    moves the fresh head, not only the adapters; `head=False` keeps it frozen; a policy has
    no scalar head to ask for."""
    from test_train_common import preference_batch

    policy = rx.Policy(CFG, key=getkey())
    reward = apply_lora(rx.RewardModel.from_policy(policy, key=getkey()), LCFG, key=getkey())
    spec = lora_filter(reward)
    assert spec.head is True and spec.bias is True
    assert count_params(reward, spec) == count_params(reward, lora_filter(reward, head=False)) + (
        CFG.d_model + 1
    )
    assert lora_filter(reward, head=False).head is False
    value = apply_lora(rx.ValueModel(CFG, key=getkey()), LCFG, key=getkey())
    assert lora_filter(value).head is True
    adapted = apply_lora(policy, LCFG, key=getkey())
    assert count_params(adapted, lora_filter(adapted)) == count_params(
        adapted, lora_filter(adapted, head=False)
    )  # a policy has no scalar head: the default marks the adapters alone
    with pytest.raises(ValueError, match=r"head=True.*Policy has no scalar read-out"):
        lora_filter(apply_lora(policy, LCFG, key=getkey()), head=True)

    opt = optax.sgd(0.5)
    batch = preference_batch(getkey(), B=4, T=10, vocab=CFG.vocab_size)
    step = rx.train.make_reward_step(opt)
    for head, moves in ((None, True), (False, False)):
        state = rx.train.init_train_state(reward, opt, filter_spec=lora_filter(reward, head=head))
        state, _ = state.apply(step, batch)
        new = state.model
        assert (not np.array_equal(np.asarray(new.head), np.asarray(reward.head))) is moves
        assert not np.array_equal(
            np.asarray(new.transformer.layers.lora["q"].b),
            np.asarray(reward.transformer.layers.lora["q"].b),
        )
        assert new.transformer.layers.wqkv is reward.transformer.layers.wqkv  # base frozen
