"""Reward sources beyond one Bradley-Terry model: reward-model ensembles, a generative
judge, and process reward models (formulas, properties, steps, devices, data)."""

import dataclasses
import json

import equinox as eqx
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import ADAM_EPS, assert_adam_steps_agree, assert_tree_allclose
from hypothesis import given, settings, strategies as st
from test_train_common import (
    VOCAB,
    CumMeanLM,
    CumMeanReward,
    CumMeanValue,
    leaves_equal,
    preference_batch,
    sgd_delta,
    tiny_config,
)

import rlhf_eqx as rx
import rlhf_eqx.testing as rt
from rlhf_eqx import data, pipelines as pl
from rlhf_eqx.distributed import replicate, shard_batch_for_pmap, unreplicate
from rlhf_eqx.losses import (
    aggregate,
    aggregate_parts,
    conservative_reward,
    process_reward_loss,
    process_sequence_reward,
    process_token_rewards,
)
from rlhf_eqx.train import (
    BootstrapBatch,
    PPOBatch,
    PRMBatch,
    PRMSettings,
    StepOptions,
    add_token_rewards,
    bootstrap_weights,
    ensemble_scores,
    init_ensemble_state,
    judge_reward,
    make_ensemble,
    make_ensemble_reward_step,
    make_optimizer,
    make_prm_step,
    make_reward_step,
    partition_trainable,
    process_rewards,
    scalar_head_filter,
    step_end_mask,
)

N_DEV = 8


# ----------------------------------------------------------------------------- references


def _np_bce(z, y):
    """-[y log σ(z) + (1 - y) log σ(-z)] in float64, stable for |z| = 1e4."""
    z, y = np.asarray(z, np.float64), np.asarray(y, np.float64)
    return y * np.logaddexp(0.0, -z) + (1.0 - y) * np.logaddexp(0.0, z)


def _np_conservative(r, penalty, mode):
    r = np.asarray(r, np.float64)
    mean = r.mean(axis=0)
    var = ((r - mean) ** 2).mean(axis=0)
    return {
        "std": mean - penalty * np.sqrt(var),
        "var": mean - penalty * var,
        "min": r.min(axis=0),
        "mean": mean,
    }[mode]


EXTREME = np.array(
    [
        [1e4, -1e4, 3.0, -2.5, 0.0, 1e4],
        [-1e4, 1e4, 0.5, 7.0, -1e4, 2.0],
        [2.0, -3.0, 1e4, -1e4, 0.1, -0.1],  # fully masked below
    ],
    np.float32,
)
EXTREME_STEPS = np.array([[1, 1, 1, 0, 1, 1], [1, 1, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0]], bool)
EXTREME_LABELS = np.array([[1, 0, 1, 1, 0, 1], [0, 1, 1, 0, 1, 0], [1, 1, 1, 1, 1, 1]], np.float32)


def test_process_reward_loss_matches_numpy_at_extremes():
    logits, steps = jnp.asarray(EXTREME), jnp.asarray(EXTREME_STEPS)
    soft = np.where(EXTREME_LABELS > 0, 0.8, 0.1).astype(np.float32)
    for labels in (EXTREME_LABELS, soft):
        got = jax.vmap(process_reward_loss)(logits, steps, jnp.asarray(labels))
        want = np.where(EXTREME_STEPS, _np_bce(EXTREME, labels), 0.0)
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5)
        mean = aggregate(got, steps, mode="token-mean")
        np.testing.assert_allclose(float(mean), want.sum() / EXTREME_STEPS.sum(), rtol=1e-5)
        grads = jax.grad(lambda z: jnp.sum(jax.vmap(process_reward_loss)(z, steps, labels)))(logits)
        assert np.all(np.isfinite(np.asarray(grads)))
        assert np.all(np.asarray(grads)[~EXTREME_STEPS] == 0.0)
    bools = jax.vmap(process_reward_loss)(logits, steps, jnp.asarray(EXTREME_LABELS > 0))
    np.testing.assert_allclose(
        np.asarray(bools), np.where(EXTREME_STEPS, _np_bce(EXTREME, EXTREME_LABELS), 0.0), rtol=1e-5
    )


def test_process_rewards_per_token_and_per_sequence_match_numpy():
    scores, steps = jnp.asarray(EXTREME), jnp.asarray(EXTREME_STEPS)
    np.testing.assert_array_equal(
        np.asarray(jax.vmap(process_token_rewards)(scores, steps)),
        np.where(EXTREME_STEPS, EXTREME, 0.0),
    )
    for aggregation in ("min", "last", "mean"):
        got = jax.vmap(lambda s, m: process_sequence_reward(s, m, aggregation=aggregation))(
            scores, steps
        )
        want = []
        for s, m in zip(EXTREME.astype(np.float64), EXTREME_STEPS):
            if not m.any():
                want.append(0.0)  # no step: no reward
            elif aggregation == "min":
                want.append(s[m].min())
            elif aggregation == "last":
                want.append(s[np.nonzero(m)[0][-1]])
            else:
                want.append(s[m].mean())
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5)
    with pytest.raises((ValueError, TypeError), match="aggregation"):
        process_sequence_reward(scores[0], steps[0], aggregation="max")


