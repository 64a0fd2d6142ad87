"""KTO's mismatched rows as a TRL `KTOTrainer` user lays out unpaired data: several
completions of one prompt next to each other (a prompt's samples, a file grouped by
prompt) still pair each prompt with another prompt's completion."""

import json

import numpy as np
import pytest

from rlhf_eqx import data, pipelines as pl
from rlhf_eqx.__main__ import main


def _rows(batch, field, mask_field):
    tokens, mask = np.asarray(getattr(batch, field)), np.asarray(getattr(batch, mask_field))
    return [tokens[i][mask[i]].tolist() for i in range(tokens.shape[0])]


def _kl_prompts_and_completions(records):
    tok = data.ByteTokenizer()
    lengths = data.SequenceLengths(max_length=32, max_prompt_length=8)
    examples, _ = data.tokenize_unpaired(records, tok, lengths=lengths)
    batch = data.collate_unpaired(examples, pad_id=tok.pad_id, lengths=lengths)
    comps = _rows(batch, "tokens", "completion_mask")
    kl_comps = _rows(batch, "kl_tokens", "kl_completion_mask")
    kl_rows = _rows(batch, "kl_tokens", "kl_mask")
    prompts = [row[: len(row) - len(c)] for row, c in zip(kl_rows, kl_comps)]
    return prompts, [comps.index(c) for c in kl_comps]


def test_grouped_prompts_pair_with_another_prompts_completion():
    # four samples of each of three prompts, grouped as a sampler returns them
    records = [
        data.UnpairedRecord(p, f" {p}{k}", k % 2 == 0) for p in ("ab", "cd", "ef") for k in range(4)
    ]
    _, sources = _kl_prompts_and_completions(records)
    for i, j in enumerate(sources):
        assert records[j].prompt != records[i].prompt, (i, j)
    # TRL's shift by one where the neighbour has another prompt (the first of each group);
    # the others take the last completion of the previous group (cyclically)
    assert sources == [11, 11, 11, 11, 3, 3, 3, 3, 7, 7, 7, 7]


def test_distinct_neighbours_keep_trls_shift_by_one():
    records = [data.UnpairedRecord(p, f" {p}{i}", i % 2 == 0) for i, p in enumerate("abcab")]
    _, sources = _kl_prompts_and_completions(records)
    assert sources == [4, 0, 1, 2, 3]


@pytest.mark.parametrize("layout", ["wraps", "one_prompt"])
def test_runs_across_the_end_and_a_single_prompt(layout):
    prompts = ["a", "b", "b", "a", "a"] if layout == "wraps" else ["a", "a", "a"]
    records = [data.UnpairedRecord(p, f" {p}{i}", i % 2 == 0) for i, p in enumerate(prompts)]
    _, sources = _kl_prompts_and_completions(records)
    if layout == "wraps":
        # the run of 'a' wraps from the end to the front: its rows take the last 'b'
        assert sources == [2, 0, 0, 2, 2]
    else:  # no other prompt: TRL's shift by one
        assert sources == [2, 0, 1]


def _first_step(tmp_path, loss_type):
    rows = [
        {"prompt": f"Tom {i} went out.", "completion": " He ran.", "label": bool(i % 2)}
        for i in range(16)
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / loss_type
    argv = ["kto", "--data", str(path), "--out", str(out), "--quiet"]
    for s in ("kto.steps=1", "kto.batch_size=4", f"kto.loss_type={loss_type}"):
        argv += ["--set", s]
    argv += ["--set", "data.heldout_fraction=0.3", "--set", "data.eval_prompts=0"]
    assert main(argv) == 0
    records = pl.tools.read_records(str(out))
    return next(r for r in records if r.get("step") == 0 and "loss" in r)


@pytest.mark.slow  # a whole run of a stage (8-15 s): in the slow suite
def test_apo_zero_unpaired_counts_no_mismatched_rows(tmp_path):
    """`apo_zero_unpaired` has no reference point: its rows are the examples alone, so
    its model FLOPs per step are half of `kto`'s (which also reads a mismatched row per
    example)."""
    kto = _first_step(tmp_path, "kto")
    apo = _first_step(tmp_path, "apo_zero_unpaired")
    assert apo["model_flops"] == kto["model_flops"] / 2


@pytest.mark.slow
def test_builtin_task_reports_its_imbalanced_labels(tmp_path, capsys):
    """The built-in task's samples (about one in five desirable) lie outside the
    recommended weighted balance [1, 4/3]: a `kto_weights` event, and the summary counts
    the examples of each kind, as on a data file."""
    out = tmp_path / "run"
    argv = ["kto", "--out", str(out), "--quiet", "--set", "sft.steps=1", "--set", "kto.steps=1"]
    assert main(argv + ["--set", "ops.monitor=false"]) == 0
    assert "[kto] kto_weights: " in capsys.readouterr().err
    (event,) = [r for r in pl.tools.read_records(str(out)) if r.get("event") == "kto_weights"]
    assert not 1 <= event["ratio"] <= 4 / 3
    kto = json.loads((out / "summary.json").read_text())["kto"]
    assert event["ratio"] == kto["train_desirable"] / kto["train_undesirable"]
