r"""Direct preference optimisation and its relatives (DPO, cDPO, rDPO, IPO, EXO, NCA, BCO,
SPPO, APO, DiscoPOP, AOT, SimPO, ORPO, RPO).

Every loss is written for **one preference pair** of scalar sequence log-probabilities
(the sum of the completion tokens' log-probabilities): `chosen_logp` $= \log\pi_\theta(y_w|x)$,
`rejected_logp` $= \log\pi_\theta(y_l|x)$ and the reference model's `ref_chosen_logp`,
`ref_rejected_logp`. Batch with `jax.vmap`, or use `dpo_batch_loss`, which also covers
the AOT variants that sort over the batch.

Notation used in the docstrings:

- $h_w = \log\pi_\theta(y_w) - \log\pi_{\rm ref}(y_w)$, $h_l$ likewise (chosen / rejected
  log-ratios);
- $u = h_w - h_l$ (the DPO logit); $\beta$ the temperature, $\varepsilon$ the label
  smoothing.

The formulas follow TRL's `DPOTrainer.dpo_loss` branch for branch (`loss_type` names are
TRL's), `CPOTrainer.cpo_loss` (SimPO) and `ORPOTrainer.odds_ratio_loss` (ORPO).
"""

import math
from collections.abc import Callable
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Real

from ._validation import Hyperparameter, check_choice, check_python_number, is_python_number


# Largest average log-probability fed to log(1 - p) in ORPO (keeps it finite at p = 1).
_ORPO_MAX_AVG_LOGP = -1e-7


class _Pair(NamedTuple):
    """Sequence log-probabilities of a pair (scalars, or `[B]` for the batch losses)."""

    chosen: Array
    rejected: Array
    ref_chosen: Array
    ref_rejected: Array

    @property
    def h_w(self) -> Array:
        r"""Chosen log-ratio $h_w = \log\pi_\theta(y_w) - \log\pi_{\rm ref}(y_w)$."""
        return self.chosen - self.ref_chosen

    @property
    def h_l(self) -> Array:
        r"""Rejected log-ratio $h_l$."""
        return self.rejected - self.ref_rejected

    @property
    def u(self) -> Array:
        r"""The DPO logit $u = h_w - h_l$, computed as TRL does (same rounding)."""
        return (self.chosen - self.rejected) - (self.ref_chosen - self.ref_rejected)


class _Hyper(NamedTuple):
    beta: Hyperparameter
    label_smoothing: Hyperparameter
    bco_delta: Array
    discopop_tau: Hyperparameter
    simpo_gamma: Hyperparameter


def _log(x: Hyperparameter) -> Hyperparameter:
    """`log` in double precision for Python numbers, `jnp.log` for arrays."""
    return math.log(x) if is_python_number(x) else jnp.log(x)


def _smoothed_sigmoid_loss(z: Array, label_smoothing: Hyperparameter) -> Array:
    """`-(1-ε) log σ(z) - ε log σ(-z)` (cDPO, Mitchell 2023)."""
    loss = -jax.nn.log_sigmoid(z)
    if is_python_number(label_smoothing) and label_smoothing == 0.0:
        return loss
    return loss * (1.0 - label_smoothing) - jax.nn.log_sigmoid(-z) * label_smoothing


def _per_token(logp: Array, length: Real[ArrayLike, "*B"] | None) -> Array:
    if length is None:
        return logp
    n = jnp.asarray(length).astype(logp.dtype)
    return logp / jnp.maximum(n, 1.0)


def _log1mexp(x: Array) -> Array:
    """`log(1 - exp(x))` for `x < 0`, stable on both sides of `-ln 2`."""
    x = jnp.minimum(x, _ORPO_MAX_AVG_LOGP)
    small = x < -math.log(2.0)
    return jnp.where(
        small,
        jnp.log1p(-jnp.exp(jnp.where(small, x, -1.0))),
        jnp.log(-jnp.expm1(jnp.where(small, -1.0, x))),
    )


# --- one function per loss: (pair, hyperparameters) -> loss ------------------------------


def _sigmoid(p: _Pair, hp: _Hyper) -> Array:
    r"""$-(1-\varepsilon)\log\sigma(\beta u) - \varepsilon\log\sigma(-\beta u)$.

    DPO (Rafailov et al. 2023, eq. 7); with $\varepsilon > 0$ conservative DPO (cDPO,
    Mitchell 2023). `"sigmoid_norm"` is the same on per-token averaged log-probabilities.
    """
    return _smoothed_sigmoid_loss(hp.beta * p.u, hp.label_smoothing)


