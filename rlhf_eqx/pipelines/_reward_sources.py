"""Where the rewards of PPO and GRPO come from, and how reward models are exported and loaded.

A stage's `reward_source` (`ppo.reward_source`, `grpo.reward_source`) is one of
`REWARD_SOURCES`:

- `"task"`: reward functions on the decoded text (the built-in task's animal scorer, the
  exact-match answer of a GSM8K-style file), or the user's own (`<stage>.reward_functions
  =MODULE:NAME,...`, called as TRL calls them: `BatchFunctionReward`);
- `"reward_model"`: a Bradley-Terry reward model, or an ensemble of them scored as
  `mean - penalty * std` (`reward.ensemble`, Coste et al. 2024);
- `"judge"`: a generative judge, a language model's verdict token after a template
  (`judge.*`; `rlhf_eqx.train.judge_reward`);
- `"prm"`: a process reward model's step scores, per token at the step ends for PPO
  (`rlhf_eqx.train.add_token_rewards`) and aggregated per sequence for GRPO.

Each source is a `RewardSource` whose `score(rollout)` returns one score per completion,
metrics, and (PRM under PPO) per-token rewards. A reward model, an ensemble or a PRM is
the run's own (the `reward` stage) or a directory written by `export_reward_model`,
`export_reward_ensemble` or `export_prm` (`<stage>.reward_model=DIR`): a one-label
`...ForSequenceClassification` checkpoint, with `ensemble.json` (members in
`member_<k>/`) or `prm.json` beside it.
"""

import dataclasses
import json
import math
import os
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

import rlhf_eqx as rx

from ._callbacks import load_object
from ._config import (
    REWARD_SOURCES as REWARD_SOURCES,
    ConfigError,
)
from ._rollout import RewardFunction, Rollout, _reward_value, reward_model_scores, score_rollout
from ._runs import check_finite_weights, copy_tokenizer
from ._task import TRAIN_PROMPTS, animal_score


@dataclasses.dataclass(frozen=True)
class Scored:
    """A rollout's rewards: `scores [B]` (one per completion), `metrics` (means, logged
    with the iteration) and, for a PRM, `token_rewards [B, T]` (step scores at the step
    ends; `None` otherwise)."""

    scores: Float[np.ndarray, " B"]
    metrics: dict
    token_rewards: Any = None


class RewardSource:
    """Scores the completions of a `Rollout`; see the module docstring for the kinds."""

    def score(self, rollout: Rollout) -> Scored:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class FunctionReward(RewardSource):
    """The weighted sum of reward functions on the decoded text (`score_rollout`)."""

    fns: tuple[RewardFunction, ...]

    def score(self, rollout: Rollout) -> Scored:
        scores, metrics = score_rollout(rollout, self.fns)
        return Scored(scores, metrics)


_CALL_KEYWORDS = ("prompts", "completions", "completion_ids", "prompt")
"""The keywords `BatchFunctionReward` gives every reward function besides the columns
(and the column a conversational prompt's messages come in, which TRL passes as
`prompts`)."""


