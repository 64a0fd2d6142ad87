"""The run layer: the task scorer, configs, checkpoints, the loop's resume, rollback and
KL guard, rollouts, and the pipeline's pieces on a tiny model."""

import dataclasses
import json
import math
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import rlhf_eqx as rx
from rlhf_eqx import pipelines as pl
from rlhf_eqx.assets import asset_path


def _tiny_policy(seed=0):
    cfg = rx.TransformerConfig(
        vocab_size=512, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=96
    )
    return rx.Policy(cfg, key=jax.random.key(seed))


@pytest.fixture(scope="module")
def tok():
    return rx.data.load_tokenizer(asset_path("tok512.bin"))


def _lines(path):
    with open(path) as f:
        return f.read().splitlines()


def _ctx(tmp_path, **ops):
    o = pl.OpsConfig(quiet=True, **ops)
    return pl.RunContext(
        ops=o,
        log=pl.tools.MetricsLog(str(tmp_path), "t", quiet=True),
        key=jax.random.key(0),
        checkpoint_dir=str(tmp_path / "ckpt"),
        prompt_length=24,
        max_new_tokens=8,
    )


# --- the task --------------------------------------------------------------------------


def test_animal_score_whole_words_any_case_and_plurals():
    s = pl.task.animal_score
    assert s("The Dog ran.") == s("two CATS") == s("Mice!") == s("the puppies") == 1.0
    assert s("three foxes and bunnies") == s("an owl") == s("Elephants") == 1.0
    assert s("a doghouse, a catalog, a hotdog, scowl") == 0.0
    assert s("") == 0.0


def test_noisy_scores_flip_about_the_noise_rate_and_are_seeded():
    clean = [1.0, 0.0] * 500
    noisy = pl.task.noisy_scores(clean, noise=0.2, seed=3)
    assert noisy == pl.task.noisy_scores(clean, noise=0.2, seed=3)
    rate = np.mean(np.asarray(noisy) != np.asarray(clean))
    assert 0.15 < rate < 0.25
    assert pl.task.noisy_scores(clean, noise=0.0, seed=1) == clean


def test_train_and_heldout_prompts_are_disjoint_and_fit(tok):
    assert not set(pl.task.TRAIN_PROMPTS) & set(pl.task.HELDOUT_PROMPTS)
    cfg = pl.animal_task_config()
    for p in pl.task.TRAIN_PROMPTS + pl.task.HELDOUT_PROMPTS:
        assert len(tok.encode(p)) + 1 <= cfg.sampling.prompt_length


# --- configs ---------------------------------------------------------------------------


def test_defaults_are_the_usual_ones_and_the_task_says_what_it_overrides():
    c = pl.PipelineConfig()
    o = c.dpo.optim
    assert (c.dpo.beta, o.learning_rate, o.warmup_ratio, o.max_grad_norm) == (0.1, 1e-5, 0.1, 1.0)
    assert c.dpo.optim.schedule == "cosine" and c.reward.optim.learning_rate == 1e-5
    p = c.ppo
    assert (p.clip_eps, p.vf_coef, p.ent_coef, p.gamma, p.lam, p.kl_target) == (
        0.2,
        0.5,
        0.01,
        1.0,
        0.95,
        0.05,
    )
    assert c.dpo.lora == pl.LoRASettings(rank=16, alpha=32.0, dropout=0.05, targets=("q", "v"))
    task = pl.animal_task_config()
    assert "Overrides" in task.notes and "LoRA" in task.notes and "KL target" in task.notes
    pl.config.validate_config(task)


def test_overrides_and_files(tmp_path):
    c = pl.apply_overrides(
        pl.animal_task_config(),
        ["dpo.beta=0.2", "ppo.lora.targets=q,v", "ops.quiet=true", "model.tokenizer=none"],
    )
    assert c.dpo.beta == 0.2 and c.ppo.lora.targets == ("q", "v") and c.ops.quiet
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"grpo": {"group_size": 4}, "stages": ["sft", "dpo"]}))
    c2 = pl.load_config(str(path), base=c)
    assert c2.grpo.group_size == 4 and c2.stages == ("sft", "dpo") and c2.dpo.beta == 0.2
    assert pl.config.config_from_dict(pl.PipelineConfig, pl.config.config_to_dict(c2)) == c2


