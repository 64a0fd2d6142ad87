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
from jaxtyping import Array, ArrayLike, Bool, Float, Int, Integer, Key, PRNGKeyArray, UInt32

from ..models import AbstractDecoder
from ._options import GenerationOutput, SamplingOptions
from ._penalties import Seen
from ._token import sample_token


def _check_decoder(policy: object) -> AbstractDecoder:
    if not isinstance(policy, AbstractDecoder):
        raise TypeError(
            "generate needs a decoder: a model inheriting rlhf_eqx.models.AbstractDecoder "
            "(init_cache / prefill / decode_step), such as rlhf_eqx.Policy; "
            f"got {type(policy).__name__}"
        )
    return policy


def _check_prompt_ids(
    prompts: Any, vocab_size: int, row_label: str = "prompt row", first: int = 0
) -> None:
    """Raise naming the first bad row (`"{row_label} {row}"`, rows counted from `first`),
    position and id, if `prompts` are concrete."""
    if isinstance(prompts, jax.core.Tracer):
        return
    if isinstance(prompts, jax.Array) and not prompts.is_fully_addressable:
        # rows on other processes' devices too: each process checks the rows it holds
        for shard in prompts.addressable_shards:
            _check_prompt_ids(shard.data, vocab_size, row_label, first=shard.index[0].start or 0)
        return
    ids = np.asarray(prompts)
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        row, col = (int(x) for x in np.argwhere(bad)[0])
        raise ValueError(
            f"{row_label} {first + row} has id {int(ids[row, col])} at position {col}, "
            f"outside the vocabulary [0, {vocab_size})"
        )


def check_prompt_masks(prompt_masks: Any, first: int = 0) -> None:
    """Refuse, naming the first such row, a prompt with no real token (an all-False row
    of `prompt_masks`: there is nothing to condition on and no position to start from),
    if `prompt_masks` is concrete (rows held by other processes are theirs to check;
    `first` numbers the rows given)."""
    if isinstance(prompt_masks, jax.core.Tracer):
        return
    if isinstance(prompt_masks, jax.Array) and not prompt_masks.is_fully_addressable:
        for shard in prompt_masks.addressable_shards:
            check_prompt_masks(shard.data, first=shard.index[0].start or 0)
        return
    empty = ~np.asarray(prompt_masks).any(axis=-1)
    if empty.any():
        raise ValueError(
            f"prompt_masks: row {first + int(np.argmax(empty))} has no real token; every "
            "prompt needs at least one (a BOS will do)"
        )


def _check_mask_values(masks: Any, name: str, first: int = 0) -> None:
    """Refuse, naming `name`, the row and the position of the first one, an integer mask
    value other than 0 and 1, if `masks` is concrete (rows held by other processes are
    theirs to check; `first` numbers the rows given). Bool masks pass as they are."""
    if isinstance(masks, jax.core.Tracer) or np.dtype(masks.dtype) == np.bool_:
        return
    if isinstance(masks, jax.Array) and not masks.is_fully_addressable:
        for shard in masks.addressable_shards:
            _check_mask_values(shard.data, name, first=shard.index[0].start or 0)
        return
    values = np.asarray(masks)
    bad = (values != 0) & (values != 1)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        row = f" row {first + at[0]}" if values.ndim > 1 else ""
        raise ValueError(
            f"{name}:{row} holds {values[at].item()} at position {at[-1]}; a mask is bools "
            "or the integers 0 and 1 (1 marks a real token, as a tokenizer's attention_mask)"
        )


def bool_masks(masks: Any, name: str = "prompt_masks") -> Any:
    """`masks` (JAX or NumPy, bools or 0 / 1 integers, any shape) as a JAX bool array.

    A concrete integer mask holding another value is refused first (a `ValueError`
    naming `name`, the row and the position); then `masks != 0`. A traced mask is
    converted without the check; a JAX bool mask is returned as it is."""
    _check_mask_values(masks, name)
    masks = jnp.asarray(masks)
    return masks if masks.dtype == jnp.bool_ else masks != 0