def test_conservative_reward_matches_numpy_at_extremes():
    members = np.array(
        [[1e4, -1e4, 3.0, 2.0], [-1e4, -1e4, 3.0, 2.5], [0.0, -1e4, 3.0, -7.0]], np.float32
    )  # [K=3, B=4]; column 1 and 2: every member agrees
    for mode in ("std", "var", "min", "mean"):
        for penalty in (0.0, 0.5, 2.0):
            got = jax.vmap(lambda s: conservative_reward(s, penalty=penalty, mode=mode), in_axes=1)(
                jnp.asarray(members)
            )
            want = _np_conservative(members, penalty, mode)
            np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5)
    # σ = 0 (members agree): a zero gradient of the penalty, not NaN
    g = jax.grad(lambda s: conservative_reward(s, penalty=1.0))(jnp.full((3,), 2.0))
    np.testing.assert_allclose(np.asarray(g), np.full(3, 1 / 3), rtol=1e-6)
    # traced penalty (a sweep)
    sweep = jax.vmap(lambda p: conservative_reward(jnp.asarray(members[:, 0]), penalty=p))(
        jnp.asarray([0.0, 1.0])
    )
    np.testing.assert_allclose(
        np.asarray(sweep, np.float64),
        [_np_conservative(members[:, :1], p, "std")[0] for p in (0.0, 1.0)],
        rtol=1e-5,
    )
    with pytest.raises(ValueError, match="penalty"):
        conservative_reward(jnp.ones(3), penalty=-1.0)


def test_verdict_scores_match_numpy_at_extremes():
    logits = np.array(
        [[1e4, -1e4, 0.0, 5.0], [-1e4, 1e4, 1e4, 0.0], [0.3, 0.1, -2.0, 1.0]], np.float32
    )
    lg = logits.astype(np.float64)
    logp = lg - np.logaddexp.reduce(lg, axis=-1, keepdims=True)
    got = rx.train.verdict_scores(jnp.asarray(logits), 0, 1, score="log_odds")
    np.testing.assert_allclose(np.asarray(got, np.float64), logp[:, 0] - logp[:, 1], rtol=1e-5)
    got = rx.train.verdict_scores(jnp.asarray(logits), 0, 1, score="prob")
    np.testing.assert_allclose(
        np.asarray(got, np.float64), np.exp(logp[:, 0]), rtol=1e-5, atol=1e-30
    )


# ----------------------------------------------------------------------------- properties


def _prm_batch_loss(logits, labels, mask):
    per_token = jax.vmap(process_reward_loss)(logits, mask, labels)
    return aggregate(per_token, mask, mode="token-mean")


def _binary(labels):
    return (labels > 0).astype(jnp.float32)


@given(rt.logprob_arrays(n=2, batch=4, length=6, min_value=-1e4, max_value=1e4))
def test_process_reward_loss_properties(arrays):
    logits, raw, mask = arrays
    labels = _binary(raw)
    rt.check_finite(_prm_batch_loss, logits, labels, mask)
    rt.check_padding_invariance(_prm_batch_loss, (logits, labels), mask)
    rt.check_all_masked_contributes_nothing(_prm_batch_loss, (logits, labels), mask)
    rt.check_permutation_invariance(_prm_batch_loss, (logits, labels, mask))
    # two micro-batches of rows, each over the full batch's denominator, sum to the loss
    per_token = jax.vmap(process_reward_loss)(logits, mask, labels)
    _, den = aggregate_parts(per_token, mask, mode="token-mean")
    nums = [
        aggregate_parts(per_token[i : i + 2], mask[i : i + 2], mode="token-mean")[0] for i in (0, 2)
    ]
    full = _prm_batch_loss(logits, labels, mask)
    split = rx.losses.safe_divide(nums[0] + nums[1], den)
    np.testing.assert_allclose(float(split), float(full), rtol=1e-5, atol=1e-6)


_SEQUENCE_REWARD = {
    a: jax.vmap(lambda s, m, a=a: process_sequence_reward(s, m, aggregation=a))
    for a in ("min", "last", "mean")
}
_TOKEN_REWARDS = jax.vmap(process_token_rewards)


@given(
    rt.logprob_arrays(n=1, batch=3, length=6, min_value=-1e4, max_value=1e4),
    st.sampled_from(["min", "last", "mean"]),
)
def test_process_sequence_reward_masking_is_inert(arrays, aggregation):
    scores, mask = arrays
    rt.check_padding_invariance(_SEQUENCE_REWARD[aggregation], (scores,), mask)
    rt.check_padding_invariance(_TOKEN_REWARDS, (scores,), mask)


