"""Per-pair reward margins (TRL's `margin` column): read from JSON lines and Parquet,
carried through tokenising and collating into `PreferenceBatch.margins`, and used by the
reward step as `-log σ(r_c - r_r - m - m_i)`; ignored by DPO."""

import json
import types

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import tiny_policies

import rlhf_eqx as rx
from rlhf_eqx import data
from rlhf_eqx.assets import asset_path
from rlhf_eqx.losses import bradley_terry_loss
from rlhf_eqx.train import make_dpo_step, make_reward_step, reward_loss

TOK = asset_path("tok512.bin")


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _plain(i, **extra):
    return {
        "prompt": f"Once upon a time {i}",
        "chosen": " a dog ran.",
        "rejected": " zzz.",
        **extra,
    }


# ----------------------------------------------------------------------------- readers


def test_jsonl_margins_are_kept_in_every_layout(tmp_path):
    rows = {
        "plain": [_plain(0, margin=1.5), _plain(1, margin=-2)],
        "hh": [
            {
                "chosen": "\n\nHuman: hi\n\nAssistant: yes",
                "rejected": "\n\nHuman: hi\n\nAssistant: no",
                "margin": 0.25,
            }
        ],
        "messages": [
            {
                "prompt": [{"role": "user", "content": "hi"}],
                "chosen": [{"role": "assistant", "content": "yes"}],
                "rejected": [{"role": "assistant", "content": "no"}],
                "margin": 3,
            }
        ],
        "sharegpt": [
            {
                "conversations": [{"from": "human", "value": "hi"}],
                "chosen": {"from": "gpt", "value": "yes"},
                "rejected": {"from": "gpt", "value": "no"},
                "margin": 0.5,
            }
        ],
    }
    expected = {"plain": [1.5, -2.0], "hh": [0.25], "messages": [3.0], "sharegpt": [0.5]}
    for fmt, recs in rows.items():
        ds = data.load_preferences(_write_jsonl(tmp_path / f"{fmt}.jsonl", recs))
        assert ds.report.format == fmt
        assert [r.margin for r in ds] == expected[fmt]
        assert all(isinstance(r.margin, float) for r in ds)


def test_records_without_a_margin_have_none(tmp_path):
    ds = data.load_preferences(_write_jsonl(tmp_path / "p.jsonl", [_plain(0), _plain(1)]))
    assert [r.margin for r in ds] == [None, None]
    assert data.PreferenceRecord("p", " a", " b").margin is None


@pytest.mark.parametrize(
    "value,got",
    [("1.0", "str '1.0'"), (True, "bool True"), (None, "null"), ([1], "list"), ("NaN", "str")],
)
def test_a_margin_that_is_not_a_number_is_refused_naming_file_line_and_column(tmp_path, value, got):
    path = _write_jsonl(tmp_path / "p.jsonl", [_plain(0, margin=1.0), _plain(1, margin=value)])
    with pytest.raises(
        data.DataError, match=r"p\.jsonl:2: .*'margin' must be a finite number"
    ) as e:
        data.load_preferences(path)
    assert got in str(e.value)


def test_a_non_finite_margin_is_refused(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(_plain(0))[:-1] + ', "margin": NaN}\n')
    with pytest.raises(data.DataError, match=r"p\.jsonl:1: .*'margin' must be a finite number"):
        data.load_preferences(path)


def test_lenient_reading_skips_a_bad_margin(tmp_path):
    rows = [_plain(0, margin=1.0), _plain(1, margin="x"), _plain(2, margin=2.0)]
    ds = data.load_preferences(_write_jsonl(tmp_path / "p.jsonl", rows), lenient=True)
    assert [r.margin for r in ds] == [1.0, 2.0]
    assert ds.report.skipped == {"wrong type": 1}


def test_some_pairs_with_a_margin_and_others_without_are_refused(tmp_path):
    rows = [_plain(0, margin=1.0), _plain(1, margin=2.0), _plain(2)]
    with pytest.raises(data.DataError, match=r"p\.jsonl:3: no 'margin'.*p\.jsonl:1 has one"):
        data.load_preferences(_write_jsonl(tmp_path / "p.jsonl", rows))


