"""Group-relative advantages of a GRPO batch's rewards (`grpo_advantages`), across devices
with `axis_name`."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ..losses import group_advantages
from ._rl_settings import AdvantageScale
from ._validation import check_positive_int


def grpo_advantages(
    rewards: Float[Array, " B"],
    *,
    group_size: int,
    scale: AdvantageScale = "group",
    eps: float = 1e-4,
    axis_name: str | None = None,
) -> Float[Array, " B"]:
    """Group-relative advantages of a flat batch whose consecutive `group_size` rows share
    a prompt: `group_advantages` on the rewards reshaped to `[B / G, G]`, flattened back.

    With `axis_name` (inside `jax.pmap`), `scale="batch"` divides by the standard
    deviation of the rewards of **every** device, as on one device with the whole batch;
    groups never straddle devices, so the other scales are local.
    """
    check_positive_int("group_size", group_size)
    (B,) = rewards.shape
    if B % group_size != 0:
        where = (
            ""
            if axis_name is None
            else f" (the rows on each device of axis {axis_name!r}: a group of samples of one "
            "prompt lies on one device, so give each device whole groups)"
        )
        raise ValueError(f"batch size {B} is not a multiple of group_size={group_size}{where}")
    grouped = rewards.reshape(B // group_size, group_size)
    if scale != "batch" or axis_name is None:
        return group_advantages(grouped, scale=scale, eps=eps).reshape(B)
    centred = group_advantages(grouped, scale="none").reshape(B)
    n, s = jax.lax.psum((jnp.asarray(B, rewards.dtype), jnp.sum(rewards)), axis_name)
    ss = jax.lax.psum(jnp.sum(jnp.square(rewards - s / n)), axis_name)
    var = ss / jnp.maximum(n - 1, 1)
    positive = (var > 0) & (n > 1)
    std = jnp.where(positive, jnp.sqrt(jnp.where(positive, var, 1.0)), 0.0)
    return centred / (std + eps)
