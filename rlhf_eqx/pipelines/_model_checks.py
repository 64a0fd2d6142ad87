"""Checks that need the model's sizes or the run's tokenizer, made before any stage runs
and without loading weights: the sizes come from a checkpoint's header
(`config.json`, a llama2.c header, a GGUF file's metadata), the tokenizer file is read
on its own.

- every length of model input the run reads (a stage's `max_length`, a sampled
  `sampling.prompt_length + sampling.max_new_tokens`) fits the model's context
  `max_seq_len` (`check_context`), and so do the lengths the other models a run reads
  see (a distillation teacher, a reward model, an ensemble's members, a PRM, a judge);
  a multi-turn episode (prompt, every turn, the
  questions between) fits it too, named by the user's fields (`multiturn.turn_tokens`, ...);
- a judge's verdicts (`judge.yes`, `judge.no`) are single, different tokens of the
  tokenizer it reads with, and a judge checkpoint shares the policy's vocabulary;
- a distillation teacher's checkpoint shares the student's vocabulary.
"""

import functools
import json
import os
from collections.abc import Sequence
from typing import Any

from rlhf_eqx import data

from ._config import ConfigError
from ._field_checks import _fail


def is_gguf_file(path: str) -> bool:
    """Whether `path` is a llama.cpp GGUF file (`rlhf_eqx.data.is_gguf_file`: a `.gguf`
    name, or a file whose first four bytes are the magic `GGUF` whatever its name, as
    such files are often downloaded). Every place that tells a model, a teacher, a judge,
    a tokenizer file or a reference apart asks this, so that such a file loads as its
    `.gguf` name would."""
    return data.is_gguf_file(path)


def read_tokenizer_file(path: str):
    """The tokenizer of the file `path`: a GGUF file's from its metadata
    (`data.tokenizer_from_gguf`, whatever the file's name: `is_gguf_file`), any other
    by its type (`data.load_tokenizer`, which names a missing file)."""

    if os.path.isfile(path) and is_gguf_file(path):
        return data.tokenizer_from_gguf(path)
    return data.load_tokenizer(path)


def _header_sizes(source: str) -> tuple[int, int] | None:
    """`(vocab_size, max_seq_len)` of a checkpoint, read from its header only (`None`
    for a format whose sizes are not read here: `load_model` checks it)."""
    from ..assets import asset_path
    from ..models import config_from_hf, read_gguf_sizes, read_llama2c_header
    from . import _pipeline

    resolve = getattr(_pipeline, "model_path", None)  # short model names
    source = resolve(source) if resolve is not None else source
    if source == "builtin":
        source = asset_path("stories260K.bin")
    if is_gguf_file(source):  # `None`: a header this walk does not read
        return read_gguf_sizes(source) if os.path.isfile(source) else None
    if os.path.isdir(source):
        base = getattr(_pipeline, "_adapter_base", None)  # a PEFT adapter: its base's sizes
        source = (base(source) if base is not None else None) or source
        path = os.path.join(source, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"{source}: no config.json (not a Hugging Face checkpoint directory)")
        with open(path, encoding="utf-8") as f:
            try:
                config = json.load(f)
            except (ValueError, UnicodeDecodeError) as e:  # name the file, not only the spot
                raise ValueError(f"{path}: not valid JSON ({e})") from None
        cfg = config_from_hf(config, source=path)
        return cfg.vocab_size, cfg.max_seq_len
    sizes, _, _, _ = read_llama2c_header(source)
    return sizes["vocab_size"], sizes["seq_len"]


def model_sizes(field: str, source: str) -> tuple[int, int] | None:
    """`(vocab_size, max_seq_len)` of the checkpoint `source` (`"builtin"`, a llama2.c
    `.bin` file, a Hugging Face directory or a GGUF file: `read_gguf_sizes`) without
    loading its weights; a `ConfigError` naming `field` when its header cannot be read,
    `None` for a GGUF header that walk does not read (the limits that need its sizes
    are then checked when it is loaded)."""
    try:
        return _header_sizes(source)
    except (OSError, ValueError, KeyError, TypeError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"{field}={source!r}: {reason}") from None


@functools.lru_cache(maxsize=8)
def _read_tokenizer(path: str, stamp: int):
    del stamp  # part of the cache key: a rewritten file is read again
    return data.load_tokenizer(path)


def run_tokenizer(cfg: Any) -> tuple[Any, str] | None:
    """The run's tokenizer (the one `load_model(cfg.model.source, cfg.model.tokenizer)`
    reads) and its file; a `ConfigError` naming `model.tokenizer` when it cannot be
    read; `None` for a GGUF file's own tokenizer (seconds to parse: checked when the
    model is loaded)."""
    from ._pipeline import tokenizer_file

    m = cfg.model
    path = tokenizer_file(m.source, m.tokenizer)
    if path is not None and is_gguf_file(path):
        return None
    if path is None:
        _fail("model.tokenizer", m.tokenizer, f"no tokenizer file found for {m.source!r}")
    try:
        return _read_tokenizer(path, os.stat(path).st_mtime_ns), path
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.tokenizer={m.tokenizer!r}: {str(e).splitlines()[0]}") from None


