r"""Reward-model ensembles as batched data: K members stacked in one pytree, one vmapped step.

An `Ensemble` holds the parts in which its $K$ members differ (`members`: every array
leaf stacked along a leading axis of size $K$, as `eqx.filter_vmap(make)(keys)` builds
them, Equinox's ensemble pattern) and the part they share (`shared`: one copy). Member
$k$ is `eqx.combine(members[k], shared)`.

**Memory.** The shared part is stored once, never $K$ times: for $K$ scalar heads on a
frozen `RewardModel` backbone the members hold $K (D + 1)$ floats; for $K$ LoRA
adapters on a frozen base they hold $K$ times the adapters (`count_params(model,
lora_filter(model, head=False))`), and the base weights are the very arrays of the model the
ensemble was built from. Optimiser state is per member, so it is $K$ times the
trainable part only. Activations: `jax.vmap` batches only what depends on the members,
so $K$ heads on a frozen backbone run the backbone **once** per step (and per scoring
call) and only the heads $K$ times; $K$ LoRA adapters change every layer, so their
forward (and backward) passes run $K$ times, as $K$ separate models would.

**Training.** `make_ensemble_reward_step` trains every member on the same batch (or on
its own bootstrap resample, `BootstrapBatch` with `bootstrap_weights`) in one jitted step:
the single-model reward update is `jax.vmap`-ed over the stacked members and their
optimiser states. The objective is $\sum_k \mathcal L_k$, the sum of the members'
Bradley-Terry losses, so member $k$ follows $\nabla \mathcal L_k$ only; its gradient
clipping, learning rate and non-finite guard are its own, and one step of the ensemble
equals $K$ separate `make_reward_step` steps.

**Scoring.** `ensemble_scores` gives every member's score and the conservative
combination $\bar r - \lambda\,\sigma$ (`rlhf_eqx.losses.conservative_reward`; Coste
et al. 2024).
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Bool, Float, Int, Key, PRNGKeyArray, PyTree, UInt32

from ..data import BootstrapBatch, PackedPreferenceBatch, PreferenceBatch
from ..losses import ENSEMBLE_MODES, EnsembleMode, conservative_reward
from ._builder import step_builder
from ._reward import _bradley_terry_sums, _pair_margins, _pair_scores, _reward_std, _scores
from ._settings import RewardSettings, StepOptions
from ._state import TrainState, combine, partition_trainable
from ._step import LossFn, Step, make_step
from ._validation import check_choice, check_number, check_positive_int


def _is_array(x: object) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _merge(a: PyTree, b: PyTree) -> PyTree:
    """`eqx.combine(a, b)`, where either may be `None` (nothing)."""
    if a is None:
        return b
    if b is None:
        return a
    return eqx.combine(a, b)


def _nothing_like(tree: PyTree) -> PyTree:
    """`tree`'s structure with every leaf `None` (the empty half of an `eqx.partition`)."""
    return eqx.filter(tree, lambda _: False)


class Ensemble(eqx.Module):
    """K models that share a frozen part: `members` stacked along a leading axis, `shared` once.

    - `members`: the parts in which the members differ (e.g. scalar heads or LoRA
      adapters), every array leaf with a leading axis of size `K`; `None` where a leaf
      is shared.
    - `shared`: the rest (e.g. the frozen backbone), one copy; `None` where a leaf is
      per member.

    Both have the structure of one member model, so member `k` is
    `eqx.combine(members[k], shared)` (`member(k)`). Build one with `make_ensemble`.
    """

    members: PyTree
    shared: PyTree

    def __check_init__(self):
        sizes = {
            x.shape[0] if x.ndim else None for x in jax.tree.leaves(self.members) if _is_array(x)
        }
        if None in sizes or len(sizes) > 1:
            raise ValueError(
                "Ensemble.members must stack every array along one leading member axis; "
                f"found leading sizes {sorted(s for s in sizes if s is not None)}"
                + (" and a scalar leaf" if None in sizes else "")
            )

    @property
    def num_members(self) -> int:
        """`K`, the size of the leading member axis."""
        leaves = [x for x in jax.tree.leaves(self.members) if _is_array(x)]
        if not leaves:
            raise ValueError("the ensemble has no per-member arrays")
        return int(leaves[0].shape[0])

    def member(self, k: int) -> PyTree:
        """Member `k` as a plain model (its own arrays, the shared ones)."""
        own = jax.tree.map(lambda x: x[k] if _is_array(x) else x, self.members)
        return _merge(own, self.shared)


