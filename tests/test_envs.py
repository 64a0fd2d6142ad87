"""Multi-turn rollouts: sampler log-probs == full forward, jit == host-driven == Python
environment, the trajectory's layout and rewards, GRPO on a multi-turn batch, and the
animal follow-up environment."""

import os
import runpy

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, strategies as st

import rlhf_eqx as rx
from rlhf_eqx.assets import asset_path
from rlhf_eqx.envs import (
    AnimalFollowUpEnv,
    Environment,
    HostEnvironment,
    Trajectory,
    animal_followup_score,
    rollout_multiturn,
    rollout_multiturn_host,
)
from rlhf_eqx.train import GRPOBatch, make_grpo_step

CFG = rx.TransformerConfig(
    vocab_size=53, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=64
)
EOS = 3
OBS0 = (50, 51)  # reset's observation, written with a hole: [50, -, 51, -]
G = 3
SETTINGS = dict(
    max_turns=3,
    max_new_tokens=6,
    max_total_tokens=26,
    temperature=0.8,
    top_k=40,
    eos_id=EOS,
    num_samples=G,
)


class Guess(Environment):
    """Reset draws a target id in [10, 20); a turn's reward is the number of times it
    sampled the target plus 0.5 per earlier turn; done when it hit the target. The
    observation after turn k is `[target, 52 - k]` written with holes in the mask."""

    max_observation_tokens: int = eqx.field(static=True, default=4)

    def reset(self, key, prompt, prompt_mask):
        target = jax.random.randint(key, (), 10, 20, dtype=jnp.int32)
        obs = jnp.array([OBS0[0], 0, OBS0[1], 0], jnp.int32)
        mask = jnp.array([True, False, True, False])
        return (target, jnp.zeros((), jnp.int32)), obs, mask

    def step(self, state, completion, completion_mask):
        target, turn = state
        hits = jnp.sum((completion == target) & completion_mask)
        reward = hits.astype(jnp.float32) + 0.5 * turn.astype(jnp.float32)
        obs = jnp.stack([jnp.zeros((), jnp.int32), target, jnp.zeros((), jnp.int32), 52 - turn])
        mask = jnp.array([False, True, False, True])
        return (target, turn + 1), obs, mask, reward, hits > 0


class HostGuess(HostEnvironment):
    """`Guess` in plain Python, for a given target."""

    max_observation_tokens = 4

    def __init__(self, target: int):
        self.target = target
        self.turn = 0
        self.prompts: list[list[int]] = []

    def reset(self, prompt):
        self.prompts.append(list(prompt))
        return list(OBS0)

    def step(self, completion):
        hits = sum(t == self.target for t in completion)
        reward = hits + 0.5 * self.turn
        obs = [self.target, 52 - self.turn]
        self.turn += 1
        return obs, reward, hits > 0


def _prompts():
    # left-padded prompts of different lengths (and one right-padded)
    toks = jnp.array(
        [
            [0, 0, 7, 8, 9, 10],
            [11, 12, 13, 14, 15, 16],
            [0, 0, 0, 0, 17, 18],
            [21, 22, 23, 0, 0, 0],
        ],
        jnp.int32,
    )
    masks = toks != 0
    return toks, masks


def _targets(key, n):
    """The targets `Guess` draws, from the documented key derivation: episode `e` has key
    `split(key, E)[e]`, split into (policy key, environment key)."""
    keys = jax.random.split(key, n)
    env_keys = [jax.random.split(k)[1] for k in keys]
    return [
        int(Guess().reset(k, jnp.zeros(1, jnp.int32), jnp.ones(1, bool))[0][0]) for k in env_keys
    ]


@pytest.fixture(scope="module")
def policy():
    return rx.Policy(CFG, key=jax.random.key(1))


@pytest.fixture(scope="module")
def jitted(policy):
    toks, masks = _prompts()
    return rollout_multiturn(policy, Guess(), toks, masks, jax.random.key(3), **SETTINGS)


@pytest.fixture(scope="module")
def host_python(policy):
    toks, masks = _prompts()
    E = toks.shape[0] * G
    envs = [HostGuess(t) for t in _targets(jax.random.key(3), E)]
    out = rollout_multiturn_host(policy, envs, toks, masks, jax.random.key(3), **SETTINGS)
    return out, envs


def _assert_same(a: Trajectory, b: Trajectory):
    for name in ("tokens", "mask", "loss_mask", "turn_ids", "num_turns", "truncated", "turn_limit"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    np.testing.assert_allclose(a.turn_rewards, b.turn_rewards, rtol=0, atol=1e-6)
    np.testing.assert_allclose(a.reward, b.reward, rtol=0, atol=1e-6)
    np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)


