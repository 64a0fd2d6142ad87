"""The settings records of `rlhf_eqx.train`: one owner per setting.

Each record validates itself with one line naming the field, the value and the valid
range or choices; traced values pass (a step built from `DPOSettings(beta=b)` under
`jax.vmap`); keyword shortcuts build the same step as the record; and the command line's
`--set` values reach the records the builders receive (β, temperature, learning rate,
micro-batches)."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_tree_allclose
from test_train_common import CumMeanLM, leaves_equal, preference_batch, sequence_batch, sgd_delta

import rlhf_eqx as rx
from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main

T = rx.train


# --- each record validates itself ---------------------------------------------------------


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: T.StepOptions(micro_batches=0), "micro_batches=0: must be a positive int"),
        (
            lambda: T.StepOptions(nonfinite="ignore"),
            "nonfinite='ignore': must be one of skip, raise",
        ),
        (lambda: T.StepOptions(check_token_ids=-3), "check_token_ids=-3: must be a positive int"),
        (
            lambda: T.OptimizerSettings(learning_rate=-1e-3),
            "learning_rate=-0.001: must be > 0",
        ),
        (
            lambda: T.OptimizerSettings(learning_rate=math.inf),
            "learning_rate=inf: must be a finite number > 0",
        ),
        (
            lambda: T.OptimizerSettings(learning_rate=1e-3, warmup_ratio=1.0),
            "warmup_ratio=1.0: must be in [0, 1)",
        ),
        (
            lambda: T.OptimizerSettings(learning_rate=1e-3, schedule="step"),
            "schedule='step': must be one of cosine, constant, linear",
        ),
        (
            lambda: T.OptimizerSettings(learning_rate=1e-3, max_grad_norm=0.0),
            "max_grad_norm=0.0: must be > 0",
        ),
        (
            lambda: T.SFTSettings(mode="mean"),
            "mode='mean': must be one of token-mean, seq-mean-token-mean, seq-mean-token-sum, "
            "seq-mean-token-sum-norm",
        ),
        (
            lambda: T.SFTSettings(constant=3.0),
            "constant=3.0: only used by mode='seq-mean-token-sum-norm' (mode='token-mean')",
        ),
        (lambda: T.RewardSettings(center_coef=-1.0), "center_coef=-1.0: must be >= 0"),
        (lambda: T.DPOSettings(beta=-0.1), "beta=-0.1: must be > 0"),
        (lambda: T.DPOSettings(beta=0.0), "beta=0.0: must be > 0"),
        (lambda: T.DPOSettings(label_smoothing=0.5), "label_smoothing=0.5: must be in [0, 0.5)"),
        (
            lambda: T.DPOSettings(reference="ref"),
            "reference='ref': must be one of model, cached, none",
        ),
        (
            lambda: T.DPOSettings(loss_type="sigmod"),
            "loss_type='sigmod': unknown loss_type 'sigmod'; expected one of 'sigmoid'",
        ),
        (lambda: T.PPOSettings(clip_eps=0.0), "clip_eps=0.0: must be > 0"),
        (lambda: T.PPOSettings(dual_clip=1.0), "dual_clip=1.0: must be > 1"),
        (lambda: T.PPOSettings(vf_coef=-0.5), "vf_coef=-0.5: must be >= 0"),
        (lambda: T.PPOSettings(temperature=0.0), "temperature=0.0: must be > 0"),
        (lambda: T.GRPOSettings(group_size=0), "group_size=0: must be a positive int"),
        (
            lambda: T.GRPOSettings(group_size=2, scale="std"),
            "scale='std': must be one of group, batch, none",
        ),
        (lambda: T.GRPOSettings(group_size=2, beta=-1.0), "beta=-1.0: must be >= 0"),
        (lambda: T.GRPOSettings(group_size=2, delta=1.0), "delta=1.0: must be > 1"),
        (
            lambda: T.GRPOSettings(group_size=2, policy_loss="ppo"),
            "policy_loss='ppo': must be one of grpo, cispo, gmpo, sapo, clip_cov, kl_cov, "
            "high_entropy",
        ),
        (
            lambda: T.GRPOSettings(group_size=2, clip_cov_low=5.0, clip_cov_high=1.0),
            "clip_cov_low=5.0: must be below clip_cov_high=1.0",
        ),
        (
            lambda: T.GRPOSettings(group_size=2, policy_loss="cispo", importance="sequence"),
            "importance='sequence': applies to policy_loss 'grpo' and 'high_entropy' only",
        ),
    ],
)
def test_each_record_refuses_a_bad_value_in_one_line(build, message):
    with pytest.raises(ValueError) as info:
        build()
    text = str(info.value)
    assert text.startswith(message) and "\n" not in text


def test_records_are_frozen_and_hold_the_only_defaults():
    ppo, grpo = T.PPOSettings(), T.GRPOSettings(group_size=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ppo.vf_coef = 1.0  # pyright: ignore
    assert (ppo.vf_coef, ppo.ent_coef, ppo.clip_eps, ppo.vf_clip_eps) == (0.5, 0.01, 0.2, 0.2)
    assert grpo.beta == 0.0  # TRL's GRPOConfig default
    assert ppo.temperature == grpo.temperature == T.SampledSettings().temperature == 1.0
    assert T.OptimizerSettings(learning_rate=1e-3).warmup_ratio == 0.0
    # the pipeline's stage configs are the records: same defaults
    assert pl.PPOConfig().vf_coef == ppo.vf_coef and pl.PPOConfig().ent_coef == ppo.ent_coef
    assert pl.GRPOConfig().beta == grpo.beta and pl.DPOConfig().beta == T.DPOSettings().beta
    assert isinstance(pl.DPOConfig(), T.DPOSettings) and isinstance(pl.SFTConfig(), T.SFTSettings)


def test_arrays_are_accepted_unchecked():
    # a JAX array's value is not known while tracing: the record takes it as it is
    s = T.DPOSettings(beta=jnp.asarray(-1.0), label_smoothing=jnp.asarray(0.7))
    assert isinstance(s.beta, jax.Array)
    T.OptimizerSettings(learning_rate=jnp.asarray(2e-3), weight_decay=jnp.asarray(0.1))
    T.GRPOSettings(group_size=2, clip_cov_low=jnp.asarray(9.0), clip_cov_high=1.0)
    T.PPOSettings(clip_eps=jnp.asarray(0.1), vf_coef=jnp.asarray(0.3))


# --- shortcuts and records build the same step -------------------------------------------


def test_unknown_keyword_is_a_type_error_naming_the_fields():
    opt = optax.sgd(1.0)
    with pytest.raises(TypeError, match=r"\['bta'\].*beta, loss_type.*micro_batches"):
        T.make_dpo_step(opt, bta=0.1)
    with pytest.raises(TypeError, match=r"\['clip'\].*clip_eps, clip_eps_high"):
        T.make_ppo_step(opt, clip=0.2)
    with pytest.raises(TypeError, match=r"\['lr'\].*learning_rate, warmup_ratio"):
        T.make_optimizer(lr=1e-3, total_steps=10)
    with pytest.raises(TypeError, match=r"\['temperature'\].*micro_batches"):
        T.make_step(lambda *a: None, opt, temperature=1.0)
    # a record of another step (the shape checker, when on, names it first)
    with pytest.raises(TypeError, match="settings"):
        T.make_dpo_step(opt, T.PPOSettings())  # pyright: ignore
    with pytest.raises((ValueError, TypeError), match="rollout_correction"):
        T.GRPOSettings(group_size=2, rollout_correction="token")  # pyright: ignore


def test_dpo_shortcuts_equal_the_record_and_replace_its_fields(getkey):
    policy = CumMeanLM(getkey())
    batch = T.compute_reference_logps(policy, preference_batch(getkey(), B=4))
    opt = optax.sgd(1.0)
    record = T.DPOSettings(beta=0.3, loss_type="ipo", reference="cached")
    options = T.StepOptions(micro_batches=2, donate=False)
    a = sgd_delta(T.make_dpo_step(opt, record, options=options), policy, batch)
    b = sgd_delta(
        T.make_dpo_step(
            opt, beta=0.3, loss_type="ipo", reference="cached", micro_batches=2, donate=False
        ),
        policy,
        batch,
    )
    # a shortcut next to a record replaces that field
    c = sgd_delta(
        T.make_dpo_step(opt, dataclasses.replace(record, beta=0.9), beta=0.3, options=options),
        policy,
        batch,
    )
    for other in (b, c):
        assert leaves_equal(a, other)  # bit-identical: deltas and metrics


def test_sft_and_grpo_shortcuts_equal_the_record(getkey):
    policy = CumMeanLM(getkey())
    seqs = sequence_batch(getkey(), B=4)
    opt = optax.sgd(1.0)
    record = T.SFTSettings(mode="seq-mean-token-sum-norm", constant=7.0)
    a = sgd_delta(T.make_sft_step(opt, record), policy, seqs)
    b = sgd_delta(T.make_sft_step(opt, mode="seq-mean-token-sum-norm", constant=7.0), policy, seqs)
    assert leaves_equal(a, b)
    batch = T.GRPOBatch(
        tokens=seqs.tokens,
        mask=seqs.mask,
        completion_mask=seqs.completion_mask,
        rewards=jnp.asarray([1.0, 0.0, 0.5, 2.0]),
    )
    record = T.GRPOSettings(group_size=2, clip_eps=0.1, scale="none", policy_loss="gmpo")
    a = sgd_delta(T.make_grpo_step(opt, record), policy, batch)
    b = sgd_delta(
        T.make_grpo_step(opt, group_size=2, clip_eps=0.1, scale="none", policy_loss="gmpo"),
        policy,
        batch,
    )
    assert leaves_equal(a, b)


def test_optimizer_from_the_record_equals_the_keywords():
    s = T.OptimizerSettings(learning_rate=3e-3, warmup_ratio=0.25, schedule="linear")
    a = T.make_schedule(s, total_steps=8)
    b = T.make_schedule(learning_rate=3e-3, warmup_ratio=0.25, schedule="linear", total_steps=8)
    steps = jnp.arange(9)
    np.testing.assert_array_equal(np.asarray(jax.vmap(a)(steps)), np.asarray(jax.vmap(b)(steps)))
    params = {"w": jnp.ones((3, 3))}
    grads = {"w": jnp.full((3, 3), 0.5)}
    out = []
    for opt in (
        T.make_optimizer(s, total_steps=8),
        T.make_optimizer(total_steps=8, **dataclasses.asdict(s)),
    ):
        with jax.numpy_dtype_promotion("standard"):  # optax's own arithmetic
            state = opt.init(params)
            for _ in range(3):  # into the schedule: warmup, then the decay
                updates, state = opt.update(grads, state, params)
        out.append((updates, T.learning_rate_from_state(state)))
    assert leaves_equal(out[0], out[1])
    np.testing.assert_allclose(float(out[0][1]), float(a(2)), rtol=1e-6)


# --- traced values ---------------------------------------------------------------------------


def test_vmap_over_beta_of_a_step_built_from_the_record(getkey):
    """`DPOSettings(beta=b)` with `b` traced under `jax.vmap`: one step per β, equal to the
    steps built from Python floats."""
    policy = CumMeanLM(getkey())
    batch = T.compute_reference_logps(policy, preference_batch(getkey(), B=4))
    betas = jnp.asarray([0.05, 0.8], jnp.float32)
    opt = optax.sgd(1.0)

    def one(beta):
        step = T.make_dpo_step(opt, T.DPOSettings(beta=beta, reference="cached"), donate=False)
        return sgd_delta(step, policy, batch)

    deltas, metrics = jax.vmap(one)(betas)
    for i, beta in enumerate((0.05, 0.8)):
        step = T.make_dpo_step(opt, T.DPOSettings(beta=beta, reference="cached"), donate=False)
        want, m = sgd_delta(step, policy, batch)
        assert_tree_allclose(jax.tree.map(lambda x: x[i], deltas), want, rtol=1e-5, atol=1e-7)
        for name in ("loss", "rewards/margins", "grad_norm"):
            np.testing.assert_allclose(float(metrics[name][i]), float(m[name]), rtol=1e-5)
    # the policy is its own reference: the loss is ln 2 for every β, the gradient ∝ β
    np.testing.assert_allclose(np.asarray(metrics["loss"]), math.log(2.0), rtol=1e-6)
    ratio = float(metrics["grad_norm"][1] / metrics["grad_norm"][0])
    np.testing.assert_allclose(ratio, 0.8 / 0.05, rtol=1e-4)


# --- the command line reaches the records ---------------------------------------------------


class _Built(Exception):
    """Raised after the real builder ran: the run stops before compiling anything."""


def _capture(monkeypatch, name, *, stop=False):
    """Wrap `rx.train.<name>`: record the arguments of every call, then call it."""
    real, calls = getattr(T, name), []

    def wrapper(*args, **kwargs):
        calls.append((args, kwargs))
        out = real(*args, **kwargs)
        if stop:
            raise _Built(name)
        return out

    monkeypatch.setattr(T, name, wrapper)
    return calls


def _pairs(path):
    with open(path, "w") as f:
        for i in range(8):
            rec = {"prompt": f"The cat {i}", "chosen": " sat on a mat.", "rejected": " zz."}
            f.write(json.dumps(rec) + "\n")


def _prompts(path):
    with open(path, "w") as f:
        for i in range(8):
            f.write(json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}) + "\n")


def _argv(command, data, out, sets):
    argv = [command, "--data", str(data), "--out", str(out), "--quiet"]
    for s in ("data.heldout_fraction=0.25", "ops.monitor=false", *sets):
        argv += ["--set", s]
    return argv


_DPO_SETS = (
    "dpo.steps=2",
    "dpo.batch_size=2",
    "dpo.max_length=24",
    "sampling.prompt_length=8",
    "dpo.beta=0.3",
    "dpo.options.micro_batches=2",
    "dpo.optim.learning_rate=0.003",
)


def test_cli_beta_learning_rate_and_micro_batches_reach_the_dpo_step(tmp_path, monkeypatch):
    _pairs(tmp_path / "pairs.jsonl")
    opts = _capture(monkeypatch, "make_optimizer")
    steps = _capture(monkeypatch, "make_dpo_step", stop=True)
    with pytest.raises(_Built):
        main(_argv("dpo", tmp_path / "pairs.jsonl", tmp_path / "run", _DPO_SETS))
    ((args, kwargs),) = steps
    settings, options = args[1], kwargs["options"]
    assert isinstance(settings, T.DPOSettings) and settings.beta == 0.3
    assert settings.reference == "cached" and options == T.StepOptions(
        micro_batches=2, donate=False
    )
    ((args, kwargs),) = opts
    assert isinstance(args[0], T.OptimizerSettings) and args[0].learning_rate == 0.003


def test_cli_sampling_temperature_reaches_the_grpo_step(tmp_path, monkeypatch):
    _prompts(tmp_path / "prompts.jsonl")
    steps = _capture(monkeypatch, "make_grpo_step", stop=True)
    sets = (
        "grpo.rollouts=1",
        "grpo.prompts_per_rollout=2",
        "grpo.group_size=2",
        "grpo.beta=0.07",
        "grpo.options.micro_batches=2",
        "sampling.prompt_length=16",
        "sampling.max_new_tokens=4",
        "sampling.temperature=0.7",
    )
    with pytest.raises(_Built):
        main(_argv("grpo", tmp_path / "prompts.jsonl", tmp_path / "run", sets))
    ((args, kwargs),) = steps
    settings = args[1]
    assert isinstance(settings, T.GRPOSettings)
    assert (settings.temperature, settings.beta, settings.group_size) == (0.7, 0.07, 2)
    assert kwargs["options"].micro_batches == 2
    # the temperature has one owner: the stage's own field is not a setting
    with pytest.raises(pl.ConfigError, match="grpo.temperature: .*set sampling.temperature"):
        pl.apply_overrides(pl.PipelineConfig(), ["grpo.temperature=0.7"])


@pytest.mark.slow
def test_cli_learning_rate_is_the_logged_rate_of_the_micro_batched_dpo_step(tmp_path):
    _pairs(tmp_path / "pairs.jsonl")
    sets = (*_DPO_SETS, "dpo.optim.schedule=constant", "dpo.optim.warmup_ratio=0")
    assert main(_argv("dpo", tmp_path / "pairs.jsonl", tmp_path / "run", sets)) == 0
    records = pl.tools.read_metrics(str(tmp_path / "run"))["dpo"]
    assert [r["step"] for r in records] == [0, 1]
    for r in records:  # the peak rate, in float32, times a rollback factor of 1
        assert r["learning_rate"] == pytest.approx(0.003, rel=1e-6) and r["lr_scale"] == 1.0
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["dpo"]["options"]["micro_batches"] == 2
    assert config["dpo"]["optim"]["learning_rate"] == 0.003 and config["dpo"]["beta"] == 0.3


# --- the logged learning rate is the applied one ---------------------------------------------


def test_after_a_rollback_the_logged_learning_rate_includes_its_factor(tmp_path):
    """A constant rate of 100 overshoots `cosh(w - 1)` (non-finite, then a spike): two
    rollbacks divide the factor by 100, and every step record logs the rate it applied,
    the schedule's times the factor."""

    def loss_fn(params, frozen, batch, key):
        del frozen, batch, key
        return {"f": jnp.sum(jnp.cosh(params["w"] - 1.0))}, {"f": jnp.ones(())}, {}

    opt = pl.runs.build_optimizer(
        T.OptimizerSettings(learning_rate=100.0, schedule="constant", max_grad_norm=None), 8
    )
    step = T.make_step(loss_fn, opt, donate=False)
    state = T.init_train_state({"w": jnp.zeros((2,), jnp.float32)}, opt)

    def iteration(state, key, i):
        state, metrics = state.apply(step, jnp.zeros((1,)), key=key)
        return state, [metrics], {}

    log = pl.tools.MetricsLog(str(tmp_path), "q", quiet=True)
    res = pl.loop.run_iterations(
        state,
        iteration,
        num_iterations=4,
        key=jax.random.key(0),
        ops=pl.OpsConfig(quiet=True),
        log=log,
    )
    assert res.stopped == "done" and res.rollbacks == 2
    with open(log.path) as f:
        steps = [r for r in map(json.loads, f) if "learning_rate" in r]
    # iterations rerun after each rollback are logged again, with the factor then in force
    assert [r["iteration"] for r in steps][-4:] == [0, 1, 2, 3]
    assert sorted({r["lr_scale"] for r in steps}) == pytest.approx([0.01, 0.1, 1.0])
    for r in steps:
        assert r["learning_rate"] == pytest.approx(100.0 * r["lr_scale"], rel=1e-6)
    assert steps[-1]["learning_rate"] == pytest.approx(1.0, rel=1e-6)
