"""Fast paths equal the reference computations: completion-only LM head (DPO, GRPO and PPO
steps, entropies, temperature), the joint chosen/rejected forward, blockwise attention and NF4
weights."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_tree_allclose, assert_updates_agree
from hypothesis import given, settings, strategies as st

import rlhf_eqx as rx
from rlhf_eqx import train


def tiny_cfg(**kw):
    base = dict(
        vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=128
    )
    base.update(kw)
    return rx.TransformerConfig(**base)


def random_rows(key, B, T, V):
    """Random tokens; masks with left, right and middle padding; a random selection."""
    k1, k2, k3 = jax.random.split(key, 3)
    tokens = jax.random.randint(k1, (B, T), 0, V)
    mask = jax.random.bernoulli(k2, 0.8, (B, T))
    mask = mask.at[:, 1].set(True).at[0, :].set(True)
    select = jax.random.bernoulli(k3, 0.6, (B, T))
    return tokens, mask, select


def reference_selected(policy, tokens, mask, select):
    logits = policy(tokens, mask)
    logp = jax.vmap(rx.logprobs_from_logits)(logits, tokens, mask)
    prev, has_prev = jax.vmap(rx.previous_real_index)(mask)
    keep = select & mask & has_prev
    mean = jnp.take_along_axis(jnp.mean(logits, axis=-1), prev, axis=-1)
    return jnp.where(keep, logp, 0.0), jnp.where(keep, mean, 0.0)


@pytest.mark.parametrize("chunk", [1, 7, 512])
@pytest.mark.parametrize("kw", [{}, dict(tie_embeddings=True, final_softcap=5.0)])
def test_selected_logprobs_equals_full_head(getkey, chunk, kw):
    policy = rx.Policy(tiny_cfg(**kw), key=getkey())
    tokens, mask, select = random_rows(getkey(), 3, 19, 61)
    want = reference_selected(policy, tokens, mask, select)
    got = policy.selected_logprobs(tokens, mask, select, chunk=chunk)
    assert_tree_allclose(got, want, rtol=1e-5, atol=1e-5)
    jitted = eqx.filter_jit(lambda p, *a: p.selected_logprobs(*a, chunk=chunk))(
        policy, tokens, mask, select
    )
    assert_tree_allclose(jitted, want, rtol=1e-5, atol=1e-5)
    one = policy.selected_logprobs(tokens[1], mask[1], select[1], chunk=chunk)
    assert_tree_allclose(one, (want[0][1], want[1][1]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 2])  # 32 chunks (a scan), 16 (unrolled)
def test_selected_logprobs_gradient_and_skipped_chunks(getkey, chunk):
    policy = rx.Policy(tiny_cfg(), key=getkey())
    tokens, mask, _ = random_rows(getkey(), 2, 16, 61)
    select = jnp.zeros_like(mask).at[:, 10:13].set(True)  # few positions: most chunks skipped

    def fast(p):
        return jnp.sum(p.selected_logprobs(tokens, mask, select, chunk=chunk)[0])

    def slow(p):
        return jnp.sum(reference_selected(p, tokens, mask, select)[0])

    gf = eqx.filter_grad(fast)(policy)
    gs = eqx.filter_grad(slow)(policy)
    assert_tree_allclose(gf, gs, rtol=1e-4, atol=1e-6)
    assert float(fast(policy)) == pytest.approx(float(slow(policy)), rel=1e-5)


def test_selected_logprobs_keeps_no_stacked_chunk_logits(getkey):
    """Up to 16 head chunks are unrolled: the backward pass reads each chunk's logits
    from its own buffer, never from a stacked `[n_chunks, chunk, V]` one (which XLA
    zero-fills and writes first)."""
    policy = rx.Policy(tiny_cfg(), key=getkey())
    tokens, mask, select = random_rows(getkey(), 3, 19, 61)  # 57 positions
    grad = lambda chunk: jax.make_jaxpr(
        jax.grad(lambda p: jnp.sum(p.selected_logprobs(tokens, mask, select, chunk=chunk)[0]))
    )(policy)
    assert "f32[9,7,61]" not in str(grad(7))  # 9 chunks: unrolled
    assert "f32[57,1,61]" in str(grad(1))  # 57 chunks: scanned, logits stacked


def test_selected_logprobs_padding_invariance(getkey):
    policy = rx.Policy(tiny_cfg(), key=getkey())
    tokens = jax.random.randint(getkey(), (1, 12), 0, 61)
    mask = jnp.ones((1, 12), bool)
    select = jnp.arange(12)[None] >= 5
    base = policy.selected_logprobs(tokens, mask, select, chunk=4)[0]
    padded_tokens = jnp.concatenate(
        [jnp.zeros((1, 3), tokens.dtype), tokens, jnp.zeros((1, 2), tokens.dtype)], 1
    )
    padded_mask = jnp.concatenate([jnp.zeros((1, 3), bool), mask, jnp.zeros((1, 2), bool)], 1)
    padded_select = jnp.concatenate([jnp.zeros((1, 3), bool), select, jnp.ones((1, 2), bool)], 1)
    got = policy.selected_logprobs(padded_tokens, padded_mask, padded_select, chunk=4)[0]
    np.testing.assert_allclose(got[:, 3:15], base, rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(got[:, :3])) and not np.any(np.asarray(got[:, 15:]))


def test_selected_logprobs_rejects_bad_chunk(getkey):
    policy = rx.Policy(tiny_cfg(), key=getkey())
    tokens = jnp.zeros((1, 4), jnp.int32)
    mask = jnp.ones((1, 4), bool)
    with pytest.raises(ValueError, match="chunk"):
        policy.selected_logprobs(tokens, mask, mask, chunk=0)


class _Plain(eqx.Module):
    """A per-sample model that is not a `Policy`: the step takes the full-logits path."""

    policy: rx.Policy

    def __call__(self, tokens, mask):
        return self.policy(tokens, mask)


def _pref_batch(key, B, T, V):
    tokens, mask, _ = random_rows(key, 2 * B, T, V)
    cm = jnp.arange(T)[None, :] >= T // 3
    cm = jnp.broadcast_to(cm, mask.shape)
    return rx.PreferenceBatch(
        chosen_tokens=tokens[:B],
        chosen_mask=mask[:B],
        chosen_completion_mask=cm[:B],
        rejected_tokens=tokens[B:],
        rejected_mask=mask[B:],
        rejected_completion_mask=cm[B:],
    )


@pytest.mark.parametrize("reference", ["model", "cached"])
def test_dpo_step_fast_path_equals_full_logits_path(getkey, reference):
    policy = rx.Policy(tiny_cfg(), key=getkey())
    ref = rx.Policy(tiny_cfg(), key=getkey())
    batch = _pref_batch(getkey(), 3, 17, 61)
    opt = optax.sgd(1.0)  # the update is minus the gradient (Adam would amplify rounding)
    step = train.make_dpo_step(opt, reference=reference, rpo_alpha=0.5)
    if reference == "cached":
        fast_batch = train.compute_reference_logps(ref, batch)
        slow_batch = train.compute_reference_logps(_Plain(ref), batch)
        assert_tree_allclose(
            (fast_batch.ref_chosen_logp, fast_batch.ref_rejected_logp),
            (slow_batch.ref_chosen_logp, slow_batch.ref_rejected_logp),
            rtol=1e-5,
            atol=1e-5,
        )
    else:
        fast_batch = slow_batch = batch
    state = opt.init(eqx.filter(policy, eqx.is_inexact_array))
    p_fast, _, m_fast = step(policy, state, fast_batch, reference=ref)
    plain = _Plain(policy)
    plain_state = opt.init(eqx.filter(plain, eqx.is_inexact_array))
    p_slow, _, m_slow = step(plain, plain_state, slow_batch, reference=_Plain(ref))
    assert_tree_allclose(m_fast, m_slow, rtol=1e-4, atol=1e-5)
    # the gradients (minus the updates), each leaf within 1e-4 of its largest entry
    assert_updates_agree(p_fast, p_slow.policy, policy)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_selected_entropy_and_temperature_equal_full_logits(getkey, temperature):
    policy = rx.Policy(tiny_cfg(), key=getkey())
    tokens, mask, select = random_rows(getkey(), 3, 19, 61)
    logp, mean, ent = policy.selected_logprobs(
        tokens, mask, select, chunk=7, temperature=temperature, with_entropy=True
    )
    logits = policy(tokens, mask)
    want_logp = jax.vmap(
        lambda lg, t, m: rx.logprobs_from_logits(lg, t, m, temperature=temperature)
    )(logits, tokens, mask)
    want_ent = jax.vmap(lambda lg, m: rx.entropy_from_logits(lg, m, temperature=temperature))(
        logits, mask
    )
    _, has_prev = jax.vmap(rx.previous_real_index)(mask)
    keep = select & mask & has_prev
    np.testing.assert_allclose(logp, jnp.where(keep, want_logp, 0.0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent, jnp.where(keep, want_ent, 0.0), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(ent)[~np.asarray(keep)] == 0.0) and np.all(
        np.asarray(ent)[np.asarray(keep)] > 0.0
    )
    # the entropy is a metric: no gradient flows through it
    g = jax.grad(
        lambda p: jnp.sum(p.selected_logprobs(tokens, mask, select, with_entropy=True)[2])
    )(policy)
    assert all(
        float(jnp.max(jnp.abs(x))) == 0.0
        for x in jax.tree.leaves(eqx.filter(g, eqx.is_inexact_array))
    )
    with pytest.raises(ValueError, match="temperature"):
        policy.selected_logprobs(tokens, mask, select, temperature=0.0)


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(beta=0.1, temperature=0.8, micro_batches=2),
        dict(importance="sequence", mode="token-mean"),
    ],
)
def test_grpo_step_fast_path_equals_full_logits_path(getkey, kw):
    """The completion-only chunked head (with its entropy) gives the GRPO step the same
    loss, metrics and update as full logits, with and without a reference model."""
    policy = rx.Policy(tiny_cfg(), key=getkey())
    ref = rx.Policy(tiny_cfg(), key=getkey())
    B, T, G = 4, 15, 2
    tokens, mask, _ = random_rows(getkey(), B, T, 61)
    cm = jnp.broadcast_to(jnp.arange(T)[None, :] >= 5, mask.shape)
    old = jax.vmap(lambda t, m: rx.token_logprobs(policy, t, m))(tokens, mask)
    old = old + 0.3 * jax.random.normal(getkey(), old.shape)
    batch = train.GRPOBatch(
        tokens=tokens,
        mask=mask,
        completion_mask=cm,
        rewards=jnp.asarray([1.0, 0.0, 0.5, 2.0]),
        old_logp=old,
    )
    opt = optax.sgd(1.0)  # the update is minus the gradient (Adam would amplify rounding)
    step = train.make_grpo_step(opt, group_size=G, **kw)
    state = opt.init(eqx.filter(policy, eqx.is_inexact_array))
    p_fast, _, m_fast = step(policy, state, batch, reference=ref)
    plain = _Plain(policy)
    p_slow, _, m_slow = step(
        plain, opt.init(eqx.filter(plain, eqx.is_inexact_array)), batch, reference=_Plain(ref)
    )
    assert float(m_fast["entropy"]) > 0.0
    assert_tree_allclose(m_fast, m_slow, rtol=1e-4, atol=1e-5)
    assert_tree_allclose(p_fast, p_slow.policy, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "kw", [dict(), dict(temperature=0.7, micro_batches=2), dict(ent_coef=0.01)]
)
def test_ppo_step_fast_path_equals_full_logits_path(getkey, kw):
    """A `(Policy, ValueModel)` pair scores only the completion tokens (entropy in the same
    chunks) unless the entropy bonus needs its gradient; either way the step equals the
    full-logits one."""
    policy = rx.Policy(tiny_cfg(), key=getkey())
    critic = rx.ValueModel(tiny_cfg(), key=getkey())
    tokens, mask, _ = random_rows(getkey(), 4, 13, 61)
    cm = jnp.broadcast_to(jnp.arange(13)[None, :] >= 4, mask.shape)
    T = kw.get("temperature", 1.0)
    batch, _ = train.prepare_ppo_batch(
        (policy, critic),
        policy,
        tokens,
        mask,
        cm,
        jnp.asarray([1.0, -1.0, 0.5, 2.0]),
        kl_coef=0.05,
        temperature=T,
    )
    noise = 0.3 * jax.random.normal(getkey(), batch.old_logp.shape)
    batch = eqx.tree_at(
        lambda b: b.old_logp, batch, jnp.where(batch.completion_mask, batch.old_logp + noise, 0.0)
    )
    opt = optax.sgd(1.0)
    step = train.make_ppo_step(opt, vf_coef=0.5, donate=False, **kw)
    fast = (policy, critic)
    slow = (_Plain(policy), critic)
    p_fast, _, m_fast = step(fast, opt.init(eqx.filter(fast, eqx.is_inexact_array)), batch)
    p_slow, _, m_slow = step(slow, opt.init(eqx.filter(slow, eqx.is_inexact_array)), batch)
    assert float(m_fast["policy/entropy"]) > 0.0
    assert_tree_allclose(m_fast, m_slow, rtol=1e-4, atol=1e-5)
    assert_tree_allclose(
        (p_fast[0], p_fast[1]), (p_slow[0].policy, p_slow[1]), rtol=1e-4, atol=1e-6
    )


NF4_TABLE = np.array(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    np.float32,
)


def reference_nf4(w, block):
    """Reference blockwise NF4 round trip in numpy: nearest level by brute force."""
    flat = np.asarray(w, np.float32).reshape(-1)
    n = flat.size
    flat = np.concatenate([flat, np.zeros((-n) % block, np.float32)]).reshape(-1, block)
    absmax = np.abs(flat).max(axis=1)
    x = flat / np.where(absmax > 0, absmax, 1.0)[:, None]
    idx = np.argmin(np.abs(x[..., None] - NF4_TABLE), axis=-1)
    return (NF4_TABLE[idx] * absmax[:, None]).reshape(-1)[:n].reshape(w.shape)


@pytest.mark.parametrize("shape,block", [((32, 48), 64), ((7, 9), 4), ((5, 3), 64)])
def test_nf4_weight_matches_reference_dequantisation(getkey, shape, block):
    w = jax.random.normal(getkey(), shape) * 0.02
    w = w.at[0, :].set(0.0)  # an all-zero stretch
    q = rx.models.quantize_weight_nf4(w, block_size=block)
    assert q.shape == shape
    assert q.codes.dtype == jnp.uint8
    np.testing.assert_allclose(
        q.dequantize(jnp.float32), reference_nf4(np.asarray(w), block), rtol=1e-6, atol=1e-9
    )


def test_nf4_rejects_bad_block_size():
    with pytest.raises(ValueError, match="block_size"):
        rx.models.quantize_weight_nf4(jnp.zeros((4, 4)), block_size=3)


def test_nf4_model_memory_forward_and_lora(getkey):
    cfg = tiny_cfg(d_model=64, d_ff=128)
    policy = rx.Policy(cfg, key=getkey())
    q = rx.models.quantize_nf4(policy)
    layers = q.transformer.layers
    assert isinstance(layers.wqkv, rx.models.NF4Weight)
    fields = ("wqkv", "wo", "w_gate_up", "w_down")
    dense_bytes = sum(getattr(policy.transformer.layers, f).nbytes for f in fields)
    nf4_bytes = sum(
        getattr(layers, f).codes.nbytes + getattr(layers, f).absmax.nbytes for f in fields
    )
    assert nf4_bytes / dense_bytes <= 0.16
    tokens = jax.random.randint(getkey(), (2, 9), 0, 61)
    mask = jnp.ones((2, 9), bool)
    dense = rx.models.dequantize(q)
    assert_tree_allclose(q(tokens, mask), dense(tokens, mask), rtol=1e-5, atol=1e-5)
    # dequantised within reach of the float weights
    err = jnp.max(jnp.abs(dense.transformer.layers.wqkv - policy.transformer.layers.wqkv))
    assert float(err) <= float(jnp.max(jnp.abs(policy.transformer.layers.wqkv))) * 0.2
    # LoRA on the NF4 base: only adapters get gradients; the step runs
    lora = rx.apply_lora(q, rx.LoRAConfig(rank=4), key=getkey())
    params, frozen = eqx.partition(lora, rx.lora_filter(lora))

    def loss(p):
        m = eqx.combine(p, frozen)
        return jnp.mean(m(tokens, mask) ** 2)

    g = eqx.filter_grad(loss)(params)
    assert np.isfinite(float(sum(jnp.sum(x) for x in jax.tree.leaves(g))))
    assert jax.tree.leaves(eqx.filter(params, eqx.is_inexact_array))
    with pytest.raises(TypeError, match="quantised base"):
        rx.merge_lora(lora)


@pytest.mark.parametrize("T,block", [(13, 4), (16, 8), (9, 9)])
def test_blockwise_attention_equals_dense(getkey, T, block):
    attention, attention_layout = rx.models.attention, rx.models.attention_layout
    B, H, K, hd = 2, 4, 2, 8
    q = jax.random.normal(getkey(), (B, T, H, hd))
    k = jax.random.normal(getkey(), (B, K, T, hd))
    v = jax.random.normal(getkey(), (B, K, T, hd))
    mask = jax.random.bernoulli(getkey(), 0.8, (B, T)).at[:, 0].set(True)
    seg = jnp.concatenate(
        [jnp.zeros((B, T // 2), jnp.int32), jnp.ones((B, T - T // 2), jnp.int32)], 1
    )
    allowed, _ = attention_layout(mask, seg)
    dense = attention(q, k, v, allowed, cap=30.0)
    fast = attention(q, k, v, allowed, cap=30.0, causal_block=block)
    rows = jnp.any(allowed, axis=-1)[..., None, None]
    np.testing.assert_allclose(
        jnp.where(rows, fast, 0.0), jnp.where(rows, dense, 0.0), rtol=1e-5, atol=1e-5
    )

    def loss(fn_block, q, k, v):
        out = attention(q, k, v, allowed, causal_block=fn_block)
        return jnp.sum(jnp.where(rows, out, 0.0) ** 2)

    g_dense = jax.grad(lambda *a: loss(None, *a), argnums=(0, 1, 2))(q, k, v)
    g_fast = jax.jit(jax.grad(lambda *a: loss(block, *a), argnums=(0, 1, 2)))(q, k, v)
    assert_tree_allclose(g_fast, g_dense, rtol=1e-4, atol=1e-5)


def test_long_sequence_forward_uses_blocks_and_matches_short_prefix(getkey):
    """A sequence longer than the attention block gives, on its first positions, the
    hidden states of its prefix alone (causality holds across blocks)."""
    cfg = tiny_cfg(max_seq_len=1024)
    policy = rx.Policy(cfg, key=getkey())
    T = rx.models.ATTENTION_BLOCK + 40
    tokens = jax.random.randint(getkey(), (1, T), 0, 61)
    mask = jnp.ones((1, T), bool)
    full = eqx.filter_jit(lambda p, t, m: p(t, m))(policy, tokens, mask)
    n = rx.models.ATTENTION_BLOCK - 10
    prefix = policy(tokens[:, :n], mask[:, :n])
    np.testing.assert_allclose(full[:, :n], prefix, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_num_samples_prefills_once_and_equals_repeated_prompts(getkey, temperature):
    policy = rx.Policy(tiny_cfg(), key=getkey())
    prompts = jax.random.randint(getkey(), (2, 5), 3, 61)
    masks = jnp.ones((2, 5), bool).at[1, :2].set(False)
    key = getkey()
    opts = dict(max_new_tokens=6, temperature=temperature, eos_id=2)
    grouped = rx.generate_batch(policy, prompts, masks, key, num_samples=3, **opts)
    repeated = rx.generate_batch(
        policy, jnp.repeat(prompts, 3, 0), jnp.repeat(masks, 3, 0), key, **opts
    )
    assert grouped.tokens.shape == (6, 11)
    for a, b in zip(jax.tree.leaves(grouped), jax.tree.leaves(repeated)):
        np.testing.assert_array_equal(
            a, b
        ) if a.dtype != jnp.float32 else np.testing.assert_allclose(a, b, atol=1e-6)


def test_num_samples_is_validated(getkey):
    policy = rx.Policy(tiny_cfg(), key=getkey())
    prompt = jnp.ones((3,), jnp.int32)
    with pytest.raises(ValueError, match="num_samples"):
        rx.generate_batch(
            policy, prompt[None], prompt[None] > 0, getkey(), max_new_tokens=2, num_samples=0
        )
    with pytest.raises(ValueError, match="num_samples"):
        rx.generate(policy, prompt, prompt > 0, getkey(), max_new_tokens=2, num_samples=2)


def _flat_inverse_cdf(key, logits):
    probs = jnp.exp(logits - jnp.max(logits))
    cdf = jnp.cumsum(probs)
    u = jax.random.uniform(key, (), jnp.float32) * cdf[-1]
    return jnp.minimum(jnp.searchsorted(cdf, u, side="right"), logits.shape[0] - 1)


@pytest.mark.parametrize("V", [1, 2, 5, 61, 300])
def test_sampled_token_equals_flat_inverse_cdf_search(getkey, V):
    """`sample_token` at temperature 1 (no top-k / top-p) searches the CDF in two levels;
    it draws the token a flat search of the whole CDF would, from the same key."""
    logits = jax.random.normal(getkey(), (V,)) * 3.0
    if V > 2:
        logits = logits.at[::3].set(-jnp.inf)  # filtered tokens: never drawn
    keys = jax.random.split(getkey(), 2000)
    fast, _ = jax.vmap(rx.sample_token, in_axes=(0, None))(keys, logits)
    flat = jax.vmap(_flat_inverse_cdf, in_axes=(0, None))(keys, logits)
    assert np.mean(np.asarray(fast) == np.asarray(flat)) >= 0.999
    assert np.all(np.isfinite(np.asarray(logits)[np.asarray(fast)]))
    if V > 2:
        p = np.asarray(jax.nn.softmax(logits))
        freq = np.bincount(np.asarray(fast), minlength=V) / fast.shape[0]
        assert np.max(np.abs(freq - p)) < 0.05


def test_reward_step_one_pass_equals_separate_scores(getkey):
    model = rx.RewardModel(tiny_cfg(), key=getkey())
    batch = _pref_batch(getkey(), 3, 11, 61)
    opt = train.make_optimizer(learning_rate=1e-3, total_steps=10)
    step = train.make_reward_step(opt)
    _, _, metrics = step(model, opt.init(eqx.filter(model, eqx.is_inexact_array)), batch)
    rc = model(batch.chosen_tokens, batch.chosen_mask)
    rr = model(batch.rejected_tokens, batch.rejected_mask)
    loss = jnp.mean(-jax.nn.log_sigmoid(rc - rr))
    assert float(metrics["loss"]) == pytest.approx(float(loss), rel=1e-5)
    assert float(metrics["margin"]) == pytest.approx(float(jnp.mean(rc - rr)), rel=1e-4, abs=1e-6)


HIDDEN_AT_CONFIGS = {
    "llama": dict(),
    "one_layer": dict(n_layers=1),
    "remat": dict(remat=True),
    "gemma3_like": dict(
        n_layers=3,
        norm_plus_one=True,
        mlp_activation="gelu_tanh",
        embed_scale=True,
        post_norms=True,
        qk_norm=True,
        attn_softcap=20.0,
        sliding_window=4,
        window_layers=(True, True, False),
        rope_local_theta=100.0,
    ),
    "mistral_like": dict(sliding_window=3, attn_bias=True),
}


@pytest.mark.parametrize("name", sorted(HIDDEN_AT_CONFIGS))
@pytest.mark.parametrize("layout", ["padded", "branches", "regions"])
def test_hidden_at_equals_full_forward_gathered(getkey, name, layout):
    """`Transformer.hidden_at` runs the last layer only at the read-out positions: the
    hidden states there and the gradients of anything read from them equal the full
    forward's, on padded rows, shared-prefix branches and fixed regions."""
    model = rx.Transformer(tiny_cfg(**HIDDEN_AT_CONFIGS[name]), key=getkey())
    B, T = 3, 12
    tokens, mask, _ = random_rows(getkey(), B, T, 61)
    kw = {}
    if layout != "padded":
        branch = jnp.asarray([0] * 4 + [1] * 4 + [2] * 4)
        kw = dict(
            segment_ids=jnp.zeros((B, T), jnp.int32), branch_ids=jnp.broadcast_to(branch, (B, T))
        )
        if layout == "regions":
            kw["regions"] = (4, 4, 4)
    at = jnp.asarray([[11, 3, 7], [0, 0, 5], [6, 11, 2]], jnp.int32)
    cot = jax.random.normal(getkey(), (B, 3, 32))

    def full(m):
        return jnp.take_along_axis(m(tokens, mask, **kw), at[..., None], axis=1)

    fast = lambda m: m.hidden_at(tokens, mask, at, **kw)
    assert_tree_allclose(fast(model), full(model), rtol=1e-5, atol=1e-5)
    # gradients compiled (eager, the many small ops of a scan's backward take ~10x longer)
    grad = lambda f: eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(f(m) * cot)))(model)
    assert_tree_allclose(grad(fast), grad(full), rtol=1e-4, atol=2e-5)
    jitted = eqx.filter_jit(fast)(model)
    assert_tree_allclose(jitted, full(model), rtol=1e-5, atol=1e-5)
    if layout == "padded":  # one sequence, no batch axis
        one = model.hidden_at(tokens[2], mask[2], at[2])
        assert_tree_allclose(one, full(model)[2], rtol=1e-5, atol=1e-5)