def scalar_head_filter(model: PyTree) -> PyTree:
    """Filter spec for `make_ensemble` / `partition_trainable`: `True` on the scalar read-out
    (`head`, `bias`) of a `ValueModel` or `RewardModel`, `False` elsewhere."""
    if not (hasattr(model, "head") and hasattr(model, "bias")):
        raise ValueError(
            f"{type(model).__name__} has no scalar head (`head`, `bias`); use a ValueModel "
            "or RewardModel, or build the filter spec with eqx.tree_at"
        )
    spec = jax.tree.map(lambda _: False, model)
    return eqx.tree_at(lambda m: (m.head, m.bias), spec, (True, True))


def make_ensemble(
    make_member: Callable[[PRNGKeyArray], PyTree],
    keys: Key[Array, " K"] | UInt32[Array, "K 2"],
    *,
    filter_spec: PyTree | Callable[[Any], bool] | None = None,
) -> Ensemble:
    """Stack the members `make_member(keys[k])`, sharing what `filter_spec` leaves out.

    Each member is split with `partition_trainable(member, filter_spec)`; the trainable
    halves are built and stacked in one compiled `eqx.filter_vmap(make_member)(keys)`
    (only they are materialised, `K` times) and the rest is taken once, from
    `make_member(keys[0])`. That rest must not depend on the
    key: the shared backbone has to be closed over by `make_member`, as in

    ```python
    make = lambda k: rx.RewardModel.from_policy(policy, key=k)
    heads = make_ensemble(make, keys, filter_spec=scalar_head_filter(make(keys[0])))
    make = lambda k: rx.apply_lora(reward_model, lora_cfg, key=k)
    adapters = make_ensemble(make, keys, filter_spec=rx.lora_filter(make(keys[0]), head=False))
    ```

    (`K` scalar heads on the policy's backbone; `K` LoRA adapters on a trained reward
    model, its head shared.)

    (`filter_spec=None`: every floating-point array is per member, i.e. `K` independent
    models.) A shared part that differs across keys is an error.

    **Arguments:**

    - `make_member`: `key -> model`.
    - `keys`: `[K]` PRNG keys (e.g. `jax.random.split(key, K)`).
    - `filter_spec`: which leaves are per member, as for `partition_trainable` (a filter
      tree built on one member, or a leaf predicate).

    **Returns:** the `Ensemble`; its `shared` arrays are those of `make_member(keys[0])`
    (for the examples above, the policy's or reward model's own arrays: no copy).
    """
    if keys.shape[0] < 1:
        raise ValueError(f"keys must be a non-empty [K] array of PRNG keys, got shape {keys.shape}")

    def own(k):
        return partition_trainable(make_member(k), filter_spec)[0]

    def rest(k):
        return eqx.filter(partition_trainable(make_member(k), filter_spec)[1], eqx.is_array)

    try:
        eqx.filter_eval_shape(eqx.filter_vmap(rest, out_axes=None), keys)
    except ValueError as e:
        raise ValueError(
            "make_ensemble: the shared (non-trainable) part of the members depends on the "
            "key; close the shared backbone over in make_member (e.g. "
            "RewardModel.from_policy(policy, key=k)) or select the per-member leaves with "
            f"filter_spec ({e})"
        ) from None
    # Compiled, so that whatever `make_member` builds and the members do not keep (e.g. the
    # fresh backbone `RewardModel.from_policy` replaces) is never materialised K times.
    members = eqx.filter_jit(eqx.filter_vmap(own))(keys)
    shared = partition_trainable(make_member(keys[0]), filter_spec)[1]
    return Ensemble(members=members, shared=shared)


def _halves(ensemble: Ensemble) -> tuple[Ensemble, Ensemble]:
    """`(params, frozen)`: the members' arrays and the shared part, as `eqx.partition`
    halves (same structure, `None` leaves), so that `eqx.combine` rebuilds the ensemble."""
    params = Ensemble(members=ensemble.members, shared=_nothing_like(ensemble.shared))
    frozen = Ensemble(members=_nothing_like(ensemble.members), shared=ensemble.shared)
    return params, frozen


