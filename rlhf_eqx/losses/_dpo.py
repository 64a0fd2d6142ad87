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
from collections.abc import Mapping
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Real

__all__ = [
    "DPOLossType",
    "dpo_loss",
    "dpo_batch_loss",
    "dpo_implicit_rewards",
    "orpo_log_odds",
    "orpo_loss",
    "combine_losses",
    "RunningMean",
    "running_mean_update",
]

DPOLossType = Literal[
    "sigmoid",
    "robust",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "bco_pair",
    "sppo_hard",
    "apo_zero",
    "apo_down",
    "discopop",
    "sigmoid_norm",
    "simpo",
    "orpo",
    "aot",
    "aot_pair",
]

_PAIR_TYPES = (
    "sigmoid",
    "robust",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "bco_pair",
    "sppo_hard",
    "apo_zero",
    "apo_down",
    "discopop",
    "sigmoid_norm",
    "simpo",
    "orpo",
)
_SORTING_TYPES = ("aot", "aot_pair")
# Types whose definition has no reference model.
_REFERENCE_FREE_TYPES = ("simpo", "orpo")
# Types that use length-normalised (per-token average) log-probabilities.
_LENGTH_NORMALISED_TYPES = ("ipo", "sigmoid_norm", "simpo", "orpo")
# Largest average log-probability fed to log(1 - p) in ORPO (keeps it finite at p = 1).
_ORPO_MAX_AVG_LOGP = -1e-7


def _smoothed_sigmoid_loss(z: Array, label_smoothing: float | int) -> Array:
    """`-(1-ε) log σ(z) - ε log σ(-z)` (cDPO, Mitchell 2023)."""
    loss = -jax.nn.log_sigmoid(z)
    if label_smoothing != 0.0:
        loss = loss * (1.0 - label_smoothing) - jax.nn.log_sigmoid(-z) * label_smoothing
    return loss


def _per_token(logp: Array, length: Real[ArrayLike, ""] | None) -> Array:
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