def check_context(
    cfg: Any,
    lengths: Sequence[tuple[str, int]],
    max_seq_len: int | None = None,
    *,
    field: str = "model.source",
    source: str | None = None,
) -> None:
    """Refuse the `lengths` a model reads (`(settings, tokens)`: `("kto.max_length", 1024)`,
    `("sampling.prompt_length=32 + sampling.max_new_tokens=600", 632)`) that exceed its
    context `max_seq_len` (by default read from the header of `source`, the setting
    `field`: the policy `model.source` unless given, or a teacher, reward model or judge;
    not for a header that cannot be read: checked once it is loaded): one `ConfigError`
    line naming each, its value, the context and the model (`model.source` as given, or
    `distill.teacher=...`). Positions past `max_seq_len` are ones the model's rotary
    embedding was not trained on, and the sampler refuses them only after training."""
    source = cfg.model.source if source is None else source
    if max_seq_len is None:
        try:
            sizes = model_sizes(field, source)
        except ConfigError:  # an unreadable header: loading the model names what is wrong
            return
        if sizes is None:
            return
        max_seq_len = sizes[1]
    over = [(what, n) for what, n in lengths if n > max_seq_len]
    if not over:
        return
    named = " and ".join(f"{what}{' = ' if '+' in what else '='}{n}" for what, n in over)
    verb = "exceeds" if len(over) == 1 else "exceed"
    model = (
        f"{source!r} (model.source, --model)" if field == "model.source" else f"{field}={source!r}"
    )
    raise ConfigError(
        f"{named} {verb} the context of the model {model}: max_seq_len={max_seq_len} tokens; "
        f"lower {'it' if len(over) == 1 else 'them'} or use a model with a longer context"
    )


def _vocab(field: str, source: str) -> int | None:
    sizes = model_sizes(field, source)
    return None if sizes is None else sizes[0]


def check_episode_length(cfg: Any, name: str, c: Any) -> None:
    """A multi-turn stage's episode (`sampling.prompt_length`, then `c.max_turns` turns
    of `c.turn_tokens` and the animal environment's questions between them) must fit
    the model's `max_seq_len`."""
    from ..envs import AnimalFollowUpEnv

    sizes = model_sizes("model.source", cfg.model.source)
    if sizes is None:
        return
    max_seq_len, found = sizes[1], run_tokenizer(cfg)
    if found is None:
        return
    tok = found[0]
    question = AnimalFollowUpEnv(tok).max_observation_tokens
    P, turns = cfg.sampling.prompt_length, c.max_turns
    between = (turns - 1) * question
    total = P + turns * c.turn_tokens + between
    if total <= max_seq_len:
        return
    fit = (max_seq_len - P - between) // turns
    hint = (
        f"at most {fit} turn tokens fit"
        if fit >= 1
        else f"lower {name}.max_turns or sampling.prompt_length"
    )
    _fail(
        f"{name}.turn_tokens",
        c.turn_tokens,
        f"an episode of sampling.prompt_length={P} + {name}.max_turns={turns} turns of "
        f"{c.turn_tokens} tokens + {turns - 1} question(s) of up to {question} tokens is "
        f"{total} tokens, longer than the model's max_seq_len={max_seq_len}; {hint}",
    )


def _check_verdicts(judge: Any, tok: Any, where: str) -> None:
    ids = {}
    for field in ("yes", "no"):
        verdict = getattr(judge, field)
        encoded = list(tok.encode(verdict))
        if len(encoded) != 1:
            _fail(
                f"judge.{field}",
                verdict,
                f"encodes to {len(encoded)} tokens {encoded} of the judge's tokenizer "
                f"({where}); must be a single token (with or without a leading space)",
            )
        ids[field] = encoded[0]
    if ids["yes"] == ids["no"]:
        _fail("judge.no", judge.no, f"the same token as judge.yes={judge.yes!r} (id {ids['no']})")


def check_judge(cfg: Any, judge: Any) -> None:
    """The judge's verdict tokens and vocabulary: `judge.yes` and `judge.no` encode to one
    token each, different ones, of the run's tokenizer (the judge reads the policy's
    tokens), and a judge checkpoint directory has the policy's vocabulary size."""
    found = run_tokenizer(cfg)
    if found is not None:
        _check_verdicts(judge, *found)
    if os.path.isdir(judge.model):
        theirs = _vocab("judge.model", judge.model)
        ours = _vocab("model.source", cfg.model.source)
        if None not in (theirs, ours) and theirs != ours:
            _fail(
                "judge.model",
                judge.model,
                f"the judge's vocab_size={theirs} differs from the policy's vocab_size={ours} "
                f"(model.source={cfg.model.source!r}); the judge reads the policy's tokens",
            )


def check_teacher_vocabulary(cfg: Any, teacher: str) -> None:
    """A distillation teacher's checkpoint directory has the student's vocabulary size."""
    theirs = _vocab("distill.teacher", teacher)
    ours = _vocab("model.source", cfg.model.source)
    if None not in (theirs, ours) and theirs != ours:
        _fail(
            "distill.teacher",
            teacher,
            f"the teacher's vocab_size={theirs} differs from the student's vocab_size={ours} "
            f"(model.source={cfg.model.source!r}); teacher and student must share a tokenizer",
        )