def test_reward_model_reads_the_last_layer_at_its_read_out_only(getkey):
    """`RewardModel` (plain rows and packed branches) scores with `hidden_at`: the same
    rewards as the full forward read at each last real token, with the last layer's
    MLP run on one position per sequence (its jaxpr holds no `[B, T, d_ff]` product there)."""
    model = rx.RewardModel(tiny_cfg(), key=getkey())
    tokens, mask, _ = random_rows(getkey(), 4, 10, 61)
    h = model.transformer(tokens, mask)
    last = jnp.max(jnp.where(mask, jnp.arange(10)[None], 0), axis=-1)
    want = h[jnp.arange(4), last] @ model.head + model.bias
    np.testing.assert_allclose(model(tokens, mask), want, rtol=1e-5, atol=1e-6)
    jaxpr = str(jax.make_jaxpr(lambda m: m(tokens, mask))(model))
    assert "f32[4,1,96]" in jaxpr  # the last layer's gate/up product on one position per row


# --- compiled programs carry no per-sequence-length constants ----------------------------


def _largest_constant(lowered) -> int:
    """Elements of the largest constant in a lowered program's StableHLO text."""
    largest = 0
    for line in lowered.as_text().splitlines():
        if "stablehlo.constant" not in line:
            continue
        dims = line.rsplit("tensor<", 1)[-1].split(">")[0].split("x")[:-1]
        largest = max(largest, int(np.prod([int(d) for d in dims])) if dims else 1)
    return largest


