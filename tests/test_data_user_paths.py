"""A user's own data files on the command line: a bad record stops the run with one line
naming the file, the line (or row) and the field, and leaves no run directory behind;
a run or a sweep stopped by SIGTERM checkpoints and prints the command that resumes it,
as Ctrl-C does."""

import json
import os
import signal
import subprocess
import sys

import pytest
from helpers import signal_when

import rlhf_eqx as rx
from rlhf_eqx import data
from rlhf_eqx.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _jsonl(path, rows) -> str:
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


def _parquet(path, rows) -> str:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


_PAIR = {"prompt": "Once a cat", "chosen": " was happy.", "rejected": " was sad."}


def _bad_files(tmp_path):
    """(stage, path, what the error line says after the path) for each kind of bad input."""
    user = {"role": "user", "content": "Hi"}
    return [
        ("dpo", _jsonl(tmp_path / "torn.jsonl", [_PAIR, '{"prompt": "a", "chosen":']), ":2: "),
        (
            "dpo",
            _jsonl(tmp_path / "no_chosen.jsonl", [{"prompt": "a", "rejected": " b"}]),
            ":1: cannot tell the preference format from the keys ['prompt', 'rejected']",
        ),
        (
            "sft",
            _jsonl(tmp_path / "number.jsonl", [{**_PAIR, "chosen": 5}]),
            ":1: wrong type: 'chosen' must be a string, got int",
        ),
        (
            "dpo",
            _jsonl(
                tmp_path / "no_content.jsonl",
                [{"prompt": [user], "chosen": [{"role": "assistant"}], "rejected": [user]}],
            ),
            ":1: wrong type: a message in 'chosen' needs string role/content",
        ),
        (
            "kto",
            _jsonl(tmp_path / "label.jsonl", [{"prompt": "a", "completion": " b", "label": "yes"}]),
            ":1: wrong type: 'label' must be a boolean (true/false, or 0/1), got str 'yes'",
        ),
        (
            "prm",
            _jsonl(
                tmp_path / "steps.jsonl",
                [{"prompt": "a", "completions": ["s1", "s2"], "labels": [True]}],
            ),
            ":1: length mismatch: 2 completions (steps) but 1 labels",
        ),
        (
            "reward",
            _parquet(tmp_path / "other.parquet", [{"foo": "a", "bar": "b"}] * 3),
            ": row 0: cannot tell the preference format from the keys ['bar', 'foo']",
        ),
        ("dpo", _jsonl(tmp_path / "empty.jsonl", []), ": no records"),
    ]


def test_a_bad_record_is_one_line_and_leaves_no_run_directory(tmp_path, capsys):
    for i, (stage, path, says) in enumerate(_bad_files(tmp_path)):
        run_dir = tmp_path / f"run{i}"
        assert main([stage, "--data", path, "--out", str(run_dir), "--quiet"]) == 1, path
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [err[0]] and err[0].startswith(f"error: {path}{says}"), (path, err)
        assert not run_dir.exists(), (path, sorted(os.listdir(run_dir)))


def test_a_failed_run_keeps_a_directory_it_did_not_create(tmp_path, capsys):
    run_dir = tmp_path / "mine"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("my notes")
    path = _jsonl(tmp_path / "no_chosen.jsonl", [{"prompt": "a", "rejected": " b"}])
    assert main(["dpo", "--data", path, "--out", str(run_dir), "--quiet"]) == 1
    assert "cannot tell the preference format" in capsys.readouterr().err
    assert (run_dir / "notes.txt").read_text() == "my notes"


def _pairs(tmp_path) -> str:
    animals = ["cat", "dog", "fox", "owl", "bee", "cow", "pig", "hen", "ant", "elk", "yak"]
    rows = [
        {"prompt": f"Once a {a}", "chosen": " was happy.", "rejected": f" was sad {i}."}
        for i, a in enumerate(animals * 2)
    ]
    return _jsonl(tmp_path / "pairs.jsonl", rows)


_TINY = [
    "--set",
    "dpo.batch_size=4",
    "--set",
    "dpo.max_length=48",
    "--set",
    "data.eval_prompts=2",
    "--set",
    "sampling.max_new_tokens=4",
    "--set",
    "ops.monitor=false",
    "--set",
    "ops.checkpoint_every=2",
    "--quiet",
]


