"""Reward-model step: Bradley-Terry loss on the scores of chosen vs rejected completions."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jaxtyping import PRNGKeyArray, PyTree

from .._batches import PreferenceBatch
from ..losses import bradley_terry_loss
from ._accumulate import accumulate_gradients, apply_optimizer, make_jitted, vmap_model
from ._state import combine

__all__ = ["make_reward_step"]


def make_reward_step(
    optimizer: optax.GradientTransformation,
    *,
    center_coef: float = 0.0,
    micro_batches: int = 1,
    donate: bool = True,
) -> Callable[..., tuple[PyTree, Any, dict]]:
    r"""Build the reward-model update (Bradley-Terry pairwise loss).

    $$\mathcal{L}(\phi) = \frac1B\sum_{i} -\log\sigma\big(r_\phi(x_i, y^w_i) - r_\phi(x_i, y^l_i)\big)
    + \lambda_c\,(r^w_i + r^l_i)^2$$

    (Ouyang et al. 2022; TRL `RewardTrainer`, `center_rewards_coefficient` = $\lambda_c$),
    via `rlhf_eqx.losses.bradley_terry_loss`. The model is any callable
    `(tokens, mask) -> scalar` (e.g. `RewardModel`), applied to the full chosen and
    rejected sequences.

    **Returns:** `step(params, opt_state, batch: PreferenceBatch, *, frozen=None, key=None)
    -> (params, opt_state, metrics)`, one `eqx.filter_jit` region (see `make_sft_step`
    for `params` / `frozen` / `key` / `donate` / `micro_batches`). Metrics: `loss`,
    `accuracy` (fraction of pairs with $r^w > r^l$), `margin` (mean $r^w - r^l$),
    `rewards/chosen`, `rewards/rejected` (means), `rewards/mean`, `rewards/std` (over
    all $2B$ scores), `grad_norm`, `learning_rate`.
    """

    def update(rest, params, opt_state):
        batch, frozen, key = rest
        n_pairs = float(batch.chosen_tokens.shape[0])

        def contribution(p, mb, k):
            model = combine(p, frozen)
            kc, kr = (None, None) if k is None else tuple(jax.random.split(k))
            rc = vmap_model(model, mb.chosen_tokens, mb.chosen_mask, kc).astype(jnp.float32)
            rr = vmap_model(model, mb.rejected_tokens, mb.rejected_mask, kr).astype(jnp.float32)
            losses = jax.vmap(lambda a, b: bradley_terry_loss(a, b, center_coef=center_coef))(rc, rr)
            rows = {"chosen": jax.lax.stop_gradient(rc), "rejected": jax.lax.stop_gradient(rr)}
            return jnp.sum(losses) / n_pairs, ({}, rows)

        loss, grads, _, rows = accumulate_gradients(
            contribution, params, batch, micro_batches=micro_batches, key=key
        )
        params, opt_state, opt_metrics = apply_optimizer(optimizer, params, opt_state, grads)
        rc, rr = rows["chosen"], rows["rejected"]
        both = jnp.concatenate([rc, rr])
        metrics = {
            "loss": loss,
            "accuracy": jnp.mean((rc > rr).astype(jnp.float32)),
            "margin": jnp.mean(rc - rr),
            "rewards/chosen": jnp.mean(rc),
            "rewards/rejected": jnp.mean(rr),
            "rewards/mean": jnp.mean(both),
            "rewards/std": jnp.std(both),
            **opt_metrics,
        }
        return params, opt_state, metrics

    jitted = make_jitted(update, donate=donate)

    def step(
        params: PyTree,
        opt_state: Any,
        batch: PreferenceBatch,
        *,
        frozen: PyTree = None,
        key: PRNGKeyArray | None = None,
    ) -> tuple[PyTree, Any, dict]:
        return jitted((batch, frozen, key), params, opt_state)

    return step