@dataclasses.dataclass(frozen=True, eq=False)
class BatchFunctionReward(RewardSource):
    """Reward functions as TRL's GRPO and PPO trainers call them: each `fn(prompts=...,
    completions=..., completion_ids=..., **columns)` once per rollout, with lists of one
    entry per completion (the prompt as the model saw it, the decoded completion, its
    token ids) and, as keywords, the other columns of each completion's record
    (`columns`: `{prompt: {column: value}}`, e.g. a file's `answer` or `difficulty`;
    `None` for a prompt without that column). When every record's prompt is a list of
    messages (TRL's conversational layout: `columns[prompt]["prompt"]`, as
    `data.PromptRecord.columns` keeps it), `prompts` are those messages and each
    completion is `[{"role": "assistant", "content": text}]`, as TRL passes them. A
    function returns one score per completion: a list, tuple, numpy or jax array of
    finite real numbers, `None` where it does not score that completion (as in TRL,
    that function then adds nothing to it). The reward is `Σ_k w_k · r_k` over the
    functions `fns` (`(name, fn, w_k)`); `reward/<name>` the mean of each function's
    scores. A function that raises, or returns another number of scores, a NaN, an
    infinity or something not a number is a `ValueError` naming it (and the completion,
    its prompt and the value)."""

    fns: tuple[tuple[str, Callable, float], ...]
    columns: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)

    @property
    def _column_names(self) -> list[str]:
        """Every column of the records (a rollout whose records lack one passes `None`s)."""
        names = dict.fromkeys(k for r in self.columns.values() for k in r)
        return [k for k in names if k not in _CALL_KEYWORDS]

    @property
    def _conversational(self) -> bool:
        """Whether every record's prompt is a list of messages."""
        rows = self.columns.values()
        return bool(rows) and all(isinstance(r.get("prompt"), list) for r in rows)

    def score(self, rollout: Rollout) -> Scored:
        prompts, texts = list(rollout.prompts), list(rollout.texts)
        kept = np.asarray(rollout.completion_mask & rollout.mask)
        ids = [row[m].tolist() for row, m in zip(np.asarray(rollout.tokens), kept)]
        rows = [self.columns.get(p, {}) for p in prompts]
        kwargs = {k: [r.get(k) for r in rows] for k in self._column_names}
        if self._conversational:
            prompts = [r["prompt"] for r in rows]
            texts = [[{"role": "assistant", "content": t}] for t in texts]
        total = np.zeros(len(texts), np.float64)
        metrics = {}
        for name, fn, weight in self.fns:
            try:
                out = fn(prompts=prompts, completions=texts, completion_ids=ids, **kwargs)
            except Exception as e:
                raise ValueError(
                    f"reward function {name!r} raised {type(e).__name__}: {e}{_where(e)}"
                ) from e
            values = batch_scores(out, name, len(texts), max(int(rollout.group_size), 1))
            scored = ~np.isnan(values)
            total += weight * np.where(scored, values, 0.0)
            metrics[f"reward/{name}"] = float(values[scored].mean()) if scored.any() else math.nan
        return Scored(total.astype(np.float32), metrics)


def _where(e: Exception) -> str:
    """` (at FILE:LINE)` of the innermost frame of `e` outside this module, if any."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename != __file__]
    return f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""


def batch_scores(out: Any, name: str, n: int, group_size: int = 1) -> np.ndarray:
    """The scores a batched reward function `name` returned for `n` completions as a
    float64 array, NaN where it returned `None`; a `ValueError` naming the function for
    another length or shape, a value that is not a finite real number (`_reward_value`)."""
    if getattr(out, "dtype", None) is not None and np.ndim(out) != 1:
        raise ValueError(
            f"reward function {name!r} returned an array of shape {np.shape(out)}: expected "
            f"{n} scores, one per completion"
        )
    if isinstance(out, (str, bytes, Mapping)) or not hasattr(out, "__len__"):
        raise ValueError(
            f"reward function {name!r} returned {type(out).__name__} {out!r:.60}: expected "
            f"a list of {n} scores, one per completion"
        )
    if len(out) != n:
        raise ValueError(
            f"reward function {name!r} returned {len(out)} scores for {n} completions "
            "(one per completion)"
        )
    if getattr(out, "dtype", None) is not None:
        out = np.asarray(out)  # a numpy or jax array: its items as numpy scalars
    return np.asarray(
        [
            math.nan if v is None else _reward_value(v, name, b, group_size)
            for b, v in enumerate(out)
        ],
        np.float64,
    )


def load_reward_functions(
    specs: Sequence[str], weights: Sequence[float] = (), *, field: str = "reward_functions"
) -> tuple[tuple[str, Callable, float], ...]:
    """`(name, fn, weight)` of each `MODULE:NAME` of `specs` (imported with the current
    directory first on the path, as `--callback`'s), the weights `weights` (default 1
    each) for `BatchFunctionReward`. A `ConfigError` naming `field` (e.g.
    `grpo.reward_functions`) and the spec when one does not import, is not callable, or
    the weights are not one finite number per function."""
    if weights and len(weights) != len(specs):
        raise ConfigError(
            f"{field.rpartition('.')[0] or field}.reward_weights={tuple(weights)!r}: expected "
            f"one weight per function of {field}={tuple(specs)!r}"
        )
    out = []
    for spec, weight in zip(specs, weights or [1.0] * len(specs)):
        fn = load_object(spec, f"{field}={spec}", "my_rewards:length_reward")
        if not callable(fn):
            raise ConfigError(f"{field}={spec}: expected a function, got {type(fn).__name__}")
        out.append((spec.partition(":")[2], fn, float(weight)))
    return tuple(out)


@dataclasses.dataclass(frozen=True, eq=False)
class ModelReward(RewardSource):
    """A scalar reward model's score of `prompt + completion` (jitted, one pass)."""

    model: Any

    def scores(self, tokens, mask) -> tuple[Float[Array, " B"], None]:
        """`(scores [B], None)` of token rows `[B, T]`."""
        return reward_model_scores(self.model, tokens, mask), None

    def score(self, rollout: Rollout) -> Scored:
        return Scored(np.asarray(self.scores(rollout.tokens, rollout.mask)[0]), {})