@pytest.mark.parametrize(
    "overrides, device_count, message",
    [
        (["dpo.beta=-0.1"], 1, "dpo.beta=-0.1: must be > 0"),
        (["ppo.clip_eps=-0.5"], 1, "ppo.clip_eps=-0.5: must be > 0"),
        (["grpo.clip_eps=0"], 1, "grpo.clip_eps=0.0: must be > 0"),
        (["dpo.batch_size=6"], 4, "dpo.batch_size=6: must divide by the device count 4"),
        (
            ["model.source=/no/such/model.bin", "model.tokenizer=/no/tok.bin"],
            1,
            "model.source='/no/such/model.bin': no such file",
        ),
        (["data.path=/no/such.jsonl"], 1, "data.path='/no/such.jsonl': no such file"),
        (["sft.optim.learning_rate=0"], 1, "sft.optim.learning_rate=0.0: must be > 0"),
        (["grpo.options.micro_batches=3"], 1, "grpo.options.micro_batches=3: must divide"),
        (["stages=sft,ppo"], 1, "ppo with ppo.reward_source=reward_model needs the reward stage"),
        (["dpo.packing=true", "dpo.loss_type=aot"], 1, "dpo.packing=True: loss_type='aot' sorts"),
    ],
)
def test_invalid_configs_fail_naming_the_field(overrides, device_count, message):
    with pytest.raises(pl.ConfigError) as info:
        pl.config.validate_config(
            pl.apply_overrides(pl.animal_task_config(), overrides), device_count=device_count
        )
    assert message in str(info.value) and "\n" not in str(info.value)


def test_bad_override_values_and_fields():
    c = pl.animal_task_config()
    with pytest.raises(pl.ConfigError, match="dpo.steps='many': expected an integer"):
        pl.apply_overrides(c, ["dpo.steps=many"])
    with pytest.raises(pl.ConfigError, match="dpo.nope: unknown field"):
        pl.apply_overrides(c, ["dpo.nope=1"])
    with pytest.raises(pl.ConfigError, match="expected FIELD=VALUE"):
        pl.apply_overrides(c, ["dpo.beta"])


# --- checkpoints -----------------------------------------------------------------------


def test_checkpoints_are_atomic_checksummed_and_pruned(tmp_path):
    tree = {"a": jnp.arange(4.0), "b": jnp.ones((2,), jnp.int32)}
    d = str(tmp_path)
    for i in (1, 2, 3):
        pl.tools.save_checkpoint(d, i, jax.tree.map(lambda x: x * i, tree), {"note": i}, keep=2)
    names = sorted(os.listdir(d))
    assert names == ["iter_00000002", "iter_00000003"]
    latest = pl.tools.latest_checkpoint(d)
    restored, meta = pl.tools.restore_checkpoint(latest, tree)
    np.testing.assert_array_equal(restored["a"], np.arange(4.0) * 3)
    assert meta["iteration"] == 3 and meta["note"] == 3
    # A damaged newest checkpoint is skipped in favour of the previous one.
    with open(os.path.join(latest, "state.eqx"), "r+b") as f:
        f.seek(0)
        f.write(b"\x00\x01garbage")
    assert pl.tools.latest_checkpoint(d).endswith("iter_00000002")
    with pytest.raises(ValueError, match="checksum mismatch"):
        pl.tools.restore_checkpoint(latest, tree)
    # A leftover temporary directory (a crash mid-write) is not a checkpoint.
    os.makedirs(os.path.join(d, "iter_00000009.tmp123"))
    assert pl.tools.latest_checkpoint(d).endswith("iter_00000002")


