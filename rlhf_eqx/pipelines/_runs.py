"""Whole runs: typed config -> final `TrainState` + metrics history. Here: the run
context and the pieces shared by every run; each algorithm's run is in its stage module
(`_sft_stage.py`, `_dpo_stage.py`, `_ppo_stage.py`, ...).

Every run goes through `run_iterations` (checkpoints, exact resume, rollback, the KL
guard, metrics). Iteration `i` draws its data from `i` and its randomness from
`fold_in(key, i)`.
"""

import dataclasses
import functools
import os
import shutil
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Int, PRNGKeyArray

import rlhf_eqx as rx
from rlhf_eqx import data

from ._config import (
    LoRASettings,
    OpsConfig,
    SamplingConfig,
)
from ._iterations import run_iterations
from ._loop_state import LoopResult
from ._lr_scale import build_optimizer
from ._metrics import MetricsLog
from ._model_checks import is_gguf_file
from ._monitor import model_flops
from ._validation import validate_ops


@dataclasses.dataclass(frozen=True)
class RunContext:
    """Where and how a run executes: its operations settings, its metrics log, its
    checkpoint directory (`None`: no checkpoints), whether to resume, its PRNG key, and
    the sampling settings of rollouts. `evaluate(policy) -> metrics`, when given, runs
    every `ops.eval_every` iterations on the current policy (LoRA merged). `peak_flops`
    (`measure_matmul_peak`, once per run) turns on the per-iteration MFU. `callbacks`
    (`Callback`s) are called by the run's loop: every run function that takes this
    context gets them. `add_eos`: how the completions of the records a run tokenises end
    (`data.tokenize_sft`'s keyword): `False` on the built-in task, whose sampled
    completions hold their own EOS where the model stopped; `"auto"` on a data file
    (TRL's EOS after each completion, unless its chat template ended the turn with its
    end-of-turn token already), so that the model learns to stop."""

    ops: OpsConfig
    log: MetricsLog
    key: PRNGKeyArray
    checkpoint_dir: str | None = None
    resume: bool = False
    prompt_length: int = SamplingConfig.prompt_length
    max_new_tokens: int = SamplingConfig.max_new_tokens
    temperature: float = SamplingConfig.temperature
    top_k: int = SamplingConfig.top_k
    top_p: float = SamplingConfig.top_p
    min_p: float = SamplingConfig.min_p
    repetition_penalty: float = SamplingConfig.repetition_penalty
    presence_penalty: float = SamplingConfig.presence_penalty
    frequency_penalty: float = SamplingConfig.frequency_penalty
    stop_strings: tuple[str, ...] = SamplingConfig.stop_strings
    slots: int = SamplingConfig.slots
    meta: dict | None = None
    evaluate: Callable[[object], dict] | None = None
    peak_flops: float | None = None
    callbacks: Sequence[Any] = ()
    add_eos: bool | str = False


@dataclasses.dataclass
class RunResult:
    """The final `TrainState`, the metrics of every step, the loop's report and what the
    run adds (e.g. the reward model's checkpoint selection)."""

    state: Any  # a `TrainState` (or, inside a run, the loop's own state pytree)
    history: list[dict]
    loop: LoopResult
    info: dict = dataclasses.field(default_factory=dict)


def with_lora(model, lora: LoRASettings, key: PRNGKeyArray):
    """`(model with adapters, filter spec)`; `lora.rank == 0`: `(model, None)` (train all)."""
    cfg = lora.lora_config()
    if cfg is None:
        return model, None
    adapted = rx.apply_lora(model, cfg, key=key)
    return adapted, rx.lora_filter(adapted)


def train_setup(model, cfg, total_steps: int, key: jax.Array, make_step, settings=None):
    """`(state, reference, step)`, what a run that trains `model` starts from:

    - `state`: the `TrainState` of `model` with the adapters of `cfg.lora` (`with_lora`:
      the adapters train, or every weight with `cfg.lora.rank == 0`) and the optimiser
      of `cfg.optim` scheduled over `total_steps` updates (`build_optimizer`);
    - `reference`: that model with its adapters off (the same base arrays), or `model`
      itself when it has none;
    - `step`: `make_step(optimizer, settings, options=cfg.options)`, `settings` by
      default `cfg` (e.g. `rlhf_eqx.train.make_sft_step`)."""
    model, spec = with_lora(model, cfg.lora, key)
    reference = rx.without_lora(model) if spec is not None else model
    opt = build_optimizer(cfg.optim, total_steps)
    state = rx.train.init_train_state(model, opt, filter_spec=spec)
    step = make_step(opt, cfg if settings is None else settings, options=cfg.options)
    return state, reference, step


