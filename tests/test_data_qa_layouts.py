"""A stage that reads more than one layout (`kto`: unpaired records, else preference
pairs) names a bad record of a preference file by its line and field, not the first
line for a layout it did not match."""

import json

from rlhf_eqx.__main__ import main


def test_kto_on_pairs_names_the_bad_pair(tmp_path, capsys):
    rows = [{"prompt": f"p{i}", "chosen": " a", "rejected": " b"} for i in range(6)]
    rows.append({"prompt": "x", "chosen": 5, "rejected": " b"})
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n" + "".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    argv = ["kto", "--data", str(path), "--out", str(out), "--quiet"]
    assert main([*argv, "--set", "ops.monitor=false"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"error: {path}:8: wrong type: 'chosen' must be a string, got int"
    assert not out.exists()