def prompt_arrays(
    prompts: Any, prompt_masks: Any, vocab_size: int, row_label: str = "prompt row"
) -> tuple[Any, Any]:
    """`prompts` and `prompt_masks` as the samplers take them, checked on the host.

    - `prompt_masks`: JAX or NumPy bools or 0 / 1 integers, as a JAX bool array
      (`bool_masks`: another integer value is a `ValueError` naming `prompt_masks`).
    - `prompts`: JAX or NumPy integer ids of any dtype, as int32 (the model's ids).
      Concrete ids outside `[0, vocab_size)` are a `ValueError` naming the row
      (`"{row_label} {row}"`), the position and the id, checked before the conversion
      (an int64 id past the int32 range is refused, never wrapped).
    - A row of `prompt_masks` with no real token is a `ValueError` (`check_prompt_masks`).

    Traced arguments (under the caller's `jit` / `vmap`) are converted, unchecked (a
    traced integer mask becomes `mask != 0`; the samplers cast their ids to int32 in any
    case). JAX int32 ids and bool masks are returned as they are; NumPy arrays become
    JAX arrays. Returns `(prompts, prompt_masks)`.
    """
    prompt_masks = bool_masks(prompt_masks, "prompt_masks")
    _check_prompt_ids(prompts, vocab_size, row_label)
    check_prompt_masks(prompt_masks)
    if not isinstance(prompts, jax.Array):  # NumPy ids, just checked
        prompts = jnp.asarray(np.asarray(prompts).astype(np.int32))
    elif prompts.dtype != jnp.int32:
        prompts = prompts.astype(jnp.int32)
    return prompts, prompt_masks


def _check_length(policy: object, prompt_length: int, max_new_tokens: int) -> None:
    """Refuse generating past the model's `max_seq_len` (when it has a config)."""
    limit = getattr(getattr(policy, "cfg", None), "max_seq_len", None)
    if isinstance(limit, int) and prompt_length + max_new_tokens > limit:
        raise ValueError(
            f"prompt length {prompt_length} + max_new_tokens {max_new_tokens} = "
            f"{prompt_length + max_new_tokens} is longer than the model's "
            f"max_seq_len={limit}: shorten the prompts (their padded length counts) or "
            "generate fewer tokens"
        )


def check_stop_ids(eos_id: tuple[int, ...], vocab_size: int) -> None:
    """Refuse a stop id outside the vocabulary `[0, vocab_size)`: the model never samples
    it, so a row would never stop there (a tokenizer's id for another model)."""
    bad = [i for i in eos_id if i >= vocab_size]
    if bad:
        raise ValueError(
            f"eos_id {bad[0]} is outside the model's vocabulary [0, {vocab_size}): it can "
            "never be sampled, so no row would stop at it (is it another tokenizer's id?)"
        )


def _check_batch(
    policy: AbstractDecoder, prompts: Any, prompt_masks: Any, opts: SamplingOptions
) -> tuple[Any, Any]:
    """The host-side checks of a batch of prompts: `prompts` and `prompt_masks` of one
    `[B, P]` shape (also with the shape checks off), then `prompt_arrays`' (0 / 1 mask
    values, concrete ids inside the vocabulary, a real token in every concrete row),
    `P + max_new_tokens` within the model's `max_seq_len`, stop ids inside the
    vocabulary (each raises a `ValueError` naming what is wrong). Returns `(prompts,
    prompt_masks)` as `prompt_arrays` does."""
    if prompts.ndim != 2 or prompts.shape != prompt_masks.shape:
        raise ValueError(
            f"prompts {prompts.shape} and prompt_masks {prompt_masks.shape} must be the "
            "same [B, P] shape"
        )
    prompts, prompt_masks = prompt_arrays(prompts, prompt_masks, policy.vocab_size)
    _check_length(policy, prompts.shape[-1], opts.max_new_tokens)
    check_stop_ids(opts.eos_id, policy.vocab_size)
    return prompts, prompt_masks


def _signature(tree: Any) -> tuple[Any, list[str]]:
    """The structure of a vmapped pytree and its leaves' per-sample shapes and dtypes."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, [f"{np.dtype(x.dtype).name}{list(np.shape(x)[1:])}" for x in leaves]


def _check_decoder_output(
    policy: AbstractDecoder, method: str, out: Any, cache: Any = None
) -> None:
    """Refuse (at trace time) a `prefill` / `decode_step` result that is not
    `(logits [vocab_size], cache)` per sample, or, for `decode_step`, whose cache differs
    in structure or shapes from the one `prefill` returned. `out` is the vmapped
    result: the sample's shapes are its shapes without the leading batch axis."""
    name = f"{type(policy).__name__}.{method}"
    if not isinstance(out, tuple) or len(out) != 2:
        raise ValueError(f"{name} must return a pair (logits, cache), got {type(out).__name__}")
    logits, new_cache = out
    expected = (policy.vocab_size,)
    got = tuple(getattr(logits, "shape", ()))[1:]
    if got != expected:
        raise ValueError(
            f"{name} returned logits of shape {got}; expected {expected} (one next-token "
            "logit per vocabulary id, for one sequence)"
        )
    if cache is not None:
        (got_def, got_leaves), (want_def, want_leaves) = _signature(new_cache), _signature(cache)
        if got_def != want_def or got_leaves != want_leaves:
            raise ValueError(
                f"{name} returned a cache with leaves {got_leaves} (structure {got_def}) "
                f"but {type(policy).__name__}.prefill returned one with leaves {want_leaves} "
                f"(structure {want_def}); decode_step must return a cache of the same "
                "structure, shapes and dtypes (shapes are per sequence)"
            )


