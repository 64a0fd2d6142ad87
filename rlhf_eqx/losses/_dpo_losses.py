r"""The DPO-family losses, one function per `loss_type`, and their table (a user's own
losses are registered in `_dpo_registry.py`).

Each loss maps a `LogpPair` of sequence log-probabilities (scalars, or `[B]` for the
losses that sort over the batch) and the `LossHyperparameters` to a loss. `DPO_LOSSES`
names them by TRL's `loss_type` and records which are length-normalised,
reference-free or batch-only; `dpo_loss` / `dpo_batch_loss` are the public entry points.
The docstrings use the notation of `_dpo.py` ($h_w$, $h_l$, $u$, $\beta$, $\varepsilon$).
"""

import math
from collections.abc import Callable
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array

from ._orpo import orpo_log_odds
from ._validation import Hyperparameter, is_python_number


class LogpPair(NamedTuple):
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


class LossHyperparameters(NamedTuple):
    """The hyperparameters every loss function receives."""

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


# --- one function per loss: (pair, hyperparameters) -> loss ------------------------------


def _sigmoid(p: LogpPair, hp: LossHyperparameters) -> Array:
    r"""$-(1-\varepsilon)\log\sigma(\beta u) - \varepsilon\log\sigma(-\beta u)$.

    DPO (Rafailov et al. 2023, eq. 7); with $\varepsilon > 0$ conservative DPO (cDPO,
    Mitchell 2023). `"sigmoid_norm"` is the same on per-token averaged log-probabilities.
    """
    return _smoothed_sigmoid_loss(hp.beta * p.u, hp.label_smoothing)


def _robust(p: LogpPair, hp: LossHyperparameters) -> Array:
    r"""$\big[-(1-\varepsilon)\log\sigma(\beta u) +
    \varepsilon\log\sigma(-\beta u)\big]/(1-2\varepsilon)$.

    Robust DPO (rDPO), Chowdhury et al. 2024, eq. 8.
    """
    eps = hp.label_smoothing
    z = hp.beta * p.u
    return (-jax.nn.log_sigmoid(z) * (1.0 - eps) + jax.nn.log_sigmoid(-z) * eps) / (1.0 - 2.0 * eps)


def _hinge(p: LogpPair, hp: LossHyperparameters) -> Array:
    r"""$\max(0, 1 - \beta u)$. SLiC-HF, Zhao et al. 2023, eq. 1."""
    return jax.nn.relu(1.0 - hp.beta * p.u)


def _ipo(p: LogpPair, hp: LossHyperparameters) -> Array:
    r"""$(\bar u - \frac{1}{2\beta})^2$ on per-token averages. IPO, Azar et al. 2023, eq. 17."""
    return jnp.square(p.u - 1.0 / (2.0 * hp.beta))


def _exo_pair(p: LogpPair, hp: LossHyperparameters) -> Array:
    r"""EXO, Ji et al. 2024, eq. 16 ($\varepsilon$ = 1e-3 when 0):

    $$\sigma(\beta u)[\log\sigma(\beta u) - \log(1-\varepsilon)]
    + \sigma(-\beta u)[\log\sigma(-\beta u) - \log\varepsilon]$$
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


def _nca_pair(p: LogpPair, hp: LossHyperparameters) -> Array:
    r"""$-\log\sigma(\beta h_w) - \tfrac12\log\sigma(-\beta h_w) - \tfrac12\log\sigma(-\beta h_l)$.

    NCA, Chen et al. 2024, eq. 11.
    """
    rw = hp.beta * p.h_w
    rl = hp.beta * p.h_l
    return -jax.nn.log_sigmoid(rw) - 0.5 * jax.nn.log_sigmoid(-rw) - 0.5 * jax.nn.log_sigmoid(-rl)


def _bco_pair(p: LogpPair, hp: LossHyperparameters) -> Array:
    r"""$-\log\sigma(\beta h_w - \delta) - \log\sigma(-(\beta h_l - \delta))$.

    BCO, Jung et al. 2024, eq. 6 ($\delta$ the running mean of the implicit rewards).
    """
    return -jax.nn.log_sigmoid(hp.beta * p.h_w - hp.bco_delta) - jax.nn.log_sigmoid(
        -(hp.beta * p.h_l - hp.bco_delta)
    )


def _sppo_hard(p: LogpPair, hp: LossHyperparameters) -> Array:
    r"""$(h_w - \frac{1}{2\beta})^2 + (h_l + \frac{1}{2\beta})^2$. SPPO, Wu et al. 2024, eq. 4.6."""
    return jnp.square(p.h_w - 0.5 / hp.beta) + jnp.square(p.h_l + 0.5 / hp.beta)


def _apo_zero(p: LogpPair, hp: LossHyperparameters) -> Array:
    r"""$1 - \sigma(\beta h_w) + \sigma(\beta h_l)$. APO-zero, D'Oosterlinck et al. 2024, eq. 7."""
    return (1.0 - jax.nn.sigmoid(hp.beta * p.h_w)) + jax.nn.sigmoid(hp.beta * p.h_l)


