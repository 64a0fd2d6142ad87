r"""Off-policy rollout corrections: importance weights between the trainer's and the
sampler's log-probabilities, and the mismatch metrics that go with them.

Completions may be sampled by a policy $\mu$ (the *behaviour* policy: another inference
engine, a lower precision, or parameters one or more steps old) whose log-probabilities
differ from those of the trainer's policy $\pi_{\rm old}$ at the start of the update. With
the per-token log-ratio $r_t = \log\pi_{\rm old}(y_t) - \log\mu(y_t)$, the corrections
reweight (truncated importance sampling, TIS) or reject (masked importance sampling, MIS)
tokens or whole sequences. They follow veRL's rollout importance sampling
(`algorithm.rollout_is_level` / `rollout_is_mode` / `rollout_is_threshold` /
`rollout_is_threshold_lower`, now `algorithm.rollout_correction`;
`verl/trainer/ppo/rollout_corr_helper.py`), after Yao et al. 2025, "Your Efficient RL
Framework Secretly Brings You Off-Policy RL Training" (TIS), and Liu, Li et al. 2025,
"When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference
Mismatch" (MIS, sequence and geometric levels).

Per-sample functions (one sequence); batch them with `jax.vmap`.
"""

import math
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from ._validation import Hyperparameter, check_choice, is_python_number, wide_float_dtype

ROLLOUT_IS_LEVELS: tuple[str, ...] = ("token", "sequence", "geometric")
"""The `level`s of `importance_weights` (veRL `rollout_is_level`)."""
ROLLOUT_IS_MODES: tuple[str, ...] = ("truncate", "mask")
"""The `mode`s of `importance_weights` (veRL `rollout_is_mode`)."""
RolloutISLevel = Literal["token", "sequence", "geometric"]
RolloutISMode = Literal["truncate", "mask"]

# Bound on every exponent (veRL's SAFETY_BOUND): exp(20) ~ 4.9e8, exp(-20) ~ 2.1e-9.
LOG_WEIGHT_CLAMP = 20.0

MISMATCH_PREFIX = "rollout_corr/"
MISMATCH_EXTREMES: tuple[str, ...] = ("rollout_corr/rollout_is_max", "rollout_corr/rollout_is_min")
"""The keys of `mismatch_metrics` that combine over rows by max / min (the rest are sums)."""


def _check_settings(level: str, mode: str, upper: object, lower: object, prefix: str = "") -> None:
    """Validate `level`, `mode` and the Python-number bounds (JAX scalars are taken as
    given); errors name the argument after `prefix`."""
    check_choice(f"{prefix}level", level, ROLLOUT_IS_LEVELS)
    check_choice(f"{prefix}mode", mode, ROLLOUT_IS_MODES)
    if isinstance(upper, bool) or not (is_python_number(upper) or isinstance(upper, jax.Array)):
        raise ValueError(f"{prefix}upper must be a number >= 1, got {upper!r}")
    if is_python_number(upper) and not (math.isfinite(upper) and upper >= 1.0):
        raise ValueError(f"{prefix}upper must be a finite number >= 1, got {upper!r}")
    if lower is None:
        return
    if mode != "mask":
        raise ValueError(f"{prefix}lower={lower!r} applies to mode='mask' only, not {mode!r}")
    if isinstance(lower, bool) or not (is_python_number(lower) or isinstance(lower, jax.Array)):
        raise ValueError(f"{prefix}lower must be a number in (0, 1] or None, got {lower!r}")
    if is_python_number(lower) and not (0.0 < lower <= 1.0):
        raise ValueError(f"{prefix}lower must be in (0, 1] or None, got {lower!r}")


