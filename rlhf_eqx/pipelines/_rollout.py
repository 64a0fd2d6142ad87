"""Rollouts: sample G completions per prompt (stopping at stop ids, then cut at stop
strings), decode, score.

Scoring is host-side Python on decoded text (`RewardFunction`s, weighted) or a jitted
model (`reward_model_scores`); both give one float per completion.
"""

import dataclasses
import math
import numbers
from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Float32, Int, PRNGKeyArray

import rlhf_eqx as rx
from rlhf_eqx import data


@dataclasses.dataclass(frozen=True)
class Rollout:
    """Sampled completions: `B = len(prompts) * group_size` rows, groups contiguous.

    - `tokens`, `mask`, `completion_mask`: `[B, T]` left-padded prompt + completion, the
      real tokens and the completion tokens (nothing after a stop id or stop string).
    - `logprobs`: `[B, T]` the sampler's log-probabilities of the completion tokens at
      the sampling temperature (0 elsewhere): the PPO/GRPO `old_logp`.
    - `truncated`: `[B]` completions that hit `max_new_tokens` without a stop id or
      stop string.
    - `prompts`, `texts`: the prompt of each row and its decoded completion.
    - `policy_version`: `[B, T_new]` with partial rollouts (`grpo.partial_rollouts`), the
      update whose policy sampled each completion token (`-1` where there is none);
      `None` otherwise.
    - `temperature`: the sampling temperature, at which `logprobs` are and at which the
      reference's log-probabilities are compared with them (`token_logps(...,
      temperature=)`, as TRL's GRPO and PPO temper the reference's logits too).
    """

    tokens: Int[Array, "B T"]
    mask: Bool[Array, "B T"]
    completion_mask: Bool[Array, "B T"]
    logprobs: Float[Array, "B T"]
    truncated: Bool[Array, " B"]
    prompts: tuple[str, ...]
    texts: tuple[str, ...]
    group_size: int
    policy_version: Int[Array, "B T_new"] | None = None
    temperature: float = rx.DEFAULT_TEMPERATURE


@dataclasses.dataclass(frozen=True)
class RewardFunction:
    """A named reward `fn(prompt, completion) -> float` with a weight; a run's reward is
    the weighted sum of its reward functions."""

    name: str
    fn: Callable[[str, str], float]
    weight: float = 1.0


def encode_prompts(tok, prompts: Sequence[str], *, prompt_length: int) -> list[list[int]]:
    """Token ids of each prompt (BOS first when the tokenizer asks for it,
    `data.wants_bos`); prompts longer than `prompt_length` are an error naming the
    first of them, how many there are and the length that holds them all."""
    bos = [tok.bos_id] if data.wants_bos(tok) else []
    ids = [bos + list(tok.encode(p)) for p in prompts]
    over = [i for i, x in enumerate(ids) if len(x) > prompt_length]
    if over:
        i, p = over[0], prompts[over[0]]
        raise ValueError(
            f"prompt {i} ({p[:40]!r}...) has {len(ids[i])} tokens > "
            f"prompt_length={prompt_length} ({len(over)} of {len(ids)} prompt(s) do not "
            f"fit; `sampling.prompt_length` in a pipeline run: "
            f"{max(len(x) for x in ids)} holds them all)"
        )
    return ids


SAMPLING_FIELDS = (
    "prompt_length",
    "max_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "stop_strings",
    "slots",
)


FILTERS_OFF: dict[str, float | int] = {
    "top_k": 0,
    "top_p": 1.0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}
"""The sampler's filters and penalties (`SAMPLING_FIELDS`) and the value of each that is
off (TRL's GRPOConfig and vLLM's)."""


def filter_options(**settings: float | int) -> dict:
    """The sampler's filter and penalty keywords of a run's `sampling.top_k` / `top_p` /
    `min_p` / `repetition_penalty` / `presence_penalty` / `frequency_penalty` (given by
    name), each only where it acts (`FILTERS_OFF`: `top_k=0`, `top_p=1`, `min_p=0`,
    `repetition_penalty=1` and the other penalties 0 are off): `{}` for the defaults, so
    unfiltered runs sample with the same compiled program as before. The
    log-probabilities the sampler returns (and the steps use) are those of the tempered
    distribution before the penalties and the filters, as TRL's and vLLM's."""
    return {
        name: int(value) if name == "top_k" else float(value)
        for name, value in settings.items()
        if value != FILTERS_OFF[name]
    }


