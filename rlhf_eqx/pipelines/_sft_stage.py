"""Supervised fine-tuning, the `sft` stage: its settings (`SFTConfig`), its run
(`run_sft`) and its rows (`sft_rows`), the stage on the built-in task (the base model's
best samples by noisy labels) and on a data file (demonstrations in TRL's SFT layouts, or
a preference file's chosen responses: `sft_split`), and its registration. Every other
stage of the built-in task starts from its policy."""

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

import rlhf_eqx as rx
from rlhf_eqx import data

from ..train import OptimizerSettings, SFTSettings
from ._config import BatchStageConfig, LoRASettings, _optim
from ._data_prep import (
    data_ctx,
    demonstration_split,
    demonstrations,
    nll,
    preference_split,
    trained_policy,
)
from ._field_checks import _fail, _positive
from ._registry import Outcome, Stage, StageEnv, register_stage
from ._runs import RunContext, RunResult, final_policy, run_on_rows, train_setup
from ._sampled_eval import heldout_samples
from ._task import TRAIN_PROMPTS
from ._validation import validate_stage


@dataclasses.dataclass(frozen=True)
class SFTConfig(BatchStageConfig, SFTSettings):
    """Supervised fine-tuning on best-of-`samples` completions (by noisy labels) of the
    base model for the training prompts; the step's settings are
    `rlhf_eqx.train.SFTSettings` (`mode`, `constant`). On a data file, the assistant
    turns of a conversation it trains on are `data.assistant_turns`, and `packing`
    packs whole sequences into the rows (`data.pack_sft`: best-fit decreasing, each
    sequence attending within itself; TRL's `SFTConfig(packing=True,
    packing_strategy="bfd", padding_free=True)`): a step is then `batch_size` rows of
    `max_length` tokens each holding as many sequences as fit, instead of `batch_size`
    sequences each padded to `max_length`."""

    optim: OptimizerSettings = _optim(2e-5)
    samples: int = 4
    packing: bool = False
    lora: LoRASettings = LoRASettings()

    def check(self, name: str, *, device_count: int = 1) -> None:
        """SFT's own rule: `samples >= 1`."""
        del device_count
        _positive(f"{name}.samples", self.samples)


def run_sft(model, tok, records: Sequence, *, cfg: SFTConfig, ctx: RunContext) -> RunResult:
    """Supervised fine-tuning (NLL of the completion tokens) on `(prompt, completion)`
    records (tuples, or `data.DemonstrationRecord`s, whose `spans` say which completion
    text is trained), `cfg.steps` steps of `cfg.batch_size` rows, LoRA per `cfg.lora`.
    With `cfg.packing` the rows are packed (`sft_packed_rows`) and the result's
    `info["packing"]` says how full they are (`packing_report`)."""
    validate_stage("sft", cfg)
    rows = sft_packed_rows if cfg.packing else sft_rows
    full = rows(records, tok, cfg, ctx.prompt_length, add_eos=ctx.add_eos)
    k_lora, ctx_key = jax.random.split(ctx.key)
    state, _, step = train_setup(model, cfg, cfg.steps, k_lora, rx.train.make_sft_step)
    res = run_on_rows(state, step, full, cfg, ctx, ctx_key, policy_of=lambda s: s.model)
    if cfg.packing:
        res.info["packing"] = packing_report(full)
    return res


def _sft_sequences(
    records, tok, c, prompt_length: int, add_eos: bool | str
) -> list[data.TokenizedSequence]:
    seqs, _ = data.tokenize_demonstrations(
        list(records),
        tok,
        max_length=c.max_length,
        max_prompt_length=prompt_length,
        add_eos=add_eos,
    )
    return seqs


def sft_rows(records, tok, c, prompt_length: int, *, add_eos: bool | str = False):
    """`run_sft`'s batch of every `(prompt, completion)` record
    (`data.tokenize_demonstrations`: `c.max_length`, prompts cut to `prompt_length`, EOS
    as `add_eos` says, `RunContext.add_eos`: none by default, as sampled completions
    hold theirs; a conversation's record with `spans` trains on those only)."""
    seqs = _sft_sequences(records, tok, c, prompt_length, add_eos)
    return data.collate_sft(seqs, max_length=c.max_length, pad_id=tok.pad_id)


def sft_packed_rows(
    records, tok, c, prompt_length: int, *, add_eos: bool | str = False
) -> data.PackedSequenceBatch:
    """`run_sft`'s rows with `c.packing`: the sequences of `sft_rows` (tokenised alike)
    packed whole into rows of `c.max_length` tokens (`data.pack_sft`, best-fit
    decreasing; TRL's `packing_strategy="bfd"`), one `sequences` axis for all rows, so
    every step of `c.batch_size` rows has one shape."""
    seqs = _sft_sequences(records, tok, c, prompt_length, add_eos)
    return data.pack_sft(seqs, max_length=c.max_length, pad_id=tok.pad_id)


