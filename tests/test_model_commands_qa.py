"""`--set` lists on the command line (non-ASCII stop strings, JSON lists), `rlhf_eqx
plot` on run directories without step records, seeds and sweep directories, `--model`
given a directory that is not a model, and the options `sample` and `eval` share."""

import pytest

from rlhf_eqx import pipelines as pl


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