def _robust(p: _Pair, hp: _Hyper) -> Array:
    r"""$\big[-(1-\varepsilon)\log\sigma(\beta u) + \varepsilon\log\sigma(-\beta u)\big]/(1-2\varepsilon)$.

    Robust DPO (rDPO), Chowdhury et al. 2024, eq. 8.
    """
    eps = hp.label_smoothing
    z = hp.beta * p.u
    return (-jax.nn.log_sigmoid(z) * (1.0 - eps) + jax.nn.log_sigmoid(-z) * eps) / (1.0 - 2.0 * eps)


def _hinge(p: _Pair, hp: _Hyper) -> Array:
    r"""$\max(0, 1 - \beta u)$. SLiC-HF, Zhao et al. 2023, eq. 1."""
    return jax.nn.relu(1.0 - hp.beta * p.u)


def _ipo(p: _Pair, hp: _Hyper) -> Array:
    r"""$(\bar u - \frac{1}{2\beta})^2$ on per-token averages. IPO, Azar et al. 2023, eq. 17."""
    return jnp.square(p.u - 1.0 / (2.0 * hp.beta))


def _exo_pair(p: _Pair, hp: _Hyper) -> Array:
    r"""$\sigma(\beta u)[\log\sigma(\beta u) - \log(1-\varepsilon)]
    + \sigma(-\beta u)[\log\sigma(-\beta u) - \log\varepsilon]$, $\varepsilon$ = 1e-3 when 0.

    EXO, Ji et al. 2024, eq. 16.
    """
    eps = hp.label_smoothing
    if is_python_number(eps):
        e = eps if eps != 0.0 else 1e-3
    else:
        e = jnp.where(eps == 0.0, 1e-3, eps)
    z = hp.beta * p.u
    return jax.nn.sigmoid(z) * (jax.nn.log_sigmoid(z) - _log(1.0 - e)) + jax.nn.sigmoid(-z) * (
        jax.nn.log_sigmoid(-z) - _log(e)
    )


def _nca_pair(p: _Pair, hp: _Hyper) -> Array:
    r"""$-\log\sigma(\beta h_w) - \tfrac12\log\sigma(-\beta h_w) - \tfrac12\log\sigma(-\beta h_l)$.

    NCA, Chen et al. 2024, eq. 11.
    """
    rw = hp.beta * p.h_w
    rl = hp.beta * p.h_l
    return -jax.nn.log_sigmoid(rw) - 0.5 * jax.nn.log_sigmoid(-rw) - 0.5 * jax.nn.log_sigmoid(-rl)


def _bco_pair(p: _Pair, hp: _Hyper) -> Array:
    r"""$-\log\sigma(\beta h_w - \delta) - \log\sigma(-(\beta h_l - \delta))$.

    BCO, Jung et al. 2024, eq. 6 ($\delta$ the running mean of the implicit rewards).
    """
    return -jax.nn.log_sigmoid(hp.beta * p.h_w - hp.bco_delta) - jax.nn.log_sigmoid(
        -(hp.beta * p.h_l - hp.bco_delta)
    )


def _sppo_hard(p: _Pair, hp: _Hyper) -> Array:
    r"""$(h_w - \frac{1}{2\beta})^2 + (h_l + \frac{1}{2\beta})^2$. SPPO, Wu et al. 2024, eq. 4.6."""
    return jnp.square(p.h_w - 0.5 / hp.beta) + jnp.square(p.h_l + 0.5 / hp.beta)


def _apo_zero(p: _Pair, hp: _Hyper) -> Array:
    r"""$1 - \sigma(\beta h_w) + \sigma(\beta h_l)$. APO-zero, D'Oosterlinck et al. 2024, eq. 7."""
    return (1.0 - jax.nn.sigmoid(hp.beta * p.h_w)) + jax.nn.sigmoid(hp.beta * p.h_l)


def _apo_down(p: _Pair, hp: _Hyper) -> Array:
    r"""$\sigma(\beta h_w) + 1 - \sigma(\beta u)$. APO-down, D'Oosterlinck et al. 2024, eq. 8."""
    return jax.nn.sigmoid(hp.beta * p.h_w) + (1.0 - jax.nn.sigmoid(hp.beta * (p.h_w - p.h_l)))


