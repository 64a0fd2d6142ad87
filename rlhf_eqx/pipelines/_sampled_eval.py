"""Sampled evaluation of a data-file stage: held-out prompts completed by the model before
and after training with the same keys (paired samples), the base model's NLL per token
of each side's samples (fluency: the aligned policy should not drift into text its base
finds unlikely), the trained policy's KL to the base on its own samples, a task score
with its standard error when the stage has one, and a few prompts with both completions
to read."""

from collections.abc import Callable, Sequence

import jax
import numpy as np
from jaxtyping import PRNGKeyArray

from ._data_prep import prompt_tokens
from ._evaluate import _completion_mean, _token_logps, prompt_se
from ._rollout import sample_rollout, sampling_options


def sampled_comparison(
    before,
    after,
    tok,
    prompts: Sequence[str],
    key: PRNGKeyArray,
    cfg,
    *,
    score: Callable[[str, str], float] | None = None,
    reward=None,
    max_prompts: int | None = None,
    shown: int = 3,
    reuse: dict | None = None,
) -> dict:
    """Sample `cfg.eval_samples` completions of each of the first `max_prompts` distinct
    `prompts` that fit `cfg.sampling.prompt_length` (default `cfg.data.eval_prompts`; 0:
    all; the number that did not fit is `longer_than_prompt_length`) with `before`
    (the model the stage started from, also the base of the NLL and the KL) and with
    `after`, with the same key (paired samples), at the run's sampling settings
    (`cfg.sampling`).

    **Returns:** a dict with `prompts`, `samples_per_prompt`, `base_nll_before` (the
    base model's NLL per completion token of its own samples), `base_nll_after` (of the
    trained policy's samples), `kl_after` (per-token KL(after || before) on the trained
    policy's samples, k1), and, with `score(prompt, completion)`, `score_before`,
    `score_after` and their standard errors over the prompts (`*_se`, `prompt_se`);
    with `reward` (a `RewardSource`: a reward model, an ensemble, a judge or a PRM,
    scoring a whole rollout), `reward_before`, `reward_after` and their `*_se` alike;
    `examples`: the first `shown` prompts with one completion of each model.

    `reuse`, a dict kept by the caller across calls (a sweep's members), holds the
    `before` side: a later call with the same `before` model, prompts, key, sampling
    settings and `score` takes it from there instead of sampling it again (the same
    numbers: the samples depend on nothing else).
    """
    limit = cfg.data.eval_prompts if max_prompts is None else max_prompts
    distinct = list(dict.fromkeys(prompts))
    fits = [p for p in distinct if prompt_tokens(tok, p) <= cfg.sampling.prompt_length]
    k = cfg.eval_samples
    opts = sampling_options(cfg.sampling)
    out: dict = {"samples_per_prompt": k}
    if len(fits) < len(distinct):
        out["longer_than_prompt_length"] = len(distinct) - len(fits)
    distinct = fits[:limit] if limit else fits
    out["prompts"] = len(distinct)
    if not distinct:
        return out
    rolls = {}
    same = None  # what the `before` side depends on (`reuse`'s key)
    if reuse is not None:
        key_bits = tuple(np.asarray(jax.random.key_data(key)).ravel().tolist())
        same = (id(before), tuple(distinct), k, tuple(sorted(opts.items())), score, key_bits)
        same += (id(reward),) if reward is not None else ()
    for name, model in (("before", before), ("after", after)):
        if name == "before" and reuse is not None and same in reuse:
            rolls[name], kept = reuse[same]
            out.update(kept)
            continue
        roll = sample_rollout(model, tok, distinct, key, group_size=k, **opts)
        rolls[name] = roll
        side = {}
        base_lp = _token_logps(before, roll)
        side[f"base_nll_{name}"] = -_completion_mean(base_lp, roll)
        if name == "after":
            side["kl_after"] = _completion_mean(_token_logps(after, roll) - base_lp, roll)
        if score is not None:
            s = np.asarray([score(p, t) for p, t in zip(roll.prompts, roll.texts)], np.float32)
            side[f"score_{name}"] = float(s.mean())
            side[f"score_{name}_se"] = prompt_se(s, k)
        if reward is not None:
            r = np.asarray(reward.score(roll).scores, np.float64)
            side[f"reward_{name}"] = float(r.mean())
            side[f"reward_{name}_se"] = prompt_se(r, k)
        out.update(side)
        if name == "before" and reuse is not None:
            reuse[same] = (roll, side)
    out["examples"] = [
        {
            "prompt": distinct[i],
            "before": rolls["before"].texts[i * k],
            "after": rolls["after"].texts[i * k],
        }
        for i in range(min(shown, len(distinct)))
    ]
    return out


def heldout_samples(env, before, after, held: Sequence, reuse: dict | None = None) -> dict:
    """`sampled_comparison` of a stage's run (`env`: its `StageEnv`) on the prompts of
    its held-out records (`data.eval_prompts` of them; 0: none, nothing is sampled and
    the result holds `prompts: 0`), with the key `ops.seed + 1` (`reuse`: as there)."""
    key = jax.random.key(env.cfg.ops.seed + 1)
    prompts = [r.prompt for r in held] if env.cfg.data.eval_prompts else []
    return sampled_comparison(before, after, env.tok, prompts, key, env.cfg, reuse=reuse)