@dataclasses.dataclass(frozen=True, eq=False)
class EnsembleReward(RewardSource):
    """An ensemble's conservative score (`rlhf_eqx.train.ensemble_scores`): with `mode`
    `std`, `mean - penalty * std` of the members' scores. Logs `reward/ensemble_std`,
    the mean over completions of the members' spread."""

    ensemble: Any
    penalty: float = 0.0
    mode: str = "std"

    def scores(self, tokens, mask) -> tuple[Float[Array, " B"], Float[Array, "K B"]]:
        """`(conservative scores [B], member scores [K, B])` of token rows `[B, T]`."""
        return rx.train.ensemble_scores(
            self.ensemble, tokens, mask, penalty=self.penalty, mode=self.mode
        )

    def score(self, rollout: Rollout) -> Scored:
        combined, members = self.scores(rollout.tokens, rollout.mask)
        spread = float(jnp.mean(jnp.std(members, axis=0)))
        return Scored(np.asarray(combined), {"reward/ensemble_std": spread})


@dataclasses.dataclass(frozen=True, eq=False)
class JudgeSource(RewardSource):
    """A generative judge (`rlhf_eqx.train.JudgeReward`): every completion of the rollout
    in one batched pass."""

    judge: Any

    def score(self, rollout: Rollout) -> Scored:
        s = self.judge.score(list(rollout.prompts), list(rollout.texts))
        return Scored(np.asarray(s, np.float32), {"reward/judge": float(np.mean(s))})


@dataclasses.dataclass(frozen=True, eq=False)
class ProcessReward(RewardSource):
    """A process reward model (a `ValueModel` trained by `make_prm_step`): its step
    scores at the separator tokens of each completion (`step_end_mask`, the final
    unterminated step included), aggregated per sequence (`aggregation`: `min`, `last`
    or `mean`), and per token for PPO."""

    model: Any
    separator_id: int
    aggregation: str = "min"
    score_kind: str = "prob"
    ignore_ids: tuple[int, ...] = ()

    def score(self, rollout: Rollout) -> Scored:
        comp = rollout.completion_mask & rollout.mask
        steps = rx.train.step_end_mask(
            rollout.tokens, comp, self.separator_id, ignore_ids=self.ignore_ids
        )
        token_rewards, seq = rx.train.process_rewards(
            self.model,
            rollout.tokens,
            rollout.mask,
            steps,
            score=self.score_kind,
            aggregation=self.aggregation,
        )
        n_steps = float(jnp.mean(jnp.sum(steps, axis=-1, dtype=jnp.float32)))
        return Scored(np.asarray(seq), {"reward/prm_steps": n_steps}, token_rewards)


def as_reward_source(reward: Any) -> RewardSource:
    """A `RewardSource` from what a run was given: a source, a scalar reward model, an
    `Ensemble` (scored by the members' mean), or reward functions."""
    if isinstance(reward, RewardSource):
        return reward
    if isinstance(reward, rx.train.Ensemble):
        return EnsembleReward(reward)
    if isinstance(reward, rx.models.AbstractScalarModel):
        return ModelReward(reward)
    fns = tuple(reward)
    if not fns or not all(isinstance(f, RewardFunction) for f in fns):
        raise TypeError(
            "reward must be a RewardSource, a reward model, an Ensemble or a non-empty "
            f"sequence of RewardFunction, got {reward!r}"
        )
    return FunctionReward(fns)


