"""The process reward model (Lightman et al. 2023; TRL `PRMTrainer`), the `prm` stage: its
settings (`PRMConfig`), its run on a stepwise data file (`rlhf_eqx prm --data FILE`), the
export PPO and GRPO score with (`reward_source=prm`), and its registration."""

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import rlhf_eqx as rx
from rlhf_eqx import data

from ..losses import PRM_AGGREGATIONS
from ..train import PRM_SCORES
from ._config import BatchStageConfig
from ._data_prep import (
    chat_rendering,
    log_skipped,
    log_truncation,
    record_numbers,
    split_records,
)
from ._field_checks import _choice, _fail
from ._lr_scale import build_optimizer
from ._registry import Outcome, Stage, StageEnv, register_stage
from ._reward_sources import export_prm
from ._runs import RunContext, RunResult, run_on_rows
from ._validation import validate_stage


@dataclasses.dataclass(frozen=True)
class PRMConfig(BatchStageConfig):
    """A process reward model (Lightman et al. 2023; TRL `PRMTrainer`) trained on a
    stepwise data file (`rlhf_eqx prm --set data.path=FILE`: records `{"prompt",
    "completions": [steps], "labels": [bools]}`): a `ValueModel` on the policy's
    backbone reads the step `separator` after each step. Its use as a reward
    (`reward_source=prm`) reads the step scores (`score`: `prob` or `logit`) at the
    separators of each completion: per token for PPO, and their `aggregation` (`min`,
    `last`, `mean`) per sequence for GRPO; both are stored with the export.
    `train_on_last_step_only` (TRL's field of that name): train and measure on the label
    of each solution's last step alone (the last one kept within `max_length`)."""

    steps: int = 100
    batch_size: int = 8
    max_length: int = 256
    separator: str = "\n"
    aggregation: str = "min"
    score: str = "prob"
    train_on_last_step_only: bool = False

    def check(self, name: str, *, device_count: int = 1) -> None:
        """The PRM's own rules: a non-empty step separator, a known aggregation and score."""
        del device_count
        if not self.separator:
            _fail(f"{name}.separator", self.separator, "must be a non-empty string")
        _choice(f"{name}.aggregation", self.aggregation, PRM_AGGREGATIONS)
        _choice(f"{name}.score", self.score, PRM_SCORES)


def stepwise_batch(records: Sequence, tok, cfg: PRMConfig, prompt_length: int):
    """`(PRMBatch, report)` of stepwise records: `BOS prompt step SEP step SEP ...` (BOS
    when the tokenizer asks for it, `data.wants_bos`), rows of `cfg.max_length` tokens,
    prompts cut (their end kept) at `prompt_length`; with `cfg.train_on_last_step_only`
    only the last kept step of each solution is marked and labelled."""
    sols, report = data.tokenize_stepwise(
        records,
        tok,
        separator=cfg.separator,
        max_length=cfg.max_length,
        max_prompt_length=min(prompt_length, cfg.max_length - 1),
        last_step_only=cfg.train_on_last_step_only,
    )
    if not sols:
        raise ValueError(
            f"prm: none of {len(records)} solutions has a step that fits prm.max_length="
            f"{cfg.max_length}"
        )
    batch = data.collate_stepwise(
        sols, pad_id=tok.pad_id, max_length=cfg.max_length, vocab_size=tok.vocab_size
    )
    return batch, report


@jax.jit
def _step_accuracy(model, tokens, mask, step_mask, labels):
    logits = jax.vmap(model)(tokens, mask)
    correct = ((logits > 0) == (labels > 0.5)) & step_mask
    return jnp.sum(correct) / jnp.maximum(jnp.sum(step_mask), 1)


def step_accuracy(model, batch) -> float:
    """The fraction of the steps of a `PRMBatch` whose label the PRM predicts (logit > 0
    for a correct step)."""
    b = batch
    return float(_step_accuracy(model, b.tokens, b.mask, b.step_mask, b.step_labels))


def run_prm(policy, tok, records: Sequence, *, cfg: PRMConfig, ctx: RunContext) -> RunResult:
    """A process reward model (Lightman et al. 2023; TRL `PRMTrainer`): a `ValueModel` on
    the policy's backbone (every weight trained) learns, at the separator ending each
    step, whether the step is correct (`make_prm_step`); `cfg.steps` steps on shuffled
    rows of `cfg.batch_size` solutions."""
    validate_stage("prm", cfg)
    full, _ = stepwise_batch(records, tok, cfg, ctx.prompt_length)
    return _train_prm(policy, full, cfg=cfg, ctx=ctx)