def test_steps_embed_no_sequence_sized_constants(getkey):
    """Masks are built from iotas inside the program: a `[T, T]` numpy constant would be
    embedded in every compiled step (2.4 MB of a DPO step's 2.9 MB program at 8 × 448,
    25 MB at T = 2048), slowing its lowering, compiling and cache loads."""
    T, V = 160, 61
    policy = rx.Policy(tiny_cfg(max_seq_len=2 * T), key=getkey())
    opt = train.make_optimizer(learning_rate=1e-3, total_steps=10)
    state = opt.init(eqx.filter(policy, eqx.is_inexact_array))
    plain = _pref_batch(getkey(), 2, T, V)
    toks = lambda n: tuple(int(t) for t in np.asarray(jax.random.randint(getkey(), (n,), 1, V)))
    pairs = [
        rx.data.TokenizedPair(
            rx.data.TokenizedSequence(toks(40), toks(60)),
            rx.data.TokenizedSequence(toks(40), toks(55)),
        )
        for _ in range(2)
    ]
    dpo = train.make_dpo_step(opt, reference="model")
    dpo_jit = eqx.filter_jit(lambda p, o, b: dpo(p, o, b, reference=p))
    batches = {
        "dpo": plain,
        "dpo packed": rx.data.pack_preferences(pairs, pad_id=0),
        "dpo aligned": rx.data.pack_preferences(pairs, pad_id=0, aligned=True),
    }
    lowered = {name: dpo_jit.lower(policy, state, b) for name, b in batches.items()}
    rm = rx.RewardModel.from_policy(policy, key=getkey())
    rm_step = train.make_reward_step(opt)
    rm_state = opt.init(eqx.filter(rm, eqx.is_inexact_array))
    lowered["reward"] = eqx.filter_jit(lambda p, o, b: rm_step(p, o, b)).lower(rm, rm_state, plain)
    B, P, N = 2, 8, T
    out = rx.generate_batch(
        policy,
        jnp.ones((B, P), jnp.int32),
        jnp.ones((B, P), bool),
        getkey(),
        max_new_tokens=N,
        num_samples=2,
    )
    grpo = train.GRPOBatch(
        tokens=out.tokens,
        mask=out.mask,
        completion_mask=out.completion_mask,
        rewards=jnp.arange(2 * B, dtype=jnp.float32),
        old_logp=out.logprobs,
        prompt_length=P,
        samples_per_prompt=2,
    )
    grpo_step = train.make_grpo_step(opt, group_size=2)
    lowered["grpo"] = eqx.filter_jit(lambda p, o, b: grpo_step(p, o, b)).lower(policy, state, grpo)
    lowered["generate"] = jax.jit(
        lambda p, t, m, k: rx.generate_batch(p, t, m, k, max_new_tokens=N).tokens
    ).lower(policy, jnp.ones((B, P), jnp.int32), jnp.ones((B, P), bool), getkey())
    sizes = {name: _largest_constant(low) for name, low in lowered.items()}
    assert all(size < 4 * T for size in sizes.values()), sizes