# --- export and loading ---------------------------------------------------------------


def _save_scalar(model, out: str, tokenizer_file: str | None) -> float:
    """Save a scalar-head model (bias dropped: the HF head has none); return the bias."""
    bias = float(model.bias)
    rx.save_hf(eqx.tree_at(lambda m: m.bias, model, jnp.zeros_like(model.bias)), out)
    copy_tokenizer(tokenizer_file, out)
    return bias


def export_reward_ensemble(
    ensemble,
    run_dir: str,
    *,
    penalty: float,
    mode: str,
    tokenizer_file: str | None = None,
) -> str:
    """Write an ensemble of reward models to `<run_dir>/reward/ensemble/`: each member
    a `...ForSequenceClassification` checkpoint in `member_<k>/`, and `ensemble.json`
    with the members' biases (the HF head has none, and the spread depends on them) and
    the combination (`mode`, `penalty`). Non-finite weights are refused."""
    out = os.path.join(run_dir, "reward", "ensemble")
    meta = {"members": ensemble.num_members, "mode": mode, "penalty": penalty, "biases": []}
    for k in range(ensemble.num_members):
        member = ensemble.member(k)
        check_finite_weights(member, f"reward ensemble member {k}")
        meta["biases"].append(
            _save_scalar(member, os.path.join(out, f"member_{k}"), tokenizer_file)
        )
    copy_tokenizer(tokenizer_file, out)
    with open(os.path.join(out, "ensemble.json"), "w") as f:
        json.dump(meta, f, indent=1)
    return out


def export_prm(
    model,
    run_dir: str,
    *,
    separator: str,
    aggregation: str,
    score: str = "prob",
    tokenizer_file: str | None = None,
) -> str:
    """Write a process reward model to `<run_dir>/prm/hf/`: the `ValueModel` as a
    `...ForSequenceClassification` checkpoint and `prm.json` with its bias (the step
    scores are logits: the bias matters), the step `separator` it was trained with and
    the defaults of its use (`aggregation`, `score`)."""
    check_finite_weights(model, "process reward model")
    out = os.path.join(run_dir, "prm", "hf")
    bias = _save_scalar(model, out, tokenizer_file)
    meta = {"bias": bias, "separator": separator, "aggregation": aggregation, "score": score}
    with open(os.path.join(out, "prm.json"), "w") as f:
        json.dump(meta, f, indent=1)
    return out


def _load_scalar(directory: str, bias: float, tokenizer, cls=None):
    model = rx.load_hf(directory)
    if not isinstance(model, rx.RewardModel):
        raise ValueError(
            f"{directory}: holds a {type(model).__name__}, not a reward model "
            "(a one-label ...ForSequenceClassification checkpoint)"
        )
    # an id past the embedding would be read as NaN: every score of such a row NaN
    ids = int(tokenizer.vocab_size)
    if model.cfg.vocab_size < ids:
        raise ValueError(
            f"reward model {directory!r}: its vocabulary has {model.cfg.vocab_size} ids, the "
            f"policy's tokenizer {ids}; a reward model scores the policy's tokens, so it must "
            "be trained from the same base model (or one with the same tokenizer)"
        )
    if cls is not None:  # the same fields under another read-out (per token)
        shell = eqx.filter_eval_shape(cls, model.cfg, key=jax.random.key(0))
        model = eqx.tree_at(
            lambda m: (m.transformer, m.head, m.bias),
            shell,
            (model.transformer, model.head, model.bias),
        )
    return eqx.tree_at(lambda m: m.bias, model, jnp.asarray(bias, jnp.float32))


EXPORTED_REWARD_MODELS: tuple[str, ...] = (
    os.path.join("reward", "ensemble"),
    os.path.join("reward", "hf"),
    os.path.join("prm", "hf"),
)
"""Where a run directory holds the reward models its `reward` and `prm` stages exported."""


