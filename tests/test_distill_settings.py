"""The settings of the `distill` stage either act on the run or are refused in one line
naming the field: the built-in task's fixed teacher samples (`distill.samples`) train
only the steps that are neither on-policy (`lmbda`) nor sampled afresh from the
teacher (`seq_kd`)."""

import re

import pytest

from rlhf_eqx import pipelines as pl


def _validate(overrides: list[str]) -> None:
    pl.config.validate_config(pl.apply_overrides(pl.PipelineConfig(), overrides))


@pytest.mark.parametrize(
    "kind",
    [["distill.seq_kd=true"], ["distill.lmbda=1.0"], ["distill.lmbda=1", "distill.seq_kd=true"]],
)
def test_samples_that_no_step_trains_on_are_refused(kind):
    with pytest.raises(pl.ConfigError, match=rf"^{re.escape('distill.samples=4')}: ") as e:
        _validate([*kind, "distill.samples=4"])
    assert "\n" not in str(e.value)
    _validate(kind)  # the default is not a choice


@pytest.mark.parametrize("kind", [[], ["distill.lmbda=0.5"], ["distill.lmbda=0.0"]])
def test_samples_are_accepted_where_fixed_completions_train(kind):
    _validate([*kind, "distill.samples=4"])