def _terminate_after_first_checkpoint(tmp_path, args: list[str], run_dir) -> tuple[int, str]:
    """Start `rlhf_eqx ARGS`, send SIGTERM once a checkpoint is in place; (exit status,
    stderr)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    err_path = tmp_path / "err.txt"

    def ready():
        return any(
            d.startswith("iter_") and ".tmp" not in d
            for root, dirs, _ in os.walk(run_dir)
            if os.path.basename(root) == "checkpoints"
            for d in dirs
        )

    with open(err_path, "w") as err:
        command = [sys.executable, "-m", "rlhf_eqx", *args]
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, env=env)
        code = signal_when(proc, ready, signal.SIGTERM, log=err_path)
    return code, err_path.read_text()


@pytest.mark.slow
@pytest.mark.parametrize("command", [["dpo"], ["sweep", "dpo", "--seeds", "2"]])
def test_sigterm_checkpoints_and_prints_the_resume_command(tmp_path, command):
    run_dir = tmp_path / "run"
    args = [*command, "--data", _pairs(tmp_path), *_TINY, "--set", "dpo.steps=100000"]
    args += ["--out", str(run_dir)]
    code, stderr = _terminate_after_first_checkpoint(tmp_path, args, run_dir)
    assert code == 130, stderr[-4000:]
    assert "Traceback" not in stderr, stderr[-4000:]
    (line,) = [x for x in stderr.splitlines() if x.startswith("interrupted")]
    assert line.endswith("resume with: rlhf_eqx " + " ".join(args) + " --resume"), line


@pytest.mark.parametrize(
    "columns, says",
    [
        ({"prompt": 5}, "data.columns.prompt=5: expected a string"),
        ({"chosen": ""}, "data.columns={'chosen': ''}: 'chosen' must name a column, got ''"),
    ],
)
def test_a_column_mapped_to_no_name_is_an_invalid_configuration(tmp_path, capsys, columns, says):
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps({"data": {"columns": columns}}))
    run_dir = tmp_path / "run"
    argv = ["dpo", "--data", _jsonl(tmp_path / "p.jsonl", [_PAIR]), "--config", str(config)]
    assert main([*argv, "--out", str(run_dir), "--quiet"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == f"error: invalid configuration: {says}" and not run_dir.exists()


def test_a_bad_data_format_lists_each_format_once(tmp_path, capsys):
    path = _jsonl(tmp_path / "p.jsonl", [_PAIR])
    assert main(["dpo", "--data", path, "--set", "data.format=xml", "--quiet"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    formats = line.partition("must be one of ")[2].split(", ")
    assert "plain" in formats and len(formats) == len(set(formats)), line


@pytest.mark.parametrize(
    "stage, row",
    [
        ("grpo", {"question": "What is 1+1?", "answer": "#### 2"}),
        ("prm", {"prompt": "1+1?", "completions": ["1+1=2"], "labels": [True]}),
        ("dpo", _PAIR),
    ],
)
def test_data_filter_is_refused_by_the_stages_that_do_not_filter(tmp_path, capsys, stage, row):
    path = _jsonl(tmp_path / "rows.jsonl", [row])
    argv = [stage, "--data", path, "--set", "data.filter=identical", "--show-config"]
    if stage == "dpo":  # its pairs are filtered
        assert main(argv) == 0
        return
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(
        f"error: invalid configuration: data.filter=identical: {stage} does not filter its records"
    ), line


def test_a_failed_sweep_leaves_no_directory_and_a_resume_names_each_changed_field(tmp_path, capsys):
    # Pairs whose every record the reader drops: the sweep takes its directory (writes
    # sweep.json), then stops before anything is compiled.
    path = _jsonl(tmp_path / "same.jsonl", [{"prompt": "a", "chosen": " b", "rejected": " b"}])
    argv = ["sweep", "dpo", "--data", path, "--seeds", "1", "--grid", "dpo.beta=0.1,0.2"]
    assert main([*argv, "--out", str(tmp_path / "fresh"), "--quiet"]) == 1
    assert "no usable records" in capsys.readouterr().err
    assert not (tmp_path / "fresh").exists()  # so the same command can run again
    # A directory that was there before is kept, with the sweep's spec.
    argv += ["--out", str(tmp_path / "made"), "--quiet"]
    (tmp_path / "made").mkdir()
    assert main(argv) == 1
    assert "no usable records" in capsys.readouterr().err
    assert main([*argv, "--set", "dpo.steps=3", "--resume"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "the resumed sweep differs from the stored one (dpo.steps: 20 -> 3); " in line


def test_a_byte_order_mark_is_not_part_of_the_first_record(tmp_path):
    from rlhf_eqx import data

    rows = [_PAIR, {**_PAIR, "prompt": "Once a dog"}]
    plain = _jsonl(tmp_path / "plain.jsonl", rows)
    expected = list(data.load_preferences(plain))
    for name, text in [
        ("bom.jsonl", "".join(json.dumps(r) + "\r\n" for r in rows)),
        ("bom.json", json.dumps(rows)),
    ]:
        path = tmp_path / name
        path.write_bytes(b"\xef\xbb\xbf" + text.encode())
        assert list(data.load_preferences(path)) == expected, name


def test_prm_refuses_a_data_format_it_would_ignore(tmp_path, capsys):
    row = {"prompt": "1+1?", "completions": ["1+1=2"], "labels": [True]}
    argv = ["prm", "--data", _jsonl(tmp_path / "steps.jsonl", [row]), "--show-config"]
    assert main([*argv, "--set", "data.format=hh"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        "error: invalid configuration: data.format='hh': prm reads one layout (prompt, "
        "completions, labels): auto"
    )
    assert main(argv) == 0


def _unpaired(tmp_path, name, rows) -> str:
    return _jsonl(tmp_path / name, [{"prompt": p, "completion": c, "label": y} for p, c, y in rows])


def test_kto_refuses_a_split_it_cannot_use_before_training(tmp_path, capsys):
    """KTO on a data file needs both labels among the training examples and two held-out
    examples (the held-out reference point pairs each with another's completion): both
    are refused up front, naming the file and the setting, with no run directory left."""
    prompts = [f"Tom saw a bird {i}" for i in range(200)]
    held = list(rx.data.split_held_out(prompts, fraction=0.1, seed=0)[1])
    train = [p for p in prompts if p not in held][:11]
    one_held = [(p, " and smiled.", i % 2 == 0) for i, p in enumerate(train + held[:1])]
    path = _unpaired(tmp_path, "one_held.jsonl", one_held)
    run_dir = tmp_path / "run_a"
    args = ["kto", "--data", path, "--set", "data.seed=0", "--out", str(run_dir), "--quiet"]
    assert main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: data.path={path}: 1 example held out (data.heldout_fraction=0.1); KTO's "
        "held-out metrics need at least two: raise data.heldout_fraction or try another "
        "data.seed"
    ]
    assert not run_dir.exists()

    rows = [{"prompt": p, "completion": " ok.", "good": True} for p in train + held[:2]]
    path = _jsonl(tmp_path / "all_good.jsonl", rows)
    run_dir = tmp_path / "run_b"
    args = ["kto", "--data", path, "--set", "data.columns.label=good", "--out", str(run_dir)]
    assert main(args + ["--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: data.path={path}: KTO needs desirable and undesirable examples; the 11 "
        "training examples (of 13) are all desirable (column 'good')"
    ]
    assert not run_dir.exists()


def test_a_bad_record_leaves_no_directory_of_a_run_over_seeds(tmp_path, capsys):
    path = _jsonl(tmp_path / "no_chosen.jsonl", [{"prompt": "a", "rejected": " b"}])
    run_dir = tmp_path / "seeds"
    assert main(["dpo", "--data", path, "--seeds", "2", "--out", str(run_dir), "--quiet"]) == 1
    assert "cannot tell the preference format" in capsys.readouterr().err
    assert not run_dir.exists()


def test_labels_written_as_numbers_of_zero_or_one_are_read_as_booleans(tmp_path):
    """KTO labels as a Parquet or pandas column holds them (floats `1.0` / `0.0`, or
    integers) are booleans; any other number is refused by name."""
    rows = [
        {"prompt": "a", "completion": " b", "label": 1.0},
        {"prompt": "c", "completion": " d", "label": 0.0},
    ]
    for path in (_jsonl(tmp_path / "f.jsonl", rows), _parquet(tmp_path / "f.parquet", rows)):
        assert [r.label for r in data.load_unpaired(path)] == [True, False]
    bad = _jsonl(tmp_path / "half.jsonl", [{**rows[0], "label": 0.5}])
    with pytest.raises(data.DataError, match=r"'label' must be a boolean .* got float 0.5"):
        data.load_unpaired(bad)
