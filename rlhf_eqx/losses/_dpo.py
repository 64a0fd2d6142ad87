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

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Real

from ._dpo_losses import (
    DPOLossFn,
    DPOLossType,
    LogpPair,
    LossHyperparameters,
    LossSpec,
)
from ._dpo_registry import call_custom_loss, resolve_dpo_loss
from ._orpo import per_token_logp
from ._validation import Hyperparameter, check_positive, check_python_number
from .defaults import (
    BCO_DELTA,
    DISCOPOP_TAU,
    DPO_BETA,
    DPO_LABEL_SMOOTHING,
    DPO_LOSS_TYPE,
    SIMPO_GAMMA,
)


def _validate(
    loss_type: str | DPOLossFn,
    beta: Hyperparameter,
    label_smoothing: Hyperparameter,
    ref_missing: bool,
    reference_free: bool,
    loss_kwargs: dict[str, Any],
) -> LossSpec:
    spec = resolve_dpo_loss(loss_type, loss_kwargs=loss_kwargs, label_smoothing=label_smoothing)
    check_positive("beta", beta)
    check_python_number("label_smoothing", label_smoothing, lambda e: 0.0 <= e < 0.5, "in [0, 0.5)")
    if ref_missing and not (reference_free or spec.reference_free):
        raise ValueError(
            f"loss_type={loss_type!r} needs reference log-probabilities "
            "(pass them, or reference_free=True)"
        )
    return spec


def _make_pair(
    spec: LossSpec,
    chosen_logp: Float[ArrayLike, "*B"],
    rejected_logp: Float[ArrayLike, "*B"],
    ref_chosen_logp: Float[ArrayLike, "*B"] | None,
    ref_rejected_logp: Float[ArrayLike, "*B"] | None,
    reference_free: bool,
    chosen_len: Real[ArrayLike, "*B"] | None,
    rejected_len: Real[ArrayLike, "*B"] | None,
) -> LogpPair:
    c = jnp.asarray(chosen_logp)
    r = jnp.asarray(rejected_logp)
    if (
        ref_chosen_logp is None
        or ref_rejected_logp is None
        or reference_free
        or spec.reference_free
    ):
        rc, rr = jnp.zeros_like(c), jnp.zeros_like(r)
    else:
        rc, rr = jnp.asarray(ref_chosen_logp), jnp.asarray(ref_rejected_logp)
    if spec.length_normalised:
        c, rc = per_token_logp(c, chosen_len), per_token_logp(rc, chosen_len)
        r, rr = per_token_logp(r, rejected_len), per_token_logp(rr, rejected_len)
    return LogpPair(c, r, rc, rr)


