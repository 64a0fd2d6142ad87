"""SFT on packed rows (`data.pack_sft`, `PackedSequenceBatch`; TRL's `SFTConfig.packing`
with `packing_strategy="bfd"` and `padding_free`): best-fit decreasing rows, the step's
loss, metrics and update equal to the same sequences padded one a row in every
aggregation mode, with and without LoRA, and `sft.packing` in the pipeline."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_tree_allclose, tiny_policies

import rlhf_eqx as rx
from rlhf_eqx import data, pipelines as pl, train
from rlhf_eqx.assets import asset_path

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
VOCAB = 16
L = 24


def _seq(sizes, *, start=1, completion_mask=None):
    """A sequence of `sizes = (prompt, completion)` ids counting up from `start`."""
    p, c = sizes
    ids = [start + i for i in range(p + c)]
    return data.TokenizedSequence(tuple(ids[:p]), tuple(ids[p:]), completion_mask)


def _mixed(seed: int, n: int = 9) -> list[data.TokenizedSequence]:
    """Sequences of many lengths: some with no prompt (their first token is trained),
    one with untrained completion tokens (a conversation's), one with no completion."""
    rng = np.random.default_rng(seed)
    seqs = []
    for i in range(n):
        p = 0 if i % 4 == 1 else int(rng.integers(1, 6))
        c = 0 if i == 5 else int(rng.integers(1, L - p - 4))
        ids = [int(t) for t in rng.integers(1, VOCAB, p + c)]
        flags = None
        if i == 2 and c >= 2:
            flags = tuple(bool(j % 2 == 0) for j in range(c))
        seqs.append(data.TokenizedSequence(tuple(ids[:p]), tuple(ids[p:]), flags))
    return seqs


def _slots(batch: data.PackedSequenceBatch) -> list[list[tuple]]:
    """Each row's sequences (their ids), slot by slot."""
    tokens, seg = np.asarray(batch.tokens), np.asarray(batch.segment_ids)
    K = batch.sequences.shape[-1]
    return [
        [tuple(int(t) for t in tokens[r][seg[r] == k]) for k in range(K) if batch.sequences[r, k]]
        for r in range(tokens.shape[0])
    ]


def test_pack_sft_is_best_fit_decreasing():
    sizes = [5, 8, 1, 7, 4]  # first fit would put the 1 in the row of the 8
    seqs = [_seq((1, n - 1), start=10 * i + 1) for i, n in enumerate(sizes)]
    batch = data.pack_sft(seqs, max_length=10, pad_id=0)
    ids = [tuple(s.prompt + s.completion) for s in seqs]
    assert _slots(batch) == [[ids[1]], [ids[3]], [ids[0], ids[4], ids[2]]]
    assert batch.tokens.shape == (3, 10) and batch.sequences.shape == (3, 3)
    seg = np.asarray(batch.segment_ids)
    np.testing.assert_array_equal(seg[2], [0] * 5 + [1] * 4 + [2])
    np.testing.assert_array_equal(seg[0], [0] * 8 + [3, 3])  # padding: segment K, masked
    np.testing.assert_array_equal(np.asarray(batch.mask).sum(1), [8, 7, 10])
    np.testing.assert_array_equal(np.asarray(batch.tokens)[0, 8:], [0, 0])
    # each sequence's prompt token is untrained, its completion trained
    np.testing.assert_array_equal(
        np.asarray(batch.completion_mask)[2], [0, 1, 1, 1, 1, 0, 1, 1, 1, 0]
    )
    again = data.pack_sft(seqs, max_length=10, pad_id=0)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(batch), jax.tree.leaves(again)))
    capped = data.pack_sft(seqs, max_length=10, pad_id=0, sequences_per_row=2, num_rows=5)
    assert capped.sequences.shape == (5, 2) and not np.asarray(capped.mask)[4].any()
    assert sorted(t for row in _slots(capped) for t in row) == sorted(ids)


