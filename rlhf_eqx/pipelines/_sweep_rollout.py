"""Rollouts of every member of a sweep in one program: the sampler `jax.vmap`ped over the
members' stacked policies and keys, then each member's rows decoded and cut at the stop
strings as `sample_rollout` does."""

from collections.abc import Sequence

import equinox as eqx
import jax

import rlhf_eqx as rx
from rlhf_eqx import data

from ._rollout import (
    FILTERS_OFF,
    PendingRollout,
    Rollout,
    default_stop_ids,
    encode_prompts,
    filter_options,
    finish_rollout,
    sample_rollout,
)
from ._sweep_program import member


@eqx.filter_jit
def _sample_all(models, tokens, mask, keys, options: dict):
    def one(model, tokens, mask, key_data):
        return rx.generate_batch(model, tokens, mask, jax.random.wrap_key_data(key_data), **options)

    return eqx.filter_vmap(one)(models, tokens, mask, keys)


def sample_members(
    models,
    tok,
    prompts: Sequence[Sequence[str]],
    keys: Sequence[jax.Array],
    *,
    group_size: int,
    **options,
) -> list[Rollout]:
    """`sample_rollout` of each member: member `m` samples `group_size` completions of
    each of its prompts `prompts[m]` (the same number for every member) with its policy
    (`models`, stacked on a leading member axis) and key `keys[m]`, the sampler vmapped
    over the members (one compiled program). `options`: `sample_rollout`'s sampling
    keywords (`sampling_options` of the run's sampling settings: `prompt_length`,
    `max_new_tokens`, `temperature`, `top_k`, `top_p`, `min_p`, the three penalties,
    `stop_strings`, `slots`).
    With `slots > 0` (continuous batching) the members are sampled one after another
    with `sample_rollout`."""
    if options.get("slots", 0) > 0:
        return [
            sample_rollout(member(models, m), tok, prompts[m], k, group_size=group_size, **options)
            for m, k in enumerate(keys)
        ]
    prompt_length = options["prompt_length"]
    stop_strings = options.get("stop_strings", ())
    stop_ids = options.get("stop_ids")
    stop_ids = default_stop_ids(tok) if stop_ids is None else tuple(int(t) for t in stop_ids)
    ids = [encode_prompts(tok, p, prompt_length=prompt_length) for p in prompts]
    batches = [
        data.collate_prompts(list(x), max_length=prompt_length, pad_id=tok.pad_id) for x in ids
    ]
    tokens = jax.numpy.stack([b.tokens for b in batches])
    mask = jax.numpy.stack([b.mask for b in batches])
    filters = filter_options(**{k: v for k, v in options.items() if k in FILTERS_OFF})
    sampler = {
        "max_new_tokens": options["max_new_tokens"],
        "temperature": options.get("temperature", rx.DEFAULT_TEMPERATURE),
        "eos_id": list(stop_ids) or None,
        "pad_id": tok.pad_id,
        "num_samples": group_size,
        **filters,
    }
    key_data = jax.numpy.stack([jax.random.key_data(k) for k in keys])
    out = _sample_all(models, tokens, mask, key_data, sampler)
    rolls = []
    for m in range(len(keys)):
        pending = PendingRollout(
            out=member(out, m),
            prompt_ids=tuple(tuple(x) for x in ids[m]),
            prompts=tuple(prompts[m]),
            group_size=group_size,
            prompt_length=prompt_length,
            stop_ids=stop_ids,
            stop_strings=tuple(stop_strings),
            temperature=float(sampler["temperature"]),
            filters=filters,
        )
        rolls.append(finish_rollout(pending, tok))
    return rolls