def test_processes_of_a_run_can_share_a_checkpoint_directory(tmp_path, monkeypatch):
    """Two processes of one run (`jax.process_index` 0 and 1 of 2) saving the same
    iterations into one directory: the first to put an iteration in place keeps it and
    the second drops its copy; each removes only its own crashed writes; a damaged
    iteration already there is replaced."""
    tree = {"a": jnp.arange(4.0), "b": jnp.ones((2,), jnp.int32)}
    d = str(tmp_path)
    monkeypatch.setattr(jax, "process_count", lambda: 2)

    def save(process, iteration, scale=1.0):
        monkeypatch.setattr(jax, "process_index", lambda: process)
        t = {"a": tree["a"] * scale, "b": tree["b"]}
        return pl.tools.save_checkpoint(d, iteration, t, {"note": iteration}, keep=2)

    first = save(0, 1)
    with open(os.path.join(first, "meta.json")) as f:
        sha = json.load(f)["sha256"]
    assert save(1, 1, scale=2.0) == first  # the second writer's copy is dropped
    with open(os.path.join(first, "meta.json")) as f:
        assert json.load(f)["sha256"] == sha
    assert sorted(os.listdir(d)) == ["iter_00000001"]
    for name in ("iter_00000002.p0.tmp11", "iter_00000002.p1.tmp12", "iter_00000002.tmp13"):
        os.makedirs(os.path.join(d, name))  # left by crashed writes of processes 0, 1, 0
    save(0, 2)
    assert sorted(os.listdir(d)) == ["iter_00000001", "iter_00000002", "iter_00000002.p1.tmp12"]
    with open(os.path.join(d, "iter_00000002", "state.eqx"), "r+b") as f:
        f.write(b"\x00\x01garbage")
    save(1, 2, scale=3.0)  # damaged: replaced by process 1's copy
    assert sorted(os.listdir(d)) == ["iter_00000001", "iter_00000002"]
    restored, meta = pl.tools.restore_checkpoint(pl.tools.latest_checkpoint(d), tree)
    np.testing.assert_array_equal(restored["a"], np.arange(4.0) * 3)
    assert meta["iteration"] == 2


# --- the loop: resume, rollback, KL guard ----------------------------------------------


def _quadratic_state(lr=0.1):
    opt = optax.chain(optax.sgd(lr), pl.loop.scale_by_lr_factor())
    params = {"w": jnp.full((3,), 2.0, jnp.float32)}
    return rx.train.init_train_state(params, opt), opt


def _quadratic_iteration(opt, poison=None):
    """One SGD step on |w - noise|^2; `poison(i, state)` may return a NaN loss."""

    @eqx.filter_jit
    def step(params, opt_state, key):
        target = jax.random.normal(key, (3,))
        loss, g = jax.value_and_grad(lambda p: jnp.sum((p["w"] - target) ** 2))(params)
        with jax.numpy_dtype_promotion("standard"):  # Optax mixes Python floats and int32
            updates, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def iteration(state, key, i):
        params, opt_state, loss = step(state.params, state.opt_state, key)
        if poison is not None and poison(i, state):
            params = jax.tree.map(lambda x: x * jnp.nan, params)
            loss = jnp.nan
        new = eqx.tree_at(
            lambda s: (s.params, s.opt_state, s.step), state, (params, opt_state, state.step + 1)
        )
        return new, [{"loss": loss}], {}

    return iteration


def test_resume_after_an_interruption_is_exact(tmp_path):
    state, opt = _quadratic_state()
    ops = pl.OpsConfig(quiet=True, checkpoint_every=1, keep=2)
    log = pl.tools.MetricsLog(str(tmp_path), "q", quiet=True)
    key = jax.random.key(5)
    full = pl.loop.run_iterations(
        state, _quadratic_iteration(opt), num_iterations=8, key=key, ops=ops, log=log
    )

    class Crash(Exception):
        pass

    def crashing(state_, k, i):
        if i == 5:
            raise Crash
        return _quadratic_iteration(opt)(state_, k, i)

    d = str(tmp_path / "ck")
    with pytest.raises(Crash):
        pl.loop.run_iterations(
            state, crashing, num_iterations=8, key=key, ops=ops, log=log, checkpoint_dir=d
        )
    assert pl.tools.latest_checkpoint(d).endswith("iter_00000005")
    resumed = pl.loop.run_iterations(
        state,
        _quadratic_iteration(opt),
        num_iterations=8,
        key=key,
        ops=ops,
        log=log,
        checkpoint_dir=d,
        resume=True,
    )
    assert resumed.iterations == 8 and len(resumed.history) == 3
    np.testing.assert_array_equal(resumed.state.params["w"], full.state.params["w"])
    assert int(resumed.state.step) == 8


