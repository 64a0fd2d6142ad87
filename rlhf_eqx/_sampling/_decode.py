"""Sampling with a KV cache: one compiled prefill + decode loop.

Prompts may be left- or right-padded (positions and attention come from the mask).
Left padding is recommended for batches (`rlhf_eqx.data` collates prompts that way):
the completion then starts right after the last real prompt token in every row.
The output row is always `prompt (as given, with its padding) ++ completion`.
"""

import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ..models._protocols import AbstractDecoder
from ._options import GenerationOutput, SamplingOptions
from ._token import sample_token


def _check_decoder(policy: object) -> AbstractDecoder:
    if not isinstance(policy, AbstractDecoder):
        raise TypeError(
            "generate needs a decoder: a model inheriting rlhf_eqx.models.AbstractDecoder "
            f"(init_cache / prefill / decode_step), such as rlhf_eqx.Policy; got {type(policy).__name__}"
        )
    return policy


def _check_prompt_ids(prompts: Any, vocab_size: int) -> None:
    """Raise naming the first bad row, position and id, if `prompts` are concrete."""
    if isinstance(prompts, jax.core.Tracer):
        return
    ids = np.asarray(prompts)
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        row, col = (int(x) for x in np.argwhere(bad)[0])
        raise ValueError(
            f"prompt row {row} has id {int(ids[row, col])} at position {col}, "
            f"outside the vocabulary [0, {vocab_size})"
        )


class _DecodeState(eqx.Module):
    """Carry of the decode loop; `tokens` / `logprobs` / `real` are the `[B, N]` outputs."""

    step: Int[Array, ""]
    logits: Float[Array, "B V"]
    cache: Any
    done: Bool[Array, " B"]
    positions: Int[Array, " B"]
    tokens: Int[Array, "B N"]
    logprobs: Float[Array, "B N"]
    real: Bool[Array, "B N"]


def _generate_batch(
    policy: AbstractDecoder,
    prompts: Int[Array, "B P"],
    prompt_masks: Bool[Array, "B P"],
    key: PRNGKeyArray,
    opts: SamplingOptions,
) -> GenerationOutput:
    B, P = prompts.shape
    N = opts.max_new_tokens
    prompts = prompts.astype(jnp.int32)
    if opts.check_ids:
        bad = (prompts < 0) | (prompts >= policy.vocab_size)
        prompts = eqx.error_if(prompts, jnp.any(bad), "prompt ids outside [0, vocab_size)")
    logits, cache = jax.vmap(lambda t, m: policy.prefill(t, m, cache_size=P + N))(prompts, prompt_masks)
    if opts.num_samples > 1:
        # one prefill per prompt, its cache shared by the prompt's samples
        rep = lambda x: jnp.repeat(x, opts.num_samples, axis=0)
        logits, cache, prompts, prompt_masks = jax.tree.map(rep, (logits, cache, prompts, prompt_masks))
        B = B * opts.num_samples
    sample = jax.vmap(
        functools.partial(
            sample_token, temperature=opts.temperature, top_k=opts.top_k, top_p=opts.top_p
        )
    )
    decode = jax.vmap(
        lambda tok, c, pos, idx: policy.decode_step(tok, c, index=idx, position=pos),
        in_axes=(0, 0, 0, None),
    )
    stop_ids = jnp.asarray(opts.eos_id, jnp.int32)
    zero = jnp.zeros((), jnp.int32)  # int32 indices also under jax_enable_x64

    def cond(s: _DecodeState):
        return (s.step < N) & ~jnp.all(s.done)

    def body(s: _DecodeState) -> _DecodeState:
        tok, lp = sample(jax.random.split(jax.random.fold_in(key, s.step), B), s.logits)
        real = ~s.done
        tok = jnp.where(real, tok, jnp.asarray(opts.pad_id, jnp.int32))
        lp = jnp.where(real, lp, jnp.zeros_like(lp))
        done = s.done
        if opts.eos_id:
            done = done | (real & jnp.any(tok[:, None] == stop_ids[None, :], axis=-1))

        def advance(args):
            logits, cache, positions = args
            logits, cache = decode(tok, cache, positions, P + s.step)
            return logits, cache, positions + 1

        logits, cache, positions = jax.lax.cond(
            s.step + 1 < N, advance, lambda args: args, (s.logits, s.cache, s.positions)
        )
        at = (zero, s.step)
        return _DecodeState(
            step=s.step + 1,
            logits=logits,
            cache=cache,
            done=done,
            positions=positions,
            tokens=jax.lax.dynamic_update_slice(s.tokens, tok[:, None], at),
            logprobs=jax.lax.dynamic_update_slice(s.logprobs, lp[:, None], at),
            real=jax.lax.dynamic_update_slice(s.real, real[:, None], at),
        )

    init = _DecodeState(
        step=zero,
        logits=logits,
        cache=cache,
        done=jnp.zeros((B,), jnp.bool_),
        positions=jnp.sum(prompt_masks, axis=-1, dtype=jnp.int32),
        tokens=jnp.full((B, N), opts.pad_id, jnp.int32),
        logprobs=jnp.zeros((B, N), jnp.float32),
        real=jnp.zeros((B, N), jnp.bool_),
    )
    s = jax.lax.while_loop(cond, body, init)
    return GenerationOutput(
        tokens=jnp.concatenate([prompts, s.tokens], axis=1),
        mask=jnp.concatenate([prompt_masks, s.real], axis=1),
        completion_mask=jnp.concatenate([jnp.zeros_like(prompt_masks), s.real], axis=1),
        logprobs=jnp.concatenate([jnp.zeros((B, P), jnp.float32), s.logprobs], axis=1),
    )


