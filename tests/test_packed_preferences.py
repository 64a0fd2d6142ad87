"""Shared-prompt packing: a `PackedPreferenceBatch` gives the losses, gradients and
metrics of the unpacked `PreferenceBatch`, for the DPO family and the reward model."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_tree_allclose
from hypothesis import given, settings, strategies as st

import rlhf_eqx as rx
from rlhf_eqx import data, train

V = 37


def tiny_cfg(**kw):
    base = dict(
        vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=128
    )
    base.update(kw)
    return rx.TransformerConfig(**base)


def make_pairs(seed, n, *, max_prompt=9, max_completion=7, merged=False):
    """Random pairs: prompts of 1..max_prompt tokens, completions of 1..max_completion.
    With `merged`, some rejected prompts differ in their last token (a token merged
    across the prompt/completion boundary)."""
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(n):
        prompt = tuple(int(t) for t in rng.integers(3, V, rng.integers(1, max_prompt + 1)))
        c = tuple(int(t) for t in rng.integers(3, V, rng.integers(1, max_completion + 1)))
        r = tuple(int(t) for t in rng.integers(3, V, rng.integers(1, max_completion + 1)))
        r_prompt = prompt
        if merged and len(prompt) > 1 and rng.random() < 0.5:
            r_prompt = prompt[:-1] + ((prompt[-1] + 1 - 3) % (V - 3) + 3,)
        pairs.append(
            data.TokenizedPair(
                chosen=data.TokenizedSequence(prompt=prompt, completion=c),
                rejected=data.TokenizedSequence(prompt=r_prompt, completion=r),
            )
        )
    return pairs


def unpacked(pairs):
    return data.collate_preferences(pairs, pad_id=0, max_length=32, bucket_size=8)


@eqx.filter_jit
def per_pair(policy, batch):
    """Summed completion log-probs of each pair from the unpacked rows (full logits)."""
    c = train.sequence_logps(
        lambda t, m: policy(t, m),
        batch.chosen_tokens,
        batch.chosen_mask,
        batch.chosen_completion_mask,
    )
    r = train.sequence_logps(
        lambda t, m: policy(t, m),
        batch.rejected_tokens,
        batch.rejected_mask,
        batch.rejected_completion_mask,
    )
    return c, r


@pytest.mark.parametrize("merged", [False, True])
def test_packed_logps_equal_unpacked(getkey, merged):
    policy = rx.Policy(tiny_cfg(), key=getkey())
    pairs = make_pairs(0, 6, merged=merged)
    c, r = per_pair(policy, unpacked(pairs))
    for K, bucket, aligned in ((1, None, False), (3, 16, False), (1, 4, True)):
        packed = data.pack_preferences(
            pairs, pad_id=0, pairs_per_row=K, bucket_size=bucket, aligned=aligned
        )
        ref = train.compute_reference_logps(policy, packed)
        got_c, got_r = np.asarray(ref.ref_chosen_logp), np.asarray(ref.ref_rejected_logp)
        # map slots back to pairs: each slot's chosen completion identifies its pair
        tokens, seg, br, present = (
            np.asarray(x)
            for x in (packed.tokens, packed.segment_ids, packed.branch_ids, packed.pairs)
        )
        seen = set()
        for row in range(present.shape[0]):
            for k in range(present.shape[1]):
                if not present[row, k]:
                    assert got_c[row, k] == 0.0 and got_r[row, k] == 0.0
                    continue
                comp = tuple(
                    tokens[row][(seg[row] == k) & (br[row] == 1) & np.asarray(packed.mask[row])]
                )
                i = next(
                    j
                    for j, p in enumerate(pairs)
                    if comp == (p.chosen.prompt + p.chosen.completion)[-len(comp) :]
                    and j not in seen
                )
                seen.add(i)
                np.testing.assert_allclose(got_c[row, k], c[i], rtol=1e-5, atol=1e-5)
                np.testing.assert_allclose(got_r[row, k], r[i], rtol=1e-5, atol=1e-5)
        assert seen == set(range(len(pairs)))


def test_packing_saves_the_prompt_and_layout():
    pairs = make_pairs(1, 5)
    packed = data.pack_preferences(pairs, pad_id=0)
    sizes = [data.packed_length(p) for p in pairs]
    assert packed.tokens.shape == (5, max(sizes))
    for i, p in enumerate(pairs):
        assert sizes[i] == len(p.chosen) + len(p.rejected) - len(p.chosen.prompt)
        row = np.asarray(packed.tokens[i])[np.asarray(packed.mask[i])]
        expected = p.chosen.prompt + p.chosen.completion + p.rejected.completion
        assert tuple(row) == expected
        scored = np.asarray(packed.completion_mask[i])[np.asarray(packed.mask[i])]
        assert scored.sum() == len(p.chosen.completion) + len(p.rejected.completion)
    several = data.pack_preferences(pairs, pad_id=0, pairs_per_row=4, row_length=64)
    assert several.tokens.shape[0] < 5 and int(several.pairs.sum()) == 5
    fixed = data.pack_preferences(pairs, pad_id=0, pairs_per_row=4, row_length=64, num_rows=4)
    assert fixed.tokens.shape == (4, 64)


def test_aligned_layout_has_fixed_regions():
    pairs = make_pairs(9, 4)
    packed = data.pack_preferences(pairs, pad_id=0, aligned=True, bucket_size=4)
    P, C, R = packed.regions
    assert packed.tokens.shape == (4, P + C + R) and P % 4 == C % 4 == R % 4 == 0
    for i, p in enumerate(pairs):
        tok, m = np.asarray(packed.tokens[i]), np.asarray(packed.mask[i])
        assert tuple(tok[:P][m[:P]]) == p.chosen.prompt
        assert tuple(tok[P : P + C][m[P : P + C]]) == p.chosen.completion
        assert tuple(tok[P + C :][m[P + C :]]) == p.rejected.completion
    fields = {
        f: getattr(packed, f)
        for f in ("tokens", "mask", "completion_mask", "segment_ids", "branch_ids", "pairs")
    }
    with pytest.raises(data.DataError, match="regions"):
        rx.PackedPreferenceBatch(**fields, regions=(P, C, R + 1))


def test_packing_errors_name_the_problem():
    pairs = make_pairs(2, 3)
    with pytest.raises(data.DataError, match="pair 0 takes .* tokens packed"):
        data.pack_preferences(pairs, pad_id=0, row_length=2)
    with pytest.raises(data.DataError, match="num_rows=1"):
        data.pack_preferences(pairs, pad_id=0, pairs_per_row=1, num_rows=1)
    with pytest.raises(data.DataError, match="pairs_per_row must be a positive int"):
        data.pack_preferences(pairs, pad_id=0, pairs_per_row=0)
    with pytest.raises(data.DataError, match="token id 99"):
        data.pack_preferences(
            make_pairs(3, 2)
            + [
                data.TokenizedPair(
                    chosen=data.TokenizedSequence(prompt=(1,), completion=(99,)),
                    rejected=data.TokenizedSequence(prompt=(1,), completion=(5,)),
                )
            ],
            pad_id=0,
            vocab_size=V,
        )
    with pytest.raises(data.DataError, match="empty"):
        data.pack_preferences([], pad_id=0)
    batch = data.pack_preferences(pairs, pad_id=0)
    fields = {
        f: getattr(batch, f)
        for f in ("tokens", "mask", "completion_mask", "segment_ids", "branch_ids")
    }
    # the shape check (jaxtyping, when on) or the batch's own check names the field
    with pytest.raises((data.DataError, TypeError), match="pairs"):
        rx.PackedPreferenceBatch(**fields, pairs=batch.pairs[:2])
    with pytest.raises((data.DataError, TypeError), match="ref_chosen_logp"):
        rx.PackedPreferenceBatch(**fields, pairs=batch.pairs, ref_chosen_logp=jnp.zeros(3))


def _dpo_step(**kw):
    return train.make_dpo_step(optax.sgd(0.1), **kw)


@pytest.mark.parametrize(
    "loss_type, reference, rpo_alpha, aligned",
    [
        ("sigmoid", "model", None, False),
        ("ipo", "cached", 0.5, True),
        ("simpo", "none", None, False),
    ],
)
def test_packed_dpo_step_equals_unpacked(getkey, loss_type, reference, rpo_alpha, aligned):
    policy = rx.Policy(tiny_cfg(), key=getkey())
    ref_model = rx.Policy(tiny_cfg(), key=getkey())
    pairs = make_pairs(4, 6, merged=True)
    plain = unpacked(pairs)
    if aligned:
        packed = data.pack_preferences(pairs, pad_id=0, aligned=True, num_rows=7)
    else:
        packed = data.pack_preferences(pairs, pad_id=0, pairs_per_row=2, row_length=48, num_rows=4)
    if reference == "cached":
        plain = train.compute_reference_logps(ref_model, plain)
        packed = train.compute_reference_logps(ref_model, packed)
    step = _dpo_step(loss_type=loss_type, reference=reference, rpo_alpha=rpo_alpha)
    extra = {"reference": ref_model} if reference == "model" else {}
    opt = optax.sgd(0.1).init(eqx.filter(policy, eqx.is_array))
    p1, _, m1 = step(policy, opt, plain, **extra)
    p2, _, m2 = step(policy, opt, packed, **extra)
    for name in m1:
        np.testing.assert_allclose(m2[name], m1[name], rtol=2e-4, atol=2e-5, err_msg=name)
    assert_tree_allclose(p2, p1, rtol=1e-4, atol=1e-6)


def test_packed_dpo_micro_batches_equal_full(getkey):
    policy = rx.Policy(tiny_cfg(), key=getkey())
    pairs = make_pairs(5, 7)
    packed = data.pack_preferences(pairs, pad_id=0, pairs_per_row=2, row_length=48, num_rows=6)
    opt = optax.sgd(0.1).init(eqx.filter(policy, eqx.is_array))
    full = _dpo_step(reference="none")(policy, opt, packed)
    micro = _dpo_step(reference="none", micro_batches=3)(policy, opt, packed)
    assert_tree_allclose(micro[0], full[0], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(micro[2]["loss"], full[2]["loss"], rtol=1e-5)


def test_packed_batch_refuses_what_it_cannot_run(getkey):
    pairs = make_pairs(6, 3)
    packed = data.pack_preferences(pairs, pad_id=0)
    policy = rx.Policy(tiny_cfg(), key=getkey())
    opt = optax.sgd(0.1).init(eqx.filter(policy, eqx.is_array))
    with pytest.raises(ValueError, match="sorts over the pairs"):
        _dpo_step(loss_type="aot", reference="none")(policy, opt, packed)

    class Plain(eqx.Module):
        policy: rx.Policy

        def __call__(self, tokens, mask, *, key=None):
            return self.policy(tokens, mask)

    plain = Plain(policy)
    with pytest.raises(ValueError, match="AbstractSelectiveLM"):
        _dpo_step(reference="none")(
            plain, optax.sgd(0.1).init(eqx.filter(plain, eqx.is_array)), packed
        )


@pytest.mark.parametrize("aligned", [False, True])
def test_packed_reward_step_equals_unpacked(getkey, aligned):
    rm = rx.RewardModel(tiny_cfg(), key=getkey())
    pairs = make_pairs(7, 6, merged=True)
    plain = unpacked(pairs)
    if aligned:
        packed = data.pack_preferences(pairs, pad_id=0, aligned=True, bucket_size=4)
    else:
        packed = data.pack_preferences(pairs, pad_id=0, pairs_per_row=3, row_length=72, num_rows=3)
    step = train.make_reward_step(optax.sgd(0.1), center_coef=0.01)
    opt = optax.sgd(0.1).init(eqx.filter(rm, eqx.is_array))
    p1, _, m1 = step(rm, opt, plain)
    p2, _, m2 = step(rm, opt, packed)
    for name in m1:
        np.testing.assert_allclose(m2[name], m1[name], rtol=2e-4, atol=2e-5, err_msg=name)
    assert_tree_allclose(p2, p1, rtol=1e-4, atol=1e-6)


def test_packed_from_preferences_round_trip(getkey):
    policy = rx.Policy(tiny_cfg(), key=getkey())
    pairs = make_pairs(8, 4)
    plain = train.compute_reference_logps(policy, unpacked(pairs))
    packed = data.packed_from_preferences(plain, bucket_size=8)
    direct = data.pack_preferences(pairs, pad_id=0, bucket_size=8)
    np.testing.assert_array_equal(packed.tokens, direct.tokens)
    np.testing.assert_allclose(packed.ref_chosen_logp[:, 0], plain.ref_chosen_logp)
    again = train.compute_reference_logps(policy, direct)
    np.testing.assert_allclose(again.ref_chosen_logp, packed.ref_chosen_logp, rtol=1e-5, atol=1e-5)


@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    K=st.sampled_from([1, 3, "aligned"]),
    sliding=st.sampled_from([None, 3]),
)
def test_packed_selected_logprobs_property(seed, K, sliding):
    """Any pairs, one or several per row, global or sliding-window attention: packed ==
    unpacked (fixed shapes, so that examples share compilations)."""
    policy = rx.Policy(tiny_cfg(sliding_window=sliding), key=jax.random.key(0))
    pairs = make_pairs(seed, 5, max_prompt=6, max_completion=5, merged=seed % 2 == 0)
    plain = data.collate_preferences(pairs, pad_id=0, max_length=16)
    c, r = per_pair(policy, plain)
    if K == "aligned":
        packed = data.pack_preferences(pairs, pad_id=0, aligned=True, bucket_size=8)
    else:
        packed = data.pack_preferences(pairs, pad_id=0, pairs_per_row=K, row_length=48, num_rows=5)
    packed = train.compute_reference_logps(policy, packed)
    present = np.asarray(packed.pairs)
    got = np.sort(np.asarray(packed.ref_chosen_logp)[present])
    np.testing.assert_allclose(got, np.sort(np.asarray(c)), rtol=1e-4, atol=1e-4)
    got = np.sort(np.asarray(packed.ref_rejected_logp)[present])
    np.testing.assert_allclose(got, np.sort(np.asarray(r)), rtol=1e-4, atol=1e-4)


def _slot_contents(batch):
    """The packed tokens `shared + chosen + rejected` of every present pair slot."""
    tokens, mask, seg, present = (
        np.asarray(x) for x in (batch.tokens, batch.mask, batch.segment_ids, batch.pairs)
    )
    return [
        tuple(tokens[r][(seg[r] == k) & mask[r]])
        for r in range(present.shape[0])
        for k in range(present.shape[1])
        if present[r, k]
    ]


def test_preference_steps_hold_every_pair_once_in_one_shape():
    pairs = make_pairs(7, 23)
    steps = data.pack_preference_steps(pairs, pad_id=0, row_length=40, rows_per_step=3, seed=1)
    assert {b.tokens.shape for b in steps} == {(3, 40)}
    assert {b.pairs.shape for b in steps} == {(3, 4)}
    expected = sorted(p.chosen.prompt + p.chosen.completion + p.rejected.completion for p in pairs)
    assert sorted(t for b in steps for t in _slot_contents(b)) == expected
    # rows never overflow and the slots of a row are its segments, in order
    for b in steps:
        assert int(jnp.max(b.segment_ids)) < 4
        assert np.all(np.asarray(b.mask).sum(axis=1) <= 40)
    # fewer rows (less padding) than one pair per row, with a filler row or two at the end
    assert len(steps) * 3 < len(pairs)
    assert not np.asarray(steps[-1].pairs).all()
    # pairs_per_step: the rows split evenly, about that many pairs a step
    even = data.pack_preference_steps(pairs, pad_id=0, row_length=40, pairs_per_step=6, seed=1)
    n_rows = sum(int(np.asarray(b.mask).any(axis=1).sum()) for b in steps)
    assert even[0].tokens.shape[0] == round(n_rows * 6 / len(pairs))
    again = data.pack_preference_steps(pairs, pad_id=0, row_length=40, rows_per_step=3, seed=1)
    assert [_slot_contents(b) for b in again] == [_slot_contents(b) for b in steps]
    ordered = data.pack_preference_steps(pairs, pad_id=0, row_length=40, rows_per_step=3, seed=None)
    longest = max(pairs, key=data.packed_length)
    assert _slot_contents(ordered[0])[0] == (
        longest.chosen.prompt + longest.chosen.completion + longest.rejected.completion
    )


def test_preference_steps_errors_name_the_problem():
    pairs = make_pairs(8, 4)
    sizes = [data.packed_length(p) for p in pairs]
    L = max(sizes) - 1
    first = next(i for i, n in enumerate(sizes) if n > L)
    message = f"pair {first} takes {sizes[first]} .* row_length={L}"
    with pytest.raises(data.DataError, match=message):
        data.pack_preference_steps(pairs, pad_id=0, row_length=L, rows_per_step=2)
    with pytest.raises(data.DataError, match="rows_per_step must be a positive int"):
        data.pack_preference_steps(pairs, pad_id=0, row_length=40, rows_per_step=0)
    with pytest.raises(data.DataError, match="one of rows_per_step and pairs_per_step"):
        data.pack_preference_steps(pairs, pad_id=0, row_length=40)
    with pytest.raises((data.DataError, TypeError), match="seed"):
        data.pack_preference_steps(pairs, pad_id=0, row_length=40, rows_per_step=2, seed=1.5)
    with pytest.raises(data.DataError, match="empty"):
        data.pack_preference_steps([], pad_id=0, row_length=40, rows_per_step=2)


def test_preference_steps_dpo_equals_the_unpacked_batch(getkey):
    """Steps of different pair counts: each averages over its own pairs, so the updates
    weighted by pair count add up to the update of the whole unpacked batch (SGD, lr 1)."""
    policy = rx.Policy(tiny_cfg(), key=getkey())
    ref_model = rx.Policy(tiny_cfg(), key=getkey())
    pairs = make_pairs(9, 9, merged=True)
    step = train.make_dpo_step(optax.sgd(1.0), reference="model")
    opt = optax.sgd(1.0).init(eqx.filter(policy, eqx.is_array))
    full, _, m_full = step(policy, opt, unpacked(pairs), reference=ref_model)
    steps = data.pack_preference_steps(
        pairs, pad_id=0, row_length=32, rows_per_step=2, pairs_per_row=3
    )
    assert len({int(b.pairs.sum()) for b in steps}) > 1  # the pair count varies
    arrays = lambda m: eqx.filter(m, eqx.is_array)
    delta, loss = None, 0.0
    for b in steps:
        p, _, m = step(policy, opt, b, reference=ref_model)
        n = int(b.pairs.sum())
        d = jax.tree.map(lambda a, c: n * (a - c), arrays(policy), arrays(p))
        delta = d if delta is None else jax.tree.map(jnp.add, delta, d)
        loss += n * float(m["loss"])
    np.testing.assert_allclose(loss / len(pairs), m_full["loss"], rtol=1e-5)
    want = jax.tree.map(lambda a, c: a - c, arrays(policy), arrays(full))
    mean = jax.tree.map(lambda x: x / len(pairs), delta)
    assert_tree_allclose(mean, want, rtol=1e-4, atol=1e-6)
