"""Every bad input is named, nothing is dropped silently: non-finite checkpoint weights,
token ids outside the vocabulary, empty and fully-masked batches, generation past the
model's length, decoders returning the wrong shapes, unreadable or oversized
tokenizers, reward functions returning non-numbers."""

import json
import math
import struct

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
import safetensors.numpy as stnp
import tokenizers
from jaxtyping import Array, Float, Int
from test_train_common import (
    VOCAB,
    CumMeanLM,
    CumMeanValue,
    leaves_equal,
    preference_batch,
    sequence_batch,
)

import rlhf_eqx as rx
from rlhf_eqx import data, train
from rlhf_eqx.models import AbstractDecoder
from rlhf_eqx.pipelines.runs import RewardFunction, Rollout, score_rollout


def small_policy(key, **kw):
    base = dict(
        vocab_size=32, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24, max_seq_len=16
    )
    return rx.Policy(rx.TransformerConfig(**(base | kw)), key=key)


# ----------------------------------------------------------------------------- 1. weights


@pytest.mark.parametrize("dtype, value", [("float32", np.nan), ("bfloat16", -np.inf)])
def test_load_hf_names_a_non_finite_tensor_and_its_file(tmp_path, getkey, dtype, value):
    rx.save_hf(small_policy(getkey()), tmp_path / "ckpt", dtype=dtype)
    path = tmp_path / "ckpt" / "model.safetensors"
    tensors = stnp.load_file(str(path))
    name = "model.layers.1.self_attn.q_proj.weight"
    bad = tensors[name].copy()
    bad[3, 5] = value
    tensors[name] = bad
    stnp.save_file(tensors, str(path))
    with pytest.raises(
        ValueError, match=rf"model\.safetensors: tensor '{name}' holds .*index \(3, 5\)"
    ):
        rx.load_hf(tmp_path / "ckpt")


