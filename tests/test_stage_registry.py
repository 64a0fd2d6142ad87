"""The stage registry: a stage registered in a few lines is a CLI command with its own
settings (`--set toy.FIELD`, `toy --help`), validated, run on the built-in task after SFT,
evaluated, exported and summarised like the built-in stages."""

import dataclasses
import json

import pytest

from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main, stage_commands


@dataclasses.dataclass(frozen=True)
class ToyConfig(pl.SFTConfig):
    """SFT on one fixed completion per prompt, `repeat` copies of each."""

    repeat: int = 1


def toy(env: pl.StageEnv, c: ToyConfig) -> pl.Outcome:
    records = [(p, " a cat sat on the mat.") for p in pl.task.TRAIN_PROMPTS[:8]] * c.repeat
    res = pl.runs.run_sft(env.policies["sft"], env.tok, records, cfg=c, ctx=env.ctx("toy"))
    return pl.Outcome(res, policy=pl.runs.final_policy(res.state.model))


@pytest.fixture
def toy_stage():
    pl.register_stage(pl.Stage("toy", ToyConfig, builtin=toy, help="a toy SFT"))
    yield
    pl.config.unregister_stage("toy")


_SMALL = ["--quiet", "--set", "ops.monitor=false", "--set", "eval_samples=1"]
_SMALL += ["--set", "sft.steps=2", "--set", "sampling.max_new_tokens=8"]


@pytest.mark.slow
def test_a_registered_stage_runs_from_the_cli(toy_stage, tmp_path, capsys):
    assert "toy" in stage_commands() and "toy" in pl.config.stage_names()
    out = tmp_path / "run"
    argv = ["toy", "--out", str(out), *_SMALL, "--set", "toy.steps=2", "--set", "toy.repeat=2"]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["toy"]["stopped"] == "done" and 0 <= summary["toy"]["score"] <= 1
    assert "win_rate_vs_sft" in summary["toy"]
    config = json.loads((out / "config.json").read_text())
    assert config["stages"] == ["sft", "toy"] and config["toy"]["repeat"] == 2
    assert (out / "toy" / "hf" / "config.json").exists()
    assert [r["step"] for r in pl.tools.read_metrics(str(out))["toy"]] == [0, 1]
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("rlhf_eqx toy: done")
    # resume checks the extra section like any other: a changed setting is refused
    assert main([*argv, "--resume", "--set", "toy.repeat=3"]) == 2
    assert "toy.repeat" in capsys.readouterr().err


def test_a_registered_stage_has_help_and_checked_settings(toy_stage, capsys):
    assert main(["toy", "--help"]) == 0
    text = capsys.readouterr().out
    assert "toy.repeat = 1" in text and "sft.steps" in text
    assert main(["toy", "--set", "toy.nope=1", "--show-config"]) == 2
    assert "toy.nope: unknown field" in capsys.readouterr().err
    assert main(["toy", "--set", "toy.steps=0", "--show-config"]) == 2
    assert "toy.steps=0: must be >= 1" in capsys.readouterr().err
    cfg = pl.apply_overrides(pl.animal_task_config(), ["toy.repeat=4"])
    # the built-in task's shared stage settings (its LoRA adapters) apply to a new stage
    task_lora = pl.config.TASK_STAGE_SETTINGS["lora"]
    assert cfg.toy == ToyConfig(repeat=4, lora=task_lora)
    assert pl.animal_task_config().toy == ToyConfig(lora=task_lora) == pl.config.task_section("toy")
    assert pl.PipelineConfig().toy == ToyConfig()
    assert pl.config.config_from_dict(pl.PipelineConfig, pl.config.config_to_dict(cfg)) == cfg


def test_registry_refuses_duplicates_and_bad_stages():
    with pytest.raises(ValueError, match="already registered"):
        pl.register_stage(pl.Stage("dpo", pl.DPOConfig, builtin=toy))
    with pytest.raises(ValueError, match="builtin=, data= or both"):
        pl.Stage("nothing", ToyConfig)
    with pytest.raises(TypeError, match="config must be a dataclass"):
        pl.Stage("bad", dict, builtin=toy)
    with pytest.raises(pl.ConfigError, match="unknown stage 'nope'"):
        pl.config.get_stage("nope")


def test_builtin_stages_come_from_the_registry():
    names = pl.config.stage_names()
    assert names[:8] == ("sft", "reward", "ppo", "online-dpo", "dpo", "grpo", "kto", "distill")
    data_stages = {"sft", "reward", "ppo", "dpo", "grpo", "kto", "distill", "prm"}
    assert set(pl.config.data_stages()) == data_stages
    cfg = pl.animal_task_config()
    assert pl.config.get_stage("ppo").prerequisites(cfg) == ("sft", "reward", "ppo")
    task = dataclasses.replace(cfg, ppo=dataclasses.replace(cfg.ppo, reward_source="task"))
    assert pl.config.get_stage("ppo").prerequisites(task) == ("sft", "ppo")
    assert pl.config.get_stage("distill").prerequisites(cfg) == ("sft", "grpo", "distill")
    assert pl.config.get_stage("online-dpo").key == "dpo"
    assert "prm" not in pl.runs.teacher_stages() and "reward" not in pl.runs.teacher_stages()