def _train_prm(policy, full, *, cfg: PRMConfig, ctx: RunContext) -> RunResult:
    """`run_prm` on the `PRMBatch` `full` of its solutions."""
    k_init, ctx_key = jax.random.split(ctx.key)
    model = rx.ValueModel.from_policy(policy, key=k_init)
    opt = build_optimizer(cfg.optim, cfg.steps)
    state = rx.train.init_train_state(model, opt)
    step = rx.train.make_prm_step(opt, rx.train.PRMSettings(), options=cfg.options)
    return run_on_rows(state, step, full, cfg, ctx, ctx_key)


def prm_on_data(cfg, policy, tok, ctx: RunContext, summary: dict, say, split) -> RunResult:
    """Train a PRM on the stepwise file `cfg.data.path` (`data.load_stepwise`), split into
    training and held-out solutions by `split(records)` (on the file's text), their
    prompts then through the model's chat template (`chat_rendering` of
    `data.chat_template`, as the other data-file stages and the rollouts the PRM later
    scores), and put the held-out step accuracy in `summary["prm"]`, with `truncation`:
    of the training solutions, those whose prompt was cut (its end kept), those whose
    later steps did not fit `prm.max_length` and were dropped with their labels
    (`steps_dropped`), and those with no step that fits (`too_long`, left out), with a
    `truncation` event when any prompt was cut or step dropped, naming the first of them
    by their number in the file (`truncated_records`; and a `skipped_records`
    event naming the lines the reader left out, e.g. a solution without steps). Both
    sides are tokenised before training, so a held-out side none of whose solutions fits
    is refused before any step."""
    records = data.load_stepwise(cfg.data.path, **cfg.data.read_options())
    log_skipped(ctx.log, records.report)
    raw, held = split(records)
    train = raw
    rendering = chat_rendering(tok, cfg.data)
    if rendering is not None:
        train, held = rendering.records(raw, records), rendering.records(held, records)
        summary["chat_template"] = cfg.data.chat_template
    numbers = record_numbers(records, raw, train)
    say(f"prm: {len(train)} training / {len(held)} held-out solutions")
    validate_stage("prm", cfg.prm)
    full, report = stepwise_batch(train, tok, cfg.prm, ctx.prompt_length)
    held_batch, _ = stepwise_batch(held, tok, cfg.prm, ctx.prompt_length)  # before training
    named = log_truncation(
        ctx.log,
        cfg.data.path,
        report,
        f"solutions lost their later steps (dropped with their labels, to fit prm.max_length="
        f"{cfg.prm.max_length})",
        f"raise sampling.prompt_length={ctx.prompt_length} or prm.max_length",
        [numbers.get(id(r)) for r in train],
    )
    res = _train_prm(policy, full, cfg=cfg.prm, ctx=ctx)
    labels = np.asarray(held_batch.step_labels)[np.asarray(held_batch.step_mask)]
    summary["prm"] = {
        "heldout_step_accuracy": step_accuracy(res.state.model, held_batch),
        "heldout_steps": int(labels.size),
        "heldout_correct_fraction": float(labels.mean()) if labels.size else 0.0,
        "train_solutions": len(train),
        "skipped_by_reader": dict(records.report.skipped),
        "truncation": {
            "solutions": report.total,
            "prompt_truncated": report.prompt_truncated,
            "steps_dropped": report.completion_truncated,
            "too_long": report.dropped.get("too long", 0),
            "truncated_records": named,
        },
    }
    return res


def prm(env: StageEnv, c: PRMConfig) -> Outcome:
    """A process reward model on a stepwise file, exported to `prm/hf/`."""
    cfg = env.cfg
    split = lambda r: split_records(r, cfg.data)  # noqa: E731
    res = prm_on_data(cfg, env.base, env.tok, env.ctx(""), env.summary, env.say, split)
    kw = dict(separator=c.separator, aggregation=c.aggregation, score=c.score)
    export_prm(res.state.model, env.run_dir, **kw, tokenizer_file=env.tok_file)
    return Outcome(res)


register_stage(
    Stage(
        "prm",
        PRMConfig,
        data=prm,
        trains_policy=False,
        sections=(),
        help="a process reward model on a stepwise file (--data)",
    )
)
