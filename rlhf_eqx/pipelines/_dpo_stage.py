"""DPO (Rafailov et al. 2023), the `dpo` and `online-dpo` stages: their settings
(`DPOConfig`, the `dpo` section both read), the runs (offline on fixed pairs, optionally
packed, and online / iterative: sample, label, pair, train, repeat; both with a cached
reference), the stages on the built-in task (pairs of SFT samples labelled by the noisy
scorer, or by the reward model for online DPO) and on a preference file, and their
registration."""

import dataclasses
from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import rlhf_eqx as rx
from rlhf_eqx import data

from ..losses import DPO_BATCH_LOSS_TYPES, DPO_LOSS_TYPES, DPO_REFERENCE_FREE_LOSS_TYPES
from ..train import DPOSettings
from ._config import BatchStageConfig, LoRASettings, _optim
from ._data_prep import DATA_EOS, data_ctx, implicit_accuracy, preference_split, trained_policy
from ._evaluate import binomial_se
from ._field_checks import _at_least, _fail, _positive
from ._monitor import model_flops
from ._registry import Outcome, Stage, StageEnv, register_stage
from ._rollout import sample_rollout, sampling_options
from ._runs import (
    RunContext,
    RunResult,
    collate_pairs,
    final_policy,
    rows_at,
    run_loop,
    run_offline,
    shuffled_batches,
    shuffled_rows,
    take_rows,
    train_setup,
)
from ._sampled_eval import heldout_samples
from ._task import TRAIN_PROMPTS
from ._validation import validate_stage


@dataclasses.dataclass(frozen=True)
class DPOConfig(BatchStageConfig, DPOSettings):
    """DPO (Rafailov et al. 2023; the step's settings are `rlhf_eqx.train.DPOSettings`:
    `beta`, `loss_type`, `label_smoothing`, `rpo_alpha`, `loss_kwargs`, and `reference`,
    here `cached`: the runs compute the reference log-probabilities once, or `none`)
    over `rounds` rounds of fresh
    samples (`rounds=1`: offline on the first samples; online DPO resamples each round).
    `packing` (offline DPO on a data file): token-budget batches
    (`data.pack_preference_steps`), each prompt written once before both completions and
    several pairs to a row, about `batch_size` pairs a step and one shape for all steps,
    instead of `batch_size` rows padded to `max_length`.
    `missing_eos_penalty` (online DPO, which samples; `None`: off; a number >= 0, TRL's
    `OnlineDPOConfig.missing_eos_penalty`): subtracted from the label of every sample cut
    at `sampling.max_new_tokens` without a stop (`penalised_labels`), before the pairs
    are formed."""

    steps: int = 20
    reference: str = "cached"
    rounds: int = 3
    samples: int = 4
    packing: bool = False
    lora: LoRASettings = LoRASettings()
    missing_eos_penalty: float | None = None

    def check(self, name: str, *, device_count: int = 1) -> None:
        """DPO's own rules: a cached (or no) reference, rounds >= 1, two samples or more per
        prompt, no packing or micro-batches with a loss that sorts over a batch's pairs,
        and label smoothing only for a loss that smooths its labels."""
        del device_count
        if isinstance(self.loss_type, str) and self.loss_type in DPO_LOSS_TYPES:
            try:  # a built-in loss's rule (a custom one's: `DPOSettings`)
                rx.train.dpo_loss_fn(loss_type=self.loss_type, label_smoothing=self.label_smoothing)
            except ValueError as e:
                _fail(f"{name}.label_smoothing", self.label_smoothing, str(e).split(": ", 1)[1])
        if self.reference == "model":
            _fail(
                f"{name}.reference",
                self.reference,
                "must be cached or none (the runs cache the reference log-probabilities)",
            )
        _positive(f"{name}.rounds", self.rounds)
        if self.missing_eos_penalty is not None:
            _at_least(f"{name}.missing_eos_penalty", self.missing_eos_penalty, 0)
        if self.samples < 2:
            _fail(f"{name}.samples", self.samples, "must be >= 2 (pairs need two completions)")
        if self.packing and self.loss_type in DPO_BATCH_LOSS_TYPES:
            why = (
                f"loss_type={self.loss_type!r} sorts over a batch's pairs and needs unpacked "
                "batches"
            )
            _fail(f"{name}.packing", self.packing, why)
        if self.options.micro_batches != 1 and self.loss_type in DPO_BATCH_LOSS_TYPES:
            why = (
                f"loss_type={self.loss_type!r} sorts over a whole batch's pairs and needs "
                "micro_batches=1"
            )
            _fail(f"{name}.options.micro_batches", self.options.micro_batches, why)


