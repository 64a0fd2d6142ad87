"""`rlhf_eqx sweep --help` says what each option does: the default seed count and
directory, and each stage's fields a grid may vary."""

import pytest

from rlhf_eqx.pipelines.tools import sweep_command


def test_sweep_help_names_the_defaults_and_the_traceable_fields(capsys):
    with pytest.raises(SystemExit) as e:
        sweep_command(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(default 4)" in text and "runs/sweep-STAGE" in text
    assert "dpo: beta, label_smoothing, optim.learning_rate" in text
    assert "ppo: kl_coef, clip_eps, vf_coef, ent_coef, optim.learning_rate" in text
    assert "--resume continue the sweep" in text
