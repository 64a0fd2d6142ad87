r"""Knowledge-distillation steps: GKD on given completions, and on-policy distillation.

- `make_distill_step` (Agarwal et al. 2024, GKD; TRL `GKDTrainer`): the student is trained
  on the full-vocabulary generalised Jensen-Shannon divergence to a teacher at every
  completion position of a `DistillBatch`. The completions may come from a dataset
  (supervised KD) or from the student itself (on-policy GKD: GKD's `lmbda` is the fraction
  of batches the caller samples from the student).
- `make_onpolicy_distill_step` (Gu et al. 2024, MiniLLM; Thinking Machines, "On-Policy
  Distillation", 2025): the batch holds the student's own samples and each sampled token
  is rewarded with the negative per-token reverse KL to the teacher, trained with a
  policy gradient.

The teacher is a keyword argument of the step (`teacher=`), never differentiated, like
the reference model of the DPO step; it may differ from the student in size (width,
depth, heads) but must share its vocabulary (a `ValueError` naming both sizes
otherwise, raised when the step is first called).
"""

from collections.abc import Callable
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray, PyTree

from .._batches import _validate
from ..data._errors import DataError
from ..losses import (
    AggregationMode,
    aggregate_parts,
    generalized_jsd,
    ppo_policy_loss,
    reverse_kl_reward,
)
from ..models import AbstractDecoder, AbstractSelectiveLM, Policy
from ..ops import logprobs_from_logits, masked_sum, previous_real_index
from ._accumulate import vmap_model
from ._state import combine
from ._step import LossFn, NonFinite, Step, make_step
from ._validate import check_aggregation, check_number, check_positive_int

# Head chunks unrolled up to this many (a scan beyond), as in `Policy.selected_logprobs`.
_UNROLLED_CHUNKS = 16
# Bound on |log ratio| before exponentiating the importance ratio (as veRL and `ppo_policy_loss`).
_LOG_RATIO_CLAMP = 20.0


def _is_array(x: object) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


class DistillBatch(eqx.Module):
    """Sequences (prompt + completion) on which a student is distilled from a teacher.

    - `tokens`, `mask`, `completion_mask`: `[B, T]` ids, real tokens, and the completion
      tokens the loss is taken on (as `SequenceBatch`; from a dataset, or a student's
      `generate_batch` output).
    - `teacher_logits`: `[B, T, V]` cached teacher logits, aligned with the model's
      output (`teacher_logits[b, s]` predicts the token after position `s`); `None`
      (default): the GKD step runs its `teacher=` model. Only `make_distill_step` reads it.
    - `old_logp`: `[B, T]` log-probabilities of the tokens under the student when they
      were sampled (`GenerationOutput.logprobs`); `None`: on-policy, the current student
      (importance ratio 1). Only `make_onpolicy_distill_step` reads it.
    - `teacher_logp`: `[B, T]` cached teacher log-probabilities of the tokens; `None`: the
      on-policy step runs its `teacher=` model. Only `make_onpolicy_distill_step` reads it.

    Shapes and dtypes are checked at construction (a `DataError` names the field).
    """

    tokens: Int[Array, "B T"]
    mask: Bool[Array, "B T"]
    completion_mask: Bool[Array, "B T"]
    teacher_logits: Float[Array, "B T V"] | None = None
    old_logp: Float[Array, "B T"] | None = None
    teacher_logp: Float[Array, "B T"] | None = None

    def __check_init__(self):
        _validate(self, ("tokens",), ("mask", "completion_mask"))
        shape = tuple(self.tokens.shape) if _is_array(self.tokens) else None
        for name in ("teacher_logits", "old_logp", "teacher_logp"):
            x = getattr(self, name)
            if not _is_array(x):
                continue
            if not np.issubdtype(np.dtype(x.dtype), np.floating):
                raise DataError(f"DistillBatch.{name} must be floating point, got dtype {x.dtype}")
            got = tuple(x.shape)
            if name == "teacher_logits":
                ok = len(got) == 3 and (shape is None or got[:2] == shape)
                want = "[B, T, V]"
            else:
                ok = len(got) == 2 and (shape is None or got == shape)
                want = "[B, T]"
            if not ok:
                raise DataError(
                    f"DistillBatch.{name} has shape {got}; expected {want} with "
                    f"[B, T] = {shape} (the shape of DistillBatch.tokens)"
                )


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

    def scored(args):
        hs, ht, start = args
        ls = student.head(hs)
        lt = jax.lax.stop_gradient(teacher.head(ht))
        return generalized_jsd(ls, lt, start + offsets < count, beta=beta, temperature=temperature)

    def skipped(args):
        return jnp.zeros((c,), jnp.float32)

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