def packing_report(rows: data.PackedSequenceBatch) -> dict:
    """How full packed rows are: `{"sequences", "rows", "row_length",
    "padding_fraction", "unpacked_padding_fraction"}` (padded positions over all
    positions, packed and with each sequence in a row of its own)."""
    R, L = rows.tokens.shape
    n, real = int(np.sum(np.asarray(rows.sequences))), int(np.sum(np.asarray(rows.mask)))
    return {
        "sequences": n,
        "rows": R,
        "row_length": L,
        "padding_fraction": 1.0 - real / (R * L),
        "unpacked_padding_fraction": 1.0 - real / (n * L),
    }


def sft(env: StageEnv, c: SFTConfig) -> Outcome:
    """SFT on the base model's best-of-`c.samples` completions (by noisy labels)."""
    roll = env.sample(env.base, TRAIN_PROMPTS, 0, c.samples)
    labels = np.asarray(env.label(roll.prompts, roll.texts, 1)).reshape(-1, c.samples)
    best = labels.argmax(axis=1)
    records = [
        (p, roll.texts[j * c.samples + b]) for j, (p, b) in enumerate(zip(TRAIN_PROMPTS, best))
    ]
    env.say(f"sft: {len(records)} demonstrations (best of {c.samples} by noisy labels)")
    res = run_sft(env.base, env.tok, records, cfg=c, ctx=env.ctx("sft", periodic=False))
    return Outcome(res, policy=final_policy(res.state.model))


def sft_split(env: StageEnv, c: SFTConfig) -> tuple[list, list, bool]:
    """The data file's SFT records, `(train, held, prompted)`: demonstrations
    (`demonstrations`, `demonstration_split`) or a preference file's pairs
    (`preference_split`) with their chosen responses as the completions; `train` as
    `(prompt, completion)` records (demonstrations: `data.DemonstrationRecord`s, with
    the `spans` of a conversation trained on every assistant turn); `prompted` false
    for language-modelling text, whose records have no prompt to sample from."""
    records, rendered = demonstrations(env)
    if records is None:
        train, held = preference_split(env, c)
        return [(r.prompt, r.chosen) for r in train], held, True
    train, held = demonstration_split(env, c, records, rendered)
    return list(train), held, records.report.format != "text"


def sft_samples(env: StageEnv, before, after, held, prompted: bool, reuse=None) -> dict:
    """`heldout_samples` of an SFT run on a data file (`reuse`: as there); for text,
    whose records have no prompt (`prompted` false), none: a note says so. A
    conversation trained on every assistant turn is prompted with its messages up to
    its last assistant message (`DemonstrationRecord.last_turn`)."""
    if not prompted:
        return {"prompts": 0, "skipped": "language-modelling text has no prompt to sample from"}
    held = [r.last_turn() if isinstance(r, data.DemonstrationRecord) else r for r in held]
    return heldout_samples(env, before, after, held, reuse)


def sft_on_data(env: StageEnv, c: SFTConfig) -> Outcome:
    """SFT on a data file's demonstrations (or a preference file's chosen responses);
    the held-out NLL and perplexity of the completions before and after, and held-out
    samples (`sft_samples`)."""
    policy, tok = env.base, env.tok
    train, held, prompted = sft_split(env, c)
    ctx = data_ctx(env)
    hb = sft_rows(held, tok, c, env.cfg.sampling.prompt_length, add_eos=ctx.add_eos)
    before = float(nll(policy, hb))
    res = run_sft(policy, tok, train, cfg=c, ctx=ctx)
    packing = res.info.get("packing")
    if packing is not None:
        env.say(
            f"sft: packed {packing['sequences']} sequences into {packing['rows']} rows of "
            f"{packing['row_length']} tokens ({packing['padding_fraction']:.0%} padding; "
            f"{packing['unpacked_padding_fraction']:.0%} with one sequence a row)"
        )
    trained = trained_policy(env, res.state.model)
    after = float(nll(trained, hb))
    env.summary["sft"] = {
        "heldout_nll_before": before,
        "heldout_nll": after,
        "heldout_perplexity": float(np.exp(after)),
        "sampled": sft_samples(env, policy, trained, held, prompted),
    }
    if packing is not None:
        env.summary["sft"]["packing"] = packing
    return Outcome(res, policy=trained)


def check_packing(cfg, run) -> None:
    """Packing applies to SFT on a data file only."""
    del run
    if cfg.data.path is None and cfg.sft.packing:
        why = (
            "the built-in task's sft stage trains on its own samples, unpacked; packing "
            "applies to sft on a data file"
        )
        _fail("sft.packing", cfg.sft.packing, why)


register_stage(
    Stage(
        "sft",
        SFTConfig,
        sft,
        sft_on_data,
        needs=lambda cfg: ("sft",),
        sections=(),
        help="supervised fine-tuning",
        task=dict(steps=30, batch_size=16, samples=2, optim=_optim(5e-4)),
        key_stream=("split", 1),
        check_run=check_packing,
    )
)