def _exported_in_run(directory: str) -> str:
    """The reward model a directory stands for: for the directory of a whole run
    (`rlhf_eqx reward --out RUN`, whose `config.json` is the run's configuration, not a
    model's) the one it exported (`EXPORTED_REWARD_MODELS`), else `directory` itself.
    A `ValueError` naming the run when it exported several, or none (a run directory:
    `holds_run`, metrics, a summary or checkpoints)."""
    found = [
        os.path.join(directory, sub)
        for sub in EXPORTED_REWARD_MODELS
        if any(os.path.isfile(os.path.join(directory, sub, f)) for f in _MODEL_FILES)
    ]
    if len(found) > 1:
        raise ValueError(
            f"reward model {directory!r}: a run directory with several exported models; "
            f"choose one: {', '.join(found)}"
        )
    if found:
        return found[0]
    from ._rundir import holds_run  # the run-directory layer (it imports the stages)

    if holds_run(directory):
        raise ValueError(
            f"reward model {directory!r}: a run directory without an exported reward model "
            f"({' or '.join(EXPORTED_REWARD_MODELS)}); train one with the reward or prm stage"
        )
    return directory


_MODEL_FILES = ("ensemble.json", "prm.json", "config.json")


def reward_model_checkpoints(directory: str) -> tuple[str, ...]:
    """The checkpoint directories `load_reward_source(directory, ...)` loads: an
    ensemble's `member_<k>/` (`ensemble.json`), else the directory of the one reward
    model or PRM (a run directory's export, `_exported_in_run`); `()` when `directory`
    holds none that can be named without loading it (loading names what is wrong)."""
    if not os.path.isdir(directory):
        return ()
    try:
        directory = _exported_in_run(directory)
        ens = os.path.join(directory, "ensemble.json")
        if os.path.isfile(ens):
            with open(ens) as f:
                biases = json.load(f)["biases"]
            return tuple(os.path.join(directory, f"member_{k}") for k in range(len(biases)))
    except (OSError, ValueError, KeyError, TypeError):
        return ()
    return (directory,) if os.path.isfile(os.path.join(directory, "config.json")) else ()


def load_reward_source(directory: str, tokenizer, *, eos_ids: Sequence[int] = ()) -> RewardSource:
    """The reward source a directory holds: an ensemble (`ensemble.json`), a process
    reward model (`prm.json`; its step separator encoded with `tokenizer`) or one reward
    model; the directory of a run stands for the model it exported (`RUN/reward/hf`,
    `RUN/reward/ensemble` or `RUN/prm/hf`). `ValueError` naming the directory when it
    holds none of these, or a model whose vocabulary is smaller than `tokenizer`'s (the
    policy's token ids would lie outside it)."""
    if not os.path.isdir(directory):
        raise ValueError(f"reward model {directory!r}: no such directory")
    directory = _exported_in_run(directory)
    ens = os.path.join(directory, "ensemble.json")
    prm = os.path.join(directory, "prm.json")
    if os.path.isfile(ens):
        with open(ens) as f:
            meta = json.load(f)
        models = [
            _load_scalar(os.path.join(directory, f"member_{k}"), b, tokenizer)
            for k, b in enumerate(meta["biases"])
        ]
        per, shared = zip(*(eqx.partition(m, eqx.is_inexact_array) for m in models))
        members = jax.tree.map(lambda *xs: jnp.stack(xs), *per)
        return EnsembleReward(
            rx.train.Ensemble(members=members, shared=shared[0]),
            penalty=float(meta["penalty"]),
            mode=str(meta["mode"]),
        )
    if os.path.isfile(prm):
        with open(prm) as f:
            meta = json.load(f)
        return ProcessReward(
            _load_scalar(directory, meta["bias"], tokenizer, rx.ValueModel),
            rx.data.separator_id(tokenizer, meta["separator"]),
            aggregation=meta["aggregation"],
            score_kind=meta["score"],
            ignore_ids=tuple(eos_ids),
        )
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise ValueError(
            f"reward model {directory!r}: no config.json, ensemble.json or prm.json (export "
            "one with the reward or prm stage)"
        )
    return ModelReward(_load_scalar(directory, 0.0, tokenizer))


