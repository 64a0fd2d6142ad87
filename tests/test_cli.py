"""The command line: config resolution, one-line errors before any compilation, plot."""

import json
import os

import pytest

from rlhf_eqx.__main__ import main


def _err_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--set", "dpo.beta=-1"], "dpo.beta=-1.0"),
        (["ppo", "--set", "ppo.clip_eps=0"], "ppo.clip_eps=0.0: must be > 0"),
        (["dpo", "--data", "/no/such/file.jsonl"], "data.path='/no/such/file.jsonl'"),
        (
            ["--model", "/no/model.bin", "--tokenizer", "/no/tok.bin"],
            "model.source='/no/model.bin'",
        ),
        (["--set", "sft.batch_size=x"], "sft.batch_size='x'"),
        (["--set", "dpo.nope=1"], "dpo.nope: unknown field"),
    ],
)
def test_invalid_configuration_is_one_line_naming_the_field(argv, field, capsys):
    assert main(argv) == 2
    line = _err_line(capsys)
    assert line.startswith("error: invalid configuration:") and field in line


def test_resolved_config_merges_file_and_overrides(tmp_path, capsys):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"dpo": {"beta": 0.3, "steps": 7}}))
    assert main(["dpo", "--config", str(path), "--set", "dpo.steps=9", "--show-config"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["dpo"]["beta"] == 0.3 and cfg["dpo"]["steps"] == 9
    assert cfg["stages"] == ["sft", "dpo"] and cfg["out"] == os.path.join("runs", "dpo")
    assert "Overrides" in cfg["notes"]


def test_a_bad_config_file_names_the_line(tmp_path, capsys):
    path = tmp_path / "cfg.json"
    path.write_text('{"dpo": {"beta": 0.3,\n "steps": }}')
    assert main(["--config", str(path)]) == 2
    assert f"{path}:2: invalid JSON" in _err_line(capsys)


def test_plot_redraws_a_run_directory(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    lines = [
        {
            "stage": "dpo",
            "iteration": i,
            "step": i,
            "loss": 0.7 - 0.1 * i,
            "rewards/accuracies": 0.5 + 0.1 * i,
        }
        for i in range(4)
    ]
    lines.append({"stage": "dpo", "event": "rollback", "message": "x"})
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    (tmp_path / "summary.json").write_text(
        json.dumps({"sft": {"score": 0.2}, "dpo": {"score": 0.8, "win_rate_vs_sft": 0.8}})
    )
    assert main(["plot", str(tmp_path)]) == 0
    assert (tmp_path / "dpo.png").stat().st_size > 0 and (tmp_path / "summary.png").exists()


def test_plot_of_a_missing_run_directory_fails_cleanly(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "nothing")]) == 2
    assert "metrics.jsonl does not exist" in _err_line(capsys)


def test_a_yaml_config_file(tmp_path, capsys):
    pytest.importorskip("yaml")
    path = tmp_path / "cfg.yaml"
    path.write_text(
        "dpo:\n  beta: 0.25\n  lora:\n    targets: [q, k, v]\n"
        'sampling:\n  stop_strings: ["\\n\\nHuman:"]\nops:\n  profile_steps: [1, 3]\n'
    )
    assert main(["dpo", "--config", str(path), "--set", "dpo.steps=4", "--show-config"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["dpo"]["beta"] == 0.25 and cfg["dpo"]["steps"] == 4
    assert cfg["dpo"]["lora"]["targets"] == ["q", "k", "v"]
    assert cfg["sampling"]["stop_strings"] == ["\n\nHuman:"]
    assert cfg["ops"]["profile_steps"] == [1, 3]


def test_a_bad_yaml_config_file_names_the_line(tmp_path, capsys):
    pytest.importorskip("yaml")
    path = tmp_path / "cfg.yaml"
    path.write_text("dpo:\n  beta: 0.3\n  steps: [1, 2\n")
    assert main(["--config", str(path)]) == 2
    line = _err_line(capsys)
    assert line.startswith("error: invalid configuration:") and f"{path}:" in line
    assert "invalid YAML" in line


def test_batch_sizes_need_not_divide_by_unused_devices(capsys):
    # The tests see 8 simulated devices; the CLI's runs use one.
    import jax

    assert jax.device_count() == 8
    assert main(["ppo", "--set", "ppo.prompts_per_rollout=4", "--show-config"]) == 0
    assert json.loads(capsys.readouterr().out)["ppo"]["prompts_per_rollout"] == 4
