"""The DPO example (`examples/dpo_stories.py`): its judge and pairing, and a tiny end-to-end run."""

import dataclasses
import importlib.util
import math
import os

import jax.numpy as jnp
import numpy as np
import pytest

import rlhf_eqx as rx
from rlhf_eqx import data

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "dpo_stories.py")


def _load_example():
    spec = importlib.util.spec_from_file_location("dpo_stories", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ex = _load_example()


def _model_paths(shared_dir):
    base = os.path.join(shared_dir, "models", "stories260K")
    return os.path.join(base, "stories260K.bin"), os.path.join(base, "tok512.bin")


def test_judge_matches_whole_words_any_case_and_plurals():
    words = ("dog", "cat")
    assert ex.judge("The Dog ran.", words) == 1.0
    assert ex.judge("Two cats and DOGS.", words) == 1.0
    assert ex.judge("A doghouse, a catalog, a hotdog.", words) == 0.0
    assert ex.judge("", words) == 0.0
    assert ex.count_words("a dog, a dog and a cat", words) == 3


def test_make_pairs_takes_best_and_worst_and_skips_ties():
    prompts = ["p0", "p1", "p2"]
    completions = [
        [" no animal", " a dog", " a cat"],  # best: first hit, worst: the miss
        [" nothing", " here"],  # all rewards equal: no pair
        [" a bird", " a frog"],  # all rewards equal: no pair
    ]
    pairs = ex.make_pairs(prompts, completions, ("dog", "cat", "bird", "frog"))
    assert pairs == [data.PreferenceRecord("p0", " a dog", " no animal")]


def test_completion_text_keeps_the_leading_space(shared_dir):
    _, tok_path = _model_paths(shared_dir)
    tok = data.load_tokenizer(tok_path)
    prompt = "Once upon a time, there was a"
    full = prompt + " little dog named Max."
    completion_ids = tok.encode(full)[len(tok.encode(prompt)) :]
    assert tok.encode(full)[: len(tok.encode(prompt))] == tok.encode(prompt)
    text = ex.completion_text(tok, prompt, completion_ids)
    assert text == " little dog named Max."
    assert tok.decode(completion_ids) == "little dog named Max."  # why the helper exists


def test_a_nan_loss_stops_training():
    def nan_step(params, opt_state, batch, *, frozen=None):
        del batch, frozen
        return params, opt_state, {"loss": jnp.array(jnp.nan, jnp.float32)}

    state = rx.train.TrainState(
        params=jnp.zeros((2,), jnp.float32),
        frozen=None,
        opt_state=(),
        step=jnp.zeros((), jnp.int32),
    )
    rows = jnp.ones((3, 4), jnp.int32)
    ones = jnp.ones((3, 4), bool)
    batch = rx.PreferenceBatch(rows, ones, ones, rows, ones, ones)
    cfg = dataclasses.replace(ex.Config(), steps=5, batch_size=2, verbose=False)
    with pytest.raises(FloatingPointError, match="nan at step 0"):
        ex.train_round(state, nan_step, batch, cfg, round_index=0)


def test_main_exits_with_a_message_when_training_diverges(shared_dir, monkeypatch):
    model, tok_path = _model_paths(shared_dir)

    def diverge(cfg):
        raise FloatingPointError("the DPO loss is nan at step 3")

    monkeypatch.setattr(ex, "run", diverge)
    with pytest.raises(SystemExit) as info:
        ex.main(["--model", model, "--tokenizer", tok_path])
    assert "training diverged" in str(info.value.code) and "nan" in str(info.value.code)


@pytest.mark.slow
def test_tiny_dpo_run_end_to_end(shared_dir, tmp_path):
    model, tok_path = _model_paths(shared_dir)
    # Target words that about half of the base model's completions contain, so that
    # every seed gives preference pairs even with a handful of samples.
    cfg = dataclasses.replace(
        ex.Config(),
        model=model,
        tokenizer=tok_path,
        words=("she", "he"),
        train_prompts=tuple(ex.TRAIN_PROMPTS[:6]),
        eval_prompts=tuple(ex.EVAL_PROMPTS[:2]),
        samples=4,
        eval_samples=4,
        new_tokens=12,
        rounds=1,
        steps=6,
        batch_size=64,  # all pairs in every step: the loss on them must go down
        lr=5e-3,
        prompt_length=24,
        max_length=40,
        save=str(tmp_path / "merged"),
        verbose=False,
    )
    result = ex.run(cfg)

    assert result.num_pairs[0] >= 1
    assert len(result.history) == cfg.steps
    for metrics in result.history:
        assert all(math.isfinite(v) for v in metrics.values()), metrics
    # A fresh adapter leaves the policy equal to the reference: the first loss is ln 2.
    np.testing.assert_allclose(result.history[0]["loss"], math.log(2.0), atol=1e-5)
    np.testing.assert_allclose(result.history[0]["rewards/margins"], 0.0, atol=1e-5)
    np.testing.assert_allclose(result.loss_before, math.log(2.0), atol=1e-5)
    # Training on the pairs lowers the DPO loss on them.
    assert result.loss_after < math.log(2.0) - 0.05
    assert result.history[-1]["loss"] < result.history[0]["loss"]
    # Merged adapters and a saved-and-reloaded checkpoint compute the same logits.
    assert result.merge_error < 1e-4
    assert result.save_error is not None and result.save_error < 1e-6
    for ev in (result.before, result.after):
        assert 0.0 <= ev.hit_rate <= 1.0 and math.isfinite(ev.base_nll)
        assert [len(c) for c in ev.completions] == [cfg.eval_samples] * len(cfg.eval_prompts)
