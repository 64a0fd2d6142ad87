"""The per-turn machinery both multi-turn rollouts share: episode state, one token, one
turn, the prefill of a batch and the per-episode keys.

**Layout.** Each episode keeps one fixed-length token buffer of `max_total_tokens`
slots: the prompt as given (with its padding) in slots `[0, P)`, then every later token
written contiguously — the first observation, the policy's first turn, the next
observation, and so on. `mask` marks real tokens, `loss_mask` the policy's own sampled
tokens only (prompts and observations are context, never trained on).

**KV cache across turns.** The prompt is prefilled once (once per prompt, shared by its
`num_samples` episodes); every later token — sampled or observed — is fed through
`decode_step` into the same cache, so a turn never recomputes the context before it.

**Penalties.** With a repetition / presence / frequency penalty on, a token's context
is the episode's buffer so far (the prompt's real tokens, every earlier turn and
observation, the turn's tokens so far) and its generated counts are those of the
policy's sampled tokens of every turn (`loss_mask`), read from the buffer at each token.

**Keys.** Episode `e` (row `e` of the output, `e = i · num_samples + g` for prompt `i`)
has the key `split(key, E)[e]`, split again into a policy key and an environment key;
token `t` of policy turn `k` is drawn with `fold_in(fold_in(policy_key, k), t)`. A draw
depends on nothing but its episode, turn and index, so the jitted rollout and the
host-driven one give the same samples.
"""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from .._sampling import SamplingOptions, context_counts, sample_token
from ..models import AbstractDecoder


class _TurnOptions(eqx.Module):
    """What a policy turn needs (static): the sampling settings and the buffer length."""

    sampling: SamplingOptions
    total: int


class _Episode(eqx.Module):
    """Episodes' buffers, write pointers and the decoder's state after their last token
    (one episode, or a batch with a leading axis).

    `length` is the next free slot; `position` the number of real tokens so far (the
    rotary position of the next one); `logits` predict the token after the last one.
    """

    tokens: Int[Array, "*E T"]
    mask: Bool[Array, "*E T"]
    loss_mask: Bool[Array, "*E T"]
    logprobs: Float[Array, "*E T"]
    turn_ids: Int[Array, "*E T"]
    length: Int[Array, "*E"]
    position: Int[Array, "*E"]
    logits: Float[Array, "*E V"]
    cache: Any


def _start(
    policy: AbstractDecoder, prompt: Int[Array, " P"], prompt_mask: Bool[Array, " P"], opts
) -> _Episode:
    """Prefill the prompt into a cache of `opts.total` slots."""
    T, (P,) = opts.total, prompt.shape
    logits, cache = policy.prefill(prompt, prompt_mask, cache_size=T)
    i32 = jnp.int32
    return _Episode(
        tokens=jnp.full((T,), opts.sampling.pad_id, i32).at[:P].set(prompt.astype(i32)),
        mask=jnp.zeros((T,), jnp.bool_).at[:P].set(prompt_mask),
        loss_mask=jnp.zeros((T,), jnp.bool_),
        logprobs=jnp.zeros((T,), jnp.float32),
        turn_ids=jnp.full((T,), -1, i32),
        length=jnp.asarray(P, i32),
        position=jnp.sum(prompt_mask, dtype=i32),
        logits=logits.astype(jnp.float32),
        cache=cache,
    )


class _TurnCarry(eqx.Module):
    """Progress through a turn (per episode, or batched): `j` observation tokens fed, `i`
    tokens sampled (also in `completion` / `completion_mask`), `stopped` once it is over."""

    j: Int[Array, "*E"]
    i: Int[Array, "*E"]
    episode: _Episode
    completion: Int[Array, "*E N"]
    completion_mask: Bool[Array, "*E N"]
    stopped: Bool[Array, "*E"]


