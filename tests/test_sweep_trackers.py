"""A sweep's members in the experiment trackers (`ops.trackers`): a tiny built-in SFT
sweep (2 learning rates × 2 seeds, the larger rate diverging) logs each member as a
separate run in one group, with its files in `members/<name>/`. Read back with each
library's own reader: one MLflow run per member (named `<sweep>/<member>`, its
parameters with its seed and grid value, each metric's history equal to the member's
`metrics.jsonl`, its summary saying `done` or `diverged`), TensorBoard's scalars, and
after a resume from a checkpoint the same runs continued with each step once. With all
four backends (W&B offline, trackio's local store) nothing leaves the machine."""

import glob
import json
import os
import shutil

import pytest
from test_trackers import (
    _installed,
    _item,
    _numbers,
    _offline,
    _Refuses,
    _steps,
    _tensorboard_events,
    _tensorboard_scalars,
)

from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

TINY = [
    "sft.steps=4",
    "eval_samples=1",
    "ops.monitor=false",
    "ops.checkpoint_every=2",
]
RATES = "sft.optim.learning_rate=0.0005,1e6"  # 1e6: non-finite by step 2
TIMING = ("time", "per_s", "mfu", "seconds")


def _sweep(out: str, trackers: str, *sets: str, grid: bool = False, resume: bool = False) -> int:
    argv = ["sweep", "sft", "--seeds", "2", "--out", out, "--quiet"]
    argv += ["--grid", RATES] if grid else []
    for s in [*TINY, f"ops.trackers={trackers}", *sets]:
        argv += ["--set", s]
    return main([*argv, *(["--resume"] if resume else [])])


def _members(out: str) -> dict[str, dict]:
    """Each member's `summary.json` by member name."""
    out_ = {}
    for d in sorted(glob.glob(os.path.join(out, "members", "*"))):
        with open(os.path.join(d, "summary.json")) as f:
            out_[os.path.basename(d)] = json.load(f)
    return out_


def _mlflow_run(member_dir: str):
    """`(client, run)`: the one MLflow run in the member's store."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri="sqlite:///" + os.path.join(member_dir, "mlflow.db"))
    exp = client.get_experiment_by_name("rlhf_eqx")
    (found,) = client.search_runs([exp.experiment_id])
    return client, client.get_run(found.info.run_id)


def _mlflow_histories(member_dir: str) -> dict[str, list[tuple[int, float]]]:
    client, run = _mlflow_run(member_dir)
    return {
        k: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, k))
        for k in run.data.metrics
        if k.startswith("sft/")
    }


def _wanted(member_dir: str, timing: bool = True) -> dict[str, list[tuple[int, float]]]:
    """`{sft/<metric>: [(step, value)]}` of the member's `metrics.jsonl`."""
    out: dict[str, list] = {}
    for rec in _steps(member_dir)["sft"]:
        for k, v in _numbers(rec).items():
            if timing or not any(t in k for t in TIMING):
                out.setdefault(f"sft/{k}", []).append((rec["step"], v))
    return {k: sorted(v) for k, v in out.items()}


def _same(got, want, rel: float = 1e-12) -> bool:
    steps = [s for s, _ in got] == [s for s, _ in want]
    values = [v for _, v in got] == pytest.approx([v for _, v in want], rel=rel, nan_ok=True)
    return steps and values


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """The sweep with MLflow and TensorBoard, the network refused: its directory."""
    _need = [m for m in ("mlflow", "tensorboardX") if not _installed(m)]
    if _need:
        pytest.skip(f"{', '.join(_need)} not installed")
    out = str(tmp_path_factory.mktemp("sweeps") / "sweep-lr")
    mp = pytest.MonkeyPatch()
    try:
        guard = _offline(mp)
        assert _sweep(out, "mlflow,tensorboard", grid=True) == 0
    finally:
        mp.undo()
    assert guard.attempts == []
    return out


