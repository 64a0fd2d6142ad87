"""The run layer's use of the library: stop ids and stop strings in rollouts, the
tokenizer check at load, the seeded split by prompt, the data-quality report and
filter, and the exports (HF reward model, PEFT adapters)."""

import json
import os

import jax
import numpy as np
import pytest

import rlhf_eqx as rx
from rlhf_eqx import data, pipelines as pl
from rlhf_eqx.assets import asset_path


def _tiny_policy(seed=0, vocab_size=512):
    cfg = rx.TransformerConfig(
        vocab_size=vocab_size,
        d_model=16,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        d_ff=32,
        max_seq_len=96,
    )
    return rx.Policy(cfg, key=jax.random.key(seed))


@pytest.fixture(scope="module")
def builtin():
    return pl.tools.load_model("builtin")


def _lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f.read().splitlines()]


# --- stop ids and stop strings ---------------------------------------------------------


def test_rollout_stops_in_the_sampler_at_every_stop_id(builtin):
    policy, tok = builtin
    prompts = ["Once upon a time"]
    free = pl.runs.sample_rollout(
        policy,
        tok,
        prompts,
        jax.random.key(0),
        group_size=4,
        prompt_length=12,
        max_new_tokens=24,
        stop_ids=(),
    )
    P = 12
    stop = int(np.asarray(free.tokens)[0, P + 2])  # a token the model did emit
    roll = pl.runs.sample_rollout(
        policy,
        tok,
        prompts,
        jax.random.key(0),
        group_size=4,
        prompt_length=12,
        max_new_tokens=24,
        stop_ids=(tok.eos_id, stop),
    )
    tokens, comp = np.asarray(roll.tokens), np.asarray(roll.completion_mask)
    for b in range(4):
        hits = np.flatnonzero(np.asarray(free.tokens)[b, P:] == stop)
        if not hits.size:
            continue
        end = P + hits[0] + 1  # the stop id is kept; nothing after it was sampled
        assert comp[b, P:end].all() and not comp[b, end:].any()
        assert (tokens[b, end:] == tok.pad_id).all()
        assert (np.asarray(roll.logprobs)[b, end:] == 0.0).all()
        assert not bool(roll.truncated[b])
    assert not bool(roll.truncated[0])


def test_stop_strings_cut_rollouts_and_fix_the_masks(builtin):
    policy, tok = builtin
    kw = dict(group_size=4, prompt_length=12, max_new_tokens=40)
    free = pl.runs.sample_rollout(policy, tok, ["Once upon a time"], jax.random.key(0), **kw)
    roll = pl.runs.sample_rollout(
        policy, tok, ["Once upon a time"], jax.random.key(0), stop_strings=(".",), **kw
    )
    cut_rows = 0
    for b, (whole, text) in enumerate(zip(free.texts, roll.texts)):
        assert "." not in text
        if "." in whole:
            cut_rows += 1
            assert whole.startswith(text) and len(text) <= whole.index(".")
            assert not bool(roll.truncated[b])
    assert cut_rows >= 1
    comp, mask = np.asarray(roll.completion_mask), np.asarray(roll.mask)
    assert not (comp & ~mask).any()
    assert comp.sum() < np.asarray(free.completion_mask).sum()
    np.testing.assert_array_equal(np.asarray(roll.logprobs)[~comp], 0.0)
    np.testing.assert_array_equal(np.asarray(roll.tokens)[:, 12:][~comp[:, 12:]], tok.pad_id)
    lp = pl.runs.token_logps(policy, roll.tokens, roll.mask)
    np.testing.assert_allclose(np.where(comp, lp, 0.0), roll.logprobs, atol=2e-5)


@pytest.mark.slow
def test_grpo_scores_and_trains_on_completions_cut_at_stop_strings(tmp_path):
    tok = data.load_tokenizer(asset_path("tok512.bin"))
    seen: list[str] = []

    def judge(prompt, completion):
        seen.append(completion)
        return float(len(completion) % 2)

    ctx = pl.RunContext(
        ops=pl.OpsConfig(quiet=True),
        log=pl.tools.MetricsLog(str(tmp_path), "grpo", quiet=True),
        key=jax.random.key(0),
        prompt_length=12,
        max_new_tokens=12,
        stop_strings=("e",),
    )
    cfg = pl.GRPOConfig(
        rollouts=1, prompts_per_rollout=2, group_size=2, lora=pl.LoRASettings(rank=2)
    )
    res = pl.runs.run_grpo(
        _tiny_policy(),
        tok,
        ["Once upon a time", "The dog"],
        reward=[pl.runs.RewardFunction("judge", judge)],
        cfg=cfg,
        ctx=ctx,
    )
    assert len(seen) == 4 and not any("e" in t for t in seen)
    assert int(res.state.step) == 1
    seen.clear()
    ppo = pl.PPOConfig(
        rollouts=1, prompts_per_rollout=2, epochs=1, minibatches=1, lora=pl.LoRASettings(rank=2)
    )
    res = pl.runs.run_ppo(
        _tiny_policy(),
        tok,
        ["Once upon a time", "The dog"],
        reward=[pl.runs.RewardFunction("judge", judge)],
        cfg=ppo,
        ctx=ctx,
    )
    assert len(seen) == 2 and not any("e" in t for t in seen)
    assert int(res.state.step) == 1


