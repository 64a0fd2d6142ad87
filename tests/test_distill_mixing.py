"""GKD's mixing in `run_distill`: a fraction `lmbda` of the steps trains on the student's
own samples (`on_policy` 1: completions of at most `sampling.max_new_tokens` tokens
sampled for the rows' prompts), the others on the fixed completions (`on_policy` 0: the
rows' own completion tokens); `lmbda` 0 and 1 are all of one kind."""

import jax
import numpy as np
import pytest
from helpers import tiny_policies

import rlhf_eqx as rx
from rlhf_eqx import data, pipelines as pl
from rlhf_eqx.assets import asset_path

_RECORDS = [("Once upon a time", " a dog ran far away."), ("The cat", " sat on a big mat.")] * 2


def _run(tmp_path, lmbda: float, steps: int, *, seq_kd: bool = False, same: bool = False):
    tok = data.load_tokenizer(asset_path("tok512.bin"))
    student, teacher = tiny_policies(tok.vocab_size, 0, 0 if same else 1)
    seqs, _ = data.tokenize_sft(_RECORDS, tok, max_length=24, max_prompt_length=8, add_eos=False)
    b = data.collate_sft(seqs, max_length=24, pad_id=tok.pad_id)
    batch = rx.train.DistillBatch(b.tokens, b.mask, b.completion_mask)
    c = pl.DistillConfig(steps=steps, batch_size=4, max_length=24, lmbda=lmbda, seq_kd=seq_kd)
    ctx = pl.RunContext(
        ops=pl.OpsConfig(quiet=True, monitor=False),
        log=pl.tools.MetricsLog(str(tmp_path / f"{lmbda}-{seq_kd}-{same}"), "distill", quiet=True),
        key=jax.random.key(2),
        prompt_length=8,
        max_new_tokens=3,
    )
    prompts = [p for p, _ in _RECORDS]
    res = pl.runs.run_distill(student, teacher, tok, prompts, batch, cfg=c, ctx=ctx)
    fixed = float(np.sum(np.asarray(b.completion_mask & b.mask)))  # every row, each step
    return res.loop.history, fixed


@pytest.mark.parametrize("lmbda", [0.0, 1.0])
def test_lmbda_zero_and_one_are_all_off_and_all_on_policy(tmp_path, lmbda):
    history, fixed = _run(tmp_path, lmbda, 3)
    assert [h["on_policy"] for h in history] == [lmbda] * 3
    for h in history:
        if lmbda == 0.0:  # the batch is the 4 rows' own completions
            assert h["num_tokens"] == fixed
        else:  # 4 sampled completions of at most max_new_tokens=3 tokens each
            assert 4 <= h["num_tokens"] <= 4 * 3


def test_lmbda_mixes_the_two_kinds_of_steps(tmp_path):
    history, fixed = _run(tmp_path, 0.5, 12)
    on = [h["on_policy"] for h in history]
    assert set(on) == {0.0, 1.0}  # both kinds (a fair coin each step)
    for h in history:
        assert (h["num_tokens"] <= 12) if h["on_policy"] else (h["num_tokens"] == fixed)


def test_seq_kd_trains_on_the_teachers_samples_instead_of_the_fixed_completions(tmp_path):
    # lmbda 0: no on-policy step; every step's completions are the teacher's samples (at
    # most max_new_tokens=3 tokens a row), not the rows' own completions
    history, fixed = _run(tmp_path, 0.0, 3, seq_kd=True)
    assert [(h["on_policy"], h["teacher_sampled"]) for h in history] == [(0.0, 1.0)] * 3
    assert all(4 <= h["num_tokens"] <= 4 * 3 < fixed for h in history)
    # without it, the fixed completions, and no step is marked teacher-sampled
    history, _ = _run(tmp_path, 0.0, 2)
    assert [h["teacher_sampled"] for h in history] == [0.0, 0.0]


def test_seq_kd_samples_the_teacher_as_an_on_policy_step_samples_the_student(tmp_path):
    # teacher and student the same weights: the first step's completions are the same
    # tokens whichever of the two samples them (same key), so the first steps agree
    seq_kd, _ = _run(tmp_path, 0.0, 1, seq_kd=True, same=True)
    on_policy, _ = _run(tmp_path, 1.0, 1, same=True)
    assert seq_kd[0]["num_tokens"] == on_policy[0]["num_tokens"]
    assert seq_kd[0]["loss"] == on_policy[0]["loss"]


def test_an_on_policy_step_samples_the_student_even_with_seq_kd(tmp_path):
    history, _ = _run(tmp_path, 1.0, 2, seq_kd=True)
    assert [(h["on_policy"], h["teacher_sampled"]) for h in history] == [(1.0, 0.0)] * 2