def test_each_member_is_an_mlflow_run_of_the_group_with_its_config_steps_and_summary(swept):
    members = _members(swept)
    assert {s["stopped"] for s in members.values()} == {"done", "diverged"}
    ids = set()
    for name, summary in members.items():
        d = os.path.join(swept, "members", name)
        client, run = _mlflow_run(d)
        ids.add(run.info.run_id)
        assert run.info.run_name == f"sweep-lr/{name}" and run.info.status == "FINISHED"
        assert run.data.tags["group"] == "sweep-lr"  # the sweep directory's name
        assert pl.trackers.recorded_runs(d)["mlflow"]["run_id"] == run.info.run_id
        params = run.data.params
        (rate,) = summary["point"].values()
        assert params["sweep.member"] == name and params["sweep.seed"] == str(summary["seed"])
        assert params["sweep.optim.learning_rate"] == json.dumps(rate)
        assert params["sft.optim.learning_rate"] == json.dumps(rate)
        assert params["ops.seed"] == str(summary["seed"]) and params["sft.steps"] == "4"
        got, want = _mlflow_histories(d), _wanted(d)
        assert set(got) == set(want) and "sft/loss" in want
        for k in want:
            assert _same(got[k], want[k]), (name, k)
        assert run.data.tags["summary/stopped"] == summary["stopped"]
        if summary["stopped"] == "diverged":
            step = summary["diverged_at"]["step"]
            assert run.data.metrics["summary/diverged_at/step"] == step
            assert any(v != v for s, v in want["sft/loss"] if s == step)  # NaN logged as is
        else:
            assert run.data.metrics["summary/loss"] == pytest.approx(summary["loss"])
    assert len(ids) == 4


def test_each_member_has_its_tensorboard_scalars(swept):
    for name in _members(swept):
        d = os.path.join(swept, "members", name)
        scalars = _tensorboard_scalars(os.path.join(d, "tensorboard", "sft"))
        want = _wanted(d)
        assert set(scalars) == set(want)
        for k, rows in want.items():
            assert _same(sorted(scalars[k].items()), rows, rel=1e-6), (name, k)  # float32


def test_a_resumed_sweep_continues_each_members_runs_with_each_step_once(swept, tmp_path):
    # the sweep as if killed after its checkpoint of iteration 2 (of 4)
    out = str(tmp_path / "sweep-lr")
    shutil.copytree(swept, out)
    shutil.rmtree(os.path.join(out, "checkpoints", "iter_00000004"))
    before = {}
    for name in os.listdir(os.path.join(out, "members")):
        os.remove(os.path.join(out, "members", name, "summary.json"))
        before[name] = pl.trackers.recorded_runs(os.path.join(out, "members", name))
    mp = pytest.MonkeyPatch()
    try:
        guard = _offline(mp)
        assert _sweep(out, "mlflow,tensorboard", grid=True, resume=True) == 0
    finally:
        mp.undo()
    assert guard.attempts == []
    for name, summary in _members(out).items():
        d, full = os.path.join(out, "members", name), os.path.join(swept, "members", name)
        client, run = _mlflow_run(d)
        assert run.info.run_id == before[name]["mlflow"]["run_id"]  # the same run, reopened
        assert run.info.status == "FINISHED"
        assert run.data.tags["summary/stopped"] == summary["stopped"]
        got, want = _mlflow_histories(d), _wanted(full, timing=False)
        for k, rows in want.items():
            assert _same(got[k], rows), (name, k)  # each step once, the same values
        events = _tensorboard_events(os.path.join(d, "tensorboard", "sft"))
        for k, rows in want.items():
            assert _same(sorted(events[k]), rows, rel=1e-6), (name, k)  # purged, then again


