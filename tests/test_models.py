"""Model layer: padding invariance, packing, jit/vmap equivalences, heads, dtypes, scan depth."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_allclose

import rlhf_eqx as rx

CFG = rx.TransformerConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48)


@pytest.fixture(scope="module")
def policy():
    return rx.Policy(CFG, key=jax.random.key(0))


@eqx.filter_jit
def call(model, *args, **kwargs):
    """Models are meant to run under jit; eager calls re-trace the layer scan every time."""
    return model(*args, **kwargs)


def _tokens(key, n, vocab=CFG.vocab_size):
    return jax.random.randint(key, (n,), 3, vocab, dtype=jnp.int32)


def test_left_and_right_padding_give_the_same_logits(policy, getkey):
    real = _tokens(getkey(), 7)
    pad = jnp.zeros((3,), jnp.int32)
    ones, zeros = jnp.ones((7,), bool), jnp.zeros((3,), bool)
    plain = call(policy, real, ones)
    right = call(policy, jnp.concatenate([real, pad]), jnp.concatenate([ones, zeros]))
    left = call(policy, jnp.concatenate([pad, real]), jnp.concatenate([zeros, ones]))
    np.testing.assert_allclose(right[:7], plain, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(left[3:], plain, atol=1e-5, rtol=1e-5)


def test_padding_tokens_do_not_matter(policy, getkey):
    real = _tokens(getkey(), 6)
    mask = jnp.array([1, 1, 1, 0, 0, 1, 1, 1, 0], bool)
    a = jnp.zeros((9,), jnp.int32).at[jnp.array([0, 1, 2, 5, 6, 7])].set(real)
    b = jnp.where(mask, a, 17)
    np.testing.assert_allclose(call(policy, a, mask)[mask], call(policy, b, mask)[mask], atol=1e-6)
    # a gap in the middle is transparent: same as the six real tokens in a row
    np.testing.assert_allclose(
        call(policy, a, mask)[mask], call(policy, real, jnp.ones((6,), bool)), atol=1e-5
    )


def test_packed_segments_equal_separate_runs(policy, getkey):
    a, b, c = _tokens(getkey(), 4), _tokens(getkey(), 6), _tokens(getkey(), 3)
    packed = jnp.concatenate([a, b, c, jnp.zeros((3,), jnp.int32)])
    seg = jnp.array([0] * 4 + [1] * 6 + [2] * 3 + [3] * 3, jnp.int32)
    mask = jnp.array([True] * 13 + [False] * 3)
    out = call(policy, packed, mask, segment_ids=seg)
    for x, start in ((a, 0), (b, 4), (c, 10)):
        alone = call(policy, x, jnp.ones(x.shape, bool))
        np.testing.assert_allclose(out[start : start + x.shape[0]], alone, atol=1e-5, rtol=1e-5)


def test_jit_equals_eager_and_vmap_equals_loop(policy, getkey):
    toks = jax.random.randint(getkey(), (3, 8), 0, CFG.vocab_size, dtype=jnp.int32)
    masks = jnp.array([[1] * 8, [1] * 5 + [0] * 3, [0] * 2 + [1] * 6], bool)
    loop = jnp.stack([call(policy, t, m) for t, m in zip(toks, masks)])
    batched = eqx.filter_jit(lambda m, t, k: jax.vmap(m)(t, k))(policy, toks, masks)
    np.testing.assert_allclose(batched, loop, atol=1e-5, rtol=1e-5)


def test_token_logprobs_match_log_softmax(policy, getkey):
    toks = _tokens(getkey(), 9)
    mask = jnp.array([0, 1, 1, 1, 1, 1, 1, 1, 0], bool)
    lp = call(lambda *a: rx.token_logprobs(policy, *a), toks, mask)
    logits = np.asarray(call(policy, toks, mask), np.float64)
    ref = np.zeros(9)
    for t in range(2, 8):  # position 1 is the first real token: nothing predicts it
        row = logits[t - 1]
        ref[t] = row[toks[t]] - (np.log(np.sum(np.exp(row - row.max()))) + row.max())
    np.testing.assert_allclose(lp, ref, atol=1e-5)
    ent = call(lambda *a: rx.token_entropy(policy, *a), toks, mask)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ref_ent = -(p * np.log(p)).sum(-1)
    np.testing.assert_allclose(ent[2:8], ref_ent[1:7], atol=1e-5)
    assert float(ent[0]) == 0.0 and float(ent[1]) == 0.0 and float(ent[8]) == 0.0


def test_value_and_reward_heads(policy, getkey):
    value = rx.ValueModel.from_policy(policy, key=getkey())
    reward = rx.RewardModel.from_policy(policy, key=getkey())
    assert value.transformer.embed is policy.transformer.embed
    toks = _tokens(getkey(), 6)
    ones = jnp.ones((6,), bool)
    v = call(value, toks, ones)
    assert v.shape == (6,) and v.dtype == jnp.float32
    r = call(reward, toks, ones)
    assert r.shape == () and r.dtype == jnp.float32
    # the reward is read at the last real token: right padding does not change it
    padded = jnp.concatenate([toks, jnp.full((4,), 5, jnp.int32)])
    pmask = jnp.concatenate([ones, jnp.zeros((4,), bool)])
    np.testing.assert_allclose(call(reward, padded, pmask), r, atol=1e-5)
    np.testing.assert_allclose(call(value, padded, pmask)[:6], v, atol=1e-5)
    # and equals the value head's read-out with the same head weights
    same = eqx.tree_at(lambda m: (m.head, m.bias), value, (reward.head, reward.bias))
    np.testing.assert_allclose(call(same, toks, ones)[-1], r, atol=1e-5)


def test_tied_embeddings_and_bias(getkey):
    cfg = rx.TransformerConfig(
        vocab_size=40,
        d_model=16,
        n_layers=1,
        n_heads=2,
        d_ff=24,
        tie_embeddings=True,
        attn_bias=True,
    )
    p = rx.Policy(cfg, key=getkey())
    assert p.lm_head is None and p.transformer.layers.bqkv is not None
    toks = _tokens(getkey(), 5, vocab=40)
    h = call(p.transformer, toks, jnp.ones((5,), bool))
    np.testing.assert_allclose(
        call(p, toks, jnp.ones((5,), bool)), h @ p.transformer.embed.T, atol=1e-5
    )
    n = sum(x.size for x in jax.tree_util.tree_leaves(eqx.filter(p, eqx.is_array)))
    assert n == cfg.num_params()


def test_bfloat16_parameters_keep_float32_logits(getkey):
    cfg32 = CFG
    cfg16 = rx.TransformerConfig(**{**CFG.__dict__, "dtype": "bfloat16"})
    p32 = rx.Policy(cfg32, key=jax.random.key(3))
    p16 = rx.Policy(cfg16, key=jax.random.key(3))
    assert p16.transformer.layers.wqkv.dtype == jnp.bfloat16
    toks = _tokens(getkey(), 12)
    mask = jnp.ones((12,), bool)
    l16, l32 = call(p16, toks, mask), call(p32, toks, mask)
    assert l16.dtype == jnp.float32
    assert float(jnp.max(jnp.abs(l16 - l32))) < 0.05
    assert bool(jnp.all(jnp.isfinite(call(lambda *a: rx.token_logprobs(p16, *a), toks, mask))))


def test_layers_are_stacked_and_scanned(getkey):
    """The traced program does not grow with depth: layers run inside one lax.scan."""

    def n_eqns(n_layers):
        cfg = rx.TransformerConfig(**{**CFG.__dict__, "n_layers": n_layers})
        p = rx.Policy(cfg, key=getkey())
        assert p.transformer.layers.wqkv.shape[0] == n_layers
        toks = jnp.zeros((8,), jnp.int32)
        jaxpr = jax.make_jaxpr(lambda m: m(toks, jnp.ones((8,), bool)))(p)
        return len(jaxpr.jaxpr.eqns)

    assert n_eqns(2) == n_eqns(12)


def test_gradients_are_finite_and_masked_tokens_get_none(policy, getkey):
    toks = _tokens(getkey(), 8)
    mask = jnp.array([1, 1, 1, 1, 1, 0, 0, 0], bool)

    def loss(model, toks):
        return -jnp.sum(rx.token_logprobs(model, toks, mask))

    grads = eqx.filter_jit(eqx.filter_grad(loss))(policy, toks)
    leaves = jax.tree_util.tree_leaves(grads)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
    # rows of the embedding for tokens that appear only at padded positions get no gradient
    toks2 = toks.at[5:].set(jnp.array([1, 1, 1], jnp.int32))
    g2 = eqx.filter_jit(eqx.filter_grad(loss))(policy, toks2)
    if not bool(jnp.any(toks2[:5] == 1)):
        assert float(jnp.max(jnp.abs(g2.transformer.embed[1]))) == 0.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n_heads=4, n_kv_heads=3), "n_kv_heads"),
        (dict(n_heads=5), "d_model"),
        (dict(dtype="int8"), "dtype"),
        (dict(d_model=0), "d_model"),
    ],
)
def test_config_validation(kwargs, match):
    base = dict(vocab_size=10, d_model=32, n_layers=1, n_heads=4, d_ff=8)
    with pytest.raises(ValueError, match=match):
        rx.TransformerConfig(**{**base, **kwargs})


def test_pytree_is_immutable(policy):
    with pytest.raises(Exception):
        policy.lm_head = None  # type: ignore[misc]
    leaves = jax.tree_util.tree_leaves(policy)
    assert_tree_allclose(
        jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(policy), leaves), policy
    )


def test_batched_call_equals_vmap(policy, getkey):
    toks = jax.random.randint(getkey(), (3, 9), 0, CFG.vocab_size, dtype=jnp.int32)
    masks = jnp.array([[1] * 9, [1] * 6 + [0] * 3, [0] * 4 + [1] * 5], bool)
    seg = jnp.array([[0] * 4 + [1] * 5, [0] * 9, [0] * 9], jnp.int32)
    value = rx.ValueModel.from_policy(policy, key=getkey())
    reward = rx.RewardModel.from_policy(policy, key=getkey())

    @eqx.filter_jit
    def both(model, *args, **kwargs):
        return model(*args, **kwargs), jax.vmap(lambda *a: model(*a, **kwargs))(*args)

    for model in (policy, value, reward):
        batched, mapped = both(model, toks, masks)
        np.testing.assert_allclose(batched, mapped, atol=1e-5, rtol=1e-5)
    batched = call(policy, toks, masks, segment_ids=seg)
    mapped = jnp.stack([call(policy, t, m, segment_ids=s) for t, m, s in zip(toks, masks, seg)])
    np.testing.assert_allclose(batched, mapped, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", [True, "dots"])
def test_remat_gives_the_same_values_and_gradients(policy, getkey, mode):
    remat = rx.with_remat(policy, mode)
    assert remat.cfg.remat == mode and not policy.cfg.remat
    assert remat.transformer.layers is policy.transformer.layers  # arrays shared
    value = rx.with_remat(rx.ValueModel(CFG, key=getkey()), mode)
    assert value.transformer.cfg.remat == mode
    with pytest.raises(ValueError, match="remat must be False, True, 'full' or 'dots'"):
        rx.with_remat(policy, "everything")
    toks = _tokens(getkey(), 8)
    mask = jnp.ones((8,), bool)

    def loss(model):
        return -jnp.sum(rx.token_logprobs(model, toks, mask))

    grad = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    (l1, g1), (l2, g2) = grad(policy), grad(remat)
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g2)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda m: loss(m)))(remat))
    assert "remat" in jaxpr or "checkpoint" in jaxpr


def test_remat_modes_keep_less_for_the_backward_pass(getkey):
    """What a differentiated forward keeps for its backward pass (the residuals of its
    VJP, weights aside): every activation without remat; with `"dots"` the products'
    outputs, about half of that here (norms, rotary tables, the MLP activation and the
    attention's outputs are recomputed); with `True` little more than each layer's input."""
    cfg = dict(CFG.__dict__, n_layers=3, d_model=64, n_heads=4, n_kv_heads=2, d_ff=160)
    T = 32
    toks = _tokens(getkey(), T)
    mask = jnp.ones((T,), bool)

    def kept(mode):
        model = rx.Policy(rx.TransformerConfig(**dict(cfg, remat=mode)), key=jax.random.key(0))
        params, static = eqx.partition(model, eqx.is_inexact_array)
        hidden = lambda p: eqx.combine(p, static).transformer(toks, mask)  # noqa: E731
        _, vjp = jax.vjp(hidden, params)
        weights = {id(x) for x in jax.tree_util.tree_leaves(params)}
        leaves = jax.tree_util.tree_leaves(vjp)
        return sum(x.nbytes for x in leaves if hasattr(x, "nbytes") and id(x) not in weights)

    none, dots, full = kept(False), kept("dots"), kept(True)
    inputs = T * cfg["n_layers"] * cfg["d_model"] * 4  # float32 layer inputs
    assert inputs <= full < 2 * inputs < dots < 0.6 * none
    with pytest.raises(ValueError, match="remat must be False, True, 'full' or 'dots'"):
        rx.TransformerConfig(**dict(cfg, remat="dot"))


def test_models_layer_imports_nothing_above_it():
    """models is the lowest layer: no module of it imports ops, sampling, losses, train or data."""
    import ast
    import pathlib

    root = pathlib.Path(rx.__file__).parent / "models"
    above = ("data", "ops", "losses", "train", "_sampling", "_batches", "_pretrained", "pipelines")
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                module = ("." * node.level) + (node.module or "")
                parts = module.lstrip(".").split(".")
                assert not (node.level >= 2 and parts[0] in above), (path.name, module)
                assert not (module.startswith("rlhf_eqx.") and parts[1] in above), (
                    path.name,
                    module,
                )
            if isinstance(node, ast.Import):
                for alias in node.names:
                    assert (
                        not alias.name.startswith("rlhf_eqx.")
                        or alias.name.split(".")[1] == "models"
                    )