def _token(policy: AbstractDecoder, c: _TurnCarry, ids, n_obs, key, turn, opts) -> _TurnCarry:
    """One token of one episode's turn: the next pending observation token, else a
    sampled one; either is written at the next slot and fed to the decoder.

    An episode that has stopped keeps its state exactly: it feeds its last token again,
    at the same slot and position, which rewrites the cache with what it already holds
    (so the batch needs no select over the cache), and writes nothing to the buffer."""
    s = opts.sampling
    N, T = s.max_new_tokens, opts.total
    e = c.episode
    live = ~c.stopped
    feeding = c.j < n_obs
    seen = {}
    if s.penalized:  # the episode's context so far: prompt, turns, observations
        context, generated = context_counts(e.tokens, e.mask, e.loss_mask, e.logits.shape[-1])
        seen = dict(
            repetition_penalty=s.repetition_penalty,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            context=context,
            generated=generated,
        )
    tok, lp = sample_token(
        jax.random.fold_in(key, c.i),
        e.logits,
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        min_p=s.min_p,
        **seen,
    )
    tok = jnp.where(feeding, ids[jnp.minimum(c.j, ids.shape[0] - 1)], tok)
    lp = jnp.where(feeding, 0.0, lp.astype(jnp.float32))
    last = jnp.maximum(e.length - 1, 0)
    logits, cache = policy.decode_step(
        jnp.where(live, tok, e.tokens[last]),
        e.cache,
        index=jnp.where(live, e.length, last),
        position=jnp.where(live, e.position, e.position - 1),
    )
    at = jnp.where(live, e.length, T)  # out of range when stopped: the writes are dropped
    step = live.astype(jnp.int32)
    e = _Episode(
        tokens=e.tokens.at[at].set(tok, mode="drop"),
        mask=e.mask.at[at].set(True, mode="drop"),
        loss_mask=e.loss_mask.at[at].set(~feeding, mode="drop"),
        logprobs=e.logprobs.at[at].set(lp, mode="drop"),
        turn_ids=e.turn_ids.at[at].set(jnp.where(feeding, -1, turn), mode="drop"),
        length=e.length + step,
        position=e.position + step,
        logits=jnp.where(live, logits.astype(jnp.float32), e.logits),
        cache=cache,
    )
    sampled = live & ~feeding
    slot = jnp.where(sampled, c.i, N)  # out of range unless sampled: dropped
    i = c.i + sampled.astype(jnp.int32)
    ended = sampled & (i >= N)
    if s.eos_id:
        ended = ended | (sampled & jnp.any(tok == jnp.asarray(s.eos_id, jnp.int32)))
    return _TurnCarry(
        j=c.j + (live & feeding).astype(jnp.int32),
        i=i,
        episode=e,
        completion=c.completion.at[slot].set(tok, mode="drop"),
        completion_mask=c.completion_mask.at[slot].set(True, mode="drop"),
        stopped=c.stopped | ended | (e.length >= T),
    )


def _turn(policy: AbstractDecoder, eps: _Episode, obs, obs_mask, policy_keys, turn, active, opts):
    """One turn of every episode of the batch, the unit both rollouts share: append each
    active episode's pending observation (its real tokens, in order), then sample its
    turn `turn` until a stop id, `max_new_tokens` or a full buffer.

    One `lax.while_loop` over tokens (until every episode has stopped) feeds both kinds
    of token, one `decode_step` each, so the decoder appears once in the program. Token
    `i` of episode `e` is drawn with `fold_in(fold_in(policy_keys[e], turn), i)`.

    Returns `(episodes, completions [E, N], completion_masks [E, N], took [E], cut [E])`;
    `took` says the episode's policy had room to play (its environment should see the
    turn), `cut` that its turn ended without a stop id (at `max_new_tokens` or a full
    buffer)."""
    s = opts.sampling
    E, N, T = obs.shape[0], s.max_new_tokens, opts.total
    keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(policy_keys, turn)
    ids = jax.vmap(lambda o, m: o[jnp.argsort(~m, stable=True)])(obs, obs_mask)
    n_obs = jnp.sum(obs_mask, axis=-1, dtype=jnp.int32)
    init = _TurnCarry(
        j=jnp.zeros((E,), jnp.int32),
        i=jnp.zeros((E,), jnp.int32),
        episode=eps,
        completion=jnp.full((E, N), s.pad_id, jnp.int32),
        completion_mask=jnp.zeros((E, N), jnp.bool_),
        stopped=~active | (eps.length >= T),
    )
    step = jax.vmap(lambda c, o, n, k: _token(policy, c, o, n, k, turn, opts))
    c = jax.lax.while_loop(
        lambda c: jnp.any(~c.stopped), lambda c: step(c, ids.astype(jnp.int32), n_obs, keys), init
    )
    took = active & (c.i > 0)
    if s.eos_id:
        stop = jnp.isin(c.completion, jnp.asarray(s.eos_id, jnp.int32)) & c.completion_mask
        cut = took & ~jnp.any(stop, axis=-1)
    else:
        cut = took
    return c.episode, c.completion, c.completion_mask, took, cut


def _episode_keys(key: PRNGKeyArray, n: int):
    """Per-episode (policy, environment) keys."""
    pairs = jax.vmap(jax.random.split)(jax.random.split(key, n))
    return pairs[:, 0], pairs[:, 1]


def _start_batch(policy, prompts, prompt_masks, opts: _TurnOptions, G: int):
    """Prefill each prompt once and copy its episode to its `G` rows."""
    eps = jax.vmap(lambda t, m: _start(policy, t, m, opts))(prompts, prompt_masks)
    rep = lambda x: jnp.repeat(x, G, axis=0)
    return jax.tree.map(rep, (eps, prompts, prompt_masks))
