"""Callbacks that change what they are given: the step records a callback reads
(`run.history`), the metrics of `on_step` and the held-out results of `on_evaluate` are
the callback's own copies; the run's records, its summary and its training are those
of the run without the callback."""

import json
import os

import jax
import jax.numpy as jnp
import pytest
from test_callbacks import _quadratic

from rlhf_eqx import pipelines as pl

_TIMING = ("iteration_time_s", "tokens_per_s", "mfu", "model_flops")


def _run(path, callbacks):
    state, iteration = _quadratic()
    return pl.loop.run_iterations(
        state,
        iteration,
        num_iterations=4,
        key=jax.random.key(1),
        ops=pl.OpsConfig(quiet=True, eval_every=2, checkpoint_every=2),
        log=pl.tools.MetricsLog(str(path), "q", quiet=True),
        checkpoint_dir=str(path / "ck"),
        evaluate=lambda s, i: {"probe": float(s.step)},
        callbacks=callbacks,
    )


def _untimed(records):
    return [{k: v for k, v in r.items() if k not in _TIMING} for r in records]


class Vandal(pl.Callback):
    """Changes everything it is handed."""

    def __init__(self):
        self.seen = []

    def on_step(self, run, step, metrics):
        history = run.history
        self.seen.append(len(history))
        for record in history:
            record["loss"] = 1e9
        history.clear()
        metrics["loss"] = -1.0
        metrics.clear()

    def on_evaluate(self, run, step, results):
        results["probe"] = -1.0
        results.clear()


def test_a_callback_changing_the_history_it_reads_changes_nothing_of_the_run(tmp_path):
    plain = _run(tmp_path / "plain", [])
    vandal = Vandal()
    changed = _run(tmp_path / "changed", [vandal])
    # Each call saw the records so far (its own copy).
    assert vandal.seen == [1, 2, 3, 4]
    assert _untimed(changed.history) == _untimed(plain.history)
    assert all(r["loss"] < 1e9 for r in changed.history)
    for a, b in zip(
        jax.tree_util.tree_leaves(changed.state.params),
        jax.tree_util.tree_leaves(plain.state.params),
    ):
        assert bool(jnp.array_equal(a, b))


def _summary(run_dir):
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)


@pytest.mark.slow  # a whole run of a stage (8-15 s): in the slow suite
def test_a_callback_changing_the_held_out_results_leaves_the_summary_as_it_was(tmp_path):
    """The held-out `on_evaluate` gets the stage's summary entry: a callback that empties
    it made the pipeline fail on the missing score and wrote its changes into
    `summary.json`."""
    got = []

    class Eraser(pl.Callback):
        def on_evaluate(self, run, step, results):
            if "score" in results:  # the held-out evaluation
                got.append(dict(results))
                results["stopped"] = "erased"
                results.clear()

    out = str(tmp_path / "run")
    cfg = pl.apply_overrides(
        pl.animal_task_config(), ["stages=sft", "sft.steps=2", "ops.quiet=true", f"out={out}"]
    )
    summary = pl.run_pipeline(cfg, callbacks=[Eraser()])
    assert len(got) == 1 and got[0]["stopped"] == "done"
    assert summary["sft"]["stopped"] == "done" and "score" in summary["sft"]
    assert _summary(out)["sft"] == summary["sft"]
    assert summary["sft"] == got[0]


def test_a_value_named_as_a_records_own_field_is_refused_naming_the_callback(tmp_path):
    """`run.log_metrics({"step": ...})` moved the record to that step (in
    `metrics.jsonl` and the trackers); `{"event": ...}` made it an event."""

    class Clash(pl.Callback):
        def on_step(self, run, step, metrics):
            if step == 2:
                run.log_metrics({"acc": 0.5, "step": 99})

    with pytest.raises(pl.loop.CallbackError) as caught:
        _run(tmp_path, [Clash()])
    message = str(caught.value)
    assert message.startswith("callback Clash.on_step failed in q after iteration 2: ValueError")
    assert "'step'" in message
    assert caught.value.checkpoint is not None
    with open(tmp_path / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert all(r.get("step") != 99 and "acc" not in r for r in records)