def test_parquet_margins_and_refusals_name_row_and_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [_plain(i) for i in range(3)]
    table = pa.table({k: [r[k] for r in rows] for k in rows[0]})
    good = table.append_column("margin", pa.array([0.5, 1.0, 2.0], pa.float32()))
    pq.write_table(good, tmp_path / "good.parquet")
    assert [r.margin for r in data.load_preferences(tmp_path / "good.parquet")] == [0.5, 1.0, 2.0]
    bad = table.append_column("margin", pa.array(["1", "2", "3"]))
    pq.write_table(bad, tmp_path / "bad.parquet")
    with pytest.raises(data.DataError, match=r"bad\.parquet: row 0: column 'margin' must be"):
        data.load_preferences(tmp_path / "bad.parquet")
    null = table.append_column("margin", pa.array([0.5, None, 2.0], pa.float64()))
    pq.write_table(null, tmp_path / "null.parquet")
    with pytest.raises(data.DataError, match=r"null\.parquet: row 1: no 'margin'"):
        data.load_preferences(tmp_path / "null.parquet")


# ----------------------------------------------------------------------- tokenise, collate


def test_margins_follow_their_pairs_through_tokenising_and_collating():
    tok = data.load_tokenizer(TOK)
    long = data.PreferenceRecord("Once upon a time " * 20, " a dog.", " a cat.", margin=9.0)
    recs = [long] + [
        data.PreferenceRecord(f"Once upon a time {i}", " a dog.", " zzz.", margin=float(i))
        for i in (1, 2)
    ]
    pairs, report = data.tokenize_preferences(
        recs, tok, max_length=32, max_prompt_length=16, truncation="drop"
    )
    assert report.dropped == {"too long": 1}
    assert [p.margin for p in pairs] == [1.0, 2.0]  # the dropped record's margin went with it
    batch = data.collate_preferences(pairs, pad_id=tok.pad_id, max_length=32)
    assert batch.margins.dtype == jnp.float32 and batch.margins.shape == (2,)
    np.testing.assert_array_equal(np.asarray(batch.margins), [1.0, 2.0])
    plain = [data.PreferenceRecord(r.prompt, r.chosen, r.rejected) for r in recs[1:]]
    pairs, _ = data.tokenize_preferences(plain, tok, max_length=32, max_prompt_length=16)
    assert data.collate_preferences(pairs, pad_id=tok.pad_id, max_length=32).margins is None
    mixed = [pairs[0], data.TokenizedPair(pairs[1].chosen, pairs[1].rejected, margin=1.0)]
    with pytest.raises(data.DataError, match="pair 0 has no margin, though pair 1 has one"):
        data.collate_preferences(mixed, pad_id=tok.pad_id, max_length=32)


def test_a_record_object_with_a_bad_margin_is_refused():
    tok = data.load_tokenizer(TOK)
    bad = types.SimpleNamespace(
        prompt="Once upon", chosen=" a dog.", rejected=" a cat.", margin="1"
    )
    with pytest.raises(data.DataError, match="preference record 0 has margin '1'"):
        data.tokenize_preferences([bad], tok, max_length=32, max_prompt_length=16)


def test_preference_batch_checks_its_margins():
    tokens = jnp.ones((2, 4), jnp.int32)
    mask = jnp.ones((2, 4), bool)
    kw = dict(
        chosen_tokens=tokens,
        chosen_mask=mask,
        chosen_completion_mask=mask,
        rejected_tokens=tokens,
        rejected_mask=mask,
        rejected_completion_mask=mask,
    )
    assert rx.PreferenceBatch(**kw).margins is None
    assert rx.PreferenceBatch(**kw, margins=jnp.zeros((2,))).margins.shape == (2,)
    with pytest.raises((data.DataError, TypeError), match="margins|B"):
        rx.PreferenceBatch(**kw, margins=jnp.zeros((3,)))
    with pytest.raises((data.DataError, TypeError)):
        rx.PreferenceBatch(**kw, margins=jnp.zeros((2,), jnp.int32))


# ----------------------------------------------------------------------------- the loss


class _BagReward(eqx.Module):
    """`r(x) = Σ_t w[x_t]` over the real tokens: a reward whose gradient is closed-form."""

    w: jax.Array

    def __call__(self, tokens, mask):
        return jnp.sum(jnp.where(mask, self.w[tokens], 0.0))