# --- the gated MLP activation keeps two arrays for its backward pass -------------------


@pytest.mark.parametrize("kind", ["silu", "gelu_tanh", "gelu"])
@settings(max_examples=12, deadline=None)
@given(
    values=st.lists(
        st.one_of(
            st.floats(-1e4, 1e4, width=32),
            st.sampled_from([0.0, -0.0, 1e-30, -88.0, 88.0, 3e38, -3e38]),
        ),
        min_size=6,
        max_size=6,
    ),
    seed=st.integers(0, 2**31 - 1),
)
def test_gated_activation_equals_the_written_out_product(kind, values, seed):
    """`gated_activation` (closed-form backward from the saved slope) has the values
    and, up to float rounding, the gradients of autodiff through `activation(gate) ·
    up`, extreme and signed-zero inputs included; under jit and vmap too."""
    activation, gated_activation = rx.models.activation, rx.models.gated_activation
    gate = jnp.asarray(values, jnp.float32).reshape(2, 3)
    up = jax.random.normal(jax.random.key(seed), (2, 3)) * 10.0
    cot = jax.random.normal(jax.random.key(seed + 1), (2, 3))
    ref = lambda g, u: activation(g, kind) * u
    np.testing.assert_array_equal(gated_activation(gate, up, kind), ref(gate, up))
    loss = lambda f: lambda g, u: jnp.sum(f(g, u) * cot)
    got = jax.jit(jax.grad(loss(lambda g, u: gated_activation(g, u, kind)), argnums=(0, 1)))(
        gate, up
    )
    want = jax.jit(jax.grad(loss(ref), argnums=(0, 1)))(gate, up)
    for a, b in zip(got, want):
        # at |gate| ~ 3e38 autodiff of the written-out SiLU multiplies inf by 0 (NaN)
        # where the slope taken in the forward pass is 1: compare where autodiff is finite
        ok = np.isfinite(b)
        np.testing.assert_allclose(a[ok], b[ok], rtol=2e-6, atol=1e-30)
    rows = jax.vmap(jax.grad(lambda g, u, c: jnp.sum(gated_activation(g, u, kind) * c)))(
        gate, up, cot
    )
    # eager against jitted: float32 rounding of a differently fused tanh
    ok = np.isfinite(want[0])
    np.testing.assert_allclose(rows[ok], want[0][ok], rtol=1e-5, atol=1e-6)


