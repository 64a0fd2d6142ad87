"""Running statistics kept across steps (the BCO reward baseline)."""

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float


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
    `bco_delta`. It folds in their *mean*, one value per batch (`RunningMoments.update`
    of `torch.cat(...).mean()`), so every batch weighs the same; folding in the values
    themselves, as below, weighs batches by their size, the same mean when batches are
    of equal size (pass `jnp.mean(rewards)[None]` for TRL's weighting of uneven ones):

    ```python
    rc, rr = jax.vmap(dpo_implicit_rewards)(c, r, ref_c, ref_r)
    state = running_mean_update(state, jax.lax.stop_gradient(jnp.concatenate([rc, rr])))
    losses = dpo_batch_loss(c, r, ref_c, ref_r, loss_type="bco_pair", bco_delta=state.mean)
    ```

    An empty batch (`values.size == 0`) leaves the state as it is.
    """
    if values.size == 0:  # the mean of nothing is NaN, and NaN * 0 would stick
        return state
    x = values.astype(jnp.float32)
    n = jnp.asarray(float(x.size), dtype=jnp.float32)
    total = state.count + n
    mean = state.mean + (jnp.mean(x) - state.mean) * (n / total)
    return RunningMean(mean=mean, count=total)
