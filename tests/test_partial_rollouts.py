"""Partial rollouts in asynchronous GRPO (`grpo.partial_rollouts`): the segments' schedule,
continued rows carrying the log-probs of the policy that sampled each token, stopped rows
left alone, the run colocated and on split meshes, and an exact resume after SIGKILL
with rollouts in flight. The split runs use the eight simulated CPU devices that
tests/conftest.py sets up."""

import dataclasses

import equinox as eqx
import jax
import numpy as np
import pytest
from helpers import ADAM_EPS, assert_adam_steps_agree, assert_same_saved_params, kill_9_then_resume

import rlhf_eqx as rx
from rlhf_eqx import pipelines as pl

_PROMPTS = [f"Once upon a time {i}" for i in range(12)]
_PARITY = [pl.runs.RewardFunction("parity", lambda p, t: float(len(t) % 2))]
_TIMING = ("stage", "time", "iteration_time_s", "tokens_per_s", "rollout/overlapped")
_SYNC = ("rollout/weight_sync_s", "rollout/weight_sync_bytes", "rollout/base_transfers")
_PARTIAL = ("rollout/partial_segments", "rollout/version_lag")


@pytest.fixture(scope="module")
def builtin():
    return pl.tools.load_model("builtin")


def test_segments_schedule():
    """Segment i of rollout q is sampled by the policy of update max(q - k + i, 0), S
    tokens each and the last (the consuming update's policy) up to max_new_tokens;
    repeated versions at the start are one segment, and S >= max_new_tokens is the stale
    policy's whole rollout."""
    seg = lambda q, k, s: pl.runs.partial_segments(q, staleness=k, segment=s, max_new_tokens=8)  # noqa: E731
    assert seg(5, 2, 3) == ((3, 3), (4, 3), (5, 2))
    assert seg(5, 2, 5) == ((3, 5), (4, 3))  # nothing left for the newest policy
    assert seg(5, 1, 3) == ((4, 3), (5, 5))
    assert seg(1, 2, 3) == ((0, 3), (1, 5))  # versions 0, 0, 1: the first two are one
    assert seg(0, 3, 2) == ((0, 8),)
    for q in range(4):
        assert seg(q, 2, 8) == ((max(q - 2, 0), 8),)
        assert seg(q, 2, 9) == ((max(q - 2, 0), 8),)


