"""The reward model, the `reward` stage: its settings (`RewardConfig`), its run (a
Bradley-Terry reward model or an ensemble of them, with checkpoint selection on held-out
pairs: `run_reward`), the stage on the built-in task (noisily labelled pairs of SFT
samples) and on a preference file, and its registration. Its model is the reward source
of the stages after it (`Outcome.reward`)."""

import dataclasses
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import rlhf_eqx as rx
from rlhf_eqx import data

from ..losses import ENSEMBLE_MODES
from ..train import RewardSettings
from ._config import BatchStageConfig, _optim
from ._data_prep import DATA_EOS, data_ctx, preference_split
from ._evaluate import binomial_se, reward_accuracy
from ._field_checks import _at_least, _choice, _fail, _positive
from ._lr_scale import build_optimizer
from ._monitor import model_flops
from ._registry import Outcome, Stage, StageEnv, register_stage
from ._reward_sources import EnsembleReward, ModelReward, export_reward_ensemble
from ._runs import (
    RunContext,
    RunResult,
    collate_pairs,
    export_reward_model,
    run_loop,
    shuffled_rows,
)
from ._task import HELDOUT_PROMPTS, TRAIN_PROMPTS, animal_score
from ._validation import validate_stage


@dataclasses.dataclass(frozen=True)
class RewardConfig(BatchStageConfig, RewardSettings):
    """Reward model (Bradley-Terry; `rlhf_eqx.train.RewardSettings`: `center_coef`,
    `margin`) on noisily labelled pairs of policy samples (`pairs_per_prompt` pairs
    sampled per prompt by the pipeline).

    Checkpoint selection: about `heldout_fraction` of the training pairs' prompts are
    held out, labels as noisy as the rest; every `eval_every` steps and at the end
    their accuracy is measured and the model with the best accuracy is kept (a reward
    model trained on noisy labels otherwise memorises them). `eval_every=0`: no
    selection, every pair trains (`heldout_fraction` is then not read and must keep its
    default).

    Ensemble: `ensemble > 1` (>= 1) trains that many reward models in one vmapped step
    (`rlhf_eqx.train.make_ensemble_reward_step`), each on its own bootstrap resample of
    every batch, and scores a completion by the members' `mean - ensemble_penalty * std`
    (`ensemble_mode`: `std`, `var`, `min` or `mean`; Coste et al. 2024; the penalty, a
    finite number >= 0, defaults to 0, the members' mean, as in
    `rlhf_eqx.losses.conservative_reward`).
    Checkpoint selection and accuracy use that score; the export is `reward/ensemble/`."""

    pairs_per_prompt: int = 4
    heldout_fraction: float = 0.1
    eval_every: int = 10
    ensemble: int = 1
    ensemble_mode: str = "std"
    ensemble_penalty: float = 0.0

    def check(self, name: str, *, device_count: int = 1) -> None:
        """The reward stage's own rules: pairs per prompt, the held-out fraction (its
        default with `eval_every=0`: nothing is held out), the ensemble's size, mode and
        penalty (their defaults with `ensemble=1`: one reward model scores alone)."""
        del device_count
        _positive(f"{name}.pairs_per_prompt", self.pairs_per_prompt)
        if not 0 < self.heldout_fraction < 1:
            _fail(f"{name}.heldout_fraction", self.heldout_fraction, "must be in (0, 1)")
        _at_least(f"{name}.eval_every", self.eval_every, 0)
        if self.eval_every == 0 and self.heldout_fraction != RewardConfig.heldout_fraction:
            _fail(
                f"{name}.heldout_fraction",
                self.heldout_fraction,
                f"holds pairs out for checkpoint selection; {name}.eval_every=0 selects no "
                f"checkpoint and trains on every pair (set {name}.eval_every >= 1)",
            )
        _positive(f"{name}.ensemble", self.ensemble)
        _choice(f"{name}.ensemble_mode", self.ensemble_mode, ENSEMBLE_MODES)
        _at_least(f"{name}.ensemble_penalty", self.ensemble_penalty, 0)
        if self.ensemble == 1:
            for field in ("ensemble_mode", "ensemble_penalty"):
                value = getattr(self, field)
                if value != getattr(RewardConfig, field):
                    _fail(
                        f"{name}.{field}",
                        value,
                        f"combines the members of an ensemble; {name}.ensemble=1 trains one "
                        f"reward model (set {name}.ensemble >= 2)",
                    )
        elif self.ensemble_mode in ("min", "mean") and self.ensemble_penalty != 0:
            _fail(
                f"{name}.ensemble_penalty",
                self.ensemble_penalty,
                f"weighs the members' spread in ensemble_mode std or var; "
                f"{name}.ensemble_mode={self.ensemble_mode} reads no penalty",
            )