def test_pack_sft_refusals_name_the_problem():
    seqs = [_seq((2, 3)), _seq((4, 9))]
    with pytest.raises(data.DataError, match=r"sequence 1 has 13 tokens, more than max_length=12"):
        data.pack_sft(seqs, max_length=12, pad_id=0)
    with pytest.raises(data.DataError, match="need 2 rows of 13 tokens, more than num_rows=1"):
        data.pack_sft(seqs, max_length=13, pad_id=0, num_rows=1)
    with pytest.raises(data.DataError, match="empty batch"):
        data.pack_sft([], max_length=8, pad_id=0)
    with pytest.raises(data.DataError, match="sequences_per_row must be a positive int"):
        data.pack_sft(seqs, max_length=16, pad_id=0, sequences_per_row=0)
    with pytest.raises(data.DataError, match="token id 13 at position 12"):
        data.pack_sft(seqs, max_length=16, pad_id=0, vocab_size=13)
    with pytest.raises(data.DataError, match="no completion token"):
        data.pack_sft([_seq((3, 0))], max_length=8, pad_id=0)
    batch = data.pack_sft(seqs, max_length=16, pad_id=0)
    fields = {k: getattr(batch, k) for k in ("tokens", "mask", "completion_mask", "segment_ids")}
    with pytest.raises((data.DataError, TypeError), match="sequences"):
        data.PackedSequenceBatch(**fields, sequences=jnp.ones((3, 2), bool))


def _with_lora(policy, key):
    """`policy` with LoRA adapters whose `b` is not zero (every adapter array gets a
    gradient)."""
    model = rx.apply_lora(policy, rx.LoRAConfig(rank=2, alpha=4.0), key=key)
    lora = model.transformer.layers.lora
    new = {
        n: eqx.tree_at(
            lambda a: a.b, ad, 0.1 * jax.random.normal(jax.random.fold_in(key, i), ad.b.shape)
        )
        for i, (n, ad) in enumerate(sorted(lora.items()))
    }
    return eqx.tree_at(lambda m: m.transformer.layers.lora, model, new)


def _one_step(model, batch, *, lora: bool, **kw):
    opt = optax.sgd(0.5)
    spec = rx.lora_filter(model) if lora else None
    state = train.init_train_state(model, opt, filter_spec=spec)
    step = train.make_sft_step(opt, donate=False, **kw)
    return state.apply(step, batch)


@pytest.mark.parametrize(
    "mode, lora", [("token-mean", False), ("token-mean", True)] + [(m, False) for m in MODES[1:]]
)
def test_packed_step_equals_unpacked(getkey, mode, lora):
    (policy,) = tiny_policies(VOCAB, 3)
    model = _with_lora(policy, getkey()) if lora else policy
    seqs = _mixed(1)
    plain = data.collate_sft(seqs, max_length=L, pad_id=0)
    packed = data.pack_sft(seqs, max_length=L, pad_id=0)
    assert packed.tokens.shape[0] < plain.tokens.shape[0]  # rows were shared
    s1, m1 = _one_step(model, plain, lora=lora, mode=mode)
    s2, m2 = _one_step(model, packed, lora=lora, mode=mode)
    assert set(m1) == set(m2)
    for name in m1:
        np.testing.assert_allclose(m2[name], m1[name], rtol=2e-5, atol=1e-6, err_msg=name)
    assert float(m1["mean_token_accuracy"]) > 0  # the metric is compared on hits too
    # a sequence's first token, trained when it has no prompt, counts as unpacked (logp 0)
    assert float(m2["num_tokens"]) == sum(s.trained for s in seqs)
    assert_tree_allclose(s2.params, s1.params, rtol=1e-5, atol=1e-6)


