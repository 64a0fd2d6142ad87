"""The run's checks of a model's header name the file at fault: a teacher checkpoint
whose `config.json` is not valid JSON is refused naming that file, not only the place in
it."""

import json

import jax

import rlhf_eqx as rx
from rlhf_eqx import pipelines as pl


def test_a_teacher_config_that_is_not_json_names_the_file(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"Say {i}.", "chosen": f"A cat {i}.", "rejected": "No."} for i in range(8)]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = rx.TransformerConfig(vocab_size=512, d_model=16, n_layers=1, n_heads=2, d_ff=32)
    teacher = tmp_path / "teacher"
    rx.save_hf(rx.Policy(cfg, key=jax.random.key(0)), teacher)
    (teacher / "config.json").write_text('{"hidden_size": 16,')
    overrides = [f"data.path={pairs}", f"distill.teacher={teacher}"]
    config = pl.apply_overrides(pl.animal_task_config(), overrides)
    try:
        pl.config.validate_config(config, stage="distill")
    except pl.ConfigError as e:
        line = str(e)
    else:
        raise AssertionError("a teacher with a broken config.json was accepted")
    assert "\n" not in line
    assert line.startswith(f"distill.teacher={str(teacher)!r}: {teacher / 'config.json'}: ")
    assert "not valid JSON (" in line