def test_rollback_on_an_injected_nan_restores_and_lowers_the_lr(tmp_path):
    state, opt = _quadratic_state()
    seen = []

    def poison(i, s):
        seen.append(i)
        return i == 3 and pl.loop.get_lr_scale(s.opt_state) == 1.0

    log = pl.tools.MetricsLog(str(tmp_path), "q", quiet=True)
    res = pl.loop.run_iterations(
        state,
        _quadratic_iteration(opt, poison),
        num_iterations=6,
        key=jax.random.key(0),
        ops=pl.OpsConfig(quiet=True),
        log=log,
    )
    assert res.rollbacks == 1 and seen.count(3) == 2
    assert bool(jnp.all(jnp.isfinite(res.state.params["w"])))
    assert pl.loop.get_lr_scale(res.state.opt_state) == pytest.approx(0.1)
    events = [json.loads(line) for line in _lines(log.path) if "event" in line]
    assert events[0]["event"] == "rollback" and "non-finite" in events[0]["message"]
    assert events[0]["lr_scale"] == pytest.approx(0.1)


def test_rollback_on_a_learning_rate_spike(tmp_path):
    # The schedule jumps from 0.05 to 1000 at step 6: the loss explodes; rollback restores
    # the state before the spike and divides the factor until the loss is back in range.
    sched = optax.piecewise_constant_schedule(0.05, {6: 1000.0})
    opt = optax.chain(optax.sgd(sched), pl.loop.scale_by_lr_factor())
    params = {"w": jnp.full((3,), 2.0, jnp.float32)}
    state = rx.train.init_train_state(params, opt)
    log = pl.tools.MetricsLog(str(tmp_path), "q", quiet=True)
    ops = pl.OpsConfig(quiet=True, lr_backoff=10.0, max_rollbacks=6, loss_spike=10.0)
    res = pl.loop.run_iterations(
        state, _quadratic_iteration(opt), num_iterations=12, key=jax.random.key(1), ops=ops, log=log
    )
    assert res.rollbacks >= 1
    assert all(math.isfinite(h["loss"]) for h in res.history)
    assert max(h["loss"] for h in res.history) < 1e3
    assert pl.loop.get_lr_scale(res.state.opt_state) < 1.0


def test_kl_guard_stops_with_the_last_policy_within_the_target(tmp_path):
    # The rollout of iteration i measures the KL of the state before it (0.01 i): at i = 5
    # it passes the target, so the last policy within it is the state before iteration 4.
    state, opt = _quadratic_state()
    inner = _quadratic_iteration(opt)

    def iteration(s, k, i):
        s2, m, _ = inner(s, k, i)
        return s2, m, {"kl": 0.01 * i}

    log = pl.tools.MetricsLog(str(tmp_path), "q", quiet=True)
    kw = dict(
        num_iterations=10,
        key=jax.random.key(0),
        ops=pl.OpsConfig(quiet=True),
        log=log,
        kl_target=0.045,
        checkpoint_dir=str(tmp_path / "ck"),
    )
    res = pl.loop.run_iterations(state, iteration, **kw)
    assert res.stopped == "kl_guard" and res.iterations == 5 and int(res.state.step) == 4
    assert any('"kl_guard"' in line for line in _lines(log.path))
    # A checkpoint of that policy is written; resuming the stopped run returns it at once.
    assert pl.tools.latest_checkpoint(str(tmp_path / "ck")).endswith("iter_00000005")
    again = pl.loop.run_iterations(state, iteration, resume=True, **kw)
    assert again.stopped == "kl_guard" and again.history == []
    assert int(again.state.step) == 4


# --- rollouts --------------------------------------------------------------------------


