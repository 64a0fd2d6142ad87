"""Callbacks: the hooks' order and arguments, a callback's early stop (in the loop, in
the batch stages SFT / DPO / reward / KTO and the rollout stages GRPO / PPO, from the
command line), exact resume with a stateful callback after a failing hook, and the
errors a bad callback gives."""

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import rlhf_eqx as rx
from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main
from rlhf_eqx.assets import asset_path

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


@pytest.fixture(scope="module")
def tok():
    return rx.data.load_tokenizer(asset_path("tok512.bin"))


def _tiny_policy(seed=0):
    cfg = rx.TransformerConfig(
        vocab_size=512, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=96
    )
    return rx.Policy(cfg, key=jax.random.key(seed))


def _ctx(path, callbacks=(), *, resume=False, stage="t", **ops):
    return pl.RunContext(
        ops=pl.OpsConfig(quiet=True, **ops),
        log=pl.tools.MetricsLog(str(path), stage, quiet=True),
        key=jax.random.key(0),
        checkpoint_dir=str(path / "ckpt"),
        resume=resume,
        prompt_length=24,
        max_new_tokens=8,
        callbacks=callbacks,
    )


def _records(path):
    with open(os.path.join(path, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


_TIMING = ("iteration_time_s", "tokens_per_s", "mfu", "model_flops")


def _comparable(path):
    """The records of a run that an interrupted and resumed run writes again exactly:
    every step and evaluation record, without wall-clock numbers."""
    out = []
    for r in _records(path):
        if "event" in r:
            continue
        out.append({k: v for k, v in r.items() if k not in _TIMING})
    return out


# --- the loop, on a quadratic ----------------------------------------------------------


def _quadratic():
    opt = optax.chain(optax.sgd(0.1), pl.loop.scale_by_lr_factor())
    state = rx.train.init_train_state({"w": jnp.full((3,), 2.0, jnp.float32)}, opt)

    @eqx.filter_jit
    def step(params, opt_state, key):
        target = jax.random.normal(key, (3,))
        loss, g = jax.value_and_grad(lambda p: jnp.sum((p["w"] - target) ** 2))(params)
        with jax.numpy_dtype_promotion("standard"):  # Optax mixes Python floats and int32
            updates, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def iteration(s, key, i):
        params, opt_state, loss = step(s.params, s.opt_state, key)
        new = eqx.tree_at(
            lambda t: (t.params, t.opt_state, t.step), s, (params, opt_state, s.step + 1)
        )
        return new, [{"loss": loss}], {"score": float(i)}

    return state, iteration


class Recorder(pl.Callback):
    def __init__(self):
        self.calls = []

    def on_start(self, run):
        self.calls.append(("start", run.iteration, run.resumed))

    def on_step(self, run, step, metrics):
        self.calls.append(("step", step, run.steps))
        self.metrics = metrics

    def on_evaluate(self, run, step, results):
        self.calls.append(("evaluate", step, results["probe"]))

    def on_checkpoint(self, run, step, path):
        self.calls.append(("checkpoint", step, os.path.basename(path)))

    def on_stop(self, run, reason):
        self.calls.append(("stop", run.iteration, reason))


def _four_iterations(tmp_path, callback, ops, **kw):
    """`run_iterations` of `_quadratic` for 4 iterations with `callback`, checkpoints in
    `tmp_path / "ck"`."""
    state, iteration = _quadratic()
    log = pl.tools.MetricsLog(str(tmp_path), "q", quiet=True)
    ck = str(tmp_path / "ck")
    return pl.loop.run_iterations(
        state, iteration, num_iterations=4, key=jax.random.key(1), ops=ops, log=log,
        checkpoint_dir=ck, callbacks=[callback], **kw,
    )  # fmt: skip


def test_hooks_run_in_order_with_host_float_metrics(tmp_path):
    rec = Recorder()
    ops = pl.OpsConfig(quiet=True, eval_every=2, checkpoint_every=3)
    res = _four_iterations(tmp_path, rec, ops, evaluate=lambda s, i: {"probe": float(s.step)})
    assert res.stopped == "done" and res.stop_reason is None
    assert rec.calls == [
        ("start", 0, False),
        ("step", 1, 1),
        ("step", 2, 2),
        ("evaluate", 2, 2.0),
        ("step", 3, 3),
        ("checkpoint", 3, "iter_00000003"),
        ("step", 4, 4),
        ("checkpoint", 4, "iter_00000004"),
        ("stop", 4, "done"),
    ]
    # The last step's record, host floats, the rollout's numbers under rollout/*.
    assert all(type(v) is float for v in rec.metrics.values())
    assert rec.metrics["loss"] == res.history[-1]["loss"]
    assert rec.metrics["rollout/score"] == 3.0 and "step" not in rec.metrics


def test_a_stop_at_a_checkpoint_iteration_reports_that_checkpoint_once(tmp_path):
    """A callback's stop after an iteration that wrote a regular checkpoint saves again
    (to mark the stop) but tells `on_checkpoint` of that checkpoint once."""

    class StopAtTwo(Recorder):
        def on_step(self, run, step, metrics):
            super().on_step(run, step, metrics)
            return "stop" if step == 2 else None

    rec = StopAtTwo()
    res = _four_iterations(tmp_path, rec, pl.OpsConfig(quiet=True, checkpoint_every=2))
    assert res.stopped == "callback"
    assert [c for c in rec.calls if c[0] == "checkpoint"] == [("checkpoint", 2, "iter_00000002")]


class StopAt(pl.Callback):
    """Returns "stop" from `on_step` after `n` iterations."""

    def __init__(self, n):
        self.n = n
        self.reasons = []

    def on_step(self, run, step, metrics):
        return "stop" if step == self.n else None

    def on_stop(self, run, reason):
        self.reasons.append((reason, run.stop_reason))


def test_a_stop_ends_the_loop_with_a_checkpoint_and_resume_continues_it(tmp_path):
    state, iteration = _quadratic()
    kw = dict(
        num_iterations=8,
        key=jax.random.key(1),
        ops=pl.OpsConfig(quiet=True, checkpoint_every=5),
        log=pl.tools.MetricsLog(str(tmp_path), "q", quiet=True),
        checkpoint_dir=str(tmp_path / "ck"),
    )
    cb = StopAt(3)
    res = pl.loop.run_iterations(state, iteration, callbacks=[cb], **kw)
    assert res.stopped == "callback" and res.iterations == 3 and int(res.state.step) == 3
    assert res.stop_reason == "StopAt.on_step returned 'stop'"
    assert cb.reasons == [("callback", res.stop_reason)]
    latest = pl.tools.latest_checkpoint(str(tmp_path / "ck"))
    assert latest.endswith("iter_00000003")  # written though checkpoint_every is 5
    with open(os.path.join(latest, "meta.json")) as f:
        meta = json.load(f)
    assert meta["stopped"] == "callback" and meta["stop_reason"] == res.stop_reason
    events = [r for r in _records(tmp_path) if r.get("event") == "callback_stop"]
    assert len(events) == 1 and events[0]["reason"] == res.stop_reason
    # Resuming the stopped run continues it from that checkpoint, as TRL's
    # `resume_from_checkpoint` does, to the run that was never stopped.
    full = pl.loop.run_iterations(state, iteration, **{**kw, "checkpoint_dir": None})
    again = pl.loop.run_iterations(state, iteration, resume=True, **kw)
    assert again.stopped == "done" and again.stop_reason is None and again.iterations == 8
    assert [int(r["step"]) for r in again.history] == [3, 4, 5, 6, 7]
    assert (again.state.params["w"] == full.state.params["w"]).all()
    (event,) = [r for r in _records(tmp_path) if r.get("event") == "resume"]
    assert event["message"].endswith(
        "a callback had stopped it there (StopAt.on_step returned 'stop'), training goes on"
    )
    assert not [r for r in _records(tmp_path) if r.get("event") == "callback_stop"]
    # request_stop from on_start stops before the first iteration.

    class Never(pl.Callback):
        def on_start(self, run):
            run.request_stop("not today")

    none = pl.loop.run_iterations(
        state, iteration, callbacks=[Never()], **{**kw, "checkpoint_dir": None}
    )
    assert none.stopped == "callback" and none.iterations == 0 and none.stop_reason == "not today"


def test_a_stopped_stage_that_a_later_stage_trained_on_stays_stopped_on_resume(tmp_path):
    """A pipeline's stage stopped by a callback, then a later stage trained from it:
    resuming keeps it as it stopped (continuing it would change what the later stage
    started from), and the resume event says so and what trains it further."""
    state, iteration = _quadratic()
    ops = pl.OpsConfig(quiet=True, checkpoint_every=5)

    def run(stage, callbacks=(), resume=False):
        return pl.loop.run_iterations(
            state,
            iteration,
            num_iterations=8,
            key=jax.random.key(1),
            ops=ops,
            log=pl.tools.MetricsLog(str(tmp_path), stage, quiet=True),
            checkpoint_dir=str(tmp_path / stage / "ck"),
            callbacks=callbacks,
            resume=resume,
        )

    assert run("a", [StopAt(3)]).stopped == "callback"
    assert run("b").stopped == "done"
    again = run("a", resume=True)
    assert again.stopped == "callback" and again.history == [] and again.iterations == 3
    assert again.stop_reason == "StopAt.on_step returned 'stop'"
    (event,) = [r for r in _records(tmp_path) if r.get("event") == "resume"]
    assert "it stays stopped: b trained on its result" in event["message"]
    assert "--overwrite or another --out" in event["message"]


class Tally(pl.Callback):
    """State that must survive an interruption: the steps seen and the sum of losses;
    a custom record every 2 steps."""

    def __init__(self):
        self.seen, self.total = [], 0.0

    def on_step(self, run, step, metrics):
        self.seen.append(step)
        self.total += metrics["loss"]
        if step % 2 == 0:
            run.log_metrics({"tally": self.total})

    def state_dict(self):
        return {"seen": self.seen, "total": self.total}

    def load_state_dict(self, state):
        self.seen, self.total = list(state["seen"]), float(state["total"])


class Boom(pl.Callback):
    def __init__(self, at=None):
        self.at = at

    def on_step(self, run, step, metrics):
        if step == self.at:
            raise ValueError("the probe\nfailed")


def test_a_failing_hook_names_itself_checkpoints_and_resume_is_exact(tmp_path):
    state, iteration = _quadratic()

    def run(path, callbacks, resume=False):
        return pl.loop.run_iterations(
            state,
            iteration,
            num_iterations=8,
            key=jax.random.key(2),
            ops=pl.OpsConfig(quiet=True, checkpoint_every=3),
            log=pl.tools.MetricsLog(str(path), "q", quiet=True),
            checkpoint_dir=str(path / "ck"),
            resume=resume,
            callbacks=callbacks,
        )

    full_tally = Tally()
    full = run(tmp_path / "full", [full_tally, Boom()])
    cut = tmp_path / "cut"
    with pytest.raises(pl.loop.CallbackError) as err:
        run(cut, [Tally(), Boom(at=5)])
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("callback Boom.on_step failed in q after iteration 5")
    assert msg.endswith("ValueError: the probe failed")
    # The last iteration whose hooks all completed (4) is checkpointed, although
    # checkpoint_every is 3.
    assert err.value.checkpoint.endswith("iter_00000004")
    assert pl.tools.latest_checkpoint(str(cut / "ck")) == err.value.checkpoint
    tally = Tally()
    resumed = run(cut, [tally, Boom()], resume=True)
    assert tally.seen == full_tally.seen == list(range(1, 9))
    assert tally.total == full_tally.total
    assert (resumed.state.params["w"] == full.state.params["w"]).all()
    assert _comparable(cut) == _comparable(tmp_path / "full")
    assert [r["tally"] for r in _records(cut) if "tally" in r] == [
        r["tally"] for r in _records(tmp_path / "full") if "tally" in r
    ]


class FailsAtStop(pl.Callback):
    def on_stop(self, run, reason):
        raise RuntimeError(f"the report after {reason} failed")


def test_a_failing_hook_after_the_loop_names_the_checkpoint_to_resume_from(tmp_path):
    # on_stop (and a stage's held-out on_evaluate) run after the loop's last checkpoint:
    # the error names it, so that the command line prints the command that resumes
    with pytest.raises(pl.loop.CallbackError) as err:
        _four_iterations(tmp_path, FailsAtStop(), pl.OpsConfig(quiet=True, checkpoint_every=3))
    assert str(err.value).startswith("callback FailsAtStop.on_stop failed in q after iteration 4")
    assert err.value.checkpoint == str(tmp_path / "ck" / "iter_00000004")


def test_bad_callbacks_are_refused_naming_them(tmp_path):
    state, iteration = _quadratic()
    kw = dict(num_iterations=1, key=jax.random.key(0), ops=pl.OpsConfig(quiet=True))
    log = pl.tools.MetricsLog(str(tmp_path), "q", quiet=True)
    with pytest.raises(TypeError, match="got the class Tally; pass an instance"):
        pl.loop.run_iterations(state, iteration, log=log, callbacks=[Tally], **kw)
    with pytest.raises(TypeError, match="has none of the hooks"):
        pl.loop.run_iterations(state, iteration, log=log, callbacks=[object()], **kw)

    class Unsaveable(pl.Callback):
        def state_dict(self):
            return {"f": lambda: 0}

    with pytest.raises(pl.loop.CallbackError, match="Unsaveable.state_dict .* TypeError"):
        pl.loop.run_iterations(state, iteration, log=log, callbacks=[Unsaveable()], **kw)


# --- the stages ------------------------------------------------------------------------


_LORA = pl.LoRASettings(rank=2, alpha=4.0, dropout=0.0)
_OPTIM = rx.train.OptimizerSettings(learning_rate=1e-2)
_PAIRS = [
    rx.data.PreferenceRecord("Once upon a time", " a dog ran.", " zzz."),
    rx.data.PreferenceRecord("The cat", " sat on a mat.", " qq qq."),
] * 4


def _batch_stage(name, tok, ctx):
    policy = _tiny_policy()
    common = dict(steps=6, batch_size=2, max_length=32, optim=_OPTIM)
    if name == "sft":
        records = [(p.prompt, p.chosen) for p in _PAIRS]
        return pl.runs.run_sft(
            policy, tok, records, cfg=pl.SFTConfig(**common, lora=_LORA), ctx=ctx
        )
    if name == "dpo":
        return pl.runs.run_dpo(policy, tok, _PAIRS, cfg=pl.DPOConfig(**common, lora=_LORA), ctx=ctx)
    if name == "reward":
        return pl.runs.run_reward(policy, tok, _PAIRS, cfg=pl.RewardConfig(**common), ctx=ctx)
    records = [rx.data.UnpairedRecord(p.prompt, p.chosen, i % 2 == 0) for i, p in enumerate(_PAIRS)]
    return pl.runs.run_kto(policy, tok, records, cfg=pl.KTOConfig(**common, lora=_LORA), ctx=ctx)


@pytest.mark.parametrize("stage", ["sft", "dpo", "reward", "kto"])
def test_a_callback_stops_a_batch_stage(stage, tok, tmp_path):
    cb = Probe(2)
    res = _batch_stage(stage, tok, _ctx(tmp_path, [cb], stage=stage))
    assert res.loop.stopped == "callback" and res.loop.iterations == 2
    assert len(res.history) == 2 and [h["step"] for h in res.history] == [0, 1]
    assert cb.reasons == [("callback", "Probe.on_step returned 'stop'")]
    policy = None if stage == "reward" else "Policy"  # the reward model's run has none
    assert [(s[0], s[1], s[3]) for s in cb.seen] == [(stage, 1, policy), (stage, 2, policy)]
    assert pl.tools.latest_checkpoint(str(tmp_path / "ckpt")).endswith("iter_00000002")


_PROMPTS = ["Once upon a time", "The dog"]
_LEN = [pl.runs.RewardFunction("len", lambda p, t: float(len(t) % 2))]


class Probe(StopAt):
    """Stops after `n` rollouts; records what each `on_step` saw."""

    def __init__(self, n):
        super().__init__(n)
        self.seen = []

    def on_step(self, run, step, metrics):
        policy = type(run.policy()).__name__ if run.has_policy else None
        self.seen.append((run.stage, step, "rollout/kl" in metrics, policy))
        return super().on_step(run, step, metrics)


def test_a_callback_stops_grpo_and_sees_the_policy(tok, tmp_path):
    g = pl.GRPOConfig(
        rollouts=4, prompts_per_rollout=2, group_size=2, optim=_OPTIM, lora=_LORA, kl_target=9.0
    )
    cb = Probe(1)
    ctx = _ctx(tmp_path, [cb], stage="grpo")
    res = pl.runs.run_grpo(_tiny_policy(), tok, _PROMPTS, reward=_LEN, cfg=g, ctx=ctx)
    assert res.loop.stopped == "callback" and res.loop.iterations == 1
    assert cb.seen == [("grpo", 1, True, "Policy")]


def test_a_callback_stops_ppo(tok, tmp_path):
    p = pl.PPOConfig(rollouts=3, prompts_per_rollout=2, epochs=1, minibatches=1, lora=_LORA)
    cb = Probe(2)
    ctx = _ctx(tmp_path, [cb], stage="ppo")
    res = pl.runs.run_ppo(_tiny_policy(), tok, _PROMPTS, reward=_LEN, cfg=p, ctx=ctx)
    assert res.loop.stopped == "callback" and res.loop.iterations == 2
    assert cb.seen == [("ppo", 1, True, "Policy"), ("ppo", 2, True, "Policy")]


# --- the documented example: custom evaluation every N steps, early stopping -----------


def heldout_nll(policy, tok, texts, length=32):
    """The policy's NLL per token of `texts` (each cut to `length` tokens)."""
    rows = [([tok.bos_id] + tok.encode(t))[:length] for t in texts]
    tokens = jnp.array([r + [tok.pad_id] * (length - len(r)) for r in rows])
    mask = jnp.arange(length)[None, :] < jnp.array([len(r) for r in rows])[:, None]
    logp = jax.vmap(lambda t, m: rx.token_logprobs(policy, t, m))(tokens, mask)
    return -float(logp.sum()) / (int(mask.sum()) - len(rows))


class HeldOutNLL(pl.Callback):
    """Every `every` steps, the NLL per token of held-out texts; stop when it has not
    improved by `min_delta` for `patience` evaluations (the docs' example)."""

    def __init__(self, tok, texts, every=2, patience=2, min_delta=0.0):
        self.tok, self.texts, self.every = tok, texts, every
        self.patience, self.min_delta = patience, min_delta
        self.best, self.bad = None, 0

    def on_start(self, run):
        if not run.resumed:  # each stage starts afresh; a resumed one has its state back
            self.best, self.bad = None, 0

    def on_step(self, run, step, metrics):
        if step % self.every or not run.has_policy:  # the reward model has none
            return None
        nll = heldout_nll(run.policy(), self.tok, self.texts)
        run.log_metrics({"heldout_nll": nll})
        if self.best is None or nll < self.best - self.min_delta:
            self.best, self.bad = nll, 0
        else:
            self.bad += 1
            if self.bad >= self.patience:
                run.request_stop(f"held-out NLL {nll:.4f} not below {self.best:.4f}")
        return None

    def state_dict(self):
        return {"best": self.best, "bad": self.bad}

    def load_state_dict(self, state):
        self.best, self.bad = state["best"], state["bad"]


def _sft(tok, path, callbacks, steps=8, resume=False):
    records = [(p.prompt, p.chosen) for p in _PAIRS]
    cfg = pl.SFTConfig(
        steps=steps,
        batch_size=2,
        max_length=32,
        optim=rx.train.OptimizerSettings(learning_rate=3e-2),
        lora=pl.LoRASettings(rank=4, alpha=8.0, dropout=0.1),
    )
    ctx = _ctx(path, callbacks, resume=resume, stage="sft", checkpoint_every=3)
    return pl.runs.run_sft(_tiny_policy(), tok, records, cfg=cfg, ctx=ctx)


def test_custom_evaluation_and_exact_resume_on_sft(tok, tmp_path):
    held = ["Once upon a time a dog ran.", "The cat sat on a mat."]
    full_cb = HeldOutNLL(tok, held)
    full = _sft(tok, tmp_path / "full", [full_cb, Boom()])
    nll = [r["heldout_nll"] for r in _records(tmp_path / "full") if "heldout_nll" in r]
    assert len(nll) == 4 and all(math.isfinite(x) for x in nll)
    assert full.loop.stopped == "done"  # it keeps improving on the texts it trains on

    with pytest.raises(pl.loop.CallbackError, match="Boom.on_step failed in sft after iteration 5"):
        _sft(tok, tmp_path / "cut", [HeldOutNLL(tok, held), Boom(at=5)])
    cb = HeldOutNLL(tok, held)
    resumed = _sft(tok, tmp_path / "cut", [cb, Boom()], resume=True)
    assert (cb.best, cb.bad) == (full_cb.best, full_cb.bad)
    assert _comparable(tmp_path / "cut") == _comparable(tmp_path / "full")
    a = jax.tree.leaves(eqx.filter(full.state.model, eqx.is_array))
    b = jax.tree.leaves(eqx.filter(resumed.state.model, eqx.is_array))
    assert all((x == y).all() for x, y in zip(a, b, strict=True))

    # Early stopping on the criterion: no step gains 10 nats per token, so with patience
    # 1 the second evaluation (step 2) stops the run.
    cb = HeldOutNLL(tok, held, every=1, patience=1, min_delta=10.0)
    res = _sft(tok, tmp_path / "stop", [cb])
    assert res.loop.stopped == "callback" and res.loop.iterations == 2
    assert res.loop.stop_reason == f"held-out NLL {nll[0]:.4f} not below {cb.best:.4f}"


# --- the command line ------------------------------------------------------------------

_SMALL = [
    "--quiet",
    "--set",
    "kto.steps=6",
    "--set",
    "kto.batch_size=4",
    "--set",
    "kto.max_length=40",
    "--set",
    "sampling.prompt_length=16",
    "--set",
    "data.heldout_fraction=0.25",
    "--set",
    "data.eval_prompts=2",
    "--set",
    "eval_samples=1",
    "--set",
    "ops.monitor=false",
]

_MODULE = textwrap.dedent(
    """
    from rlhf_eqx import pipelines as pl

    class StopAfterTwo(pl.Callback):
        def on_step(self, run, step, metrics):
            if step == 2:
                run.request_stop(f"two steps, loss {metrics['loss']:.3f}")

    class FailOnce(pl.Callback):
        armed = True

        def on_step(self, run, step, metrics):
            if step == 3 and FailOnce.armed:
                FailOnce.armed = False
                raise RuntimeError("the judge is down")

    class Seen(pl.Callback):
        def on_evaluate(self, run, step, results):
            with open("evaluated.json", "w") as f:
                f.write(str(sorted(results)))
    """
)


def _unpaired(path, n=16):
    with open(path, "w") as f:
        for i in range(n):
            good = i % 2 == 0
            rec = {
                "prompt": f"Once upon a time {i}",
                "completion": " a dog ran home." if good else " zzz zzz.",
                "label": good,
            }
            f.write(json.dumps(rec) + "\n")


def _cli_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "cli_callbacks.py").write_text(_MODULE)
    _unpaired(tmp_path / "unpaired.jsonl")
    return ["kto", "--data", "unpaired.jsonl", "--out", str(tmp_path / "run"), *_SMALL]


def test_cli_callback_specs_are_checked_in_one_line(tmp_path, monkeypatch, capsys):
    argv = _cli_dir(tmp_path, monkeypatch)
    (tmp_path / "broken_callbacks.py").write_text("class Stop(\n")
    (tmp_path / "failing_callbacks.py").write_text("import json\njson.loads('{')\n")
    for spec, what in [
        ("cli_callbacks", "expected MODULE:NAME"),
        ("no_such_module:X", "cannot import no_such_module"),
        ("cli_callbacks:Nope", "cli_callbacks has no Nope"),
        ("broken_callbacks:Stop", "importing broken_callbacks raised SyntaxError: "),
        ("failing_callbacks:Stop", "importing failing_callbacks raised JSONDecodeError: "),
    ]:
        assert main([*argv, "--callback", spec]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--callback {spec}: {what}" in err[0]
    assert main([*argv, "--seeds", "2", "--callback", "cli_callbacks:Seen"]) == 2
    assert "--callback: not with --seeds" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_cli_callbacks_stop_a_data_run(tmp_path, monkeypatch, capsys):
    argv = _cli_dir(tmp_path, monkeypatch)
    out = tmp_path / "run"
    cbs = ["--callback", "cli_callbacks:StopAfterTwo", "--callback", "cli_callbacks:Seen"]
    assert main([*argv, *cbs]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"] == "callback" and summary["stop_reason"].startswith("two steps")
    steps = pl.tools.read_metrics(str(out))["kto"]
    assert [r["step"] for r in steps] == [0, 1]
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("rlhf_eqx kto: stopped (callback: two steps, loss")
    # The held-out evaluation after the stage reached on_evaluate with the summary entry.
    assert "heldout_ordering_accuracy" in (tmp_path / "evaluated.json").read_text()


@pytest.mark.slow
def test_cli_a_failing_callback_stops_the_run_in_one_line_and_resume_finishes_it(
    tmp_path, monkeypatch, capsys
):
    argv = _cli_dir(tmp_path, monkeypatch)
    argv += ["--callback", "cli_callbacks:FailOnce"]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(
        "error: callback FailOnce.on_step failed in kto after iteration 3: "
        "RuntimeError: the judge is down; checkpoint "
    )
    assert err[0].endswith(" --callback cli_callbacks:FailOnce --resume")
    assert pl.tools.latest_checkpoint(str(tmp_path / "run" / "kto" / "checkpoints")).endswith(
        "_00000002"
    )
    # FailOnce is disarmed in this process: the resumed run finishes.
    assert main([*argv, "--resume"]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stopped"] == "done"
    assert [r["step"] for r in pl.tools.read_metrics(str(tmp_path / "run"))["kto"]] == list(
        range(6)
    )


@pytest.mark.slow
def test_the_pipeline_takes_callbacks_per_stage(tmp_path, monkeypatch, capsys):
    _cli_dir(tmp_path, monkeypatch)
    out = tmp_path / "pipe"
    argv = ["sft", "--out", str(out), "--quiet", "--set", "sft.steps=4"]
    argv += ["--set", "eval_samples=1", "--set", "sampling.max_new_tokens=16"]
    assert (
        main(
            [*argv, "--callback", "cli_callbacks:StopAfterTwo", "--callback", "cli_callbacks:Seen"]
        )
        == 0
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sft"]["stopped"] == "callback"
    assert summary["sft"]["stop_reason"].startswith("two steps, loss")
    assert summary["stopped"] == "done"
    assert [r["step"] for r in pl.tools.read_metrics(str(out))["sft"]] == [0, 1]
    # on_evaluate saw the stage's held-out evaluation
    assert "'score'" in (tmp_path / "evaluated.json").read_text()


# --- kill -9 with a callback, then resume ----------------------------------------------

_KILLED = textwrap.dedent(
    """
    import json, sys, time
    import equinox as eqx, jax
    import rlhf_eqx as rx
    from rlhf_eqx import pipelines as pl
    from rlhf_eqx.assets import asset_path

    ckpt, out, resume, pause = sys.argv[1], sys.argv[2], sys.argv[3] == "1", float(sys.argv[4])
    tok = rx.data.load_tokenizer(asset_path("tok512.bin"))
    cfg = rx.TransformerConfig(vocab_size=512, d_model=16, n_layers=1, n_heads=2,
                               n_kv_heads=1, d_ff=32, max_seq_len=64)
    policy = rx.Policy(cfg, key=jax.random.key(0))
    records = [("Once upon a time", " a dog ran."), ("The cat", " sat on a mat.")] * 4

    class Tally(pl.Callback):
        def __init__(self):
            self.losses = []
        def on_step(self, run, step, metrics):
            time.sleep(pause)
            self.losses.append(metrics["loss"])
            run.log_metrics({"mean_loss": sum(self.losses) / len(self.losses)})
        def state_dict(self):
            return {"losses": self.losses}
        def load_state_dict(self, state):
            self.losses = list(state["losses"])

    sft = pl.SFTConfig(steps=10, batch_size=4, max_length=24,
                       optim=rx.train.OptimizerSettings(learning_rate=1e-2),
                       lora=pl.LoRASettings(rank=4, alpha=8.0, dropout=0.1))
    tally = Tally()
    ctx = pl.RunContext(ops=pl.OpsConfig(quiet=True, checkpoint_every=1, keep=3, seed=3),
                        log=pl.tools.MetricsLog(ckpt, "sft", quiet=True), key=jax.random.key(7),
                        checkpoint_dir=ckpt, resume=resume, prompt_length=12,
                        callbacks=[tally])
    res = pl.runs.run_sft(policy, tok, records, cfg=sft, ctx=ctx)
    eqx.tree_serialise_leaves(out, res.state)
    with open(out + ".json", "w") as f:
        json.dump(tally.losses, f)
    """
)


def _spawn(tmp_path, name, resume, pause):
    script = tmp_path / "killed_run.py"
    script.write_text(_KILLED)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = [sys.executable, str(script), str(tmp_path / name), str(tmp_path / f"{name}.eqx")]
    return subprocess.Popen([*args, "1" if resume else "0", str(pause)], env=env)


@pytest.mark.slow
def test_kill_9_with_a_stateful_callback_then_resume_is_exact(tmp_path):
    assert _spawn(tmp_path, "full", False, 0.0).wait(timeout=300) == 0
    proc = _spawn(tmp_path, "killed", False, 0.4)
    ckpt = str(tmp_path / "killed")
    deadline = time.time() + 300
    while time.time() < deadline:
        latest = pl.tools.latest_checkpoint(ckpt)
        if latest is not None and int(latest[-8:]) >= 4:
            break
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert int(pl.tools.latest_checkpoint(ckpt)[-8:]) < 10
    assert _spawn(tmp_path, "killed", True, 0.0).wait(timeout=300) == 0
    assert (tmp_path / "full.eqx").read_bytes() == (tmp_path / "killed.eqx").read_bytes()
    full = json.loads((tmp_path / "full.eqx.json").read_text())
    assert json.loads((tmp_path / "killed.eqx.json").read_text()) == full and len(full) == 10
    assert _comparable(ckpt) == _comparable(str(tmp_path / "full"))


class LogsAtStop(pl.Callback):
    def on_stop(self, run, reason):
        run.log_metrics({"final_probe": float(run.iteration)})


def test_records_a_callback_writes_after_the_loop_are_not_repeated_on_resume(tmp_path):
    """What a callback logs once the loop has ended (`on_stop`, the held-out
    `on_evaluate`) follows the last checkpoint: resuming the finished run writes it
    again in place of the old one, not beside it."""
    ops = pl.OpsConfig(quiet=True, checkpoint_every=2)
    _four_iterations(tmp_path, LogsAtStop(), ops)
    first = [r for r in _records(tmp_path) if "final_probe" in r]
    assert len(first) == 1 and first[0]["after_loop"] and first[0]["iteration"] == 4
    again = _four_iterations(tmp_path, LogsAtStop(), ops, resume=True)
    assert again.iterations == 4 and again.history == []
    finals = [r for r in _records(tmp_path) if "final_probe" in r]
    assert finals == first
