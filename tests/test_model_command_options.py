"""Options of `rlhf_eqx sample` and `rlhf_eqx serve` that are refused before a model
loads: one line naming the option, exit status 2."""

from rlhf_eqx.__main__ import main
from rlhf_eqx.serving import serve_command


def test_sample_refuses_a_sample_count_below_one(capsys):
    """`rlhf_eqx sample -n 0`: one line naming `-n`, exit 2 (an invalid option, not a
    run error)."""
    assert main(["sample", "-n", "0"]) == 2
    err = capsys.readouterr().err
    assert err == "error: invalid configuration: -n/--num-samples=0: must be >= 1\n"


def test_serve_names_an_unknown_chat_template(capsys, tmp_path):
    """`--chat-template` that is neither a built-in name nor a file or directory is
    refused naming the option and what it takes; a file with no template names it."""
    assert serve_command(["--chat-template", "bogus", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: --chat-template 'bogus': not hh, chatml, nor an existing .jinja file, "
        "tokenizer_config.json or model directory\n"
    )
    path = tmp_path / "tokenizer_config.json"
    path.write_text("{}")
    assert serve_command(["--chat-template", str(path), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --chat-template: ") and str(path) in err, err
