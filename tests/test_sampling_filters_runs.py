"""The run settings `sampling.top_k`, `sampling.top_p` and `sampling.min_p` (TRL's
GRPOConfig and vLLM's names; 0, 1 and 0 are off) reach every sampler a run uses:
rollouts (static and continuous batching) and their continuations, GRPO's rollouts
through the run context, the `sample` and `eval` commands; bad values, and values a
run would not read, are refused by name before anything runs."""

import dataclasses
import json

import jax
import pytest

from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main

PROMPTS = ["Once upon a time", "Tom had a ball"]
OPTS = dict(group_size=4, prompt_length=16, max_new_tokens=8)


@pytest.fixture(scope="module")
def builtin():
    return pl.tools.load_model("builtin")


def _groups(roll, size: int = 4) -> list[set[str]]:
    return [set(roll.texts[i : i + size]) for i in range(0, len(roll.texts), size)]


def test_unfiltered_groups_vary(builtin):
    policy, tok = builtin
    roll = pl.runs.sample_rollout(policy, tok, PROMPTS, jax.random.key(0), **OPTS)
    assert any(len(g) > 1 for g in _groups(roll))  # what the filters below take away


@pytest.mark.parametrize("filters", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
@pytest.mark.parametrize("slots", [0, 4])
def test_a_filter_keeping_the_likeliest_token_alone_samples_the_greedy_text(
    builtin, filters, slots
):
    policy, tok = builtin
    rolls = [
        pl.runs.sample_rollout(policy, tok, PROMPTS, jax.random.key(k), **OPTS, **filters)
        for k in (0, 1)
    ]
    greedy = pl.runs.sample_rollout(
        policy, tok, PROMPTS, jax.random.key(2), **OPTS, top_k=1, slots=slots
    )
    for roll in rolls:
        assert all(len(g) == 1 for g in _groups(roll)), roll.texts
        assert roll.texts == greedy.texts


def test_a_continued_rollout_keeps_its_filters(builtin):
    """A partial rollout's continuation samples with the rollout's own top-k: four greedy
    tokens then four more are the eight greedy tokens."""
    policy, tok = builtin
    half = dict(OPTS, max_new_tokens=4)
    pending = pl.runs.dispatch_rollout(policy, tok, PROMPTS, jax.random.key(0), **half, top_k=1)
    more = pl.runs.continue_rollout(
        policy, pending, jax.random.key(1), max_new_tokens=4, temperature=1.0, pad_id=tok.pad_id
    )
    whole = pl.runs.sample_rollout(policy, tok, PROMPTS, jax.random.key(3), **OPTS, top_k=1)
    assert pl.runs.finish_rollout(more, tok).texts == whole.texts


@pytest.mark.slow
def test_grpo_rollouts_read_the_run_context_filters(builtin, tmp_path):
    """With `top_k=1` every completion of a group is the same text: no group has a reward
    spread (`frac_reward_zero_std` 1), where the unfiltered rollouts had one."""
    policy, tok = builtin
    cfg = dataclasses.replace(
        pl.animal_task_config().grpo, prompts_per_rollout=2, group_size=4, rollouts=1
    )
    reward = [pl.runs.RewardFunction("length", lambda p, t: float(len(t)))]
    spreads = {}
    for name, top_k in (("free", 0), ("top1", 1)):
        log = pl.tools.MetricsLog(str(tmp_path), name, quiet=True)
        ctx = pl.RunContext(
            ops=pl.OpsConfig(monitor=False, quiet=True),
            log=log,
            key=jax.random.key(0),
            prompt_length=16,
            max_new_tokens=8,
            top_k=top_k,
        )
        pl.runs.run_grpo(policy, tok, PROMPTS * 4, reward=reward, cfg=cfg, ctx=ctx)
        recs = [r for r in pl.tools.read_records(str(tmp_path)) if r.get("stage") == name]
        spreads[name] = [r["frac_reward_zero_std"] for r in recs if "frac_reward_zero_std" in r]
    assert spreads["top1"] == [1.0] and spreads["free"][0] < 1.0, spreads


@pytest.mark.slow
def test_sample_and_eval_read_the_filters(capsys):
    argv = ["sample", "-n", "3", "--prompt", "Once upon a time", "--set", "sampling.top_k=1"]
    assert main([*argv, "--set", "sampling.max_new_tokens=8"]) == 0
    texts = [t for t in capsys.readouterr().out.strip().split("\n") if t.startswith("Once")]
    assert len(texts) == 3 and len(set(texts)) == 1, texts
    sets = ["--set", "eval_samples=2", "--set", "sampling.max_new_tokens=8"]
    results = []
    for seed in (0, 1):
        assert main(["eval", *sets, "--set", "sampling.min_p=1", "--set", f"ops.seed={seed}"]) == 0
        out = capsys.readouterr().out
        results.append(json.loads(out[out.index("{") :]))
    assert results[0] == results[1]  # greedy: the key no longer matters


@pytest.mark.parametrize(
    "setting, why",
    [
        ("sampling.top_k=-1", "sampling.top_k=-1: "),
        ("sampling.top_p=0", "sampling.top_p=0.0: must be in (0, 1]"),
        ("sampling.top_p=1.5", "sampling.top_p=1.5: must be in (0, 1]"),
        ("sampling.min_p=1.5", "sampling.min_p=1.5: must be in [0, 1]"),
    ],
)
def test_bad_filter_values_are_refused_by_name(capsys, setting, why):
    assert main(["grpo", "--set", setting, "--show-config"]) == 2
    assert f"error: invalid configuration: {why}" in capsys.readouterr().err


def test_trl_names_point_to_the_sampling_section(capsys):
    assert main(["grpo", "--set", "grpo.top_p=0.9", "--show-config"]) == 2
    assert "TRL's top_p is sampling.top_p here" in capsys.readouterr().err


def test_a_data_file_stage_that_samples_nothing_refuses_them(tmp_path, capsys):
    path = tmp_path / "prefs.jsonl"
    path.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n")
    argv = ["reward", "--data", str(path), "--set", "sampling.top_p=0.9", "--show-config"]
    assert main(argv) == 2
    assert "sampling.top_p=0.9: the reward stage samples no completions" in capsys.readouterr().err
