"""A user's environment with observations of varying lengths (masks with holes, an empty
first observation for some prompts), early termination, per-turn rewards and a buffer
that runs out before some episodes end: the compiled rollout, the host-driven one
with the same jittable environment and with its Python twin give the same episodes for
the same keys, the recorded log-probs equal a full forward over the final transcript
(penalties and filters on), and only the policy's own tokens are in `loss_mask`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlhf_eqx as rx
from rlhf_eqx.envs import Environment, HostEnvironment, rollout_multiturn, rollout_multiturn_host

CFG = rx.TransformerConfig(
    vocab_size=53, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=24, max_seq_len=64
)
W = 5  # max_observation_tokens
STOP = 5


class Varying(Environment):
    """`reset` shows `sum(prompt_mask) % 4` tokens of `40 ...`; each step shows
    `sum(turn ids) % (W + 1)` tokens `45 + turn` (written at the end of the padded
    observation: holes first); reward `0.1 · length + turn`; done on a turn holding 5."""

    max_observation_tokens: int = eqx.field(static=True, default=W)

    def reset(self, key, prompt, prompt_mask):
        n = jnp.sum(prompt_mask) % 4
        return jnp.zeros((), jnp.int32), 40 + jnp.arange(W, dtype=jnp.int32), jnp.arange(W) < n

    def step(self, turn, completion, completion_mask):
        n = jnp.sum(jnp.where(completion_mask, completion, 0)) % (W + 1)
        obs = jnp.full((W,), 45, jnp.int32) + turn
        reward = jnp.sum(completion_mask).astype(jnp.float32) * 0.1 + turn.astype(jnp.float32)
        done = jnp.any((completion == STOP) & completion_mask)
        return turn + 1, obs, jnp.arange(W) >= W - n, reward, done


class HostVarying(HostEnvironment):
    """`Varying` in Python."""

    max_observation_tokens = W

    def reset(self, prompt):
        self.turn = 0
        return [40 + i for i in range(len(prompt) % 4)]

    def step(self, completion):
        obs = [45 + self.turn] * (sum(completion) % (W + 1))
        reward = len(completion) * 0.1 + self.turn
        self.turn += 1
        return obs, reward, STOP in completion


FIELDS = ("tokens", "mask", "loss_mask", "turn_ids", "num_turns", "truncated", "turn_limit")


@pytest.mark.parametrize(
    "settings",
    [
        dict(max_total_tokens=22, max_new_tokens=6, max_turns=5, eos_id=(3, STOP)),
        pytest.param(
            dict(
                max_total_tokens=40,
                max_new_tokens=4,
                max_turns=6,
                eos_id=STOP,
                top_k=20,
                top_p=0.9,
                repetition_penalty=1.3,
                presence_penalty=0.5,
                frequency_penalty=0.3,
            ),
            marks=pytest.mark.slow,
        ),
    ],
)
def test_compiled_and_host_rollouts_agree_and_score_the_policy_tokens_only(settings):
    policy = rx.Policy(CFG, key=jax.random.key(1))
    toks = jnp.asarray([[0, 0, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16], [21, 22, 0, 0, 0, 0]])
    masks = toks != 0
    kw = dict(temperature=0.7, num_samples=3, **settings)
    key = jax.random.key(4)
    compiled = rollout_multiturn(policy, Varying(), toks, masks, key, **kw)
    for other in (
        rollout_multiturn_host(policy, Varying(), toks, masks, key, **kw),
        rollout_multiturn_host(policy, HostVarying, toks, masks, key, **kw),
    ):
        for name in FIELDS:
            np.testing.assert_array_equal(getattr(compiled, name), getattr(other, name), name)
        for name in ("turn_rewards", "reward", "logprobs"):
            got, want = getattr(other, name), getattr(compiled, name)
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5, err_msg=name)
    tr = jax.tree.map(np.asarray, compiled)
    full = jax.vmap(lambda t, m: rx.token_logprobs(policy, t, m, temperature=0.7))(
        compiled.tokens, compiled.mask
    )
    np.testing.assert_allclose(np.where(tr.loss_mask, full, 0.0), tr.logprobs, atol=2e-6)
    assert np.all(tr.logprobs[~tr.loss_mask] == 0.0)
    # the loss mask is exactly the tokens of the policy's turns; observations are context
    assert np.array_equal(tr.loss_mask, tr.turn_ids >= 0) and not (tr.loss_mask & ~tr.mask).any()
    observed = tr.mask & ~tr.loss_mask
    observed[:, : toks.shape[1]] = False
    assert observed.any() and np.isin(tr.tokens[observed], np.arange(40, 40 + 2 * W + 6)).all()
    # the budget cut episodes mid-turn and mid-observation, and the environment ended some
    assert tr.truncated.any() and (~tr.truncated).any() and tr.mask[:, -1].any()
