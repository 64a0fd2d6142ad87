r"""The training step of a reward-model `Ensemble`: every member's Bradley-Terry update in
one vmapped step, on the same pairs or on per-member bootstrap resamples
(`BootstrapBatch`, `bootstrap_weights`)."""

import dataclasses
import functools
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, PRNGKeyArray

from ..data import BootstrapBatch, PackedPreferenceBatch, PreferenceBatch
from ..losses import bradley_terry_loss
from ._ensemble import Ensemble, _merge
from ._reward import _pair_scores, _reward_std
from ._settings import RewardSettings, StepOptions, split_shortcuts
from ._state import combine
from ._step import LossFn, Step, make_step
from ._validation import check_choice, check_positive_int

BOOTSTRAP_METHODS = ("resample", "poisson")


def bootstrap_weights(
    key: PRNGKeyArray,
    num_pairs: int,
    members: int,
    *,
    method: Literal["resample", "poisson"] = "resample",
) -> Float[Array, "N K"]:
    r"""Per-member bootstrap weights of a batch of `num_pairs` pairs: `[num_pairs, members]`.

    - `"resample"`: member $k$ draws `num_pairs` pairs with replacement; $w_{ik}$ counts
      how often pair $i$ was drawn (the classical bootstrap; every column sums to
      `num_pairs`).
    - `"poisson"`: $w_{ik} \sim \mathrm{Poisson}(1)$ independently (the online
      bootstrap of Oza & Russell 2001, which does not tie the pairs of a batch together;
      under data parallelism each device may draw its own).

    Members trained on different resamples disagree where the data are thin, which is
    what the ensemble's spread is meant to measure (Lakshminarayanan et al. 2017 find
    random initialisation alone often enough; Coste et al. 2024 use different seeds).
    """
    check_positive_int("num_pairs", num_pairs)
    check_positive_int("members", members)
    check_choice("method", method, BOOTSTRAP_METHODS)
    return _bootstrap_weights(key, num_pairs, members, method)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _bootstrap_weights(key, num_pairs: int, members: int, method: str):
    if method == "poisson":
        return jax.random.poisson(key, 1.0, (num_pairs, members)).astype(jnp.float32)
    draws = jax.random.randint(key, (members, num_pairs), 0, num_pairs)
    counts = jax.vmap(lambda d: jnp.zeros((num_pairs,), jnp.float32).at[d].add(1.0))(draws)
    return counts.T


def _member_reward_loss(settings: RewardSettings) -> LossFn:
    """The Bradley-Terry loss of one member on `(pairs, weights)` (`weights` `None`: all 1)."""
    center_coef, margin = settings.center_coef, settings.margin

    def loss_fn(params, frozen, batch, key):
        pairs, weights = batch
        model = combine(params, frozen)
        rc, rr, w = _pair_scores(model, pairs, key)
        if weights is not None:
            w = w * weights.reshape(-1).astype(jnp.float32)
        losses = jax.vmap(
            lambda a, b: bradley_terry_loss(a, b, margin=margin, center_coef=center_coef)
        )(rc, rr)
        real = w > 0
        wsum = lambda x: jnp.sum(jnp.where(real, w * x, 0.0))
        n = jnp.sum(w)
        metrics = {
            "accuracy": (wsum((rc > rr).astype(jnp.float32)), n),
            "margin": (wsum(rc - rr), n),
            "rewards/chosen": (wsum(rc), n),
            "rewards/rejected": (wsum(rr), n),
            "rewards/mean": (wsum(rc) + wsum(rr), 2 * n),
            "rewards/_sq": (wsum(jnp.square(rc)) + wsum(jnp.square(rr)), 2 * n),
        }
        return {"bt": wsum(losses)}, {"bt": n}, metrics

    return loss_fn


_MEAN_METRICS = (
    "accuracy",
    "margin",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/mean",
    "rewards/std",
)


def _ensemble_metrics(per_member: dict[str, Array], members: int) -> dict[str, Array]:
    out = {"loss": jnp.sum(per_member["loss"])}
    for name in _MEAN_METRICS:
        out[name] = jnp.mean(per_member[name])
    out["grad_norm"] = jnp.sqrt(jnp.sum(jnp.square(per_member["grad_norm"])))
    if "learning_rate" in per_member:
        out["learning_rate"] = per_member["learning_rate"][0]
    skipped = per_member["nonfinite"]
    out["nonfinite"] = jnp.max(skipped)
    out["nonfinite/members"] = jnp.sum(skipped)
    if "empty_batch" in per_member:  # members whose (bootstrap) batch held nothing
        empty = per_member["empty_batch"]
        out["empty_batch"] = jnp.min(empty)
        out["empty_batch/members"] = jnp.sum(empty)
    for k in range(members):
        for name in ("loss", "accuracy", "margin", "grad_norm"):
            out[f"member_{k}/{name}"] = per_member[name][k]
    return out