def test_sample_rollout_repeats_prompts_and_matches_the_model(tok):
    policy = _tiny_policy()
    prompts = ["Once upon a time", "The dog"]
    roll = pl.runs.sample_rollout(
        policy, tok, prompts, jax.random.key(0), group_size=3, prompt_length=12, max_new_tokens=6
    )
    assert roll.tokens.shape == (6, 18) and roll.prompts == tuple(
        p for p in prompts for _ in range(3)
    )
    assert len(roll.texts) == 6 and roll.truncated.shape == (6,)
    lp = pl.runs.token_logps(policy, roll.tokens, roll.mask)
    m = roll.completion_mask & roll.mask
    np.testing.assert_allclose(np.where(m, lp, 0.0), roll.logprobs, atol=2e-5)
    with pytest.raises(ValueError, match="prompt_length=4"):
        pl.runs.sample_rollout(
            policy,
            tok,
            ["a long prompt with many words"],
            jax.random.key(0),
            prompt_length=4,
            max_new_tokens=2,
        )


def test_reward_functions_weights_and_zero_std():
    roll = pl.runs.Rollout(
        tokens=jnp.zeros((4, 2), jnp.int32),
        mask=jnp.ones((4, 2), bool),
        completion_mask=jnp.ones((4, 2), bool),
        logprobs=jnp.zeros((4, 2)),
        truncated=jnp.zeros((4,), bool),
        prompts=("p",) * 4,
        texts=("a dog", "nothing", "a cat", "x"),
        group_size=2,
    )
    fns = [
        pl.runs.RewardFunction("animal", lambda p, t: pl.task.animal_score(t), 2.0),
        pl.runs.RewardFunction("short", lambda p, t: float(len(t) < 3), 1.0),
    ]
    total, metrics = pl.runs.score_rollout(roll, fns)
    np.testing.assert_allclose(total, [2.0, 0.0, 2.0, 1.0])
    assert metrics == {"reward/animal": 0.5, "reward/short": 0.25}
    assert pl.runs.group_signal(np.array([1.0, 1.0, 0.0, 1.0]), 2) == 0.5
    with pytest.raises(ValueError, match="'bad' returned nan for prompt 0.*not finite"):
        pl.runs.score_rollout(roll, [pl.runs.RewardFunction("bad", lambda p, t: math.nan)])


def test_rows_at_is_deterministic_and_covers_epochs():
    rows = [pl.loop.rows_at(10, 4, 0, i) for i in range(4)]
    assert all(len(r) == 4 for r in rows)
    assert len(set(np.concatenate(rows[:2]).tolist())) == 8
    np.testing.assert_array_equal(pl.loop.rows_at(10, 4, 0, 3), rows[3])
    assert len(pl.loop.rows_at(3, 8, 0, 0)) == 8


def test_win_rate_pairs_and_ties():
    assert pl.runs.win_rate([1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 1.0, 1.0]) == pytest.approx(0.5)
    assert pl.runs.win_rate([1.0, 1.0], [0.0, 0.0]) == 1.0
    with pytest.raises(ValueError, match="paired"):
        pl.runs.win_rate([1.0], [1.0, 0.0])


# --- runs on a tiny model --------------------------------------------------------------


@pytest.mark.slow
def test_model_remat_reaches_the_policy_and_trains_the_same_losses(tmp_path, tok):
    """`model.remat` reaches the loaded policy (`rx.with_remat`), is checked by name, may
    change on resume, and an SFT run with the products' outputs kept (`"dots"`) or only
    each layer's input (`"full"`) logs the losses of the run without remat."""
    cfg = pl.apply_overrides(pl.PipelineConfig(), ["model.remat=dots"])
    assert pl.tools.load_configured_model(cfg)[0].cfg.remat == "dots"
    with pytest.raises(pl.ConfigError, match="model.remat=.*must be one of none, dots, full"):
        pl.config.validate_config(pl.apply_overrides(pl.PipelineConfig(), ["model.remat=all"]))
    records = [("Once upon a time", " there was a dog."), ("The cat", " sat on a mat.")] * 4
    sft = pl.SFTConfig(
        steps=3, batch_size=4, max_length=32, optim=rx.train.OptimizerSettings(learning_rate=3e-2)
    )
    losses = {}
    for mode in (False, "dots", "full"):
        policy = rx.with_remat(_tiny_policy(), mode)
        res = pl.runs.run_sft(policy, tok, records, cfg=sft, ctx=_ctx(tmp_path / str(mode)))
        losses[mode] = [r["loss"] for r in res.history]
    np.testing.assert_allclose(losses["dots"], losses[False], rtol=1e-5)
    np.testing.assert_allclose(losses["full"], losses[False], rtol=1e-5)


