"""Online DPO's pairs: for each prompt, the completion the label (a judge's or a reward
model's score) ranks first is chosen and the one it ranks last rejected; a prompt whose
completions tie gives no pair. Worked by hand, then through `run_online_dpo`."""

import jax
import numpy as np

from rlhf_eqx import pipelines as pl


def test_best_worst_pairs_by_hand():
    prompts = ["a", "b", "c"]
    texts = ["a0", "a1", "a2", "b0", "b1", "b2", "c0", "c1", "c2"]
    labels = [0.1, 0.9, 0.5, 0.3, 0.3, 0.3, 2.0, -1.0, 2.0]
    pairs = pl.runs.best_worst_pairs(prompts, texts, labels, 3)
    # a: best a1 (0.9), worst a0 (0.1); b: all tie, no pair; c: the first of the tied
    # best (c0) against c1
    assert [(p.prompt, p.chosen, p.rejected) for p in pairs] == [
        ("a", "a1", "a0"),
        ("c", "c0", "c1"),
    ]


def test_run_online_dpo_labels_each_prompts_samples_and_pairs_best_with_worst(tmp_path):
    """The label function gets each prompt's `samples` completions together, in prompt
    order (the rows `best_worst_pairs` reads); a round's `pairs` counts the prompts
    whose labels differ, and a round where every label ties logs `no_signal` and takes
    no step."""
    policy, tok = pl.tools.load_model("builtin")
    prompts = ["Once upon a time", "Tom had a red ball", "The sun"]
    seen = []

    def label(ps, texts, r):
        seen.append((list(ps), list(texts), r))
        if r == 1:  # a judge with no preference
            return [0.0] * len(texts)
        # prompt 0: by completion length; prompt 1: a tie; prompt 2: by the text order
        out = []
        for j, p in enumerate(ps):
            k = prompts.index(p)
            out.append(float(len(texts[j])) if k == 0 else 1.0 if k == 1 else float(j % 2))
        return out

    ctx = pl.RunContext(
        ops=pl.OpsConfig(quiet=True),
        log=pl.tools.MetricsLog(str(tmp_path), "online-dpo", quiet=True),
        key=jax.random.key(0),
        prompt_length=16,
        max_new_tokens=6,
    )
    cfg = pl.DPOConfig(rounds=2, samples=2, steps=1, batch_size=2, max_length=40)
    res = pl.runs.run_online_dpo(policy, tok, prompts, label, cfg=cfg, ctx=ctx)
    assert [r for _, _, r in seen] == [0, 1]
    ps, texts, _ = seen[0]
    assert ps == [p for p in prompts for _ in range(2)]
    lengths = [len(t) for t in texts[:2]]
    want = int(lengths[0] != lengths[1]) + 1  # prompt 0 if its lengths differ, prompt 2
    records = pl.tools.read_records(str(tmp_path))
    steps = [r for r in records if "step" in r]
    assert [r["iteration"] for r in steps] == [0]  # round 1 took no step
    assert steps[0]["rollout/pairs"] == want and np.isfinite(steps[0]["loss"])
    events = [r for r in records if r.get("event") == "no_signal"]
    assert len(events) == 1 and events[0]["iteration"] == 1
    assert len(res.history) == 1
