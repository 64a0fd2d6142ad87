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
    for model in (out, f"{out}/sft/hf"):
        assert main(["eval", "--model", model]) == 0  # the run's own settings
        want = summary["sft"]
        got = json.loads(capsys.readouterr().out)
        for k in ("score", "score_se", "base_nll", "kl"):
            assert got[k] == want[k], (model, k)
    assert main(["eval", "--model", "builtin", "--set", "eval_samples=2"]) == 0
    got = json.loads(capsys.readouterr().out)
    for k in ("score", "score_se", "base_nll"):
        assert got[k] == summary["base"][k], k


def _settings_run(root) -> str:
    """A run directory whose `config.json` has evaluation settings that are not the
    built-in task's, with the stories model exported as its one policy."""
    run = _run_dir(root, {"sft": "lm"})
    cfg = pl.apply_overrides(
        pl.animal_task_config(),
        ["eval_samples=2", "ops.seed=7", "sampling.max_new_tokens=6", "sampling.temperature=0.7"],
    )
    with open(os.path.join(run, "config.json"), "w") as f:
        json.dump(pl.config.config_to_dict(cfg), f)
    return run


def test_eval_of_a_run_directory_defaults_to_the_runs_settings(tmp_path, capsys):
    """`eval --model RUN` reads the run's `eval_samples`, `sampling.*` and `ops.seed` from
    its `config.json`; a `--set` still overrides them; another model is unaffected."""
    run = _settings_run(tmp_path / "run")
    assert main(["eval", "--model", run, "--show-config"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert (cfg["eval_samples"], cfg["ops"]["seed"]) == (2, 7)
    assert (cfg["sampling"]["max_new_tokens"], cfg["sampling"]["temperature"]) == (6, 0.7)
    sets = ["--set", "ops.seed=3", "--set", "sampling.temperature=1.0"]
    assert main(["eval", "--model", run, *sets, "--show-config"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert (cfg["eval_samples"], cfg["ops"]["seed"], cfg["sampling"]["temperature"]) == (2, 3, 1)
    other = _run_dir(tmp_path / "other", {"sft": "lm"})  # config.json: the defaults
    os.remove(os.path.join(other, "config.json"))  # no longer a run directory
    assert main(["eval", "--model", other, "--show-config"]) == 0
    assert json.loads(capsys.readouterr().out)["ops"]["seed"] == pl.animal_task_config().ops.seed


def test_eval_of_a_stage_export_in_a_run_directory_reads_the_runs_settings(tmp_path, capsys):
    """`eval --model RUN/<stage>/hf` reads the run's evaluation settings as `eval --model
    RUN` does; a `--set` still wins; an `hf` directory outside a run directory keeps the
    command line's defaults."""
    run = _settings_run(tmp_path / "run")
    for export in ("hf", "hf/"):
        model = os.path.join(run, "sft", export)
        assert main(["eval", "--model", model, "--show-config"]) == 0
        cfg = json.loads(capsys.readouterr().out)
        assert (cfg["eval_samples"], cfg["ops"]["seed"]) == (2, 7), export
        assert cfg["sampling"]["temperature"] == 0.7
    hf = os.path.join(run, "sft", "hf")
    assert main(["eval", "--model", hf, "--set", "ops.seed=3", "--show-config"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert (cfg["eval_samples"], cfg["ops"]["seed"]) == (2, 3)
    os.makedirs(tmp_path / "loose" / "sft")
    os.rename(hf, tmp_path / "loose" / "sft" / "hf")
    assert main(["eval", "--model", str(tmp_path / "loose" / "sft" / "hf"), "--show-config"]) == 0
    assert json.loads(capsys.readouterr().out)["ops"]["seed"] == pl.animal_task_config().ops.seed


def test_eval_of_a_run_directory_scores_as_with_the_runs_settings_repeated(tmp_path, capsys):
    run = _settings_run(tmp_path / "run")
    assert main(["eval", "--model", run]) == 0
    got = json.loads(capsys.readouterr().out)
    with open(os.path.join(run, "config.json")) as f:
        cfg = pl.config.config_from_dict(pl.PipelineConfig, json.load(f))
    hf = os.path.join(run, "sft", "hf")
    want = pl.tools.evaluate_model(pl.apply_overrides(cfg, [f"model.source={hf}"]))
    assert got == json.loads(json.dumps(want))