def rl_step_settings(cfg, temperature: float, completion_budget: int):
    """The settings an RL stage's step is built from: `cfg` at the run's sampling
    `temperature` (its one owner, `sampling.temperature`) and, for Dr.GRPO's aggregation
    (`mode="seq-mean-token-sum-norm"`) without a `constant`, the normaliser
    `C = completion_budget`, the most loss tokens a row can hold, as TRL's
    `loss_type="dr_grpo"` divides by `max_completion_length` (the step's own default, the
    padded row width, would count the prompt too)."""
    constant = cfg.constant
    if cfg.mode == "seq-mean-token-sum-norm" and constant is None:
        constant = float(completion_budget)
    return dataclasses.replace(cfg, temperature=temperature, constant=constant)


def has_lora(model) -> bool:
    """Whether `model` carries LoRA adapters (`apply_lora`)."""
    return rx.without_lora(model) is not model


def check_finite_weights(model, what: str) -> None:
    """Refuse (`ValueError`) a model with a NaN or infinite weight, naming the weight: no
    export ever writes non-finite weights."""
    leaves = jax.tree_util.tree_leaves_with_path(eqx.filter(model, eqx.is_inexact_array))
    for path, x in leaves:
        if not bool(jnp.all(jnp.isfinite(x))):
            name = jax.tree_util.keystr(path)
            raise ValueError(f"{what}: weight {name} has non-finite values; not exported")


_TOKENIZER_FILES = {".json": "tokenizer.json", ".model": "tokenizer.model", ".bin": "tokenizer.bin"}
_HF_TOKENIZER_EXTRAS = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",  # where transformers >= 4.50 saves a chat template
    "generation_config.json",
)


@functools.lru_cache(maxsize=4)
def _gguf_tokenizer(path: str, stamp: int):
    del stamp  # part of the cache key: a rewritten file is read again
    return data.tokenizer_from_gguf(path)


def copy_tokenizer(tokenizer_file: str | None, directory: str) -> None:
    """Copy the tokenizer file a model was loaded with into `directory` under the name
    `data.load_tokenizer(directory)` finds (`tokenizer.json`, `tokenizer.model` or
    `tokenizer.bin`), with the files of a Hugging Face directory beside a `tokenizer.json`
    or `tokenizer.model` (`tokenizer_config.json`, `special_tokens_map.json`,
    `chat_template.jinja`, `generation_config.json`) when they are there. For a GGUF
    file (`is_gguf_file`: a `.gguf` name or the file's magic) the tokenizer built from
    its metadata is written instead (`HFTokenizer.save`: `tokenizer.json`, and
    `tokenizer_config.json` with the special tokens and the chat template)."""
    if tokenizer_file is None:
        return
    ext = os.path.splitext(tokenizer_file)[1].lower()
    if is_gguf_file(tokenizer_file):
        stamp = os.stat(tokenizer_file).st_mtime_ns
        _gguf_tokenizer(os.path.abspath(tokenizer_file), stamp).save(directory)
        return
    name = _TOKENIZER_FILES.get(ext)
    if name is None:
        raise ValueError(f"{tokenizer_file}: unknown tokenizer file type, not exported")
    shutil.copyfile(tokenizer_file, os.path.join(directory, name))
    if ext in (".json", ".model"):
        for extra in _HF_TOKENIZER_EXTRAS:
            src = os.path.join(os.path.dirname(tokenizer_file), extra)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(directory, extra))