def _discopop(p: _Pair, hp: _Hyper) -> Array:
    r"""$-\log\sigma(\beta u)(1 - \sigma(\beta u/\tau)) + e^{-\beta u}\sigma(\beta u/\tau)$.

    DiscoPOP, Chris Lu et al. 2024, eq. 5. The second term is one exponential,
    $\exp(-\beta u + \log\sigma(\beta u/\tau))$, finite for $\beta u \ll 0$ when $\tau < 1$.
    """
    z = hp.beta * p.u
    tau = hp.discopop_tau
    logistic = -jax.nn.log_sigmoid(z)
    exp_part = jnp.exp(-z + jax.nn.log_sigmoid(z / tau))
    return logistic * jax.nn.sigmoid(-z / tau) + exp_part


def _simpo(p: _Pair, hp: _Hyper) -> Array:
    r"""$-(1-\varepsilon)\log\sigma(z) - \varepsilon\log\sigma(-z)$,
    $z = \beta(\bar\ell_w - \bar\ell_l) - \gamma$ (reference-free).

    SimPO, Meng et al. 2024, eq. 6; TRL `CPOTrainer` `loss_type="simpo"`.
    """
    z = hp.beta * (p.chosen - p.rejected) - hp.simpo_gamma
    return _smoothed_sigmoid_loss(z, hp.label_smoothing)


def _orpo(p: _Pair, hp: _Hyper) -> Array:
    r"""$-\beta\log\sigma(\log\mathrm{OR})$ of per-token averages (reference-free).

    ORPO's odds-ratio term, Hong et al. 2024, eq. 4-6 ($\beta$ is the paper's $\lambda$).
    """
    return -hp.beta * jax.nn.log_sigmoid(orpo_log_odds(p.chosen, p.rejected))


def _aot(p: _Pair, hp: _Hyper) -> Array:
    r"""Smoothed sigmoid of $\beta\,[\mathrm{sort}(\ell_w - \ell_l) - \mathrm{sort}(\ell^{\rm ref}_w - \ell^{\rm ref}_l)]$.

    AOT (paired), Melnyk et al. 2024, eq. 12; needs the batch (`[B]` arrays).
    """
    delta = jnp.sort(p.chosen - p.rejected) - jnp.sort(p.ref_chosen - p.ref_rejected)
    return _smoothed_sigmoid_loss(hp.beta * delta, hp.label_smoothing)


def _aot_pair(p: _Pair, hp: _Hyper) -> Array:
    r"""Smoothed sigmoid of $\beta\,[\mathrm{sort}(h_w) - \mathrm{sort}(h_l)]$.

    AOT (unpaired), Melnyk et al. 2024, eq. 11; needs the batch (`[B]` arrays).
    """
    delta = jnp.sort(p.h_w) - jnp.sort(p.h_l)
    return _smoothed_sigmoid_loss(hp.beta * delta, hp.label_smoothing)


class _LossSpec(NamedTuple):
    fn: Callable[[_Pair, _Hyper], Array]
    length_normalised: bool = False  # per-token averaged log-probabilities
    reference_free: bool = False  # defined without a reference model
    batch: bool = False  # sorts over the batch: only in `dpo_batch_loss`


# The one list of DPO-family losses; names are TRL's `loss_type`s.
_LOSSES: dict[str, _LossSpec] = {
    "sigmoid": _LossSpec(_sigmoid),
    "robust": _LossSpec(_robust),
    "hinge": _LossSpec(_hinge),
    "ipo": _LossSpec(_ipo, length_normalised=True),
    "exo_pair": _LossSpec(_exo_pair),
    "nca_pair": _LossSpec(_nca_pair),
    "bco_pair": _LossSpec(_bco_pair),
    "sppo_hard": _LossSpec(_sppo_hard),
    "apo_zero": _LossSpec(_apo_zero),
    "apo_down": _LossSpec(_apo_down),
    "discopop": _LossSpec(_discopop),
    "sigmoid_norm": _LossSpec(_sigmoid, length_normalised=True),
    "simpo": _LossSpec(_simpo, length_normalised=True, reference_free=True),
    "orpo": _LossSpec(_orpo, length_normalised=True, reference_free=True),
    "aot": _LossSpec(_aot, batch=True),
    "aot_pair": _LossSpec(_aot_pair, batch=True),
}