def filters_of(settings) -> dict:
    """`filter_options` of the run context or sampling settings `settings` (an object with
    the `FILTERS_OFF` fields)."""
    return filter_options(**{name: getattr(settings, name) for name in FILTERS_OFF})


def sampling_options(settings) -> dict:
    """`sample_rollout`'s sampling keywords (`SAMPLING_FIELDS`) read from a config or run
    context that has those fields."""
    return {name: getattr(settings, name) for name in SAMPLING_FIELDS}


@dataclasses.dataclass(frozen=True)
class PendingRollout:
    """A rollout sampled by `dispatch_rollout` and not yet decoded: `finish_rollout`
    cuts it at the stop strings and decodes it."""

    out: "rx.GenerationOutput"
    prompt_ids: tuple[tuple[int, ...], ...]
    prompts: tuple[str, ...]
    group_size: int
    prompt_length: int
    stop_ids: tuple[int, ...]
    stop_strings: tuple[str, ...]
    temperature: float = rx.DEFAULT_TEMPERATURE
    filters: dict = dataclasses.field(default_factory=dict)  # `filter_options`


def default_stop_ids(tok) -> tuple[int, ...]:
    """The ids a completion of `tok`'s model stops at unless told otherwise: the
    tokenizer's `stop_ids` (EOS and its model's end-of-turn ids: a GGUF file's
    `tokenizer.ggml.eot_token_id`, an HF directory's `generation_config.json` list; EOS
    alone for a tokenizer without them) and BOS (the stories260K model starts a new story
    with it), in ascending order."""
    stops = getattr(tok, "stop_ids", None) or (tok.eos_id,)
    return tuple(sorted({*(int(i) for i in stops), int(tok.bos_id)}))


def dispatch_rollout(
    policy,
    tok,
    prompts: Sequence[str],
    key: PRNGKeyArray,
    *,
    group_size: int = 1,
    prompt_length: int,
    max_new_tokens: int,
    temperature: float = rx.DEFAULT_TEMPERATURE,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    stop_ids: Sequence[int] | None = None,
    stop_strings: Sequence[str] = (),
    slots: int = 0,
    place: Callable | None = None,
) -> PendingRollout:
    """The device half of `sample_rollout`: encode the prompts and run the compiled
    sampler for `group_size` completions of each prompt, with `rlhf_eqx.generate_batch`
    or with `slots > 0` with `rlhf_eqx.generate_continuous` (that many decode slots
    refilled as rows finish; prompt `i` draws from `fold_in(key, i)`, so its samples do
    not depend on the batching).

    Prompts are left-padded to `prompt_length` (one compiled sampler per batch size).
    The sampler stops a row at the first of `stop_ids` (default: `default_stop_ids`,
    EOS, the model's end-of-turn ids and BOS — the stories260K model starts a new story
    with BOS; the stop id is kept). `stop_strings`
    (e.g. `("\\n\\nHuman:",)` for chat-formatted prompts) are applied by the host half. The
    same `temperature` must be given to the training steps. `top_k`, `top_p`, `min_p`
    filter the tempered distribution (`filter_options`: off at 0, 1, 0);
    `repetition_penalty`, `presence_penalty`, `frequency_penalty` penalise the tokens
    already seen (`rlhf_eqx.penalize_logits`: off at 1, 0, 0). `place`, when
    given, lays the prompt tokens and mask out for the sampler, e.g. split over a sampler
    mesh: `(tokens, mask) -> (tokens, mask)`.

    `finish_rollout`, the host half (cutting at stop strings, decoding), can then run
    elsewhere, e.g. in a worker thread while an update runs (a GRPO run with `overlap`).
    Equinox's compiled calls return once their result is ready, so this returns after
    sampling."""
    parameters = locals()  # the arguments by name (the filters and penalties are read below)
    if stop_ids is None:
        stop_ids = default_stop_ids(tok)
    stop_ids = tuple(int(t) for t in stop_ids)
    ids = encode_prompts(tok, prompts, prompt_length=prompt_length)
    batch = data.collate_prompts(list(ids), max_length=prompt_length, pad_id=tok.pad_id)
    filters = filter_options(**{name: parameters[name] for name in FILTERS_OFF})
    kw = dict(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        eos_id=list(stop_ids) or None,
        pad_id=tok.pad_id,
        num_samples=group_size,  # each prompt prefilled once, its group_size rows follow it
        **filters,
    )
    tokens, mask = batch.tokens, batch.mask
    if place is not None:
        tokens, mask = place(tokens, mask)
    if slots > 0:
        keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(len(ids)))
        rows = len(ids) * group_size
        out = rx.generate_continuous(policy, tokens, mask, keys, slots=min(slots, rows), **kw)
    else:
        out = rx.generate_batch(policy, tokens, mask, key, **kw)
    return PendingRollout(
        out=out,
        prompt_ids=tuple(tuple(x) for x in ids),
        prompts=tuple(prompts),
        group_size=group_size,
        prompt_length=prompt_length,
        stop_ids=stop_ids,
        stop_strings=tuple(stop_strings),
        temperature=float(temperature),
        filters=filters,
    )


