"""The command line: config resolution, one-line errors before any compilation, plot, the
settings a run prints and the fields a stage's `--help` lists."""

import json
import os

import pytest

from rlhf_eqx import pipelines as pl
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


def _help(argv, capsys) -> str:
    assert main([*argv, "--help"]) == 0
    return capsys.readouterr().out


def _sections_listed(text: str) -> set[str]:
    """The dotted sections of the `  section.field = value` lines of a help text."""
    return {line.split(".")[0].strip() for line in text.splitlines() if line.startswith("  ")}


def test_stage_help_lists_its_own_and_the_shared_sections(tmp_path, capsys):
    shared = {"model", "data", "sampling", "ops"}
    # On the built-in task KTO starts from SFT's policy; no other stage's settings.
    text = _help(["kto"], capsys)
    assert "kto.beta = 0.1" in text and "sft.steps = 30" in text
    assert _sections_listed(text) == {"kto", "sft"} | shared
    assert "ppo." not in text and "grpo." not in text
    # On a data file KTO runs alone: SFT's settings are not read.
    data = str(tmp_path / "x.jsonl")
    text = _help(["kto", "--data", data], capsys)
    assert _sections_listed(text) == {"kto"} | shared and "kto alone" in text
    # A stage lists the judge it can score with, and the stages it starts from.
    assert _sections_listed(_help(["ppo"], capsys)) == {"ppo", "sft", "reward", "judge"} | shared
    assert _sections_listed(_help(["grpo", "--data", data], capsys)) == {"grpo", "judge"} | shared
    # `pipeline --help` is the full listing: every section and the top-level fields.
    text = _help(["pipeline"], capsys)
    every = {st.key for st in pl.config.stages()} | {"judge"} | shared
    assert _sections_listed(text) >= every
    assert "  stages = sft,reward,ppo,dpo,grpo" in text and "  eval_samples = 8" in text


def test_a_run_prints_the_settings_it_reads_and_saves_the_whole_config(tmp_path, capsys):
    # One preference pair: the run takes its directory and writes config.json, then
    # stops at the held-out split (nothing is compiled). The directory is made first: a
    # run that fails before its first metrics removes a directory it created.
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"prompt": "Once", "chosen": " a cat", "rejected": " rain"}))
    out = tmp_path / "run"
    out.mkdir()
    assert main(["dpo", "--data", str(data), "--out", str(out)]) == 1
    printed = capsys.readouterr().out
    header, rest = printed.split("\n", 1)
    assert (
        header == f"rlhf_eqx dpo: the settings this run reads (the whole config: {out}/config.json)"
    )
    shown = json.JSONDecoder().raw_decode(rest)[0]
    assert list(shown) == [
        "stages", "out", "eval_samples", "dpo", "model", "data", "sampling", "ops"
    ]  # fmt: skip
    assert '"ppo"' not in printed and '"sft"' not in printed and '"judge"' not in printed
    assert shown["dpo"]["beta"] == 0.1 and shown["data"]["path"] == str(data)
    saved = json.loads((out / "config.json").read_text())
    cfg = pl.apply_overrides(pl.animal_task_config(), [f"data.path={data}", f"out={out}"])
    assert (
        set(saved) == set(pl.config.config_to_dict(cfg)) >= {"ppo", "grpo", "kto", "prm", "judge"}
    )
    assert {k: saved[k] for k in shown if k != "stages"} == {
        k: v for k, v in shown.items() if k != "stages"
    }
    # On the built-in task: the stages run (SFT first) and the task's own fields. A run
    # directory that already holds a run stops these after printing.
    held = tmp_path / "held"
    held.mkdir()
    (held / "summary.json").write_text("{}")
    task = ["stages", "out", "label_noise", "eval_samples", "notes"]
    for argv, sections in [
        (["kto"], ["sft", "kto"]),
        (["pipeline"], ["sft", "reward", "ppo", "judge", "dpo", "grpo"]),
    ]:
        assert main([*argv, "--out", str(held)]) == 2
        shown = json.JSONDecoder().raw_decode(capsys.readouterr().out.split("\n", 1)[1])[0]
        assert list(shown) == [*task, *sections, "model", "sampling", "ops"]
    # --quiet prints no settings, --show-config the whole configuration.
    assert main(["dpo", "--data", str(data), "--out", str(tmp_path / "q"), "--quiet"]) == 1
    assert '"dpo"' not in capsys.readouterr().out
    assert main(["dpo", "--data", str(data), "--show-config"]) == 0
    assert set(json.loads(capsys.readouterr().out)) == set(saved)


def test_read_fields_follow_the_stages_a_run_executes():
    cfg = pl.animal_task_config()
    task = ("stages", "out", "label_noise", "eval_samples", "notes")
    shared = ("model", "sampling", "ops")
    assert pl.config.read_fields(cfg) == (
        *task,
        "sft",
        "reward",
        "ppo",
        "judge",
        "dpo",
        "grpo",
        *shared,
    )
    assert pl.config.read_fields(cfg, ("sft", "kto")) == (*task, "sft", "kto", *shared)
    on_file = pl.config.read_fields(cfg, ("dpo",), data_file=True)
    assert on_file == ("stages", "out", "eval_samples", "dpo", "model", "data", "sampling", "ops")
    # a reward model's held-out evaluation on a data file samples nothing
    on_file = pl.config.read_fields(cfg, ("reward",), data_file=True)
    assert on_file == ("stages", "out", "reward", "model", "data", "sampling", "ops")
    # online DPO reads the `dpo` section, and the reward model's only when that stage runs
    assert pl.config.read_fields(cfg, ("sft", "online-dpo"))[5:7] == ("sft", "dpo")
    assert "reward" in pl.config.read_fields(cfg, ("sft", "reward", "online-dpo"))
    assert list(pl.config.config_to_dict(cfg, only=("ops", "stages"))) == ["ops", "stages"]
    assert pl.config.help_sections("kto", cfg) == ("kto", "sft", "model", "sampling", "ops", "data")
    with pytest.raises(pl.ConfigError, match="nope: unknown config section"):
        pl.config.config_to_dict(cfg, only=("nope",))


def test_result_line_shows_rates_not_their_standard_errors():
    from rlhf_eqx.__main__ import result_line

    summary = {
        "grpo": {
            "heldout_exact_match_before": 0.121,
            "heldout_exact_match_before_se": 0.026,
            "heldout_exact_match": 0.852,
            "heldout_exact_match_se": 0.041,
        }
    }
    line = result_line("grpo", summary, "runs/x")
    assert line == (
        "rlhf_eqx grpo: done: heldout_exact_match_before 0.121, heldout_exact_match 0.852"
        " (runs/x/summary.json)"
    )
    # a pipeline stage a callback (or the KL guard) stopped early is named
    summary = {"stopped": "done", "sft": {"score": 0.25, "stopped": "callback"}}
    summary["sft"]["stop_reason"] = "EarlyStop: plateau"
    assert result_line("pipeline", summary, "r") == (
        "rlhf_eqx pipeline: done (sft stopped (callback: EarlyStop: plateau)): sft 25.0% "
        "(r/summary.json)"
    )
    # a stage that reports no numbers: no empty list before the path
    assert result_line("x", {}, "runs/x") == "rlhf_eqx x: done: (runs/x/summary.json)"
