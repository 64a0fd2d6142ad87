"""`pipelines.sampled_comparison`: the held-out samples a data-file stage reports before
and after training (base-model NLL of each side's samples, KL to the base, a task score
with its standard error, example completions)."""

import dataclasses

import equinox as eqx
import jax
import numpy as np
import pytest

from rlhf_eqx import pipelines as pl

PROMPTS = ["Once upon a time", "The cat", "Tom had a ball", "Lily saw a dog", "The sun"]


@pytest.fixture(scope="module")
def model():
    return pl.tools.load_model("builtin")


def _cfg(eval_prompts=3, eval_samples=2):
    cfg = pl.PipelineConfig()
    cfg = dataclasses.replace(cfg, eval_samples=eval_samples)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, eval_prompts=eval_prompts))
    s = dataclasses.replace(cfg.sampling, prompt_length=16, max_new_tokens=12)
    return dataclasses.replace(cfg, sampling=s)


def test_same_model_is_paired_and_has_zero_kl(model):
    policy, tok = model
    cfg = _cfg()
    ev = pl.sampled_comparison(policy, policy, tok, PROMPTS + PROMPTS[:2], jax.random.key(0), cfg)
    assert ev["prompts"] == 3 and ev["samples_per_prompt"] == 2
    # the same model with the same key: the same samples on both sides
    assert ev["base_nll_before"] == ev["base_nll_after"] > 0
    assert ev["kl_after"] == pytest.approx(0.0, abs=1e-6)
    assert len(ev["examples"]) == 3
    for ex, p in zip(ev["examples"], PROMPTS):
        assert ex["prompt"] == p and ex["before"] == ex["after"]


def test_nll_matches_completion_nll_and_scores(model):
    policy, tok = model
    cfg = _cfg(eval_prompts=0, eval_samples=3)
    key = jax.random.key(1)
    other = jax.tree.map(lambda x: x * 1.05 if eqx.is_inexact_array(x) else x, policy)
    ev = pl.sampled_comparison(
        policy, other, tok, PROMPTS, key, cfg, score=lambda p, t: float("a" in t), shown=2
    )
    assert ev["prompts"] == len(PROMPTS) and len(ev["examples"]) == 2
    assert ev["kl_after"] != 0.0 and ev["base_nll_after"] != ev["base_nll_before"]
    opts = {
        f: getattr(cfg.sampling, f)
        for f in ("prompt_length", "max_new_tokens", "temperature", "stop_strings", "slots")
    }
    for side, m in (("before", policy), ("after", other)):
        roll = pl.runs.sample_rollout(m, tok, PROMPTS, key, group_size=3, **opts)
        assert ev[f"base_nll_{side}"] == pytest.approx(
            pl.runs.completion_nll(policy, roll), rel=1e-5
        )
        s = np.asarray([float("a" in t) for t in roll.texts])
        assert ev[f"score_{side}"] == pytest.approx(s.mean())
        per_prompt = s.reshape(len(PROMPTS), 3).mean(1)
        se = per_prompt.std(ddof=1) / np.sqrt(len(PROMPTS))
        assert ev[f"score_{side}_se"] == pytest.approx(se, rel=1e-5, abs=1e-9)
        assert ev["examples"][1][side] == roll.texts[3]


def test_no_prompts(model):
    policy, tok = model
    ev = pl.sampled_comparison(policy, policy, tok, [], jax.random.key(0), _cfg())
    assert ev == {"prompts": 0, "samples_per_prompt": 2}
    long = ["Once upon a time " * 12]
    ev = pl.sampled_comparison(policy, policy, tok, long + PROMPTS[:1], jax.random.key(0), _cfg())
    assert ev["prompts"] == 1 and ev["longer_than_prompt_length"] == 1


def test_eval_prompts_is_validated():
    cfg = _cfg(eval_prompts=-1)
    with pytest.raises(Exception, match="data.eval_prompts"):
        pl.config.validate_config(cfg)


def test_reuse_keeps_the_before_side_for_later_calls(model):
    """A sweep's members share the base model's side: with a `reuse` dict a second
    comparison against the same base, prompts, key and settings takes the base's samples
    from it, and reports exactly what sampling them again reports."""
    policy, tok = model
    cfg, key = _cfg(eval_prompts=0, eval_samples=2), jax.random.key(3)
    score = lambda p, t: float("a" in t)  # noqa: E731
    others = [
        jax.tree.map(lambda x, f=f: x * f if eqx.is_inexact_array(x) else x, policy)
        for f in (1.03, 0.97)
    ]
    reuse: dict = {}
    shared = [
        pl.sampled_comparison(policy, o, tok, PROMPTS, key, cfg, score=score, reuse=reuse)
        for o in others
    ]
    assert len(reuse) == 1  # the base sampled once for both
    fresh = [pl.sampled_comparison(policy, o, tok, PROMPTS, key, cfg, score=score) for o in others]
    assert shared == fresh
    assert shared[0]["score_after"] != shared[1]["score_after"] or (
        shared[0]["kl_after"] != shared[1]["kl_after"]
    )
    # another key, other settings or another base: sampled anew
    pl.sampled_comparison(policy, others[0], tok, PROMPTS, jax.random.key(4), cfg, reuse=reuse)
    cfg_t = dataclasses.replace(cfg, sampling=dataclasses.replace(cfg.sampling, temperature=0.5))
    pl.sampled_comparison(policy, others[0], tok, PROMPTS, key, cfg_t, score=score, reuse=reuse)
    pl.sampled_comparison(others[1], others[0], tok, PROMPTS, key, cfg, score=score, reuse=reuse)
    assert len(reuse) == 4