@given(rt.reward_groups(group_size=st.integers(2, 6)), st.sampled_from(["std", "var", "min"]))
def test_conservative_reward_properties(scores, mode):
    penalty = 0.5
    got = float(conservative_reward(scores, penalty=penalty, mode=mode))
    want = float(_np_conservative(np.asarray(scores)[:, None], penalty, mode)[0])
    scale = max(1.0, float(np.max(np.abs(np.asarray(scores)))))
    tol = 1e-5 * scale * (scale if mode == "var" else 1.0)
    assert abs(got - want) <= tol, (got, want)
    assert got <= float(jnp.mean(scores)) + tol  # conservative
    flipped = float(conservative_reward(scores[::-1], penalty=penalty, mode=mode))
    assert abs(flipped - got) <= tol  # the members' order does not matter


# ----------------------------------------------------------------------------- PRM steps


# one compilation each, shared by the tests below (same model structure and shapes)
_PRM_STEPS = {k: make_prm_step(optax.sgd(1.0), micro_batches=k) for k in (1, 2)}


def _prm_batch(key, B=8, T=10, vocab=VOCAB):
    k1, k2, k3 = jax.random.split(key, 3)
    tokens = jax.random.randint(k1, (B, T), 1, vocab)
    lengths = jnp.asarray([T, T - 2, 3, T - 1, T - 4, T, T - 3, 5] * (B // 8 + 1))[:B]
    mask = jnp.arange(T)[None, :] < lengths[:, None]
    steps = jax.random.bernoulli(k2, 0.4, (B, T)) & mask & (jnp.arange(T)[None, :] >= 2)
    steps = steps.at[2].set(False)  # a row without steps
    labels = jax.random.bernoulli(k3, 0.5, (B, T)).astype(jnp.float32)
    return PRMBatch(tokens=tokens, mask=mask, step_mask=steps, step_labels=labels)


def test_prm_step_closed_form_and_micro_batches(getkey):
    model = CumMeanValue(getkey())
    batch = _prm_batch(getkey())
    full, m_full = sgd_delta(_PRM_STEPS[1], model, batch)
    micro, m_micro = sgd_delta(_PRM_STEPS[2], model, batch)
    assert_tree_allclose(micro, full, atol=1e-6)
    for name in m_full:
        np.testing.assert_allclose(float(m_micro[name]), float(m_full[name]), rtol=1e-5, atol=1e-6)
    z = np.asarray(jax.vmap(model)(batch.tokens, batch.mask), np.float64)
    m = np.asarray(batch.step_mask & batch.mask)
    y = np.asarray(batch.step_labels, np.float64)
    np.testing.assert_allclose(float(m_full["loss"]), _np_bce(z, y)[m].mean(), rtol=1e-5)
    np.testing.assert_allclose(
        float(m_full["accuracy"]), ((z > 0) == (y > 0.5))[m].mean(), rtol=1e-6
    )
    np.testing.assert_allclose(float(m_full["steps/per_row"]), m.sum() / m.shape[0], rtol=1e-6)
    # only the steps matter: junk labels elsewhere change nothing
    junk = eqx.tree_at(lambda b: b.step_labels, batch, jnp.where(m, batch.step_labels, 7.0))
    again, _ = sgd_delta(_PRM_STEPS[1], model, junk)
    assert_tree_allclose(again, full, atol=1e-7)
    lm = CumMeanLM(getkey())  # logits [T, V]: not a per-token scalar model
    with pytest.raises(ValueError, match="one scalar per position"):
        make_prm_step(optax.sgd(1.0))(lm, optax.sgd(1.0).init(lm), batch)


def test_prm_record_equals_keywords_and_names_a_bad_mode(getkey):
    model = CumMeanValue(getkey())
    batch = _prm_batch(getkey())
    opt = optax.sgd(1.0)
    record, options = PRMSettings(mode="seq-mean-token-mean"), StepOptions(micro_batches=2)
    a = sgd_delta(make_prm_step(opt, record, options=options), model, batch)
    b = sgd_delta(make_prm_step(opt, mode="seq-mean-token-mean", micro_batches=2), model, batch)
    step = make_prm_step(opt, PRMSettings(), mode=record.mode, options=options)  # a shortcut
    c = sgd_delta(step, model, batch)
    assert leaves_equal(a, b) and leaves_equal(a, c)
    # the record's mode reaches the loss: the mean over rows (with steps) of each row's mean
    z = np.asarray(jax.vmap(model)(batch.tokens, batch.mask), np.float64)
    m = np.asarray(batch.step_mask & batch.mask)
    bce = _np_bce(z, np.asarray(batch.step_labels, np.float64))
    rows = [bce[i][m[i]].mean() for i in range(m.shape[0]) if m[i].any()]
    np.testing.assert_allclose(float(a[1]["loss"]), np.mean(rows), rtol=1e-5)
    assert PRMSettings().mode == "token-mean"
    for build in (lambda: PRMSettings(mode="mean"), lambda: make_prm_step(opt, mode="mean")):
        with pytest.raises(ValueError) as info:
            build()
        assert str(info.value).startswith("mode='mean': must be one of token-mean")
        assert "\n" not in str(info.value)
    with pytest.raises(TypeError, match=r"\['beta'\].*PRMSettings are mode"):
        make_prm_step(opt, beta=0.1)


@settings(max_examples=6)
@given(rt.masks((8, 10), allow_all_masked=True), hnp.arrays(np.bool_, (8, 10)))
def test_prm_step_micro_batches_property(steps, labels):
    """micro_batches=2 equals the full batch for any step layout (empty rows included)."""
    model = CumMeanValue(jax.random.key(0))
    base = _prm_batch(jax.random.key(1))
    batch = PRMBatch(  # steps anywhere, also on padding (ignored there)
        tokens=base.tokens,
        mask=base.mask,
        step_mask=steps,
        step_labels=jnp.asarray(labels, jnp.float32),
    )
    full, m_full = sgd_delta(_PRM_STEPS[1], model, batch)
    micro, m_micro = sgd_delta(_PRM_STEPS[2], model, batch)
    assert_tree_allclose(micro, full, atol=1e-6)
    np.testing.assert_allclose(float(m_micro["loss"]), float(m_full["loss"]), rtol=1e-5, atol=1e-7)


def _devices():
    if jax.local_device_count() < N_DEV:
        pytest.skip(f"needs {N_DEV} devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    return jax.local_devices()[:N_DEV]


def _pmap_equals_one_device(step_dp, step_one, params, opt_state, batch, frozen=None, key=None):
    devices = _devices()
    one_params, _, one_m = step_one(params, opt_state, batch, frozen=frozen, key=key)
    dp = jax.pmap(
        lambda p, s, b, f, k: step_dp(p, s, b, frozen=f, key=k), axis_name="data", devices=devices
    )
    dp_params, _, dp_m = dp(
        replicate(params, devices),
        replicate(opt_state, devices),
        shard_batch_for_pmap(batch, N_DEV),
        replicate(frozen, devices),
        replicate(key, devices),
    )
    got = eqx.filter(unreplicate(dp_params), eqx.is_inexact_array)
    want = eqx.filter(one_params, eqx.is_inexact_array)
    assert_tree_allclose(got, want, atol=1e-5, rtol=1e-4)
    moved = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(
            jax.tree.leaves(want), jax.tree.leaves(eqx.filter(params, eqx.is_inexact_array))
        )
    )
    assert moved > 1e-4  # the step did something
    for name, value in one_m.items():
        np.testing.assert_allclose(
            np.asarray(dp_m[name][0]), np.asarray(value), rtol=2e-4, atol=2e-5, err_msg=name
        )
    return one_m


def test_pmap_prm_equals_one_device(getkey):
    """8 devices (one row each, some without steps) == one device in 2 micro-batches."""
    value = CumMeanValue(getkey())
    batch = _prm_batch(getkey())
    opt = optax.sgd(1.0)
    m = _pmap_equals_one_device(
        make_prm_step(opt, axis_name="data"),
        _PRM_STEPS[2],
        value,
        opt.init(eqx.filter(value, eqx.is_inexact_array)),
        batch,
    )
    assert 0.0 < float(m["accuracy"]) < 1.0


# ----------------------------------------------------------------------------- PRM data


RECORDS = [
    {
        "prompt": "2+3*4?",
        "completions": ["3*4=12", "2+12=14", "so 14"],
        "labels": [True, False, False],
    },
    {"prompt": "1+1?", "completions": ["1+1=2", "answer 2"], "labels": [1, True]},
    {"prompt": "9-3?", "completions": ["9-3=6"], "labels": [True]},
    {"prompt": "5*5?", "completions": ["5*5=25", "25"], "labels": [True, True]},
]


def _write(tmp_path, records, name="steps.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_stepwise_records_tokenize_and_collate(tmp_path):
    tok = data.ByteTokenizer()
    records = data.load_stepwise(_write(tmp_path, RECORDS))
    assert len(records) == 4 and records[1].labels == (True, True)
    sols, report = data.tokenize_stepwise(records, tok, max_length=32, max_prompt_length=16)
    sep = data.separator_id(tok, "\n")
    first = sols[0]
    want = [tok.bos_id] + tok.encode("2+3*4?")
    for step in RECORDS[0]["completions"]:
        want += tok.encode(step) + [sep]
    assert list(first.tokens) == want
    assert [first.tokens[i] for i in first.step_ends] == [sep] * 3
    assert first.labels == (True, False, False)
    batch = data.collate_stepwise(sols, pad_id=tok.pad_id, max_length=32, vocab_size=tok.vocab_size)
    assert isinstance(batch, PRMBatch) and batch.tokens.shape == (4, 32)
    np.testing.assert_array_equal(np.asarray(batch.step_mask).sum(axis=1), [3, 2, 1, 2])
    np.testing.assert_array_equal(
        np.asarray(batch.step_labels)[0][list(first.step_ends)], [1, 0, 0]
    )
    assert np.all(np.asarray(batch.tokens)[np.asarray(batch.step_mask)] == sep)
    assert report.kept == 4
    # whole steps are kept while they fit; later steps are dropped with their labels
    cut, report = data.tokenize_stepwise(records, tok, max_length=16, max_prompt_length=8)
    assert [len(s.labels) for s in cut] == [1, 1, 1, 2] and report.completion_truncated == 2
    assert all(len(s) <= 16 for s in cut)
    last, _ = data.tokenize_stepwise(
        records, tok, max_length=32, max_prompt_length=16, last_step_only=True
    )
    assert last[0].labels == (False,) and last[0].step_ends == first.step_ends[-1:]


def test_stepwise_errors_name_file_and_line(tmp_path):
    bad_label = RECORDS[:1] + [{"prompt": "x", "completions": ["a"], "labels": ["yes"]}]
    path = _write(tmp_path, bad_label, "bad.jsonl")
    with pytest.raises(data.DataError, match=r"bad\.jsonl:2: wrong type.*labels'\]?\[0\]"):
        data.load_stepwise(path)
    path = _write(
        tmp_path, [{"prompt": "x", "completions": ["a", "b"], "labels": [True]}], "n.jsonl"
    )
    with pytest.raises(data.DataError, match=r"n\.jsonl:1: length mismatch"):
        data.load_stepwise(path)
    path = _write(
        tmp_path, RECORDS[:1] + [{"prompt": "x", "completions": "a b", "labels": [True]}], "s.jsonl"
    )
    with pytest.raises(data.DataError, match=r"s\.jsonl:2: wrong type"):
        data.load_stepwise(path)
    mixed = RECORDS[:2] + [
        {"prompt": "x", "completions": [], "labels": []},
        {"prompt": 3, "completions": ["a"], "labels": [True]},
    ]
    ds = data.load_stepwise(_write(tmp_path, mixed, "m.jsonl"), lenient=True)
    assert len(ds) == 2 and ds.report.skipped == {"no steps": 1, "wrong type": 1}


def test_tiny_prm_learns_from_stepwise_data(tmp_path, getkey):
    tok = data.ByteTokenizer()
    records = data.load_stepwise(_write(tmp_path, RECORDS))
    sols, _ = data.tokenize_stepwise(records, tok, max_length=32, max_prompt_length=16)
    batch = data.collate_stepwise(sols, pad_id=tok.pad_id, max_length=32)
    cfg = rx.TransformerConfig(
        vocab_size=tok.vocab_size,
        d_model=32,
        n_layers=1,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        max_seq_len=32,
    )
    opt = make_optimizer(learning_rate=1e-2, total_steps=20, schedule="constant")
    state = rx.train.init_train_state(rx.ValueModel(cfg, key=getkey()), opt)
    step = make_prm_step(opt, check_token_ids=tok.vocab_size)
    state, first = state.apply(step, batch)
    for _ in range(14):
        state, metrics = state.apply(step, batch)
    assert float(metrics["loss"]) < 0.5 * float(first["loss"])
    assert float(metrics["accuracy"]) == 1.0
    # its step scores as rewards: per token at the step ends, per sequence (min / last)
    per_token, per_sequence = process_rewards(
        state.model, batch.tokens, batch.mask, batch.step_mask, aggregation="last"
    )
    m = np.asarray(batch.step_mask)
    assert np.all(np.asarray(per_token)[~m] == 0.0)
    labels = np.asarray(batch.step_labels)
    assert np.all((np.asarray(per_token)[m] > 0.5) == (labels[m] > 0.5))
    last = [labels[i][np.nonzero(m[i])[0][-1]] for i in range(4)]
    np.testing.assert_array_equal(np.asarray(per_sequence) > 0.5, np.asarray(last) > 0.5)


# ----------------------------------------------------------------------------- PRM rewards


def test_step_end_mask_marks_separators_and_an_unterminated_last_step():
    SEP, EOS = 9, 2
    tokens = jnp.asarray(
        [
            [1, 5, 6, SEP, 7, SEP, EOS, 0],  # "a\nb\n<eos>": two steps, the EOS is not one
            [1, 5, 6, SEP, 7, 7, EOS, 0],  # "a\nbb<eos>": the last step ends at its EOS
            [1, 5, 6, SEP, 7, 7, 7, 7],  # truncated: the last step ends at the cut
            [1, SEP, 6, 6, 0, 0, 0, 0],  # a separator inside the prompt does not count
        ]
    )
    completion = jnp.asarray(
        [[0, 1, 1, 1, 1, 1, 1, 0]] * 2 + [[0, 1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0, 0, 0]], bool
    )
    got = np.asarray(step_end_mask(tokens, completion, SEP, ignore_ids=(EOS,)))
    want = np.zeros((4, 8), bool)
    want[0, [3, 5]] = want[1, [3, 6]] = want[2, [3, 7]] = want[3, 3] = True
    np.testing.assert_array_equal(got, want)
    plain = np.asarray(step_end_mask(tokens, completion, SEP, final_step=False))
    np.testing.assert_array_equal(plain, np.asarray(completion & (tokens == SEP)))


def test_add_token_rewards_equals_gae_of_the_summed_rewards(getkey):
    B, T, gamma, lam = 4, 9, 0.9, 0.8
    rewards = jax.random.normal(getkey(), (B, T))
    values = jax.random.normal(getkey(), (B, T))
    extra = jax.random.normal(getkey(), (B, T))
    pos = jnp.arange(T)[None, :]
    m = (pos >= 2) & (pos < jnp.asarray([9, 6, 2, 8])[:, None])  # row 2: empty completion
    run = jax.jit(jax.vmap(lambda r, v, mi: rx.losses.gae(r, v, mi, gamma=gamma, lam=lam)))
    adv, ret = run(rewards, values, m)
    batch = PPOBatch(
        tokens=jnp.zeros((B, T), jnp.int32),
        mask=jnp.ones((B, T), bool),
        completion_mask=m,
        old_logp=jnp.zeros((B, T)),
        old_values=jnp.where(m, values, 0.0),
        advantages=adv,
        returns=ret,
    )
    want_adv, want_ret = run(rewards + extra, values, m)
    got, stats = add_token_rewards(batch, extra, gamma=gamma, lam=lam, whiten=False)
    np.testing.assert_allclose(np.asarray(got.advantages), np.asarray(want_adv), atol=1e-5)
    np.testing.assert_allclose(np.asarray(got.returns), np.asarray(want_ret), atol=1e-5)
    whitened, _ = add_token_rewards(batch, extra, gamma=gamma, lam=lam)
    np.testing.assert_allclose(
        np.asarray(whitened.advantages),
        np.asarray(rx.losses.whiten_advantages(want_adv, m)),
        atol=1e-5,
    )
    np.testing.assert_allclose(
        float(stats["objective/process_reward"]),
        float(jnp.mean(jnp.sum(jnp.where(m, extra, 0.0), axis=1))),
        rtol=1e-5,
    )


# ----------------------------------------------------------------------------- ensembles

K = 3


def _heads_ensemble(policy, keys):
    make = lambda k: rx.RewardModel.from_policy(policy, key=k)
    return make, make_ensemble(make, keys, filter_spec=scalar_head_filter(make(keys[0])))


def _member(tree, k):
    return jax.tree.map(lambda x: x[k], tree)


def test_heads_ensemble_steps_equal_separate_reward_steps(getkey):
    """One vmapped step of K reward heads on a shared frozen backbone, each on its
    bootstrap resample, == K separate reward steps on the pairs each member drew (after
    one and two steps; Adam with gradient clipping, which is per member)."""
    policy = rx.Policy(tiny_config(), key=getkey())
    keys = jax.random.split(getkey(), K)
    make, ensemble = _heads_ensemble(policy, keys)
    spec = scalar_head_filter(make(keys[0]))
    # memory: the backbone is the policy's own arrays; only the heads are stacked
    assert ensemble.shared.transformer.embed is policy.transformer.embed
    assert ensemble.num_members == K
    stacked = sum(x.size for x in jax.tree.leaves(ensemble.members))
    assert stacked == K * (tiny_config().d_model + 1)
    pairs = preference_batch(getkey(), B=4, T=10)
    weights = bootstrap_weights(getkey(), 4, K)
    np.testing.assert_array_equal(np.asarray(weights).sum(axis=0), [4] * K)
    assert np.all(np.asarray(bootstrap_weights(getkey(), 4, K, method="poisson")) >= 0)
    # Adam's eps = ADAM_EPS: the stacked members' reductions may add in another order than
    # one member's, and the parameters then agree within a bound scaled by the learning rate
    opt = make_optimizer(
        learning_rate=1e-2, total_steps=10, schedule="constant", max_grad_norm=0.05, eps=ADAM_EPS
    )
    state = init_ensemble_state(ensemble, opt)
    step = make_ensemble_reward_step(opt, members=K, center_coef=0.01)
    batch = BootstrapBatch(pairs=pairs, weights=weights)
    w = np.asarray(weights).astype(int)
    resampled = [  # the pairs member k drew, each as often as drawn
        jax.tree.map(lambda x: x[np.repeat(np.arange(4), w[:, k])], pairs) for k in range(K)
    ]
    single = make_reward_step(opt, center_coef=0.01)
    want = []
    for k in range(K):
        params, frozen = partition_trainable(make(keys[k]), spec)
        opt_state, history = opt.init(params), []
        for _ in range(2):
            params, opt_state, m = single(params, opt_state, resampled[k], frozen=frozen)
            history.append((params, m))
        want.append(history)
    for n in range(2):  # after one and after two steps
        state, metrics = state.apply(step, batch)
        for k in range(K):
            params, m = want[k][n]
            assert_adam_steps_agree(_member(state.params.members, k), params, lr=1e-2, steps=n + 1)
            np.testing.assert_allclose(
                float(metrics[f"member_{k}/loss"]), float(m["loss"]), rtol=1e-5
            )
    assert state.model.shared.transformer.embed is policy.transformer.embed
    losses = [float(metrics[f"member_{k}/loss"]) for k in range(K)]
    np.testing.assert_allclose(float(metrics["loss"]), sum(losses), rtol=1e-6)
    assert len(set(losses)) == K  # the members differ
    # the clipping was active, per member (a norm shared by the members would differ)
    assert min(float(metrics[f"member_{k}/grad_norm"]) for k in range(K)) > 0.05
    assert float(metrics["nonfinite"]) == 0.0
    # a member that drew no pair is not moved; the others are
    fresh = init_ensemble_state(ensemble, opt)
    none_for_0 = BootstrapBatch(pairs=pairs, weights=weights.at[:, 0].set(0.0))
    moved, _ = fresh.apply(step, none_for_0)
    for k in range(K):
        change = max(
            float(jnp.max(jnp.abs(a - b)))
            for a, b in zip(
                jax.tree.leaves(_member(moved.params.members, k)),
                jax.tree.leaves(_member(ensemble.members, k)),
            )
        )
        assert (change == 0.0) == (k == 0), (k, change)
    with pytest.raises(data.DataError, match="weights"):
        BootstrapBatch(pairs=pairs, weights=jnp.ones((3, K)))


def test_lora_ensemble_scores_are_mean_minus_penalty_std(getkey):
    """K LoRA adapters on one frozen reward model: each member's score, and the
    conservative mean - λ·std, against numpy."""
    base = rx.RewardModel(tiny_config(), key=getkey())
    cfg = rx.LoRAConfig(rank=2, targets=("q", "v"))
    make = lambda k: rx.apply_lora(base, cfg, key=k)
    keys = jax.random.split(getkey(), K)
    spec = rx.lora_filter(make(keys[0]), head=False)
    adapters = make_ensemble(make, keys, filter_spec=spec)
    # memory: the base is the reward model's own arrays; only the adapters are stacked
    assert adapters.shared.transformer.layers.wqkv is base.transformer.layers.wqkv
    stacked = sum(x.size for x in jax.tree.leaves(adapters.members))
    assert stacked == K * rx.count_params(make(keys[0]), spec)
    # LoRA's B starts at 0: give each member a different non-zero B
    ensemble = eqx.tree_at(
        lambda e: e.members.transformer.layers.lora["v"].b,
        adapters,
        0.5 * jax.random.normal(getkey(), adapters.members.transformer.layers.lora["v"].b.shape),
    )
    batch = preference_batch(getkey(), B=4, T=10)
    tokens, mask = batch.chosen_tokens, batch.chosen_mask
    scores, members = ensemble_scores(ensemble, tokens, mask, penalty=0.7)
    assert members.shape == (K, 4) and scores.shape == (4,)
    score = eqx.filter_jit(lambda model: jax.vmap(model)(tokens, mask))
    for k in range(K):  # each member on its own, as a plain model
        own = score(ensemble.member(k))
        np.testing.assert_allclose(np.asarray(members[k]), np.asarray(own), rtol=1e-5, atol=1e-6)
    assert np.ptp(np.asarray(members), axis=0).min() > 1e-4  # the members disagree
    want = _np_conservative(np.asarray(members), 0.7, "std")
    np.testing.assert_allclose(np.asarray(scores, np.float64), want, rtol=1e-5, atol=1e-6)
    worst, _ = ensemble_scores(ensemble, tokens, mask, mode="min")
    np.testing.assert_allclose(np.asarray(worst), np.asarray(members).min(axis=0), rtol=1e-6)
    with pytest.raises(ValueError, match="depends on the key"):
        make_ensemble(
            lambda k: rx.RewardModel(tiny_config(), key=k),
            keys,
            filter_spec=scalar_head_filter(base),
        )


def test_pmap_ensemble_equals_one_device(getkey):
    base = CumMeanReward(CumMeanValue(getkey()))  # K read-out vectors on one frozen body
    make = lambda k: eqx.tree_at(lambda m: m.value.w, base, 0.3 * jax.random.normal(k, (16,)))
    spec = eqx.tree_at(lambda m: m.value.w, jax.tree.map(lambda _: False, base), True)
    ensemble = make_ensemble(make, jax.random.split(getkey(), K), filter_spec=spec)
    assert ensemble.shared.value.body.embed is base.value.body.embed
    k1, k2 = jax.random.split(getkey())
    batch = preference_batch(k1, B=8, T=10)
    batch = jax.tree.map(lambda x: jnp.concatenate([x, x[::-1]]), batch)  # 16 pairs
    weights = bootstrap_weights(k2, 16, K, method="poisson")
    opt = optax.sgd(0.5)
    state = init_ensemble_state(ensemble, opt)
    # 8 devices (2 pairs each) == one device in 2 micro-batches: both reductions exact
    m = _pmap_equals_one_device(
        make_ensemble_reward_step(opt, members=K, axis_name="data", center_coef=0.01),
        make_ensemble_reward_step(opt, members=K, center_coef=0.01, micro_batches=2),
        state.params,
        state.opt_state,
        BootstrapBatch(pairs=batch, weights=weights),
        frozen=state.frozen,
    )
    assert {"member_0/loss", "member_2/grad_norm", "nonfinite/members"} <= set(m)


# ----------------------------------------------------------------------------- judge


def _judge_setup(getkey, **kw):
    tok = data.ByteTokenizer()
    cfg = rx.TransformerConfig(
        vocab_size=tok.vocab_size,
        d_model=32,
        n_layers=1,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        max_seq_len=64,
    )
    policy = rx.Policy(cfg, key=getkey())
    template = "Q: {prompt}\nA: {completion}\nOK?"
    kw.setdefault("bucket_size", 64)  # one row length: one compilation per row count
    judge = judge_reward(policy, tok, template=template, yes_token="Y", no_token="N", **kw)
    return tok, policy, template, judge


PROMPTS = ("2+2?", "capital of France?", "3*3?")
ANSWERS = ("4", "Paris, of course", "10")


@eqx.filter_jit
def _full_logits(policy, tokens, mask):
    return jax.vmap(policy)(tokens, mask)


def test_judge_equals_direct_forward_and_batched_equals_one_at_a_time(getkey):
    tok, policy, template, judge = _judge_setup(getkey)
    batched = judge.score(PROMPTS, ANSWERS)
    # a direct forward: the full logits of each text (padded to the longest, not to the
    # judge's bucket), log-softmax in float64 at the last real position
    rows = [
        [tok.bos_id] + tok.encode(template.format(prompt=p, completion=a))
        for p, a in zip(PROMPTS, ANSWERS)
    ]
    T = max(len(r) for r in rows)
    tokens = np.zeros((len(rows), T), np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    mask = np.arange(T)[None, :] < np.asarray([len(r) for r in rows])[:, None]
    logits = np.asarray(_full_logits(policy, jnp.asarray(tokens), jnp.asarray(mask)))
    y, n = tok.encode("Y")[0], tok.encode("N")[0]
    for i, r in enumerate(rows):
        lg = logits[i, len(r) - 1].astype(np.float64)
        logp = lg - np.logaddexp.reduce(lg)
        np.testing.assert_allclose(batched[i], logp[y] - logp[n], rtol=1e-5, atol=1e-5)
    for p, a, s in zip(PROMPTS, ANSWERS, batched):
        np.testing.assert_allclose(judge(p, a), s, rtol=1e-5, atol=1e-6)  # one at a time
    with pytest.raises(ValueError, match="encodes to 3 tokens"):
        judge_reward(policy, tok, template=template, yes_token="Yes", no_token="N")


def test_judge_scores_a_whole_rollout_as_a_reward_function(getkey):
    tok, _, _, judge = _judge_setup(getkey)
    prompts = tuple(p for p in PROMPTS for _ in range(2))
    texts = ANSWERS[:1] + ("5",) + ANSWERS[1:2] + ("Lyon",) + ANSWERS[2:] + ("9",)
    B = len(texts)
    roll = pl.runs.Rollout(
        tokens=jnp.zeros((B, 4), jnp.int32),
        mask=jnp.ones((B, 4), bool),
        completion_mask=jnp.ones((B, 4), bool),
        logprobs=jnp.zeros((B, 4)),
        truncated=jnp.zeros((B,), bool),
        prompts=prompts,
        texts=texts,
        group_size=2,
    )
    rewards, metrics = pl.runs.score_rollout(
        roll, [pl.runs.RewardFunction("judge", judge.for_rollout(roll))]
    )
    want = judge.score(prompts, texts)
    np.testing.assert_allclose(rewards, want, rtol=1e-6)
    one_by_one, _ = pl.runs.score_rollout(roll, [pl.runs.RewardFunction("judge", judge)])
    np.testing.assert_allclose(one_by_one, want, rtol=1e-5, atol=1e-6)
    assert metrics["reward/judge"] == pytest.approx(float(np.mean(want)), rel=1e-6)
    chunked = dataclasses.replace(judge, batch_size=4)  # two passes of 4 rows
    np.testing.assert_allclose(chunked.score(prompts, texts), want, rtol=1e-5, atol=1e-6)


def test_judge_refuses_a_template_that_leaves_no_room_within_max_length(getkey):
    tok, policy, template, judge = _judge_setup(getkey)
    own = 1 + len(tok.encode(template.format(prompt="", completion="")))  # BOS + template
    with pytest.raises(ValueError, match=f"is already {own} tokens.*max_length={own} "):
        judge_reward(policy, tok, template=template, yes_token="Y", no_token="N", max_length=own)
    # one token of room is enough to build it; a function template is not called
    judge_reward(policy, tok, template=template, yes_token="Y", no_token="N", max_length=own + 1)
    judge_reward(
        policy, tok, template=lambda p, c: p.split()[0], yes_token="Y", no_token="N", max_length=2
    )
