"""A model that is not rlhf_eqx's, trained with SFT, DPO, PPO and GRPO and sampled from.

`TinyRNN` is a small recurrent language model with its own cache type (the recurrent
state). It meets `rlhf_eqx.models.AbstractDecoder`: a per-sample call
`(tokens [T], mask [T]) -> logits [T, V]`, plus `vocab_size`, `init_cache`, `prefill`
and `decode_step`. Nothing else is needed for the step builders and the sampler:

    python examples/custom_model.py

runs one short training loop per algorithm on random data (a few seconds on a CPU) and
prints the first and last loss of each.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

import rlhf_eqx as rx
from rlhf_eqx import train
from rlhf_eqx.models import AbstractDecoder, AbstractSequenceModel


class RNNCache(eqx.Module):
    h: Float[Array, " D"]  # the recurrent state after the last real token


class TinyRNN(AbstractDecoder[RNNCache]):
    embed: Float[Array, "V D"]
    recur: Float[Array, "D D"]
    out: Float[Array, "D V"]

    def __init__(self, vocab: int, dim: int, *, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = jax.random.normal(k1, (vocab, dim)) * 0.5
        self.recur = jax.random.normal(k2, (dim, dim)) / dim**0.5
        self.out = jax.random.normal(k3, (dim, vocab)) / dim**0.5

    @property
    def vocab_size(self) -> int:
        return self.embed.shape[0]

    def _step(self, h: Float[Array, " D"], token: Int[Array, ""]) -> Float[Array, " D"]:
        return jnp.tanh(h @ self.recur + self.embed[token])

    def _run(self, tokens: Int[Array, " T"], mask: Bool[Array, " T"]):
        def f(h, tm):  # padding leaves the state unchanged
            h = jnp.where(tm[1], self._step(h, tm[0]), h)
            return h, h

        return jax.lax.scan(f, jnp.zeros(self.recur.shape[0]), (tokens, mask))

    def __call__(self, tokens, mask, *, key=None) -> Float[Array, "T V"]:
        return self._run(tokens, mask)[1] @ self.out

    def init_cache(self, cache_size: int) -> RNNCache:
        return RNNCache(jnp.zeros(self.recur.shape[0]))

    def prefill(self, tokens, mask, *, cache_size):
        h, _ = self._run(tokens, mask)
        return h @ self.out, RNNCache(h)

    def decode_step(self, token, cache, *, index, position):
        h = self._step(cache.h, token)
        return h @ self.out, RNNCache(h)


class TinyCritic(AbstractSequenceModel):
    """A value model on its own `TinyRNN` body: one value per position."""

    body: TinyRNN
    head: Float[Array, " V"]

    def __call__(self, tokens, mask, *, key=None) -> Float[Array, " T"]:
        return self.body(tokens, mask) @ self.head


VOCAB, DIM, B, P, N = 16, 16, 8, 3, 6  # vocabulary, width, batch, prompt, new tokens
GOOD = 3  # the "preferred" token: rewards count it


def rollout(policy, key, n=B):
    """Sample completions of random prompts with rlhf_eqx's sampler; score them."""
    kp, ks = jax.random.split(key)
    prompts = jax.random.randint(kp, (n, P), 0, VOCAB)
    out = rx.generate_batch(policy, prompts, jnp.ones((n, P), bool), ks, max_new_tokens=N)
    scores = jnp.mean((out.tokens == GOOD) & out.completion_mask, axis=-1).astype(jnp.float32)
    return out, scores


def run_sft(policy, key, steps=10):
    opt = optax.adam(3e-2)
    state = train.init_train_state(policy, opt)
    step = train.make_sft_step(opt, donate=False)  # `policy` is reused below
    tokens = jax.random.randint(key, (B, P + N), 0, VOCAB)
    mask = jnp.ones_like(tokens, bool)
    batch = rx.SequenceBatch(tokens=tokens, mask=mask, completion_mask=mask.at[:, :P].set(False))
    losses = []
    for _ in range(steps):
        state, m = state.apply(step, batch)
        losses.append(float(m["loss"]))
    return losses


def run_dpo(policy, key, steps=10):
    k1, k2 = jax.random.split(key)
    chosen, _ = rollout(policy, k1)
    # The rejected completion: the chosen one with every token shifted (same prompt).
    rejected = jnp.where(chosen.completion_mask, (chosen.tokens + 1) % VOCAB, chosen.tokens)
    batch = rx.PreferenceBatch(
        chosen_tokens=chosen.tokens,
        chosen_mask=chosen.mask,
        chosen_completion_mask=chosen.completion_mask,
        rejected_tokens=rejected,
        rejected_mask=chosen.mask,
        rejected_completion_mask=chosen.completion_mask,
    )
    opt = optax.adam(3e-2)
    state = train.init_train_state(policy, opt)
    step = train.make_dpo_step(opt, beta=0.5, reference="cached", donate=False)
    batch = train.compute_reference_logps(policy, batch)
    losses = []
    for _ in range(steps):
        state, m = state.apply(step, batch)
        losses.append(float(m["loss"]))
    return losses


def run_ppo(policy, key, steps=10):
    critic = TinyCritic(TinyRNN(VOCAB, DIM, key=jax.random.fold_in(key, 1)), jnp.zeros(VOCAB))
    out, scores = rollout(policy, key)
    params = (policy, critic)
    batch, _ = train.prepare_ppo_batch(
        params, policy, out.tokens, out.mask, out.completion_mask, scores, kl_coef=0.05
    )
    opt = optax.adam(1e-2)
    opt_state = opt.init(eqx.filter(params, eqx.is_inexact_array))
    step = train.make_ppo_step(opt, vf_coef=0.5, donate=False)
    losses = []
    for _ in range(steps):
        params, opt_state, m = step(params, opt_state, batch)
        losses.append(float(m["loss"]))
    return losses


def run_grpo(policy, key, steps=10, group_size=4):
    prompts = jnp.repeat(
        jax.random.randint(key, (B // group_size, P), 0, VOCAB), group_size, axis=0
    )
    out = rx.generate_batch(policy, prompts, jnp.ones_like(prompts, bool), key, max_new_tokens=N)
    rewards = jnp.sum((out.tokens == GOOD) & out.completion_mask, axis=-1).astype(jnp.float32)
    batch = train.GRPOBatch(
        tokens=out.tokens,
        mask=out.mask,
        completion_mask=out.completion_mask,
        rewards=rewards,
        old_logp=jnp.where(out.completion_mask, out.logprobs, 0.0),
    )
    opt = optax.adam(1e-2)
    state = train.init_train_state(policy, opt)
    step = train.make_grpo_step(opt, group_size=group_size, donate=False)
    losses = []
    for _ in range(steps):
        state, m = state.apply(step, batch)
        losses.append(float(m["loss"]))
    return losses


def main():
    key = jax.random.key(0)
    policy = TinyRNN(VOCAB, DIM, key=key)
    for name, run in (("SFT", run_sft), ("DPO", run_dpo), ("PPO", run_ppo), ("GRPO", run_grpo)):
        losses = run(policy, jax.random.fold_in(key, len(name)))
        print(f"{name:5s} loss {losses[0]:+.4f} -> {losses[-1]:+.4f}")


if __name__ == "__main__":
    main()