def stage_reward_source(
    c,
    *,
    task: Sequence[RewardFunction],
    tokenizer,
    judge,
    judges: dict,
    run_reward: RewardSource | None = None,
    columns: Mapping[str, Mapping[str, Any]] | None = None,
    key: str = "",
) -> RewardSource:
    """The reward source of a PPO / GRPO stage config `c` (section `key`, e.g. `ppo`, in
    the messages that refuse a directory holding the other kind of model; `c.reward_source`,
    `c.reward_model`): the user's `c.reward_functions` when it names some
    (`BatchFunctionReward`, given `columns`, `{prompt: {column: value}}`: a data file's
    other columns), else the `task` reward functions; the run's reward model
    (`run_reward`) or a directory's; a judge (`judge`: the `JudgeConfig`; `judges` maps
    `judge.model` names to policies, e.g. `{"base": base, "sft": sft}`; any other
    `judge.model` is loaded as `--model` is: a short model name, a run or checkpoint
    directory, a `.gguf` file); a process reward model from a directory."""
    eos = tuple(i for i in (tokenizer.eos_id,) if i is not None)
    at = f"{key}." if key else ""
    if c.reward_source == "task":
        own = user_reward_functions(c)
        if own is not None:
            return dataclasses.replace(own, columns=dict(columns or {}))
        return FunctionReward(tuple(task))
    if c.reward_source == "judge":
        model = judges.get(judge.model)
        if model is None:  # a short model name, a run, checkpoint directory or .gguf file
            from ._pipeline import load_model, model_path

            model, _ = load_model(model_path(judge.model, "judge.model"))
        return JudgeSource(
            rx.train.judge_reward(
                model,
                tokenizer,
                template=judge.template,
                yes_token=judge.yes,
                no_token=judge.no,
                score=judge.score,
            )
        )
    if c.reward_model:
        source = load_reward_source(c.reward_model, tokenizer, eos_ids=eos)
    elif run_reward is not None:
        source = run_reward
    else:
        raise ValueError(f"{at}reward_source={c.reward_source!r} needs {at}reward_model=DIR")
    is_prm = isinstance(source, ProcessReward)
    if is_prm != (c.reward_source == "prm"):
        where = f"{at}reward_model={c.reward_model!r}" if c.reward_model else "the run"
        raise ValueError(
            f"{at}reward_source={c.reward_source!r} but {where} holds "
            + ("a process reward model" if is_prm else "a reward model, not a process reward model")
        )
    return source


def prompt_file_reward(
    name: str, c, records: Sequence, path: str, *, tokenizer, judge, judges: dict
) -> tuple[RewardSource, RewardFunction | None]:
    """The reward source of a PPO / GRPO stage (section `name`, config `c`) on the
    records `records` of the prompt file `path` (`data.PromptRecord`s as trained on), and the
    exact-match reward of their reference answers (`None` unless every prompt has one).
    `reward_source=task` is the user's `reward_functions` (given each prompt's other
    columns: the first record's of a repeated prompt) or else that exact match, which
    then needs every prompt's answer (a `ValueError` naming the stage's other choices);
    the other sources as `stage_reward_source` builds them."""
    columns: dict = {}
    for r in records:
        columns.setdefault(r.prompt, r.columns)
    answers = {r.prompt: r.answer for r in records if r.answer is not None}

    def exact(prompt: str, completion: str) -> float:
        return float(rx.data.exact_match_reward([completion], [answers[prompt]])[0])

    match = RewardFunction("exact_match", exact) if len(answers) == len(columns) else None
    if c.reward_source == "task" and not c.reward_functions and match is None:
        raise ValueError(
            f"{name}.reward_source=task: the exact match of reference answers, but "
            f"{sum(r.answer is None for r in records)} prompts of {path} have none; score "
            f"with your own functions ({name}.reward_functions=MODULE:NAME), or "
            f"{name}.reward_source=reward_model ({name}.reward_model=DIR), judge or prm"
        )
    task = [match] if match is not None else []
    source = stage_reward_source(
        c, task=task, tokenizer=tokenizer, judge=judge, judges=judges, columns=columns, key=name
    )
    return source, match