def dpo_loss(
    chosen_logp: Float[ArrayLike, ""],
    rejected_logp: Float[ArrayLike, ""],
    ref_chosen_logp: Float[ArrayLike, ""] | None = None,
    ref_rejected_logp: Float[ArrayLike, ""] | None = None,
    *,
    beta: Hyperparameter = DPO_BETA,
    loss_type: DPOLossType | str | DPOLossFn = DPO_LOSS_TYPE,
    label_smoothing: Hyperparameter = DPO_LABEL_SMOOTHING,
    chosen_len: Real[ArrayLike, ""] | None = None,
    rejected_len: Real[ArrayLike, ""] | None = None,
    reference_free: bool = False,
    bco_delta: Float[ArrayLike, ""] = BCO_DELTA,
    discopop_tau: Hyperparameter = DISCOPOP_TAU,
    simpo_gamma: Hyperparameter = SIMPO_GAMMA,
    **loss_kwargs: Any,
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
    - `"exo_pair"`, with $\varepsilon$ = 1e-3 when 0 (EXO, Ji et al. 2024, eq. 16):

        $$\sigma(\beta u)[\log\sigma(\beta u) - \log(1-\varepsilon)]
        + \sigma(-\beta u)[\log\sigma(-\beta u) - \log\varepsilon]$$

    - `"nca_pair"` (NCA, Chen et al. 2024):

        $$-\log\sigma(\beta h_w) - \tfrac12\log\sigma(-\beta h_w)
        - \tfrac12\log\sigma(-\beta h_l)$$

    - `"bco_pair"`: $-\log\sigma(\beta h_w - \delta) - \log\sigma(-(\beta h_l - \delta))$.
      BCO, Jung et al. 2024.
    - `"sppo_hard"`: $(h_w - \frac{1}{2\beta})^2 + (h_l + \frac{1}{2\beta})^2$. SPPO,
      Wu et al. 2024 (hard labels).
    - `"apo_zero"`: $1 - \sigma(\beta h_w) + \sigma(\beta h_l)$. APO-zero,
      D'Oosterlinck et al. 2024 (eq. 7).
    - `"apo_down"`: $\sigma(\beta h_w) + 1 - \sigma(\beta u)$. APO-down, ibid. (eq. 8).
    - `"discopop"` (DiscoPOP, Chris Lu et al. 2024, eq. 5; the second term is evaluated as
      one exponential, finite for $\tau < 1$):

        $$-\log\sigma(\beta u)\,(1 - \sigma(\beta u/\tau))
        + e^{-\beta u}\,\sigma(\beta u/\tau)$$

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

    **Custom losses.** `loss_type` may also be a name added with `register_dpo_loss`, or
    a per-pair loss itself, `fn(chosen_logp, rejected_logp, ref_chosen_logp,
    ref_rejected_logp, *, beta, **loss_kwargs) -> Float[Array, ""]` (see
    `register_dpo_loss`); it receives `beta` and the further keyword arguments given
    here (`loss_kwargs`), which built-in losses refuse.

    **Arguments:**

    - `chosen_logp`, `rejected_logp`: policy sequence log-probabilities (scalars).
    - `ref_chosen_logp`, `ref_rejected_logp`: reference sequence log-probabilities; may
      be `None` for `simpo` / `orpo` or with `reference_free=True`.
    - `beta`: $\beta > 0$ (for `ipo` the regulariser $\tau$; for `orpo` the weight $\lambda$).
    - `loss_type`: one of the names above (`DPO_LOSS_TYPES`), a registered name or a
      custom loss (see above).
    - `label_smoothing`: $\varepsilon \in [0, 0.5)$ (`sigmoid`, `sigmoid_norm`, `robust`,
      `exo_pair`, `simpo`, `aot*`).
    - `chosen_len`, `rejected_len`: number of completion tokens (length-normalised types).
    - `reference_free`: treat the reference log-probabilities as 0 (TRL `reference_free`).
    - `bco_delta`: the running mean $\delta$ of the implicit rewards for `bco_pair` (TRL
      keeps it in `RunningMoments`; see `RunningMean` / `running_mean_update`).
    - `discopop_tau`: $\tau$ for `discopop` (TRL default 0.05).
    - `simpo_gamma`: the target margin $\gamma$ for `simpo` (TRL default 0.5).
    - `**loss_kwargs`: hyperparameters of a custom `loss_type`.

    Hyperparameters (`beta`, `label_smoothing`, `bco_delta`, `discopop_tau`,
    `simpo_gamma`) may be JAX scalars, traced under `jax.jit` or `jax.vmap` (a sweep over
    β is `jax.vmap(lambda b: dpo_loss(..., beta=b))(betas)`); only Python numbers are
    range-checked.

    **Returns:** the scalar loss of the pair.
    """
    ref_missing = ref_chosen_logp is None or ref_rejected_logp is None
    spec = _validate(loss_type, beta, label_smoothing, ref_missing, reference_free, loss_kwargs)
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
    if spec.custom is not None:
        return call_custom_loss(spec, pair, beta, loss_kwargs, chosen_len, rejected_len)
    hp = LossHyperparameters(
        beta, label_smoothing, jnp.asarray(bco_delta), discopop_tau, simpo_gamma
    )
    return spec.fn(pair, hp)


def dpo_batch_loss(
    chosen_logp: Float[Array, " B"],
    rejected_logp: Float[Array, " B"],
    ref_chosen_logp: Float[Array, " B"] | None = None,
    ref_rejected_logp: Float[Array, " B"] | None = None,
    *,
    beta: Hyperparameter = DPO_BETA,
    loss_type: DPOLossType | str | DPOLossFn = DPO_LOSS_TYPE,
    label_smoothing: Hyperparameter = DPO_LABEL_SMOOTHING,
    chosen_len: Real[Array, " B"] | None = None,
    rejected_len: Real[Array, " B"] | None = None,
    reference_free: bool = False,
    bco_delta: Float[ArrayLike, ""] = BCO_DELTA,
    discopop_tau: Hyperparameter = DISCOPOP_TAU,
    simpo_gamma: Hyperparameter = SIMPO_GAMMA,
    **loss_kwargs: Any,
) -> Float[Array, " B"]:
    r"""Per-pair losses of a batch, for every `loss_type` including the sorting ones.

    For the per-pair types this is `jax.vmap(dpo_loss)` (see `dpo_loss` for the formulas),
    custom losses (a registered name or a callable, with their `**loss_kwargs`) included.
    The AOT losses (Melnyk et al. 2024, "Distributional Preference Alignment of LLMs via
    Optimal Transport"; TRL `loss_type="aot"` / `"aot_pair"`) compare *sorted* batch
    quantities, which is the one-dimensional optimal-transport coupling:

    - `"aot"`:

        $$\delta_{(i)} = \mathrm{sort}(\ell_w - \ell_l)_i
        - \mathrm{sort}(\ell^{\rm ref}_w - \ell^{\rm ref}_l)_i;$$

    - `"aot_pair"` (unpaired): $\delta_{(i)} = \mathrm{sort}(h_w)_i - \mathrm{sort}(h_l)_i$;

    then the (label-smoothed) sigmoid loss of $\beta\delta_{(i)}$. The $i$-th output belongs
    to the $i$-th *rank*, not to the $i$-th pair, so the vector is invariant to a joint
    permutation of the batch (its mean is the loss TRL reports).

    **Returns:** `[B]` losses (rank-ordered for the AOT types).
    """
    ref_missing = ref_chosen_logp is None or ref_rejected_logp is None
    spec = _validate(loss_type, beta, label_smoothing, ref_missing, reference_free, loss_kwargs)
    use_ref = not (ref_missing or reference_free or spec.reference_free)
    rc = ref_chosen_logp if use_ref else jnp.zeros_like(chosen_logp)
    rr = ref_rejected_logp if use_ref else jnp.zeros_like(rejected_logp)
    if spec.batch:
        hp = LossHyperparameters(
            beta, label_smoothing, jnp.asarray(bco_delta), discopop_tau, simpo_gamma
        )
        return spec.fn(LogpPair(chosen_logp, rejected_logp, rc, rr), hp)

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
            **loss_kwargs,
        )

    return jax.vmap(one)(chosen_logp, rejected_logp, rc, rr, chosen_len, rejected_len)


def dpo_implicit_rewards(
    chosen_logp: Float[ArrayLike, ""],
    rejected_logp: Float[ArrayLike, ""],
    ref_chosen_logp: Float[ArrayLike, ""] | None = None,
    ref_rejected_logp: Float[ArrayLike, ""] | None = None,
    *,
    beta: Hyperparameter = DPO_BETA,
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