def _nudged(policy, seed):
    """`policy` with every float weight moved by N(0, 0.05^2): another policy version."""
    arrays, rest = eqx.partition(policy, eqx.is_inexact_array)
    leaves, treedef = jax.tree.flatten(arrays)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    moved = [x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return eqx.combine(jax.tree.unflatten(treedef, moved), rest)


def _three_segments(builtin, stop_ids):
    """Rollout in segments of 3, 3 and 2 tokens by three policy versions."""
    policy, tok = builtin
    models = [policy, _nudged(policy, 1), _nudged(policy, 2)]
    key = jax.random.key(3)
    kw = dict(temperature=1.0)
    pending = pl.runs.dispatch_rollout(
        models[0],
        tok,
        _PROMPTS[:8],
        key,
        group_size=2,
        prompt_length=16,
        max_new_tokens=3,
        stop_ids=stop_ids,
        **kw,
    )
    first = pending
    for i, (model, n) in enumerate(zip(models[1:], (3, 2)), start=1):
        pending = pl.runs.continue_rollout(
            model, pending, jax.random.fold_in(key, i), max_new_tokens=n, pad_id=tok.pad_id, **kw
        )
    return models, first, pending


def test_each_token_has_the_log_prob_of_its_policy(builtin):
    """Tokens 1-3 sampled by version 0, 4-6 by version 1 (a fresh prefill of prompt +
    tokens so far), 7-8 by version 2: each token's behaviour log-prob is the teacher-forced
    log-prob of its own version (and not the other versions')."""
    models, _, pending = _three_segments(builtin, None)
    out, P = pending.out, 16
    assert out.tokens.shape == (16, P + 8)
    versions = np.repeat([0, 1, 2], [3, 3, 2])
    real = np.asarray(out.completion_mask)[:, P:]
    assert real.all()  # the built-in model does not stop within 8 tokens
    for v, model in enumerate(models):
        lp = jax.vmap(lambda t, m, model=model: rx.token_logprobs(model, t, m, temperature=1.0))(
            out.tokens, out.mask
        )
        own, theirs = np.asarray(out.logprobs)[:, P:], np.asarray(lp)[:, P:]
        np.testing.assert_allclose(own[:, versions == v], theirs[:, versions == v], atol=1e-4)
        assert np.abs(own[:, versions != v] - theirs[:, versions != v]).max() > 1e-2


def test_rows_stopped_in_the_first_segment_are_not_continued(builtin):
    """With a frequent token as an extra stop id, the rows that stop within the first
    segment keep their tokens; everything after is padding with masks off and zero
    log-probs, while the other rows go on."""
    policy, tok = builtin
    _, plain, _ = _three_segments(builtin, None)
    early = np.asarray(plain.out.tokens)[:, 16:]
    counts = np.bincount(early[:, :2].reshape(-1))
    stop = int(np.argmax(counts))  # among the first two tokens of some rows, not of all
    stops = (tok.eos_id, tok.bos_id, stop)
    _, first, pending = _three_segments(builtin, stops)
    comp = np.asarray(first.out.completion_mask)[:, 16:]
    last = np.asarray(first.out.tokens)[:, -1]
    stopped = ~comp.all(axis=1) | np.isin(last, stops)
    assert 0 < stopped.sum() < len(stopped)
    out = pending.out
    np.testing.assert_array_equal(np.asarray(out.tokens)[:, : 16 + 3], first.out.tokens)
    after = slice(16 + 3, None)
    assert not np.asarray(out.completion_mask)[stopped, after].any()
    assert not np.asarray(out.mask)[stopped, after].any()
    assert (np.asarray(out.tokens)[stopped, after] == tok.pad_id).all()
    assert (np.asarray(out.logprobs)[stopped, after] == 0.0).all()
    assert np.asarray(out.completion_mask)[~stopped, 16 + 3].all()


def _first_segment(builtin, place=None):
    """16 rows (8 prompts x 2) of 3 tokens by the built-in policy, none stopped."""
    policy, tok = builtin
    return pl.runs.dispatch_rollout(
        policy,
        tok,
        _PROMPTS[:8],
        jax.random.key(3),
        group_size=2,
        prompt_length=16,
        max_new_tokens=3,
        temperature=1.0,
        place=place,
    )


def _stopped_early(pending, rows, pad_id):
    """`pending` with the rows `rows` ended one position early (the last a pad token with
    masks off and log-prob 0): stopped rows, which a continuation leaves alone. The
    arrays keep their layout."""
    out = pending.out

    def cut(x, value):
        y = np.asarray(x).copy()
        y[np.asarray(rows, np.int64), -1] = value
        return jax.device_put(y, x.sharding)

    grown = rx.GenerationOutput(
        tokens=cut(out.tokens, pad_id),
        mask=cut(out.mask, False),
        completion_mask=cut(out.completion_mask, False),
        logprobs=cut(out.logprobs, 0.0),
    )
    return dataclasses.replace(pending, out=grown)


@pytest.mark.slow
def test_a_rows_continuation_does_not_depend_on_the_other_rows(builtin):
    """Row `b` continues with the key `fold_in(key, b)` whichever other rows still run:
    with all 16 rows running, 13 (16 sampled, 3 of them padding), 5 (8 sampled), 2 or 1,
    each running row gets the same tokens and log-probs, those of the row continued
    alone by `generate_continuous`; the rows so far are unchanged, and the stopped rows
    get pad tokens, masks off and log-prob 0 (nothing the padding sampled leaks)."""
    policy, tok = builtin
    first = _first_segment(builtin)
    key, L, N = jax.random.key(7), 16 + 3, 4
    cont = lambda pending: (
        pl.runs.continue_rollout(  # noqa: E731
            policy, pending, key, max_new_tokens=N, temperature=1.0, pad_id=tok.pad_id
        ).out
    )
    full = cont(first)
    fields = ("tokens", "mask", "completion_mask", "logprobs")
    want = {f: np.asarray(getattr(full, f)) for f in fields}
    assert want["completion_mask"][:, L:].all()  # the built-in model does not stop here
    rng = np.random.default_rng(0)
    for n in (13, 5, 2, 1):
        running = np.sort(rng.choice(16, n, replace=False))
        stopped = np.setdiff1d(np.arange(16), running)
        pending = _stopped_early(first, stopped, tok.pad_id)
        out = cont(pending)
        got = {f: np.asarray(getattr(out, f)) for f in fields}
        for f in fields:
            np.testing.assert_array_equal(got[f][:, :L], np.asarray(getattr(pending.out, f)))
        for f in ("tokens", "mask", "completion_mask"):
            np.testing.assert_array_equal(got[f][running, L:], want[f][running, L:], err_msg=f)
        np.testing.assert_allclose(
            got["logprobs"][running, L:], want["logprobs"][running, L:], atol=1e-5
        )
        assert (got["tokens"][stopped, L:] == tok.pad_id).all()
        assert not got["mask"][stopped, L:].any() and not got["completion_mask"][stopped, L:].any()
        assert (got["logprobs"][stopped, L:] == 0.0).all()
    b = 5
    alone = rx.generate_continuous(
        policy,
        first.out.tokens[b : b + 1],
        first.out.mask[b : b + 1],
        jax.random.fold_in(key, b)[None],
        slots=1,
        max_new_tokens=N,
        temperature=1.0,
        eos_id=list(first.stop_ids),
        pad_id=tok.pad_id,
    )
    np.testing.assert_array_equal(np.asarray(alone.tokens)[0], want["tokens"][b])
    np.testing.assert_allclose(
        np.asarray(alone.logprobs)[0, L:], want["logprobs"][b, L:], atol=1e-5
    )


@pytest.mark.slow
def test_continuations_sample_a_few_bucket_sizes(builtin):
    """Continuing 1, 3, 4, 6 or 16 of a rollout's 16 rows samples 1, 4, 4, 8 and 16 rows
    (the next power of two): four traces of the sampler for five counts; with the rows
    over a 4-device `"data"` mesh, multiples of 4 (1 and 3 rows: 4 sampled, 5: 8)."""
    policy, tok = builtin
    traces = []

    def listen(event, duration, fun_name="", **_):
        if event == "/jax/core/compile/jaxpr_trace_duration" and "generate_batch" in fun_name:
            traces.append(fun_name)

    mesh = jax.sharding.Mesh(np.array(jax.devices()[4:8]), ("data",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    placed = []

    def place(tokens, mask):
        placed.append(tokens.shape[0])
        return jax.device_put((tokens, mask), rows)

    def sampled(first, counts, place=None):
        traces.clear()
        for n in counts:
            pending = _stopped_early(first, np.arange(n, 16), tok.pad_id)
            kw = dict(max_new_tokens=5, temperature=1.0, pad_id=tok.pad_id, place=place)
            out = pl.runs.continue_rollout(policy, pending, jax.random.key(1), **kw).out
            real = np.asarray(out.completion_mask)[:, -5:]
            assert real[:n].all() and not real[n:].any()
        return len(traces)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        assert sampled(_first_segment(builtin), (1, 3, 4, 6, 16)) == 4
        first = _first_segment(builtin, place)
        placed.clear()
        assert sampled(first, (1, 3, 5), place) == 2
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert placed == [4, 4, 8]


def _ctx(tmp_path, name, **ops):
    return pl.RunContext(
        ops=pl.OpsConfig(monitor=False, quiet=True, **ops),
        log=pl.tools.MetricsLog(str(tmp_path), name, quiet=True),
        key=jax.random.key(0),
        checkpoint_dir=None,
        prompt_length=16,
        max_new_tokens=8,
    )


def _cfg(**changes):
    cfg = pl.animal_task_config().grpo
    optim = dataclasses.replace(cfg.optim, warmup_ratio=0.0)  # the first update moves
    defaults = dict(rollouts=3, prompts_per_rollout=4, group_size=2, optim=optim)
    return dataclasses.replace(cfg, **dict(defaults, **changes))


def _grpo(builtin, tmp_path, name, ops=None, **changes):
    policy, tok = builtin
    ctx = _ctx(tmp_path, name, **(ops or {}))
    res = pl.runs.run_grpo(policy, tok, _PROMPTS, reward=_PARITY, cfg=_cfg(**changes), ctx=ctx)
    records = [r for r in pl.tools.read_records(str(tmp_path)) if r.get("stage") == name]
    return res, [r for r in records if "step" in r]


def _numbers(records, leave=()):
    """The records' numbers, without timings, transfers, the keys `leave` and the
    token counts by version lag; their other entries (events) as they are, to compare."""
    return [
        {
            k: v if isinstance(v, int | float) else str(v)
            for k, v in r.items()
            if k not in _TIMING + _SYNC + leave and "tokens_lag" not in k
        }
        for r in records
    ]


def _close(a, b, rtol=1e-3, atol=1e-4):
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for key in ra:
            if isinstance(ra[key], str):
                assert ra[key] == rb[key], key
            else:
                np.testing.assert_allclose(ra[key], rb[key], rtol=rtol, atol=atol, err_msg=key)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(partial_rollouts=3), r"grpo.partial_rollouts=3: needs grpo.staleness >= 1"),
        (dict(partial_rollouts=-1, staleness=1), r"grpo.partial_rollouts=-1: must be >= 0"),
        (
            dict(partial_rollouts=3, staleness=1, dynamic_sampling=2),
            r"grpo.partial_rollouts=3: .* grpo.dynamic_sampling=0 \(got 2\)",
        ),
    ],
)
def test_bad_partial_rollouts_are_refused(changes, message):
    with pytest.raises(pl.ConfigError, match=message):
        pl.config.validate_stage("grpo", _cfg(**changes))


