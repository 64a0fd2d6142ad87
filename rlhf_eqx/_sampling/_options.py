"""`SamplingOptions` (validated once) and the `GenerationOutput` of a sampled batch."""

import math
import numbers
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import numpy as np
from jaxtyping import Array, Bool, Float, Int

DEFAULT_TEMPERATURE: float = 1.0
"""The default sampling temperature, written here only: `generate`, `SamplingOptions`,
`sample_token`, the pipelines' `sampling.temperature` and the steps' `temperature`
(`rlhf_eqx.train.SampledSettings`, `rlhf_eqx.train.DistillSettings`) default to it."""


Count = int | np.integer
"""A count or an id as the samplers' signatures take it: a Python int or a NumPy one."""

Number = float | int | np.floating | np.integer
"""A scalar setting as the samplers' signatures take it: a Python or NumPy number."""


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_top_k(top_k: object) -> None:
    """Raise unless `top_k` is a positive int or None."""
    if top_k is not None and not (_is_int(top_k) and top_k > 0):  # type: ignore[operator]
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")


def check_top_p(top_p: object) -> None:
    """Raise unless `top_p` is a number in (0, 1] or None."""
    if top_p is not None and not (
        isinstance(top_p, numbers.Real) and not isinstance(top_p, bool) and 0.0 < top_p <= 1.0
    ):
        raise ValueError(f"top_p must be a number in (0, 1] or None, got {top_p!r}")


def check_min_p(min_p: object) -> None:
    """Raise unless `min_p` is a number in [0, 1] or None (0 and None: off)."""
    if min_p is not None and not (
        isinstance(min_p, numbers.Real) and not isinstance(min_p, bool) and 0.0 <= min_p <= 1.0
    ):
        raise ValueError(f"min_p must be a number in [0, 1] or None, got {min_p!r}")


