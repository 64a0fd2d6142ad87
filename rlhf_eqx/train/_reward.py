"""Reward model: Bradley-Terry loss on the scores of chosen vs rejected completions."""

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import PRNGKeyArray, PyTree

from ..data import PackedPreferenceBatch, PreferenceBatch
from ..losses import bradley_terry_loss
from ..models import AbstractBranchScorer
from ._accumulate import _moment_std, vmap_model
from ._builder import step_builder
from ._settings import RewardSettings, StepOptions, settings_from
from ._state import combine
from ._step import LossFn, Step, make_step


def _scores(model, tokens, mask, key, which):
    out = vmap_model(model, tokens, mask, key)
    if not hasattr(out, "shape") or out.shape != tokens.shape[:1]:
        shape = getattr(out, "shape", type(out).__name__)
        raise ValueError(
            f"the reward model must return one scalar per sequence: {type(model).__name__} "
            f"returned {shape} for {which} tokens of shape {tokens.shape} (expected "
            f"{tokens.shape[:1]}); use a scalar-head model such as rlhf_eqx.RewardModel"
        )
    return out.astype(jnp.float32)


def _pair_scores(model, batch, key):
    """Chosen and rejected scores `[P]` and pair weights `[P]` (1 for a real pair)."""
    if isinstance(batch, PackedPreferenceBatch):
        if not isinstance(model, AbstractBranchScorer):
            raise ValueError(
                "a PackedPreferenceBatch needs a reward model that meets "
                f"rlhf_eqx.models.AbstractBranchScorer (e.g. rlhf_eqx.RewardModel); "
                f"{type(model).__name__} does not: use a PreferenceBatch"
            )
        scores = model.branch_scores(
            batch.tokens,
            batch.mask,
            batch.segment_ids,
            batch.branch_ids,
            num_segments=batch.pairs.shape[-1],
            regions=batch.regions,
            key=key,
        ).astype(jnp.float32)
        scores = scores.reshape(-1, 2)
        return scores[:, 0], scores[:, 1], batch.pairs.reshape(-1).astype(jnp.float32)
    # chosen and rejected rows in one pass of the model ([2B, T])
    b = batch.chosen_tokens.shape[0]
    cat = lambda x, y: jnp.concatenate([x, y], axis=0)
    scores = _scores(
        model,
        cat(batch.chosen_tokens, batch.rejected_tokens),
        cat(batch.chosen_mask, batch.rejected_mask),
        key,
        "chosen and rejected",
    )
    return scores[:b], scores[b:], jnp.ones((b,), jnp.float32)


def _pair_margins(batch, margin):
    """The margin of each pair of `batch`: `margin` itself (the settings' scalar, as
    given) when the batch has no per-pair `margins` (a `PackedPreferenceBatch` has
    none), else `margin + batch.margins` (float32 `[B]`)."""
    margins = getattr(batch, "margins", None)
    if margins is None:
        return margin
    return margin + margins.astype(jnp.float32)


def _bradley_terry_sums(rc, rr, w, *, margin, center_coef):
    """The Bradley-Terry loss of scored pairs as `make_step` parts: numerators,
    denominators and metrics, pair `i` weighted by `w[i]` (1 for a real pair, 0 for
    padding, a bootstrap count in an ensemble); `margin` a scalar for every pair or
    one per pair (`[P]`, `_pair_margins`)."""
    per_pair = 0 if getattr(margin, "ndim", 0) == 1 else None
    losses = jax.vmap(
        lambda a, b, m: bradley_terry_loss(a, b, margin=m, center_coef=center_coef),
        in_axes=(0, 0, per_pair),
    )(rc, rr, margin)
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