def test_every_stage_section_takes_one_route(toy_stage):
    """Every stage's section, built-in or registered later, is a keyword of
    `PipelineConfig`, an attribute, a `dataclasses.replace` field and a `config.json`
    section; a section at its defaults is not stored, so equality does not depend on
    when a stage was registered."""
    dpo = pl.DPOConfig(beta=0.3)
    cfg = pl.PipelineConfig(dpo=dpo, toy=ToyConfig(repeat=3))
    assert cfg.dpo == dpo and cfg.toy.repeat == 3 and cfg.sft == pl.SFTConfig()
    again = dataclasses.replace(cfg, toy=ToyConfig(), stages=("sft", "toy"))
    assert again.dpo == dpo and again.toy == ToyConfig() and again.stages == ("sft", "toy")
    assert set(again.sections) == {"dpo"}  # the toy section is at its defaults
    assert again == pl.PipelineConfig(dpo=dpo, stages=("sft", "toy"))
    d = pl.config.config_to_dict(cfg)
    assert list(d)[:6] == ["model", "data", "sampling", "ops", "sft", "reward"]
    assert d["toy"]["repeat"] == 3 and pl.config.config_from_dict(pl.PipelineConfig, d) == cfg
    with pytest.raises(TypeError, match="no field or stage section 'nope'"):
        pl.PipelineConfig(nope=dpo)
    with pytest.raises(TypeError, match="PipelineConfig.dpo: expected DPOConfig"):
        pl.PipelineConfig(dpo=pl.SFTConfig())


def test_resume_rules_come_from_the_registry(toy_stage):
    counts = pl.loop.iteration_fields()
    assert counts["dpo.steps"] == ("online-dpo", "dpo") and counts["grpo.rollouts"] == ("grpo",)
    assert counts["toy.steps"] == ("toy",)
    resumable = pl.loop.resumable_fields()
    assert {"grpo.overlap", "grpo.sampler_device", "ops.quiet"} <= set(resumable)
    assert "grpo.beta" not in resumable


def test_each_stage_declares_the_key_stream_of_its_numbers():
    """The built-in stages' keys (`split(key, 8)[i]` or `fold_in(key, i)` of the run's
    key, which the README's numbers come from) are declared by each stage."""
    streams = {st.name: st.key_stream for st in pl.config.stages()}
    assert streams["sft"] == ("split", 1) and streams["reward"] == ("split", 2)
    assert streams["ppo"] == ("split", 3) and streams["dpo"] == ("split", 4)
    assert streams["grpo"] == ("split", 5) and streams["online-dpo"] == ("split", 7)
    assert streams["kto"] == ("fold", 9) and streams["distill"] == ("fold", 10)
    assert streams["multiturn"] is None and streams["prm"] is None


@dataclasses.dataclass(frozen=True)
class NeedsRate(pl.SFTConfig):
    """A setting without a usable default: `rate` must be given."""

    rate: float | None = None

    def __post_init__(self):
        if self.rate is None:
            raise ValueError("rate=None: must be given")
        super().__post_init__()


def _refused(stage, match, error=ValueError):
    before = pl.config.stages()
    with pytest.raises(error, match=match):
        pl.register_stage(stage)
    assert pl.config.stages() == before  # the registry is as it was


def test_registration_refuses_what_would_break_other_commands():
    """A stage that would shadow a command or a shared section, take over another stage's
    section, or whose settings cannot be built is refused when registered, so that the
    other commands (which build every section) keep working."""
    for name in ("sample", "pipeline", "sweep", "serve"):
        _refused(pl.Stage(name, ToyConfig, builtin=toy), "the name of another command")
    for name in ("model", "ops", "judge", "stages", "out"):
        _refused(pl.Stage(name, ToyConfig, builtin=toy), "is a field of PipelineConfig")
    _refused(pl.Stage("toy2", ToyConfig, builtin=toy, section="dpo"), "holds DPOConfig")
    _refused(pl.Stage("toy2", ToyConfig, builtin=toy, sections=("nope",)), r"\['nope'\]")
    # `PipelineConfig()` builds the defaults, `animal_task_config()` the task's values
    _refused(pl.Stage("toy2", NeedsRate, builtin=toy), "NeedsRate cannot be built: rate=None")
    needs_rate = pl.Stage("toy2", NeedsRate, builtin=toy, task=dict(rate=0.5))
    _refused(needs_rate, "NeedsRate cannot be built: rate=None")
    bad_task = pl.Stage("toy2", ToyConfig, builtin=toy, task=dict(mode="nope"))
    _refused(bad_task, "ToyConfig cannot be built: mode='nope'")
    _refused(pl.Stage("toy2", ToyConfig, builtin=toy, resumable=("nope",)), "'nope' is not a field")
    _refused(pl.Stage("toy2", ToyConfig, builtin=toy, resumable=("optim",)), "optim.learning_rate")
    with pytest.raises(ValueError, match=r"task values \['nope'\] are not fields of ToyConfig"):
        pl.Stage("toy2", ToyConfig, builtin=toy, task=dict(nope=1))
    with pytest.raises(ValueError, match="a letter, then"):
        pl.Stage("-x", ToyConfig, builtin=toy)
    with pytest.raises(TypeError, match="frozen dataclass"):
        pl.Stage("toy2", dataclasses.make_dataclass("Loose", [("a", int, 1)]), builtin=toy)
    with pytest.raises(TypeError, match="config"):  # (the test run's type checker, too)
        pl.Stage("toy2", ToyConfig(), builtin=toy)
    with pytest.raises(ValueError, match="key_stream"):
        pl.Stage("toy2", ToyConfig, builtin=toy, key_stream=("spilt", 3))
    # a refused replacement keeps the stage it would have replaced
    pl.register_stage(pl.Stage("toy2", ToyConfig, builtin=toy, resumable=("repeat",)))
    try:
        before = pl.config.get_stage("toy2")
        with pytest.raises(ValueError, match="cannot be built"):
            pl.register_stage(pl.Stage("toy2", NeedsRate, builtin=toy), replace=True)
        assert pl.config.get_stage("toy2") is before
        assert "toy2.repeat" in pl.loop.resumable_fields()
    finally:
        pl.config.unregister_stage("toy2")
    assert main(["dpo", "--show-config"]) == 0


