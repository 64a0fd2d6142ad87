"""A `TokenizeReport` names the first records whose prompt or completion was cut
(`truncated_rows`, their indices in the records tokenised), for every tokenising pass."""

import pytest

from rlhf_eqx import data
from rlhf_eqx.data import ByteTokenizer


@pytest.fixture(scope="module")
def tok():
    return ByteTokenizer()


def test_unpaired_report_names_the_cut_rows(tok):
    records = [
        data.UnpairedRecord("short", " ok", True),
        data.UnpairedRecord("a long prompt " * 4, " ok", False),
        data.UnpairedRecord("x", " a long completion" * 4, True),
        data.UnpairedRecord("y", " ok", False),
    ]
    _, report = data.tokenize_unpaired(records, tok, max_length=30, max_prompt_length=10)
    assert (report.prompt_truncated, report.completion_truncated) == (1, 1)
    assert report.truncated_rows == [1, 2]


def test_a_record_cut_twice_is_named_once_and_at_most_five_are(tok):
    records = [data.UnpairedRecord("p" * 20, "c" * 40, True) for _ in range(8)]
    _, report = data.tokenize_unpaired(records, tok, max_length=30, max_prompt_length=10)
    assert (report.prompt_truncated, report.completion_truncated) == (8, 8)
    assert report.truncated_rows == [0, 1, 2, 3, 4]


def test_stepwise_report_names_the_cut_rows(tok):
    records = [
        data.StepwiseRecord("q", ("a", "b"), (True, True)),
        data.StepwiseRecord("q", ("a", "b" * 40), (True, False)),
        data.StepwiseRecord("q" * 30, ("a",), (True,)),
    ]
    _, report = data.tokenize_stepwise(records, tok, max_length=24, max_prompt_length=8)
    assert (report.prompt_truncated, report.completion_truncated) == (1, 1)
    assert report.truncated_rows == [1, 2]


def test_an_uncut_pass_names_none(tok):
    records = [data.UnpairedRecord("q", " ok", True)]
    _, report = data.tokenize_unpaired(records, tok, max_length=30, max_prompt_length=10)
    assert report.truncated_rows == [] and report.prompt_truncated == 0
