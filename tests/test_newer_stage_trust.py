"""The newer stages refuse, name and keep what they should: a resume with every checkpoint
damaged or on a changed data file is refused; an empty data file or a directory is named;
a broken chat template names its file; a full disk while writing a checkpoint or an export
gives one line and keeps the previous one; environments declare their stop ids; tool
responses share the observation budget; the distillation stage computes its loss at
τ = 1, as TRL's GKDTrainer does."""

import builtins
import errno
import io
import json
import os
import re
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from helpers import CountingEnv, quadratic_run, tiny_policies
from jaxtyping import TypeCheckError

import rlhf_eqx as rx
from rlhf_eqx import data, pipelines as pl
from rlhf_eqx.__main__ import main
from rlhf_eqx.assets import asset_path
from rlhf_eqx.envs import Environment, ToolEnvironment

_SMALL = [
    "--quiet",
    "--set",
    "sampling.prompt_length=16",
    "--set",
    "data.heldout_fraction=0.25",
    "--set",
    "ops.monitor=false",
    "--set",
    "ops.checkpoint_every=1",
]
_KTO = ["--set", "kto.steps=3", "--set", "kto.batch_size=4", "--set", "kto.max_length=40"]
_PRM = ["--set", "prm.steps=2", "--set", "prm.batch_size=4", "--set", "prm.max_length=48"]


def _unpaired(path, n=16, flip=False):
    with open(path, "w") as f:
        for i in range(n):
            good = (i % 2 == 0) != flip
            rec = {"prompt": f"Once upon a time {i}", "completion": " a dog ran.", "label": good}
            f.write(json.dumps(rec) + "\n")


def _stepwise(path, n=12):
    with open(path, "w") as f:
        for i in range(n):
            rec = {
                "prompt": f"What is {i} + 1?",
                "completions": [f"{i} plus one", f"is {i + 1}"],
                "labels": [True, i % 3 != 0],
            }
            f.write(json.dumps(rec) + "\n")


def _steps(run):
    return [r["step"] for r in pl.tools.read_records(str(run)) if "step" in r and "event" not in r]


# --- empty data files, directories, broken chat templates -------------------------------

_READERS = {
    "load_preferences": data.load_preferences,
    "load_prompts": data.load_prompts,
    "load_unpaired": data.load_unpaired,
    "load_stepwise": data.load_stepwise,
}


@pytest.mark.parametrize("reader", sorted(_READERS))
@pytest.mark.parametrize("content", ["", "\n  \n"])
def test_every_reader_names_an_empty_file_and_a_directory(tmp_path, reader, content):
    empty = tmp_path / "empty.jsonl"
    empty.write_text(content)
    with pytest.raises(data.DataError, match=f"^{re.escape(str(empty))}: no records$"):
        _READERS[reader](empty)
    with pytest.raises(data.DataError, match=f"^{re.escape(str(tmp_path))}: is a directory"):
        _READERS[reader](tmp_path)


def test_a_file_whose_every_record_was_skipped_is_named():
    records = data.PreferenceDataset([], data.LoadReport(path="pairs.jsonl", read=2))
    with pytest.raises(ValueError, match="pairs.jsonl: no usable records"):
        pl.runs.split_records(records, pl.DataConfig())