def _int32_prompts(
    policy: AbstractDecoder, prompts: Int[Array, "B P"], opts: SamplingOptions, message: str
) -> Int[Array, "B P"]:
    """`prompts` as int32, with (under `opts.check_ids`) a runtime error `message` when an
    id lies outside `[0, vocab_size)` (traced prompts are checked here only)."""
    prompts = prompts.astype(jnp.int32)
    if opts.check_ids:
        bad = (prompts < 0) | (prompts >= policy.vocab_size)
        prompts = eqx.error_if(prompts, jnp.any(bad), message)
    return prompts


def _row_sampler(opts: SamplingOptions):
    """`sample_token` with `opts`' settings, vmapped over rows:
    `(keys [B], logits [B, V], seen) -> (tokens [B], logprobs [B])`, `seen` the rows'
    `Seen` tokens when `opts.penalized` (else ignored: `None`)."""
    settings = dict(
        temperature=opts.temperature, top_k=opts.top_k, top_p=opts.top_p, min_p=opts.min_p
    )
    if not opts.penalized:
        plain = jax.vmap(functools.partial(sample_token, **settings))
        return lambda keys, logits, seen=None: plain(keys, logits)
    penalized = jax.vmap(
        lambda key, logits, context, generated: sample_token(
            key,
            logits,
            **settings,
            repetition_penalty=opts.repetition_penalty,
            presence_penalty=opts.presence_penalty,
            frequency_penalty=opts.frequency_penalty,
            context=context,
            generated=generated,
        )
    )
    return lambda keys, logits, seen: penalized(keys, logits, seen.context, seen.generated)


def _row_keys(keys: Key[Array, " R"], G: int) -> Key[Array, " B"]:
    """Each output row's key: `keys[p]` alone; `fold_in(keys[p], g)` for sample `g` of
    prompt `p`'s group of `G` (token `t` is then drawn with `fold_in(row key, t)`)."""
    if G == 1:
        return keys
    R = keys.shape[0]
    return jax.vmap(jax.random.fold_in)(jnp.repeat(keys, G), jnp.tile(jnp.arange(G), R))


def _per_prompt_keys(key: Any, prompts: int) -> bool:
    """Whether `key` is one PRNG key per prompt (typed `[prompts]` or raw
    `uint32[prompts, 2]`) rather than one for the batch; a `ValueError` naming `key` for
    any other shape."""
    raw = 0 if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) else 1
    if key.ndim == raw:
        return False
    if key.ndim == raw + 1 and key.shape[0] == prompts:
        return True
    raise ValueError(
        f"key must be one PRNG key or one per prompt ({prompts}), got {key.dtype}{list(key.shape)}"
    )


class _Completions(eqx.Module):
    """The `[B, N]` completions a sampler writes: the sampled `tokens` (`pad_id` where
    none was), their `logprobs` (0 elsewhere), and `real` where a token was generated."""

    tokens: Int[Array, "B N"]
    logprobs: Float[Array, "B N"]
    real: Bool[Array, "B N"]

    @classmethod
    def empty(cls, rows: int, N: int, pad_id: int) -> "_Completions":
        """`rows` completions of `N` slots with nothing generated yet."""
        return cls(
            tokens=jnp.full((rows, N), pad_id, jnp.int32),
            logprobs=jnp.zeros((rows, N), jnp.float32),
            real=jnp.zeros((rows, N), jnp.bool_),
        )

    def written(self, write, tokens, logprobs, real) -> "_Completions":
        """With one step's `tokens`, `logprobs` and `real` (one value a row) put in by
        `write(buffer, values)`."""
        return _Completions(
            tokens=write(self.tokens, tokens),
            logprobs=write(self.logprobs, logprobs),
            real=write(self.real, real),
        )