def test_stop_strings_config_from_the_command_line():
    c = pl.apply_overrides(pl.PipelineConfig(), ["sampling.stop_strings=\\n\\nHuman:,###"])
    assert c.sampling.stop_strings == ("\n\nHuman:", "###")
    assert pl.PipelineConfig().sampling.stop_strings == ()
    with pytest.raises(pl.ConfigError, match="sampling.stop_strings"):
        pl.config.validate_config(
            pl.config.config_from_dict(pl.PipelineConfig, {"sampling": {"stop_strings": [""]}})
        )


# --- the tokenizer check ----------------------------------------------------------------


def test_load_refuses_a_tokenizer_larger_than_the_model(tmp_path):
    rx.save_hf(_tiny_policy(vocab_size=256), str(tmp_path / "small"))
    tok_file = asset_path("tok512.bin")
    with pytest.raises(pl.ConfigError) as e:
        pl.tools.load_model(str(tmp_path / "small"), tok_file)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("model.tokenizer=")
    assert "512" in msg and "256" in msg
    # A model vocabulary padded past the tokenizer's is fine.
    rx.save_hf(_tiny_policy(vocab_size=576), str(tmp_path / "padded"))
    policy, tok = pl.tools.load_model(str(tmp_path / "padded"), tok_file)
    assert policy.cfg.vocab_size == 576 and tok.vocab_size == 512


# --- the split and the data-quality report ------------------------------------------------


def _pairs():
    rec = data.PreferenceRecord
    return [
        rec("Human: hi", " hello there", " go away"),
        rec("Human: hi", " hello there", " go away"),  # exact duplicate
        rec("Human: name?", " Tim", " Tim"),  # identical
        rec("Human: empty", " ", " no"),  # empty chosen
        rec("Human: cats?", " cats purr", " no idea"),
        rec("Human: dogs?", " dogs bark", " what"),
    ]


def test_quality_report_goes_to_the_log_and_the_filter_says_what_it_dropped(tmp_path):
    tok = data.load_tokenizer(asset_path("tok512.bin"))
    log = pl.tools.MetricsLog(str(tmp_path), "dpo", quiet=True)
    lengths = data.SequenceLengths(max_length=16, max_prompt_length=4)
    kept, report = pl.runs.quality_report(_pairs(), tok, lengths, pl.DataConfig(), log)
    assert len(kept) == 6
    (event,) = _lines(log.path)
    assert event["event"] == "data_quality" and event["identical"] == 1
    assert event["empty"] == 1 and event["exact_duplicates"] == 1
    assert event["duplicate_prompts"] == 1 and event["distinct_prompts"] == 5
    assert "prompts were cut to 4 tokens" in event["truncation"]
    assert 0 < event["distinct_2"] <= 1
    assert report.truncation is not None and report.truncation.prompt_truncated > 0
    dc = pl.DataConfig(filter=("identical", "empty", "exact_duplicate"))
    kept, _ = pl.runs.quality_report(_pairs(), tok, lengths, dc, log)
    assert [r.prompt for r in kept] == ["Human: hi", "Human: cats?", "Human: dogs?"]
    last = _lines(log.path)[-1]
    assert last["event"] == "data_filter" and last["kept"] == 3
    assert last["dropped_identical"] == 1 and last["dropped_empty"] == 1
    with pytest.raises(pl.ConfigError, match="data.filter"):
        pl.config.validate_config(pl.apply_overrides(pl.PipelineConfig(), ["data.filter=typos"]))


