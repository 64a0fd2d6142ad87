"""The commands that use a model without training it: `rlhf_eqx sample` (completions of
prompts) and `rlhf_eqx eval` (the built-in task's held-out score), on the model the
stages load (`model.*`), its prompts as the stages write them (`data.chat_template`)."""

from collections.abc import Sequence

import jax

from . import task
from ._config import ConfigError, DataConfig
from ._data_prep import chat_rendering, prompt_tokens
from ._pipeline import load_configured_model, load_model, task_evaluator
from ._rollout import sample_rollout, sampling_options


def render_prompts(tok, dc: DataConfig, prompts: Sequence[str]) -> list[str]:
    """The texts a model is given for `prompts`.

    **Arguments:**

    - `tok`: the model's tokenizer (its `chat_template`, when it has one).
    - `dc`: the run's `DataConfig`; `chat_template` is read (`auto`, `none` or a
      `.jinja` file, as for the data-file stages).
    - `prompts`: the prompts as a user writes them.

    **Returns:** each prompt through the chat template (`chat_rendering`: one user
    message, then the generation prompt; an HH-RLHF transcript, its turns), or as
    written (`none`, or a tokenizer without a template, e.g. the built-in stories
    model). BOS is not in the text: `encode_prompts` adds it when the tokenizer asks.
    """
    rendering = chat_rendering(tok, dc)
    return list(prompts) if rendering is None else [rendering.prompt(p) for p in prompts]


def sample_model(cfg, prompts: Sequence[str] = (), *, num_samples: int = 4) -> list[str]:
    """What `rlhf_eqx sample` prints: `num_samples` completions of each prompt (default:
    the built-in task's first two held-out prompts) by `load_configured_model(cfg)`,
    with `sampling.*` and the key `ops.seed`.

    Each prompt goes to the model through `render_prompts` (BOS in front only when the
    tokenizer asks for it, `data.wants_bos`), and a row stops at EOS (SmolLM2's
    `<|im_end|>`, its template's end of turn), the model's end-of-turn ids (the
    tokenizer's `stop_ids`: Gemma's `<end_of_turn>`, Llama 3's `<|eot_id|>`), BOS or
    `sampling.stop_strings`. A prompt longer
    than `sampling.prompt_length` widens it instead of being refused. `num_samples`
    below 1 is a `ConfigError` naming `-n` (`--num-samples`), before the model loads, and
    so is `data.path` (`--data`: sample reads no data file). `sampling.temperature=0`
    is greedy decoding (each token the argmax), as `rlhf_eqx serve` takes it.

    **Returns:** one text per sample, prompt by prompt: the prompt as given, then its
    completion (after a line break when the prompt went through a chat template).
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ConfigError(f"-n/--num-samples={num_samples!r}: must be >= 1")
    _no_data_file(cfg, "sample completes the --prompt texts (by default two story openings)")
    policy, tok = load_configured_model(cfg)
    prompts = list(prompts) or list(task.HELDOUT_PROMPTS[:2])
    fed = render_prompts(tok, cfg.data, prompts)
    shown, sep = dict(zip(fed, prompts)), "" if fed == prompts else "\n"
    length = max(cfg.sampling.prompt_length, *(prompt_tokens(tok, p) for p in fed))
    # `sampling.*` as a run samples, but the prompt length widened and the static batch loop
    options = sampling_options(cfg.sampling) | dict(prompt_length=length, slots=0)
    roll = sample_rollout(
        policy,
        tok,
        fed,
        jax.random.key(cfg.ops.seed),
        group_size=num_samples,
        **options,
    )
    return [f"{shown[p]}{sep}{t}" for p, t in zip(roll.prompts, roll.texts)]


def evaluate_model(cfg) -> dict:
    """What `rlhf_eqx eval` prints: the built-in task's held-out score of
    `load_configured_model(cfg)` as a run of `cfg` evaluates its stages
    (`task_evaluator`: `eval_samples` samples of each held-out story opening with the
    run's key `split(key(ops.seed), 8)[0]` and sampling settings, `sampling.slots`
    included, the animal scorer), with the stories model as base and reference for the
    512-token vocabulary, else the model itself. The openings are continued as written,
    as the built-in pipeline evaluates them (no chat template). So the numbers of a
    run's exported policy (`RUN/sft/hf`, or `RUN` itself: `load_model`) at the run's
    `ops.seed`, `eval_samples` and `sampling.*` are those in its `summary.json`, and
    `builtin`'s are the run's `base` numbers. `data.path` is refused (a `ConfigError`):
    eval reads no data file (a data-file run reports its held-out numbers in its
    `summary.json`). `sampling.temperature=0` samples greedily, as `sample` does.

    **Returns:** the metrics of `evaluate_policy` (`score`, `score_se`, `base_nll`,
    `kl`).
    """
    _no_data_file(cfg, "eval scores the built-in task's story openings")
    policy, tok = load_configured_model(cfg)
    base, _ = load_model("builtin") if policy.cfg.vocab_size == 512 else (policy, tok)
    evaluate = task_evaluator(cfg, tok, base, jax.random.key(cfg.ops.seed))
    metrics, _, _ = evaluate(policy, base)
    return metrics


def _no_data_file(cfg, what: str) -> None:
    """A `ConfigError` naming `data.path` (`--data`) when it is set: `what` the command
    reads instead."""
    if cfg.data.path is not None:
        raise ConfigError(
            f"data.path={cfg.data.path!r} (--data): {what} and reads no data file (a "
            "data-file run reports its held-out numbers in its summary.json)"
        )