def test_gated_activation_rejects_mismatched_halves():
    """Named by the shape check (on by default) or, with checks off, by its own error."""
    gated_activation = rx.models.gated_activation
    with pytest.raises((ValueError, TypeError), match=r"'up'|up \(2, 4\)"):
        gated_activation(jnp.ones((2, 3)), jnp.ones((2, 4)), "silu")


def test_block_keeps_four_d_ff_arrays_for_its_backward_pass(getkey, capsys):
    """A decoder block's backward pass keeps up, the gate's activation and slope, and
    their product (`[T, d_ff]` each), not gate and the activation's intermediates as
    well (six arrays when differentiated as written); the memory estimate counts four."""
    from jax.ad_checkpoint import print_saved_residuals

    cfg = tiny_cfg()
    policy = rx.Policy(cfg, key=getkey())
    tokens, mask, _ = random_rows(getkey(), 2, 12, cfg.vocab_size)
    capsys.readouterr()
    print_saved_residuals(lambda p: jnp.sum(p(tokens, mask) ** 2), policy)
    shapes = [line.split(" ", 1)[0] for line in capsys.readouterr().out.splitlines()]
    # the layer scan stacks each saved array over the layers: one line per kind of array
    wide = [s for s in shapes if s.endswith(f",{cfg.d_ff}]")]
    assert len(wide) == 4 and all(s.startswith(f"f32[{cfg.n_layers},") for s in wide), shapes


