r"""Knowledge-distillation steps: GKD on given completions, and on-policy distillation.

- `make_distill_step` (Agarwal et al. 2024, GKD; TRL `GKDTrainer`): the student is trained
  on the full-vocabulary generalised Jensen-Shannon divergence to a teacher at every
  completion position of a `DistillBatch`. The completions may come from a dataset
  (supervised KD) or from the student itself (on-policy GKD: GKD's `lmbda` is the fraction
  of batches the caller samples from the student).
- `make_onpolicy_distill_step` (in `_onpolicy_distill.py`; Gu et al. 2024, MiniLLM;
  Thinking Machines, "On-Policy Distillation", 2025): the batch holds the student's own
  samples and each sampled token is rewarded with the negative per-token reverse KL to
  the teacher, trained with a policy gradient.

The teacher is a keyword argument of the step (`teacher=`), never differentiated, like
the reference model of the DPO step; it may differ from the student in size (width,
depth, heads) but must share its vocabulary (a `ValueError` naming both sizes
otherwise, raised when the step is first called).
"""

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray, PyTree

from .._sampling import DEFAULT_TEMPERATURE
from ..data import DistillBatch
from ..losses import aggregate_parts, generalized_jsd
from ..losses.defaults import DISTILL_BETA
from ..models import AbstractDecoder, Policy
from ..ops import masked_sum, previous_real_index
from ._accumulate import vmap_model
from ._builder import step_builder
from ._settings import StepOptions, settings_from
from ._state import combine
from ._step import LossFn, Step, make_step, vary_over, varying_axes
from ._validation import check_aggregation, check_number, check_positive_int

# Head chunks unrolled up to this many (a scan beyond), as in `Policy.selected_logprobs`.
_UNROLLED_CHUNKS = 16


# --- what both distillation steps share --------------------------------------------------


def _check_vocab(student: int, teacher: int) -> None:
    if student != teacher:
        raise ValueError(
            f"teacher vocab_size={teacher} differs from student vocab_size={student}: "
            "distillation compares next-token distributions over one shared vocabulary "
            "(use a teacher with the student's tokenizer)"
        )


def _vocab_size(model: Callable[..., Array], tokens: Array, mask: Array) -> int:
    """The size of `model`'s output distribution (from its shape only: nothing runs)."""
    if isinstance(model, AbstractDecoder):
        return int(model.vocab_size)
    out = eqx.filter_eval_shape(vmap_model, model, tokens[:1], mask[:1], None)
    return int(out.shape[-1])


def _check_reference_vocab(
    policy: Callable[..., Array],
    reference: Callable[..., Array],
    tokens: Array,
    mask: Array,
    where: str,
) -> None:
    """Refuse (at trace time) a reference model whose vocabulary differs from the
    policy's: it would score the policy's token ids against other tokens (an id past
    its vocabulary is clamped by the gather, silently)."""
    mine, theirs = _vocab_size(policy, tokens, mask), _vocab_size(reference, tokens, mask)
    if mine != theirs:
        raise ValueError(
            f"{where}: the reference model's vocab_size={theirs} differs from the policy's "
            f"vocab_size={mine}: the reference scores the policy's token ids (use a "
            "reference with the policy's tokenizer, e.g. a frozen copy of the initial policy)"
        )


def _split_teacher(frozen: PyTree, cached: Array | None, where: str, field: str):
    """`(frozen_part_of_the_student, teacher)` from a step's `frozen`; the teacher may be
    `None` only when the batch holds its output (`cached`, the batch's `field`)."""
    frozen_part, teacher = frozen
    if cached is None and teacher is None:
        raise ValueError(f"{where} needs the step's `teacher=` model or batch.{field}")
    return frozen_part, teacher


def _distill_step(loss_fn: LossFn, optimizer, options: StepOptions, cache_key) -> Step:
    """`make_step` of a distillation loss: on a `DistillBatch`, with the teacher passed to
    the step as `teacher=`."""
    return make_step(
        loss_fn,
        optimizer,
        options,
        batch_type=DistillBatch,
        extras=("teacher",),
        cache_key=cache_key,
    )


def _loss_mask(batch: DistillBatch) -> tuple[Bool[Array, "B T"], Int[Array, "B T"]]:
    """Completion tokens that have a real token before them (so a prediction), and for each
    position the index of that earlier token."""
    prev, has_prev = jax.vmap(previous_real_index)(batch.mask)
    return batch.completion_mask & batch.mask & has_prev, prev


# --- GKD ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillSettings:
    r"""Generalised knowledge distillation (`make_distill_step`; Agarwal et al. 2024, TRL
    `GKDTrainer` defaults).

    - `beta`: $\beta \in [0, 1]$, the JSD's interpolation (0: forward KL, 1: reverse KL;
      may be a JAX array).
    - `temperature`: $\tau > 0$ dividing both logits in the divergence (may be a JAX
      array). Its default is `rlhf_eqx.DEFAULT_TEMPERATURE` (1.0), as TRL's `GKDTrainer`
      computes its loss; the temperature completions are sampled at is the caller's.
    - `mode`, `constant`: aggregation over the completion tokens (`aggregate_parts`).
    - `chunk`: positions per head chunk (a positive int).

    Validated when built (see `DPOSettings`): one `ValueError` line naming the field.
    """

    beta: float | Float[Array, ""] = DISTILL_BETA
    temperature: float | Float[Array, ""] = DEFAULT_TEMPERATURE
    mode: str = "token-mean"
    constant: float | None = None
    chunk: int = 512

    def __post_init__(self):
        check_number("beta", self.beta, low=0.0, high=1.0)
        check_number("temperature", self.temperature, low=0.0, low_open=True)
        check_aggregation(self.mode, self.constant)
        check_positive_int("chunk", self.chunk)