def _tiny_pairs(margins=None):
    c = jnp.asarray([[1, 2, 3, 0], [1, 4, 4, 4], [2, 2, 0, 0]], jnp.int32)
    r = jnp.asarray([[1, 2, 5, 5], [1, 3, 0, 0], [2, 5, 5, 0]], jnp.int32)
    cm, rm = c > 0, r > 0
    return rx.PreferenceBatch(c, cm, cm, r, rm, rm, margins=margins)


def _counts(tokens, mask, vocab):
    return np.stack([np.bincount(t[m], minlength=vocab) for t, m in zip(tokens, mask)]).astype(
        np.float64
    )


def test_reward_step_with_margins_matches_float64_formula_and_gradient():
    w = np.asarray([0.0, 0.3, -0.2, 0.5, 0.1, -0.4], np.float64)
    model = _BagReward(jnp.asarray(w, jnp.float32))
    margins = np.asarray([0.5, -1.0, 2.0], np.float64)
    batch = _tiny_pairs(jnp.asarray(margins, jnp.float32))
    m0, lam = 0.25, 0.01
    step = make_reward_step(optax.sgd(1.0), margin=m0, center_coef=lam, donate=False)
    opt_state = optax.sgd(1.0).init(model)
    new, _, metrics = step(model, opt_state, batch)
    # float64 reference: L = mean_i -log σ(d_i) + λ (r_c + r_r)^2, d_i = r_c - r_r - m - m_i
    cc = _counts(np.asarray(batch.chosen_tokens), np.asarray(batch.chosen_mask), 6)
    cr = _counts(np.asarray(batch.rejected_tokens), np.asarray(batch.rejected_mask), 6)
    rc, rr = cc @ w, cr @ w
    d = rc - rr - m0 - margins
    loss = np.mean(np.log1p(np.exp(-d)) + lam * (rc + rr) ** 2)
    sig_neg = 1.0 / (1.0 + np.exp(d))  # σ(-d) = -∂(-log σ(d))/∂d
    grad = np.mean(-sig_neg[:, None] * (cc - cr) + 2 * lam * (rc + rr)[:, None] * (cc + cr), 0)
    np.testing.assert_allclose(float(metrics["loss"]), loss, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(model.w - new.w, np.float64), grad, rtol=1e-5, atol=1e-7)
    # the margins change the loss (it is not the scalar margin's alone)
    none = step(model, opt_state, _tiny_pairs())[2]
    assert abs(float(none["loss"]) - float(metrics["loss"])) > 1e-2
    # metrics of the scores are those of the batch without margins
    for name in ("accuracy", "margin", "rewards/chosen", "rewards/rejected"):
        assert float(none[name]) == float(metrics[name])


def test_constant_margins_equal_the_scalar_margin_and_no_margins_are_unchanged():
    model = _BagReward(jnp.linspace(-0.5, 0.5, 6))
    loss = lambda b, **kw: reward_loss(**kw)(model, None, b, None)
    with_c = loss(_tiny_pairs(jnp.full((3,), 0.7)), margin=0.3)
    scalar = loss(_tiny_pairs(), margin=1.0)
    np.testing.assert_allclose(float(with_c[0]["bt"]), float(scalar[0]["bt"]), rtol=1e-6)
    # no margins: the sums of bradley_terry_loss with the scalar margin, bit for bit
    b = _tiny_pairs()
    rc, rr = (
        jax.vmap(model)(b.chosen_tokens, b.chosen_mask),
        jax.vmap(model)(b.rejected_tokens, b.rejected_mask),
    )
    per = jax.vmap(lambda x, y: bradley_terry_loss(x, y, margin=1.0, center_coef=0.0))(rc, rr)
    assert np.array_equal(np.asarray(scalar[0]["bt"]), np.asarray(jnp.sum(per)))


