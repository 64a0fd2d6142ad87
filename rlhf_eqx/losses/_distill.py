r"""Knowledge distillation: the generalised Jensen-Shannon divergence of GKD and the per-token
reverse-KL reward of on-policy distillation.

With $P = \pi_{\rm teacher}(\cdot \mid y_{<t})$ and $Q = \pi_{\rm student}(\cdot \mid y_{<t})$
the next-token distributions at one position:

- GKD (Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
  Self-Generated Mistakes", eq. for $D_{\rm JSD(\beta)}$; TRL `GKDTrainer`) trains on the
  full-vocabulary divergence $\mathrm{JSD}_\beta(P \,\|\, Q)$ at every completion position;
- on-policy distillation (Gu et al. 2024, MiniLLM; Thinking Machines, "On-Policy
  Distillation", 2025) samples from the student and rewards each sampled token with the
  negative per-token reverse KL $-(\log Q(y_t) - \log P(y_t))$.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .._sampling import DEFAULT_TEMPERATURE
from ._validation import (
    Hyperparameter,
    check_positive,
    check_python_number,
    is_python_number,
    wide_float_dtype,
)
from .defaults import DISTILL_BETA


def _log_softmax(
    logits: Float[Array, "T V"], mask: Bool[Array, " T"], temperature: Hyperparameter
) -> Float[Array, "T V"]:
    """Log-softmax of `logits / temperature` in float32; masked rows are replaced by 0 first,
    so that whatever they hold (even NaN or inf) reaches neither the value nor the gradient."""
    x = jnp.where(mask[:, None], logits.astype(jnp.float32), 0.0)
    if not (is_python_number(temperature) and float(temperature) == 1.0):
        x = x / jnp.asarray(temperature, jnp.float32)
    # max-shifted: entries near the maximum are exact even for logits of magnitude 1e4
    return jax.nn.log_softmax(x, axis=-1)


def _kl(log_p: Float[Array, "T V"], log_q: Float[Array, "T V"]) -> Float[Array, " T"]:
    r"""$\mathrm{KL}(p \,\|\, q) = \sum_v p_v(\log p_v - \log q_v)$ per row (finite log-probs)."""
    return jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)


def _mixture_jsd(
    log_s: Float[Array, "T V"], log_t: Float[Array, "T V"], beta: Float[Array, ""]
) -> Float[Array, " T"]:
    """`JSD_beta` for `0 < beta < 1`, the mixture's log-probabilities by a logsumexp."""
    log_m = jnp.logaddexp(log_t + jnp.log(beta), log_s + jnp.log1p(-beta))
    return beta * _kl(log_t, log_m) + (1.0 - beta) * _kl(log_s, log_m)