class RewardRunState(eqx.Module):
    """The state of a reward-model run: the `TrainState`, and the trainable parameters
    with the best held-out accuracy so far (checkpointed with it, so a resumed run keeps
    the same selection)."""

    train: rx.train.TrainState
    best_params: Any
    best_accuracy: jax.Array
    best_step: jax.Array


def data_validation_seed(seed: int) -> int:
    """The seed of the validation split of a reward model trained on a data file:
    `seed + 2**64` (`seed`: `ops.seed`), a BLAKE2b key no 64-bit `data.seed` shares.

    The file's held-out split (`data.split_held_out` keyed by `data.seed`) leaves
    training pairs whose prompt hashes all lie above its threshold; a validation split
    keyed by the same seed would find none below its own (when
    `reward.heldout_fraction <= data.heldout_fraction`, the defaults among them), and
    checkpoint selection would never run. With another key the two splits are
    independent."""
    return int(seed) + 2**64


def run_reward(
    policy,
    tok,
    pairs: Sequence[data.PreferenceRecord],
    *,
    cfg: RewardConfig,
    ctx: RunContext,
    validation_seed: int | None = None,
) -> RunResult:
    """Bradley-Terry reward model (`RewardModel.from_policy`, every weight trained) on
    preference pairs; with `cfg.ensemble = K > 1`, `K` of them stacked in an `Ensemble`
    and trained in one vmapped step, each on its own bootstrap resample of every batch
    (accuracies then use the ensemble's conservative score).

    With `cfg.eval_every > 0`, about `cfg.heldout_fraction` of the pairs' prompts are
    held out (`data.split_held_out`, seeded by `validation_seed`, default `ops.seed`; on
    a data file `data_validation_seed`; their labels are as noisy as
    the training ones): every `cfg.eval_every` steps and at the end their accuracy is
    logged (`validation/accuracy`) and the parameters with the best accuracy so far
    are kept; the result is that model (checkpoint selection: a reward model trained on
    noisy labels otherwise memorises them). `res.history` then also holds
    `res.info` says which step was kept, with its training and held-out accuracy.
    """
    validate_stage("reward", cfg)
    pairs = list(pairs)
    val: list = []
    if cfg.eval_every:
        seed = ctx.ops.seed if validation_seed is None else validation_seed
        train, val = data.split_held_out(pairs, fraction=cfg.heldout_fraction, seed=seed)
        if train and val:
            pairs = list(train)
        else:
            val = []
            ctx.log.event(
                "no_validation",
                f"reward.heldout_fraction={cfg.heldout_fraction}: {len(pairs)} pairs are too "
                "few to hold some out; the last model is kept",
            )
    lengths = dict(max_length=cfg.max_length, prompt_length=ctx.prompt_length)
    full = collate_pairs(pairs, tok, **lengths, add_eos=ctx.add_eos)
    val_batch = collate_pairs(val, tok, **lengths, add_eos=ctx.add_eos) if val else None
    k_init, ctx_key = jax.random.split(ctx.key)
    opt = build_optimizer(cfg.optim, cfg.steps)
    K = cfg.ensemble
    if K > 1:  # K reward models stacked, one vmapped step, a bootstrap resample each
        from ._reward_sources import EnsembleReward

        make = lambda k: rx.RewardModel.from_policy(policy, key=k)
        ts = rx.train.init_ensemble_state(
            rx.train.make_ensemble(make, jax.random.split(k_init, K)), opt
        )
        step = rx.train.make_ensemble_reward_step(opt, cfg, members=K, options=cfg.options)
        scorer = lambda m: EnsembleReward(m, cfg.ensemble_penalty, cfg.ensemble_mode)
    else:
        ts = rx.train.init_train_state(rx.RewardModel.from_policy(policy, key=k_init), opt)
        step = rx.train.make_reward_step(opt, cfg, options=cfg.options)
        scorer = lambda m: m
    rows_of = shuffled_rows(full, cfg.batch_size, ctx.ops.seed)

    def batch_at(i, key):
        b = rows_of(i)
        if K == 1:
            return b
        w = rx.train.bootstrap_weights(key, b.chosen_tokens.shape[0], K)
        return rx.train.BootstrapBatch(pairs=b, weights=w)

    state = RewardRunState(
        ts, ts.params, jnp.asarray(-1.0, jnp.float32), jnp.asarray(-1, jnp.int32)
    )

    def iteration(st: RewardRunState, key, i):
        k_boot, k_step = jax.random.split(key) if K > 1 else (None, key)
        ts, m = st.train.apply(step, batch_at(i, k_boot), key=k_step)
        if val_batch is not None and ((i + 1) % cfg.eval_every == 0 or i + 1 == cfg.steps):
            acc = reward_accuracy(scorer(ts.model), val_batch)
            m = {**m, "validation/accuracy": acc}
            if acc > float(st.best_accuracy):
                best = (ts.params, jnp.asarray(acc, jnp.float32), jnp.asarray(i + 1, jnp.int32))
                return RewardRunState(ts, *best), [m], {}
        return eqx.tree_at(lambda s: s.train, st, ts), [m], {}

    tokens = 2 * cfg.batch_size * cfg.max_length
    res = run_loop(
        state,
        iteration,
        dataclasses.replace(ctx, key=ctx_key),
        cfg.steps,
        tokens_per_iteration=tokens,
        flops_per_iteration=model_flops(rx.count_params(ts.model), train_tokens=tokens),
    )
    final: RewardRunState = res.state
    ts = final.train
    if val_batch is not None and int(final.best_step) > 0:
        ts = eqx.tree_at(lambda s: s.params, ts, final.best_params)
        summary = {
            "event": "reward_selection",
            "message": (
                f"kept the model of step {int(final.best_step)} (held-out accuracy "
                f"{float(final.best_accuracy):.3f} on {len(val)} pairs)"
            ),
            "selected_step": int(final.best_step),
            "validation_accuracy": float(final.best_accuracy),
            "train_accuracy": reward_accuracy(scorer(ts.model), full),
            "validation_pairs": len(val),
            "train_pairs": len(pairs),
        }
        ctx.log.write(summary)
        info = {k: v for k, v in summary.items() if k not in ("event", "message")}
        return RunResult(ts, res.history, res.loop, info)
    return RunResult(ts, res.history, res.loop)