def _with_prompts(prompts, prompt_masks, out: _Completions) -> GenerationOutput:
    """The output rows `prompt ++ completion`: the prompts `[B, P]` as given, then the
    completions `out` (`[B, N]`)."""
    B, P = prompts.shape
    return GenerationOutput(
        tokens=jnp.concatenate([prompts, out.tokens], axis=1),
        mask=jnp.concatenate([prompt_masks, out.real], axis=1),
        completion_mask=jnp.concatenate([jnp.zeros_like(prompt_masks), out.real], axis=1),
        logprobs=jnp.concatenate([jnp.zeros((B, P), jnp.float32), out.logprobs], axis=1),
    )


class _DecodeState(eqx.Module):
    """Carry of the decode loop; `out` holds the `[B, N]` completions."""

    step: Int[Array, ""]
    logits: Float[Array, "B V"]
    cache: Any
    done: Bool[Array, " B"]
    positions: Int[Array, " B"]
    out: _Completions
    seen: Seen | None = None  # the rows' context and generated counts (`opts.penalized`)


def _generate_batch(
    policy: AbstractDecoder,
    prompts: Int[Array, "B P"],
    prompt_masks: Bool[Array, "B P"],
    key: PRNGKeyArray | Key[Array, " B"] | UInt32[Array, "B 2"],
    opts: SamplingOptions,
) -> GenerationOutput:
    B, P = prompts.shape
    if _per_prompt_keys(key, B):  # row b draws token t with fold_in(its row key, t)
        if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.wrap_key_data(key)
        row_keys = _row_keys(key, opts.num_samples)
        step_keys = lambda step: jax.vmap(jax.random.fold_in, (0, None))(row_keys, step)  # noqa: E731
    else:
        step_keys = lambda step: jax.random.split(jax.random.fold_in(key, step), B)  # noqa: E731
    N = opts.max_new_tokens
    prompts = _int32_prompts(policy, prompts, opts, "prompt ids outside [0, vocab_size)")
    out = jax.vmap(lambda t, m: policy.prefill(t, m, cache_size=P + N))(prompts, prompt_masks)
    _check_decoder_output(policy, "prefill", out)
    logits, cache = out
    if opts.num_samples > 1:
        # one prefill per prompt, its cache shared by the prompt's samples
        rep = lambda x: jnp.repeat(x, opts.num_samples, axis=0)
        logits, cache, prompts, prompt_masks = jax.tree.map(
            rep, (logits, cache, prompts, prompt_masks)
        )
        B = B * opts.num_samples
    sample = _row_sampler(opts)
    decode = jax.vmap(
        lambda tok, c, pos, idx: policy.decode_step(tok, c, index=idx, position=pos),
        in_axes=(0, 0, 0, None),
    )
    _check_decoder_output(
        policy,
        "decode_step",
        jax.eval_shape(decode, jnp.zeros((B,), jnp.int32), cache, jnp.zeros((B,), jnp.int32), P),
        cache,
    )
    stop_ids = jnp.asarray(opts.eos_id, jnp.int32)
    zero = jnp.zeros((), jnp.int32)  # int32 indices also under jax_enable_x64

    def cond(s: _DecodeState):
        return (s.step < N) & ~jnp.all(s.done)

    def body(s: _DecodeState) -> _DecodeState:
        tok, lp = sample(step_keys(s.step), s.logits, s.seen)
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
        put = lambda buf, x: jax.lax.dynamic_update_slice(buf, x[:, None], (zero, s.step))
        return _DecodeState(
            step=s.step + 1,
            logits=logits,
            cache=cache,
            done=done,
            positions=positions,
            out=s.out.written(put, tok, lp, real),
            seen=None if s.seen is None else s.seen.after(tok, real),
        )

    init = _DecodeState(
        step=zero,
        logits=logits,
        cache=cache,
        done=jnp.zeros((B,), jnp.bool_),
        positions=jnp.sum(prompt_masks, axis=-1, dtype=jnp.int32),
        out=_Completions.empty(B, N, opts.pad_id),
        seen=(
            Seen.of_prompts(prompts, prompt_masks, policy.vocab_size) if opts.penalized else None
        ),
    )
    s = jax.lax.while_loop(cond, body, init)
    return _with_prompts(prompts, prompt_masks, s.out)


_generate_batch_jit = eqx.filter_jit(_generate_batch)