def _is_number(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def check_repetition_penalty(repetition_penalty: object) -> None:
    """Raise unless `repetition_penalty` is a finite number > 0 (1: off)."""
    if not (_is_number(repetition_penalty) and repetition_penalty > 0):  # type: ignore[operator]
        raise ValueError(
            f"repetition_penalty must be a finite number > 0 (1: off), got {repetition_penalty!r}"
        )


def check_penalty(name: str, value: object) -> None:
    """Raise unless `value` (`presence_penalty` or `frequency_penalty`, named `name`) is a
    number in [-2, 2] (0: off), the range of OpenAI's API and vLLM."""
    if not (_is_number(value) and -2.0 <= value <= 2.0):  # type: ignore[operator]
        raise ValueError(f"{name} must be a number in [-2, 2] (0: off), got {value!r}")


def check_temperature(temperature: object) -> None:
    """Raise unless `temperature` is a number >= 0."""
    if not (
        isinstance(temperature, numbers.Real)
        and not isinstance(temperature, bool)
        and temperature >= 0.0
    ):
        raise ValueError(f"temperature must be a number >= 0 (0 is greedy), got {temperature!r}")


def penalties_on(repetition_penalty: Any, presence_penalty: Any, frequency_penalty: Any) -> bool:
    """Whether any of the three (scalar) penalties is on (`1`, `0`, `0` are off)."""
    return repetition_penalty != 1 or presence_penalty != 0 or frequency_penalty != 0


def _plain(x: Any) -> Any:
    """A NumPy scalar (`np.int64(3)`, `np.float32(0.7)`, a config's value) as the Python
    number it holds; anything else unchanged. The settings are static in the compiled
    program: a NumPy scalar would be traced there as an array."""
    return x.item() if isinstance(x, np.generic) else x


def _stop_ids(eos_id: object) -> tuple[int, ...]:
    """`eos_id` as a tuple of ids: `None` -> `()`, `2` -> `(2,)`, `[2, 7]` -> `(2, 7)`
    (a NumPy scalar or 1-D array of ids too)."""
    if isinstance(eos_id, np.ndarray) and eos_id.ndim <= 1:
        eos_id = eos_id.tolist()
    if eos_id is None:
        return ()
    ids = (eos_id,) if not isinstance(eos_id, Sequence) else tuple(eos_id)
    for i in ids:
        if not (_is_int(i) and i >= 0):  # type: ignore[operator]
            raise ValueError(
                f"eos_id must be a non-negative int or a sequence of them, got {eos_id!r}"
            )
    return tuple(int(i) for i in ids)


class SamplingOptions(eqx.Module):
    """Settings of `generate` / `generate_batch` (their keyword arguments), validated once.

    - `max_new_tokens`: number of tokens to sample (a positive int).
    - `temperature`: 0 means greedy; otherwise logits are divided by it.
    - `top_k`, `top_p`, `min_p`: optional filters (a positive int; a number in (0, 1];
      a number in [0, 1], 0 being off), applied after the temperature in that order, as
      Hugging Face's `generate` applies its warpers (`filter_logits`). Top-p keeps
      every token tied with its boundary token, where Hugging Face and vLLM cut ties by
      sorted position; min-p keeps `p_v >= min_p · max_u p_u`.
    - `repetition_penalty` (a number > 0, 1 off), `presence_penalty` and
      `frequency_penalty` (numbers in [-2, 2], 0 off): penalties of the tokens already
      seen, applied to the raw logits before the temperature and the filters
      (`penalize_logits`): a token of the row's context (the prompt's real tokens and
      the tokens generated so far) has its logit `l` divided by `repetition_penalty`
      where `l > 0`, multiplied by it otherwise (CTRL, Keskar et al. 2019, as Hugging
      Face's `RepetitionPenaltyLogitsProcessor` and vLLM apply it); a token generated
      `c` times loses `frequency_penalty · c + presence_penalty · [c > 0]` (OpenAI's
      API, vLLM). Greedy takes the argmax of the penalised logits. When on, each row
      carries `[vocab_size]` counts of its context through the decode loop; all off
      (the defaults) is the program without them.
    - `eos_id`: a stop id, several stop ids (`[2, 13]`) or `None`; a row stops at the
      first of them, which is kept in its completion.
    - `pad_id`: fills rows after they stop.
    - `check_ids`: also check prompt ids against the vocabulary inside the compiled
      program (`eqx.error_if`), for prompts that are traced (under the caller's `jit`
      or `vmap`); concrete prompts are always checked on the host.
    - `num_samples`: completions per prompt (a positive int). Each prompt is run
      through the model once and its cache copied to its `num_samples` rows (GRPO's
      groups): the output has `B · num_samples` rows, those of prompt `i` at
      `i · num_samples …`, identical to passing every prompt repeated `num_samples`
      times.

    NumPy scalars (`np.int64(64)`, `np.float32(0.7)`) are taken as the Python numbers
    they hold, and `eos_id` may be a 1-D NumPy array of ids.
    """

    max_new_tokens: Any = eqx.field(converter=_plain)
    temperature: float | int = eqx.field(default=DEFAULT_TEMPERATURE, converter=_plain)
    top_k: Any = eqx.field(default=None, converter=_plain)
    top_p: float | int | None = eqx.field(default=None, converter=_plain)
    min_p: float | int | None = eqx.field(default=None, converter=_plain)
    repetition_penalty: float | int = eqx.field(default=1.0, converter=_plain)
    presence_penalty: float | int = eqx.field(default=0.0, converter=_plain)
    frequency_penalty: float | int = eqx.field(default=0.0, converter=_plain)
    eos_id: tuple[int, ...] = eqx.field(default=(), converter=_stop_ids)
    pad_id: int = eqx.field(default=0, converter=_plain)
    check_ids: bool = eqx.field(default=False, converter=_plain)
    num_samples: int = eqx.field(default=1, converter=_plain)

    def __check_init__(self):
        if not (_is_int(self.num_samples) and self.num_samples > 0):
            raise ValueError(f"num_samples must be a positive int, got {self.num_samples!r}")
        if not (_is_int(self.max_new_tokens) and self.max_new_tokens > 0):
            raise ValueError(f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        check_temperature(self.temperature)
        check_top_k(self.top_k)
        check_top_p(self.top_p)
        check_min_p(self.min_p)
        check_repetition_penalty(self.repetition_penalty)
        check_penalty("presence_penalty", self.presence_penalty)
        check_penalty("frequency_penalty", self.frequency_penalty)
        if not _is_int(self.pad_id):
            raise ValueError(f"pad_id must be an int, got {self.pad_id!r}")

    @property
    def penalized(self) -> bool:
        """Whether a penalty is on (the decode loop then carries each row's counts)."""
        return penalties_on(self.repetition_penalty, self.presence_penalty, self.frequency_penalty)


class GenerationOutput(eqx.Module):
    """Prompt + completion of one sequence (a leading batch axis under `generate_batch`).

    - `tokens`: prompt followed by `max_new_tokens` sampled ids (`pad_id` after EOS).
    - `mask`: real tokens (the prompt's real tokens, then completion tokens up to and
      including EOS).
    - `completion_mask`: the completion's real tokens.
    - `logprobs`: log-probability of each sampled token under the model's distribution
      at the sampling temperature (`logits / temperature`, before top-k / top-p /
      min-p filtering and before the repetition / presence / frequency penalties;
      temperature 1 for greedy), 0 elsewhere: the policy's own distribution, the one
      RL steps train on (the penalties and filters only change which token is drawn).
      It matches `token_logprobs(policy, tokens, mask, temperature=...)`.

    **A broken model.** No sampler stops on non-finite logits (the loop has no host
    round trip): a step whose logits hold a NaN or `+inf`, or are all `-inf`, gives its
    row a non-finite `logprobs` entry (NaN, or `-inf`) at the token it wrote, and that
    token means nothing. Finite logits give finite log-probs, so
    `jnp.isfinite(out.logprobs).all()` tells whether every sampled token came from a
    usable distribution (the train steps skip a non-finite loss).
    """

    tokens: Int[Array, "*B T"]
    mask: Bool[Array, "*B T"]
    completion_mask: Bool[Array, "*B T"]
    logprobs: Float[Array, "*B T"]