@pytest.mark.parametrize("segment", [8, 9])
def test_a_segment_of_the_whole_completion_is_refused(builtin, tmp_path, segment):
    """The segment must be shorter than `sampling.max_new_tokens` (8 here): a longer one
    is the run without partial rollouts."""
    with pytest.raises(pl.ConfigError, match=rf"grpo.partial_rollouts={segment}: must be 0"):
        _grpo(builtin, tmp_path, "long", staleness=1, partial_rollouts=segment)


@pytest.mark.slow
def test_partial_run_colocated(builtin, tmp_path):
    """Staleness 1, segments of 3 tokens: rollout 0 has one segment, the initial policy's
    (its record is the plain staleness-1 run's); rollout 1's first 3 tokens of each row
    come from the policy of update 0 and the other 5 from the policy of update 1, so its
    mean version lag is 3/8 and the run differs from the plain one from there on."""
    plain = _grpo(builtin, tmp_path, "plain", staleness=1)
    part = _grpo(builtin, tmp_path, "partial", staleness=1, partial_rollouts=3)
    recs = part[1]
    assert [r["rollout/partial_segments"] for r in recs] == [1.0, 2.0, 2.0]
    assert [r["rollout/version_lag"] for r in recs] == [0.0, 3 / 8, 3 / 8]
    rows = 4 * 2
    assert [(r["rollout/tokens_lag_0"], r["rollout/tokens_lag_1"]) for r in recs] == [
        (8.0 * rows, 0.0)
    ] + [(5.0 * rows, 3.0 * rows)] * 2
    _close(_numbers(recs[:1], _PARTIAL), _numbers(plain[1][:1]), rtol=0, atol=0)
    assert recs[1]["rollout/kl"] != plain[1][1]["rollout/kl"]


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_partial_run_on_split_meshes(builtin, tmp_path):
    """Split placement (trainer fsdp:4, sampler data:4), staleness 2, segments of 3: the
    sampler starts rollouts two ahead and continues them with each new policy during the
    updates; the run is the colocated one, where every segment runs when its rollout is
    consumed. Adam's `eps` is `ADAM_EPS`, so that the float reassociation of FSDP's
    gradients moves no parameter by more than `1e-2 · lr` a step (tests/helpers.py)."""
    optim = dataclasses.replace(_cfg().optim, eps=ADAM_EPS)
    kw = dict(staleness=2, partial_rollouts=3, rollouts=4, optim=optim)
    split = _grpo(builtin, tmp_path, "split", placement="split", trainer_mesh="fsdp:4", **kw)
    assert [r["rollout/overlapped"] for r in split[1]] == [0.0, 1.0, 1.0, 1.0]
    assert [r["rollout/queued"] for r in split[1]] == [2.0, 2.0, 1.0, 0.0]
    assert [r["rollout/partial_segments"] for r in split[1]] == [1.0, 2.0, 3.0, 3.0]
    colocated = _grpo(builtin, tmp_path, "colocated", **kw)
    _close(_numbers(split[1], ("rollout/queued",)), _numbers(colocated[1]))
    params = [run[0].state.params for run in (split, colocated)]
    assert_adam_steps_agree(*params, lr=optim.learning_rate, steps=4)


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_partial_rollouts_after_rollbacks(builtin, tmp_path):
    """A KL spike rolls the split run back (a copy of an earlier state): the rollouts in
    flight, continued by the discarded policies, are dropped and sampled again in the
    same segments; the run equals the one without overlap, which samples every segment
    when its rollout is consumed."""
    ops = dict(kl_spike=5e-3, max_rollbacks=2)  # iteration 1 spikes at the full learning rate
    kw = dict(staleness=2, partial_rollouts=3, rollouts=4, kl_target=10.0)
    kw.update(placement="split", trainer_mesh="fsdp:4")
    on = _grpo(builtin, tmp_path, "on", ops, **kw)
    off = _grpo(builtin, tmp_path, "off", ops, overlap=False, **kw)
    assert on[0].loop.rollbacks >= 1
    flags = [r["rollout/overlapped"] for r in on[1] if "rollout/overlapped" in r]
    assert 1.0 in flags and 0.0 in flags[1:]  # the re-run after the rollback samples anew
    _close(_numbers(on[1], ("rollout/queued",)), _numbers(off[1]), rtol=0, atol=0)