_generate_batch_jit = eqx.filter_jit(_generate_batch)


def generate_batch(
    policy: AbstractDecoder,
    prompts: Int[Array, "B P"],
    prompt_masks: Bool[Array, "B P"],
    key: PRNGKeyArray,
    **options: Any,
) -> GenerationOutput:
    """Sample completions for a batch of prompts in one compiled program.

    Prefill runs all prompts at once; the decode loop is a `lax.while_loop` that stops
    as soon as every row has emitted a stop id (or after `max_new_tokens`), with no
    Python work per step. One compile per (batch, prompt length, options).

    **Arguments:**

    - `policy`: a decoder (`rlhf_eqx.models.AbstractDecoder`, e.g. `rlhf_eqx.Policy`).
    - `prompts`, `prompt_masks`: `[B, P]` ids and real-token masks; each row needs at
      least one real token. Concrete ids outside `[0, vocab_size)` raise a `ValueError`
      naming the row and the id.
    - `key`: PRNG key (ignored when greedy).
    - `**options`: the fields of `SamplingOptions`: `max_new_tokens` (required),
      `temperature=1.0` (0 is greedy), `top_k=None`, `top_p=None`, `eos_id=None` (one
      id or several), `pad_id=0`, `check_ids=False`, `num_samples=1` (completions per
      prompt, each prompt prefilled once).

    **Returns:** a `GenerationOutput` with a leading batch axis (`B · num_samples`
    rows), rows of length `P + max_new_tokens`. Cut completions at stop *strings* afterwards with
    `truncate_at_stop_strings`.
    """
    opts = SamplingOptions(**options)
    policy = _check_decoder(policy)
    if prompts.shape != prompt_masks.shape:
        raise ValueError(
            f"prompts {prompts.shape} and prompt_masks {prompt_masks.shape} differ in shape"
        )
    _check_prompt_ids(prompts, policy.vocab_size)
    return _generate_batch_jit(policy, prompts, prompt_masks, key, opts)


def generate(
    policy: AbstractDecoder,
    prompt: Int[Array, " P"],
    prompt_mask: Bool[Array, " P"],
    key: PRNGKeyArray,
    **options: Any,
) -> GenerationOutput:
    """Sample a completion of one prompt (jitted; vmappable over a batch of prompts).

    `generate_batch` on a batch of one: same `options` (`SamplingOptions`), no batch axis.
    Under `jax.vmap` the loop runs until every row of the batch is done; `generate_batch`
    is the batched entry point.
    """
    if options.get("num_samples", 1) != 1:
        raise ValueError(
            f"generate samples one completion (got num_samples={options['num_samples']!r}); "
            "use generate_batch(..., num_samples=n)"
        )
    out = generate_batch(policy, prompt[None], prompt_mask[None], key, **options)
    return jax.tree_util.tree_map(lambda x: x[0], out)