def generate_batch(
    policy: AbstractDecoder,
    prompts: Integer[ArrayLike, "B P"],
    prompt_masks: Bool[ArrayLike, "B P"] | Integer[ArrayLike, "B P"],
    key: PRNGKeyArray | Key[Array, " B"] | UInt32[Array, "B 2"],
    **options: Any,
) -> GenerationOutput:
    """Sample completions for a batch of prompts in one compiled program.

    Prefill runs all prompts at once; the decode loop is a `lax.while_loop` that stops
    as soon as every row has emitted a stop id (or after `max_new_tokens`), with no
    Python work per step. One compile per (batch, prompt length, options).

    **Arguments:**

    - `policy`: a decoder (`rlhf_eqx.models.AbstractDecoder`, e.g. `rlhf_eqx.Policy`).
    - `prompts`, `prompt_masks`: `[B, P]` ids and real-token masks; each row needs at
      least one real token. JAX or NumPy arrays, as a tokenizer returns them
      (`tokenizer(..., return_tensors="np")`'s `input_ids` and `attention_mask`): ids of
      any integer dtype (NumPy int64 ids become int32 once checked), masks of bools or
      the integers 0 and 1 (read as `mask != 0`; another value in a concrete mask is a
      `ValueError` naming `prompt_masks`). Nested Python lists are refused (pass
      `np.asarray(ids)`). The results are those of the same values given as JAX int32
      ids and bool masks. Concrete ids outside `[0, vocab_size)` raise a `ValueError`
      naming the row and the id. `P + max_new_tokens` may not exceed the model's
      `cfg.max_seq_len` (when it has one): a `ValueError` names both numbers.
    - `key`: PRNG key (ignored when greedy), or one key per prompt (`[B]` typed keys or
      raw `uint32[B, 2]`): then sample `g` of prompt `p` draws its `t`-th token with
      `fold_in(fold_in(key[p], g), t)` (`fold_in(key[p], t)` with `num_samples=1`), as
      `generate_continuous` does with the same keys, so a row's tokens do not depend on
      the other rows of the batch (up to the floating-point rounding of batched matrix
      products, which could flip a near-tie). Another shape is a `ValueError` naming
      `key`.
    - `**options`: the fields of `SamplingOptions`: `max_new_tokens` (required),
      `temperature=1.0` (0 is greedy), `top_k=None`, `top_p=None`, `min_p=None`
      (`filter_logits`), `repetition_penalty=1.0`, `presence_penalty=0.0`,
      `frequency_penalty=0.0` (`penalize_logits`: a row's context is its prompt's real
      tokens and its tokens so far; its generated counts start at 0, also for each of a
      prompt's `num_samples` rows), `eos_id=None` (one id or several), `pad_id=0`,
      `check_ids=False`, `num_samples=1` (completions per prompt, each prompt
      prefilled once). A stop id outside `[0, vocab_size)` is a `ValueError` (the model
      never samples it).

    **Returns:** a `GenerationOutput` with a leading batch axis (`B · num_samples`
    rows), rows of length `P + max_new_tokens`. Cut completions at stop *strings* afterwards with
    `truncate_at_stop_strings`.

    A decoder whose `prefill` or `decode_step` does not return `(logits [vocab_size],
    cache)` per sample, or whose `decode_step` changes the cache's structure, shapes or
    dtypes, is refused when the sampler is traced (`ValueError` naming the class, the
    method and the expected and actual shapes).
    """
    opts = SamplingOptions(**options)
    policy = _check_decoder(policy)
    prompts, prompt_masks = _check_batch(policy, prompts, prompt_masks, opts)
    return _generate_batch_jit(policy, prompts, prompt_masks, key, opts)


def generate(
    policy: AbstractDecoder,
    prompt: Integer[ArrayLike, " P"],
    prompt_mask: Bool[ArrayLike, " P"] | Integer[ArrayLike, " P"],
    key: PRNGKeyArray,
    **options: Any,
) -> GenerationOutput:
    """Sample a completion of one prompt (jitted; vmappable over a batch of prompts).

    `generate_batch` on a batch of one: same `options` (`SamplingOptions`), no batch axis;
    `prompt` and `prompt_mask` (`[P]`) may be JAX or NumPy arrays, as `generate_batch`'s
    (integer ids; bool or 0 / 1 integer masks, another value naming `prompt_mask`).
    Under `jax.vmap` the loop runs until every row of the batch is done; `generate_batch`
    is the batched entry point.
    """
    if options.get("num_samples", 1) != 1:
        raise ValueError(
            f"generate samples one completion (got num_samples={options['num_samples']!r}); "
            "use generate_batch(..., num_samples=n)"
        )
    prompt_mask = bool_masks(prompt_mask, "prompt_mask")
    out = generate_batch(policy, prompt[None], prompt_mask[None], key, **options)
    return jax.tree_util.tree_map(lambda x: x[0], out)