_ONLINE_UNPACKED = (
    "on the built-in task samples fresh pairs each round and trains them unpacked; packing "
    "applies to offline DPO on a data file"
)


def _check_packing(stage: str):
    def check_run(cfg, run) -> None:
        """Packing applies to offline DPO on a data file only."""
        del run
        if cfg.data.path is None and cfg.dpo.packing:
            _fail("dpo.packing", cfg.dpo.packing, f"the {stage} stage {_ONLINE_UNPACKED}")

    return check_run


def run_dpo(
    model,
    tok,
    pairs: Sequence[data.PreferenceRecord],
    *,
    cfg: DPOConfig,
    ctx: RunContext,
    make_step: Callable | None = None,
) -> RunResult:
    """Offline DPO (Rafailov et al. 2023) on fixed pairs: reference log-probs computed
    once (the reference is the model without its adapters; none when the steps read
    none, `reads_reference`), `cfg.steps` steps. With
    `cfg.packing`, on token-budget batches (`packed_steps`).

    `make_step(optimizer, cfg, *, options)`: the update (default
    `rlhf_eqx.train.make_dpo_step`); another preference step on the same batches (a
    variant of the DPO loss with settings of its own, a subclass of `DPOConfig`) runs
    with everything here: cached reference, packing, checkpoints, resume."""
    validate_stage("dpo", cfg)
    k_lora, ctx_key = jax.random.split(ctx.key)
    make_step = make_step or rx.train.make_dpo_step
    state, reference, step = train_setup(model, cfg, cfg.steps, k_lora, make_step)
    run = dict(steps=cfg.steps, ctx=ctx, ctx_key=ctx_key, policy_of=lambda s: s.model)
    scored = reads_reference(cfg)
    if cfg.packing:
        batches = packed_steps(
            pairs,
            tok,
            cfg=cfg,
            prompt_length=ctx.prompt_length,
            seed=ctx.ops.seed,
            add_eos=ctx.add_eos,
        )
        return run_offline(
            state,
            step,
            referenced_batches(reference, batches, ctx.ops.seed)
            if scored
            else shuffled_batches(batches, ctx.ops.seed),
            tokens_per_iteration=int(batches[0].tokens.size),
            **run,
        )
    full = collate_pairs(
        pairs,
        tok,
        max_length=cfg.max_length,
        prompt_length=ctx.prompt_length,
        add_eos=ctx.add_eos,
    )
    return run_offline(
        state,
        step,
        referenced_rows(reference, full, cfg.batch_size, ctx.ops.seed)
        if scored
        else shuffled_rows(full, cfg.batch_size, ctx.ops.seed),
        tokens_per_iteration=2 * cfg.batch_size * cfg.max_length,
        **run,
    )


def reads_reference(cfg: DPOConfig) -> bool:
    """Whether the run's steps read the reference log-probabilities: not with
    `reference="none"` (TRL `reference_free`) or a loss defined without a reference
    (`simpo`, `orpo`); the runs then skip the reference's forward passes (a `make_step`
    of the runs gets no `ref_chosen_logp` / `ref_rejected_logp` then)."""
    if cfg.reference == "none":
        return False
    return not (isinstance(cfg.loss_type, str) and cfg.loss_type in DPO_REFERENCE_FREE_LOSS_TYPES)