def importance_weights(
    logp_old: Float[Array, " T"],
    behaviour_logp: Float[Array, " T"],
    mask: Bool[Array, " T"],
    *,
    level: RolloutISLevel = "token",
    mode: RolloutISMode = "truncate",
    upper: Hyperparameter = 2.0,
    lower: Hyperparameter | None = None,
) -> tuple[Float[Array, " T"], Bool[Array, " T"]]:
    r"""Rollout importance weights $w_t$ of one completion and the tokens that `kept` count.

    With $r_t = \log\pi_{\rm old}(y_t) - \log\mu(y_t)$ over the real tokens $t \in M$
    ($\mu$ the behaviour/sampling policy), the log-weight is, by `level`
    (veRL `rollout_is_level`):

    - `"token"`: $\log w_t = r_t$, the per-token ratio $\pi_{\rm old}/\mu$;
    - `"sequence"`: $\log w_t = \sum_{s \in M} r_s$, the sequence ratio (product of the
      token ratios), the same for every token;
    - `"geometric"`: $\log w_t = \frac{1}{|M|}\sum_{s \in M} r_s$, its geometric mean.

    Then $w_t = \exp(\mathrm{clip}(\log w_t, -20, 20))$ (veRL's safety bound) and, by
    `mode` (veRL `rollout_is_mode`):

    - `"truncate"` (TIS, Yao et al. 2025): $w_t \leftarrow \min(w_t, U)$ with $U$ = `upper`;
      every real token is kept;
    - `"mask"` (MIS, rejection; Liu, Li et al. 2025): tokens (`"token"`) or whole
      sequences (`"sequence"`, `"geometric"`) whose ratio lies outside $[L, U]$ are
      rejected: `kept` is false there. The weights stay the true ratios (as veRL's
      `rollout_is_weights`), so a kept token carries $w_t \in [L, U]$. $L$ = `lower`,
      by default $1/U$. The bounds are compared with the unclamped $\log w_t$.

    The policy loss of a token is multiplied by $w_t$, and rejected tokens leave both
    the numerator and the denominator of the aggregation (pass `mask & kept` to
    `aggregate_parts`). The weights are constants: their gradient is stopped.

    **Arguments:**

    - `logp_old`: `[T]` log-probabilities of the trainer's policy at the start of the
      update ($\pi_{\rm old}$; veRL `old_log_probs`).
    - `behaviour_logp`: `[T]` log-probabilities of the policy that sampled the tokens
      ($\mu$; veRL `rollout_log_probs`).
    - `mask`: `[T]` the real completion tokens; other positions are never read (they may
      hold anything, even NaN) and get weight 0.
    - `level`, `mode`: see above (`ROLLOUT_IS_LEVELS`, `ROLLOUT_IS_MODES`).
    - `upper`: $U \geq 1$ (veRL `rollout_is_threshold`; veRL suggests 1.5–5 for tokens,
      2–10 for sequences, about 1.001 for the geometric mean).
    - `lower`: $L \in (0, 1]$ for `mode="mask"` (veRL `rollout_is_threshold_lower`);
      `None` means $1/U$.

    **Returns:** `(weights, kept)`, both `[T]`: the weights (0 outside `mask`, finite for
    any input) and the boolean mask of the tokens that count (`mask` under `"truncate"`).
    """
    _check_settings(level, mode, upper, lower)
    sg = jax.lax.stop_gradient
    dtype = wide_float_dtype(logp_old)  # float32, or float64 for float64 inputs
    zero = jnp.zeros(logp_old.shape, dtype)
    r = jnp.where(mask, sg(logp_old).astype(dtype) - sg(behaviour_logp).astype(dtype), zero)
    if level == "token":
        log_w = r
    else:
        total = jnp.sum(r)
        if level == "geometric":
            total = total / jnp.maximum(jnp.sum(mask), 1).astype(r.dtype)
        log_w = jnp.broadcast_to(total, r.shape)
    w = jnp.exp(jnp.clip(log_w, -LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP))
    up = jnp.asarray(upper, r.dtype)
    if mode == "truncate":
        w, kept = jnp.minimum(w, up), mask
    else:
        low = 1.0 / up if lower is None else jnp.asarray(lower, r.dtype)
        kept = mask & (log_w >= jnp.log(low)) & (log_w <= jnp.log(up))
    return sg(jnp.where(mask, w, zero)), kept


