"""`rlhf_eqx STAGE --help` with settings that do not load is refused as a run is: the
run's error line above the help, and a run's refusal status; settings that load are shown
(also for a stage that runs on a data file and has none yet)."""

import pytest

from rlhf_eqx.__main__ import main


@pytest.mark.parametrize(
    "override, reason",
    [("bad.field=1", "bad: unknown config section"), ("dpo.beta=-1", "dpo.beta=-1")],
)
def test_help_with_a_bad_setting_prints_the_run_s_error_and_refuses(override, reason, capsys):
    assert main(["dpo", "--set", override]) == 2  # the run's refusal
    run_err = capsys.readouterr().err
    assert run_err.startswith("error: invalid configuration: ") and reason in run_err
    assert main(["dpo", "--help", "--set", override]) == 2
    out, err = capsys.readouterr()
    assert err == run_err  # the same line, above the help
    assert "Fields of `dpo`" in out and "  dpo.beta = 0.1" in out  # the defaults' help


def test_help_shows_settings_that_load(capsys):
    assert main(["dpo", "--help", "--set", "dpo.beta=0.3"]) == 0
    out, err = capsys.readouterr()
    assert "  dpo.beta = 0.3" in out and not err


def test_help_of_a_data_file_stage_without_data_shows_the_given_settings(capsys):
    assert main(["prm", "--help", "--set", "prm.separator=|"]) == 0
    out, err = capsys.readouterr()
    assert "  prm.separator = |" in out and not err