def generalized_jsd(
    student_logits: Float[Array, "T V"],
    teacher_logits: Float[Array, "T V"],
    mask: Bool[Array, " T"],
    *,
    beta: Hyperparameter = DISTILL_BETA,
    temperature: Hyperparameter = DEFAULT_TEMPERATURE,
) -> Float[Array, " T"]:
    r"""Per-position generalised Jensen-Shannon divergence between teacher and student.

    With $P = \mathrm{softmax}(z_{\rm teacher}/\tau)$, $Q = \mathrm{softmax}(z_{\rm student}/\tau)$
    at each position and the mixture $M_\beta = \beta P + (1-\beta) Q$,

    $$\mathrm{JSD}_\beta(P \,\|\, Q) = \beta\,\mathrm{KL}(P \,\|\, M_\beta)
      + (1-\beta)\,\mathrm{KL}(Q \,\|\, M_\beta), \qquad 0 < \beta < 1,$$

    and at the end points the divergences GKD names after them:

    $$\mathrm{JSD}_0 = \mathrm{KL}(P \,\|\, Q)\ \text{(forward KL)}, \qquad
      \mathrm{JSD}_1 = \mathrm{KL}(Q \,\|\, P)\ \text{(reverse KL)}.$$

    (Agarwal et al. 2024, GKD, section 3 and eq. 1; TRL `GKDTrainer.generalized_jsd_loss`,
    which treats $\beta \in \{0, 1\}$ the same way.) $\mathrm{JSD}_\beta$ itself tends to 0
    at both ends; the end points are its rescaled limits,
    $\lim_{\beta\to0}\mathrm{JSD}_\beta/\beta = \mathrm{KL}(P\|Q)$ and
    $\lim_{\beta\to1}\mathrm{JSD}_\beta/(1-\beta) = \mathrm{KL}(Q\|P)$, computed exactly
    (never as $0\cdot\infty$). $\mathrm{JSD}_{1/2}$ is the symmetric Jensen-Shannon
    divergence, bounded by $\ln 2$; in general $\mathrm{JSD}_\beta(P\|Q) =
    \mathrm{JSD}_{1-\beta}(Q\|P)$.

    Computed in float32 in log space: max-shifted log-softmaxes, $\log M_\beta =
    \mathrm{logaddexp}(\log P + \log\beta,\ \log Q + \log(1-\beta))$, and
    $\mathrm{KL}(p\|q) = \sum_v p_v(\log p_v - \log q_v)$, so values and gradients are
    finite for any finite logits (tested to $\pm 10^4$); no float64 and no probability
    ratio is formed.

    **Arguments:**

    - `student_logits`, `teacher_logits`: `[T, V]`, row `t` the logits of the
      distribution compared at position `t` (the same vocabulary for both).
    - `mask`: `[T]`, true on the positions that count; other rows may hold anything.
    - `beta`: $\beta \in [0, 1]$ (a Python number, checked, or a JAX scalar, possibly
      traced: then 0 and 1 select the end points with `jnp.where`).
    - `temperature`: $\tau > 0$, dividing both logits (the `temperature` of TRL's
      `GKDTrainer.generalized_jsd_loss`, which its trainer calls at the default
      $\tau = 1$; `GKDConfig.temperature`, 0.9, is TRL's *sampling* temperature).

    **Returns:** `[T]` per-position divergences, 0 where `mask` is false. Reduce a batch
    of them with `aggregate(..., mode="token-mean")` (TRL's `batchmean` over the
    completion tokens).
    """
    check_python_number("beta", beta, lambda b: 0.0 <= b <= 1.0, "in [0, 1]")
    check_positive("temperature", temperature)
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student_logits {student_logits.shape} and teacher_logits {teacher_logits.shape} "
            "differ in shape (teacher and student must share the vocabulary)"
        )
    log_s = _log_softmax(student_logits, mask, temperature)
    log_t = _log_softmax(teacher_logits, mask, temperature)
    if is_python_number(beta):
        b = float(beta)
        if b == 0.0:
            out = _kl(log_t, log_s)
        elif b == 1.0:
            out = _kl(log_s, log_t)
        else:
            out = _mixture_jsd(log_s, log_t, jnp.asarray(b, jnp.float32))
    else:
        b = jnp.asarray(beta).astype(jnp.float32)
        inside = (b > 0.0) & (b < 1.0)
        mixed = _mixture_jsd(log_s, log_t, jnp.where(inside, b, 0.5))
        out = jnp.where(b == 0.0, _kl(log_t, log_s), jnp.where(b == 1.0, _kl(log_s, log_t), mixed))
    return jnp.where(mask, out, 0.0)


def reverse_kl_reward(
    student_logp: Float[Array, " T"],
    teacher_logp: Float[Array, " T"],
    mask: Bool[Array, " T"],
) -> Float[Array, " T"]:
    r"""Per-token reward of on-policy distillation: the negative reverse-KL estimate.

    $$r_t = -\big(\log\pi_{\rm student}(y_t \mid y_{<t})
      - \log\pi_{\rm teacher}(y_t \mid y_{<t})\big)$$

    on tokens $y_t$ sampled from the student. $-r_t$ is the single-sample (k1) estimate
    of $\mathrm{KL}(\pi_{\rm student}\,\|\,\pi_{\rm teacher})$ at position $t$, unbiased
    for tokens drawn from the student; used as a per-token advantage (no discounting) it
    gives the policy-gradient form of the reverse-KL gradient (Gu et al. 2024, MiniLLM;
    Thinking Machines, "On-Policy Distillation", 2025, `advantages = -reverse_kl`).
    Treat it as a constant (`jax.lax.stop_gradient`) when it multiplies
    $\log\pi_{\rm student}$.

    **Arguments:**

    - `student_logp`: `[T]` log-probabilities of the sampled tokens under the student
      (e.g. `GenerationOutput.logprobs`).
    - `teacher_logp`: `[T]` their log-probabilities under the teacher.
    - `mask`: `[T]`, true on the sampled (completion) tokens.

    **Returns:** `[T]` rewards, 0 where `mask` is false; float32 (float64 for float64
    inputs).
    """
    # at least float32 (bfloat16 inputs are subtracted in float32), float64 kept as is
    dtype = wide_float_dtype(student_logp, teacher_logp)
    r = teacher_logp.astype(dtype) - student_logp.astype(dtype)
    return jnp.where(mask, r, 0.0)