class RolloutCorrection(eqx.Module):
    """Settings of a rollout importance-sampling correction (see `importance_weights`).

    `level` (`ROLLOUT_IS_LEVELS`), `mode` (`ROLLOUT_IS_MODES`), `upper` $\\geq 1$ and,
    for `mode="mask"` only, `lower` in (0, 1] (`None`: `1 / upper`). Validated when
    built (a one-line `ValueError` naming the field, the value and the choices).
    Calling it, `correction(logp_old, behaviour_logp, mask)`, returns
    `importance_weights(...)` with these settings: `(weights, kept)`.
    """

    # Plain `str` (not the Literal types) so that a bad value gets `check_choice`'s error.
    level: str = "token"
    mode: str = "truncate"
    upper: float | int = 2.0
    lower: float | int | None = None

    def __check_init__(self):
        for name in ("upper", "lower"):
            value = getattr(self, name)
            if value is not None and not is_python_number(value):
                raise ValueError(f"RolloutCorrection.{name} must be a Python number, got {value!r}")
        _check_settings(**self._settings(), prefix="RolloutCorrection.")

    def _settings(self) -> dict[str, object]:
        """The settings as keyword arguments of `importance_weights`."""
        return dict(level=self.level, mode=self.mode, upper=self.upper, lower=self.lower)

    def __call__(
        self,
        logp_old: Float[Array, " T"],
        behaviour_logp: Float[Array, " T"],
        mask: Bool[Array, " T"],
    ) -> tuple[Float[Array, " T"], Bool[Array, " T"]]:
        return importance_weights(logp_old, behaviour_logp, mask, **self._settings())


def mismatch_metrics(
    logp_old: Float[Array, " T"],
    behaviour_logp: Float[Array, " T"],
    mask: Bool[Array, " T"],
    *,
    kept: Bool[Array, " T"] | None = None,
) -> dict[str, tuple[Float[Array, ""], Float[Array, ""]]]:
    r"""Training–sampling mismatch of one completion, as pieces that add up over rows.

    Each entry is a pair `(value, count)`; over a batch (rows, micro-batches, devices)
    the metric is $\sum \text{value} / \sum \text{count}$, except the `MISMATCH_EXTREMES`
    (`*_max`, `*_min`), which are the max / min of `value` over the rows with
    `count > 0` (`aggregate_mismatch_metrics` does both). With
    $r_t = \log\pi_{\rm old}(y_t) - \log\mu(y_t)$, $\rho_t = e^{\mathrm{clip}(r_t, \pm 20)}$,
    $n$ real tokens (`mask`), $\bar\ell$ the mean log-probability of a row, the names
    are veRL's (`compute_offpolicy_metrics`, `compute_is_metrics`, with its
    `rollout_corr/` prefix; "training" is $\pi_{\rm old}$, "rollout" is $\mu$), as
    `value / count` per row:

    - `kl`: $\sum_t (-r_t)$ / $n$: the k1 estimate of $\mathrm{KL}(\mu \,\|\, \pi_{\rm old})$
      per token;
    - `k3_kl`: $\sum_t (\rho_t - r_t - 1)$ / $n$: the k3 estimate of the same ($\geq 0$);
    - `rollout_is_mean`: $\sum_t \rho_t$ / $n$: the mean token ratio (veRL's at level
      `token`);
    - `rollout_is_max`, `rollout_is_min`: $\max_t \rho_t$, $\min_t \rho_t$ / 1;
    - `training_ppl`: $e^{-\bar\ell_{\rm old}}$ / 1: mean per-sequence perplexity of
      $\pi_{\rm old}$; `rollout_ppl`: $e^{-\bar\ell_\mu}$ / 1, the same for $\mu$;
    - `ppl_ratio`: $e^{\bar\ell_\mu - \bar\ell_{\rm old}}$ / 1: mean per-sequence ratio of
      the training to the rollout perplexity; `log_ppl_diff`:
      $\bar\ell_\mu - \bar\ell_{\rm old}$ / 1, its logarithm;
    - with `kept`: `rollout_is_masked_fraction`, $\#\{t : \neg\text{kept}_t\}$ / $n$,
      the fraction of tokens rejected, and `rollout_is_seq_masked_fraction`,
      $[\exists t : \neg\text{kept}_t]$ / 1, the fraction of sequences with a rejected
      token.

    Counts are 0 for a row without real tokens (its values are 0 too), so empty rows
    count nowhere (veRL counts them in its sequence means). Every exponent is clamped to
    $[-20, 20]$, so every value is finite for finite inputs at the real tokens, and
    perplexities saturate at $e^{20}$. No gradient flows through the metrics.

    **Arguments:** `logp_old`, `behaviour_logp`, `mask` as in `importance_weights`;
    `kept`: the tokens kept by the correction (the `*_masked_fraction` entries are
    present only when it is given).

    **Returns:** `{name: (value, count)}` of float scalars.
    """
    sg = jax.lax.stop_gradient
    dtype = wide_float_dtype(logp_old)  # float32, or float64 for float64 inputs
    zero = jnp.zeros(logp_old.shape, dtype)
    o = jnp.where(mask, sg(logp_old).astype(dtype), zero)
    b = jnp.where(mask, sg(behaviour_logp).astype(dtype), zero)
    r = o - b
    rho = jnp.where(mask, jnp.exp(jnp.clip(r, -LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP)), zero)
    n = jnp.sum(mask).astype(dtype)
    has = n > 0
    one = has.astype(dtype)
    mean_o = jnp.sum(o) / jnp.maximum(n, 1.0)
    mean_b = jnp.sum(b) / jnp.maximum(n, 1.0)

    def exp_(x):
        return jnp.where(has, jnp.exp(jnp.clip(x, -LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP)), 0.0)

    k3 = jnp.where(mask, jnp.expm1(jnp.clip(r, -LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP)) - r, zero)
    big = jnp.asarray(jnp.finfo(dtype).max, dtype)
    p = MISMATCH_PREFIX
    out = {
        p + "kl": (-jnp.sum(r), n),
        p + "k3_kl": (jnp.sum(k3), n),
        p + "rollout_is_mean": (jnp.sum(rho), n),
        p + "rollout_is_max": (jnp.max(rho), one),
        p + "rollout_is_min": (jnp.where(has, jnp.min(jnp.where(mask, rho, big)), 0.0), one),
        p + "training_ppl": (exp_(-mean_o), one),
        p + "rollout_ppl": (exp_(-mean_b), one),
        p + "ppl_ratio": (exp_(mean_b - mean_o), one),
        p + "log_ppl_diff": (mean_b - mean_o, one),
    }
    if kept is not None:
        rejected = mask & ~kept
        out[p + "rollout_is_masked_fraction"] = (jnp.sum(rejected).astype(dtype), n)
        out[p + "rollout_is_seq_masked_fraction"] = (jnp.any(rejected).astype(dtype), one)
    return out