def test_data_runs_split_by_prompt_with_the_library_split():
    rec = data.PreferenceRecord
    records = [rec(f"prompt {i % 40}", f"a{i}", f"b{i}") for i in range(200)]
    dc = pl.DataConfig(heldout_fraction=0.25, seed=3, limit=0)
    train, held = pl.runs.split_records(records, dc)
    assert {r.prompt for r in train}.isdisjoint({r.prompt for r in held})
    assert (train, held) == tuple(
        list(x) for x in data.split_held_out(records, fraction=0.25, seed=3)
    )
    with pytest.raises(ValueError, match="data.heldout_fraction"):
        pl.runs.split_records(records[:1], dc)


# --- exports ----------------------------------------------------------------------------


def test_export_writes_the_merged_policy_and_the_peft_adapters(tmp_path):
    policy = _tiny_policy()
    adapted, _ = pl.runs.with_lora(policy, pl.LoRASettings(rank=2, dropout=0.0), jax.random.key(1))
    assert pl.runs.has_lora(adapted) and not pl.runs.has_lora(policy)
    pl.runs.export_policy(pl.runs.final_policy(adapted), str(tmp_path), "dpo", adapted=adapted)
    assert os.path.isfile(tmp_path / "dpo" / "hf" / "model.safetensors")
    config = json.loads((tmp_path / "dpo" / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 2 and config["peft_type"] == "LORA"
    assert config["base_model_name_or_path"] is None  # trained on no Hugging Face directory
    assert os.path.isfile(tmp_path / "dpo" / "adapter" / "adapter_model.safetensors")
    base = str(tmp_path / "base")
    pl.runs.export_policy(
        pl.runs.final_policy(adapted), str(tmp_path), "sft", adapted=adapted, base_model=base
    )
    config = json.loads((tmp_path / "sft" / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == base
    pl.runs.export_policy(policy, str(tmp_path), "full", adapted=policy)
    assert not os.path.exists(tmp_path / "full" / "adapter")


# --- the sweep example's pairs -------------------------------------------------------------


def test_sweep_pairs_contrast_accepted_and_rejected_completions():
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(
        "sweep_example", os.path.join(root, "examples", "sweep.py")
    )
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    texts = ["a cat", "nothing", "a dog", "none", "x", "y", "a fox", "a pig", "z", "w", "q", "r"]
    labels = [pl.task.animal_score(t) for t in texts]
    pairs = sweep.contrast_pairs(["p0", "p1", "p2"], texts, labels, 4, per_prompt=3)
    # p0 and p1: two accepted, two rejected -> two pairs each; p2: none accepted.
    assert [(r.prompt, r.chosen, r.rejected) for r in pairs] == [
        ("p0", "a cat", "nothing"),
        ("p0", "a dog", "none"),
        ("p1", "a fox", "x"),
        ("p1", "a pig", "y"),
    ]
    assert len(sweep.contrast_pairs(["p0"], texts[:4], labels[:4], 4, per_prompt=1)) == 1


def test_exports_name_the_special_tokens_and_carry_the_tokenizer_files(tmp_path):
    """The `hf/` exports name the tokenizer's BOS and EOS in `config.json` (transformers'
    `generate` stops at EOS only then), the reward model its padding id too (transformers
    scores batches of a sequence classifier only with one); a Hugging Face tokenizer's
    chat template file and generation config come along, for `tokenizer.model` too."""
    from rlhf_eqx.assets import asset_path

    policy, tok = pl.tools.load_model("builtin")
    pl.runs.export_policy(policy, str(tmp_path), "sft", tokenizer_file=asset_path("tok512.bin"))
    config = json.loads((tmp_path / "sft" / "hf" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (tok.bos_id, tok.eos_id)
    assert "pad_token_id" not in config
    rm = rx.RewardModel(policy.cfg, key=jax.random.key(0))
    pl.runs.export_reward_model(rm, str(tmp_path), tokenizer_file=asset_path("tok512.bin"))
    config = json.loads((tmp_path / "reward" / "hf" / "config.json").read_text())
    assert config["pad_token_id"] == tok.pad_id and config["eos_token_id"] == tok.eos_id
    src = tmp_path / "src"
    src.mkdir()
    (src / "tokenizer.model").write_bytes(b"not read here")
    (src / "chat_template.jinja").write_text("{{ messages }}")
    (src / "generation_config.json").write_text('{"eos_token_id": 2}')
    out = tmp_path / "out"
    out.mkdir()
    pl.runs.copy_tokenizer(str(src / "tokenizer.model"), str(out))
    assert sorted(os.listdir(out)) == [
        "chat_template.jinja",
        "generation_config.json",
        "tokenizer.model",
    ]
    with pytest.raises(ValueError, match=r"save_hf: eos_token_id=\[2, 999\]: must be ids in"):
        rx.save_hf(policy, tmp_path / "bad", eos_token_id=[2, 999])