def _rms_norm_autodiff(x, w, eps, plus_one):
    """RMSNorm as written out (what autodiff differentiates)."""
    x32 = x.astype(jnp.float32)
    n = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    w = w.reshape((1,) * (x.ndim - 1) + w.shape)
    if plus_one:
        return (n * (1.0 + w.astype(jnp.float32))).astype(x.dtype)
    return n.astype(x.dtype) * w.astype(x.dtype)


@pytest.mark.parametrize("plus_one", [False, True])
@settings(max_examples=12, deadline=None)
@given(
    scale=st.sampled_from([0.0, 1e-20, 1e-3, 1.0, 1e3, 1e15]),
    seed=st.integers(0, 2**31 - 1),
)
def test_rms_norm_backward_equals_autodiff(plus_one, scale, seed):
    """`rms_norm`'s written-out backward pass (it keeps `x` and `1/rms` only) gives
    autodiff's gradients for `x` and the weight, and the float64 closed form's at every
    scale: rows of zeros (where `eps` decides) and rows of 1e15, where autodiff's
    `rsqrt(·)³` underflows in float32 and the written-out pass does not; jitted and
    under vmap."""
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k1, (3, 4, 16)) * scale
    w = jax.random.normal(k2, (16,))
    cot = jax.random.normal(k3, (3, 4, 16))
    eps = 1e-6
    np.testing.assert_array_equal(
        rx.models.rms_norm(x, w, eps, plus_one=plus_one), _rms_norm_autodiff(x, w, eps, plus_one)
    )
    loss = lambda f: lambda x, w: jnp.sum(f(x, w) * cot)
    ours = jax.jit(
        jax.grad(
            loss(lambda x, w: rx.models.rms_norm(x, w, eps, plus_one=plus_one)), argnums=(0, 1)
        )
    )(x, w)
    # float64 closed form
    x64, w64, c64 = (np.asarray(a, np.float64) for a in (x, w, cot))
    r = 1.0 / np.sqrt(np.mean(x64**2, axis=-1, keepdims=True) + eps)
    n = x64 * r
    g = c64 * ((1.0 + w64) if plus_one else w64)
    exact = (r * (g - n * np.mean(g * n, axis=-1, keepdims=True)), np.sum(c64 * n, axis=(0, 1)))
    close = lambda a, b, rtol: np.testing.assert_allclose(
        a, b, rtol=rtol, atol=rtol * float(np.max(np.abs(b)) + 1e-300)
    )
    for a, b in zip(ours, exact):
        close(np.asarray(a, np.float64), b, 1e-4)
    if scale <= 1e3:
        want = jax.jit(
            jax.grad(loss(lambda x, w: _rms_norm_autodiff(x, w, eps, plus_one)), argnums=(0, 1))
        )(x, w)
        for a, b in zip(ours, want):
            close(np.asarray(a), np.asarray(b), 2e-5)
    rows = jax.vmap(
        jax.grad(lambda x, c: jnp.sum(rx.models.rms_norm(x, w, eps, plus_one=plus_one) * c))
    )(x, cot)
    close(np.asarray(rows, np.float64), exact[0], 1e-4)


def test_rms_norm_backward_in_bfloat16_is_float32_accurate():
    """bfloat16 inputs: gradients in the inputs' dtypes, within bfloat16 rounding of the
    float32 computation (the backward pass accumulates in float32)."""
    x = jax.random.normal(jax.random.key(0), (6, 32)) * 3
    w = jax.random.normal(jax.random.key(1), (32,))
    cot = jax.random.normal(jax.random.key(2), (6, 32))
    grad = lambda dt: jax.grad(
        lambda x, w: jnp.sum(rx.models.rms_norm(x, w, 1e-6).astype(jnp.float32) * cot),
        argnums=(0, 1),
    )(x.astype(dt), w.astype(dt))
    lo, hi = grad(jnp.bfloat16), grad(jnp.float32)
    assert [g.dtype for g in lo] == [jnp.bfloat16, jnp.bfloat16]
    for a, b in zip(lo, hi):
        np.testing.assert_allclose(
            a.astype(jnp.float32), b, rtol=3e-2, atol=3e-2 * float(np.max(np.abs(b)))
        )