class _Scorer(NamedTuple):
    """A model's per-position `features [B, T, F]` and the `head` that maps gathered
    features `[C, F]` to next-token logits `[C, V]`."""

    features: Array
    head: Callable[[Array], Array]
    vocab_size: int


def _identity(x: Array) -> Array:
    return x


def _scorer(model: Callable[..., Array], tokens: Array, mask: Array, key: PRNGKeyArray | None):
    """A `Policy` returns its final hidden states and applies its LM head later, only at
    the positions that predict completion tokens; any other model returns full logits."""
    if isinstance(model, Policy):
        h = model.transformer(tokens, mask, key=key)
        return _Scorer(h, model.logits_from_hidden, model.vocab_size)
    logits = vmap_model(model, tokens, mask, key)
    return _Scorer(logits, _identity, int(logits.shape[-1]))


def _chunked_jsd(
    student: _Scorer,
    teacher: _Scorer,
    valid: Bool[Array, "B T"],
    prev: Int[Array, "B T"],
    *,
    beta,
    temperature,
    chunk: int,
) -> Float[Array, "B T"]:
    """`generalized_jsd` of the distributions that predict each `valid` token, at that token.

    The positions predicting valid tokens are gathered (all rows together, valid first)
    and scored in chunks of `chunk`; a chunk without a valid position is skipped
    (`jax.lax.cond`, forward and backward), so the heads and the vocabulary-wide work run
    on the completion positions only. Returns 0 at the other positions.
    """
    B, T = valid.shape
    N = B * T
    c = min(chunk, N)
    n_chunks = -(-N // c)
    flat_valid = valid.reshape(N)
    rows = jnp.arange(N, dtype=jnp.int32) // T
    src = rows * T + prev.reshape(N).astype(jnp.int32)
    order = jnp.argsort(~flat_valid, stable=True)
    padded = jnp.concatenate([order, jnp.zeros((n_chunks * c - N,), order.dtype)])
    idx = src[padded].reshape(n_chunks, c)
    fs = student.features.reshape(N, -1)[idx]
    ft = teacher.features.reshape(N, -1)[idx]
    count = jnp.sum(flat_valid, dtype=jnp.int32)
    starts = jnp.arange(n_chunks, dtype=jnp.int32) * c
    offsets = jnp.arange(c, dtype=jnp.int32)
    # Under `jax.shard_map` (check_vma) every value in a chunk's branches varies over the
    # device axes the rows (or the heads' weights) vary over: the heads' weights are cast
    # before the conditional and a skipped chunk's zeros have a scored chunk's type.
    axes = varying_axes((fs, ft, count, student.head, teacher.head))
    student_head, teacher_head = vary_over((student.head, teacher.head), axes)

    def scored(args):
        hs, ht, start = args
        ls = student_head(hs)
        lt = jax.lax.stop_gradient(teacher_head(ht))
        jsd = generalized_jsd(ls, lt, start + offsets < count, beta=beta, temperature=temperature)
        return vary_over(jsd.astype(jnp.float32), axes)

    def skipped(args):
        return vary_over(jnp.zeros((c,), jnp.float32), axes)

    # As in `Policy.selected_logprobs`: across processes no collective may run inside a
    # conditional, so there every chunk is scored.
    skip_empty = jax.process_count() == 1

    def one(hs, ht, start):
        if not skip_empty:
            return scored((hs, ht, start))
        return jax.lax.cond(start < count, scored, skipped, (hs, ht, start))

    if n_chunks <= _UNROLLED_CHUNKS:
        vals = jnp.stack([one(fs[i], ft[i], starts[i]) for i in range(n_chunks)])
    else:
        _, vals = jax.lax.scan(lambda _, xs: (None, one(*xs)), None, (fs, ft, starts))
    flat = jnp.zeros((N,), jnp.float32).at[order].set(vals.reshape(-1)[:N])
    return jnp.where(valid, flat.reshape(B, T), 0.0)


def distill_loss(settings: DistillSettings | None = None, **shortcuts: Any) -> LossFn:
    r"""The GKD loss function for `make_step` on a `DistillBatch`:
    $\mathrm{aggregate}_{\rm mode}\big(\mathrm{JSD}_\beta(\pi_{\rm teacher} \,\|\,
    \pi_\theta)\big)$ over the completion tokens (`generalized_jsd` of the distributions
    that predict them), with `settings` (a `DistillSettings`, or its fields as keywords).
    `frozen` is `(frozen_part_of_the_student, teacher_model)`; the teacher is not needed
    when `batch.teacher_logits` is given (which then takes precedence).

    Metrics: `jsd` (token mean), `num_tokens` (per batch).
    """
    s = settings_from(DistillSettings, settings, shortcuts, where="distill_loss")
    beta, temperature, mode, constant, chunk = s.beta, s.temperature, s.mode, s.constant, s.chunk
    sg = jax.lax.stop_gradient
    f32 = jnp.float32

    def loss_fn(params: PyTree, frozen: PyTree, batch: DistillBatch, key: PRNGKeyArray | None):
        frozen_part, teacher = _split_teacher(
            frozen, batch.teacher_logits, "make_distill_step", "teacher_logits"
        )
        student = _scorer(combine(params, frozen_part), batch.tokens, batch.mask, key)
        if batch.teacher_logits is not None:
            lg = sg(batch.teacher_logits)
            t = _Scorer(lg, _identity, int(lg.shape[-1]))
        else:
            t = _scorer(teacher, batch.tokens, batch.mask, None)
            t = t._replace(features=sg(t.features))
        _check_vocab(student.vocab_size, t.vocab_size)
        m, prev = _loss_mask(batch)
        per_token = _chunked_jsd(
            student, t, m, prev, beta=beta, temperature=temperature, chunk=chunk
        )
        num, den = aggregate_parts(per_token, m, mode=mode, constant=constant)
        n = jnp.sum(m).astype(f32)
        metrics = {
            "jsd": (masked_sum(per_token, m), n),
            "num_tokens": (n, jnp.zeros((), f32)),  # a total
        }
        return {"distill": num}, {"distill": den}, metrics

    return loss_fn


@step_builder(DistillSettings)
def make_distill_step(optimizer, settings: DistillSettings, options: StepOptions) -> Step:
    r"""Build the generalised knowledge-distillation update (GKD; TRL `GKDTrainer`).

    $$\mathcal{L}(\theta) = \mathrm{aggregate}_{\rm mode}\Big(
      \mathrm{JSD}_\beta\big(\pi_{\rm teacher}(\cdot \mid y_{<t}) \,\big\|\,
      \pi_\theta(\cdot \mid y_{<t})\big)\Big)$$

    over the completion tokens $y_t$ of a `DistillBatch`, both distributions at
    temperature $\tau$ (Agarwal et al. 2024, "On-Policy Distillation of Language Models:
    Learning from Self-Generated Mistakes"; `rlhf_eqx.losses.generalized_jsd`).
    $\beta = 0$ is the forward KL $\mathrm{KL}(\pi_{\rm teacher}\|\pi_\theta)$ (classic
    word-level KD), $\beta = 1$ the reverse KL $\mathrm{KL}(\pi_\theta\|\pi_{\rm teacher})$;
    with the default `"token-mean"` the loss is TRL's `batchmean` over the completion
    tokens. On the student's own samples ($\lambda = 1$ in GKD) and $\beta = 1$ this is
    on-policy distillation with the exact (full-vocabulary) reverse-KL gradient at each
    sampled prefix; `make_onpolicy_distill_step` is its single-sample policy-gradient form.

    The teacher runs inside the step on the same tokens (or its logits come cached in
    `batch.teacher_logits`) and is never differentiated. With a `Policy` student (and
    teacher), the LM heads and the vocabulary-wide divergence run only on the positions
    that predict completion tokens, in chunks of `chunk` positions (chunks without one
    are skipped); any other model `(tokens, mask) -> logits [T, V]` works too, with its
    full logits.

    **Arguments:**

    - `settings`: a `DistillSettings` with the fields below.
    - `beta`: $\beta \in [0, 1]$ (TRL GKD default 0.5); `temperature`: $\tau > 0$
      dividing both logits in the divergence (default 1, as TRL's `GKDTrainer` computes
      its loss; its `GKDConfig.temperature`, 0.9, is the temperature completions are
      sampled at, the `distill` stage's `distill.temperature`). Both may be JAX arrays
      (traced: a new value runs the same compiled step).
    - `mode`, `constant`: aggregation (see `rlhf_eqx.losses.aggregate_parts`).
    - `chunk`: positions per head chunk (a positive int).
    - `optimizer`, `options` (a `StepOptions`; every aggregation mode is exact across
      micro-batches and devices) and `**shortcuts` (`beta=0.2`, `micro_batches=2`): see
      `step_builder`.

    Invalid choices and out-of-range numbers raise `ValueError` when the record is built.

    **Returns:**

    ```python
    step(params, opt_state, batch: DistillBatch, *, frozen=None, teacher=None, key=None)
        -> (params, opt_state, metrics)
    ```

    one `eqx.filter_jit` region; `key` (optional) is the student's dropout key. A teacher
    whose vocabulary differs from the student's raises `ValueError("teacher
    vocab_size=... differs from student vocab_size=...")` when the step is first called.
    Metrics: `loss`, `jsd` (token mean over the completion tokens), `num_tokens` (of the
    global batch), `grad_norm`, `learning_rate`, `nonfinite`.
    """
    return _distill_step(distill_loss(settings), optimizer, options, ("distill", settings))
