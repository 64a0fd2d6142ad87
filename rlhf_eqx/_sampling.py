"""Sampling with a KV cache: one compiled prefill + decode loop.

Prompts may be left- or right-padded (positions and attention come from the mask).
Left padding is recommended for batches (`rlhf_eqx.data` collates prompts that way):
the completion then starts right after the last real prompt token in every row.
The output row is always `prompt (as given, with its padding) ++ completion`.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

__all__ = ["GenerationOutput", "generate", "generate_batch", "sample_token", "filter_logits"]


class GenerationOutput(eqx.Module):
    """Prompt + completion of one sequence (a leading batch axis under `generate_batch`).

    - `tokens`: prompt followed by `max_new_tokens` sampled ids (`pad_id` after EOS).
    - `mask`: real tokens (the prompt's real tokens, then completion tokens up to and
      including EOS).
    - `completion_mask`: the completion's real tokens.
    - `logprobs`: log-probability of each sampled token under the model's distribution
      at the sampling temperature (`logits / temperature`, before top-k / top-p
      filtering; temperature 1 for greedy), 0 elsewhere. It matches
      `token_logprobs(policy, tokens, mask, temperature=...)`.
    """

    tokens: Int[Array, "*B T"]
    mask: Bool[Array, "*B T"]
    completion_mask: Bool[Array, "*B T"]
    logprobs: Float[Array, "*B T"]


def filter_logits(
    logits: Float[Array, " V"], *, top_k: int | None = None, top_p: float | None = None
) -> Float[Array, " V"]:
    """Set logits outside the top-k set and outside the top-p nucleus (Holtzman et al. 2020) to -inf.

    Skips all sorting when both are off; with `top_k`, top-p works on the `k` best only.
    """
    if top_k is None and top_p is None:
        return logits
    neg = jnp.asarray(-jnp.inf, logits.dtype)
    if top_k is not None:
        if top_k <= 0:
            raise ValueError(f"top_k must be positive, got {top_k}")
        best = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0]
    else:
        best = jnp.sort(logits)[::-1]
    threshold = best[-1]
    if top_p is not None:
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        probs = jax.nn.softmax(best)
        before = jnp.cumsum(probs) - probs  # mass strictly above each candidate
        keep = before < top_p  # always keeps the best token
        threshold = jnp.min(jnp.where(keep, best, jnp.inf))
    return jnp.where(logits < threshold, neg, logits)


def sample_token(
    key: PRNGKeyArray,
    logits: Float[Array, " V"],
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> tuple[Int[Array, ""], Float[Array, ""]]:
    """Sample one token; return it and its log-probability at `temperature` (1 when greedy)."""
    logits = logits.astype(jnp.float32)
    if temperature == 0.0:
        token = jnp.argmax(logits).astype(jnp.int32)
        scaled = logits
    else:
        if temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        scaled = logits / temperature
        filtered = filter_logits(scaled, top_k=top_k, top_p=top_p)
        token = _inverse_cdf_sample(key, filtered)
    logprob = scaled[token] - jax.nn.logsumexp(scaled)
    return token, logprob


def _inverse_cdf_sample(key: PRNGKeyArray, logits: Float[Array, " V"]) -> Int[Array, ""]:
    """Exact categorical sample from one uniform draw: the first index whose CDF exceeds `u`.

    Needs one random number per row instead of one per vocabulary entry (as Gumbel-max
    does), which matters on CPUs where the PRNG dominates a decode step.
    """
    probs = jnp.exp(logits - jnp.max(logits))
    cdf = jnp.cumsum(probs)
    u = jax.random.uniform(key, (), jnp.float32) * cdf[-1]
    token = jnp.searchsorted(cdf, u, side="right")
    return jnp.minimum(token, logits.shape[0] - 1).astype(jnp.int32)


def _check_policy(policy) -> None:
    if not (hasattr(policy, "prefill") and hasattr(policy, "decode_step")):
        raise TypeError(
            "generate needs a model with prefill/decode_step (an rlhf_eqx Policy); "
            f"got {type(policy).__name__}"
        )


def _generate_batch(
    policy,
    prompts: Int[Array, "B P"],
    prompt_masks: Bool[Array, "B P"],
    key: PRNGKeyArray,
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    eos_id: int | None,
    pad_id: int,
) -> GenerationOutput:
    B, P = prompts.shape
    N = max_new_tokens
    S = P + N
    logits, cache = jax.vmap(lambda t, m: policy.prefill(t, m, cache_size=S))(prompts, prompt_masks)
    positions = jnp.sum(prompt_masks, axis=-1, dtype=jnp.int32)
    sample = jax.vmap(
        functools.partial(sample_token, temperature=temperature, top_k=top_k, top_p=top_p)
    )
    decode = jax.vmap(
        lambda tok, c, pos, idx: policy.decode_step(tok, c, index=idx, position=pos),
        in_axes=(0, 0, 0, None),
    )

    def choose(i, logits, done, key):
        tok, lp = sample(jax.random.split(jax.random.fold_in(key, i), B), logits)
        real = ~done
        tok = jnp.where(real, tok, pad_id)
        lp = jnp.where(real, lp, 0.0)
        if eos_id is not None:
            done = done | (real & (tok == eos_id))
        return tok, lp, real, done

    out_tok = jnp.full((B, N), pad_id, jnp.int32)
    out_lp = jnp.zeros((B, N), jnp.float32)
    out_real = jnp.zeros((B, N), jnp.bool_)

    def cond(state):
        i, _, _, done, *_ = state
        return (i < N) & ~jnp.all(done)

    def body(state):
        i, logits, cache, done, positions, out_tok, out_lp, out_real = state
        tok, lp, real, done = choose(i, logits, done, key)
        out_tok = jax.lax.dynamic_update_slice(out_tok, tok[:, None], (0, i))
        out_lp = jax.lax.dynamic_update_slice(out_lp, lp[:, None], (0, i))
        out_real = jax.lax.dynamic_update_slice(out_real, real[:, None], (0, i))

        def advance(args):
            logits, cache, positions = args
            logits, cache = decode(tok, cache, positions, P + i)
            return logits, cache, positions + 1

        logits, cache, positions = jax.lax.cond(
            i + 1 < N, advance, lambda args: args, (logits, cache, positions)
        )
        return i + 1, logits, cache, done, positions, out_tok, out_lp, out_real

    done = jnp.zeros((B,), jnp.bool_)
    state = (jnp.zeros((), jnp.int32), logits, cache, done, positions, out_tok, out_lp, out_real)
    state = jax.lax.while_loop(cond, body, state)
    out_tok, out_lp, out_real = state[5], state[6], state[7]
    return GenerationOutput(
        tokens=jnp.concatenate([prompts.astype(jnp.int32), out_tok], axis=1),
        mask=jnp.concatenate([prompt_masks, out_real], axis=1),
        completion_mask=jnp.concatenate([jnp.zeros_like(prompt_masks), out_real], axis=1),
        logprobs=jnp.concatenate([jnp.zeros((B, P), jnp.float32), out_lp], axis=1),
    )


_generate_batch_jit = eqx.filter_jit(_generate_batch)


def generate_batch(
    policy,
    prompts: Int[Array, "B P"],
    prompt_masks: Bool[Array, "B P"],
    key: PRNGKeyArray,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    pad_id: int = 0,
) -> GenerationOutput:
    """Sample completions for a batch of prompts in one compiled program.

    Prefill runs all prompts at once; the decode loop is a `lax.while_loop` that stops
    as soon as every row has emitted `eos_id` (or after `max_new_tokens`). One compile
    per (batch, prompt length, `max_new_tokens`, sampling settings).

    **Arguments:**

    - `policy`: an rlhf_eqx `Policy` (anything with `prefill` / `decode_step`).
    - `prompts`, `prompt_masks`: `[B, P]` ids and real-token masks; each row needs at
      least one real token.
    - `key`: PRNG key (ignored when greedy).
    - `temperature`: 0 means greedy; `top_k`, `top_p`: optional filters.
    - `eos_id`: stop token (kept in the completion), `pad_id`: fills rows after EOS.

    **Returns:** a `GenerationOutput` with a leading batch axis, rows of length `P + max_new_tokens`.
    """
    _check_policy(policy)
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
    if prompts.shape != prompt_masks.shape:
        raise ValueError(f"prompts {prompts.shape} and prompt_masks {prompt_masks.shape} differ in shape")
    return _generate_batch_jit(
        policy,
        prompts,
        prompt_masks,
        key,
        max_new_tokens=max_new_tokens,
        temperature=float(temperature),
        top_k=top_k,
        top_p=top_p,
        eos_id=eos_id,
        pad_id=pad_id,
    )


def generate(
    policy,
    prompt: Int[Array, " P"],
    prompt_mask: Bool[Array, " P"],
    key: PRNGKeyArray,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    pad_id: int = 0,
) -> GenerationOutput:
    """Sample a completion of one prompt (jitted; vmappable over a batch of prompts).

    Same arguments as `generate_batch` without the batch axis. Under `jax.vmap` the
    loop runs until every row of the batch is done; `generate_batch` is the batched
    entry point.
    """
    out = generate_batch(
        policy,
        prompt[None],
        prompt_mask[None],
        key,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_id=eos_id,
        pad_id=pad_id,
    )
    return jax.tree_util.tree_map(lambda x: x[0], out)