def _loss_mask(batch: DistillBatch) -> tuple[Bool[Array, "B T"], Int[Array, "B T"]]:
    """Completion tokens that have a real token before them (so a prediction), and for each
    position the index of that earlier token."""
    prev, has_prev = jax.vmap(previous_real_index)(batch.mask)
    return batch.completion_mask & batch.mask & has_prev, prev


def distill_loss(
    *,
    beta: float | Float[Array, ""] = 0.5,
    temperature: float | Float[Array, ""] = 1.0,
    mode: AggregationMode = "token-mean",
    constant: float | None = None,
    chunk: int = 512,
) -> LossFn:
    r"""The GKD loss function for `make_step` on a `DistillBatch`:
    $\mathrm{aggregate}_{\rm mode}\big(\mathrm{JSD}_\beta(\pi_{\rm teacher} \,\|\,
    \pi_\theta)\big)$ over the completion tokens (`generalized_jsd` of the distributions
    that predict them). `frozen` is `(frozen_part_of_the_student, teacher_model)`; the
    teacher is not needed when `batch.teacher_logits` is given (which then takes
    precedence).

    Metrics: `jsd` (token mean), `num_tokens` (per batch).
    """
    check_number("beta", beta, low=0.0, high=1.0)
    check_number("temperature", temperature, low=0.0, low_open=True)
    check_aggregation(mode, constant)
    check_positive_int("chunk", chunk)
    sg = jax.lax.stop_gradient
    f32 = jnp.float32

    def loss_fn(params: PyTree, frozen: PyTree, batch: DistillBatch, key: PRNGKeyArray | None):
        frozen_part, teacher = frozen
        if batch.teacher_logits is None and teacher is None:
            raise ValueError(
                "make_distill_step needs the step's `teacher=` model or batch.teacher_logits"
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


def make_distill_step(
    optimizer: optax.GradientTransformation,
    *,
    beta: float | Float[Array, ""] = 0.5,
    temperature: float | Float[Array, ""] = 1.0,
    mode: AggregationMode = "token-mean",
    constant: float | None = None,
    chunk: int = 512,
    micro_batches: int = 1,
    axis_name: str | None = None,
    donate: bool | None = None,
    nonfinite: NonFinite = "skip",
    check_token_ids: int | None = None,
) -> Step:
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

    - `optimizer`: e.g. from `make_optimizer`.
    - `beta`: $\beta \in [0, 1]$ (TRL GKD default 0.5); `temperature`: $\tau > 0$.
    - `mode`, `constant`: aggregation (see `rlhf_eqx.losses.aggregate_parts`).
    - `chunk`: positions per head chunk (a positive int).
    - `micro_batches`, `axis_name`, `donate`, `nonfinite`, `check_token_ids`: see
      `make_step` (every aggregation mode is exact across micro-batches and devices).

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
    return make_step(
        distill_loss(beta=beta, temperature=temperature, mode=mode, constant=constant, chunk=chunk),
        optimizer,
        micro_batches=micro_batches,
        axis_name=axis_name,
        donate=donate,
        nonfinite=nonfinite,
        check_token_ids=check_token_ids,
        batch_type=DistillBatch,
        extras=("teacher",),
    )


def _token_logps(
    model: Callable[..., Array],
    batch: DistillBatch,
    select: Bool[Array, "B T"],
    key: PRNGKeyArray | None,
    temperature: float,
) -> Float[Array, "B T"]:
    """Log-probabilities of the selected tokens (an `AbstractSelectiveLM` runs its LM head
    only there; any other model returns full logits). Other positions are never read."""
    if isinstance(model, AbstractSelectiveLM):
        out = model.selected_logprobs(
            batch.tokens, batch.mask, select, key=key, temperature=temperature
        )
        return out[0]
    logits = vmap_model(model, batch.tokens, batch.mask, key)
    return jax.vmap(lambda lg, t, mk: logprobs_from_logits(lg, t, mk, temperature=temperature))(
        logits, batch.tokens, batch.mask
    )


def onpolicy_distill_loss(
    *,
    kl_coef: float | Float[Array, ""] = 1.0,
    clip_eps: float | None = None,
    mode: AggregationMode = "token-mean",
    constant: float | None = None,
    temperature: float = 1.0,
) -> LossFn:
    r"""The on-policy distillation loss function for `make_step` on a `DistillBatch` of
    student samples; `frozen` is `(frozen_part_of_the_student, teacher_model)` (the
    teacher is not needed when `batch.teacher_logp` is given, which then takes
    precedence). See `make_onpolicy_distill_step` for the formula.

    Metrics: `reverse_kl` (token mean of $\log\pi_{\rm old} - \log\pi_{\rm teacher}$ on
    the sampled tokens), `teacher_logp` (token mean), `num_tokens` (per batch), and
    `clipfrac` with `clip_eps`.
    """
    check_number("kl_coef", kl_coef, low=0.0)
    check_number("clip_eps", clip_eps, low=0.0, low_open=True, allow_none=True)
    check_aggregation(mode, constant)
    check_number("temperature", temperature, low=0.0, low_open=True)
    if not isinstance(temperature, int | float):
        raise ValueError(f"temperature must be a Python number here, got {temperature!r}")
    sg = jax.lax.stop_gradient
    f32 = jnp.float32

    def loss_fn(params: PyTree, frozen: PyTree, batch: DistillBatch, key: PRNGKeyArray | None):
        frozen_part, teacher = frozen
        if batch.teacher_logp is None and teacher is None:
            raise ValueError(
                "make_onpolicy_distill_step needs the step's `teacher=` model or batch.teacher_logp"
            )
        student = combine(params, frozen_part)
        m, _ = _loss_mask(batch)
        if batch.teacher_logp is not None:
            teacher_logp = batch.teacher_logp
        else:
            _check_vocab(
                _vocab_size(student, batch.tokens, batch.mask),
                _vocab_size(teacher, batch.tokens, batch.mask),
            )
            teacher_logp = _token_logps(teacher, batch, m, None, temperature)
        teacher_logp = sg(teacher_logp.astype(f32))
        logp = _token_logps(student, batch, m, key, temperature).astype(f32)
        old_logp = sg(logp) if batch.old_logp is None else sg(batch.old_logp.astype(f32))
        reward = jax.vmap(reverse_kl_reward)(old_logp, teacher_logp, m)
        adv = kl_coef * reward
        n = jnp.sum(m).astype(f32)
        metrics = {}
        if clip_eps is None:
            log_ratio = jnp.clip(
                jnp.where(m, logp - old_logp, 0.0), -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP
            )
            per_token = jnp.where(m, -jnp.exp(log_ratio) * adv, 0.0)
        else:
            per_token, stats = jax.vmap(
                lambda a, b, c, d: ppo_policy_loss(a, b, c, d, clip_eps=clip_eps)
            )(logp, old_logp, adv, m)
            metrics["clipfrac"] = (masked_sum(stats["clipped"].astype(f32), m), n)
        num, den = aggregate_parts(per_token, m, mode=mode, constant=constant)
        metrics.update(
            {
                "reverse_kl": (masked_sum(-reward, m), n),
                "teacher_logp": (masked_sum(teacher_logp, m), n),
                "num_tokens": (n, jnp.zeros((), f32)),  # a total
            }
        )
        return {"distill": num}, {"distill": den}, metrics

    return loss_fn


def make_onpolicy_distill_step(
    optimizer: optax.GradientTransformation,
    *,
    kl_coef: float | Float[Array, ""] = 1.0,
    clip_eps: float | None = None,
    mode: AggregationMode = "token-mean",
    constant: float | None = None,
    temperature: float = 1.0,
    micro_batches: int = 1,
    axis_name: str | None = None,
    donate: bool | None = None,
    nonfinite: NonFinite = "skip",
    check_token_ids: int | None = None,
) -> Step:
    r"""Build the on-policy distillation update: a per-token reverse-KL policy gradient.

    The batch holds completions sampled from the student (`generate_batch`; `old_logp`
    their sampling log-probabilities, or `None` when the current student sampled them).
    Each sampled token $y_t$ gets the detached advantage

    $$A_t = -\beta_{\rm KL}\big(\log\pi_{\rm old}(y_t \mid y_{<t})
      - \log\pi_{\rm teacher}(y_t \mid y_{<t})\big)$$

    (`rlhf_eqx.losses.reverse_kl_reward`, no discounting across tokens) and the loss is
    the importance-sampled policy gradient

    $$\ell_t = -\rho_t A_t, \qquad \rho_t = \exp\big(\log\pi_\theta(y_t \mid y_{<t})
      - \log\pi_{\rm old}(y_t \mid y_{<t})\big),$$

    aggregated over the completion tokens (Thinking Machines, "On-Policy Distillation",
    2025, with Tinker's `importance_sampling` loss; Gu et al. 2024, MiniLLM, single-step
    term). On-policy ($\rho_t = 1$) its gradient is $\beta_{\rm KL}\,\nabla_\theta
    \log\pi_\theta(y_t)\,(\log\pi_\theta(y_t) - \log\pi_{\rm teacher}(y_t))$, whose
    expectation over $y_t \sim \pi_\theta(\cdot \mid y_{<t})$ is exactly $\beta_{\rm KL}
    \nabla_\theta \mathrm{KL}(\pi_\theta \,\|\, \pi_{\rm teacher})$ at that prefix: the
    policy-gradient (score-function) form of the per-token reverse-KL gradient, which
    needs only the teacher's log-probabilities of the sampled tokens. (The exact
    full-vocabulary gradient is `make_distill_step(beta=1.0)` on the same batch.) The
    log-ratio is clamped to $[-20, 20]$; `clip_eps` replaces the surrogate by PPO's
    clipped one (`ppo_policy_loss`).

    **Arguments:**

    - `optimizer`: e.g. from `make_optimizer`.
    - `kl_coef`: $\beta_{\rm KL} \geq 0$ (Thinking Machines' `kl_penalty_coef`, 1).
    - `clip_eps`: `None` (default) for the plain importance-sampling loss, or PPO's
      $\varepsilon$.
    - `mode`, `constant`: aggregation (see `rlhf_eqx.losses.aggregate_parts`).
    - `temperature`: the sampling temperature; both log-probabilities are taken of
      `logits / temperature`.
    - `micro_batches`, `axis_name`, `donate`, `nonfinite`, `check_token_ids`: see
      `make_step`.

    **Returns:**

    ```python
    step(params, opt_state, batch: DistillBatch, *, frozen=None, teacher=None, key=None)
        -> (params, opt_state, metrics)
    ```

    one `eqx.filter_jit` region; the teacher's log-probabilities come from
    `batch.teacher_logp` or from `teacher=` (never differentiated; a vocabulary that
    differs from the student's raises `ValueError` when the step is first called).
    Metrics: `loss`, `reverse_kl` (per-token estimate, token mean), `teacher_logp`,
    `num_tokens`, `clipfrac` (with `clip_eps`), `grad_norm`, `learning_rate`, `nonfinite`.
    """
    return make_step(
        onpolicy_distill_loss(
            kl_coef=kl_coef,
            clip_eps=clip_eps,
            mode=mode,
            constant=constant,
            temperature=temperature,
        ),
        optimizer,
        micro_batches=micro_batches,
        axis_name=axis_name,
        donate=donate,
        nonfinite=nonfinite,
        check_token_ids=check_token_ids,
        batch_type=DistillBatch,
        extras=("teacher",),
    )