DPO_LOSS_TYPES: tuple[str, ...] = tuple(_LOSSES)
"""Every `loss_type` of `dpo_loss` / `dpo_batch_loss`, in a fixed order."""
DPO_BATCH_LOSS_TYPES: tuple[str, ...] = tuple(k for k, s in _LOSSES.items() if s.batch)
"""The `loss_type`s that sort over the batch (only `dpo_batch_loss`; no micro-batching)."""
DPO_REFERENCE_FREE_LOSS_TYPES: tuple[str, ...] = tuple(
    k for k, s in _LOSSES.items() if s.reference_free
)
"""The `loss_type`s defined without a reference model."""

DPOLossType = Literal[DPO_LOSS_TYPES]  # type: ignore[valid-type]


def _validate(
    loss_type: str,
    beta: Hyperparameter,
    label_smoothing: Hyperparameter,
    ref_missing: bool,
    reference_free: bool,
) -> _LossSpec:
    check_choice("loss_type", loss_type, DPO_LOSS_TYPES)
    check_python_number("beta", beta, lambda b: b > 0.0, "positive")
    check_python_number(
        "label_smoothing", label_smoothing, lambda e: 0.0 <= e < 0.5, "in [0, 0.5)"
    )
    spec = _LOSSES[loss_type]
    if ref_missing and not (reference_free or spec.reference_free):
        raise ValueError(
            f"loss_type={loss_type!r} needs reference log-probabilities "
            "(pass them, or reference_free=True)"
        )
    return spec


def _make_pair(
    spec: _LossSpec,
    chosen_logp: Float[ArrayLike, "*B"],
    rejected_logp: Float[ArrayLike, "*B"],
    ref_chosen_logp: Float[ArrayLike, "*B"] | None,
    ref_rejected_logp: Float[ArrayLike, "*B"] | None,
    reference_free: bool,
    chosen_len: Real[ArrayLike, "*B"] | None,
    rejected_len: Real[ArrayLike, "*B"] | None,
) -> _Pair:
    c = jnp.asarray(chosen_logp)
    r = jnp.asarray(rejected_logp)
    if ref_chosen_logp is None or ref_rejected_logp is None or reference_free or spec.reference_free:
        rc, rr = jnp.zeros_like(c), jnp.zeros_like(r)
    else:
        rc, rr = jnp.asarray(ref_chosen_logp), jnp.asarray(ref_rejected_logp)
    if spec.length_normalised:
        c, rc = _per_token(c, chosen_len), _per_token(rc, chosen_len)
        r, rr = _per_token(r, rejected_len), _per_token(rr, rejected_len)
    return _Pair(c, r, rc, rr)