def test_a_non_finite_tensor_is_named_whichever_tensor_it_is(tmp_path, getkey):
    """Every tensor of the checkpoint, the first in the file included (`lm_head.weight`,
    which the runtime shape checks once read to check the tensor mapping's values):
    a `ValueError` naming the file and the tensor."""
    rx.save_hf(small_policy(getkey()), tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "model.safetensors"
    tensors = stnp.load_file(str(path))
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"):
        bad = dict(tensors)
        bad[name] = tensors[name].copy()
        bad[name].flat[1] = np.nan
        stnp.save_file(bad, str(path))
        with pytest.raises(ValueError, match=rf"model\.safetensors: tensor '{name}' holds"):
            rx.load_hf(tmp_path / "ckpt")


def test_load_llama2c_names_a_non_finite_tensor_and_its_file(tmp_path):
    D, F, L, H, K, V, S = 8, 16, 2, 2, 2, 12, 16
    rng = np.random.default_rng(0)
    shapes = [
        (V, D),
        (L, D),
        (L, D, D),
        (L, D, D),
        (L, D, D),
        (L, D, D),
        (L, D),
        (L, F, D),
        (L, D, F),
        (L, F, D),
        (D,),
        (S, D // H // 2),
        (S, D // H // 2),
    ]
    arrays = [rng.standard_normal(s).astype("<f4") for s in shapes]
    arrays[3][1, 2, 0] = np.inf  # wk, layer 1
    path = tmp_path / "model.bin"
    path.write_bytes(
        struct.pack("<7i", D, F, L, H, K, V, S) + b"".join(a.tobytes() for a in arrays)
    )
    with pytest.raises(ValueError, match=r"model\.bin: tensor 'wk' holds .*inf.*index \(1, 2, 0\)"):
        rx.load_llama2c(path)
    arrays[3][1, 2, 0] = 0.0
    path.write_bytes(
        struct.pack("<7i", D, F, L, H, K, V, S) + b"".join(a.tobytes() for a in arrays)
    )
    policy, _ = rx.load_llama2c(path)
    assert policy.cfg.vocab_size == V


def test_load_lora_adapter_names_a_non_finite_tensor_and_its_file(tmp_path, getkey):
    base = small_policy(getkey())
    lora = rx.apply_lora(
        base, rx.LoRAConfig(rank=2, alpha=4.0, targets=("q", "down")), key=getkey()
    )
    rx.models.save_lora_adapter(lora, tmp_path / "adapter")
    path = tmp_path / "adapter" / "adapter_model.safetensors"
    tensors = stnp.load_file(str(path))
    name = "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"
    tensors[name] = np.full_like(tensors[name], np.nan)
    stnp.save_file(tensors, str(path))
    with pytest.raises(ValueError, match=rf"adapter_model\.safetensors: tensor '{name}' holds"):
        rx.models.load_lora_adapter(base, tmp_path / "adapter")


# ----------------------------------------------------------------------------- 2. token ids


def test_check_token_ids_names_the_row_position_and_value():
    data.check_token_ids([[1, 2], [3, 7]], 8)
    data.check_token_ids(np.asarray([0, 7]), 8)
    with pytest.raises(data.DataError, match=r"prompt 1 has token id -1 at position 2, .*\[0, 8\)"):
        data.check_token_ids([[1, 2], [3, 4, -1]], 8, where="prompt")
    with pytest.raises(data.DataError, match=r"row 0 has token id 8 at position 1, .*\[0, 8\)"):
        data.check_token_ids(jnp.asarray([[1, 8], [9, 9]], jnp.int32), 8)
    with pytest.raises(data.DataError, match=r"sequence has token id -5 at position 0"):
        data.check_token_ids(np.asarray([-5, 1]), 8, where="sequence")
    with pytest.raises(data.DataError, match="integer"):
        data.check_token_ids([1.5], 8)
    with pytest.raises(data.DataError, match="vocab_size"):
        data.check_token_ids([1], 0)


def test_collate_refuses_negative_ids_everywhere():
    seq = data.TokenizedSequence
    pair = data.TokenizedPair(seq((1, 2), (3,)), seq((1, 2), (-4,)))
    with pytest.raises(data.DataError, match="row 0 has token id -4 at position 2"):
        data.collate_preferences([pair], max_length=4, pad_id=0, vocab_size=8)
    with pytest.raises(data.DataError, match="row 0 has token id -4 at position 2"):
        data.collate_preferences([pair], max_length=4, pad_id=0)
    with pytest.raises(data.DataError, match="prompt 0 has token id -2"):
        data.collate_prompts([[1, -2]], max_length=4, pad_id=0)
    with pytest.raises(data.DataError, match="token id -4"):
        data.pack_preferences([pair], pad_id=0)


def test_collate_refuses_a_batch_without_completion_tokens():
    seq = data.TokenizedSequence
    with pytest.raises(data.DataError, match="no completion token"):
        data.collate_sft([seq((1, 2), ()), seq((1,), ())], max_length=4, pad_id=0)
    with pytest.raises(data.DataError, match="no completion token"):
        data.collate_preferences(
            [data.TokenizedPair(seq((1, 2), ()), seq((1, 2), ()))], max_length=4, pad_id=0
        )
    # One empty completion among others is fine (that row adds nothing to the loss).
    data.collate_sft([seq((1, 2), ()), seq((1,), (3,))], max_length=4, pad_id=0)


# ----------------------------------------------------------------------------- 3. batches


def _ppo_batch(key, B=2, T=8):
    s = sequence_batch(key, B=B, T=T)
    z = jnp.zeros((B, T), jnp.float32)
    return train.PPOBatch(s.tokens, s.mask, s.completion_mask, z, z, z + 1.0, z)


def _grpo_batch(key, B=2, T=8):
    s = sequence_batch(key, B=B, T=T)
    return train.GRPOBatch(
        s.tokens, s.mask, s.completion_mask, rewards=jnp.arange(B, dtype=jnp.float32)
    )


class Scorer(eqx.Module):
    """A scalar-head model: the masked mean of per-token scores."""

    scores: jax.Array

    def __call__(self, tokens, mask):
        return jnp.sum(jnp.where(mask, self.scores[tokens], 0.0)) / jnp.maximum(
            jnp.sum(mask), 1
        ).astype(jnp.float32)


def _cases(getkey):
    lm = CumMeanLM(getkey())
    rm = Scorer(jax.random.normal(getkey(), (VOCAB,)))
    critic = CumMeanValue(getkey())
    opt = optax.adam(1e-2)
    return {
        "sft": (train.make_sft_step(opt), lm, sequence_batch(getkey(), B=2, T=8), {}),
        "dpo": (
            train.make_dpo_step(opt),
            lm,
            preference_batch(getkey(), B=2, T=8),
            {"reference": lm},
        ),
        "reward": (train.make_reward_step(opt), rm, preference_batch(getkey(), B=2, T=8), {}),
        "ppo": (train.make_ppo_step(opt), (lm, critic), _ppo_batch(getkey()), {}),
        "grpo": (train.make_grpo_step(opt, group_size=2), lm, _grpo_batch(getkey()), {}),
    }


@pytest.mark.parametrize("name", ["sft", "dpo", "reward", "ppo", "grpo"])
def test_steps_refuse_a_batch_without_rows(getkey, name):
    step, model, batch, extra = _cases(getkey)[name]
    empty = jax.tree.map(lambda x: x[:0], batch)  # rebuilt from leaves: not re-validated
    opt_state = optax.adam(1e-2).init(eqx.filter(model, eqx.is_inexact_array))
    kind = type(batch).__name__
    field = "chosen_tokens" if kind == "PreferenceBatch" else "tokens"
    with pytest.raises(
        ValueError, match=rf"{kind}\.{field} has shape \(0, 8\): the batch has no rows"
    ):
        step(model, opt_state, empty, **extra)


def _unmasked(batch):
    """The batch with every completion mask false."""
    names = [
        n
        for n in ("completion_mask", "chosen_completion_mask", "rejected_completion_mask")
        if hasattr(batch, n)
    ]
    return eqx.tree_at(
        lambda b: [getattr(b, n) for n in names],
        batch,
        [jnp.zeros_like(getattr(batch, n)) for n in names],
    )


@pytest.mark.parametrize("name", ["sft", "dpo", "ppo", "grpo"])
def test_a_fully_masked_batch_is_reported_and_leaves_the_state(getkey, name):
    step, model, batch, extra = _cases(getkey)[name]
    state = train.init_train_state(model, optax.adam(1e-2))
    state, m = state.apply(step, batch, donate=False, **extra)
    assert float(m["empty_batch"]) == 0.0
    before = jax.tree.map(np.asarray, (state.params, state.opt_state))
    state, m = state.apply(step, _unmasked(batch), donate=False, **extra)
    assert float(m["empty_batch"]) == 1.0 and float(m["nonfinite"]) == 0.0
    # Adam's momentum would have moved the weights: the update is skipped instead.
    assert leaves_equal((state.params, state.opt_state), before)


def test_the_reward_step_scores_whole_sequences_so_completion_masks_do_not_empty_it(getkey):
    step, model, batch, _ = _cases(getkey)["reward"]
    opt_state = optax.adam(1e-2).init(eqx.filter(model, eqx.is_inexact_array))
    _, _, m = step(model, opt_state, _unmasked(batch))
    assert float(m["empty_batch"]) == 0.0 and float(m["loss"]) > 0.0


# ----------------------------------------------------------------------------- 4. length


def test_generate_refuses_to_run_past_max_seq_len(getkey):
    policy = small_policy(getkey())  # max_seq_len 16
    prompts, masks = jnp.ones((2, 10), jnp.int32), jnp.ones((2, 10), bool)
    with pytest.raises(
        ValueError, match=r"prompt length 10 \+ max_new_tokens 7 = 17 .*max_seq_len=16"
    ):
        rx.generate_batch(policy, prompts, masks, getkey(), max_new_tokens=7)
    with pytest.raises(ValueError, match=r"prompt length 10 \+ max_new_tokens 7 = 17"):
        rx.generate(policy, prompts[0], masks[0], getkey(), max_new_tokens=7)
    shapes = jax.eval_shape(
        lambda k: rx.generate_batch(policy, prompts, masks, k, max_new_tokens=6), getkey()
    )
    assert shapes.tokens.shape == (2, 16)


# ----------------------------------------------------------------------------- 5. decoders


class Bigram(AbstractDecoder[Int[Array, ""]]):
    table: Float[Array, "V V"]
    wrong: str = eqx.field(static=True, default="")

    @property
    def vocab_size(self) -> int:
        return self.table.shape[0]

    def __call__(self, tokens, mask, *, key=None):
        return self.table[tokens]

    def init_cache(self, cache_size):
        return jnp.zeros((), jnp.int32)

    def prefill(self, tokens, mask, *, cache_size):
        last = tokens[jnp.max(jnp.where(mask, jnp.arange(tokens.shape[0]), 0))]
        logits = self.table[last]
        return (logits[:-1] if self.wrong == "prefill" else logits), last

    def decode_step(self, token, cache, *, index, position):
        logits = self.table[token]
        if self.wrong == "logits":
            return logits[None, :], token
        if self.wrong == "cache":
            return logits, jnp.stack([token, token])
        return logits, token


@pytest.mark.parametrize(
    "wrong, message",
    [
        ("logits", r"Bigram\.decode_step returned logits of shape \(1, 6\); expected \(6,\)"),
        ("prefill", r"Bigram\.prefill returned logits of shape \(5,\); expected \(6,\)"),
        (
            "cache",
            r"Bigram\.decode_step returned a cache .*int32\[2\].*Bigram\.prefill .*int32\[\]",
        ),
    ],
)
def test_a_decoder_returning_the_wrong_shape_is_named(wrong, message):
    model = Bigram(jnp.eye(6), wrong=wrong)
    prompts, masks = jnp.ones((2, 3), jnp.int32), jnp.ones((2, 3), bool)
    with pytest.raises(ValueError, match=message):
        rx.generate_batch(model, prompts, masks, jax.random.key(0), max_new_tokens=2)


# ----------------------------------------------------------------------------- 6. tokenizers


def test_an_invalid_tokenizer_json_names_the_file_and_line(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text('{\n  "version": "1.0",\n  "model": \n}\n')
    with pytest.raises(data.DataError, match=r"tokenizer\.json:4: not valid JSON"):
        data.load_tokenizer(path)
    path.write_text(json.dumps({"version": "1.0"}))
    with pytest.raises(data.DataError, match=r"tokenizer\.json: not a Hugging Face tokenizer"):
        data.load_tokenizer(tmp_path)
    tokenizers.Tokenizer(tokenizers.models.WordLevel({"<s>": 0, "</s>": 1, "a": 2}, "a")).save(
        str(path)
    )
    config = tmp_path / "tokenizer_config.json"
    config.write_text('{\n  "eos_token": "</s>",\n  "bos_token": <s>\n}')
    with pytest.raises(data.DataError, match=r"tokenizer_config\.json:3: not valid JSON"):
        data.load_tokenizer(path)
    config.write_text('{"eos_token": "</s>", "bos_token": "<s>"}')
    tok = data.load_tokenizer(path)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (3, 0, 1)
    with pytest.raises(
        data.DataError, match="the tokenizer has 3 ids but the model's vocabulary has only 2"
    ):
        data.check_vocab(tok, 2)  # it could emit an id the model cannot embed


def test_tokenizer_and_model_vocabularies():
    tok = data.ByteTokenizer()  # 259 ids
    data.check_vocab(tok, 320)  # smaller than the model's (a padded embedding): fine
    with pytest.raises(
        data.DataError, match=r"the tokenizer has 259 ids but the model's vocabulary has only 200"
    ):
        data.check_vocab(tok, 200)


# ----------------------------------------------------------------------------- 7. rewards


def _rollout(n=3):
    z = jnp.zeros((n, 4), jnp.int32)
    return Rollout(
        z,
        z > 0,
        z > 0,
        z.astype(jnp.float32),
        jnp.zeros((n,), bool),
        tuple(f"p{i}" for i in range(n)),
        tuple(str(i) for i in range(n)),
        group_size=1,
    )


@pytest.mark.parametrize(
    "value, shown",
    [
        (None, "None"),
        ("1.0", "'1.0'"),
        ([1.0], r"\[1\.0\]"),
        (math.nan, "nan"),
        (np.float32(np.inf), r"np\.float32\(inf\)"),
        (np.ones(2), r"array\(\[1\., 1\.\]\)"),
        (1 + 2j, r"\(1\+2j\)"),
    ],
)
def test_a_reward_function_returning_a_non_number_is_named(value, shown):
    fn = lambda p, t: value if t == "1" else 1.0  # noqa: E731
    with pytest.raises(ValueError, match=rf"reward function 'judge' returned {shown} for prompt 1"):
        score_rollout(_rollout(), [RewardFunction("judge", fn)])


def test_reward_functions_may_return_any_real_number():
    values = iter(
        [
            True,
            2,
            0.5,
            np.float32(0.25),
            np.int64(3),
            np.bool_(False),
            jnp.asarray(1.5),
            ml_dtypes.bfloat16(0.5),
            np.asarray(4.0),
        ]
    )
    rewards, metrics = score_rollout(
        _rollout(9), [RewardFunction("any", lambda p, t: next(values))]
    )
    np.testing.assert_allclose(rewards, [1, 2, 0.5, 0.25, 3, 0, 1.5, 0.5, 4])
    assert metrics["reward/any"] == pytest.approx(np.mean([1, 2, 0.5, 0.25, 3, 0, 1.5, 0.5, 4]))