def aggregate_mismatch_metrics(
    pieces: dict[str, tuple[Float[Array, "*rows"], Float[Array, "*rows"]]],
    *,
    axis_name: str | None = None,
) -> dict[str, Float[Array, ""]]:
    """Combine the per-row pieces of `mismatch_metrics` (e.g. `jax.vmap`-ed over a batch)
    into batch metrics: `sum(value) / sum(count)` (0 when nothing was counted), and
    max / min over the counted rows for `MISMATCH_EXTREMES` (0 when none).

    With `axis_name` (inside `jax.pmap` / `shard_map`), the sums and extremes run over
    every device's rows, so the result equals one device's on the whole batch.

    **Returns:** `{name: scalar}`.
    """
    out = {}
    for name, (value, count) in pieces.items():
        counted = jnp.sum(count)
        if axis_name is not None:
            counted = jax.lax.psum(counted, axis_name)
        if name in MISMATCH_EXTREMES:
            is_max = name.endswith("_max")
            fill = -jnp.inf if is_max else jnp.inf
            v = jnp.where(count > 0, value, fill)
            v = jnp.max(v) if is_max else jnp.min(v)
            if axis_name is not None:
                v = (jax.lax.pmax if is_max else jax.lax.pmin)(v, axis_name)
            out[name] = jnp.where(counted > 0, v, 0.0).astype(value.dtype)
        else:
            total = jnp.sum(value)
            if axis_name is not None:
                total = jax.lax.psum(total, axis_name)
            ok = counted > 0
            out[name] = jnp.where(ok, total / jnp.where(ok, counted, 1.0), 0.0).astype(value.dtype)
    return out