def dpo_loss(
    chosen_logp: Float[ArrayLike, ""],
    rejected_logp: Float[ArrayLike, ""],
    ref_chosen_logp: Float[ArrayLike, ""] | None = None,
    ref_rejected_logp: Float[ArrayLike, ""] | None = None,
    *,
    beta: Hyperparameter = 0.1,
    loss_type: DPOLossType = "sigmoid",
    label_smoothing: Hyperparameter = 0.0,
    chosen_len: Real[ArrayLike, ""] | None = None,
    rejected_len: Real[ArrayLike, ""] | None = None,
    reference_free: bool = False,
    bco_delta: Float[ArrayLike, ""] = 0.0,
    discopop_tau: Hyperparameter = 0.05,
    simpo_gamma: Hyperparameter = 0.5,
) -> Float[Array, ""]:
    r"""Loss of one preference pair for the DPO family (TRL `DPOTrainer.dpo_loss`).

    With $h_w, h_l$ the chosen / rejected log-ratios to the reference, $u = h_w - h_l$,
    $\beta$ the temperature and $\varepsilon$ the label smoothing:

    - `"sigmoid"`: $-(1-\varepsilon)\log\sigma(\beta u) - \varepsilon\log\sigma(-\beta u)$.
      DPO, Rafailov et al. 2023; with $\varepsilon > 0$ cDPO (Mitchell 2023).
    - `"robust"`: $\big[-(1-\varepsilon)\log\sigma(\beta u) + \varepsilon\log\sigma(-\beta u)\big]
      / (1-2\varepsilon)$. rDPO, Chowdhury et al. 2024.
    - `"hinge"`: $\max(0, 1 - \beta u)$. SLiC, Zhao et al. 2023.
    - `"ipo"`: $(\bar u - \frac{1}{2\beta})^2$ with $\bar u$ from per-token averages. IPO,
      Azar et al. 2023 (eq. 17).
    - `"exo_pair"`: $\sigma(\beta u)[\log\sigma(\beta u) - \log(1-\varepsilon)]
      + \sigma(-\beta u)[\log\sigma(-\beta u) - \log\varepsilon]$, with $\varepsilon$ = 1e-3
      when 0. EXO, Ji et al. 2024 (eq. 16).
    - `"nca_pair"`: $-\log\sigma(\beta h_w) - \tfrac12\log\sigma(-\beta h_w)
      - \tfrac12\log\sigma(-\beta h_l)$. NCA, Chen et al. 2024.
    - `"bco_pair"`: $-\log\sigma(\beta h_w - \delta) - \log\sigma(-(\beta h_l - \delta))$.
      BCO, Jung et al. 2024.
    - `"sppo_hard"`: $(h_w - \frac{1}{2\beta})^2 + (h_l + \frac{1}{2\beta})^2$. SPPO,
      Wu et al. 2024 (hard labels).
    - `"apo_zero"`: $1 - \sigma(\beta h_w) + \sigma(\beta h_l)$. APO-zero,
      D'Oosterlinck et al. 2024 (eq. 7).
    - `"apo_down"`: $\sigma(\beta h_w) + 1 - \sigma(\beta u)$. APO-down, ibid. (eq. 8).
    - `"discopop"`: $-\log\sigma(\beta u)\,(1 - \sigma(\beta u/\tau))
      + e^{-\beta u}\,\sigma(\beta u/\tau)$. DiscoPOP, Chris Lu et al. 2024 (eq. 5); the
      second term is evaluated as one exponential, finite for $\tau < 1$.
    - `"sigmoid_norm"`: `"sigmoid"` on per-token averaged log-ratios (length-normalised
      DPO).
    - `"simpo"`: $-(1-\varepsilon)\log\sigma(z) - \varepsilon\log\sigma(-z)$ with
      $z = \beta(\bar\ell_w - \bar\ell_l) - \gamma$, reference-free. SimPO, Meng et al.
      2024; TRL `CPOTrainer` `loss_type="simpo"`, `simpo_gamma`.
    - `"orpo"`: $-\beta\log\sigma\big(\log\frac{\mathrm{odds}(\bar\ell_w)}
      {\mathrm{odds}(\bar\ell_l)}\big)$, $\mathrm{odds}(\ell) = \frac{e^\ell}{1-e^\ell}$,
      reference-free: ORPO's odds-ratio term (Hong et al. 2024; TRL `ORPOTrainer`, where
      `beta` is the paper's $\lambda$). See `orpo_loss` for NLL + OR.

    $\bar\ell$ are per-token average log-probabilities: for `ipo`, `sigmoid_norm`, `simpo` and
    `orpo` the sequence log-probabilities (policy and reference) are divided by
    `chosen_len` / `rejected_len`, as TRL does for IPO (`concatenated_forward` averages
    the log-probs), SimPO and ORPO. If the lengths are `None`, the log-probabilities
    passed in are taken to be averages already.

    The batch-sorting variants `"aot"` / `"aot_pair"` (Melnyk et al. 2024) are only
    defined on a batch: use `dpo_batch_loss`. Other options of TRL (`rpo_alpha`,
    multiple `loss_type`s with `loss_weights`) are expressed with `combine_losses`.

    **Arguments:**

    - `chosen_logp`, `rejected_logp`: policy sequence log-probabilities (scalars).
    - `ref_chosen_logp`, `ref_rejected_logp`: reference sequence log-probabilities; may
      be `None` for `simpo` / `orpo` or with `reference_free=True`.
    - `beta`: $\beta > 0$ (for `ipo` the regulariser $\tau$; for `orpo` the weight $\lambda$).
    - `loss_type`: one of the names above (`DPO_LOSS_TYPES`).
    - `label_smoothing`: $\varepsilon \in [0, 0.5)$ (`sigmoid`, `sigmoid_norm`, `robust`,
      `exo_pair`, `simpo`, `aot*`).
    - `chosen_len`, `rejected_len`: number of completion tokens (length-normalised types).
    - `reference_free`: treat the reference log-probabilities as 0 (TRL `reference_free`).
    - `bco_delta`: the running mean $\delta$ of the implicit rewards for `bco_pair` (TRL
      keeps it in `RunningMoments`; see `RunningMean` / `running_mean_update`).
    - `discopop_tau`: $\tau$ for `discopop` (TRL default 0.05).
    - `simpo_gamma`: the target margin $\gamma$ for `simpo` (TRL default 0.5).

    Hyperparameters (`beta`, `label_smoothing`, `bco_delta`, `discopop_tau`,
    `simpo_gamma`) may be JAX scalars, traced under `jax.jit` or `jax.vmap` (a sweep over
    β is `jax.vmap(lambda b: dpo_loss(..., beta=b))(betas)`); only Python numbers are
    range-checked.

    **Returns:** the scalar loss of the pair.
    """
    ref_missing = ref_chosen_logp is None or ref_rejected_logp is None
    spec = _validate(loss_type, beta, label_smoothing, ref_missing, reference_free)
    if spec.batch:
        raise ValueError(f"loss_type={loss_type!r} sorts over the batch: use dpo_batch_loss")
    pair = _make_pair(
        spec,
        chosen_logp,
        rejected_logp,
        ref_chosen_logp,
        ref_rejected_logp,
        reference_free,
        chosen_len,
        rejected_len,
    )
    hp = _Hyper(beta, label_smoothing, jnp.asarray(bco_delta), discopop_tau, simpo_gamma)
    return spec.fn(pair, hp)


