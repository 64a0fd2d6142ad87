"""`--set` lists on the command line (non-ASCII stop strings, JSON lists), `rlhf_eqx
plot` on run directories without step records, seeds and sweep directories, `--model`
given a directory that is not a model, and the options `sample` and `eval` share."""

import json
import os

import jax
import pytest

import rlhf_eqx as rx
from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main


def _stops(value: str) -> tuple[str, ...]:
    cfg = pl.apply_overrides(pl.PipelineConfig(), [f"sampling.stop_strings={value}"])
    return cfg.sampling.stop_strings


@pytest.mark.parametrize(
    "value, want",
    [
        ("café", ("café",)),
        ("€ 日本", ("€ 日本",)),
        ("\\n\\nHuman:", ("\n\nHuman:",)),
        ("café,\\u20ac\\t", ("café", "€\t")),
        ("[INST]", ("[INST]",)),  # not a JSON list: one stop string
    ],
)
def test_stop_strings_keep_non_ascii_and_read_escapes(value, want):
    assert _stops(value) == want


def test_a_json_list_may_hold_commas():
    assert _stops('["a,b", "c"]') == ("a,b", "c")
    assert _stops('["\\n\\nHuman:", "日本"]') == ("\n\nHuman:", "日本")
    cfg = pl.apply_overrides(pl.PipelineConfig(), ["ops.profile_steps=[2, 4]"])
    assert tuple(cfg.ops.profile_steps) == (2, 4)
    cfg = pl.apply_overrides(pl.PipelineConfig(), ['stages=["sft", "dpo"]'])
    assert cfg.stages == ("sft", "dpo")


def _metrics(run, lines: list[str], summary: dict | None = None) -> str:
    os.makedirs(run, exist_ok=True)
    with open(os.path.join(run, "metrics.jsonl"), "w") as f:
        f.write("\n".join(lines))
    if summary is not None:
        with open(os.path.join(run, "summary.json"), "w") as f:
            json.dump(summary, f)
    return str(run)


def _step(stage: str, step: int) -> str:
    return json.dumps({"stage": stage, "step": step, "loss": 1.0 / (step + 1)})


@pytest.mark.parametrize("lines", [[], [json.dumps({"event": "start", "stage": "sft"}), ""]])
def test_plot_says_when_there_are_no_step_records_yet(tmp_path, capsys, lines):
    run = _metrics(tmp_path / "run", lines)
    assert main(["plot", run]) == 0
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "no step records yet" in captured.err


def test_plot_notes_a_torn_last_line_once(tmp_path, capsys):
    run = _metrics(tmp_path / "run", [_step("sft", 0), _step("sft", 1), '{"stage": "sf'])
    assert main(["plot", run]) == 0
    captured = capsys.readouterr()
    assert captured.err.count("skipped a torn last line") == 1, captured.err
    assert captured.out.split() == [os.path.join(run, "sft.png")]


def test_plot_names_a_line_that_is_not_a_json_object(tmp_path, capsys):
    run = _metrics(tmp_path / "run", [_step("sft", 0), "[1, 2]", _step("sft", 1), ""])
    assert main(["plot", run]) == 2
    err = capsys.readouterr().err
    path = os.path.join(run, "metrics.jsonl")
    assert err == f"error: {path}:2: not a JSON object (list)\n"


def test_plot_draws_each_seed_of_a_seeds_run_and_refuses_an_unfinished_sweep(tmp_path, capsys):
    root = tmp_path / "seeds"
    for seed in (2, 1):
        _metrics(root / f"seed-{seed}", [_step("sft", 0), _step("sft", 1), ""])
    (root / "seeds_summary.json").write_text("{}")
    assert main(["plot", str(root)]) == 0
    out = capsys.readouterr().out.split()
    assert out == [str(root / f"seed-{s}" / "sft.png") for s in (1, 2)]
    sweep = tmp_path / "sweep"
    _metrics(sweep / "members" / "beta=0.1", [_step("dpo", 0), ""])
    (sweep / "sweep.json").write_text("{}")
    assert main(["plot", str(sweep)]) == 2
    err = capsys.readouterr().err
    assert f"{sweep}/plots/" in err and f"rlhf_eqx plot {sweep}/members/<name>" in err
    assert "\n" not in err.rstrip("\n")