def _apo_down(p: LogpPair, hp: LossHyperparameters) -> Array:
    r"""$\sigma(\beta h_w) + 1 - \sigma(\beta u)$. APO-down, D'Oosterlinck et al. 2024, eq. 8."""
    return jax.nn.sigmoid(hp.beta * p.h_w) + (1.0 - jax.nn.sigmoid(hp.beta * (p.h_w - p.h_l)))


def _discopop(p: LogpPair, hp: LossHyperparameters) -> Array:
    r"""$-\log\sigma(\beta u)(1 - \sigma(\beta u/\tau)) + e^{-\beta u}\sigma(\beta u/\tau)$.

    DiscoPOP, Chris Lu et al. 2024, eq. 5. The second term is one exponential,
    $\exp(-\beta u + \log\sigma(\beta u/\tau))$, finite for $\beta u \ll 0$ when $\tau < 1$.
    """
    z = hp.beta * p.u
    tau = hp.discopop_tau
    logistic = -jax.nn.log_sigmoid(z)
    exp_part = jnp.exp(-z + jax.nn.log_sigmoid(z / tau))
    return logistic * jax.nn.sigmoid(-z / tau) + exp_part


def _simpo(p: LogpPair, hp: LossHyperparameters) -> Array:
    r"""$-(1-\varepsilon)\log\sigma(z) - \varepsilon\log\sigma(-z)$,
    $z = \beta(\bar\ell_w - \bar\ell_l) - \gamma$ (reference-free).

    SimPO, Meng et al. 2024, eq. 6; TRL `CPOTrainer` `loss_type="simpo"`.
    """
    z = hp.beta * (p.chosen - p.rejected) - hp.simpo_gamma
    return _smoothed_sigmoid_loss(z, hp.label_smoothing)


def _orpo(p: LogpPair, hp: LossHyperparameters) -> Array:
    r"""$-\beta\log\sigma(\log\mathrm{OR})$ of per-token averages (reference-free).

    ORPO's odds-ratio term, Hong et al. 2024, eq. 4-6 ($\beta$ is the paper's $\lambda$).
    """
    return -hp.beta * jax.nn.log_sigmoid(orpo_log_odds(p.chosen, p.rejected))


def _aot(p: LogpPair, hp: LossHyperparameters) -> Array:
    r"""Smoothed sigmoid of $\beta\,[\mathrm{sort}(\ell_w - \ell_l) -
    \mathrm{sort}(\ell^{\rm ref}_w - \ell^{\rm ref}_l)]$.

    AOT (paired), Melnyk et al. 2024, eq. 12; needs the batch (`[B]` arrays).
    """
    delta = jnp.sort(p.chosen - p.rejected) - jnp.sort(p.ref_chosen - p.ref_rejected)
    return _smoothed_sigmoid_loss(hp.beta * delta, hp.label_smoothing)


