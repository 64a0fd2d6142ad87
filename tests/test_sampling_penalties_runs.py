"""The run settings `sampling.repetition_penalty` (TRL's GRPOConfig name, 1.0 off),
`sampling.presence_penalty` and `sampling.frequency_penalty` (OpenAI's and vLLM's, 0 off)
reach every sampler a run uses: rollouts (static and continuous batching) and their
continuations, the run context, multi-turn episodes, the `sample` command; the defaults
sample the same numbers as before; bad values, values a run would not read and a
presence / frequency penalty with partial rollouts are refused by name."""

import json

import jax
import numpy as np
import pytest

import rlhf_eqx as rx
from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main

PROMPTS = ["Once upon a time", "Tom had a ball"]
OPTS = dict(group_size=2, prompt_length=16, max_new_tokens=8)
PENALTIES = dict(repetition_penalty=2.0, presence_penalty=1.5, frequency_penalty=0.5)


@pytest.fixture(scope="module")
def builtin():
    return pl.tools.load_model("builtin")


def _direct(policy, tok, roll, key, **kw):
    """`rlhf_eqx.generate_batch` on the rollout `roll`'s own prompts, stop ids and key."""
    ids = pl.runs.encode_prompts(tok, PROMPTS, prompt_length=16)
    batch = rx.data.collate_prompts(list(ids), max_length=16, pad_id=tok.pad_id)
    return rx.generate_batch(
        policy, batch.tokens, batch.mask, key, max_new_tokens=8, num_samples=2,
        eos_id=list(roll.stop_ids), pad_id=tok.pad_id, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("slots", [0, 4])
def test_rollouts_sample_with_the_penalties(builtin, slots):
    """Greedy (top-k 1) rollouts with the penalties are `generate_batch`'s with them, and
    not the unpenalised ones; continuous batching samples the same."""
    policy, tok = builtin
    key = jax.random.key(0)
    roll = pl.runs.dispatch_rollout(
        policy, tok, PROMPTS, key, **OPTS, top_k=1, slots=slots, **PENALTIES
    )
    want = _direct(policy, tok, roll, key, top_k=1, **PENALTIES)
    np.testing.assert_array_equal(roll.out.tokens, want.tokens)
    plain = _direct(policy, tok, roll, key, top_k=1)
    assert not np.array_equal(roll.out.tokens, plain.tokens)
    assert roll.filters == dict(top_k=1, **PENALTIES)


def test_the_defaults_sample_todays_numbers(builtin):
    policy, tok = builtin
    key = jax.random.key(1)
    off = dict(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
    roll = pl.runs.dispatch_rollout(policy, tok, PROMPTS, key, **OPTS, **off)
    assert roll.filters == {}
    want = _direct(policy, tok, roll, key)
    np.testing.assert_array_equal(roll.out.tokens, want.tokens)
    np.testing.assert_array_equal(roll.out.logprobs, want.logprobs)


@pytest.mark.slow
def test_a_continued_rollout_keeps_its_repetition_penalty(builtin):
    """Four greedy penalised tokens then four more are the eight (the continuation's
    prompt, the prompt and the tokens so far, is the same context)."""
    policy, tok = builtin
    half = dict(OPTS, max_new_tokens=4)
    kw = dict(top_k=1, repetition_penalty=2.0)
    pending = pl.runs.dispatch_rollout(policy, tok, PROMPTS, jax.random.key(0), **half, **kw)
    more = pl.runs.continue_rollout(
        policy, pending, jax.random.key(1), max_new_tokens=4, temperature=1.0, pad_id=tok.pad_id
    )
    whole = pl.runs.sample_rollout(policy, tok, PROMPTS, jax.random.key(3), **OPTS, **kw)
    assert pl.runs.finish_rollout(more, tok).texts == whole.texts


def test_a_continuation_refuses_presence_and_frequency_penalties(builtin):
    """They count the generated tokens only; a continued row's tokens so far would be
    its prompt."""
    policy, tok = builtin
    pending = pl.runs.dispatch_rollout(
        policy, tok, PROMPTS, jax.random.key(0), **OPTS, presence_penalty=0.5
    )
    with pytest.raises(ValueError, match="presence_penalty=0.5 counts the generated"):
        pl.runs.continue_rollout(
            policy, pending, jax.random.key(1), max_new_tokens=4, temperature=1.0, pad_id=0
        )


def test_the_config_and_the_run_context_carry_them(tmp_path):
    cfg = pl.apply_overrides(
        pl.animal_task_config(),
        ["sampling.repetition_penalty=1.2", "sampling.frequency_penalty=-0.5"],
    )
    s = cfg.sampling
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (1.2, 0.0, -0.5)
    ctx = pl.RunContext(
        ops=pl.OpsConfig(monitor=False, quiet=True),
        log=pl.tools.MetricsLog(str(tmp_path), "grpo", quiet=True),
        key=jax.random.key(0),
        repetition_penalty=1.2,
        frequency_penalty=-0.5,
    )
    assert (ctx.repetition_penalty, ctx.presence_penalty, ctx.frequency_penalty) == (
        1.2,
        0.0,
        -0.5,
    )


@pytest.mark.slow
def test_sample_reads_the_penalties(capsys):
    argv = ["sample", "-n", "2", "--prompt", "Once upon a time", "--set", "sampling.top_k=1"]
    argv += ["--set", "sampling.max_new_tokens=12"]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    assert main([*argv, "--set", "sampling.presence_penalty=2", "--set",
                 "sampling.repetition_penalty=3"]) == 0  # fmt: skip
    assert capsys.readouterr().out != plain


@pytest.mark.parametrize(
    "setting, why",
    [
        ("sampling.repetition_penalty=0", "sampling.repetition_penalty=0.0: must be a number > 0"),
        ("sampling.repetition_penalty=-1", "sampling.repetition_penalty=-1.0: must be"),
        ("sampling.presence_penalty=2.5", "sampling.presence_penalty=2.5: must be in [-2, 2]"),
        ("sampling.frequency_penalty=-3", "sampling.frequency_penalty=-3.0: must be in [-2, 2]"),
    ],
)
def test_bad_penalty_values_are_refused_by_name(capsys, setting, why):
    assert main(["grpo", "--set", setting, "--show-config"]) == 2
    assert f"error: invalid configuration: {why}" in capsys.readouterr().err


def test_presence_and_frequency_penalties_are_refused_with_partial_rollouts(capsys):
    sets = ["--set", "grpo.staleness=1", "--set", "grpo.partial_rollouts=4"]
    assert main(["grpo", *sets, "--show-config"]) == 0
    capsys.readouterr()
    assert main(["grpo", *sets, "--set", "sampling.frequency_penalty=0.5", "--show-config"]) == 2
    err = capsys.readouterr().err
    assert "sampling.frequency_penalty=0.5: is not supported with grpo.partial_rollouts=4" in err
    argv = ["grpo", *sets, "--set", "sampling.repetition_penalty=1.2", "--show-config"]
    assert main(argv) == 0


def test_trl_name_points_to_the_sampling_section(capsys):
    assert main(["grpo", "--set", "grpo.repetition_penalty=1.1", "--show-config"]) == 2
    assert "TRL's repetition_penalty is sampling.repetition_penalty here" in (
        capsys.readouterr().err
    )


def test_a_data_file_stage_that_samples_nothing_refuses_them(tmp_path, capsys):
    path = tmp_path / "prefs.jsonl"
    path.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n")
    for setting in ("repetition_penalty=1.3", "presence_penalty=0.5"):
        argv = ["reward", "--data", str(path), "--set", f"sampling.{setting}", "--show-config"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"sampling.{setting}: the reward stage samples no completions" in err