_PLUGIN = """
import dataclasses

from rlhf_eqx import pipelines as pl


@dataclasses.dataclass(frozen=True)
class {cls}(pl.SFTConfig):
    colour: str = "red"


def run(env, c):
    raise AssertionError("not run by these tests")


pl.register_stage(pl.Stage("{name}", {cls}, builtin=run, help="a plugin's stage"))
"""


def test_plugins_add_their_stages_to_the_command_line(tmp_path, monkeypatch, capsys):
    """`--import MODULE` (from the current directory) and the installed entry points of
    `rlhf_eqx.plugins` are imported before the commands are built: their stages are
    commands with their own settings; a module that cannot be imported is one line."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_plugin_stage.py").write_text(_PLUGIN.format(cls="PlugConfig", name="plug"))
    site = tmp_path / "site"
    (site / "plugdist-0.1.dist-info").mkdir(parents=True)
    (site / "plugdist-0.1.dist-info" / "METADATA").write_text("Name: plugdist\nVersion: 0.1\n")
    (site / "plugdist-0.1.dist-info" / "entry_points.txt").write_text(
        "[rlhf_eqx.plugins]\nep = my_ep_stage\nbroken = no_such_module_here\n"
    )
    (site / "my_ep_stage.py").write_text(_PLUGIN.format(cls="EpConfig", name="epstage"))
    monkeypatch.syspath_prepend(str(site))
    try:
        assert main(["plug", "--import", "my_plugin_stage", "--help"]) == 0
        out, err = capsys.readouterr()
        assert "plug.colour = red" in out
        # a settings class without a docstring: no dataclass signature as its description
        assert "\nplug:\n  plug." in out and "PlugConfig(" not in out
        assert "warning: plugin broken (no_such_module_here) not loaded" in err
        assert main(["epstage", "--set", "epstage.colour=blue", "--show-config"]) == 0
        assert '"colour": "blue"' in capsys.readouterr().out
        assert main(["--import=nope_mod", "sft", "--show-config"]) == 2
        err = capsys.readouterr().err
        assert "error: --import nope_mod: ModuleNotFoundError: No module named 'nope_mod'" in err
    finally:
        for name in ("plug", "epstage"):
            if name in pl.config.stage_names():
                pl.config.unregister_stage(name)


def test_a_stage_whose_needs_leave_it_out_or_whose_functions_are_not_functions_is_refused():
    """`needs` must end with the stage itself (else its command would run only the stages
    before it); `builtin`, `data`, `needs` and `check_run` must be functions."""
    _refused(
        pl.Stage("toy2", ToyConfig, builtin=toy, needs=lambda cfg: ("sft",)),
        r"stage 'toy2': needs\(cfg\) returned \('sft',\); .* 'toy2' last",
    )
    _refused(pl.Stage("toy2", ToyConfig, builtin=toy, needs=lambda cfg: "toy2"), "needs")
    with pytest.raises(TypeError, match="builtin"):  # (the test run's type checker, too)
        pl.Stage("toy2", ToyConfig, builtin=3)
    with pytest.raises(TypeError, match="check_run"):
        pl.Stage("toy2", ToyConfig, builtin=toy, check_run="sft")
    with_needs = pl.Stage("toy2", ToyConfig, builtin=toy, needs=lambda cfg: ["sft", "toy2"])
    pl.register_stage(with_needs)
    try:
        assert with_needs.prerequisites(pl.animal_task_config()) == ("sft", "toy2")
    finally:
        pl.config.unregister_stage("toy2")