def test_sft_run_lowers_the_loss_and_grpo_run_logs_its_signal(tmp_path, tok):
    policy = _tiny_policy()
    records = [("Once upon a time", " there was a dog."), ("The cat", " sat on a mat.")] * 4
    cfg = pl.SFTConfig(
        steps=6,
        batch_size=4,
        max_length=32,
        optim=rx.train.OptimizerSettings(learning_rate=3e-2),
        lora=pl.LoRASettings(rank=8, alpha=16.0, dropout=0.0, targets=("q", "v", "up", "down")),
    )
    calls = []

    def evaluate(model):
        calls.append(model)
        return {"score": 0.5}

    ctx = dataclasses.replace(_ctx(tmp_path, eval_every=2), evaluate=evaluate)
    res = pl.runs.run_sft(policy, tok, records, cfg=cfg, ctx=ctx)
    assert len(res.history) == 6 and res.history[-1]["loss"] < res.history[0]["loss"]
    # Periodic evaluation on the merged policy at iterations 2 and 4 (the end is the
    # caller's final evaluation).
    assert len(calls) == 2 and all(isinstance(m, rx.Policy) for m in calls)
    evals = [json.loads(x) for x in _lines(ctx.log.path) if '"eval"' in x]
    assert [e["iteration"] for e in evals] == [2, 4] and evals[0]["score"] == 0.5
    merged = pl.runs.final_policy(res.state.model)
    assert isinstance(merged, rx.Policy)

    gcfg = pl.GRPOConfig(
        rollouts=2,
        prompts_per_rollout=2,
        group_size=2,
        beta=0.0,
        kl_target=10.0,
        optim=rx.train.OptimizerSettings(learning_rate=1e-2, warmup_ratio=0.1),
        lora=pl.LoRASettings(rank=2, alpha=4.0, dropout=0.0),
    )
    fns = [pl.runs.RewardFunction("len", lambda p, t: float(len(t) % 2))]
    res = pl.runs.run_grpo(
        policy,
        tok,
        ["Once upon a time", "The dog"],
        reward=fns,
        cfg=gcfg,
        ctx=_ctx(tmp_path / "g"),
    )
    assert res.loop.iterations == 2
    last = res.history[-1]
    for k in ("rollout/frac_reward_zero_std", "rollout/kl", "rollout/reward/len", "loss"):
        assert k in last and math.isfinite(last[k])


def test_packed_dpo_run_holds_every_pair_in_one_shape(tmp_path, tok):
    """`dpo.packing`: token-budget batches of one shape hold every pair once, about
    `batch_size` pairs a step; the run starts at ln 2 (policy == reference) and learns."""
    policy = _tiny_policy()
    rng = np.random.default_rng(0)
    words = ["dog", "cat", "sun", "tree", "boat", "rain", "hill", "fox"]
    say = lambda n: " ".join(rng.choice(words, n))
    records = [
        rx.data.PreferenceRecord(
            say(int(rng.integers(2, 9))),
            " " + say(int(rng.integers(1, 6))),
            " " + say(int(rng.integers(1, 6))),
        )
        for _ in range(13)
    ]
    cfg = pl.DPOConfig(
        steps=4,
        batch_size=4,
        max_length=32,
        packing=True,
        beta=0.5,
        optim=rx.train.OptimizerSettings(learning_rate=5e-2),
        lora=pl.LoRASettings(rank=4, alpha=8.0, dropout=0.0),
    )
    batches = pl.runs.packed_steps(records, tok, cfg=cfg, prompt_length=24, seed=0)
    assert {b.tokens.shape[1] for b in batches} == {64} and len(
        {b.tokens.shape for b in batches}
    ) == 1
    assert sum(int(b.pairs.sum()) for b in batches) == len(records)
    assert 2 <= len(records) / len(batches) <= 8  # about batch_size pairs a step
    res = pl.runs.run_dpo(policy, tok, records, cfg=cfg, ctx=_ctx(tmp_path))
    assert res.loop.iterations == 4
    assert res.history[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert res.history[-1]["loss"] < math.log(2)