def referenced_batches(reference, batches: Sequence, seed: int) -> Callable[[int], object]:
    """`shuffled_batches` with each batch's reference log-probabilities computed when it is
    first used and kept (`compute_reference_logps`, one forward of the reference per batch
    over the whole run): a run shorter than an epoch computes only what it trains on."""
    at = shuffled_batches(range(len(batches)), seed)
    done: dict[int, object] = {}

    def batch_at(i: int):
        j = at(i)
        if j not in done:
            done[j] = rx.train.compute_reference_logps(reference, batches[j])
        return done[j]

    return batch_at


def referenced_rows(reference, full, batch_size: int, seed: int) -> Callable[[int], object]:
    """`shuffled_rows` with the reference log-probabilities of each row computed with the
    first batch that holds it (one forward of a `batch_size`-row batch; its rows' values
    kept for later epochs), instead of over every row before the first step."""
    n = full.chosen_tokens.shape[0]
    ref = np.zeros((2, n), np.float32)
    known = np.zeros(n, bool)

    def batch_at(i: int):
        idx = rows_at(n, batch_size, seed, i)
        batch = take_rows(full, idx)
        if not known[idx].all():
            b = rx.train.compute_reference_logps(reference, batch)
            ref[0, idx], ref[1, idx] = (
                np.asarray(b.ref_chosen_logp),
                np.asarray(b.ref_rejected_logp),
            )
            known[idx] = True
            return b
        values = (jnp.asarray(ref[0, idx]), jnp.asarray(ref[1, idx]))
        return eqx.tree_at(
            lambda b: (b.ref_chosen_logp, b.ref_rejected_logp),
            batch,
            values,
            is_leaf=lambda x: x is None,
        )

    return batch_at


def packed_steps(
    pairs: Sequence[data.PreferenceRecord],
    tok,
    *,
    cfg: DPOConfig,
    prompt_length: int,
    seed: int,
    add_eos: bool | str = False,
) -> list[rx.PackedPreferenceBatch]:
    """Token-budget DPO batches (`data.pack_preference_steps`): rows of `2 · max_length`
    tokens (any pair fits) holding up to 4 pairs each with their prompt written once, as
    many rows a step as hold `cfg.batch_size` pairs on average; one shape for every step.
    `add_eos` as `RunContext.add_eos`."""
    tokenized, _ = data.tokenize_preferences(
        list(pairs),
        tok,
        max_length=cfg.max_length,
        max_prompt_length=prompt_length,
        add_eos=add_eos,
    )
    return data.pack_preference_steps(
        tokenized,
        pad_id=tok.pad_id,
        row_length=2 * cfg.max_length,
        pairs_per_step=cfg.batch_size,
        seed=seed,
    )


def best_worst_pairs(
    prompts: Sequence[str], texts: Sequence[str], labels: Sequence[float], samples: int
) -> list[data.PreferenceRecord]:
    """For each prompt's `samples` completions, (best, worst) by `labels` when they differ."""
    pairs = []
    for j, prompt in enumerate(prompts):
        lab = np.asarray(labels[j * samples : (j + 1) * samples])
        best, worst = int(np.argmax(lab)), int(np.argmin(lab))
        if lab[best] > lab[worst]:
            pairs.append(
                data.PreferenceRecord(prompt, texts[j * samples + best], texts[j * samples + worst])
            )
    return pairs


def penalised_labels(labels, truncated, cfg: DPOConfig) -> list[float]:
    """The labels of a round's samples with `cfg.missing_eos_penalty` (when set)
    subtracted from those of the samples cut at the length limit without a stop
    (`truncated`, the rollout's): TRL's `scores[~contains_eos] -= missing_eos_penalty`,
    so that a sample that never ends loses against one that does."""
    if cfg.missing_eos_penalty is None:
        return list(labels)
    cut = np.asarray(truncated, dtype=np.float64)
    return (np.asarray(labels, dtype=np.float64) - cfg.missing_eos_penalty * cut).tolist()


