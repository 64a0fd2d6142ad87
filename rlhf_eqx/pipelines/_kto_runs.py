"""KTO runs (Ethayarajh et al. 2024) on unpaired examples: a reference computed once,
the reference point estimated from mismatched completions in each batch."""

from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import numpy as np

import rlhf_eqx as rx
from rlhf_eqx import data

from ._lr_scale import build_optimizer
from ._rollout import sample_rollout, sampling_options
from ._runs import RunContext, RunResult, run_offline, shuffled_rows, with_lora
from ._stage_configs import (
    KTOConfig,
)
from ._validation import validate_stage


def collate_unpaired_records(
    records: Sequence[data.UnpairedRecord], tok, *, max_length: int, prompt_length: int
) -> rx.train.KTOBatch:
    """Tokenise `prompt + completion` (no EOS) right-padded to `max_length`, with the
    mismatched rows KTO's reference point needs (`data.collate_unpaired`)."""
    tokenized, _ = data.tokenize_unpaired(
        list(records), tok, max_length=max_length, max_prompt_length=prompt_length, add_eos=False
    )
    return data.collate_unpaired(tokenized, pad_id=tok.pad_id, max_length=max_length)


def run_kto(
    model, tok, records: Sequence[data.UnpairedRecord], *, cfg: KTOConfig, ctx: RunContext
) -> RunResult:
    """KTO (Ethayarajh et al. 2024; TRL `KTOTrainer`) on unpaired records: LoRA adapters
    per `cfg.lora` (the reference is the model without them), reference log-probs
    computed once (`compute_kto_reference_logps`), `cfg.steps` steps of `cfg.batch_size`
    examples (`make_kto_step`)."""
    validate_stage("kto", cfg)
    records = list(records)
    labels = {bool(r.label) for r in records}
    if labels != {True, False}:
        kind = "desirable" if True in labels else "undesirable"
        raise ValueError(
            f"KTO needs desirable and undesirable examples; all {len(records)} are {kind}"
        )
    full = collate_unpaired_records(
        records, tok, max_length=cfg.max_length, prompt_length=ctx.prompt_length
    )
    k_lora, ctx_key = jax.random.split(ctx.key)
    model, spec = with_lora(model, cfg.lora, k_lora)
    reference = rx.without_lora(model) if spec is not None else model
    full = rx.train.compute_kto_reference_logps(reference, full)
    opt = build_optimizer(cfg.optim, cfg.steps)
    state = rx.train.init_train_state(model, opt, filter_spec=spec)
    settings = rx.train.KTOSettings(
        beta=cfg.beta,
        desirable_weight=cfg.desirable_weight,
        undesirable_weight=cfg.undesirable_weight,
        loss_type=cfg.loss_type,
        reference="cached",
    )
    step = rx.train.make_kto_step(opt, settings, options=cfg.options)
    return run_offline(
        state,
        step,
        shuffled_rows(full, cfg.batch_size, ctx.ops.seed),
        steps=cfg.steps,
        tokens_per_iteration=2 * cfg.batch_size * cfg.max_length,
        ctx=ctx,
        ctx_key=ctx_key,
        policy_of=lambda s: s.model,
    )


def sampled_unpaired(
    policy,
    tok,
    prompts: Sequence[str],
    key: jax.Array,
    label: Callable[[Sequence[str], Sequence[str], int], Sequence[float]],
    *,
    samples: int,
    salt: int,
    sampling,
) -> list[data.UnpairedRecord]:
    """`samples` completions per prompt from `policy`, each labelled desirable when
    `label(prompts, texts, salt)` exceeds 0.5 (the built-in task's noisy scorer)."""
    roll = sample_rollout(
        policy, tok, prompts, key, group_size=samples, **sampling_options(sampling)
    )
    scores = np.asarray(label(roll.prompts, roll.texts, salt), np.float64)
    return [
        data.UnpairedRecord(p, t, bool(s > 0.5))
        for p, t, s in zip(roll.prompts, roll.texts, scores)
    ]


@eqx.filter_jit
def _logratios(policy, reference, batch):
    lp = rx.train.sequence_logps
    cm = batch.completion_mask
    return lp(policy, batch.tokens, batch.mask, cm) - lp(reference, batch.tokens, batch.mask, cm)


def kto_heldout_metrics(policy, reference, batch: rx.train.KTOBatch, beta: float) -> dict:
    """Held-out implicit rewards `β · log(π/π_ref)` of unpaired examples: their mean over
    the desirable and the undesirable ones, the margin between the two, and the
    fraction of (desirable, undesirable) combinations ordered correctly."""
    r = beta * np.asarray(_logratios(policy, reference, batch), np.float64)
    y = np.asarray(batch.label, bool)
    good, bad = r[y], r[~y]
    if not len(good) or not len(bad):
        return {}
    order = float(np.mean(good[:, None] > bad[None, :]))
    return {
        "heldout_reward_desirable": float(good.mean()),
        "heldout_reward_undesirable": float(bad.mean()),
        "heldout_reward_margin": float(good.mean() - bad.mean()),
        "heldout_ordering_accuracy": order,
    }