def _validate(
    loss_type: str,
    beta: float | int,
    label_smoothing: float | int,
    ref_missing: bool,
    reference_free: bool,
) -> None:
    if loss_type not in _PAIR_TYPES + _SORTING_TYPES:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}")
    if beta <= 0.0:
        raise ValueError(f"beta must be positive, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if ref_missing and not (reference_free or loss_type in _REFERENCE_FREE_TYPES):
        raise ValueError(
            f"loss_type={loss_type!r} needs reference log-probabilities "
            "(pass them, or reference_free=True)"
        )


def _pair_loss(
    chosen_logp: Array,
    rejected_logp: Array,
    ref_chosen_logp: Array,
    ref_rejected_logp: Array,
    *,
    beta: float | int,
    loss_type: str,
    label_smoothing: float | int,
    chosen_len: Real[ArrayLike, ""] | None,
    rejected_len: Real[ArrayLike, ""] | None,
    bco_delta: Array,
    discopop_tau: float | int,
    simpo_gamma: float | int,
) -> Array:
    if loss_type in _LENGTH_NORMALISED_TYPES:
        chosen_logp = _per_token(chosen_logp, chosen_len)
        rejected_logp = _per_token(rejected_logp, rejected_len)
        ref_chosen_logp = _per_token(ref_chosen_logp, chosen_len)
        ref_rejected_logp = _per_token(ref_rejected_logp, rejected_len)

    h_w = chosen_logp - ref_chosen_logp
    h_l = rejected_logp - ref_rejected_logp
    # TRL computes the logit as (π_w - π_l) - (ref_w - ref_l); same value, same rounding.
    u = (chosen_logp - rejected_logp) - (ref_chosen_logp - ref_rejected_logp)
    eps = label_smoothing

    if loss_type in ("sigmoid", "sigmoid_norm"):
        return _smoothed_sigmoid_loss(beta * u, eps)
    if loss_type == "robust":
        z = beta * u
        return (-jax.nn.log_sigmoid(z) * (1.0 - eps) + jax.nn.log_sigmoid(-z) * eps) / (
            1.0 - 2.0 * eps
        )
    if loss_type == "hinge":
        return jax.nn.relu(1.0 - beta * u)
    if loss_type == "ipo":
        return jnp.square(u - 1.0 / (2.0 * beta))
    if loss_type == "exo_pair":
        e = eps if eps != 0.0 else 1e-3
        z = beta * u
        return jax.nn.sigmoid(z) * (jax.nn.log_sigmoid(z) - math.log(1.0 - e)) + jax.nn.sigmoid(
            -z
        ) * (jax.nn.log_sigmoid(-z) - math.log(e))
    if loss_type == "nca_pair":
        rw = beta * h_w
        rl = beta * h_l
        return (
            -jax.nn.log_sigmoid(rw) - 0.5 * jax.nn.log_sigmoid(-rw) - 0.5 * jax.nn.log_sigmoid(-rl)
        )
    if loss_type == "bco_pair":
        return -jax.nn.log_sigmoid(beta * h_w - bco_delta) - jax.nn.log_sigmoid(
            -(beta * h_l - bco_delta)
        )
    if loss_type == "sppo_hard":
        return jnp.square(h_w - 0.5 / beta) + jnp.square(h_l + 0.5 / beta)
    if loss_type == "apo_zero":
        return (1.0 - jax.nn.sigmoid(beta * h_w)) + jax.nn.sigmoid(beta * h_l)
    if loss_type == "apo_down":
        return jax.nn.sigmoid(beta * h_w) + (1.0 - jax.nn.sigmoid(beta * (h_w - h_l)))
    if loss_type == "discopop":
        z = beta * u
        logistic = -jax.nn.log_sigmoid(z)
        # σ(z/τ)·exp(-z) computed as one exponential so that it stays finite for z ≪ 0.
        exp_part = jnp.exp(-z + jax.nn.log_sigmoid(z / discopop_tau))
        return logistic * jax.nn.sigmoid(-z / discopop_tau) + exp_part
    if loss_type == "simpo":
        z = beta * (chosen_logp - rejected_logp) - simpo_gamma
        return _smoothed_sigmoid_loss(z, eps)
    if loss_type == "orpo":
        return -beta * jax.nn.log_sigmoid(orpo_log_odds(chosen_logp, rejected_logp))
    raise ValueError(f"loss_type={loss_type!r} sorts over the batch: use dpo_batch_loss")


def dpo_loss(
    chosen_logp: Float[ArrayLike, ""],
    rejected_logp: Float[ArrayLike, ""],
    ref_chosen_logp: Float[ArrayLike, ""] | None = None,
    ref_rejected_logp: Float[ArrayLike, ""] | None = None,
    *,
    beta: float | int = 0.1,
    loss_type: DPOLossType = "sigmoid",
    label_smoothing: float | int = 0.0,
    chosen_len: Real[ArrayLike, ""] | None = None,
    rejected_len: Real[ArrayLike, ""] | None = None,
    reference_free: bool = False,
    bco_delta: Float[ArrayLike, ""] = 0.0,
    discopop_tau: float | int = 0.05,
    simpo_gamma: float | int = 0.5,
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
    - `loss_type`: one of the names above.
    - `label_smoothing`: $\varepsilon \in [0, 0.5)$ (`sigmoid`, `sigmoid_norm`, `robust`,
      `exo_pair`, `simpo`, `aot*`).
    - `chosen_len`, `rejected_len`: number of completion tokens (length-normalised types).
    - `reference_free`: treat the reference log-probabilities as 0 (TRL `reference_free`).
    - `bco_delta`: the running mean $\delta$ of the implicit rewards for `bco_pair` (TRL
      keeps it in `RunningMoments`; see `RunningMean` / `running_mean_update`).
    - `discopop_tau`: $\tau$ for `discopop` (TRL default 0.05).
    - `simpo_gamma`: the target margin $\gamma$ for `simpo` (TRL default 0.5).

    **Returns:** the scalar loss of the pair.
    """
    ref_missing = ref_chosen_logp is None or ref_rejected_logp is None
    _validate(loss_type, beta, label_smoothing, ref_missing, reference_free)
    if loss_type in _SORTING_TYPES:
        raise ValueError(f"loss_type={loss_type!r} sorts over the batch: use dpo_batch_loss")
    c = jnp.asarray(chosen_logp)
    r = jnp.asarray(rejected_logp)
    if ref_missing or reference_free or loss_type in _REFERENCE_FREE_TYPES:
        rc = jnp.zeros_like(c)
        rr = jnp.zeros_like(r)
    else:
        rc = jnp.asarray(ref_chosen_logp)
        rr = jnp.asarray(ref_rejected_logp)
    return _pair_loss(
        c,
        r,
        rc,
        rr,
        beta=beta,
        loss_type=loss_type,
        label_smoothing=label_smoothing,
        chosen_len=chosen_len,
        rejected_len=rejected_len,
        bco_delta=jnp.asarray(bco_delta),
        discopop_tau=discopop_tau,
        simpo_gamma=simpo_gamma,
    )


def dpo_batch_loss(
    chosen_logp: Float[Array, " B"],
    rejected_logp: Float[Array, " B"],
    ref_chosen_logp: Float[Array, " B"] | None = None,
    ref_rejected_logp: Float[Array, " B"] | None = None,
    *,
    beta: float | int = 0.1,
    loss_type: DPOLossType = "sigmoid",
    label_smoothing: float | int = 0.0,
    chosen_len: Real[Array, " B"] | None = None,
    rejected_len: Real[Array, " B"] | None = None,
    reference_free: bool = False,
    bco_delta: Float[ArrayLike, ""] = 0.0,
    discopop_tau: float | int = 0.05,
    simpo_gamma: float | int = 0.5,
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
    _validate(loss_type, beta, label_smoothing, ref_missing, reference_free)
    use_ref = not (ref_missing or reference_free or loss_type in _REFERENCE_FREE_TYPES)
    rc = ref_chosen_logp if use_ref else jnp.zeros_like(chosen_logp)
    rr = ref_rejected_logp if use_ref else jnp.zeros_like(rejected_logp)
    if loss_type in _SORTING_TYPES:
        if loss_type == "aot":
            delta = jnp.sort(chosen_logp - rejected_logp) - jnp.sort(rc - rr)
        else:
            delta = jnp.sort(chosen_logp - rc) - jnp.sort(rejected_logp - rr)
        return _smoothed_sigmoid_loss(beta * delta, label_smoothing)

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
    beta: float | int = 0.1,
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
    beta: float | int = 0.1,
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


def combine_losses(
    terms: Mapping[str, Float[Array, "*shape"]], weights: Mapping[str, float | int]
) -> Float[Array, "*shape"]:
    r"""Weighted sum $\sum_k w_k \mathcal{L}_k$ of named loss terms.

    Mirrors TRL's `DPOConfig(loss_type=[...], loss_weights=[...])` and `rpo_alpha`:
    RPO (Pang et al. 2024, "Iterative Reasoning Preference Optimization") is

    ```python
    combine_losses({"dpo": dpo_term, "nll": nll_chosen}, {"dpo": 1.0, "nll": alpha})
    ```

    with `nll_chosen` the chosen completion's token-mean NLL. Every weighted term must be
    present and every term must have a weight (a typo raises instead of silently
    dropping a term).
    """
    if set(terms) != set(weights):
        raise ValueError(
            f"terms {sorted(terms)} and weights {sorted(weights)} must have the same keys"
        )
    if not terms:
        raise ValueError("combine_losses needs at least one term")
    keys = sorted(terms)
    total = terms[keys[0]] * weights[keys[0]]
    for k in keys[1:]:
        total = total + terms[k] * weights[k]
    return total


class RunningMean(eqx.Module):
    """Running mean of every value seen so far (the BCO reward baseline $\\delta$).

    TRL's `RunningMoments` keeps the same mean (it starts with a count of 1e-24).
    """

    mean: Float[Array, ""]
    count: Float[Array, ""]

    def __init__(self, mean: Float[ArrayLike, ""] = 0.0, count: Float[ArrayLike, ""] = 0.0):
        self.mean = jnp.asarray(mean, dtype=jnp.float32)
        self.count = jnp.asarray(count, dtype=jnp.float32)


def running_mean_update(state: RunningMean, values: Float[Array, "*n"]) -> RunningMean:
    r"""Fold a batch into the running mean: $\mu \leftarrow \mu + (\bar x - \mu)\,\frac{n}{N + n}$.

    For BCO (`bco_pair`), TRL updates the mean with the batch's detached implicit rewards
    (chosen and rejected together) *before* computing the loss, then uses it as
    `bco_delta`:

    ```python
    rc, rr = jax.vmap(dpo_implicit_rewards)(c, r, ref_c, ref_r)
    state = running_mean_update(state, jax.lax.stop_gradient(jnp.concatenate([rc, rr])))
    losses = dpo_batch_loss(c, r, ref_c, ref_r, loss_type="bco_pair", bco_delta=state.mean)
    ```
    """
    x = values.astype(jnp.float32)
    n = jnp.asarray(float(x.size), dtype=jnp.float32)
    total = state.count + n
    mean = state.mean + (jnp.mean(x) - state.mean) * (n / total)
    return RunningMean(mean=mean, count=total)