def _pairs(roll, scores, noisy=None) -> list:
    """Preference pairs of consecutive samples whose true scores differ, ordered by the
    noisy labels (ties by the true scores) or, without `noisy`, by the true scores."""
    out = []
    for j in range(0, len(roll.texts), 2):
        if scores[j] == scores[j + 1]:
            continue
        if noisy is None:
            first = scores[j] > scores[j + 1]
        else:
            first = noisy[j] > noisy[j + 1] or (
                noisy[j] == noisy[j + 1] and scores[j] > scores[j + 1]
            )
        c, w = (j, j + 1) if first else (j + 1, j)
        out.append(data.PreferenceRecord(roll.prompts[j], roll.texts[c], roll.texts[w]))
    return out


def reward(env: StageEnv, r: RewardConfig) -> Outcome:
    """A reward model (or ensemble) on noisily labelled pairs of SFT samples; its clean
    held-out accuracy on pairs of held-out prompts labelled by the true scorer."""
    sft_policy, tok, s = env.policies["sft"], env.tok, env.cfg.sampling
    roll = env.sample(sft_policy, TRAIN_PROMPTS, 1, 2 * r.pairs_per_prompt)
    true = np.asarray([animal_score(t) for t in roll.texts])
    pairs = _pairs(roll, true, np.asarray(env.label(roll.prompts, roll.texts, 2)))
    held_roll = env.sample(sft_policy, HELDOUT_PROMPTS, 2, 2 * r.pairs_per_prompt)
    clean = _pairs(held_roll, np.asarray([animal_score(t) for t in held_roll.texts]))
    env.say(f"reward: {len(pairs)} noisily labelled pairs, {len(clean)} clean held-out pairs")
    res = run_reward(sft_policy, tok, pairs, cfg=r, ctx=env.ctx("reward", periodic=False))
    rm = res.state.model
    if r.ensemble > 1:
        kw = dict(penalty=r.ensemble_penalty, mode=r.ensemble_mode)
        export_reward_ensemble(rm, env.run_dir, **kw, tokenizer_file=env.tok_file)
        source = EnsembleReward(rm, r.ensemble_penalty, r.ensemble_mode)
    else:
        export_reward_model(rm, env.run_dir, tokenizer_file=env.tok_file)
        source = ModelReward(rm)
    held = collate_pairs(clean, tok, max_length=r.max_length, prompt_length=s.prompt_length)
    acc = reward_accuracy(source, held)
    info = res.info
    summary = {
        "heldout_accuracy": acc,
        "heldout_accuracy_se": binomial_se(acc, held.chosen_tokens.shape[0]),
        "train_accuracy": info.get("train_accuracy"),
        "validation_accuracy": info.get("validation_accuracy"),
        "selected_step": info.get("selected_step", r.steps),
        "train_pairs": info.get("train_pairs", len(pairs)),
        "validation_pairs": info.get("validation_pairs", 0),
        "heldout_pairs": len(clean),
        "stopped": res.loop.stopped,
    }
    if r.ensemble > 1:
        summary["ensemble"] = r.ensemble
    kept = (
        f" (kept step {info['selected_step']} of {r.steps}: training accuracy "
        f"{info['train_accuracy']:.1%}, noisy validation accuracy "
        f"{info['validation_accuracy']:.1%})"
        if info
        else ""
    )
    env.say(f"reward model: clean held-out accuracy {acc:.1%}" + kept)
    return Outcome(res, summary=summary, reward=source)


