"""Model families against their reference implementation (Hugging Face transformers).

The fixtures in `tests/fixtures/hf/` were written by `tests/fixtures/make_fixtures.py`:
tiny random checkpoints with the families' real `config.json` fields, the reference
logits for right- and left-padded inputs, a greedy continuation, and the result of
the reference loading what `save_hf` writes.
"""

import dataclasses
import json
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlhf_eqx as rx

HF = os.path.join(os.path.dirname(__file__), "fixtures", "hf")
FAMILIES = ["llama3", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3"]
WINDOWED = ["mistral", "gemma2", "gemma3"]
ARCHITECTURES = {
    "llama3": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
_CACHE: dict[str, rx.Policy] = {}


def load(family: str) -> rx.Policy:
    if family not in _CACHE:
        _CACHE[family] = rx.load_hf(os.path.join(HF, family), dtype="float32")
    return _CACHE[family]


def reference(family: str):
    return np.load(os.path.join(HF, family, "reference.npz"))


@eqx.filter_jit
def forward(model, tokens, mask, segment_ids=None):
    return model(tokens, mask, segment_ids=segment_ids)


def with_config(policy: rx.Policy, **changes) -> rx.Policy:
    """The same arrays under a configuration with some switches changed."""
    cfg = dataclasses.replace(policy.cfg, **changes)
    skeleton = eqx.filter_eval_shape(rx.Policy, cfg, key=jax.random.key(0))
    return jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(skeleton), jax.tree_util.tree_leaves(policy)
    )


def test_configs_select_the_family_switches():
    cfg = {f: load(f).cfg for f in FAMILIES}
    assert cfg["llama3"].rope_scaling.kind == "llama3" and cfg["llama3"].tie_embeddings
    assert cfg["mistral"].local_layers == (True, True) and cfg["mistral"].sliding_window == 4
    assert cfg["qwen2"].attn_bias and cfg["qwen2"].sliding_window is None
    assert cfg["qwen3"].qk_norm and not cfg["qwen3"].attn_bias and cfg["qwen3"].head_dim == 16
    g = cfg["gemma"]
    assert (
        g.norm_plus_one and g.embed_scale and g.mlp_activation == "gelu_tanh" and not g.post_norms
    )
    g2 = cfg["gemma2"]
    assert g2.post_norms and g2.attn_softcap == 5.0 and g2.final_softcap == 3.0
    assert g2.local_layers == (True, False) and g2.query_scale == 8**-0.5
    g3 = cfg["gemma3"]
    assert g3.qk_norm and g3.local_layers == (True, False, True, False)
    assert (
        g3.rope_local_theta == 10000.0 and g3.rope_theta == 1e6 and g3.rope_scaling.kind == "linear"
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_reference_right_and_left_padded(family):
    policy, ref = load(family), reference(family)
    for tokens, mask, logits in (
        ("tokens", "mask_right", "logits_right"),
        ("tokens_left", "mask_left", "logits_left"),
    ):
        m = ref[mask]
        out = np.asarray(forward(policy, jnp.asarray(ref[tokens], jnp.int32), jnp.asarray(m)))
        assert np.abs(out - ref[logits])[m].max() < 1e-4, (family, logits)


@pytest.mark.parametrize(
    "family, changes",
    [
        ("llama3", dict(rope_scaling=None)),
        ("mistral", dict(sliding_window=None, window_layers=None)),
        ("qwen3", dict(qk_norm=True)),  # QK-norm weights reset to the identity below
        ("gemma", dict(embed_scale=False)),
        ("gemma", dict(mlp_activation="gelu")),
        ("gemma2", dict(attn_softcap=None)),
        ("gemma2", dict(final_softcap=None)),
        ("gemma2", dict(query_scale=None)),
        ("gemma2", dict(window_layers=(True, True))),
        ("gemma3", dict(rope_local_theta=None)),
        ("gemma3", dict(rope_scaling=None)),
        ("gemma3", dict(sliding_window=None, window_layers=None)),
    ],
)
def test_every_switch_shows_in_the_reference_logits(family, changes):
    """The parity above is meaningful: each architecture switch moves the logits."""
    ref = reference(family)
    changed = with_config(load(family), **changes)
    if family == "qwen3":
        changed = eqx.tree_at(
            lambda p: (p.transformer.layers.q_norm, p.transformer.layers.k_norm),
            changed,
            replace_fn=jnp.ones_like,
        )
    out = np.asarray(
        forward(changed, jnp.asarray(ref["tokens"], jnp.int32), jnp.asarray(ref["mask_right"]))
    )
    assert np.abs(out - ref["logits_right"])[ref["mask_right"]].max() > 2e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_continuation_matches_reference(family):
    policy, ref = load(family), reference(family)
    prompt = jnp.asarray(ref["prompt"], jnp.int32)
    n = ref["continuation"].shape[0]
    out = rx.generate(
        policy,
        prompt,
        jnp.ones(prompt.shape, bool),
        jax.random.key(0),
        max_new_tokens=n,
        temperature=0.0,
    )
    np.testing.assert_array_equal(
        np.asarray(out.tokens)[np.asarray(out.completion_mask)], ref["continuation"]
    )


@pytest.mark.parametrize("family", WINDOWED)
def test_kv_cache_decode_equals_forward_across_the_window(family):
    """Prefill 3 tokens (behind 2 pads), decode 7 more: past the 4-token window."""
    policy, ref = load(family), reference(family)
    seq = jnp.asarray(ref["tokens"][0], jnp.int32)
    pads = 2
    full = forward(policy, seq, jnp.ones(seq.shape, bool))
    prompt = jnp.concatenate([jnp.zeros((pads,), jnp.int32), seq[:3]])
    pmask = jnp.arange(pads + 3) >= pads
    prefill = eqx.filter_jit(lambda p, t, m: p.prefill(t, m, cache_size=pads + seq.shape[0]))
    step = eqx.filter_jit(lambda p, tok, c, i, pos: p.decode_step(tok, c, index=i, position=pos))
    logits, cache = prefill(policy, prompt, pmask)
    np.testing.assert_allclose(logits, full[2], atol=1e-4)
    for t in range(3, seq.shape[0]):
        logits, cache = step(policy, seq[t], cache, jnp.int32(pads + t), jnp.int32(t))
        np.testing.assert_allclose(logits, full[t], atol=1e-4, err_msg=f"{family} position {t}")


@pytest.mark.parametrize("family", FAMILIES)
def test_save_hf_round_trip_is_identical(family, tmp_path):
    policy = load(family)
    rx.save_hf(policy, tmp_path / "out")
    again = rx.load_hf(tmp_path / "out")
    assert again.cfg == policy.cfg
    for a, b in zip(jax.tree_util.tree_leaves(policy), jax.tree_util.tree_leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == [ARCHITECTURES[family]]


def test_reference_implementation_reads_what_save_hf_writes():
    """Recorded by make_fixtures.py: transformers loaded each `save_hf` output, the
    policy as a causal LM and a reward model as a sequence classifier."""
    with open(os.path.join(HF, "export_check.json")) as f:
        check = json.load(f)
    for family in FAMILIES:
        assert check[family]["architecture"] == ARCHITECTURES[family]
        assert check[family]["max_abs_logit_diff"] < 1e-4, family
        scorer = ARCHITECTURES[family].replace("ForCausalLM", "ForSequenceClassification")
        assert check[family]["reward_architecture"] == scorer.replace("Gemma3", "Gemma3Text"), (
            family
        )
        assert check[family]["max_abs_reward_diff"] < 1e-4, family
        # PEFT loads save_lora_adapter's output onto the reference base: same logits,
        # and the adapters do change them
        assert check[family]["peft_max_abs_logit_diff"] < 1e-4, family
        assert check[family]["peft_adapter_effect"] > 0.1, family


def test_sliding_window_with_packed_segments():
    policy = load("mistral")
    ref = reference("mistral")
    a, b = (
        jnp.asarray(ref["tokens"][0, :6], jnp.int32),
        jnp.asarray(ref["tokens"][1, :7], jnp.int32),
    )
    packed = jnp.concatenate([a, b, jnp.zeros((3,), jnp.int32)])
    seg = jnp.array([0] * 6 + [1] * 7 + [2] * 3, jnp.int32)
    mask = jnp.arange(16) < 13
    out = forward(policy, packed, mask, seg)
    np.testing.assert_allclose(out[:6], forward(policy, a, jnp.ones((6,), bool)), atol=1e-5)
    np.testing.assert_allclose(out[6:13], forward(policy, b, jnp.ones((7,), bool)), atol=1e-5)


def test_alternating_local_and_global_layers_compile_one_layer_body():
    base = load("gemma2").cfg

    def n_eqns(n_layers):
        cfg = dataclasses.replace(
            base, n_layers=n_layers, window_layers=tuple(i % 2 == 0 for i in range(n_layers))
        )
        p = eqx.filter_eval_shape(rx.Policy, cfg, key=jax.random.key(0))
        jaxpr = jax.make_jaxpr(lambda m: m(jnp.zeros((8,), jnp.int32), jnp.ones((8,), bool)))(p)
        return len(jaxpr.jaxpr.eqns)

    assert n_eqns(2) == n_eqns(6)


@pytest.mark.parametrize("family", ["gemma3"])
def test_lora_and_int8_cover_the_family(family, getkey):
    policy = load(family)
    model = rx.apply_lora(
        policy, rx.LoRAConfig(rank=2, targets=rx.models.LORA_TARGETS), key=getkey()
    )
    lora = model.transformer.layers.lora
    model = eqx.tree_at(
        lambda m: [m.transformer.layers.lora[t].b for t in lora],
        model,
        [0.1 * jax.random.normal(getkey(), lora[t].b.shape) for t in lora],
    )
    ref = reference(family)
    tokens, mask = jnp.asarray(ref["tokens"], jnp.int32), jnp.asarray(ref["mask_right"])
    adapted = forward(model, tokens, mask)
    assert float(jnp.max(jnp.abs(adapted - forward(policy, tokens, mask)))) > 1e-3
    np.testing.assert_allclose(forward(rx.merge_lora(model), tokens, mask), adapted, atol=1e-4)
    int8 = forward(rx.quantize_int8(policy), tokens, mask)
    assert float(jnp.max(jnp.abs(int8 - forward(policy, tokens, mask)))) < 0.25


# The published config.json of a real checkpoint per family (as on the Hugging Face Hub).
REAL_CONFIGS = {
    "Llama-3.2-1B": (
        dict(
            architectures=["LlamaForCausalLM"],
            attention_bias=False,
            attention_dropout=0.0,
            bos_token_id=128000,
            eos_token_id=128001,
            head_dim=64,
            hidden_act="silu",
            hidden_size=2048,
            initializer_range=0.02,
            intermediate_size=8192,
            max_position_embeddings=131072,
            mlp_bias=False,
            model_type="llama",
            num_attention_heads=32,
            num_hidden_layers=16,
            num_key_value_heads=8,
            pretraining_tp=1,
            rms_norm_eps=1e-05,
            rope_scaling=dict(
                factor=32.0,
                high_freq_factor=4.0,
                low_freq_factor=1.0,
                original_max_position_embeddings=8192,
                rope_type="llama3",
            ),
            rope_theta=500000.0,
            tie_word_embeddings=True,
            torch_dtype="bfloat16",
            use_cache=True,
            vocab_size=128256,
        ),
        1_235_814_400,
    ),
    "gemma-2-2b": (
        dict(
            architectures=["Gemma2ForCausalLM"],
            attention_bias=False,
            attention_dropout=0.0,
            attn_logit_softcapping=50.0,
            bos_token_id=2,
            cache_implementation="hybrid",
            eos_token_id=1,
            final_logit_softcapping=30.0,
            head_dim=256,
            hidden_act="gelu_pytorch_tanh",
            hidden_activation="gelu_pytorch_tanh",
            hidden_size=2304,
            initializer_range=0.02,
            intermediate_size=9216,
            max_position_embeddings=8192,
            model_type="gemma2",
            num_attention_heads=8,
            num_hidden_layers=26,
            num_key_value_heads=4,
            pad_token_id=0,
            query_pre_attn_scalar=256,
            rms_norm_eps=1e-06,
            rope_theta=10000.0,
            sliding_window=4096,
            torch_dtype="float32",
            use_cache=True,
            vocab_size=256000,
        ),
        2_614_341_888,
    ),
    "Qwen3-0.6B": (
        dict(
            architectures=["Qwen3ForCausalLM"],
            attention_bias=False,
            attention_dropout=0.0,
            bos_token_id=151643,
            eos_token_id=151645,
            head_dim=128,
            hidden_act="silu",
            hidden_size=1024,
            initializer_range=0.02,
            intermediate_size=3072,
            max_position_embeddings=40960,
            max_window_layers=28,
            model_type="qwen3",
            num_attention_heads=16,
            num_hidden_layers=28,
            num_key_value_heads=8,
            rms_norm_eps=1e-06,
            rope_scaling=None,
            rope_theta=1000000,
            sliding_window=None,
            tie_word_embeddings=True,
            torch_dtype="bfloat16",
            use_cache=True,
            use_sliding_window=False,
            vocab_size=151936,
        ),
        596_049_920,
    ),
}


@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
def test_published_configs_translate_with_the_published_sizes(name):
    config, n_params = REAL_CONFIGS[name]
    cfg = rx.models.config_from_hf(config)
    assert cfg.num_params() == n_params
    back = rx.models.config_to_hf(cfg)
    assert back["architectures"] == config["architectures"]
    assert rx.models.config_from_hf(back) == cfg


@pytest.mark.slow
@pytest.mark.parametrize(
    "family", ["gemma", "gemma2", "gemma3", "llama3", "mistral", "qwen2", "qwen3"]
)
def test_one_dpo_step_with_lora_on_the_family(family, getkey):
    from test_train_common import preference_batch

    from rlhf_eqx.train import init_train_state, make_dpo_step, make_optimizer

    policy = rx.apply_lora(
        load(family), rx.LoRAConfig(rank=2, targets=("q", "v", "down")), key=getkey()
    )
    batch = preference_batch(getkey(), B=2, T=10, vocab=policy.cfg.vocab_size)
    opt = make_optimizer(learning_rate=1e-2, total_steps=2)
    state = init_train_state(policy, opt, filter_spec=rx.lora_filter(policy))
    state, metrics = state.apply(
        make_dpo_step(opt, beta=0.1), batch, reference=rx.without_lora(policy)
    )
    np.testing.assert_allclose(float(metrics["loss"]), np.log(2.0), rtol=1e-5)
    assert np.isfinite(float(metrics["grad_norm"])) and float(metrics["grad_norm"]) > 0