def _round_steps(state, step, pairs, count: int, cfg: DPOConfig, seed: int, key: jax.Array):
    """One round of online DPO's updates: `cfg.steps` steps on `cfg.batch_size` of the
    first `count` rows of `pairs` (step `s`: the rows `rows_at(count, cfg.batch_size,
    seed, s)`, the key `fold_in(key, s)`). Returns the state and each step's metrics."""
    metrics = []
    for s in range(cfg.steps):
        batch = take_rows(pairs, rows_at(count, cfg.batch_size, seed, s))
        state, m = state.apply(step, batch, key=jax.random.fold_in(key, s))
        metrics.append(m)
    return state, metrics


def run_online_dpo(
    model,
    tok,
    prompts: Sequence[str],
    label: Callable[[Sequence[str], Sequence[str], int], Sequence[float]],
    *,
    cfg: DPOConfig,
    ctx: RunContext,
    make_step: Callable | None = None,
) -> RunResult:
    """Online (iterative) DPO: for each of `cfg.rounds` rounds, sample `cfg.samples`
    completions per prompt from the current policy, label them with
    `label(prompts, texts, round)` (a reward model or a judge), lower the labels of
    the samples cut without a stop by `cfg.missing_eos_penalty` (when set:
    `penalised_labels`; the round's `missing_eos` is the fraction cut), pair best and
    worst, cache the reference log-probs and take `cfg.steps` DPO steps (Xu et al. 2023;
    Guo et al. 2024). Packing is refused (`cfg.packing`): the rounds' fresh pairs train unpacked."""
    validate_stage("dpo", cfg)
    if cfg.packing:  # the built-in stages refuse it earlier (`_check_packing`)
        _fail("packing", cfg.packing, f"online DPO {_ONLINE_UNPACKED}")
    k_lora, ctx_key = jax.random.split(ctx.key)
    make_step = make_step or rx.train.make_dpo_step
    state, reference, step = train_setup(model, cfg, cfg.rounds * cfg.steps, k_lora, make_step)
    scored = reads_reference(cfg)

    def iteration(state, key, r):
        k_sample, k_steps = jax.random.split(key)
        roll = sample_rollout(
            state.model,
            tok,
            prompts,
            k_sample,
            group_size=cfg.samples,
            **sampling_options(ctx),
        )
        truncated = np.asarray(roll.truncated)
        labels = penalised_labels(label(roll.prompts, roll.texts, r), truncated, cfg)
        pairs = best_worst_pairs(prompts, roll.texts, labels, cfg.samples)
        info = {"pairs": float(len(pairs)), "label_mean": float(np.mean(labels))}
        if cfg.missing_eos_penalty is not None:
            info["missing_eos"] = float(np.mean(truncated))
        if not pairs:
            ctx.log.event(
                "no_signal",
                f"round {r}: all completions of every prompt got the same label; no pairs",
                iteration=r,
            )
            return state, [], info
        full = collate_pairs(pairs, tok, max_length=cfg.max_length, prompt_length=ctx.prompt_length)
        if scored:
            full = rx.train.compute_reference_logps(reference, full)
        n = full.chosen_tokens.shape[0]
        state, metrics = _round_steps(state, step, full, n, cfg, ctx.ops.seed + r, k_steps)
        return state, metrics, info

    ctx = dataclasses.replace(ctx, key=ctx_key)
    sampled = len(prompts) * cfg.samples * (ctx.prompt_length + ctx.max_new_tokens)
    flops = model_flops(
        rx.count_params(state.model),
        train_tokens=cfg.steps * 2 * cfg.batch_size * cfg.max_length,
        # + reference (when read), <= 1 pair/prompt
        forward_tokens=sampled + 2 * len(prompts) * cfg.max_length * scored,
    )
    return run_loop(
        state,
        iteration,
        ctx,
        cfg.rounds,
        policy_of=lambda s: s.model,
        tokens_per_iteration=sampled,
        flops_per_iteration=flops,
    )


