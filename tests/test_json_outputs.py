"""The JSON a run writes for other tools is JSON: a NaN or infinite number is the string
"NaN", "Infinity" or "-Infinity" (Python's bare tokens are refused by `jq`, JavaScript
and most readers), and the library reads back both these files and older ones written
with the bare tokens."""

import dataclasses
import json
import math
import os

from rlhf_eqx import pipelines as pl


def _strict(text: str):
    """`json.loads` as a strict reader parses: the bare NaN / Infinity tokens refused."""

    def refuse(token):
        raise ValueError(f"not JSON: {token}")

    return json.loads(text, parse_constant=refuse)


def _strict_lines(path) -> list[dict]:
    with open(path) as f:
        return [_strict(line) for line in f if line.strip()]


ODD = {"loss": math.nan, "kl": math.inf, "margin": -math.inf, "score": 0.5}


def test_metrics_lines_are_strict_json_and_read_back(tmp_path):
    run = str(tmp_path / "run")
    log = pl.tools.MetricsLog(run, "sft", quiet=True)
    log.write({"iteration": 0, "step": 0, **ODD})
    (line,) = _strict_lines(os.path.join(run, "metrics.jsonl"))
    assert (line["loss"], line["kl"], line["margin"]) == ("NaN", "Infinity", "-Infinity")
    assert line["score"] == 0.5
    (rec,) = pl.tools.read_metrics(run)["sft"]
    assert math.isnan(rec["loss"]) and rec["kl"] == math.inf and rec["margin"] == -math.inf


def test_an_older_metrics_file_with_bare_tokens_still_reads(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    line = json.dumps({"stage": "sft", "iteration": 0, "step": 0, **ODD})  # bare tokens
    (run / "metrics.jsonl").write_text(line + "\n")
    (rec,) = pl.tools.read_metrics(str(run))["sft"]
    assert math.isnan(rec["loss"]) and rec["kl"] == math.inf


def _summary(seed: int) -> dict:
    loss = math.nan if seed == 1 else 0.25 * (seed + 1)
    return {"stopped": "done", "dpo": {"loss": loss, "kl": math.inf, "score": 0.5 + seed / 10}}


def _fake_run(c, **kw):
    """A run over one seed that writes its directory as an older version did: its
    configuration (`open_run_dir`) and a `summary.json` with the bare NaN token."""
    with pl.tools.open_run_dir(c, c.out, **kw):
        with open(os.path.join(c.out, "summary.json"), "w") as f:
            json.dump(_summary(c.ops.seed), f)
        log = pl.tools.MetricsLog(c.out, "dpo", quiet=True)
        log.write({"iteration": 0, "step": 0, "loss": 1.0})
    return _summary(c.ops.seed)


def test_seeds_summary_is_strict_json_and_names_the_seeds_that_were_not_finite(tmp_path):
    cfg = dataclasses.replace(pl.PipelineConfig(stages=("dpo",)), out=str(tmp_path / "seeds"))
    pl.tools.run_seeds(cfg, 3, run=_fake_run)
    path = os.path.join(cfg.out, "seeds_summary.json")
    with open(path) as f:
        written = _strict(f.read())
    loss = written["metrics"]["dpo.loss"]
    assert loss["values"] == [0.25, "NaN", 0.75]
    assert loss["mean"] == "NaN"  # not the mean of the other seeds alone
    assert (loss["min"], loss["max"]) == (0.25, 0.75) and loss["nonfinite"] == [1]
    assert written["metrics"]["dpo.kl"]["mean"] == "Infinity"
    assert "nonfinite" not in written["metrics"]["dpo.score"]

    # a resume reads each finished seed's summary (an older file, with bare tokens) back
    again = pl.tools.run_seeds(cfg, 3, resume=True, run=_fake_run)
    assert math.isnan(again["metrics"]["dpo.loss"]["values"][1])
    assert again["metrics"]["dpo.kl"]["values"] == [math.inf] * 3
    with open(path) as f:
        assert _strict(f.read()) == written


def test_summarize_seeds_keeps_min_and_max_of_the_numbers_beside_a_nan():
    for order in ([0.2, math.nan, 0.9], [math.nan, 0.9, 0.2]):
        out = pl.tools.summarize_seeds({i: {"x": v} for i, v in enumerate(order)})["metrics"]
        assert (out["x"]["min"], out["x"]["max"]) == (0.2, 0.9)
        assert math.isnan(out["x"]["mean"]) and math.isnan(out["x"]["std"])
    both = pl.tools.summarize_seeds({0: {"x": math.inf}, 1: {"x": -math.inf}})["metrics"]["x"]
    assert math.isnan(both["mean"]) and both["nonfinite"] == [0, 1]