def reward_on_data(env: StageEnv, c: RewardConfig) -> Outcome:
    """A reward model (or ensemble) on a preference file; its held-out accuracy (with its
    standard error and the number of held-out pairs, `heldout_pairs`)."""
    tok = env.tok
    train, held = preference_split(env, c)
    held_batch = collate_pairs(
        held,
        tok,
        max_length=c.max_length,
        prompt_length=env.cfg.sampling.prompt_length,
        add_eos=DATA_EOS,
    )
    ctx = data_ctx(env)
    margins = _margin_summary(train)
    if margins is not None:
        message = (
            f"per-pair margins read from the 'margin' column: {margins['pairs']} pairs, mean "
            f"{margins['mean']:.4g}, from {margins['min']:.4g} to {margins['max']:.4g}; the "
            f"loss is -log sigmoid(r_chosen - r_rejected - {c.margin:g} - margin)"
        )
        ctx.log.write({"event": "margins", "message": message, **margins})
        ctx.log.info(message)
    seed = data_validation_seed(ctx.ops.seed)
    res = run_reward(env.base, tok, train, cfg=c, ctx=ctx, validation_seed=seed)
    rm = res.state.model
    if c.ensemble > 1:
        scorer = EnsembleReward(rm, c.ensemble_penalty, c.ensemble_mode)
        kw = dict(penalty=c.ensemble_penalty, mode=c.ensemble_mode)
        export_reward_ensemble(rm, env.run_dir, **kw, tokenizer_file=env.tok_file)
    else:
        scorer = rm
        export_reward_model(rm, env.run_dir, tokenizer_file=env.tok_file)
    acc = reward_accuracy(scorer, held_batch)
    se = binomial_se(acc, held_batch.chosen_tokens.shape[0])
    env.summary["reward_model"] = {
        "heldout_accuracy": acc,
        "heldout_accuracy_se": se,
        "heldout_pairs": len(held),
        **res.info,
    }
    if margins is not None:
        env.summary["reward_model"]["margins"] = margins
    return Outcome(res)


def _margin_summary(pairs: Sequence) -> dict[str, Any] | None:
    """`{"pairs", "mean", "min", "max"}` of the pairs' own margins (`PreferenceRecord.margin`,
    a file's `margin` column); `None` when no pair has one."""
    values = [p.margin for p in pairs if getattr(p, "margin", None) is not None]
    if not values:
        return None
    return {
        "pairs": len(values),
        "mean": float(np.mean(values)),
        "min": float(min(values)),
        "max": float(max(values)),
    }


register_stage(
    Stage(
        "reward",
        RewardConfig,
        reward,
        reward_on_data,
        summary_key="reward_model",
        trains_policy=False,
        help="a Bradley-Terry reward model (or an ensemble: reward.ensemble=K)",
        task=dict(steps=80, batch_size=32, pairs_per_prompt=24, eval_every=5, optim=_optim(1e-3)),
        key_stream=("split", 2),
    )
)