def _rm_label(rm, tok, cfg):
    """Labels from a reward model's (or ensemble's) scores of `prompt + completion`
    (RLAIF)."""

    def label(prompts, texts, salt):
        del salt
        seqs, _ = data.tokenize_sft(
            list(zip(prompts, texts)),
            tok,
            max_length=cfg.dpo.max_length,
            max_prompt_length=cfg.sampling.prompt_length,
            add_eos=False,
        )
        batch = data.collate_sft(seqs, max_length=cfg.dpo.max_length, pad_id=tok.pad_id)
        return np.asarray(rm.scores(batch.tokens, batch.mask)[0]).tolist()

    return label


def online_dpo(env: StageEnv, c: DPOConfig) -> Outcome:
    """Online DPO from SFT on the built-in task, pairs labelled by the reward model."""
    label = _rm_label(env.reward, env.tok, env.cfg)
    ctx = env.ctx("online-dpo")
    res = run_online_dpo(env.policies["sft"], env.tok, TRAIN_PROMPTS, label, cfg=c, ctx=ctx)
    return Outcome(res, policy=final_policy(res.state.model))


def dpo(env: StageEnv, c: DPOConfig) -> Outcome:
    """DPO from SFT on the built-in task, pairs labelled by the noisy scorer."""
    ctx = env.ctx("dpo")
    res = run_online_dpo(env.policies["sft"], env.tok, TRAIN_PROMPTS, env.label, cfg=c, ctx=ctx)
    return Outcome(res, policy=final_policy(res.state.model))


def dpo_heldout_metrics(env: StageEnv, reference, trained, held: Sequence, c: DPOConfig) -> dict:
    r"""The held-out evaluation of a DPO-family stage on a preference file (the summary
    entry of `dpo --data`): `heldout_reward_accuracy`, the fraction of the `held` pairs
    (`preference_split`'s second part) whose implicit reward margin
    $\beta[(\log\pi(y_w) - \log\pi_{\rm ref}(y_w)) - (\log\pi(y_l) - \log\pi_{\rm ref}(y_l))]$
    of the `trained` policy against `reference` (the model training started from) is
    positive, with `c.beta` and the pairs collated at `c.max_length`; its binomial
    standard error `heldout_reward_accuracy_se`; and `sampled`, the two models' samples on
    the held-out prompts (`sampling` and `eval_samples` of the run's configuration)."""
    held_batch = collate_pairs(
        held,
        env.tok,
        max_length=c.max_length,
        prompt_length=env.cfg.sampling.prompt_length,
        add_eos=DATA_EOS,
    )
    accuracy = float(implicit_accuracy(trained, reference, held_batch, c.beta))
    n_held = held_batch.chosen_tokens.shape[0]
    return {
        "heldout_reward_accuracy": accuracy,
        "heldout_reward_accuracy_se": binomial_se(accuracy, n_held),
        "sampled": heldout_samples(env, reference, trained, held),
    }


def dpo_on_data(env: StageEnv, c: DPOConfig) -> Outcome:
    """Offline DPO on a preference file; the held-out implicit reward accuracy and
    held-out samples (`dpo_heldout_metrics`)."""
    policy = env.base
    train, held = preference_split(env, c)
    res = run_dpo(policy, env.tok, train, cfg=c, ctx=data_ctx(env))
    trained = trained_policy(env, res.state.model)
    env.summary["dpo"] = dpo_heldout_metrics(env, policy, trained, held, c)
    return Outcome(res, policy=trained)


register_stage(
    Stage(
        "online-dpo",
        DPOConfig,
        online_dpo,
        section="dpo",
        sections=("reward", "sft"),
        needs=lambda cfg: ("sft", "reward", "online-dpo"),
        help="online DPO on pairs labelled by the reward model",
        check_run=_check_packing("online-dpo"),
        key_stream=("split", 7),
    )
)
register_stage(
    Stage(
        "dpo",
        DPOConfig,
        dpo,
        dpo_on_data,
        help="DPO (and its loss family)",
        check_run=_check_packing("dpo"),
        task=dict(beta=0.1, rounds=3, steps=20, batch_size=16, samples=4, optim=_optim(5e-4)),
        key_stream=("split", 4),
    )
)
