"""GRPO with the trainer and the sampler on disjoint meshes (`grpo.placement=split`): the
same run as on one device, the weight transfer timed and limited to the LoRA adapters,
and the placement settings checked. Runs on the eight simulated CPU devices that
tests/conftest.py sets up (`XLA_FLAGS=--xla_force_host_platform_device_count=8` before
JAX is imported)."""

import dataclasses

import equinox as eqx
import jax
import numpy as np
import pytest
from helpers import assert_same_saved_params, kill_9_then_resume

import rlhf_eqx as rx
from rlhf_eqx import pipelines as pl

_PROMPTS = [f"Once upon a time {i}" for i in range(12)]
_PARITY = [pl.runs.RewardFunction("parity", lambda p, t: float(len(t) % 2))]
_TIMING = (
    "stage",
    "time",
    "iteration_time_s",
    "tokens_per_s",
    "rollout/overlapped",
    "rollout/queued",
)
_GENERATE = rx.generate_batch
_SYNC = ("rollout/weight_sync_s", "rollout/weight_sync_bytes", "rollout/base_transfers")


def _need_8():
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")


@pytest.fixture(scope="module")
def builtin():
    return pl.tools.load_model("builtin")


def _cfg(**changes):
    cfg = pl.animal_task_config().grpo
    optim = dataclasses.replace(cfg.optim, warmup_ratio=0.0)  # the first update moves
    defaults = dict(rollouts=3, prompts_per_rollout=4, group_size=2, optim=optim)
    return dataclasses.replace(cfg, **dict(defaults, **changes))


def _grpo(builtin, tmp_path, name, monkeypatch, **changes):
    """The run, its metric records and each rollout's sampled tokens with their devices."""
    policy, tok = builtin
    seen = []
    sampler = _GENERATE

    def spy(model, *args, **kw):
        out = sampler(model, *args, **kw)
        seen.append((np.asarray(out.tokens), set(out.tokens.devices())))
        return out

    monkeypatch.setattr(rx, "generate_batch", spy)
    log = pl.tools.MetricsLog(str(tmp_path), name, quiet=True)
    ctx = pl.RunContext(
        ops=pl.OpsConfig(monitor=False, quiet=True),
        log=log,
        key=jax.random.key(0),
        checkpoint_dir=None,
        prompt_length=16,
        max_new_tokens=8,
    )
    res = pl.runs.run_grpo(policy, tok, _PROMPTS, reward=_PARITY, cfg=_cfg(**changes), ctx=ctx)
    records = [r for r in pl.tools.read_records(str(tmp_path)) if r.get("stage") == name]
    return res, [r for r in records if "step" in r], seen


def _same_numbers(a, b, atol):
    for (ta, _), (tb, _) in zip(a[2], b[2], strict=True):
        np.testing.assert_array_equal(ta, tb)  # the same sampled tokens
    # Adam's normalised steps (learning rate 2e-3) magnify the reassociated sums of FSDP
    for x, y in zip(jax.tree.leaves(a[0].state.params), jax.tree.leaves(b[0].state.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=0)
    strip = lambda recs: [  # noqa: E731
        {k: v for k, v in r.items() if k not in _TIMING + _SYNC} for r in recs
    ]
    for ra, rb in zip(strip(a[1]), strip(b[1]), strict=True):
        assert ra.keys() == rb.keys()
        for key in ra:
            np.testing.assert_allclose(ra[key], rb[key], rtol=1e-3, atol=1e-4, err_msg=key)


def _trainable_bytes(res) -> int:
    arrays = [x for x in jax.tree.leaves(res.state.params) if eqx.is_array(x)]
    return sum(x.size * x.dtype.itemsize for x in arrays)


@pytest.mark.slow
@pytest.mark.parametrize(
    "trainer, sampler, trainer_mesh, sampler_mesh, prompts",
    [(4, 4, "fsdp:4", "data:4", 4), (2, 6, "fsdp:2", "data:6", 6)],
)
def test_split_placement_trains_the_colocated_numbers(
    builtin, tmp_path, monkeypatch, trainer, sampler, trainer_mesh, sampler_mesh, prompts
):
    """Trainer FSDP on the first devices, the sampler data parallel on the others,
    staleness 1 with the next rollout sampled during the update: the sampled tokens are
    the colocated run's, the parameters equal to float tolerance; every rollout is
    sampled on the sampler's devices; after each update only the LoRA adapters move
    (the base is placed on the sampler once) and the transfer is timed."""
    _need_8()
    kw = dict(staleness=1, prompts_per_rollout=prompts)
    split = _grpo(
        builtin,
        tmp_path,
        "split",
        monkeypatch,
        placement="split",
        trainer_devices=float(trainer),
        sampler_devices=float(sampler),
        trainer_mesh=trainer_mesh,
        sampler_mesh=sampler_mesh,
        **kw,
    )
    colocated = _grpo(builtin, tmp_path, "colocated", monkeypatch, **kw)
    _same_numbers(split, colocated, atol=1e-4)
    devices = jax.devices()
    assert [d for _, d in split[2]] == [set(devices[trainer : trainer + sampler])] * 3
    params = split[0].state.params
    first = next(x for x in jax.tree.leaves(params) if eqx.is_array(x))
    assert set(first.devices()) == set(devices[:trainer])
    # the trainable LoRA adapters move after each update, the base never again
    adapters = _trainable_bytes(split[0])
    frozen = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(split[0].state.frozen))
    assert adapters < frozen / 4  # rank-8 adapters of a small model
    assert [r["rollout/base_transfers"] for r in split[1]] == [1.0] * 3
    # rollout 0 is sampled by the initial policy; each iteration moves the next one's
    assert [r["rollout/weight_sync_bytes"] for r in split[1]] == [adapters] * 2 + [0.0]
    assert all(r["rollout/weight_sync_s"] > 0 for r in split[1][:2])
    assert all(k not in r for r in colocated[1] for k in _SYNC)


