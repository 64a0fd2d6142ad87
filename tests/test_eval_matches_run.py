"""`rlhf_eqx eval` gives a run's own numbers (the pipeline's evaluator: its key and
sampling settings): a finished run's exported policy scores what its summary.json says,
`builtin` the run's base numbers; a run directory stands for the policy it exported
when there is exactly one, and is refused naming the candidates when there are several
or none; `eval --data` is refused by name (eval reads no data file)."""

import json
import os

import jax
import pytest

import rlhf_eqx as rx
from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main


def _run_dir(root, exports: dict) -> str:
    """A run directory (a run's `config.json`) with `exports`: `{stage: head}` of the
    stories model saved as `<stage>/hf` (`lm`: a policy, `score`: a reward model)."""
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump(pl.config.config_to_dict(pl.PipelineConfig()), f)
    policy, _ = pl.tools.load_model("builtin")
    for stage, head in exports.items():
        out = os.path.join(root, stage, "hf")
        model = (
            policy if head == "lm" else rx.RewardModel.from_policy(policy, key=jax.random.key(0))
        )
        rx.save_hf(model, out)
        pl.runs.copy_tokenizer(pl.tools.tokenizer_file(), out)
    return str(root)


def test_a_run_directory_stands_for_its_only_exported_policy(tmp_path):
    run = _run_dir(tmp_path / "run", {"sft": "lm", "reward": "score"})
    assert pl.model_path(run) == os.path.join(run, "sft", "hf")
    assert pl.tools.model_files(run) == pl.tools.model_files(os.path.join(run, "sft", "hf"))
    policy, tok = pl.tools.load_model(run)
    assert isinstance(policy, rx.Policy) and tok.vocab_size == 512
    hf = os.path.join(run, "sft", "hf")
    assert pl.model_path(hf) == hf  # a checkpoint directory is itself


def test_a_run_directory_with_several_or_no_policies_is_refused_naming_them(tmp_path):
    run = _run_dir(tmp_path / "run", {"dpo": "lm", "sft": "lm"})
    sft, dpo = (os.path.join(run, s, "hf") for s in ("sft", "dpo"))
    with pytest.raises(pl.ConfigError, match="^model.source=.*2 exported policies") as e:
        pl.tools.load_model(run)
    assert f"({sft}, {dpo})" in str(e.value)  # in the order the stages run
    assert f"--model {dpo}" in str(e.value)
    scorer = _run_dir(tmp_path / "reward", {"reward": "score"})
    with pytest.raises(pl.ConfigError, match="without an exported policy.*reward/hf scores"):
        pl.tools.load_model(scorer)


def test_eval_refuses_a_data_file_by_name(tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "Once upon a time"}) + "\n")
    assert main(["eval", "--data", str(path)]) == 2
    err = capsys.readouterr().err
    assert "data.path=" in err and "eval scores the built-in task's story openings" in err


@pytest.mark.slow
def test_eval_of_a_finished_run_gives_the_numbers_of_its_summary(tmp_path, capsys):
    out = str(tmp_path / "R")
    sets = ["--set", "sft.steps=4", "--set", "eval_samples=2", "--quiet"]
    assert main(["sft", *sets, "--set", "ops.monitor=false", "--out", out]) == 0
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    capsys.readouterr()
    for model, want in ((out, summary["sft"]), (f"{out}/sft/hf", summary["sft"])):
        assert main(["eval", "--model", model, "--set", "eval_samples=2"]) == 0
        got = json.loads(capsys.readouterr().out)
        for k in ("score", "score_se", "base_nll", "kl"):
            assert got[k] == want[k], (model, k)
    assert main(["eval", "--model", "builtin", "--set", "eval_samples=2"]) == 0
    got = json.loads(capsys.readouterr().out)
    for k in ("score", "score_se", "base_nll"):
        assert got[k] == summary["base"][k], k
