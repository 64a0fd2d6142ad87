"""Compilation where a user waits for it: equal step builds share one compiled program,
the decoder's program does not grow with depth, and the command line keeps compiled
programs on disk between runs (`ops.compilation_cache`)."""

import json
import logging
import os
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_train_common import CumMeanLM, counted, sequence_batch, traces

import rlhf_eqx as rx
from rlhf_eqx.train import (
    GRPOBatch,
    GRPOSettings,
    OptimizerSettings,
    StepOptions,
    init_train_state,
    make_grpo_step,
    make_optimizer,
    make_sft_step,
    make_step,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _grpo_batch(key, policy, B=4):
    s = sequence_batch(key, B=B, T=10)
    old = jax.vmap(lambda t, m: rx.token_logprobs(policy, t, m))(s.tokens, s.mask)
    rewards = jnp.asarray([1.0, 0.0, 0.5, 2.0][:B])
    return GRPOBatch(
        tokens=s.tokens, mask=s.mask, completion_mask=s.completion_mask, rewards=rewards,
        old_logp=old,
    )  # fmt: skip


def _optimizer(lr=1e-2):
    return make_optimizer(OptimizerSettings(learning_rate=lr), total_steps=10)


# --- equal builds share one program ----------------------------------------------------


def test_make_optimizer_returns_one_object_for_equal_settings():
    assert _optimizer(1e-2) is _optimizer(1e-2)
    assert make_optimizer(learning_rate=1e-2, total_steps=10) is _optimizer(1e-2)
    assert _optimizer(1e-2) is not _optimizer(2e-2)
    assert _optimizer(1e-2) is not make_optimizer(learning_rate=1e-2, total_steps=11)
    # an array in the settings (e.g. a learning rate to vmap over) builds a new one
    lr = jnp.asarray(1e-2)
    assert make_optimizer(learning_rate=lr, total_steps=10) is not make_optimizer(
        learning_rate=lr, total_steps=10
    )


def test_equal_grpo_builds_trace_once_and_a_new_setting_traces_again(getkey):
    base = CumMeanLM(getkey())
    batch = _grpo_batch(getkey(), base)
    policy = counted(base)
    settings = GRPOSettings(group_size=2, beta=0.0)

    def run(step, entropy_coef=None):
        state = init_train_state(policy, _optimizer())
        state, metrics = state.apply(step, batch, entropy_coef=entropy_coef)
        return state, metrics

    _, m1 = run(make_grpo_step(_optimizer(), settings, options=StepOptions(donate=False)))
    once = traces(policy)
    assert once > 0
    # a second build from equal records (and the keyword-shortcut spelling): no trace
    _, m2 = run(make_grpo_step(_optimizer(), GRPOSettings(group_size=2), donate=False))
    assert traces(policy) == once
    assert m1 == m2
    # a different setting is a different program: it traces
    _, m3 = run(make_grpo_step(_optimizer(), settings, clip_eps=0.3, donate=False))
    assert traces(policy) == 2 * once
    # a different optimiser too
    opt = make_optimizer(OptimizerSettings(learning_rate=2e-2), total_steps=10)
    make_grpo_step(opt, settings, donate=False)(
        eqx.filter(policy, eqx.is_inexact_array), opt.init(eqx.filter(policy, eqx.is_array)), batch
    )
    assert traces(policy) == 3 * once


def test_traced_hyperparameters_still_work(getkey):
    """A step's traced scalar (`entropy_coef`) takes new values without a trace; a step
    built inside `jax.jit` from a traced `beta` is not cached and gives the eager step's
    numbers."""
    policy, ref = CumMeanLM(getkey()), CumMeanLM(getkey())
    batch = _grpo_batch(getkey(), policy)
    opt = _optimizer()
    params = eqx.filter(policy, eqx.is_inexact_array)
    opt_state = opt.init(params)
    state = init_train_state(counted(policy), opt)
    step = make_grpo_step(opt, group_size=2, donate=False)
    losses = [state.apply(step, batch, entropy_coef=jnp.asarray(0.0))[1]["loss"]]
    once = traces(state.params)
    for c in (0.01, 0.5):
        losses.append(state.apply(step, batch, entropy_coef=jnp.asarray(c))[1]["loss"])
    assert traces(state.params) == once
    assert losses[0] != losses[2]

    @eqx.filter_jit
    def with_beta(beta):
        s = make_grpo_step(opt, group_size=2, beta=beta, donate=False)
        return s(params, opt_state, batch, reference=ref)[2]["loss"]

    for beta in (0.05, 0.5):
        eager = make_grpo_step(opt, group_size=2, beta=beta, donate=False)
        want = eager(params, opt_state, batch, reference=ref)[2]["loss"]
        np.testing.assert_allclose(with_beta(jnp.asarray(beta)), want, rtol=1e-5, atol=1e-7)


def _plain_loss(params, frozen, batch, key):
    del key
    model = eqx.combine(params, frozen)
    logp = jax.vmap(lambda t, m: rx.token_logprobs(model, t, m))(batch.tokens, batch.mask)
    m = batch.completion_mask & batch.mask
    return {"nll": -jnp.sum(jnp.where(m, logp, 0.0))}, {"nll": jnp.sum(m)}, {}


def test_make_step_shares_plain_functions_and_keys_never_closures(getkey):
    model = counted(CumMeanLM(getkey()))
    params, frozen = eqx.partition(model, eqx.is_inexact_array)
    batch = sequence_batch(getkey())
    opt = _optimizer()
    opt_state = opt.init(params)

    def run(step):
        step(params, opt_state, batch, frozen=frozen)
        return traces(model)

    once = run(make_step(_plain_loss, opt))
    assert run(make_step(_plain_loss, opt)) == once  # a module-level function: shared
    closure = lambda *a: _plain_loss(*a)  # noqa: E731 - may capture anything: not shared
    assert run(make_step(closure, opt)) == 2 * once
    assert run(make_step(lambda *a: _plain_loss(*a), opt, cache_key="nll")) == 3 * once
    assert run(make_step(lambda *a: _plain_loss(*a), opt, cache_key="nll")) == 3 * once
    assert run(make_step(_plain_loss, opt, micro_batches=2)) > 3 * once  # new options


def test_equal_sft_builds_share_their_program(getkey):
    model = counted(CumMeanLM(getkey()))
    batch = sequence_batch(getkey())
    for n in range(3):
        state = init_train_state(model, _optimizer())
        state.apply(make_sft_step(_optimizer(), mode="token-mean"), batch)
        if n == 0:
            once = traces(model)
    assert traces(model) == once


# --- the decoder's program does not grow with depth -----------------------------------


def _hlo_ops(n_layers: int) -> int:
    cfg = rx.TransformerConfig(
        vocab_size=64, d_model=16, n_layers=n_layers, n_heads=2, n_kv_heads=1, d_ff=32,
        max_seq_len=16,
    )  # fmt: skip
    policy = rx.Policy(cfg, key=jax.random.key(0))
    tokens = jnp.zeros((2, 8), jnp.int32)
    mask = jnp.ones((2, 8), bool)

    def loss(p):
        return jnp.sum(jax.vmap(lambda t, m: rx.token_logprobs(p, t, m))(tokens, mask))

    text = eqx.filter_jit(eqx.filter_grad(loss)).lower(policy).as_text()
    return sum(1 for line in text.splitlines() if " = " in line)


def test_decoder_program_size_does_not_grow_with_depth():
    """The layers run as one `lax.scan`: 30 layers lower to the program of 2 (the weights
    are stacked), so compile time stays flat in depth."""
    two, thirty = _hlo_ops(2), _hlo_ops(30)
    assert thirty <= two * 1.05 + 5, (two, thirty)


# --- the persistent compilation cache -------------------------------------------------


def test_enable_compilation_cache_checks_its_arguments(tmp_path):
    with pytest.raises(ValueError, match="max_mb=0"):
        rx.enable_compilation_cache(str(tmp_path), max_mb=0)
    with pytest.raises(ValueError, match="min_compile_time_s=-1"):
        rx.enable_compilation_cache(str(tmp_path), min_compile_time_s=-1.0)


_COUNT = """
import json, runpy, sys
import jax.monitoring as mon
counts = {"hits": 0, "misses": 0}
def on(event, **kw):
    if event == "/jax/compilation_cache/cache_hits": counts["hits"] += 1
    if event == "/jax/compilation_cache/cache_misses": counts["misses"] += 1
mon.register_event_listener(on)
sys.argv = ["rlhf_eqx", *sys.argv[1:]]
from rlhf_eqx.__main__ import main
code = main(sys.argv[1:])
print("COUNTS " + json.dumps(counts))
sys.exit(code)
"""


def _cli(args, home, **env):
    """A command-line run in a fresh process whose user cache directory is `home`: the
    test suite's own JAX cache settings are not passed on."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "RLHF_EQX_"))}
    e.update(XDG_CACHE_HOME=str(home), PYTHONPATH=ROOT, **env)
    e["XLA_FLAGS"] = ""  # the CLI's own compilation (the tests' fast flags aside)
    out = subprocess.run(
        [sys.executable, "-c", _COUNT, *args], env=e, capture_output=True, text=True, cwd=ROOT,
        timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("COUNTS ")][-1]
    return json.loads(line[len("COUNTS ") :])


def _entries(directory) -> int:
    if not os.path.isdir(directory):
        return 0
    return sum(1 for name in os.listdir(directory) if name.endswith("-cache"))


SAMPLE = ["sample", "--prompt", "Once upon a time", "-n", "2", "--set", "sampling.max_new_tokens=8"]


@pytest.mark.slow
def test_command_line_writes_then_reads_the_cache(tmp_path):
    cache = tmp_path / "rlhf_eqx" / "jax"
    first = _cli(SAMPLE, tmp_path)
    written = _entries(cache)
    assert written > 0 and first["hits"] == 0, (first, written)
    second = _cli(SAMPLE, tmp_path)
    assert second["hits"] >= written and second["misses"] < first["misses"], (first, second)
    assert _entries(cache) == written


@pytest.mark.slow
@pytest.mark.parametrize(
    "how", [{"RLHF_EQX_COMPILATION_CACHE": "0"}, {"set": "ops.compilation_cache=false"}]
)
def test_command_line_cache_switched_off_writes_nothing(tmp_path, how):
    args = SAMPLE + (["--set", how.pop("set")] if "set" in how else [])
    counts = _cli(args, tmp_path, **how)
    assert counts["hits"] == 0
    assert not (tmp_path / "rlhf_eqx").exists()


# --- a command-line run compiles each program once ------------------------------------


class _Programs(logging.Handler):
    """Counts `Compiling <name> with global shapes and types <shapes>` records."""

    def __init__(self):
        super().__init__()
        self.built: dict[str, int] = {}

    def emit(self, record):
        msg = record.getMessage()
        if msg.startswith("Compiling "):
            key = msg.split(". Argument mapping")[0]
            self.built[key] = self.built.get(key, 0) + 1


@pytest.mark.slow
def test_grpo_command_compiles_each_model_program_once(tmp_path):
    """`rlhf_eqx grpo` (SFT, then GRPO with evaluations): every program over the whole
    model (the stories260K embedding, float32[512,64], among its arguments) — the steps,
    the sampler, the log-prob passes — is compiled at most once for its shapes."""
    from rlhf_eqx.__main__ import main

    handler = _Programs()
    loggers = [logging.getLogger(n) for n in ("jax._src.interpreters.pxla", "jax._src.dispatch")]
    for lg in loggers:
        lg.addHandler(handler)
    jax.config.update("jax_log_compiles", True)
    try:
        args = ["grpo", "--quiet", "--out", str(tmp_path / "run")]
        args += ["--set", "grpo.rollouts=2", "--set", "sft.steps=2"]
        assert main(args) == 0
    finally:
        jax.config.update("jax_log_compiles", False)
        for lg in loggers:
            lg.removeHandler(handler)
    model_programs = {k: v for k, v in handler.built.items() if "float32[512,64]" in k}
    assert model_programs  # (a run in a fresh process compiles 7 of them)
    again = {k: v for k, v in model_programs.items() if v != 1}
    assert not again, again
    # two updates, SFT's and GRPO's (each compiled once, whatever the iteration)
    updates = [k for k in model_programs if k.startswith("Compiling jit(update) ")]
    assert len(updates) == 2, updates


def _python(code: str, **env) -> str:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "RLHF_EQX_"))}
    e.update(PYTHONPATH=ROOT, **env)
    out = subprocess.run(
        [sys.executable, "-c", code], env=e, capture_output=True, text=True, cwd=ROOT, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_importing_the_library_leaves_the_cache_off(tmp_path):
    code = (
        "import jax, rlhf_eqx, rlhf_eqx.pipelines, rlhf_eqx.__main__\n"
        "print(jax.config.jax_compilation_cache_dir, rlhf_eqx.compilation_cache_dir())"
    )
    assert _python(code, XDG_CACHE_HOME=str(tmp_path)).split() == ["None", "None"]
    assert not (tmp_path / "rlhf_eqx").exists()


@pytest.mark.slow
def test_the_cache_stays_within_its_size_bound(tmp_path):
    """Past `max_mb`, the least recently used programs are evicted."""
    code = f"""
import os, jax, jax.numpy as jnp, rlhf_eqx as rx
d = rx.enable_compilation_cache({str(tmp_path)!r}, max_mb=1, min_compile_time_s=0.0)
def f(x):
    for i in range(200):  # unrolled: a program of about 80 kB compressed
        x = jnp.sin(x @ x.T + i) @ x
    return x
for n in range(4, 24):
    jax.jit(f)(jnp.ones((n, 4))).block_until_ready()
print(d)
"""
    d = _python(code).strip()
    assert d == str(tmp_path)
    programs = [f for f in os.listdir(d) if f.startswith("jit_f-") and f.endswith("-cache")]
    total = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if "-cache" in f)
    assert 0 < len(programs) < 20 and total <= 1 << 20, (len(programs), total)


# --- the evaluations share GRPO's reference pass -------------------------------------


def test_evaluation_log_probs_in_passes_of_64_rows_equal_one_pass(monkeypatch):
    """`completion_nll` scores more than 64 rows in passes of 64 (the last padded with its
    own rows: one program shape, shared with GRPO's reference pass at the built-in
    settings); the result equals one pass over every row."""
    from rlhf_eqx import pipelines as pl

    policy, _ = pl.tools.load_model("builtin")
    B, T = 130, 24
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 512, (B, T)), jnp.int32)
    start = rng.integers(0, 6, (B, 1))
    mask = jnp.asarray(np.arange(T)[None, :] >= start)
    completion = mask & jnp.asarray(np.arange(T)[None, :] >= 10)
    roll = pl.runs.Rollout(
        tokens=tokens, mask=mask, completion_mask=completion, logprobs=jnp.zeros((B, T)),
        truncated=jnp.zeros((B,), bool), prompts=("",) * B, texts=("",) * B, group_size=1,
    )  # fmt: skip
    whole = np.asarray(pl.runs.token_logps(policy, tokens, mask))
    m = np.asarray(completion)
    nll = pl.runs.completion_nll(policy, roll)
    assert nll == pytest.approx(-(whole * m).sum() / m.sum(), rel=1e-6)