def dpo_batch_loss(
    chosen_logp: Float[Array, " B"],
    rejected_logp: Float[Array, " B"],
    ref_chosen_logp: Float[Array, " B"] | None = None,
    ref_rejected_logp: Float[Array, " B"] | None = None,
    *,
    beta: Hyperparameter = 0.1,
    loss_type: DPOLossType = "sigmoid",
    label_smoothing: Hyperparameter = 0.0,
    chosen_len: Real[Array, " B"] | None = None,
    rejected_len: Real[Array, " B"] | None = None,
    reference_free: bool = False,
    bco_delta: Float[ArrayLike, ""] = 0.0,
    discopop_tau: Hyperparameter = 0.05,
    simpo_gamma: Hyperparameter = 0.5,
) -> Float[Array, " B"]:
    r"""Per-pair losses of a batch, for every `loss_type` including the sorting ones.

    For the per-pair types this is `jax.vmap(dpo_loss)` (see `dpo_loss` for the formulas).
    The AOT losses (Melnyk et al. 2024, "Distributional Preference Alignment of LLMs via
    Optimal Transport"; TRL `loss_type="aot"` / `"aot_pair"`) compare *sorted* batch
    quantities, which is the one-dimensional optimal-transport coupling:

    - `"aot"`: $\delta_{(i)} = \mathrm{sort}(\ell_w - \ell_l)_i
      - \mathrm{sort}(\ell^{\rm ref}_w - \ell^{\rm ref}_l)_i$;
    - `"aot_pair"` (unpaired): $\delta_{(i)} = \mathrm{sort}(h_w)_i - \mathrm{sort}(h_l)_i$;

    then the (label-smoothed) sigmoid loss of $\beta\delta_{(i)}$. The $i$-th output belongs
    to the $i$-th *rank*, not to the $i$-th pair, so the vector is invariant to a joint
    permutation of the batch (its mean is the loss TRL reports).

    **Returns:** `[B]` losses (rank-ordered for the AOT types).
    """
    ref_missing = ref_chosen_logp is None or ref_rejected_logp is None
    spec = _validate(loss_type, beta, label_smoothing, ref_missing, reference_free)
    use_ref = not (ref_missing or reference_free or spec.reference_free)
    rc = ref_chosen_logp if use_ref else jnp.zeros_like(chosen_logp)
    rr = ref_rejected_logp if use_ref else jnp.zeros_like(rejected_logp)
    if spec.batch:
        hp = _Hyper(beta, label_smoothing, jnp.asarray(bco_delta), discopop_tau, simpo_gamma)
        return spec.fn(_Pair(chosen_logp, rejected_logp, rc, rr), hp)

    def one(c, r, rc_, rr_, cl, rl):
        return dpo_loss(
            c,
            r,
            rc_,
            rr_,
            beta=beta,
            loss_type=loss_type,
            label_smoothing=label_smoothing,
            chosen_len=cl,
            rejected_len=rl,
            reference_free=False,
            bco_delta=bco_delta,
            discopop_tau=discopop_tau,
            simpo_gamma=simpo_gamma,
        )

    return jax.vmap(one)(chosen_logp, rejected_logp, rc, rr, chosen_len, rejected_len)