def test_sampled_logprobs_equal_full_forward_over_all_turns(policy, jitted):
    tr = jitted
    recomputed = jax.jit(jax.vmap(lambda t, m: rx.token_logprobs(policy, t, m, temperature=0.8)))(
        tr.tokens, tr.mask
    )
    diff = np.where(tr.loss_mask, np.asarray(recomputed) - np.asarray(tr.logprobs), 0.0)
    assert np.max(np.abs(diff)) < 1e-5
    assert np.all(np.asarray(tr.logprobs)[~np.asarray(tr.loss_mask)] == 0.0)
    assert int(jnp.max(tr.num_turns)) >= 2  # several turns were played


def test_trajectory_layout_and_rewards(jitted):
    """Rebuild every episode from its parts: prompt, then observation, turn, observation,
    ...; rewards and endings recomputed from the sampled turns."""
    tr = jax.tree.map(np.asarray, jitted)
    toks, masks = (np.asarray(x) for x in _prompts())
    P, T, K = toks.shape[1], SETTINGS["max_total_tokens"], SETTINGS["max_turns"]
    targets = _targets(jax.random.key(3), tr.tokens.shape[0])
    endings = set()
    assert np.all(tr.loss_mask <= tr.mask)
    for e in range(tr.tokens.shape[0]):
        i = e // G
        np.testing.assert_array_equal(tr.tokens[e, :P], toks[i])
        np.testing.assert_array_equal(tr.mask[e, :P], masks[i])
        pos, expected_reward, done = P, np.zeros(K, np.float32), False
        obs = list(OBS0)
        for k in range(int(tr.num_turns[e])):
            n_obs = min(len(obs), T - pos)
            assert tr.tokens[e, pos : pos + n_obs].tolist() == obs[:n_obs]
            assert not tr.loss_mask[e, pos : pos + n_obs].any()
            pos += n_obs
            turn = np.flatnonzero(tr.turn_ids[e] == k)
            assert turn.size > 0 and turn[0] == pos and np.all(np.diff(turn) == 1)
            assert tr.loss_mask[e, turn].all()
            sampled = tr.tokens[e, turn].tolist()
            stop = EOS in sampled
            assert not stop or sampled.index(EOS) == len(sampled) - 1  # a turn ends at EOS
            assert stop or len(sampled) == SETTINGS["max_new_tokens"] or turn[-1] == T - 1
            pos = turn[-1] + 1
            hits = sampled.count(targets[e])
            expected_reward[k] = hits + 0.5 * k
            done = hits > 0
            obs = [targets[e], 52 - k]
        if done:  # the environment ended it, after a whole turn or a cut one
            ending = "done" if stop else "done, cut"
        elif tr.num_turns[e] < K:  # the pending observation filled the buffer
            assert 0 <= T - pos < len(obs) or pos == T
            assert tr.tokens[e, pos:T].tolist() == obs[: T - pos]
            pos = T
            ending = "budget"
        else:  # the turn limit, unless the last turn was cut without its stop id
            ending = "turns" if stop else "budget"
        endings.add(ending)
        assert not tr.mask[e, pos:].any()  # nothing after the end
        np.testing.assert_allclose(tr.turn_rewards[e], expected_reward, atol=1e-6)
        np.testing.assert_allclose(tr.reward[e], expected_reward.sum(), atol=1e-6)
        assert bool(tr.truncated[e]) == (ending in ("budget", "done, cut")), (e, ending)
        assert bool(tr.turn_limit[e]) == (ending == "turns"), (e, ending)
    assert "budget" in endings and endings & {"done", "done, cut"}  # the endings that matter


def test_jit_rollout_equals_host_driven_rollout(policy, jitted):
    toks, masks = _prompts()
    host = rollout_multiturn_host(policy, Guess(), toks, masks, jax.random.key(3), **SETTINGS)
    _assert_same(jitted, host)