def finish_rollout(pending: PendingRollout, tok) -> Rollout:
    """The host half of `sample_rollout`: wait for the sampler of `pending`, cut the
    completions at its stop strings and decode them."""
    out, G, P = pending.out, pending.group_size, pending.prompt_length
    stop_ids = pending.stop_ids
    lengths = np.asarray(out.completion_mask).sum(axis=1)
    tokens = np.asarray(out.tokens)
    last = tokens[np.arange(tokens.shape[0]), P + np.maximum(lengths - 1, 0)]
    stopped = (lengths > 0) & np.isin(last, np.asarray(stop_ids, np.int64))
    if pending.stop_strings:
        out = rx.truncate_at_stop_strings(out, tok, pending.stop_strings, pad_id=tok.pad_id)
        stopped |= np.asarray(out.completion_mask).sum(axis=1) < lengths
    tokens = np.asarray(out.tokens)
    completion = np.asarray(out.completion_mask)
    texts = []
    repeated = [x for x in pending.prompt_ids for _ in range(G)]
    for b, prompt_ids in enumerate(repeated):
        comp = [t for t in tokens[b][completion[b]].tolist() if t not in stop_ids]
        texts.append(data.decode_continuation(tok, list(prompt_ids), comp))
    return Rollout(
        tokens=out.tokens,
        mask=out.mask,
        completion_mask=out.completion_mask,
        logprobs=out.logprobs,
        truncated=jnp.asarray(~stopped),
        prompts=tuple(p for p in pending.prompts for _ in range(G)),
        texts=tuple(texts),
        group_size=G,
        temperature=pending.temperature,
    )


def sample_rollout(policy, tok, prompts: Sequence[str], key: PRNGKeyArray, **options) -> Rollout:
    """Sample completions of `prompts`: `dispatch_rollout` (its keyword `options`:
    `group_size`, `prompt_length`, `max_new_tokens`, `temperature`, `top_k`, `top_p`,
    `min_p`, the three penalties, `stop_ids`, `stop_strings`, `slots`) then
    `finish_rollout`, which cuts each
    completion where one of `stop_strings` first appears in its text
    (`rlhf_eqx.truncate_at_stop_strings`: the string is dropped, and the tokens, masks
    and log-probabilities after the cut are cleared) before anything is scored."""
    return finish_rollout(dispatch_rollout(policy, tok, prompts, key, **options), tok)