def special_token_ids(tokenizer_file: str | None, *, pad: bool) -> dict[str, int]:
    """The `save_hf` keywords of the tokenizer `tokenizer_file` (`copy_tokenizer`'s):
    `bos_token_id`, `eos_token_id` (so that transformers' `generate` stops there: a list,
    EOS first, when the tokenizer's `stop_ids` hold its model's end-of-turn ids too) and,
    with `pad` (a sequence classifier, which transformers scores on batches only with
    one), `pad_token_id`; none without a file."""
    if tokenizer_file is None:
        return {}
    if is_gguf_file(tokenizer_file):
        stamp = os.stat(tokenizer_file).st_mtime_ns
        tok = _gguf_tokenizer(os.path.abspath(tokenizer_file), stamp)
    else:
        tok = data.load_tokenizer(tokenizer_file)
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id}
    if pad:
        ids["pad_token_id"] = tok.pad_id
    ids = {k: v for k, v in ids.items() if isinstance(v, int) and v >= 0}
    stops = [int(i) for i in getattr(tok, "stop_ids", None) or ()]
    if "eos_token_id" in ids and len(stops) > 1:
        ids["eos_token_id"] = stops
    return ids


def export_policy(
    policy,
    run_dir: str,
    stage: str,
    *,
    adapted=None,
    tokenizer_file: str | None = None,
    base_model: str | None = None,
) -> None:
    """Write `policy` (merged) as a Hugging Face checkpoint in `<run_dir>/<stage>/hf/`
    (`save_hf`) with its tokenizer beside it (`tokenizer_file`, copied by
    `copy_tokenizer`: `rlhf_eqx sample --model <run_dir>/<stage>/hf` then works alone);
    when `adapted`, the trained model before merging, has LoRA adapters, also the
    adapters alone in the PEFT layout in `<run_dir>/<stage>/adapter/`
    (`save_lora_adapter`), with `base_model` (the Hugging Face directory the adapters
    were trained on, when there is one) as its `base_model_name_or_path`. A model with a
    non-finite weight is refused. In a run of several processes every process calls it:
    arrays sharded across the processes are gathered whole first (`to_host`, a
    collective) onto this process's default device, and each process writes its own
    `run_dir`."""
    if jax.process_count() > 1:
        from rlhf_eqx.distributed import to_host

        local = lambda t: jax.tree.map(
            lambda x: jnp.asarray(x) if isinstance(x, np.ndarray) else x, to_host(t)
        )
        policy = local(policy)
        # the adapters are written only when there are some: gather the model once else
        adapted = local(adapted) if adapted is not None and has_lora(adapted) else None
    check_finite_weights(policy, f"{stage} policy")
    out = os.path.join(run_dir, stage, "hf")
    rx.save_hf(policy, out, **special_token_ids(tokenizer_file, pad=False))
    copy_tokenizer(tokenizer_file, out)
    if adapted is not None and has_lora(adapted):
        rx.save_lora_adapter(
            adapted, os.path.join(run_dir, stage, "adapter"), base_model_name_or_path=base_model
        )


def export_reward_model(model, run_dir: str, *, tokenizer_file: str | None = None) -> None:
    """Write a reward model as a `...ForSequenceClassification` checkpoint in
    `<run_dir>/reward/hf/` with its tokenizer beside it. That head has no bias, so the
    bias is dropped first: a Bradley-Terry reward is shift-invariant, and the exported
    scores differ from `model`'s by that one constant. A model with a non-finite weight
    is refused."""
    check_finite_weights(model, "reward model")
    model = eqx.tree_at(lambda m: m.bias, model, jnp.zeros_like(model.bias))
    out = os.path.join(run_dir, "reward", "hf")
    rx.save_hf(model, out, **special_token_ids(tokenizer_file, pad=True))
    copy_tokenizer(tokenizer_file, out)


def final_policy(model):
    """The trained policy with its LoRA adapters (if any) merged into the weights; a
    quantised frozen base (`model.quantized`: QLoRA) is decoded first, so the merged
    policy is dense."""
    quantized = jax.tree.leaves(
        model, is_leaf=lambda x: isinstance(x, rx.models.AbstractQuantizedWeight)
    )
    if any(isinstance(x, rx.models.AbstractQuantizedWeight) for x in quantized):
        model = rx.models.dequantize(model)
    return rx.merge_lora(model)


def rows_at(n: int, batch_size: int, seed: int, i: int) -> Int[np.ndarray, " batch"]:
    """Row indices of batch `i` of shuffled epochs over `n` rows (`epoch_permutation`);
    with fewer than `batch_size` rows, rows repeat (fixed shapes)."""
    if n < batch_size:
        perm = data.epoch_permutation(n, seed, i)
        return perm[np.arange(batch_size) % n]
    per_epoch = n // batch_size
    epoch, pos = divmod(i, per_epoch)
    perm = data.epoch_permutation(n, seed, epoch)
    return perm[pos * batch_size : (pos + 1) * batch_size]