def _aot_pair(p: LogpPair, hp: LossHyperparameters) -> Array:
    r"""Smoothed sigmoid of $\beta\,[\mathrm{sort}(h_w) - \mathrm{sort}(h_l)]$.

    AOT (unpaired), Melnyk et al. 2024, eq. 11; needs the batch (`[B]` arrays).
    """
    delta = jnp.sort(p.h_w) - jnp.sort(p.h_l)
    return _smoothed_sigmoid_loss(hp.beta * delta, hp.label_smoothing)


DPOLossFn = Callable[..., Array]
"""A user's per-pair DPO-family loss (see `register_dpo_loss`)."""


class LossSpec(NamedTuple):
    """A loss function and the properties `dpo_loss` / `dpo_batch_loss` act on."""

    fn: Callable[[LogpPair, LossHyperparameters], Array] | None
    length_normalised: bool = False  # per-token averaged log-probabilities
    reference_free: bool = False  # defined without a reference model
    batch: bool = False  # sorts over the batch: only in `dpo_batch_loss`
    custom: DPOLossFn | None = None  # a user's loss, called as `DPOLossFn` (then `fn` is None)
    name: str = ""  # how errors name a user's loss
    # the metrics' log-probabilities are per-token averages (TRL's `CPOTrainer` /
    # `ORPOTrainer` log them so; its `DPOTrainer` logs sums for every loss type)
    per_token_metrics: bool = False
    # the hyperparameters besides `beta` the loss reads (`label_smoothing` and the
    # built-in keywords `bco_delta`, `discopop_tau`, `simpo_gamma`); the others it ignores
    reads: tuple[str, ...] = ()


_SMOOTHING = ("label_smoothing",)
# The one list of DPO-family losses; names are TRL's `loss_type`s.
DPO_LOSSES: dict[str, LossSpec] = {
    "sigmoid": LossSpec(_sigmoid, reads=_SMOOTHING),
    "robust": LossSpec(_robust, reads=_SMOOTHING),
    "hinge": LossSpec(_hinge),
    "ipo": LossSpec(_ipo, length_normalised=True),
    "exo_pair": LossSpec(_exo_pair, reads=_SMOOTHING),
    "nca_pair": LossSpec(_nca_pair),
    "bco_pair": LossSpec(_bco_pair, reads=("bco_delta",)),
    "sppo_hard": LossSpec(_sppo_hard),
    "apo_zero": LossSpec(_apo_zero),
    "apo_down": LossSpec(_apo_down),
    "discopop": LossSpec(_discopop, reads=("discopop_tau",)),
    "sigmoid_norm": LossSpec(_sigmoid, length_normalised=True, reads=_SMOOTHING),
    "simpo": LossSpec(
        _simpo,
        length_normalised=True,
        reference_free=True,
        per_token_metrics=True,
        reads=(*_SMOOTHING, "simpo_gamma"),
    ),
    "orpo": LossSpec(_orpo, length_normalised=True, reference_free=True, per_token_metrics=True),
    "aot": LossSpec(_aot, batch=True, reads=_SMOOTHING),
    "aot_pair": LossSpec(_aot_pair, batch=True, reads=_SMOOTHING),
}

DPO_LOSS_TYPES: tuple[str, ...] = tuple(DPO_LOSSES)
"""Every `loss_type` of `dpo_loss` / `dpo_batch_loss`, in a fixed order."""
DPO_BATCH_LOSS_TYPES: tuple[str, ...] = tuple(k for k, s in DPO_LOSSES.items() if s.batch)
"""The `loss_type`s that sort over the batch (only `dpo_batch_loss`; no micro-batching)."""
DPO_REFERENCE_FREE_LOSS_TYPES: tuple[str, ...] = tuple(
    k for k, s in DPO_LOSSES.items() if s.reference_free
)
"""The `loss_type`s defined without a reference model."""

DPOLossType = Literal[DPO_LOSS_TYPES]  # type: ignore[valid-type]