def _reward_value(value: object, name: str, row: int, group_size: int) -> float:
    """`value` as a finite float, or a `ValueError` naming the reward function, the
    prompt, the completion and the value."""
    if isinstance(value, bool | np.bool_ | numbers.Real):
        number = float(value)
    elif (
        hasattr(value, "dtype")
        and np.shape(value) == ()
        and (
            jnp.issubdtype(value.dtype, jnp.floating)
            or jnp.issubdtype(value.dtype, jnp.integer)
            or jnp.issubdtype(value.dtype, jnp.bool_)
        )
    ):  # numpy scalars of any real dtype (bfloat16 included), 0-d numpy / jax arrays
        number = float(value)
    else:
        number = None
    if number is None or not math.isfinite(number):
        kind = "not a real number" if number is None else "not finite"
        raise ValueError(
            f"reward function {name!r} returned {value!r} for prompt {row // group_size} "
            f"(completion {row}): {kind}; a reward must be a finite int, float or bool"
        )
    return number


def score_rollout(
    rollout: Rollout, reward_fns: Sequence[RewardFunction]
) -> tuple[Float32[np.ndarray, " B"], dict[str, float]]:
    """Weighted sum of `reward_fns` on each completion: `(rewards [B], metrics)` with the
    mean of each named reward (`reward/<name>`).

    A reward must be a finite real number: a Python `int`, `float` or `bool`, or a numpy
    / jax scalar (0-d array) of a real dtype. Anything else — `None`, a string (even
    `"1.0"`), a list, a complex number, NaN or ±inf — raises `ValueError` naming the
    reward function, the prompt (and completion) index and the value."""
    if not reward_fns:
        raise ValueError("score_rollout needs at least one reward function")
    total = np.zeros(len(rollout.texts), np.float32)
    metrics = {}
    G = max(int(rollout.group_size), 1)
    for rf in reward_fns:
        values = np.asarray(
            [
                _reward_value(rf.fn(p, t), rf.name, b, G)
                for b, (p, t) in enumerate(zip(rollout.prompts, rollout.texts))
            ],
            np.float32,
        )
        if not np.all(np.isfinite(values)):  # finite floats past the float32 range
            b = int(np.argmin(np.isfinite(values)))
            raise ValueError(
                f"reward function {rf.name!r} returned a value that overflows float32 for "
                f"prompt {b // G} (completion {b})"
            )
        metrics[f"reward/{rf.name}"] = float(values.mean())
        total += rf.weight * values
    return total, metrics


def group_signal(rewards: Float[Array | np.ndarray, " B"], group_size: int) -> float:
    """`frac_reward_zero_std`: the fraction of groups whose rewards are all equal (their
    group-relative advantages are 0: no learning signal)."""
    groups = np.asarray(rewards).reshape(-1, group_size)
    return float(np.mean(np.std(groups, axis=1) == 0.0))


def no_signal_message(rollout: int, beta: float) -> str:
    """The `no_signal` event of a rollout whose groups all have equal rewards: zero
    advantages, and an update that only the KL term (`beta > 0`) still has."""
    return f"rollout {rollout}: every group has equal rewards; the advantages are zero" + (
        f" and only the KL term (grpo.beta={beta}) moves the policy"
        if beta
        else " and so is the update"
    )


@eqx.filter_jit
def reward_model_scores(
    reward_model, tokens: Int[Array, "B T"], mask: Bool[Array, "B T"]
) -> Float[Array, " B"]:
    """Scalar reward of each sequence under a `RewardModel` (jitted)."""
    return jax.vmap(reward_model)(tokens, mask).astype(jnp.float32)


def token_logps(
    model,
    tokens: Int[Array, "B T"],
    mask: Bool[Array, "B T"],
    temperature: float = rx.DEFAULT_TEMPERATURE,
) -> Float[Array, "B T"]:
    r"""`log p(tokens[t] | tokens[<t])` of every row under `model` (0 where undefined), of
    the distribution $\mathrm{softmax}(z / \tau)$ at `temperature` $\tau$ (a sampler's
    log-probabilities are at its sampling temperature; a reference compared with them is
    taken at the same one). One compiled program per model, shapes and temperature,
    however the temperature is given (left out, or passed by position or by name)."""
    if isinstance(temperature, int | float):  # a number: static, one program per value
        temperature = float(temperature)
    return _token_logps(model, tokens, mask, temperature)


@eqx.filter_jit
def _token_logps(model, tokens, mask, temperature):
    return jax.vmap(lambda t, m: rx.token_logprobs(model, t, m, temperature=temperature))(
        tokens, mask
    )
