"""Offline DPO computes each batch's reference log-probabilities when the batch is first
used (`referenced_batches`, `referenced_rows`): the values equal those computed up
front, later epochs reuse them, and a run shorter than an epoch computes no more than
it trains on."""

import jax
import numpy as np
import pytest

import rlhf_eqx as rx
from rlhf_eqx import data, pipelines as pl
from rlhf_eqx.pipelines.loop import (
    collate_pairs,
    referenced_batches,
    referenced_rows,
    rows_at,
    shuffled_batches,
    take_rows,
)

WORDS = ["cat", "dog", "sun", "ball", "tree", "park", "bird", "cake"]


@pytest.fixture(scope="module")
def setup():
    policy, tok = pl.tools.load_model("builtin")
    pairs = [
        data.PreferenceRecord(
            f"Once upon a time {WORDS[i % 8]}",
            f" a {WORDS[(i + 1) % 8]}",
            f" the {WORDS[(i + 3) % 8]}.",
        )
        for i in range(10)
    ]
    return policy, tok, pairs


def _counting(monkeypatch):
    calls = []
    real = rx.train.compute_reference_logps

    def counted(reference, batch):
        calls.append(jax.tree.leaves(batch)[0].shape[0])
        return real(reference, batch)

    monkeypatch.setattr(rx.train, "compute_reference_logps", counted)
    return calls


def test_rows_match_up_front_and_are_computed_once(setup, monkeypatch):
    policy, tok, pairs = setup
    full = collate_pairs(pairs, tok, max_length=24, prompt_length=12)
    eager = rx.train.compute_reference_logps(policy, full)
    calls = _counting(monkeypatch)
    at = referenced_rows(policy, full, 4, seed=0)
    for i in range(6):  # 2 batches an epoch (10 // 4): three epochs
        b = at(i)
        idx = rows_at(10, 4, 0, i)
        want = take_rows(eager, idx)
        np.testing.assert_allclose(b.ref_chosen_logp, want.ref_chosen_logp, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(
            b.ref_rejected_logp, want.ref_rejected_logp, rtol=1e-5, atol=1e-5
        )
        np.testing.assert_array_equal(b.chosen_tokens, want.chosen_tokens)
    # each new batch touches unseen rows; rows seen before come from the cache
    seen: set[int] = set()
    expected = 0
    for i in range(6):
        idx = set(rows_at(10, 4, 0, i).tolist())
        if not idx <= seen:
            expected += 1
        seen |= idx
    assert len(calls) == expected < 6


def test_batches_match_up_front_and_short_runs_compute_less(setup, monkeypatch):
    policy, tok, pairs = setup
    cfg = pl.DPOConfig(batch_size=4, max_length=24, packing=True)
    batches = pl.runs.packed_steps(pairs, tok, cfg=cfg, prompt_length=12, seed=0)
    eager = [rx.train.compute_reference_logps(policy, b) for b in batches]
    order = shuffled_batches(eager, 0)
    calls = _counting(monkeypatch)
    at = referenced_batches(policy, batches, seed=0)
    n = len(batches)
    b = at(0)
    assert len(calls) == 1 <= n
    np.testing.assert_array_equal(b.ref_chosen_logp, order(0).ref_chosen_logp)
    for i in range(2 * n):
        b = at(i)
        np.testing.assert_array_equal(b.ref_rejected_logp, order(i).ref_rejected_logp)
    assert len(calls) == n  # one forward per batch over two epochs


def test_run_dpo_short_run_does_not_score_every_pair(setup, monkeypatch, tmp_path):
    policy, tok, pairs = setup
    calls = _counting(monkeypatch)
    cfg = pl.DPOConfig(steps=1, batch_size=4, max_length=24)
    ops = pl.OpsConfig(monitor=False)
    log = pl.tools.MetricsLog(str(tmp_path), "dpo", quiet=True)
    ctx = pl.RunContext(ops=ops, log=log, key=jax.random.key(0), prompt_length=12)
    res = pl.runs.run_dpo(policy, tok, pairs, cfg=cfg, ctx=ctx)
    assert calls == [4]  # one batch of 4 rows, not all 10 pairs
    assert np.isfinite(res.history[-1]["loss"])