def test_packed_micro_batches_equal_the_full_batch(getkey):
    (policy,) = tiny_policies(VOCAB, 4)
    packed = data.pack_sft(_mixed(2, 11), max_length=L, pad_id=0, num_rows=6)
    full = _one_step(policy, packed, lora=False, mode="seq-mean-token-mean")
    micro = _one_step(policy, packed, lora=False, mode="seq-mean-token-mean", micro_batches=3)
    assert_tree_allclose(micro[0].params, full[0].params, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(micro[1]["loss"], full[1]["loss"], rtol=1e-6)


def test_no_token_is_predicted_from_another_sequence(getkey):
    """The second sequence of a row scores the same whatever the first one holds: its
    first token (trained, no prompt) gets log-probability 0, as in a row of its own."""
    (policy,) = tiny_policies(VOCAB, 5)
    second = _seq((0, 4), start=3)
    losses = []
    for first in ((1, 2, 3, 4, 5, 6), (9, 9, 9, 9, 9, 9)):
        seqs = [data.TokenizedSequence(first, ()), second]
        batch = data.pack_sft(seqs, max_length=12, pad_id=0)
        assert batch.tokens.shape == (1, 12)
        losses.append(_one_step(policy, batch, lora=False)[1]["loss"])
    alone = data.collate_sft([second], max_length=12, pad_id=0)
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)
    unpacked = _one_step(policy, alone, lora=False)[1]["loss"]
    np.testing.assert_allclose(losses[0], unpacked, rtol=1e-5)


def test_packed_batch_needs_a_model_that_takes_segment_ids(getkey):
    (policy,) = tiny_policies(VOCAB, 6)

    class Plain(eqx.Module):
        policy: rx.Policy

        def __call__(self, tokens, mask, *, key=None):
            return jax.vmap(self.policy)(tokens, mask)

    packed = data.pack_sft(_mixed(3, 4), max_length=L, pad_id=0)
    with pytest.raises(ValueError, match="needs a model whose call takes segment_ids"):
        _one_step(Plain(policy), packed, lora=False)


def _ctx(tmp_path):
    return pl.RunContext(
        ops=pl.OpsConfig(quiet=True),
        log=pl.tools.MetricsLog(str(tmp_path), "sft", quiet=True),
        key=jax.random.key(0),
    )


def test_run_sft_with_packing_trains_on_full_rows(tmp_path):
    tok = data.load_tokenizer(asset_path("tok512.bin"))
    (policy,) = tiny_policies(512, 7)
    rng = np.random.default_rng(0)
    words = ["dog", "cat", "sun", "tree", "boat", "rain", "hill", "fox"]
    say = lambda n: " ".join(rng.choice(words, n))  # noqa: E731
    records = [
        (say(int(rng.integers(1, 5))), " " + say(int(rng.integers(1, 9)))) for _ in range(20)
    ]
    cfg = pl.SFTConfig(
        steps=3,
        batch_size=2,
        max_length=40,
        packing=True,
        optim=rx.train.OptimizerSettings(learning_rate=1e-2),
        lora=pl.LoRASettings(rank=2, alpha=4.0, dropout=0.0),
    )
    res = pl.runs.run_sft(policy, tok, records, cfg=cfg, ctx=_ctx(tmp_path))
    info = res.info["packing"]
    assert info["sequences"] == 20 and info["row_length"] == 40
    assert info["padding_fraction"] < info["unpacked_padding_fraction"]
    assert res.loop.iterations == 3
    assert all(np.isfinite(h["loss"]) and h["num_tokens"] > 0 for h in res.history)


def test_packing_is_refused_on_the_built_in_task():
    cfg = pl.apply_overrides(pl.animal_task_config(), ["sft.packing=true"])
    with pytest.raises(pl.ConfigError) as e:
        pl.config.validate_config(cfg)
    assert "sft.packing=True" in str(e.value) and "data file" in str(e.value)


def test_a_run_from_before_sft_packing_resumes_unpacked():
    new = pl.config.config_to_dict(pl.animal_task_config())
    old = {k: (dict(v) if isinstance(v, dict) else v) for k, v in new.items()}
    del old["sft"]["packing"]
    assert pl.loop.check_resumable(old, new, where="run") == []