def check_reward_functions(name: str, c) -> None:
    """A `ConfigError` naming the field when the stage config `c` (section `name`) has
    reward functions that do not import (`load_reward_functions`), weights that are not
    one finite number per function, or functions with another `reward_source` than
    `task`, which is the one they score. A stage whose config declares `reward_source`
    unused (`unused_fields`: its rewards are its environment's) uses no reward
    functions either: setting them is refused, not ignored."""
    specs, weights = tuple(c.reward_functions), tuple(c.reward_weights)
    if "reward_source" in getattr(type(c), "unused_fields", ()):
        for field, value in (("reward_functions", specs), ("reward_weights", weights)):
            if value:
                raise ConfigError(
                    f"{name}.{field}={value!r}: the {name} stage does not use this setting "
                    "(its rewards are its environment's)"
                )
    if weights and not specs:
        raise ConfigError(f"{name}.reward_weights={weights!r}: only with {name}.reward_functions")
    if not all(math.isfinite(w) for w in weights):
        raise ConfigError(f"{name}.reward_weights={weights!r}: must be finite numbers")
    if specs:
        load_reward_functions(specs, weights, field=f"{name}.reward_functions")
        if c.reward_source != "task":
            raise ConfigError(
                f"{name}.reward_functions={specs!r}: score only with {name}.reward_source=task "
                f"(it is {c.reward_source})"
            )


def heldout_reward_summary(ev: dict) -> dict:
    """A data-file stage's held-out reward (`summary[<stage>]`) from `ev`, a
    `sampled_comparison` scored by the run's reward source: `heldout_reward_before`,
    `heldout_reward` (the mean reward of the base model's and the trained policy's
    samples) with their standard errors over the prompts (`*_se`), the rest of `ev` as
    `sampled`."""
    return {
        "heldout_reward_before": ev.pop("reward_before"),
        "heldout_reward_before_se": ev.pop("reward_before_se"),
        "heldout_reward": ev.pop("reward_after"),
        "heldout_reward_se": ev.pop("reward_after_se"),
        "sampled": ev,
    }


def user_reward_functions(c, key: str = "") -> BatchFunctionReward | None:
    """The user's reward functions of a PPO / GRPO stage config `c` (section `key`, in
    messages): `c.reward_functions` (`MODULE:NAME` each) weighted by
    `c.reward_weights`, as a `BatchFunctionReward` without columns; `None` when it
    names none (or `c` has no such field)."""
    specs = tuple(getattr(c, "reward_functions", ()))
    if not specs:
        return None
    weights = tuple(getattr(c, "reward_weights", ()))
    field = f"{key}.reward_functions" if key else "reward_functions"
    return BatchFunctionReward(load_reward_functions(specs, weights, field=field))


def task_reward_source(env, c, key: str = "") -> RewardSource:
    """The reward source of a PPO / GRPO stage on the built-in task (`c.reward_source`;
    `key` the stage's section, for the messages): the animal scorer (or the user's
    `reward_functions`), the run's reward model, or the judge (`base` or `sft`)."""
    task = [RewardFunction("animal", lambda p, t: animal_score(t))]
    judges = {"base": env.base, "sft": env.policies.get("sft")}
    return stage_reward_source(
        c,
        task=task,
        tokenizer=env.tok,
        judge=env.cfg.judge,
        judges=judges,
        run_reward=env.reward,
        key=key,
    )


def scored_on_task(env, c, run, name: str):
    """PPO or GRPO (`run`) from SFT on the built-in task's training prompts, rewards from
    `c.reward_source` (`task_reward_source`)."""
    source = task_reward_source(env, c, name)
    return run(env.policies["sft"], env.tok, TRAIN_PROMPTS, reward=source, cfg=c, ctx=env.ctx(name))


def scored_needs(cfg, name: str) -> tuple[str, ...]:
    """The stages before the PPO or GRPO stage `name` on the built-in task: the reward
    stage when it scores with the run's own reward model."""
    c = getattr(cfg, name)
    own = c.reward_source == "reward_model" and not c.reward_model
    return ("sft", "reward", name) if own else ("sft", name)