def test_an_ensembles_members_read_the_margins():
    # constant per-pair margins c at scalar margin 0 == no margins at scalar margin c,
    # every member; other margins change each member's loss
    from rlhf_eqx.train import (
        BootstrapBatch,
        init_ensemble_state,
        make_ensemble,
        make_ensemble_reward_step,
    )

    make = lambda k: _BagReward(0.3 * jax.random.normal(k, (6,)))  # noqa: E731
    ensemble = make_ensemble(make, jax.random.split(jax.random.key(0), 2), filter_spec=True)
    opt = optax.sgd(0.1)
    weights = jnp.asarray([[1.0, 2.0], [1.0, 0.0], [1.0, 1.0]])

    def losses(pairs, margin):
        step = make_ensemble_reward_step(opt, members=2, margin=margin, donate=False)
        _, m = init_ensemble_state(ensemble, opt).apply(step, BootstrapBatch(pairs, weights))
        return [float(m[f"member_{k}/loss"]) for k in range(2)]

    with_c = losses(_tiny_pairs(jnp.full((3,), 0.7)), 0.0)
    np.testing.assert_allclose(with_c, losses(_tiny_pairs(), 0.7), rtol=1e-6)
    other = losses(_tiny_pairs(jnp.asarray([2.0, -1.0, 0.5])), 0.0)
    assert all(abs(a - b) > 1e-3 for a, b in zip(other, with_c))


def test_micro_batches_split_the_margins():
    model = _BagReward(jnp.linspace(-0.5, 0.5, 6))
    batch = _tiny_pairs(jnp.asarray([0.5, -1.0, 2.0]))
    batch = jax.tree.map(lambda x: jnp.concatenate([x, x[:1]]), batch)  # B = 4
    opt_state = optax.sgd(1.0).init(model)
    full = make_reward_step(optax.sgd(1.0), donate=False)(model, opt_state, batch)
    micro = make_reward_step(optax.sgd(1.0), micro_batches=2, donate=False)(model, opt_state, batch)
    np.testing.assert_allclose(np.asarray(micro[0].w), np.asarray(full[0].w), atol=1e-6)
    np.testing.assert_allclose(float(micro[2]["loss"]), float(full[2]["loss"]), rtol=1e-6)


def test_dpo_ignores_the_margins():
    (policy,) = tiny_policies(16, 0)
    (reference,) = tiny_policies(16, 1)
    batch = _tiny_pairs()
    with_m = eqx.tree_at(
        lambda b: b.margins, batch, jnp.asarray([5.0, -3.0, 1.0]), is_leaf=lambda x: x is None
    )
    step = make_dpo_step(optax.sgd(1.0), beta=0.1, donate=False)
    opt_state = optax.sgd(1.0).init(eqx.filter(policy, eqx.is_inexact_array))
    a = step(policy, opt_state, batch, reference=reference)
    b = step(policy, opt_state, with_m, reference=reference)
    assert float(a[2]["loss"]) == float(b[2]["loss"])
    for x, y in zip(
        jax.tree.leaves(eqx.filter(a[0], eqx.is_array)),
        jax.tree.leaves(eqx.filter(b[0], eqx.is_array)),
    ):
        assert np.array_equal(np.asarray(x), np.asarray(y))


# ----------------------------------------------------------------------------- the stage


@pytest.mark.slow
def test_reward_stage_on_a_file_with_margins_reports_them(tmp_path, capsys):
    from rlhf_eqx import pipelines as pl
    from rlhf_eqx.__main__ import main

    rows = [_plain(i, margin=float(i % 3)) for i in range(40)]
    path = _write_jsonl(tmp_path / "pairs.jsonl", rows)
    out = tmp_path / "run"
    argv = ["reward", "--data", str(path), "--out", str(out), "--set", "reward.steps=2"]
    assert main([*argv, "--set", "ops.quiet=true", "--set", "ops.monitor=false"]) == 0
    rm = json.loads((out / "summary.json").read_text())["reward_model"]
    assert rm["margins"]["min"] == 0.0 and rm["margins"]["max"] == 2.0
    assert rm["margins"]["pairs"] == rm["train_pairs"] + rm["validation_pairs"]
    events = [r for r in pl.tools.read_records(str(out)) if r.get("event") == "margins"]
    assert len(events) == 1 and "per-pair margins read" in events[0]["message"]
    # an ensemble's members train on the margins too
    argv = ["reward", "--data", str(path), "--out", str(tmp_path / "ens"), "--quiet"]
    assert main([*argv, "--set", "reward.steps=2", "--set", "reward.ensemble=2"]) == 0


def test_a_margin_column_of_another_name_is_mapped(tmp_path):
    rows = [_plain(i) | {"gap": float(i)} for i in range(3)]
    path = _write_jsonl(tmp_path / "gap.jsonl", rows)
    pairs = data.load_preferences(path, columns={"margin": "gap"})
    assert [p.margin for p in pairs] == [0.0, 1.0, 2.0]