def test_summary_plot_has_every_stage_with_a_score(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    summary = {
        "base": {"score": 0.1},
        "sft": {"score": 0.2},
        "kto": {"score": 0.3, "win_rate_vs_sft": 0.6},
        "distill": {"score": 0.4},
        "multiturn": {"score": 0.5},
        "reward": {"accuracy": 0.7},
        "stopped": "done",
    }
    run = _metrics(tmp_path / "run", [_step("sft", 0), ""], summary)
    import matplotlib.axes

    bars = []
    real_bar = matplotlib.axes.Axes.bar
    monkeypatch.setattr(
        matplotlib.axes.Axes,
        "bar",
        lambda self, x, *a, **k: bars.append(list(x)) or real_bar(self, x, *a, **k),
    )
    assert pl.tools.plot_run(run)[-1] == os.path.join(run, "summary.png")
    assert bars == [["base", "sft", "kto", "distill", "multiturn"]]


def _export(out) -> str:
    """The stories model saved as a Hugging Face directory with its tokenizer."""
    policy, _ = pl.tools.load_model("builtin")
    rx.save_hf(policy, out)
    pl.runs.copy_tokenizer(pl.tools.tokenizer_file(), str(out))
    return str(out)


def test_a_directory_without_a_model_names_the_one_to_pass(tmp_path):
    seeds = tmp_path / "seeds"
    _metrics(seeds / "seed-3", [_step("sft", 0), ""])
    (seeds / "seeds_summary.json").write_text("{}")
    with pytest.raises(pl.ConfigError) as e:
        pl.tools.load_model(str(seeds))
    assert str(e.value) == (
        f"model.source={str(seeds)!r} (--model): a run over several seeds; pass one seed's "
        f"run, {seeds}/seed-<s>, e.g. {seeds}/seed-3"
    )
    sweep = tmp_path / "sweep"
    os.makedirs(sweep)
    (sweep / "sweep.json").write_text("{}")
    with pytest.raises(pl.ConfigError, match="a sweep exports no single policy") as e:
        pl.tools.load_model(str(sweep))
    assert f"{sweep}/members/<name>/<stage>/hf (written with --export)" in str(e.value)
    hf = _export(tmp_path / "run" / "sft" / "hf")
    with pytest.raises(pl.ConfigError) as e:
        pl.tools.load_model(str(tmp_path / "run" / "sft"))
    assert str(e.value).endswith(f": a stage's directory; its model is {hf}")


def test_an_adapter_directory_loads_on_its_base(tmp_path):
    hf = _export(tmp_path / "base")
    base, tok = pl.tools.load_model(hf)
    lora = rx.apply_lora(base, rx.LoRAConfig(rank=2, alpha=4.0), key=jax.random.key(0))
    adapter = tmp_path / "run" / "sft" / "adapter"
    rx.save_lora_adapter(lora, adapter, base_model_name_or_path=hf)
    policy, tok2 = pl.tools.load_model(str(adapter))
    assert tok2.vocab_size == tok.vocab_size
    want = rx.merge_lora(rx.load_lora_adapter(base, adapter))
    assert all(
        jax.numpy.array_equal(a, b) for a, b in zip(jax.tree.leaves(policy), jax.tree.leaves(want))
    )
    # a run on the adapter copies the base's tokenizer and fingerprints both directories
    assert pl.tools.tokenizer_file(str(adapter)) == pl.tools.tokenizer_file(hf)
    files = pl.tools.model_files(str(adapter))
    assert str(adapter / "adapter_config.json") in files
    assert set(pl.tools.model_files(hf)) <= set(files)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "HuggingFaceTB/SmolLM2-135M"
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(pl.ConfigError, match="^model.source=.*a PEFT adapter whose base") as e:
        pl.tools.load_model(str(adapter))
    assert "('HuggingFaceTB/SmolLM2-135M') is not a directory here" in str(e.value)
    assert "merged model" not in str(e.value)  # no export beside the adapter
    merged = _export(tmp_path / "run" / "sft" / "hf")
    with pytest.raises(pl.ConfigError) as e:
        pl.tools.load_model(str(adapter))
    assert str(e.value).endswith(f", or pass the merged model: --model {merged}")


def test_sample_refuses_a_data_file_by_name(tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "Once upon a time"}) + "\n")
    assert main(["sample", "--data", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: invalid configuration: data.path={str(path)!r} (--data): ")
    assert "sample completes the --prompt texts" in err and err.count("\n") == 1


@pytest.mark.slow
def test_sample_and_eval_take_temperature_zero_as_greedy(capsys):
    sets = ["--set", "sampling.temperature=0", "--set", "sampling.max_new_tokens=8"]
    assert main(["sample", "-n", "2", "--prompt", "Once upon a time", *sets]) == 0
    first, second = capsys.readouterr().out.split("\n\n")[:2]
    assert first == second and first.startswith("Once upon a time")  # argmax each token
    assert main(["eval", *sets, "--set", "eval_samples=2"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["score_se"] == 0.0  # every sample of an opening is the same
    assert main(["sample", "--set", "sampling.temperature=-1"]) == 2
    assert "sampling.temperature=-1.0: must be" in capsys.readouterr().err


def test_sample_names_greedy_when_refusing_a_negative_temperature(capsys):
    assert main(["sample", "--set", "sampling.temperature=-1"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: invalid configuration: sampling.temperature=-1.0: must be > 0, or 0 for "
        "greedy decoding\n"
    )
    assert main(["sft", "--set", "sampling.temperature=-1"]) == 2  # a stage: no greedy
    assert capsys.readouterr().err.endswith("sampling.temperature=-1.0: must be > 0\n")