def dpo_implicit_rewards(
    chosen_logp: Float[ArrayLike, ""],
    rejected_logp: Float[ArrayLike, ""],
    ref_chosen_logp: Float[ArrayLike, ""] | None = None,
    ref_rejected_logp: Float[ArrayLike, ""] | None = None,
    *,
    beta: Hyperparameter = 0.1,
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    r"""DPO's implicit rewards $\beta(\log\pi_\theta(y) - \log\pi_{\rm ref}(y))$ of a pair.

    The quantities TRL logs as `rewards/chosen` and `rewards/rejected` (their difference is
    `rewards/margins`, its sign `rewards/accuracies`). Missing reference log-probabilities
    count as 0. They are metrics: wrap in `jax.lax.stop_gradient` if used in a loss.

    **Returns:** `(chosen_reward, rejected_reward)`.
    """
    c = jnp.asarray(chosen_logp)
    r = jnp.asarray(rejected_logp)
    rc = jnp.zeros_like(c) if ref_chosen_logp is None else jnp.asarray(ref_chosen_logp)
    rr = jnp.zeros_like(r) if ref_rejected_logp is None else jnp.asarray(ref_rejected_logp)
    return beta * (c - rc), beta * (r - rr)


def orpo_log_odds(
    chosen_avg_logp: Float[ArrayLike, ""], rejected_avg_logp: Float[ArrayLike, ""]
) -> Float[Array, ""]:
    r"""ORPO's log odds ratio $\log\frac{\mathrm{odds}(y_w)}{\mathrm{odds}(y_l)}$ of averages.

    $$\bar\ell_w - \bar\ell_l - \big(\log(1 - e^{\bar\ell_w}) - \log(1 - e^{\bar\ell_l})\big)$$

    (Hong et al. 2024, eq. 4-6; TRL `ORPOTrainer.odds_ratio_loss`). $\log(1-e^x)$ is
    evaluated stably; averages above -1e-7 are clamped there so that it stays finite.
    """
    lw = jnp.asarray(chosen_avg_logp)
    ll = jnp.asarray(rejected_avg_logp)
    return (lw - ll) - (_log1mexp(lw) - _log1mexp(ll))


def orpo_loss(
    chosen_logp: Float[ArrayLike, ""],
    rejected_logp: Float[ArrayLike, ""],
    *,
    chosen_len: Real[ArrayLike, ""],
    rejected_len: Real[ArrayLike, ""],
    beta: Hyperparameter = 0.1,
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    r"""ORPO (Hong et al. 2024): supervised NLL of the chosen completion plus $\lambda$ times
    the odds-ratio loss, for one pair.

    $$\mathcal{L} = \underbrace{-\bar\ell_w}_{\rm nll}
      \;\underbrace{-\,\lambda\log\sigma(\log\mathrm{OR})}_{\rm or}$$

    with $\bar\ell = \ell / |y|$ the per-token average log-probabilities and
    $\log\mathrm{OR}$ from `orpo_log_odds`. `beta` is $\lambda$ (TRL `ORPOConfig.beta`).
    The NLL here is the pair's token mean; TRL's is the token mean over the whole batch,
    which `aggregate(sft_nll(...), mode="token-mean")` reproduces if needed.

    **Returns:** `(loss, parts)` with `parts` holding `"nll"`, `"or_loss"` (the
    $\lambda$-weighted term), `"log_odds"` and `"ratio"` ($\log\sigma(\log\mathrm{OR})$).
    """
    c = jnp.asarray(chosen_logp)
    r = jnp.asarray(rejected_logp)
    lw = _per_token(c, chosen_len)
    ll = _per_token(r, rejected_len)
    log_odds = orpo_log_odds(lw, ll)
    ratio = jax.nn.log_sigmoid(log_odds)
    nll = -lw
    or_loss = -beta * ratio
    parts = {"nll": nll, "or_loss": or_loss, "log_odds": log_odds, "ratio": ratio}
    return nll + or_loss, parts