@pytest.mark.parametrize("stage, extra", [("kto", _KTO), ("prm", _PRM)])
def test_data_stages_name_an_empty_file_and_a_directory(tmp_path, capsys, stage, extra):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    argv = [stage, "--out", str(tmp_path / "run"), *_SMALL, *extra]
    assert main([*argv, "--data", str(empty)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {empty}: no records"]
    folder = tmp_path / "folder"
    folder.mkdir()
    assert main([*argv, "--data", str(folder), "--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: invalid configuration: data.path={str(folder)!r}: is a directory"]


def test_a_broken_chat_template_names_its_file(tmp_path):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    with pytest.raises(
        data.DataError, match=f"^{re.escape(str(broken))}: .*syntax error at line 2"
    ):
        data.load_chat_template(broken)
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x "}))
    config = re.escape(str(model / "tokenizer_config.json"))
    with pytest.raises(data.DataError, match=f"^{config} \\(chat_template\\): .*syntax error"):
        data.load_chat_template(model)
    with pytest.raises(data.DataError, match="missing.jinja: no such file"):
        data.load_chat_template(tmp_path / "missing.jinja")


def test_kto_refuses_examples_of_one_label(tmp_path):
    records = [data.UnpairedRecord("p", " c", True)] * 4
    ctx = pl.RunContext(
        ops=pl.OpsConfig(quiet=True),
        log=pl.tools.MetricsLog(str(tmp_path), "kto"),
        key=jax.random.key(0),
    )
    with pytest.raises(ValueError, match="KTO needs desirable and undesirable examples; all 4"):
        pl.runs.run_kto(_tiny_policy(), None, records, cfg=pl.KTOConfig(), ctx=ctx)


# --- resume: every checkpoint damaged --------------------------------------------------


def _damage(path):
    with open(os.path.join(path, "state.eqx"), "r+b") as f:
        f.write(b"\x00garbage")


def test_a_resume_with_every_checkpoint_damaged_is_refused(tmp_path):
    state, iteration = quadratic_run()
    ops = pl.OpsConfig(quiet=True, checkpoint_every=1, keep=2)
    log = pl.tools.MetricsLog(str(tmp_path), "q", quiet=True)
    ck = str(tmp_path / "ck")
    kw = dict(num_iterations=4, key=jax.random.key(0), ops=ops, log=log, checkpoint_dir=ck)
    pl.loop.run_iterations(state, iteration, **kw)
    names = sorted(os.listdir(ck))
    assert names == ["iter_00000003", "iter_00000004"]
    _damage(os.path.join(ck, names[-1]))  # one damaged: the older one is used
    assert pl.tools.latest_checkpoint(ck).endswith(names[0])
    _damage(os.path.join(ck, names[0]))
    with pytest.raises(pl.loop.RunDirError, match=f"{re.escape(ck)}: every checkpoint is damaged"):
        pl.loop.run_iterations(state, iteration, **kw, resume=True)
    with pytest.raises(pl.loop.RunDirError, match="--overwrite"):
        pl.tools.latest_checkpoint(ck)
    assert pl.tools.latest_checkpoint(str(tmp_path / "none")) is None  # no checkpoint: a new run


@pytest.mark.slow
def test_kto_resume_with_every_checkpoint_damaged_refuses_on_the_command_line(tmp_path, capsys):
    data_file = tmp_path / "unpaired.jsonl"
    _unpaired(data_file)
    out = tmp_path / "run"
    argv = ["kto", "--data", str(data_file), "--out", str(out), *_SMALL, *_KTO]
    assert main(argv) == 0
    ck = out / "kto" / "checkpoints"
    for name in os.listdir(ck):
        _damage(ck / name)
    before = _steps(out)
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: {ck}: every checkpoint is damaged") and "--overwrite" in last
    assert _steps(out) == before == [0, 1, 2]  # nothing was trained again from iteration 0


# --- resume: a changed data file --------------------------------------------------------


def test_check_data_records_and_compares_the_fingerprint(tmp_path):
    path = tmp_path / "d.jsonl"
    _unpaired(path)
    run = tmp_path / "run"
    run.mkdir()
    pl.tools.check_data(str(run), str(path), resume=False)
    stored = json.loads((run / "data.json").read_text())
    assert stored["size"] == os.path.getsize(path) and len(stored["sha256"]) == 64
    pl.tools.check_data(str(run), str(path), resume=True)  # unchanged: resumes
    _unpaired(path, flip=True)  # the same size, other labels
    assert os.path.getsize(path) == stored["size"]
    with pytest.raises(pl.loop.RunDirError, match=f"the data file {re.escape(str(path))} changed"):
        pl.tools.check_data(str(run), str(path), resume=True)
    pl.tools.check_data(str(run), str(path), resume=False)  # a new run records the new file


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["kto", "prm"])
def test_a_resume_on_a_changed_data_file_is_refused(tmp_path, capsys, stage):
    data_file = tmp_path / "data.jsonl"
    (_unpaired if stage == "kto" else _stepwise)(data_file)
    out = tmp_path / "run"
    own = _KTO if stage == "kto" else _PRM  # each reads its own section alone
    argv = [stage, "--data", str(data_file), "--out", str(out), *_SMALL, *own]
    assert main(argv) == 0
    before = _steps(out)
    original = data_file.read_bytes()
    if stage == "kto":
        _unpaired(data_file, flip=True)
    else:
        data_file.write_text(original.decode().replace("true", "false"))
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"error: {out}: cannot resume: the data file {data_file} changed")
    assert _steps(out) == before
    data_file.write_bytes(original)
    assert main([*argv, "--resume"]) == 0  # the same file again: resumes (finished already)


# --- a full disk ------------------------------------------------------------------------

_ENOSPC_SAFETENSORS = "Error while serializing: I/O error: No space left on device (os error 28)"


class _FullFile(io.FileIO):
    """A file on a full device: every write fails as the kernel's `write(2)` would."""

    def write(self, b):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _fill_disk_for_checkpoints(monkeypatch, after: int = 0):
    """Checkpoint writes after the first `after` hit a full disk."""
    calls = {"n": 0}

    real_open = builtins.open

    def fake_open(path, mode="r", *a, **k):
        if str(path).endswith("state.eqx") and "w" in mode:
            calls["n"] += 1
            if calls["n"] > after:
                return _FullFile(path, "wb")
        return real_open(path, mode, *a, **k)

    monkeypatch.setattr(builtins, "open", fake_open)


def _fill_disk_for_safetensors(monkeypatch):
    """safetensors' writer (Rust) on a full device: its error, as a 64 KiB tmpfs gives it."""

    def full(*a, **k):
        raise safetensors.SafetensorError(_ENOSPC_SAFETENSORS)

    monkeypatch.setattr(safetensors.numpy, "serialize_file", full)


def test_a_full_disk_while_checkpointing_names_the_directory(tmp_path, monkeypatch):
    tree = {"a": jnp.arange(4.0)}
    d = str(tmp_path / "ck")
    pl.tools.save_checkpoint(d, 1, tree, {}, keep=2)
    _fill_disk_for_checkpoints(monkeypatch)
    with pytest.raises(OSError, match=f"^no space left on the device of {re.escape(d)}") as e:
        pl.tools.save_checkpoint(d, 2, tree, {}, keep=2)
    assert e.value.errno == errno.ENOSPC and "\n" not in str(e.value)
    assert sorted(os.listdir(d)) == ["iter_00000001"]
    restored, _ = pl.tools.restore_checkpoint(pl.tools.latest_checkpoint(d), tree)
    np.testing.assert_array_equal(restored["a"], np.arange(4.0))


def _tiny_policy(key=0):
    cfg = rx.TransformerConfig(
        vocab_size=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=32
    )
    return rx.Policy(cfg, key=jax.random.key(key))


def test_a_full_disk_while_exporting_names_the_directory_and_keeps_the_old_export(
    tmp_path, monkeypatch
):
    policy = _tiny_policy()
    lora = rx.apply_lora(policy, rx.LoRAConfig(rank=2), key=jax.random.key(1))
    rm = rx.RewardModel.from_policy(policy, key=jax.random.key(2))
    rm = eqx.tree_at(lambda m: m.bias, rm, jnp.zeros_like(rm.bias))
    hf, adapter, run = tmp_path / "hf", tmp_path / "adapter", tmp_path / "run"
    rx.save_hf(policy, hf)
    rx.save_lora_adapter(lora, adapter)
    pl.runs.export_reward_model(rm, str(run))
    saved = {p: sorted(os.listdir(p)) for p in (hf, adapter, run / "reward" / "hf")}
    weights = (hf / "model.safetensors").read_bytes()
    _fill_disk_for_safetensors(monkeypatch)
    cases = [
        (lambda: rx.save_hf(_tiny_policy(3), hf), hf),
        (lambda: rx.save_lora_adapter(lora, adapter), adapter),
        (lambda: pl.runs.export_reward_model(rm, str(run)), run / "reward" / "hf"),
    ]
    for write, where in cases:
        with pytest.raises(OSError, match=f"^no space left on the device of {where} ") as e:
            write()
        assert e.value.errno == errno.ENOSPC and "\n" not in str(e.value)
    assert {p: sorted(os.listdir(p)) for p in saved} == saved
    assert (hf / "model.safetensors").read_bytes() == weights
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no staging left
    assert isinstance(rx.load_hf(hf), rx.Policy)


@pytest.mark.slow
def test_a_full_disk_on_the_command_line_is_one_line_and_keeps_the_checkpoints(
    tmp_path, capsys, monkeypatch
):
    data_file = tmp_path / "unpaired.jsonl"
    _unpaired(data_file)
    out = tmp_path / "run"
    argv = ["kto", "--data", str(data_file), "--out", str(out), *_SMALL, *_KTO]
    _fill_disk_for_checkpoints(monkeypatch, after=1)  # the second checkpoint cannot be written
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    ck = out / "kto" / "checkpoints"
    assert err == [f"error: no space left on the device of {ck} (checkpoint not written)"]
    assert pl.tools.latest_checkpoint(str(ck)).endswith("iter_00000001")
    monkeypatch.undo()
    _fill_disk_for_safetensors(monkeypatch)  # training resumes; the export cannot be written
    assert main([*argv, "--resume"]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if "resume:" not in line]
    assert err == [
        f"error: no space left on the device of {out / 'kto' / 'hf'} (export not written; "
        "what was there before is unchanged)"
    ]
    assert pl.tools.latest_checkpoint(str(ck)).endswith("iter_00000003")
    monkeypatch.undo()
    assert main([*argv, "--resume"]) == 0  # space again: the export is written
    assert (out / "kto" / "hf" / "model.safetensors").exists()


# --- environments -----------------------------------------------------------------------


def test_environments_declare_stop_ids_with_a_default():
    tok = data.load_tokenizer(asset_path("tok512.bin"))
    assert CountingEnv().stop_ids == ()
    # none of its own: where a single-turn completion of this tokenizer stops (EOS, BOS)
    assert pl.runs.turn_stop_ids(CountingEnv(), tok) == tuple(sorted({tok.eos_id, tok.bos_id}))
    animal = rx.envs.AnimalFollowUpEnv(tok)
    assert animal.stop_ids and pl.runs.turn_stop_ids(animal, tok) == animal.stop_ids
    assert "stop_ids" in Environment.__doc__


@pytest.mark.slow
def test_run_multiturn_runs_an_environment_without_stop_ids(tmp_path):
    policy, tok = pl.tools.load_model("builtin")
    cfg = pl.MultiturnConfig(
        rollouts=1, prompts_per_rollout=2, group_size=2, max_turns=2, turn_tokens=4
    )
    ops = pl.OpsConfig(quiet=True, monitor=False)
    ctx = pl.RunContext(
        ops=ops,
        log=pl.tools.MetricsLog(str(tmp_path), "multiturn", quiet=True),
        key=jax.random.key(0),
        prompt_length=8,
    )
    res = pl.runs.run_multiturn(
        policy, tok, ["Once upon a time", "The cat"], CountingEnv(), cfg=cfg, ctx=ctx
    )
    assert res.loop.iterations == 1 and res.loop.stopped == "done"


def _calls(*names):
    return "".join(
        "<tool_call>" + json.dumps({"name": n, "arguments": {}}) + "</tool_call>" for n in names
    )


def test_tool_responses_share_the_observation_budget():
    tok = rx.data.ByteTokenizer()

    def lookup():
        return "The quick brown fox jumps over the lazy dog. " * 20

    error = "the database connection was refused because the credentials expired at noon"

    def fail():
        raise ValueError(error)

    tools = {"lookup": lookup, "fail": fail}
    for budget in (140, 200, 300):
        env = ToolEnvironment(tools, tok, max_observation_tokens=budget)
        env.reset([])
        obs, reward, done = env.step_text(_calls("lookup", "lookup", "fail"))
        assert len(tok.encode(obs)) <= budget and not done
        parts = re.findall(r"<tool_response>(.*?)</tool_response>", obs, re.DOTALL)
        assert len(parts) == 3
        for part, full in zip(parts, (lookup(), lookup(), f"error: ValueError: {error}")):
            assert part.endswith("...[cut]")
            head = part[: -len("...[cut]")]
            assert len(head.split()) >= 1 and full.startswith(head)
            # cut at a word boundary: the kept text ends where a word of the full text ends
            assert full[len(head)] in " ."
    # a short response is kept whole, the long ones share what it leaves
    env = ToolEnvironment({"lookup": lookup, "ok": lambda: "4"}, tok, max_observation_tokens=160)
    env.reset([])
    obs, _, _ = env.step_text(_calls("lookup", "ok", "lookup"))
    parts = re.findall(r"<tool_response>(.*?)</tool_response>", obs, re.DOTALL)
    assert parts[1] == "4" and len(parts[0]) == len(parts[2]) > len("...[cut]") + 3
    # a budget that cannot hold a readable part of each response is named
    env = ToolEnvironment(tools, tok, max_observation_tokens=100)
    env.reset([])
    with pytest.raises(ValueError, match="max_observation_tokens=100 leaves 5 tokens .* at least"):
        env.step_text(_calls("lookup", "lookup", "fail"))


# --- docstrings agree with behaviour ----------------------------------------------------


def test_generate_continuous_raises_what_its_docstring_says_for_too_few_keys():
    policy = _tiny_policy()
    prompts = jnp.ones((3, 4), jnp.int32)
    masks = jnp.ones((3, 4), bool)
    keys = jax.random.split(jax.random.key(0), 2)
    assert "TypeCheckError" in rx.generate_continuous.__doc__
    with pytest.raises(TypeCheckError):
        rx.generate_continuous(policy, prompts, masks, keys, slots=2, max_new_tokens=2)


def test_batches_raise_what_the_batches_docstring_says():
    assert "TypeCheckError" in sys.modules[rx.PreferenceBatch.__module__].__doc__
    tokens, mask = jnp.ones((2, 5), jnp.int32), jnp.ones((2, 5), bool)
    with pytest.raises(TypeCheckError):  # a mask of another shape: the annotation says so
        rx.train.DistillBatch(tokens, mask[:, :4], mask)
    with pytest.raises(data.DataError, match=r"DistillBatch.tokens has shape \(0, 5\)"):
        rx.train.DistillBatch(tokens[:0], mask[:0], mask[:0])


# --- distillation at TRL's temperatures -------------------------------------------------


def test_the_distillation_stage_samples_at_its_temperature_and_computes_the_loss_at_one(
    tmp_path,
):
    tok = data.load_tokenizer(asset_path("tok512.bin"))
    student, teacher = tiny_policies(tok.vocab_size, 0, 1)
    records = [("Once upon a time", " a dog ran."), ("The cat", " sat on a mat.")] * 2
    seqs, _ = data.tokenize_sft(records, tok, max_length=24, max_prompt_length=8, add_eos=False)
    b = data.collate_sft(seqs, max_length=24, pad_id=tok.pad_id)
    batch = rx.train.DistillBatch(b.tokens, b.mask, b.completion_mask)
    c = pl.DistillConfig(steps=1, batch_size=4, max_length=24, lmbda=0.0, temperature=0.9)
    ctx = pl.RunContext(
        ops=pl.OpsConfig(quiet=True, monitor=False),
        log=pl.tools.MetricsLog(str(tmp_path), "distill", quiet=True),
        key=jax.random.key(2),
        prompt_length=8,
    )
    res = pl.runs.run_distill(student, teacher, tok, [p for p, _ in records], batch, cfg=c, ctx=ctx)
    jsd = res.loop.history[0]["jsd"]  # before the update: the student as given (LoRA B = 0)
    at_one = pl.runs.distill_divergence(student, teacher, batch, beta=0.5, temperature=1.0)
    at_09 = pl.runs.distill_divergence(student, teacher, batch, beta=0.5, temperature=0.9)
    assert jsd == pytest.approx(at_one, rel=1e-4)
    assert abs(at_09 - at_one) > 100 * abs(jsd - at_one)
    assert pl.runs.distill_divergence(student, teacher, batch, beta=0.5) == at_one


@pytest.mark.parametrize("stage", ["grpo", "multiturn"])
def test_prompts_longer_than_the_prompt_length_name_the_setting(tmp_path, capsys, stage):
    """Built-in prompts that do not fit `sampling.prompt_length` are one line naming the
    setting, how many do not fit and the length that holds them all, before any step."""
    argv = [stage, "--out", str(tmp_path / "run"), "--quiet", "--set", "sampling.prompt_length=3"]
    assert main(argv) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "tokens > prompt_length=3" in line and "`sampling.prompt_length`" in line, line
    assert re.search(r"(\d+) of \1 prompt\(s\) do not fit", line), line
    assert not (tmp_path / "run" / "sft" / "ckpt").exists()
