"""Monitoring of runs: model FLOPs and MFU, device memory, reward improvement, profiler
traces and TensorBoard scalars."""

import json
import os
import sys
import types

import jax
import pytest

import rlhf_eqx as rx
from rlhf_eqx import pipelines as pl
from rlhf_eqx.assets import asset_path
from rlhf_eqx.pipelines.tools import device_memory, measure_matmul_peak, model_flops


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f.read().splitlines()]


def _fake_run(tmp_path, ops, *, n=6, **kw):
    """`run_iterations` on a state without arrays: iteration `i` reports score `i`."""
    state = types.SimpleNamespace(opt_state=())
    log = pl.tools.MetricsLog(str(tmp_path), "t", quiet=True, tensorboard=ops.tensorboard)

    def iteration(state, key, i):
        del key
        return state, [{"loss": 1.0}], {"score": float(i)}

    res = pl.loop.run_iterations(
        state, iteration, num_iterations=n, key=jax.random.key(0), ops=ops, log=log, **kw
    )
    return res, log


def test_model_flops_count_and_a_positive_measured_peak():
    assert model_flops(10, train_tokens=3) == 180.0
    assert model_flops([10, 5], forward_tokens=4, train_tokens=1) == 2 * 15 * 4 + 6 * 15
    assert measure_matmul_peak(size=64, repeats=2) > 0


def test_mfu_memory_and_reward_improvement_are_logged(tmp_path):
    ops = pl.OpsConfig(quiet=True, log_every=2)
    res, log = _fake_run(tmp_path, ops, flops_per_iteration=1e6, peak_flops=1e9)
    lines = _records(log.path)
    (start,) = [r for r in lines if r.get("event") == "monitor"]
    assert start["peak_flops"] == 1e9 and start["devices"] == jax.device_count()
    assert "one device" in start["collective_share"]
    steps = [r for r in lines if "step" in r and "event" not in r]
    assert len(steps) == 6
    for r in steps:
        assert r["model_flops"] == 1e6
        assert r["mfu"] == pytest.approx(1e6 / r["iteration_time_s"] / 1e9)
        assert ("memory_in_use_bytes" in r) == bool(jax.local_devices()[0].memory_stats())
    assert "reward_improvement" not in steps[1]
    assert [r["reward_improvement"] for r in steps[2:]] == [2.0] * 4


def test_device_memory_is_omitted_where_the_backend_reports_none():
    stats = jax.local_devices()[0].memory_stats()
    assert (device_memory() == {}) == (not stats)


def test_profile_steps_write_a_trace_in_the_run_directory(tmp_path):
    _fake_run(tmp_path, pl.OpsConfig(quiet=True, profile_steps=(1, 3)), n=4)
    trace_dir = tmp_path / "profile" / "t"
    files = [os.path.join(d, f) for d, _, fs in os.walk(trace_dir) for f in fs]
    assert files, "no trace written"
    with pytest.raises(pl.ConfigError, match="ops.profile_steps"):
        pl.config.validate_config(
            pl.apply_overrides(pl.PipelineConfig(), ["ops.profile_steps=3,1"])
        )


def test_tensorboard_scalars_when_a_writer_is_installed(tmp_path, monkeypatch):
    calls = []

    class SummaryWriter:
        def __init__(self, logdir):
            self.logdir = logdir

        def add_scalar(self, tag, value, global_step):
            calls.append((tag, value, global_step))

        def flush(self):
            pass

    monkeypatch.setitem(
        sys.modules, "tensorboardX", types.SimpleNamespace(SummaryWriter=SummaryWriter)
    )
    _fake_run(tmp_path, pl.OpsConfig(quiet=True, tensorboard=True), n=2)
    assert ("t/loss", 1.0, 0) in calls and ("t/loss", 1.0, 1) in calls


def test_tensorboard_is_skipped_cleanly_without_a_writer(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    monkeypatch.setitem(sys.modules, "torch", None)
    res, log = _fake_run(tmp_path, pl.OpsConfig(quiet=True, tensorboard=True), n=2)
    assert log.writer is None and res.iterations == 2
    assert "tensorboardX" in capsys.readouterr().err
    assert len([r for r in _records(log.path) if "step" in r]) == 2


@pytest.mark.slow
def test_sft_run_counts_six_flops_per_parameter_and_token(tmp_path):
    cfg = rx.TransformerConfig(
        vocab_size=512, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=64
    )
    policy = rx.Policy(cfg, key=jax.random.key(0))
    tok = rx.data.load_tokenizer(asset_path("tok512.bin"))
    ctx = pl.RunContext(
        ops=pl.OpsConfig(quiet=True),
        log=pl.tools.MetricsLog(str(tmp_path), "sft", quiet=True),
        key=jax.random.key(0),
        prompt_length=8,
        peak_flops=1e9,
    )
    sft = pl.SFTConfig(steps=1, batch_size=2, max_length=24, lora=pl.LoRASettings(rank=0))
    res = pl.runs.run_sft(
        policy, tok, [("Once", " upon a time"), ("The", " dog ran")], cfg=sft, ctx=ctx
    )
    (rec,) = res.history
    assert rec["model_flops"] == 6 * rx.count_params(policy) * 2 * 24 and rec["mfu"] > 0