def test_python_environment_equals_jittable_environment(jitted, host_python):
    out, envs = host_python
    _assert_same(jitted, out)
    toks, masks = (np.asarray(x) for x in _prompts())
    for e, env in enumerate(envs):  # reset saw the real prompt ids only
        assert env.prompts == [toks[e // G][masks[e // G]].tolist()]


def test_last_turn_episode_reward(policy, host_python):
    out, _ = host_python
    toks, masks = _prompts()
    E = toks.shape[0] * G
    envs = [HostGuess(t) for t in _targets(jax.random.key(3), E)]
    last = rollout_multiturn_host(
        policy, envs, toks, masks, jax.random.key(3), episode_reward="last", **SETTINGS
    )
    idx = np.asarray(out.num_turns) - 1
    expected = np.asarray(out.turn_rewards)[np.arange(E), idx]
    np.testing.assert_allclose(last.reward, expected, atol=1e-6)
    np.testing.assert_array_equal(last.tokens, out.tokens)


def test_groups_share_one_prefill(policy, host_python):
    """`num_samples=G` equals every prompt repeated G times (same rows, same keys)."""
    out, _ = host_python
    toks, masks = _prompts()
    E = toks.shape[0] * G
    envs = [HostGuess(t) for t in _targets(jax.random.key(3), E)]
    settings = dict(SETTINGS, num_samples=1)
    rep = rollout_multiturn_host(
        policy, envs, jnp.repeat(toks, G, 0), jnp.repeat(masks, G, 0), jax.random.key(3), **settings
    )
    _assert_same(out, rep)


def test_multiturn_trajectory_trains_with_loss_mask_only(policy, jitted):
    """GRPO on a multi-turn batch: ratio 1 on-policy, the update is the policy gradient of
    the policy's own tokens only — observation and prompt log-probs never enter."""
    tr = jitted
    step = make_grpo_step(
        optax.sgd(1.0), group_size=G, mode="seq-mean-token-mean", temperature=0.8, donate=False
    )
    batch = GRPOBatch(
        tokens=tr.tokens,
        mask=tr.mask,
        completion_mask=tr.loss_mask,
        rewards=tr.reward,
        old_logp=tr.logprobs,
    )

    def update(b):
        opt_state = optax.sgd(1.0).init(eqx.filter(policy, eqx.is_inexact_array))
        new, _, metrics = step(policy, opt_state, b)
        delta = jax.tree.map(
            lambda a, c: a - c,
            eqx.filter(new, eqx.is_inexact_array),
            eqx.filter(policy, eqx.is_inexact_array),
        )
        return delta, metrics

    delta, metrics = update(batch)
    assert float(metrics["clip_ratio"]) == 0.0
    # changing the log-probs recorded outside the loss mask (prompt, observations) changes
    # nothing
    noise = jax.random.normal(jax.random.key(0), tr.logprobs.shape)
    moved = eqx.tree_at(lambda b: b.old_logp, batch, jnp.where(tr.loss_mask, tr.logprobs, noise))
    delta_moved, _ = update(moved)
    for a, b in zip(jax.tree.leaves(delta), jax.tree.leaves(delta_moved)):
        np.testing.assert_array_equal(a, b)

    # the closed form: -∇ [ -1/E Σ_e A_e mean_{t ∈ loss_mask_e} log π(t) ]
    rewards = np.asarray(tr.reward, np.float64).reshape(-1, G)
    adv = (rewards - rewards.mean(1, keepdims=True)) / (
        rewards.std(1, ddof=1, keepdims=True) + 1e-4
    )
    adv = jnp.asarray(adv.reshape(-1), jnp.float32)

    def objective(model, select):
        logp = jax.vmap(lambda t, m: rx.token_logprobs(model, t, m, temperature=0.8))(
            tr.tokens, tr.mask
        )
        count = jnp.maximum(jnp.sum(select, -1), 1).astype(jnp.float32)
        per_seq = jnp.sum(jnp.where(select, logp, 0.0), -1) / count
        return jnp.mean(adv * per_seq)

    gradient = eqx.filter_jit(eqx.filter_grad(objective))
    grads = gradient(policy, tr.loss_mask)
    for a, b in zip(jax.tree.leaves(delta), jax.tree.leaves(eqx.filter(grads, eqx.is_array))):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=2e-6)
    # while counting the observation tokens too would give a different update
    observations = tr.mask & ~tr.loss_mask & (jnp.arange(tr.tokens.shape[1]) >= 6)[None, :]
    wrong = gradient(policy, tr.loss_mask | observations)
    assert not all(
        np.allclose(a, b, rtol=1e-3, atol=2e-6)
        for a, b in zip(jax.tree.leaves(delta), jax.tree.leaves(eqx.filter(wrong, eqx.is_array)))
    )


class _Endless(Environment):
    """Never ends an episode: each turn is answered with one token and reward 1."""

    max_observation_tokens: int = eqx.field(static=True, default=1)

    def reset(self, key, prompt, prompt_mask):
        return jnp.zeros((), jnp.int32), jnp.zeros((1,), jnp.int32), jnp.zeros((1,), bool)

    def step(self, state, completion, completion_mask):
        obs = jnp.full((1,), 5, jnp.int32)
        return state + 1, obs, jnp.ones((1,), bool), jnp.ones((), jnp.float32), state < 0


def test_stop_ids_as_a_field_after_fields_without_a_default():
    """The documented override, a static `stop_ids` field with a default, may follow the
    subclass's fields that have none (it takes its place in their order)."""

    class Asks(Environment):
        question: jax.Array
        max_observation_tokens: int = eqx.field(static=True)
        stop_ids: tuple[int, ...] = eqx.field(static=True, default=(EOS,))

        def reset(self, key, prompt, prompt_mask):
            return jnp.zeros((), jnp.int32), self.question, self.question < 0

        def step(self, state, completion, completion_mask):
            return state, self.question, self.question >= 0, jnp.zeros(()), state >= 0

    env = Asks(jnp.asarray([5, 6]), max_observation_tokens=2)
    assert env.stop_ids == (EOS,) and Asks(env.question, 2, (7,)).stop_ids == (7,)
    assert Environment.stop_ids == () and _Endless().stop_ids == ()


@pytest.mark.slow
@pytest.mark.parametrize("rollout", [rollout_multiturn, rollout_multiturn_host])
def test_the_turn_limit_is_not_a_truncation(policy, rollout):
    """An environment that never ends its episodes: whole turns up to `max_turns` end by
    the turn limit (`turn_limit`, not `truncated`); turns cut at `max_new_tokens` without
    a stop id, or an episode out of buffer, are `truncated`."""
    toks, masks = _prompts()
    run = lambda **kw: rollout(policy, _Endless(), toks, masks, jax.random.key(3), **kw)
    every_id = tuple(range(CFG.vocab_size))  # each turn stops at its first token
    whole = run(max_turns=2, max_new_tokens=4, max_total_tokens=20, eos_id=every_id)
    assert np.all(np.asarray(whole.num_turns) == 2)
    assert np.asarray(whole.turn_limit).all() and not np.asarray(whole.truncated).any()
    cut = run(max_turns=2, max_new_tokens=4, max_total_tokens=20, eos_id=None)
    assert np.asarray(cut.truncated).all() and not np.asarray(cut.turn_limit).any()
    # a buffer too short for the second turn: the budget, whatever stops the turns
    short = run(max_turns=3, max_new_tokens=4, max_total_tokens=8, eos_id=every_id)
    assert np.all(np.asarray(short.num_turns) < 3) and np.asarray(short.truncated).all()

    class Once(_Endless):  # ends every episode after its first turn
        def step(self, state, completion, completion_mask):
            return super().step(state, completion, completion_mask)[:4] + (state >= 0,)

    # the environment ended them, but on a turn cut short: a cut answer is truncated
    for eos, cut in ((None, True), (every_id, False)):
        tr = rollout(policy, Once(), toks, masks, jax.random.key(3), max_turns=2,
                     max_new_tokens=4, max_total_tokens=20, eos_id=eos)  # fmt: skip
        assert np.all(np.asarray(tr.num_turns) == 1) and not np.asarray(tr.turn_limit).any()
        assert np.all(np.asarray(tr.truncated) == cut)


# ---------------------------------------------------------------------------- validation


def test_bad_arguments_raise(policy):
    toks, masks = _prompts()
    key = jax.random.key(0)
    run = lambda env=Guess(), **kw: rollout_multiturn(
        policy, env, toks, masks, key, **dict(SETTINGS, **kw)
    )
    with pytest.raises(ValueError, match="max_turns"):
        run(max_turns=0)
    with pytest.raises(ValueError, match="max_total_tokens"):
        run(max_total_tokens=6)
    with pytest.raises(ValueError, match="max_seq_len"):
        run(max_total_tokens=65)
    with pytest.raises(ValueError, match="episode_reward"):
        run(episode_reward="mean")
    with pytest.raises(ValueError, match=r"eos_id 60 is outside the vocabulary \[0, 53\)"):
        run(eos_id=(EOS, 60))
    with pytest.raises(TypeError, match="Environment"):
        run(env=HostGuess(3))
    with pytest.raises(ValueError, match="row 0 has no real token"):
        rollout_multiturn(policy, Guess(), toks, masks & False, key, **SETTINGS)

    class WrongObs(Guess):
        max_observation_tokens: int = eqx.field(static=True, default=3)

    with pytest.raises(ValueError, match=r"observation must be an int array of shape \(3,\)"):
        run(env=WrongObs())

    class GrowingState(Guess):
        def step(self, state, completion, completion_mask):
            out = super().step(state, completion, completion_mask)
            return ((out[0][0], out[0][1].astype(jnp.float32)),) + out[1:]

    with pytest.raises(ValueError, match="keep its structure"):
        run(env=GrowingState())


def test_an_environment_is_checked_without_a_policy():
    """`check_environment`: the rollout's checks of `reset` and `step`, and `stop_ids`
    inside the vocabulary, before anything is compiled."""
    check = rx.envs.check_environment
    assert check(Guess(), prompt_length=6, max_new_tokens=4, vocab_size=53) == Guess()

    class WrongObs(Guess):
        max_observation_tokens: int = eqx.field(static=True, default=3)

    with pytest.raises(ValueError, match=r"WrongObs.reset's observation must be an int array"):
        check(WrongObs(), prompt_length=6, max_new_tokens=4)

    class Stops(Guess):
        stop_ids = (EOS, 60)

    with pytest.raises(ValueError, match=r"Stops.stop_ids holds 60, outside the vocabulary"):
        check(Stops(), prompt_length=6, max_new_tokens=4, vocab_size=53)
    check(Stops(), prompt_length=6, max_new_tokens=4)  # no vocabulary: not checked

    class OneStop(Guess):
        stop_ids = EOS

    with pytest.raises(TypeError, match="OneStop.stop_ids must be a tuple of int token ids"):
        check(OneStop(), prompt_length=6, max_new_tokens=4)


def test_a_trajectory_is_checked_after_a_rollout_inside_vmap(jitted):
    """`check_trajectory`: what a rollout inside `jit` / `vmap` leaves unchecked."""
    check = rx.envs.check_trajectory
    assert check(jitted, environment="Guess", vocab_size=53) is jitted
    with pytest.raises(ValueError, match=r"Guess returned the observation id 50 \(episode 0, "):
        check(jitted, environment="Guess", vocab_size=50)  # reset's observation holds 50
    rewards = jitted.turn_rewards.at[1, 0].set(jnp.inf)
    bad = eqx.tree_at(lambda t: t.turn_rewards, jitted, rewards)
    with pytest.raises(ValueError, match=r"Guess.step returned the reward inf \(episode 1, turn 0"):
        check(bad, environment="Guess", vocab_size=53)


def test_host_observation_longer_than_declared_raises(policy):
    class Long(HostGuess):
        def reset(self, prompt):
            return [5] * 5

    toks, masks = _prompts()
    with pytest.raises(ValueError, match="5 tokens, more than its max_observation_tokens=4"):
        rollout_multiturn_host(policy, lambda: Long(3), toks, masks, jax.random.key(3), **SETTINGS)


class _Broken(Guess):
    """`Guess` whose observation after turn `turn` gets `offset` added to its ids and
    whose reward at that turn gets `bonus` added (it never ends at that turn)."""

    offset: int = eqx.field(static=True, default=0)
    bonus: float = eqx.field(static=True, default=0.0)
    turn: int = eqx.field(static=True, default=0)

    def step(self, state, completion, completion_mask):
        at = state[1] == self.turn
        new, obs, mask, reward, done = super().step(state, completion, completion_mask)
        obs = jnp.where(at, obs + self.offset, obs)
        return new, obs, mask, jnp.where(at, reward + self.bonus, reward), done & ~at


class _Dice(Environment):
    """Keeps a typed PRNG key in its state (as `Environment` advises for randomness in
    `step`): each turn's reward is a uniform draw, its observation a random id."""

    max_observation_tokens: int = eqx.field(static=True, default=1)

    def reset(self, key, prompt, prompt_mask):
        return (key, jnp.zeros((), jnp.int32)), jnp.zeros((1,), jnp.int32), jnp.zeros((1,), bool)

    def step(self, state, completion, completion_mask):
        key, turn = state
        key, sub = jax.random.split(key)
        obs = jax.random.randint(sub, (1,), 10, 20, dtype=jnp.int32)
        return (key, turn + 1), obs, jnp.ones((1,), bool), jax.random.uniform(sub), turn >= 1


def test_a_prng_key_in_the_state(policy):
    toks, masks = _prompts()
    run = lambda f: f(policy, _Dice(), toks, masks, jax.random.key(3), **SETTINGS)
    jitted, host = run(rollout_multiturn), run(rollout_multiturn_host)
    _assert_same(jitted, host)
    rewards = np.asarray(jitted.turn_rewards)[np.asarray(jitted.num_turns) == 2, :2]
    assert rewards.size and np.all((rewards > 0) & (rewards < 1))


@pytest.mark.parametrize("host", [False, True])
def test_environment_values_outside_the_vocabulary_or_not_finite_raise(policy, host):
    """An observation id outside the vocabulary (the next logits would be NaN) and a
    reward that is not finite are refused once the rollout is done, naming the class,
    the episode and where."""
    toks, masks = _prompts()
    run = rollout_multiturn_host if host else rollout_multiturn
    go = lambda env: run(policy, env, toks, masks, jax.random.key(3), **SETTINGS)
    with pytest.raises(ValueError, match=r"_Broken returned the observation id 6\d .*\[0, 53\)"):
        go(_Broken(offset=CFG.vocab_size - 40))
    with pytest.raises(ValueError, match=r"_Broken returned the observation id -\d+"):
        go(_Broken(offset=-60))
    with pytest.raises(ValueError, match=r"_Broken.step returned the reward (nan|inf).*turn 1"):
        go(_Broken(bonus=float("nan"), turn=1))
    with pytest.raises(ValueError, match=r"reward -inf \(episode 0, turn 0\)"):
        go(_Broken(bonus=-float("inf")))


def test_host_environment_answers_are_checked_and_failures_named(policy):
    toks, masks = _prompts()
    E = toks.shape[0] * G

    def go(make):
        return rollout_multiturn_host(policy, make, toks, masks, jax.random.key(3), **SETTINGS)

    def answer(**change):
        class Changed(HostGuess):
            def step(self, completion):
                obs, reward, done = super().step(completion)
                out = {"obs": obs, "reward": reward, "done": done, **change}
                return out.get("tuple") or (out["obs"], out["reward"], out["done"])

        return lambda: Changed(3)

    class Crash(HostGuess):
        def step(self, completion):
            if self.turn == 0:
                raise RuntimeError("the tool crashed")
            return super().step(completion)

    shared = HostGuess(3)
    for env in ([shared] * E, lambda: shared):
        with pytest.raises(ValueError, match=r"the same environment object to several episodes"):
            go(env)
    with pytest.raises(RuntimeError, match="the tool crashed") as info:
        go([HostGuess(3) if e != 4 else Crash(3) for e in range(E)])
    assert "raised by Crash.step of episode 4 at turn 0" in "".join(info.value.__notes__)

    def factory():
        raise OSError("no sandbox")

    with pytest.raises(OSError, match="no sandbox") as info:
        go(factory)
    assert "raised by the environment factory factory (episode 0)" in info.value.__notes__[0]
    with pytest.raises(ValueError, match=r"Changed.step of episode 0 at turn 0 .* id 53,"):
        go(answer(obs=[53]))
    with pytest.raises(ValueError, match="id -1, outside the vocabulary"):
        go(answer(obs=[-1, 4]))
    with pytest.raises(TypeError, match="sequence of token ids, got str"):
        go(answer(obs="ok"))
    with pytest.raises(TypeError, match=r"not a list of int ids: \[1.5\]"):
        go(answer(obs=[1.5]))
    with pytest.raises(ValueError, match="reward nan: rewards must be finite"):
        go(answer(reward=float("nan")))
    with pytest.raises(TypeError, match="reward None: it must be a real number"):
        go(answer(reward=None))
    with pytest.raises(TypeError, match="done='no': it must be a bool"):
        go(answer(done="no"))
    with pytest.raises(TypeError, match=r"must return \(observation, reward, done\)"):
        go(answer(tuple=([1], 0.0)))
    with pytest.raises(TypeError, match="reset of episode 0 must return the observation"):

        class NoObservation(HostGuess):
            def reset(self, prompt):
                return None

        go(lambda: NoObservation(3))

    class Silent(HostGuess):
        max_observation_tokens = 0

    with pytest.raises(ValueError, match="Silent.max_observation_tokens must be a positive int"):
        go(lambda: Silent(3))
    # NumPy answers are fine
    ok = go(answer(obs=np.asarray([5, 6]), reward=np.float32(1.0), done=np.bool_(True)))
    assert np.all(np.asarray(ok.num_turns) == 1)
    ok = go(answer(obs=jnp.asarray([5, 6]), reward=jnp.float32(1.0), done=jnp.asarray(False)))
    assert not np.asarray(ok.num_turns == 0).any() and np.asarray(ok.num_turns).max() > 1
    ended = np.asarray(ok.truncated).astype(int) + np.asarray(ok.turn_limit)
    assert np.all(ended == 1)  # never the environment: the budget or the turn limit


# -------------------------------------------------------------------------- animal task


@pytest.fixture(scope="module")
def tok512():
    return rx.data.Llama2cTokenizer.from_file(asset_path("tok512.bin"))


@pytest.fixture(scope="module")
def animal_env(tok512):
    return AnimalFollowUpEnv(tok512)


def _encode_batch(tok, texts, width):
    ids = np.zeros((len(texts), width), np.int32)
    mask = np.zeros((len(texts), width), bool)
    for i, text in enumerate(texts):
        row = tok.encode(text)[:width]
        ids[i, : len(row)] = row
        mask[i, : len(row)] = True
    return jnp.asarray(ids), jnp.asarray(mask)


def test_animal_env_reset_and_step_jit_and_vmap(animal_env, tok512):
    env = animal_env
    assert env.stop_ids == (tok512.eos_id, tok512.bos_id, 13)  # 13: the newline byte piece
    keys = jax.random.split(jax.random.key(0), 64)
    prompt = jnp.asarray([tok512.bos_id] + tok512.encode("Once upon a time"), jnp.int32)
    pmask = jnp.ones(prompt.shape, bool)
    states, obs, obs_mask = jax.jit(jax.vmap(env.reset, in_axes=(0, None, None)))(
        keys, prompt, pmask
    )
    assert not obs_mask.any()
    animals = np.asarray(states.animal)
    assert len(set(animals.tolist())) > 10  # drawn from the key
    first = ["Lily went to the park and saw a big tree.\n"] * 64
    ids, mask = _encode_batch(tok512, first, 24)
    step = jax.jit(jax.vmap(env.step))
    states2, obs, obs_mask, reward, done = step(states, ids, mask)
    assert not done.any() and not reward.any()
    for a, o, m in zip(animals, np.asarray(obs), np.asarray(obs_mask)):
        assert tok512.decode(o[m]) == f"Now tell me about the {env.animals[a]}.\n"
    second = [f"The {env.animals[a]} was happy." for a in animals]
    ids, mask = _encode_batch(tok512, second, 24)
    _, _, _, reward, done = step(states2, ids, mask)
    assert done.all() and np.all(np.asarray(reward) == 1.0)
    # the same texts against another animal score 0
    other = eqx.tree_at(lambda s: s.animal, states2, (states2.animal + 1) % len(env.animals))
    _, _, _, reward, _ = step(other, ids, mask)
    assert np.all(np.asarray(reward) == 0.0)


def test_animal_host_rewards_on_a_hand_built_trajectory(animal_env, tok512):
    """`host_rewards` reads the animal back from the question and scores the second turn."""
    prompt = [tok512.bos_id] + tok512.encode("Once upon a time")
    turn1 = tok512.encode("Lily had a red ball.") + [13]
    rows, turn_ids, expected = [], [], []
    for animal, answer in [("owl", "The owl said hoot."), ("cat", "The dog ran."), ("fox", "")]:
        a = animal_env.animals.index(animal)
        question = np.asarray(animal_env.questions[a])[np.asarray(animal_env.question_masks[a])]
        turn2 = tok512.encode(answer) + [13] if answer else []
        row = prompt + turn1 + question.tolist() + turn2
        ids = [-1] * len(prompt) + [0] * len(turn1) + [-1] * len(question) + [1] * len(turn2)
        rows.append(row)
        turn_ids.append(ids)
        expected.append(animal_followup_score(answer, animal) if answer else 0.0)
    T = max(map(len, rows))
    pad = lambda r, v: r + [v] * (T - len(r))
    tr = Trajectory(
        tokens=jnp.asarray([pad(r, 0) for r in rows], jnp.int32),
        mask=jnp.asarray([pad([True] * len(r), False) for r in rows]),
        loss_mask=jnp.asarray([pad([i >= 0 for i in t], False) for t in turn_ids]),
        logprobs=jnp.zeros((3, T)),
        turn_ids=jnp.asarray([pad(t, -1) for t in turn_ids], jnp.int32),
        turn_rewards=jnp.zeros((3, 2)),
        reward=jnp.zeros(3),
        num_turns=jnp.asarray([2, 2, 1], jnp.int32),
        truncated=jnp.asarray([False, False, True]),
    )
    assert expected == [1.0, 0.0, 0.0]
    np.testing.assert_array_equal(animal_env.host_rewards(tr, tok512), expected)


HAND_BUILT = [
    ("cat", "The cat sat.", 1.0),
    ("cat", "Two CATS!", 1.0),
    ("cat", "a catalog and a bobcat", 0.0),
    ("dog", "the doghouse", 0.0),
    ("dog", "Dogs, dogs", 1.0),
    ("mouse", "Mice ran.", 1.0),
    ("mouse", "a mousetrap", 0.0),
    ("puppy", "three puppies", 1.0),
    ("fox", "foxes and a fox_hole", 1.0),
    ("fox", "fox_hole", 0.0),
    ("bird", "", 0.0),
]


@pytest.fixture(scope="module")
def mentions(animal_env):
    return jax.jit(jax.vmap(animal_env.mentions))


def test_animal_reward_on_hand_built_completions(animal_env, tok512, mentions):
    ids, mask = _encode_batch(tok512, [t for _, t, _ in HAND_BUILT], 32)
    index = jnp.asarray([animal_env.animals.index(a) for a, _, _ in HAND_BUILT], jnp.int32)
    got = np.asarray(mentions(ids, mask, index), np.float32)
    np.testing.assert_array_equal(got, [r for _, _, r in HAND_BUILT])
    host = [animal_followup_score(t, a) for a, t, _ in HAND_BUILT]
    np.testing.assert_array_equal(host, [r for _, _, r in HAND_BUILT])


WORDS = [
    "cat",
    "cats",
    "Cat",
    "dog",
    "doghouse",
    "mice",
    "Mouse",
    "the",
    "a",
    "big",
    "ran",
    "catalog",
    "fox",
    "foxes",
    "bunny",
    "bunnies",
    "owl",
    "bowl",
    "pig",
    "piglet",
]


@given(
    st.lists(st.sampled_from(WORDS), max_size=8),
    st.lists(st.sampled_from([" ", ", ", ". ", "\n", "!", "-", "_", "'"]), min_size=8, max_size=8),
    st.integers(0, 19),
)
def test_animal_reward_equals_host_regex(animal_env, tok512, mentions, words, seps, animal):
    text = "".join(w + s for w, s in zip(words, seps))
    assert len(tok512.encode(text)) <= 64  # the whole text reaches the environment
    ids, mask = _encode_batch(tok512, [text], 64)
    got = float(mentions(ids, mask, jnp.asarray([animal], jnp.int32))[0])
    assert got == animal_followup_score(text, animal_env.animals[animal])


def test_animal_env_with_any_tokenizer_and_animals():
    """A tokenizer without a piece table (bytes) and a custom animal list."""
    tok = rx.data.ByteTokenizer()
    env = AnimalFollowUpEnv(tok, animals=["cat", "mouse"], question="Tell me of the {animal}!")
    assert env.animals == ("cat", "mouse") and env.stop_ids == (2, 1, 13)
    texts = ["Mice!", "the cat.", "catmouse", "a MOUSE_", "mouse-cat"]
    ids, mask = _encode_batch(tok, texts, 16)
    for a, animal in enumerate(env.animals):
        got = jax.jit(jax.vmap(env.mentions, in_axes=(0, 0, None)))(ids, mask, jnp.asarray(a))
        expected = [animal_followup_score(t, animal) for t in texts]
        np.testing.assert_array_equal(np.asarray(got, np.float32), expected)
    q = np.asarray(env.questions[1])[np.asarray(env.question_masks[1])]
    assert tok.decode(q) == "Tell me of the mouse!\n"


@pytest.mark.slow
def test_animal_followup_rollout_on_stories260k(tok512):
    policy, tok = rx.load_llama2c(asset_path("stories260K.bin"), asset_path("tok512.bin"))
    env = AnimalFollowUpEnv(tok)
    prompts = ["Once upon a time, there was a", "One day, a little"]
    rows = [[tok.bos_id] + tok.encode(p) for p in prompts]
    P = max(len(r) for r in rows)
    ids = jnp.asarray([[0] * (P - len(r)) + r for r in rows], jnp.int32)
    settings = dict(
        max_turns=2,
        max_new_tokens=48,
        max_total_tokens=P + 48 + env.max_observation_tokens + 48,
        temperature=1.0,
        eos_id=env.stop_ids,
        num_samples=4,
    )
    tr = rollout_multiturn(policy, env, ids, ids != 0, jax.random.key(0), **settings)
    recomputed = jax.vmap(lambda t, m: rx.token_logprobs(policy, t, m))(tr.tokens, tr.mask)
    diff = jnp.where(tr.loss_mask, recomputed - tr.logprobs, 0.0)
    assert float(jnp.max(jnp.abs(diff))) < 5e-5
    assert np.all(np.asarray(tr.num_turns) == 2) and not np.asarray(tr.turn_limit).any()
    tokens, turn_ids = np.asarray(tr.tokens), np.asarray(tr.turn_ids)
    stopped = [bool(set(tokens[e][turn_ids[e] == 1]) & set(env.stop_ids)) for e in range(8)]
    np.testing.assert_array_equal(np.asarray(tr.truncated), np.logical_not(stopped))
    np.testing.assert_array_equal(env.host_rewards(tr, tok), np.asarray(tr.reward))
    assert all(np.asarray(tr.turn_rewards[:, 0]) == 0.0)


@pytest.mark.slow
def test_custom_environment_example_runs(capsys):
    path = os.path.join(os.path.dirname(__file__), "..", "examples", "custom_environment.py")
    runpy.run_path(path, run_name="__main__")
    out = capsys.readouterr().out
    assert out.count("episode ") == 2 and "«" in out and "» And then?" in out
