"""A user environment: it asks "And then?" after each paragraph; 1 if a turn ends its paragraph."""

import equinox as eqx
import jax
import jax.numpy as jnp

import rlhf_eqx as rx
from rlhf_eqx.assets import asset_path

policy, tok = rx.load_llama2c(asset_path("stories260K.bin"), asset_path("tok512.bin"))
NEWLINE = tok.encode("a\n")[-1]


class AndThen(rx.envs.Environment):
    question: jax.Array  # the observation's ids
    max_observation_tokens: int = eqx.field(static=True)

    def reset(self, key, prompt, prompt_mask):  # state: turns played; no first observation
        return jnp.zeros((), jnp.int32), 0 * self.question, self.question < 0

    def step(self, turns, completion, completion_mask):
        ended = jnp.any(completion_mask & (completion == NEWLINE)).astype(jnp.float32)
        return turns + 1, self.question, self.question >= 0, ended, turns + 1 >= 3


question = jnp.asarray(tok.encode("And then?") + [NEWLINE], jnp.int32)
env = AndThen(question, max_observation_tokens=question.shape[0])
prompt = jnp.asarray([[tok.bos_id] + tok.encode("Once upon a time, there was a cat")])
kw = dict(max_turns=3, max_new_tokens=48, max_total_tokens=200, temperature=0.8, num_samples=2)
tr = rx.envs.rollout_multiturn(
    policy, env, prompt, prompt >= 0, jax.random.key(0), eos_id=(tok.eos_id, NEWLINE), **kw
)
for e in range(tr.tokens.shape[0]):
    text, seen, mine = "", [], False  # the loss mask's runs of policy tokens go in «»
    for t, m in zip(tr.tokens[e][tr.mask[e]].tolist(), tr.loss_mask[e][tr.mask[e]].tolist()):
        mark = "«" if m > mine else "»" if m < mine else ""
        text += mark + rx.data.decode_continuation(tok, seen, [t])
        seen, mine = seen + [t], m
    print(f"episode {e}: turn rewards {tr.turn_rewards[e].tolist()}\n{text}{'»' * mine}\n")