def make_ensemble_reward_step(
    optimizer: optax.GradientTransformation,
    settings: RewardSettings | None = None,
    *,
    members: int,
    options: StepOptions | None = None,
    **shortcuts: Any,
) -> Step:
    r"""Build the update of a reward-model `Ensemble`: every member's Bradley-Terry step at once.

    $$\mathcal L(\phi_1, \dots, \phi_K) = \sum_{k=1}^K \mathcal L_k(\phi_k),\qquad
    \mathcal L_k = \frac{\sum_i w_{ik}\big[-\log\sigma(r_{\phi_k}(x_i, y^w_i) -
    r_{\phi_k}(x_i, y^l_i) - m) + \lambda_c (r^w_{ik} + r^l_{ik})^2\big]}{\sum_i w_{ik}}$$

    with $w_{ik} = 1$ for a `PreferenceBatch` / `PackedPreferenceBatch` (every member
    sees every pair) or the bootstrap weights of a `BootstrapBatch`. The single-model
    update of `make_reward_step` (same micro-batching, device reduction and metrics) is
    `jax.vmap`-ed over the members' parameters and optimiser states, so member $k$
    follows $\nabla_{\phi_k}\mathcal L_k$ with its own optimiser state, gradient
    clipping and non-finite guard (one member's non-finite update skips that member
    only); the step equals `K` separate `make_reward_step` steps. Each member gets its
    own key (`jax.random.split(key, K)`: different LoRA dropout masks).

    **Arguments:** `optimizer`; `settings`, a `RewardSettings` (`center_coef`, `margin`
    as for `make_reward_step`); `members` (`K`, the ensemble's size); `options`, a
    `StepOptions` (`micro_batches`, `axis_name`, `donate`, `nonfinite`,
    `check_token_ids` as for `make_step`); `**shortcuts`, any field of either record as
    a keyword.

    **Returns:** `step(params, opt_state, batch, *, frozen=None, key=None) -> (params,
    opt_state, metrics)`, where `params` / `frozen` are the halves of an `Ensemble`
    (`init_ensemble_state` makes them; `frozen=None`: `params` is the whole ensemble) and
    `opt_state` holds one state per member (`init_ensemble_optimizer`). Metrics: `loss`
    ($\sum_k \mathcal L_k$), the members' means of `accuracy`, `margin`,
    `rewards/chosen`, `rewards/rejected`, `rewards/mean`, `rewards/std`; `grad_norm`
    (the norm of all members' gradients together), `learning_rate`, `nonfinite` (1 when
    any member's update was skipped for a non-finite value), `nonfinite/members` (how
    many), `empty_batch` (1 when no member had a pair to learn from) and
    `empty_batch/members` (members whose bootstrap weights were all 0: their update is
    skipped, as `make_step` skips an empty batch), and `member_<k>/loss`,
    `member_<k>/accuracy`, `member_<k>/margin`, `member_<k>/grad_norm`.
    """
    check_positive_int("members", members)
    settings, options = split_shortcuts(
        RewardSettings, settings, options, shortcuts, where="make_ensemble_reward_step"
    )
    inner = make_step(
        _member_reward_loss(settings),
        optimizer,
        dataclasses.replace(options, donate=False),
        metrics_fn=_reward_std,
    )

    def update(rest, params, opt_state):
        batch, frozen, key = rest
        if not isinstance(params, Ensemble):
            raise TypeError(f"params must be an Ensemble, got {type(params).__name__}")
        if frozen is not None and not isinstance(frozen, Ensemble):
            raise TypeError(f"frozen must be an Ensemble or None, got {type(frozen).__name__}")
        if isinstance(batch, BootstrapBatch):
            pairs, weights = batch.pairs, batch.weights
            if weights.shape[-1] != members:
                raise ValueError(
                    f"BootstrapBatch.weights has {weights.shape[-1]} members; the step was "
                    f"built for members={members}"
                )
        else:
            pairs, weights = batch, None
        size = params.num_members
        if size != members:
            raise ValueError(
                f"the ensemble has {size} members; the step was built for members={members}"
            )
        shared = _merge(params.shared, None if frozen is None else frozen.shared)
        frozen_members = None if frozen is None else frozen.members
        keys = None if key is None else jax.random.split(key, members)

        def one(own, state, own_frozen, w, k):
            return inner(own, state, (pairs, w), frozen=_merge(own_frozen, shared), key=k)

        in_axes = (0, 0, 0, None if weights is None else -1, None if keys is None else 0)
        new_members, new_state, per_member = eqx.filter_vmap(one, in_axes=in_axes)(
            params.members, opt_state, frozen_members, weights, keys
        )
        new_params = dataclasses.replace(params, members=new_members)
        return new_params, new_state, _ensemble_metrics(per_member, members)

    batch_type = (PreferenceBatch, PackedPreferenceBatch, BootstrapBatch)
    return Step(update, donate=options.donate, batch_type=batch_type)