def take_rows(batch, idx):
    return jax.tree.map(lambda x: None if x is None else x[idx], batch)


_LOOP_FIELDS = ("key", "ops", "log", "checkpoint_dir", "resume", "meta", "peak_flops", "callbacks")
"""The `RunContext` fields `run_iterations` takes as they are (`run_loop`)."""


def run_loop(state, iteration, ctx: RunContext, num, *, policy_of=None, **kw) -> RunResult:
    """`run_iterations` with the context's settings, its periodic evaluation (on the
    policy `policy_of(state)`, LoRA merged) and its callbacks."""
    validate_ops(ctx.ops)
    evaluate = merged = None
    if policy_of is not None:
        merged = lambda s: final_policy(policy_of(s))  # noqa: E731
    if ctx.evaluate is not None and merged is not None:
        evaluate = lambda s, i: ctx.evaluate(merged(s))  # noqa: E731
    given = {name: getattr(ctx, name) for name in _LOOP_FIELDS}
    loop = run_iterations(
        state, iteration, num_iterations=num, evaluate=evaluate, policy_of=merged, **given, **kw
    )
    return RunResult(loop.state, loop.history, loop)


# --- batches ---------------------------------------------------------------------------


def shuffled_rows(full, batch_size: int, seed: int) -> Callable[[int], Any]:
    """Batch `i` of shuffled epochs over the rows of `full`: the rows `rows_at(i)`."""
    n = jax.tree.leaves(full)[0].shape[0]
    return lambda i: take_rows(full, rows_at(n, batch_size, seed, i))


def shuffled_batches(batches: Sequence[Any], seed: int) -> Callable[[int], Any]:
    """Batch `i` of epochs over a fixed list of batches, each epoch in its own order
    (`epoch_permutation`)."""
    n = len(batches)
    return lambda i: batches[int(data.epoch_permutation(n, seed, i // n)[i % n])]


def run_offline(
    state,
    step,
    batch_at: Callable[[int], Any],
    *,
    steps: int,
    tokens_per_iteration: int,
    ctx: RunContext,
    ctx_key,
    policy_of=None,
) -> RunResult:
    """`steps` updates of `step` on the batches `batch_at(i)` (offline DPO's; SFT, KTO
    and the PRM train on shuffled rows: `run_on_rows`)."""

    def iteration(state, key, i):
        state, m = state.apply(step, batch_at(i), key=key)
        return state, [m], {}

    tokens = tokens_per_iteration
    return run_loop(
        state,
        iteration,
        dataclasses.replace(ctx, key=ctx_key),
        steps,
        policy_of=policy_of,
        tokens_per_iteration=tokens,
        flops_per_iteration=model_flops(rx.count_params(state.model), train_tokens=tokens),
    )


def run_on_rows(
    state, step, full, cfg, ctx: RunContext, ctx_key, *, row_tokens=None, policy_of=None
) -> RunResult:
    """`run_offline` on shuffled rows of `full` (`shuffled_rows`, the run's seed):
    `cfg.steps` steps of `cfg.batch_size` rows of `row_tokens` tokens each (default
    `cfg.max_length`)."""
    rows = shuffled_rows(full, cfg.batch_size, ctx.ops.seed)
    tokens = cfg.batch_size * (cfg.max_length if row_tokens is None else row_tokens)
    return run_offline(
        state,
        step,
        rows,
        steps=cfg.steps,
        tokens_per_iteration=tokens,
        ctx=ctx,
        ctx_key=ctx_key,
        policy_of=policy_of,
    )


def collate_pairs(
    pairs: Sequence[data.PreferenceRecord],
    tok,
    *,
    max_length: int,
    prompt_length: int,
    add_eos: bool | str = False,
) -> rx.PreferenceBatch:
    """Tokenise `prompt + chosen` / `prompt + rejected`, right-padded to `max_length`;
    `add_eos` as `RunContext.add_eos` (default no EOS: sampled completions carry their
    own)."""
    tokenized, _ = data.tokenize_preferences(
        list(pairs), tok, max_length=max_length, max_prompt_length=prompt_length, add_eos=add_eos
    )
    return data.collate_preferences(tokenized, max_length=max_length, pad_id=tok.pad_id)