def reward_loss(settings: RewardSettings | None = None, **shortcuts: Any) -> LossFn:
    r"""The Bradley-Terry loss function for `make_step` on a `PreferenceBatch` or a
    shared-prompt `PackedPreferenceBatch` (needs an `AbstractBranchScorer`):
    $\frac1B\sum_i -\log\sigma(r^w_i - r^l_i - m - m_i) + \lambda_c (r^w_i + r^l_i)^2$,
    with `settings` (a `RewardSettings`, or its fields as keywords). $m_i$ is the pair's
    own margin, `PreferenceBatch.margins` (a preference file's `margin` column, as TRL's
    `RewardTrainer` reads it), added to the settings' `margin` $m$ (default 0, so the
    column alone is TRL's loss); $m_i = 0$ for a batch without `margins`, whose losses
    and gradients are those of the scalar margin alone, bit for bit.
    """
    s = settings_from(RewardSettings, settings, shortcuts, where="reward_loss")
    center_coef, margin = s.center_coef, s.margin

    def loss_fn(
        params: PyTree,
        frozen: PyTree,
        batch: PreferenceBatch | PackedPreferenceBatch,
        key: PRNGKeyArray | None,
    ):
        model = combine(params, frozen)
        rc, rr, w = _pair_scores(model, batch, key)
        m = _pair_margins(batch, margin)
        return _bradley_terry_sums(rc, rr, w, margin=m, center_coef=center_coef)

    return loss_fn


def _reward_std(metrics, grads):
    del grads
    metrics = dict(metrics)
    metrics["rewards/std"] = _moment_std(metrics, "rewards")
    return metrics


@step_builder(RewardSettings)
def make_reward_step(optimizer, settings: RewardSettings, options: StepOptions) -> Step:
    r"""Build the reward-model update (Bradley-Terry pairwise loss).

    $$\mathcal{L}(\phi) = \frac1B\sum_{i}
    -\log\sigma\big(r_\phi(x_i, y^w_i) - r_\phi(x_i, y^l_i) - m - m_i\big)
    + \lambda_c\,(r^w_i + r^l_i)^2$$

    (Ouyang et al. 2022; TRL `RewardTrainer`, `center_rewards_coefficient` = $\lambda_c$),
    via `rlhf_eqx.losses.bradley_terry_loss`. The model is any callable
    `(tokens, mask) -> scalar` (e.g. `RewardModel`), applied to the full chosen and
    rejected sequences; a model that does not return one scalar per sequence (e.g. a
    `Policy`) is refused when the step is first traced. A shared-prompt
    `PackedPreferenceBatch` (`data.pack_preferences`) runs each prompt once and gives the
    same losses and gradients; it needs a model meeting `AbstractBranchScorer`
    (`RewardModel` does). $m_i$: the batch's per-pair `margins` when it has them (added
    to the settings' `margin` $m$; Touvron et al. 2023, TRL's `margin` column), else 0
    (a `PackedPreferenceBatch` carries none).

    **Arguments:** `settings`, a `RewardSettings` (`center_coef`, `margin`);
    `optimizer`, `options` (a `StepOptions`) and `**shortcuts`: see `step_builder`.

    **Returns:** `step(params, opt_state, batch: PreferenceBatch, *, frozen=None, key=None)
    -> (params, opt_state, metrics)`. Metrics: `loss`, `accuracy` (fraction of
    pairs with $r^w > r^l$), `margin` (mean $r^w - r^l$), `rewards/chosen`,
    `rewards/rejected` (means), `rewards/mean`, `rewards/std` (over all $2B$ scores),
    `grad_norm`, `learning_rate`, `nonfinite`, `empty_batch`.

    **Empty batches.** A batch with zero rows raises `ValueError` when the step is
    traced. The completion masks are not used (the whole sequences are scored), so all
    of them false does not empty the batch; a `PackedPreferenceBatch` with no real pair
    slot does (`empty_batch = 1`, the update is skipped; see `make_step`).
    """
    return make_step(
        reward_loss(settings),
        optimizer,
        options,
        metrics_fn=_reward_std,
        batch_type=(PreferenceBatch, PackedPreferenceBatch),
        cache_key=("reward", settings),
    )