@pytest.mark.slow
def test_split_placement_synchronous_full_fine_tuning(builtin, tmp_path, monkeypatch):
    """Without LoRA every parameter moves after each update (staleness 0: the rollout of
    iteration r is sampled by the policy of update r - 1), and the run is the
    colocated one."""
    _need_8()
    base = pl.animal_task_config().grpo
    lora = dataclasses.replace(base.lora, rank=0)
    optim = dataclasses.replace(base.optim, learning_rate=1e-4, warmup_ratio=0.0)
    split = _grpo(
        builtin,
        tmp_path,
        "split_full",
        monkeypatch,
        lora=lora,
        optim=optim,
        rollouts=2,
        placement="split",
        trainer_devices=0.5,
        sampler_devices=0.5,
        sampler_mesh="data:2,model:2",
    )
    colocated = _grpo(
        builtin, tmp_path, "colocated_full", monkeypatch, lora=lora, optim=optim, rollouts=2
    )
    _same_numbers(split, colocated, atol=1e-4)
    everything = _trainable_bytes(split[0])
    assert [r["rollout/weight_sync_bytes"] for r in split[1]] == [everything] * 2


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(placement="apart"), r"grpo.placement='apart': must be one of colocated, split"),
        (
            dict(placement="split", sampler_devices=6.0, trainer_devices=4.0),
            r"grpo.sampler_devices=6.0: 6 sampler \+ 4 trainer devices .* must fit in the 8",
        ),
        (
            dict(placement="split", trainer_devices=0.0),
            r"grpo.trainer_devices=0.0: must be a device",
        ),
        (
            dict(placement="split", sampler_devices=2.5),
            r"grpo.sampler_devices=2.5: must be a whole number",
        ),
        (
            dict(placement="split", sampler_devices=0.05),
            r"grpo.sampler_devices=0.05: must be at least one of the 8",
        ),
        (
            dict(placement="split", trainer_mesh="fsdp:2"),
            r"grpo.trainer_mesh='fsdp:2': must span the 4 device\(s\) assigned to it, not 2",
        ),
        (
            dict(placement="split", sampler_mesh="data:2,fsdp:2"),
            r"grpo.sampler_mesh='data:2,fsdp:2': must name data or fsdp, not both",
        ),
        (dict(placement="split", sampler_mesh="pipe:4"), r"grpo.sampler_mesh='pipe:4': must be"),
        (
            dict(trainer_mesh="fsdp:4"),
            r"grpo.trainer_mesh='fsdp:4': must be empty unless grpo.placement=split",
        ),
        (
            dict(placement="split", sampler_device=1),
            r"grpo.sampler_device=1: must stay -1 with grpo.placement=split",
        ),
    ],
)
def test_bad_placements_are_refused(changes, message):
    _need_8()
    cfg = pl.apply_overrides(pl.animal_task_config(), [])
    bad = dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, **changes))
    with pytest.raises(pl.ConfigError, match=message):
        pl.config.validate_stage("grpo", bad.grpo)


def test_placement_settings_from_the_command_line():
    """The split settings parse from `--set` overrides (counts and fractions)."""
    _need_8()
    cfg = pl.apply_overrides(
        pl.animal_task_config(),
        [
            "grpo.placement=split",
            "grpo.trainer_devices=2",
            "grpo.sampler_devices=0.75",
            "grpo.trainer_mesh=fsdp:2",
            "grpo.sampler_mesh=data:3,model:2",
        ],
    )
    assert cfg.grpo.placement == "split" and cfg.grpo.sampler_devices == 0.75
    pl.config.validate_stage("grpo", cfg.grpo)


@pytest.mark.slow
def test_sampler_runs_staleness_rollouts_ahead(builtin, tmp_path, monkeypatch):
    """Split placement with staleness 2: the sampler keeps up to two rollouts queued
    (rollout r + j samples with the policy of update r + j - 2, known before update r),
    and the run is the one that samples each rollout when its iteration starts."""
    _need_8()
    kw = dict(staleness=2, rollouts=4, placement="split", trainer_mesh="fsdp:4")
    ahead = _grpo(builtin, tmp_path, "ahead", monkeypatch, **kw)
    assert [r["rollout/queued"] for r in ahead[1]] == [2.0, 2.0, 1.0, 0.0]
    assert [r["rollout/overlapped"] for r in ahead[1]] == [0.0, 1.0, 1.0, 1.0]
    inline = _grpo(builtin, tmp_path, "inline", monkeypatch, overlap=False, **kw)
    _same_numbers(ahead, inline, atol=0.0)


@pytest.mark.slow
def test_kill_9_with_queued_rollouts_then_resume_is_exact(tmp_path):
    """A split, staleness-2 run killed with SIGKILL once its second checkpoint exists
    (two rollouts queued on the sampler) resumes from the checkpoint's stale policies,
    samples the queued rollouts again and ends with the uninterrupted run's parameters."""
    _need_8()
    changes = dict(staleness=2, placement="split", trainer_mesh="fsdp:4")
    full, cut = kill_9_then_resume(tmp_path, changes)
    events = [r for r in pl.tools.read_records(str(cut)) if r.get("event")]
    assert [r["iteration"] for r in events if r["event"] == "resume"][0] >= 2
    assert_same_saved_params(full, cut)