@pytest.mark.slow
def test_kill_9_with_partial_rollouts_in_flight_then_resume_is_exact(tmp_path):
    """A split, staleness-2 run with segments of 3 tokens, killed with SIGKILL once its
    second checkpoint exists (rollouts started and continued on the sampler), resumes from
    the checkpoint's stale policies, samples the rollouts in flight again in the same
    segments and ends with the uninterrupted run's records and parameters."""
    changes = dict(staleness=2, partial_rollouts=3, placement="split", trainer_mesh="fsdp:4")
    full, cut = kill_9_then_resume(tmp_path, changes)
    events = [r for r in pl.tools.read_records(str(cut)) if r.get("event")]
    assert [r["iteration"] for r in events if r["event"] == "resume"][0] >= 1  # rollouts in flight

    def by_step(out):  # the last record of each step (a resumed run repeats the lost ones)
        recs = [r for r in pl.tools.read_records(str(out)) if "step" in r]
        return [v for _, v in sorted({r["step"]: r for r in recs}.items())]

    want, got = by_step(full), by_step(cut)
    assert [r["rollout/partial_segments"] for r in want] == [1.0, 2.0, 3.0, 3.0, 3.0, 3.0]
    _close(_numbers(got, ("rollout/queued",)), _numbers(want, ("rollout/queued",)), 0, 0)
    assert_same_saved_params(full, cut)


def test_the_segment_is_checked_against_max_new_tokens_before_loading():
    """`grpo.partial_rollouts` at or above `sampling.max_new_tokens` (the task's 40) is
    refused with the whole configuration, naming the field and the bound."""
    cfg = pl.apply_overrides(
        pl.animal_task_config(), ["grpo.staleness=1", "grpo.partial_rollouts=40"]
    )
    with pytest.raises(pl.ConfigError, match=r"grpo.partial_rollouts=40: .*max_new_tokens=40\)"):
        pl.config.validate_config(dataclasses.replace(cfg, stages=("sft", "grpo")))
    ok = pl.apply_overrides(cfg, ["grpo.partial_rollouts=16"])
    pl.config.validate_config(dataclasses.replace(ok, stages=("sft", "grpo")))