def test_all_four_trackers_log_each_member_offline_in_the_group(tmp_path, monkeypatch):
    names = [n for n, m in (("wandb", "wandb"), ("trackio", "trackio")) if _installed(m)]
    if not names:
        pytest.skip("neither wandb nor trackio is installed")
    guard = _offline(monkeypatch)
    out = str(tmp_path / "sweep-all")
    trackers = ",".join(["tensorboard", "mlflow", *names])
    assert _sweep(out, trackers, "ops.tracker_group=grp") == 0
    assert guard.attempts == []
    members = _members(out)
    assert len(members) == 2
    for name, summary in members.items():
        d = os.path.join(out, "members", name)
        want = _wanted(d)
        assert set(pl.trackers.recorded_runs(d)) == {"tensorboard", "mlflow", *names}
        assert _mlflow_run(d)[1].data.tags["group"] == "grp"
        assert set(_tensorboard_scalars(os.path.join(d, "tensorboard", "sft"))) == set(want)
        if "wandb" in names:
            (path,) = glob.glob(os.path.join(d, "wandb", "offline-run-*", "run-*.wandb"))
            history, final = [], {}
            for r in pl.trackers.wandb_records(path):
                kind = r.WhichOneof("record_type")
                if kind == "run":
                    assert r.run.run_group == "grp" and r.run.display_name == f"sweep-all/{name}"
                    config = dict(_item(u) for u in r.run.config.update)
                    assert config["sweep"] == {"member": name, "seed": summary["seed"]}
                elif kind == "history":
                    history.append(dict(_item(i) for i in r.history.item))
                elif kind == "summary":
                    final.update(_item(u) for u in r.summary.update)
            for k, rows in want.items():
                assert _same(sorted((h["sft/step"], h[k]) for h in history if k in h), rows)
            assert final["summary/stopped"] == "done" and final["summary/name"] == name
        if "trackio" in names:
            import trackio
            from trackio.sqlite_storage import SQLiteStorage

            (run,) = [r for r in trackio.Api().runs("rlhf_eqx") if r.name == f"sweep-all/{name}"]
            assert run.config["_Group"] == "grp" and run.config["sweep"]["member"] == name
            logs = SQLiteStorage.get_logs("rlhf_eqx", f"sweep-all/{name}")
            for k, rows in want.items():
                assert _same(sorted((r["step"], r[k]) for r in logs if k in r), rows)
            assert any(r.get("summary/loss") == pytest.approx(summary["loss"]) for r in logs)


def test_each_seeds_shared_sft_is_a_tracker_run_of_the_group(tmp_path):
    """A DPO sweep runs SFT once per seed (`seeds/seed-<s>/`): that stage is a tracker run
    of its own in the sweep's group, `<sweep>/seed-<s>`, its TensorBoard scalars those of
    the seed's `metrics.jsonl`; the members' runs hold their DPO stage."""
    out = str(tmp_path / "dposweep")
    argv = ["sweep", "dpo", "--seeds", "2", "--grid", "dpo.beta=0.1,0.2", "--out", out]
    sets = ["sft.steps=2", "dpo.rounds=1", "dpo.steps=2", "eval_samples=1", "ops.quiet=true"]
    sets += ["ops.monitor=false", "ops.trackers=tensorboard"]
    assert main([*argv, *[a for s in sets for a in ("--set", s)]]) == 0
    seeds = sorted(glob.glob(os.path.join(out, "seeds", "seed-*")))
    assert [os.path.basename(d) for d in seeds] == ["seed-0", "seed-1"]
    for d in seeds:
        with open(os.path.join(d, "trackers.json")) as f:
            assert "tensorboard" in json.load(f)
        scalars = _tensorboard_scalars(os.path.join(d, "tensorboard", "sft"))
        want = _wanted(d)
        assert want and set(scalars) == set(want)
        for k, rows in want.items():
            assert _same(sorted(scalars[k].items()), rows, rel=1e-6), (d, k)
    for name in _members(out):
        member = os.path.join(out, "members", name)
        assert os.listdir(os.path.join(member, "tensorboard")) == ["dpo"], name


class _NoServer(_Refuses):
    """A tracker whose server never answers: each start is counted, then refused."""

    starts = 0

    def start(self, run_name, config, group):
        type(self).starts += 1
        super().start(run_name, config, group)


def test_a_tracker_that_cannot_start_is_tried_once_for_the_whole_sweep(tmp_path, capsys):
    """2 β × 2 seeds of DPO open trackers for 4 members and 2 seeds' shared SFT: a tracker
    that cannot start is tried once and said once, and the sweep goes on with the others
    (TensorBoard logs every member)."""
    pl.trackers.register_tracker("test-no-server", _NoServer)
    _NoServer.starts = 0
    out = str(tmp_path / "s")
    argv = ["sweep", "dpo", "--seeds", "2", "--grid", "dpo.beta=0.1,0.2", "--out", out]
    sets = ["sft.steps=2", "dpo.rounds=1", "dpo.steps=2", "eval_samples=1", "ops.quiet=true"]
    sets += ["ops.monitor=false", "ops.trackers=test-no-server", "ops.tensorboard=true"]
    assert main([*argv, *[a for s in sets for a in ("--set", s)]]) == 0
    err = capsys.readouterr().err
    assert _NoServer.starts == 1, err
    assert err.count("tracker test-no-server: could not start") == 1, err
    members = _members(out)
    assert len(members) == 4
    for name in members:
        recorded = pl.trackers.recorded_runs(os.path.join(out, "members", name))
        assert set(recorded) == {"tensorboard"}, name