def init_ensemble_optimizer(optimizer: optax.GradientTransformation, members: PyTree) -> Any:
    """One optimiser state per member: `eqx.filter_vmap(optimizer.init)(members)`."""
    with jax.numpy_dtype_promotion("standard"):  # Optax is not written for strict promotion.
        return eqx.filter_vmap(optimizer.init)(eqx.filter(members, eqx.is_inexact_array))


def init_ensemble_state(
    ensemble: Ensemble,
    optimizer: optax.GradientTransformation,
    *,
    key: PRNGKeyArray | None = None,
) -> TrainState:
    """A `TrainState` for an ensemble step: the members train, the shared part is frozen.

    `state.params` is `Ensemble(members, <nothing>)` (the members' arrays, copied: the
    state owns them, as `init_train_state` does), `state.frozen` is
    `Ensemble(<nothing>, shared)` (not copied), `state.opt_state` holds one optimiser
    state per member (`init_ensemble_optimizer`) and `state.model` is the ensemble.
    """
    params, frozen = _halves(ensemble)
    members = jax.tree.map(jnp.copy, eqx.filter(params.members, eqx.is_inexact_array))
    params = dataclasses.replace(params, members=members)
    return TrainState(
        params=params,
        frozen=frozen,
        opt_state=init_ensemble_optimizer(optimizer, members),
        step=jnp.zeros((), jnp.int32),
        key=key,
    )


@eqx.filter_jit
def _member_scores(ensemble: Ensemble, tokens, mask):
    def one(own):
        return _scores(_merge(own, ensemble.shared), tokens, mask, None, "scored")

    return eqx.filter_vmap(one)(ensemble.members)


def ensemble_scores(
    ensemble: Ensemble,
    tokens: Int[Array, "B T"],
    mask: Bool[Array, "B T"],
    *,
    penalty: float | Float[Array, ""] = 0.0,
    mode: EnsembleMode = "std",
) -> tuple[Float[Array, " B"], Float[Array, "K B"]]:
    r"""Every member's score of each sequence and their conservative combination (jitted).

    $r_{kb}$ = member $k$'s scalar score of row $b$ (one `jax.vmap` over the members; a
    frozen backbone shared by scalar heads runs once), combined per row by
    `rlhf_eqx.losses.conservative_reward`: by default $\bar r_b - \lambda\,\sigma_b$
    with the members' mean and population standard deviation (Coste et al. 2024).

    **Arguments:** `ensemble` (members meeting the scalar-model protocol, e.g.
    `RewardModel`), `tokens` / `mask` `[B, T]`, `penalty` $\lambda \geq 0$, `mode` (see
    `conservative_reward`: `"std"`, `"var"`, `"min"`, `"mean"`).

    **Returns:** `(scores [B], member_scores [K, B])`, float32.
    """
    check_choice("mode", mode, ENSEMBLE_MODES)
    check_number("penalty", penalty, low=0.0)
    per_member = _member_scores(ensemble, tokens, mask)
    combined = jax.vmap(lambda s: conservative_reward(s, penalty=penalty, mode=mode), in_axes=1)(
        per_member
    )
    return combined, per_member


# --- the training step ----------------------------------------------------------------

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
    """The Bradley-Terry loss of one member on `(pairs, weights)` (`weights` `None`: all 1),
    each pair at its own margin when the batch has them (`_pair_margins`)."""
    center_coef, margin = settings.center_coef, settings.margin

    def loss_fn(params, frozen, batch, key):
        pairs, weights = batch
        model = combine(params, frozen)
        rc, rr, w = _pair_scores(model, pairs, key)
        if weights is not None:
            w = w * weights.reshape(-1).astype(jnp.float32)
        m = _pair_margins(pairs, margin)
        return _bradley_terry_sums(rc, rr, w, margin=m, center_coef=center_coef)

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


@step_builder(RewardSettings)
def make_ensemble_reward_step(
    optimizer,
    settings: RewardSettings,
    options: StepOptions,
    *,
    members: int,
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

    **Arguments:** `settings`, a `RewardSettings` (`center_coef`, `margin` as for
    `make_reward_step`); `members` (`K`, the ensemble's size); `optimizer`, `options` (a
    `StepOptions`) and `**shortcuts`: see `step_builder`.

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
